"""Spark writes to several persist shards, plus stash catalog updates, as ONE transaction.

Usage (the shape is a driver-side context, like a database
transaction in plain Python)::

    from spark.persist_txn import persist_txn

    with persist_txn(spark, stash_url, blob_uri) as txn:
        txn.write(flights_df, "flights", key_columns=["id"], time_column="t")
        txn.write(lines_df, "order_lines")
        txn.upsert("planes", planes_table)        # row upsert into the shard "planes"
        txn.upsert_entries("catalog", {"N123": {...}})  # entries of a stash collection
    # leaving the block commits everything at once (txn.commit()); an exception aborts

:meth:`PersistTxn.write` runs one Spark job over the DataFrame: each task writes its rows
as a batch (the parts go to the blob store from the executors, through the shard's batch
builder, as the ``persist`` data source's writer does) and returns only its batch's
transmittable bytes; the driver collects them and adds them to a
:class:`persist.Txn` (:meth:`persist.Txn.write_batches`).  Nothing is visible until the
commit, which makes every shard's new version and the catalog batches durable in one
stash ``append``.

:func:`prepare_write` writes a DataFrame in ONE Spark job as batches grouped by an
integer chunk column (each task writes one batch per chunk it holds); each chunk's
batches then go into a transaction of their own with :meth:`PersistTxn.write_prepared`,
so that e.g. a load committed month by month costs one Spark job, not one per month.
Chunks no transaction took are deleted when the :class:`PreparedWrite` is left.

Why a context and not a ``txn`` option of ``df.write.format("persist")``: a Python data
source's ``commit`` runs in a Python worker process the JVM starts, not in the driver's
interpreter, so it cannot hand its batches to a transaction object the user's code holds;
``mapInArrow`` plus ``collect`` keeps the batches in the driver.

Invariants kept here: a write that raised added nothing to the transaction (its tasks'
uploaded parts are deleted when the driver got them, else left to GC once the executors'
writer leases run out); an aborted transaction deletes every part it collected; the
executors' writers stay registered (their leases are not released), and the driver
renews their leases while it holds their batches (decoded batches held by a
transaction, and the untaken chunks of a :class:`PreparedWrite`:
:meth:`persist.WriteHandle.hold`), so GC never deletes a part a pending transaction or
an untaken chunk holds, however long it is held.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from spark.persist_common import (
    DIFF,
    TIME,
    PersistSourceError,
    ShardTarget,
    persist_client,
    registered_schemas,
)

__all__ = ["PersistTxn", "PreparedWrite", "persist_txn", "prepare_write"]

log = logging.getLogger(__name__)

_OUT_SCHEMA = "chunk long, batch binary, rows long"


def _build_batches(
    target: ShardTarget,
    key_schema: pa.Schema,
    value_schema: pa.Schema,
    time_column: str | None,
    diff_column: str | None,
    chunk_column: str | None = None,
) -> Any:
    """The ``mapInArrow`` function of :meth:`PersistTxn.write` and :func:`prepare_write`
    (runs on executors): write the partition's rows as one batch per chunk (one batch,
    chunk null, without ``chunk_column``; else one per distinct value of that column)
    and yield each batch's transmittable bytes with its chunk and row count."""

    def fn(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow.compute as pc

        from persist.txn import RAW_TIME
        from stash import Antichain

        schema = pa.schema(
            [
                *key_schema,
                *value_schema,
                pa.field(TIME, pa.int64(), False),
                pa.field(DIFF, pa.int64(), False),
            ]
        )
        # chunk -> [builder, rows, max time]
        open_: dict[int | None, list[Any]] = {}
        out: list[tuple[int | None, bytes, int]] = []
        with (
            persist_client(target) as client,
            client.open_writer(target.shard, key_schema, value_schema) as write,
        ):
            try:
                for rb in batches:
                    if rb.num_rows == 0:
                        continue
                    if chunk_column is None:
                        pieces: list[tuple[int | None, pa.RecordBatch]] = [(None, rb)]
                    else:
                        chunks = rb.column(rb.schema.get_field_index(chunk_column))
                        if chunks.null_count:
                            raise PersistSourceError(f"chunk column {chunk_column!r} has nulls")
                        chunks = chunks.cast(pa.int64())
                        pieces = [
                            (c, rb.filter(pc.equal(chunks, c)))
                            for c in pc.unique(chunks).to_pylist()
                        ]
                    for chunk, piece in pieces:
                        n = piece.num_rows
                        cols: list[Any] = [
                            piece.column(piece.schema.get_field_index(f.name)).cast(f.type)
                            for f in [*key_schema, *value_schema]
                        ]
                        state = open_.get(chunk)
                        if state is None:
                            state = [write.builder(Antichain.from_elem(RAW_TIME)), 0, None]
                            open_[chunk] = state
                        if time_column is None:
                            times = pa.array([RAW_TIME] * n, pa.int64())
                        else:
                            times = piece.column(piece.schema.get_field_index(time_column)).cast(
                                pa.int64()
                            )
                            if times.null_count:
                                raise PersistSourceError(f"time column {time_column!r} has nulls")
                            lo, hi = (v.as_py() for v in pc.min_max(times).values())
                            if lo <= RAW_TIME:
                                raise PersistSourceError(f"time column {time_column!r} holds {lo}")
                            state[2] = hi if state[2] is None else max(state[2], hi)
                        if diff_column is None:
                            diffs = pa.array([1] * n, pa.int64())
                        else:
                            diffs = piece.column(piece.schema.get_field_index(diff_column)).cast(
                                pa.int64()
                            )
                            if diffs.null_count:
                                raise PersistSourceError(f"diff column {diff_column!r} has nulls")
                        state[0].add(pa.Table.from_arrays([*cols, times, diffs], schema=schema))
                        state[1] += n
                while open_:
                    chunk, (builder, rows, max_t) = next(iter(open_.items()))
                    upper = RAW_TIME + 1 if max_t is None else max_t + 1
                    batch = builder.finish(Antichain.from_elem(upper))
                    del open_[chunk]
                    out.append((chunk, batch.into_transmittable(), rows))
            except BaseException:
                for builder, _, _ in open_.values():
                    builder.abort()
                if out:  # finished batches of this task, never handed to the driver
                    for _, payload, _ in out:
                        write.batch_from_transmittable(payload).delete()
                raise
        if out:
            yield pa.RecordBatch.from_pydict(
                {
                    "chunk": [c for c, _, _ in out],
                    "batch": [p for _, p, _ in out],
                    "rows": [r for _, _, r in out],
                },
                schema=pa.schema(
                    [("chunk", pa.int64()), ("batch", pa.binary()), ("rows", pa.int64())]
                ),
            )

    return fn


@dataclass
class PreparedWrite:
    """Batches one Spark job wrote to ``shard`` and no transaction holds yet, grouped by
    chunk (:func:`prepare_write`); :meth:`PersistTxn.write_prepared` adds one chunk's
    batches to a transaction.  Leaving its ``with`` block (or :meth:`discard`) deletes
    the parts of every chunk not taken.

    Attributes:
        shard: the shard written.
        key_schema, value_schema: the shard's schemas the batches were written with.
        chunks: chunk value -> (transmittable batches, rows) of the chunks not taken yet
            (the key ``None`` when the write had no chunk column).
    """

    target: ShardTarget
    key_schema: pa.Schema
    value_schema: pa.Schema
    chunks: dict[int | None, tuple[list[bytes], int]] = field(default_factory=dict)
    #: The client and stash renewing the executors' writer leases (closed on discard).
    _keeper: tuple[Any, Any] | None = field(default=None, repr=False)

    def keep_leases(self, client: Any, stash: Any, lease_keeper: Any = None) -> None:
        """Renew, in the background, the leases of the executors' writers whose parts
        the untaken chunks hold, for as long as any chunk is untaken
        (:meth:`persist.WriteHandle.hold`), so a chunk taken hours later still commits.
        ``client`` (on ``stash``) is this object's from now on: :meth:`discard` closes
        both.  ``lease_keeper``: the :class:`persist.lease.LeaseKeeper` running the
        renewal (the default one unless given: tests pass one with an injected clock)."""
        self._keeper = (client, stash)
        from persist.batch import Batch
        from persist.keys import key_writer_id

        owners = {
            w
            for payloads, _ in self.chunks.values()
            for p in payloads
            for k in Batch.from_transmittable(client.blob, p).blob_keys()
            if (w := key_writer_id(k)) is not None
        }
        if owners:
            handle = client.open_writer(self.shard, self.key_schema, self.value_schema)
            if lease_keeper is not None:
                handle.lease_keeper = lease_keeper
            me = weakref.ref(self)
            handle.hold(self, sorted(owners), lambda: (p := me()) is not None and bool(p.chunks))

    @property
    def shard(self) -> str:
        return self.target.shard

    def take(self, chunk: int | None) -> tuple[list[bytes], int]:
        """Remove and return a chunk's ``(transmittable batches, rows)``; a chunk the
        write had no rows for gives ``([], 0)``."""
        return self.chunks.pop(chunk, ([], 0))

    def discard(self) -> None:
        """Delete the parts of every chunk not taken (best effort: a part that cannot be
        deleted is left to GC once its writer's lease runs out)."""
        keeper, self._keeper = self._keeper, None
        try:
            self._discard_chunks()
        finally:
            if keeper is not None:
                keeper[0].close()
                keeper[1].close()

    def _discard_chunks(self) -> None:
        if not self.chunks:
            return
        chunks, self.chunks = self.chunks, {}
        try:
            with persist_client(self.target) as client:
                handle = client.open_writer(self.shard, self.key_schema, self.value_schema)
                try:
                    for payloads, _ in chunks.values():
                        for p in payloads:
                            handle.batch_from_transmittable(p).delete()
                finally:
                    handle.expire()
        except Exception as e:  # pragma: no cover - leave them to GC
            log.warning("could not delete the untaken batches of shard %s: %s", self.shard, e)

    def __enter__(self) -> PreparedWrite:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()


def _run_write(
    spark: Any,
    stash_url: str,
    blob_uri: str,
    df: Any,
    shard: str,
    *,
    key_columns: Sequence[str] | None,
    value_columns: Sequence[str] | None,
    time_column: str | None,
    diff_column: str | None,
    chunk_column: str | None,
    client: Any,
) -> PreparedWrite:
    """One Spark job writing ``df`` to ``shard`` as batches by chunk (see
    :func:`prepare_write`); ``client`` creates or checks the shard first."""
    from spark.persist_writer import WriteSettings

    opts: dict[str, str] = {"stash": stash_url, "blob": blob_uri, "shard": shard}
    if key_columns is not None:
        opts["key_columns"] = ",".join(key_columns)
    if value_columns is not None:
        opts["value_columns"] = ",".join(value_columns)
    if time_column is not None:
        opts["time_column"] = time_column
    if diff_column is not None:
        opts["diff_column"] = diff_column
    target = ShardTarget(stash_url, blob_uri, shard)
    schema = df.schema
    if chunk_column is not None:
        if chunk_column not in schema.fieldNames():
            raise PersistSourceError(
                f"chunk column {chunk_column!r} is not a column of the DataFrame "
                f"{schema.fieldNames()}"
            )
        dtype = schema[chunk_column].dataType.typeName()
        if dtype not in ("long", "integer", "short", "byte"):
            raise PersistSourceError(
                f"chunk column {chunk_column!r} must be an integer, not {dtype}"
            )
    settings = WriteSettings.from_options(opts, schema, registered_schemas(target))
    # Create (or check) the shard on the driver before the executors write.
    client.open_writer(shard, settings.key_schema, settings.value_schema).expire()
    fn = _build_batches(
        target,
        settings.key_schema,
        settings.value_schema,
        settings.time_column,
        settings.diff_column,
        chunk_column,
    )
    out = df.mapInArrow(fn, _OUT_SCHEMA).collect()
    prepared = PreparedWrite(target, settings.key_schema, settings.value_schema)
    for r in out:
        c = r["chunk"]
        payloads, rows = prepared.chunks.get(c, ([], 0))
        payloads.append(bytes(r["batch"]))
        prepared.chunks[c] = (payloads, rows + int(r["rows"]))
    return prepared


def prepare_write(
    spark: Any,
    stash_url: str,
    blob_uri: str,
    df: Any,
    shard: str,
    *,
    chunk_column: str,
    key_columns: Sequence[str] | None = None,
    value_columns: Sequence[str] | None = None,
    time_column: str | None = None,
    diff_column: str | None = None,
) -> PreparedWrite:
    """Write ``df`` to ``shard`` in ONE Spark job, as batches grouped by the integer
    ``chunk_column``'s values (each task writes one batch per chunk it holds), and add
    none of them to any transaction: :meth:`PersistTxn.write_prepared` then adds one
    chunk's batches to a transaction, so that many transactions (e.g. one per month)
    cost one Spark job instead of one each.  The columns, options and checks are
    :meth:`PersistTxn.write`'s; ``chunk_column`` stays a data column.  Use the result
    as a context manager: leaving it deletes the chunks no transaction took.

    Raises:
        PersistSourceError: the checks of :meth:`PersistTxn.write`; ``chunk_column``
            missing, not an integer, or holding nulls.
    """
    from persist import PersistClient
    from stash import Stash

    s = Stash.open(stash_url, fenced=False)
    client = None
    try:
        client = PersistClient(s, blob_uri, compaction="off")
        prepared = _run_write(
            spark,
            stash_url,
            blob_uri,
            df,
            shard,
            key_columns=key_columns,
            value_columns=value_columns,
            time_column=time_column,
            diff_column=diff_column,
            chunk_column=chunk_column,
            client=client,
        )
        prepared.keep_leases(client, s)
        return prepared
    except BaseException:
        if client is not None:
            client.close()
        s.close()
        raise


def _as_arrow(rows: Any) -> pa.Table | None:
    """``rows`` as an Arrow table: a ``Table`` as is, a ``RecordBatch`` wrapped, a Spark
    DataFrame collected (``toArrow``); ``None`` for anything else."""
    if isinstance(rows, pa.RecordBatch):
        return pa.Table.from_batches([rows])
    if isinstance(rows, pa.Table):
        return rows
    try:
        from pyspark.sql import DataFrame
    except ImportError:  # pragma: no cover - pyspark is a dependency of spark/
        return None
    if isinstance(rows, DataFrame):
        return rows.toArrow()
    return None


class PersistTxn:
    """A driver-side transaction over persist shards and stash collections for Spark
    jobs (see the module docstring).  Made by :func:`persist_txn`.

    Attributes:
        stash: the open :class:`stash.Stash` (for ``collection(...).make_batch``).
        client: the :class:`persist.PersistClient` the transaction commits with.
        txn: the underlying :class:`persist.Txn`.
    """

    def __init__(self, spark: Any, stash_url: str, blob_uri: str) -> None:
        from persist import PersistClient
        from stash import Stash

        self.spark = spark
        self.stash_url = stash_url
        self.blob_uri = blob_uri
        self.stash = Stash.open(stash_url, fenced=False)
        try:
            self.client = PersistClient(self.stash, blob_uri, compaction="off")
        except BaseException:
            self.stash.close()
            raise
        self.txn = self.client.begin()
        self.rows: dict[str, int] = {}
        # collection -> (its TableTransaction, its batch in the transaction, uniqueness):
        # every upsert to one collection goes through one TableTransaction and batch.
        self._upserts: dict[str, tuple[Any, Any, Any]] = {}

    def write(
        self,
        df: Any,
        shard: str,
        *,
        key_columns: Sequence[str] | None = None,
        value_columns: Sequence[str] | None = None,
        time_column: str | None = None,
        diff_column: str | None = None,
    ) -> int:
        """Write ``df`` to ``shard`` as part of the transaction (one Spark job; the
        shard is created if it does not exist, its columns matched by name otherwise,
        as the ``persist`` data source writer does).  Rows take the commit time, or the
        ``time_column``'s times (see :meth:`persist.Txn.write`); ``diff_column`` (or a
        ``_diff`` column) gives diffs, else 1.

        Returns: the number of rows written.

        Raises:
            PersistSourceError: columns or options that do not fit the shard.
            persist.InvalidUsage: see :meth:`persist.Txn.write_batches`.
        """
        prepared = _run_write(
            self.spark,
            self.stash_url,
            self.blob_uri,
            df,
            shard,
            key_columns=key_columns,
            value_columns=value_columns,
            time_column=time_column,
            diff_column=diff_column,
            chunk_column=None,
            client=self.client,
        )
        with prepared:
            return self.write_prepared(prepared, None)

    def write_prepared(self, prepared: PreparedWrite, chunk: int | None) -> int:
        """Add the batches of one chunk of a :func:`prepare_write` to the transaction
        (taken from ``prepared``: a chunk is added once).  Returns its rows (0 for a
        chunk the write had no rows for).

        Raises:
            persist.InvalidUsage: see :meth:`persist.Txn.write_batches` (the chunk's
                parts are then deleted).
        """
        payloads, n = prepared.take(chunk)
        shard = prepared.shard
        handle = self.client.open_writer(shard, prepared.key_schema, prepared.value_schema)
        batches = []
        try:
            for p in payloads:
                batches.append(handle.batch_from_transmittable(p))
            if batches:
                self.txn.write_batches(shard, batches)
        except BaseException:
            for b in batches:
                b.delete()
            raise
        finally:
            handle.expire()  # it only decoded bytes: never registered
        self.rows[shard] = self.rows.get(shard, 0) + n
        return n

    def stash_append(self, batches: Sequence[Any]) -> None:
        """Add stash :class:`~stash.AppendBatch` es of this transaction's stash (see
        :meth:`persist.Txn.stash_append`)."""
        self.txn.stash_append(batches)

    def upsert(self, shard: str, rows: Any, uniqueness: Any = None) -> int:
        """Upsert ``rows`` into the persist shard ``shard`` with the transaction: each
        row replaces every live row with its key (:meth:`persist.Txn.upsert`, planned
        on the version the commit lands on), as ``upsert`` does on
        :class:`persist.Txn` and :class:`persist.WriteHandle`.

        Args:
            shard: an existing shard's name.
            rows: a pyarrow ``Table`` / ``RecordBatch`` with exactly the shard's key and
                value columns, or a Spark DataFrame with them (collected to the driver
                as Arrow: for catalog-sized data; a large DataFrame belongs to the
                executors' row changes of ``spark.PersistTable``).
            uniqueness: only for the deprecated call shape below.

        Returns: the number of rows upserted.

        The old call shape ``upsert(collection, {key: value, ...}[, uniqueness])``
        (a ``Mapping`` of stash catalog entries) still works for one release and warns
        with a ``DeprecationWarning``: use :meth:`upsert_entries`.  The two shapes are
        told apart by the type of the second argument, never guessed.

        Raises:
            persist.InvalidUsage: ``rows`` is neither an Arrow table/batch, a Spark
                DataFrame nor a mapping (naming both call shapes); ``uniqueness`` with
                rows; see :meth:`persist.Txn.upsert`.
        """
        from persist import InvalidUsage

        if isinstance(rows, Mapping):
            warnings.warn(
                "PersistTxn.upsert(collection, {key: value}) for stash catalog entries is "
                "deprecated: use PersistTxn.upsert_entries(collection, items); upsert(shard, "
                "rows) now upserts rows into a persist shard",
                DeprecationWarning,
                stacklevel=2,
            )
            return self.upsert_entries(shard, rows, uniqueness)
        if uniqueness is not None:
            raise InvalidUsage(
                f"upsert into shard {shard!r}: uniqueness is only for stash catalog entries "
                "(upsert_entries)"
            )
        table = _as_arrow(rows)
        if table is None:
            raise InvalidUsage(
                f"upsert into shard {shard!r} takes rows as a pyarrow Table/RecordBatch or a "
                f"Spark DataFrame, not {type(rows).__name__} (catalog entries, a mapping, "
                "go to upsert_entries(collection, items))"
            )
        self.txn.upsert(shard, table)
        return int(table.num_rows)

    def delete(self, shard: str, filter: Any) -> None:
        """Retract every live row of the persist shard ``shard`` that ``filter`` (a
        ``pyarrow.compute`` expression) keeps, with the transaction
        (:meth:`persist.Txn.delete`)."""
        self.txn.delete(shard, filter)

    def update(self, shard: str, filter: Any, set: Mapping[str, Any]) -> None:
        """Re-insert every live row of ``shard`` that ``filter`` keeps with ``set``
        (``{column: scalar | pyarrow.compute expression}``), with the transaction
        (:meth:`persist.Txn.update`)."""
        self.txn.update(shard, filter, set)

    def upsert_entries(
        self, collection: str, items: Mapping[str, Any], uniqueness: Any = None
    ) -> int:
        """Set ``key -> value`` in the JSON stash collection ``collection`` (created if
        needed) with the transaction, through a :class:`stash.TableTransaction` (so
        ``uniqueness`` constraints apply).  Several calls for one collection accumulate
        in one table transaction and one stash batch (a later value of a key replaces
        an earlier one).  Returns the number of pending updates of the collection (0:
        nothing to change, nothing added).  The updates are computed against the
        version the first call read: if another writer appends to the collection after
        that read, :meth:`commit` raises :class:`persist.TxnUpperMismatch` naming the
        collection and commits nothing.

        Raises:
            persist.InvalidUsage: ``items`` is not a mapping; a later call for the
                collection with another ``uniqueness`` than the first.
        """
        from persist import InvalidUsage
        from stash import PeekSinceUpperError, TableTransaction

        if not isinstance(items, Mapping):
            raise InvalidUsage(
                f"upsert_entries to collection {collection!r} takes a mapping of key -> "
                f"value, not {type(items).__name__} (rows go to upsert(shard, rows))"
            )
        coll = self.stash.collection(collection, key="str", value="json")
        known = self._upserts.get(collection)
        fresh = known is None
        if known is None:
            # The batch first, then the read: a commit landing in between fails the
            # batch's lower check, so the changes below are appended to the version they
            # were computed against (Materialize's compare-and-append).
            batch = coll.make_batch(self.stash)
            try:
                initial = self.stash.peek_one(coll)
            except PeekSinceUpperError as e:
                if not e.never_written():  # sealed but unreadable: not "empty"
                    raise
                initial = {}
            tx: TableTransaction[str, Any] = TableTransaction(initial, uniqueness)
        else:
            tx, batch, first = known
            if uniqueness is not None and uniqueness is not first:
                raise InvalidUsage(
                    f"upsert to collection {collection!r}: uniqueness differs from the "
                    "first upsert to it in this transaction"
                )
            uniqueness = first
        tx.set_many(items.items())
        pending = tx.pending()
        if fresh:
            if not pending:
                return 0
            self.txn.stash_append([batch])
        batch.entries.clear()
        for k, v, d in pending:
            coll.append_to_batch(batch, k, v, d)
        self._upserts[collection] = (tx, batch, uniqueness)
        return len(pending)

    def commit(self) -> int:
        """Commit at the smallest valid time (:meth:`persist.Txn.commit`); returns it."""
        return self.txn.commit()

    def commit_at(self, ts: int) -> int:
        """Commit at ``ts`` (:meth:`persist.Txn.commit_at`)."""
        return self.txn.commit_at(ts)

    def abort(self) -> None:
        """Delete every part collected so far (:meth:`persist.Txn.abort`)."""
        self.txn.abort()

    def close(self) -> None:
        """Close the client and the stash (an uncommitted transaction is aborted)."""
        with contextlib.suppress(Exception):
            self.txn.abort()
        try:
            self.client.close()
        finally:
            self.stash.close()

    def __enter__(self) -> PersistTxn:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            if exc_type is None and self.txn.committed_ts is None:
                self.txn.commit()
        finally:
            self.close()


def persist_txn(spark: Any, stash_url: str, blob_uri: str) -> PersistTxn:
    """A :class:`PersistTxn` on the given stores: use it as a context manager (a clean
    exit commits, an exception aborts) or call ``commit``/``abort`` and ``close``."""
    return PersistTxn(spark, stash_url, blob_uri)
