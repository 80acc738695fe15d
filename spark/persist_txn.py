"""Spark writes to several persist shards, plus stash catalog updates, as ONE transaction.

Usage (DESIGN section 5.2; the shape is a driver-side context, like a database
transaction in plain Python)::

    from spark.persist_txn import persist_txn

    with persist_txn(spark, stash_url, blob_uri) as txn:
        txn.write(flights_df, "flights", key_columns=["id"], time_column="t")
        txn.write(lines_df, "order_lines")
        txn.upsert("planes", {"N123": {...}})     # catalog rows (a stash collection)
    # leaving the block commits everything at once (txn.commit()); an exception aborts

:meth:`PersistTxn.write` runs one Spark job over the DataFrame: each task writes its rows
as a batch (the parts go to the blob store from the executors, through the shard's batch
builder, as the ``persist`` data source's writer does) and returns only its batch's
transmittable bytes; the driver collects them and adds them to a
:class:`persist.Txn` (:meth:`persist.Txn.write_batches`).  Nothing is visible until the
commit, which makes every shard's new version and the catalog batches durable in one
stash ``append``.

Why a context and not a ``txn`` option of ``df.write.format("persist")``: a Python data
source's ``commit`` runs in a Python worker process the JVM starts, not in the driver's
interpreter, so it cannot hand its batches to a transaction object the user's code holds;
``mapInArrow`` plus ``collect`` keeps the batches in the driver.

Invariants kept here: a write that raised added nothing to the transaction (its tasks'
uploaded parts are deleted when the driver got them, else left to GC once the executors'
writer leases run out); an aborted transaction deletes every part it collected; the
executors' writers stay registered (their leases are not released) until their batches
are committed or the leases run out, so GC never deletes a part a pending transaction
holds within the writer lease (one hour by default).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
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

__all__ = ["PersistTxn", "persist_txn"]

log = logging.getLogger(__name__)

_OUT_SCHEMA = "batch binary, rows long"


def _build_batches(
    target: ShardTarget,
    key_schema: pa.Schema,
    value_schema: pa.Schema,
    time_column: str | None,
    diff_column: str | None,
) -> Any:
    """The ``mapInArrow`` function of :meth:`PersistTxn.write` (runs on executors): write
    the partition's rows as one batch and yield its transmittable bytes."""

    def fn(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from persist.txn import RAW_TIME
        from stash import Antichain

        rows = 0
        max_t: int | None = None
        schema = pa.schema(
            [
                *key_schema,
                *value_schema,
                pa.field(TIME, pa.int64(), False),
                pa.field(DIFF, pa.int64(), False),
            ]
        )
        with (
            persist_client(target) as client,
            client.open_writer(target.shard, key_schema, value_schema) as write,
        ):
            builder = write.builder(Antichain.from_elem(RAW_TIME))
            try:
                for rb in batches:
                    n = rb.num_rows
                    if n == 0:
                        continue
                    cols: list[Any] = [
                        rb.column(rb.schema.get_field_index(f.name)).cast(f.type)
                        for f in [*key_schema, *value_schema]
                    ]
                    if time_column is None:
                        times = pa.array([RAW_TIME] * n, pa.int64())
                    else:
                        times = rb.column(rb.schema.get_field_index(time_column)).cast(pa.int64())
                        if times.null_count:
                            raise PersistSourceError(f"time column {time_column!r} has nulls")
                        import pyarrow.compute as pc

                        hi = pc.max(times).as_py()
                        lo = pc.min(times).as_py()
                        if lo <= RAW_TIME:
                            raise PersistSourceError(f"time column {time_column!r} holds {lo}")
                        max_t = hi if max_t is None else max(max_t, hi)
                    if diff_column is None:
                        diffs = pa.array([1] * n, pa.int64())
                    else:
                        diffs = rb.column(rb.schema.get_field_index(diff_column)).cast(pa.int64())
                        if diffs.null_count:
                            raise PersistSourceError(f"diff column {diff_column!r} has nulls")
                    builder.add(pa.Table.from_arrays([*cols, times, diffs], schema=schema))
                    rows += n
                upper = RAW_TIME + 1 if max_t is None else max_t + 1
                batch = builder.finish(Antichain.from_elem(upper))
            except BaseException:
                builder.abort()
                raise
            if rows == 0:
                batch.delete()
                return
            payload = batch.into_transmittable()
        yield pa.RecordBatch.from_pydict(
            {"batch": [payload], "rows": [rows]},
            schema=pa.schema([("batch", pa.binary()), ("rows", pa.int64())]),
        )

    return fn


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
        from spark.persist_writer import WriteSettings

        opts: dict[str, str] = {"stash": self.stash_url, "blob": self.blob_uri, "shard": shard}
        if key_columns is not None:
            opts["key_columns"] = ",".join(key_columns)
        if value_columns is not None:
            opts["value_columns"] = ",".join(value_columns)
        if time_column is not None:
            opts["time_column"] = time_column
        if diff_column is not None:
            opts["diff_column"] = diff_column
        target = ShardTarget(self.stash_url, self.blob_uri, shard)
        settings = WriteSettings.from_options(opts, df.schema, registered_schemas(target))
        # Create (or check) the shard on the driver before the executors write.
        self.client.open_writer(shard, settings.key_schema, settings.value_schema).expire()
        fn = _build_batches(
            target,
            settings.key_schema,
            settings.value_schema,
            settings.time_column,
            settings.diff_column,
        )
        out = df.mapInArrow(fn, _OUT_SCHEMA).collect()
        handle = self.client.open_writer(shard, settings.key_schema, settings.value_schema)
        batches = []
        try:
            for r in out:
                batches.append(handle.batch_from_transmittable(bytes(r["batch"])))
            if batches:
                self.txn.write_batches(shard, batches)
        except BaseException:
            for b in batches:
                b.delete()
            raise
        finally:
            handle.expire()  # it only decoded bytes: never registered
        n = sum(int(r["rows"]) for r in out)
        self.rows[shard] = self.rows.get(shard, 0) + n
        return n

    def stash_append(self, batches: Sequence[Any]) -> None:
        """Add stash :class:`~stash.AppendBatch` es of this transaction's stash (see
        :meth:`persist.Txn.stash_append`)."""
        self.txn.stash_append(batches)

    def upsert(self, collection: str, items: Mapping[str, Any], uniqueness: Any = None) -> int:
        """Set ``key -> value`` in the JSON stash collection ``collection`` (created if
        needed) with the transaction, through a :class:`stash.TableTransaction` (so
        ``uniqueness`` constraints apply).  Several calls for one collection accumulate
        in one table transaction and one stash batch (a later value of a key replaces
        an earlier one).  Returns the number of pending updates of the collection (0:
        nothing to change, nothing added).

        Raises:
            persist.InvalidUsage: a later call for the collection with another
                ``uniqueness`` than the first.
        """
        from persist import InvalidUsage
        from stash import PeekSinceUpperError, TableTransaction

        coll = self.stash.collection(collection, key="str", value="json")
        known = self._upserts.get(collection)
        if known is None:
            try:
                initial = self.stash.peek_one(coll)
            except PeekSinceUpperError:
                initial = {}
            tx: TableTransaction[str, Any] = TableTransaction(initial, uniqueness)
            batch = None
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
        if batch is None:
            if not pending:
                return 0
            batch = coll.make_batch(self.stash)
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
