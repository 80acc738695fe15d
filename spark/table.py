"""``PersistTable``: a persist shard as a Spark table, shaped after delta-spark's
``DeltaTable`` (``forName``, ``toDF``, ``history``, ``merge``-style row changes,
``optimize``/``vacuum``).

::

    from spark import PersistTable

    t = PersistTable.create(spark, "flights", key_schema, value_schema,
                            stash="sqlite:////abs/stash.db", blob="file:///abs/blob")
    t = PersistTable.for_name(spark, "flights", stash=STASH_URL, blob=BLOB_URI)
    df = t.to_df()                      # the consolidated snapshot, with _diff
    df = t.to_df(as_of=41, columns=["carrier", "arr_delay"])
    t.history(limit=10).show()          # the newest 10 versions changing data
    t.compact(); t.gc()                 # what `persist compact` / `persist gc` do
    t.upsert(df); t.delete("id = 3"); t.update("id = 3", {"v": "v + 1"})

``to_df`` reads through Spark's own Parquet reader where it can (:mod:`spark.native_read`;
``path="native"``), else through the ``persist`` Python data source (``path="python"``);
``path="auto"`` (the default) takes the native path unless the blob store or a column
type keeps it off, or the tail that persist reads on the driver is large, and logs one
line saying why. Both paths give the same rows: ``ReadHandle.snapshot(as_of)`` without
its ``_time`` column.

The DataFrame ``to_df`` returns stays usable for one reader lease (the client's
``reader_lease_seconds``, 15 minutes by default) after ``to_df`` returns, on either path:
the native one names the parts of one state version, which GC deletes none of meanwhile;
the Python one plans again on each action at the time ``to_df`` decided, and a reader
left behind holds the since at that time meanwhile (:meth:`persist.ReadHandle.detach`
with ``hold_since``), whatever other readers and compaction do. Act on it within that
time, or call ``to_df`` again (a later action fails with a missing file or a since
violation, never with other rows).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from persist.commit_note import noting
from spark import row_changes
from spark.persist_common import PersistSourceError, ShardTarget, open_read, persist_client

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

log = logging.getLogger(__name__)

READ_PATHS = ("auto", "native", "python")
"""Values of :meth:`PersistTable.to_df`'s ``path``."""


def _arrow_schema(schema: Any, what: str) -> pa.Schema:
    """A key or value schema given as a ``pyarrow.Schema`` or a Spark ``StructType``.

    Raises:
        PersistSourceError: anything else.
    """
    if isinstance(schema, pa.Schema):
        return schema
    from pyspark.sql.types import StructType

    if isinstance(schema, StructType):
        from spark.persist_common import spark_to_arrow

        return spark_to_arrow(schema)
    raise PersistSourceError(
        f"{what} must be a pyarrow.Schema or a pyspark StructType, not {type(schema).__name__}"
    )


class PersistTable:
    """A persist shard seen from Spark (see the module docstring).

    Attributes:
        spark: the SparkSession.
        shard: the shard's name.
        stash_url: the stash (consensus) URL, a database every executor reaches.
        blob_uri: the blob store URI, one every executor reaches.

    The native read (:meth:`to_df`) plans on the driver through one
    :class:`persist.PersistClient` the table keeps open (its stash's connection pool and
    the shard's state machine) instead of opening one per read; every plan still starts
    from the committed state (it registers a reader by compare-and-set). :meth:`close`
    (or leaving a ``with`` block, or the table being garbage collected) closes it.

    The table also keeps its last native plan and DataFrame: a read whose plan has the
    same identity (:attr:`spark.native_plan.NativePlan.identity`: read time, schemas
    and the batches listed from the state version just read) returns that DataFrame
    again instead of reading the tail and building the plan anew, as delta-spark's
    ``DeltaLog`` keeps the ``Snapshot`` of an unchanged table version. New batches (an
    append, a compaction), a schema version or another read time make a new plan; a
    since downgrade alone changes no row read at that time, and keeps it.
    """

    def __init__(
        self,
        spark: SparkSession,
        shard: str,
        stash_url: str,
        blob_uri: str,
        *,
        readonly: bool = False,
    ) -> None:
        self.spark = spark
        self.readonly = readonly
        self.shard = shard
        self.stash_url = stash_url
        self.blob_uri = blob_uri
        self._lock = threading.Lock()  # guards the planning client (see close)
        self._kept_client: Any = None
        self._finalizer: weakref.finalize | None = None
        self._last: tuple[Any, DataFrame] | None = None  # (NativePlan, its DataFrame)

    def __enter__(self) -> PersistTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the client the table keeps for planning reads (a later read opens a
        new one). A read being planned in another thread finishes first."""
        with self._lock:
            fin, self._finalizer, self._kept_client = self._finalizer, None, None
            self._last = None
            if fin is not None:
                fin()

    def _planning_client(self) -> Any:
        """The client kept for planning native reads, opened on first use; the caller
        holds ``self._lock``."""
        if self._kept_client is None:
            stack = contextlib.ExitStack()
            self._kept_client = stack.enter_context(
                persist_client(self.target, readonly=self.readonly)
            )
            self._finalizer = weakref.finalize(self, stack.close)
        return self._kept_client

    def __repr__(self) -> str:
        return f"PersistTable({self.shard!r})"

    @property
    def target(self) -> ShardTarget:
        """Where the shard lives (the ``persist`` source's options)."""
        return ShardTarget(self.stash_url, self.blob_uri, self.shard)

    @contextlib.contextmanager
    def client(self, *, readonly: bool = False) -> Iterator[Any]:
        """A :class:`persist.PersistClient` on the table's stores (compaction off),
        closed when the ``with`` block ends: open handles with
        ``client.open_writer(table.shard, *table.schemas())`` and friends."""
        with persist_client(self.target, readonly=readonly) as c:
            yield c

    def schemas(self) -> tuple[pa.Schema, pa.Schema]:
        """The shard's ``(key_schema, value_schema)`` (newest value schema version)."""
        with self.client(readonly=True) as c:
            st = c.inspect(self.shard)
        return st.key_schema, st.value_schema

    # ---------------------------------------------------------------- opening
    @classmethod
    def for_name(
        cls, spark: SparkSession, shard: str, *, stash: str, blob: str, readonly: bool = False
    ) -> PersistTable:
        """The existing shard ``shard`` (Delta's ``DeltaTable.forName``).  With
        ``readonly``, the stash is opened ``readonly`` for reads (:meth:`to_df`,
        :meth:`history`, :meth:`schemas`): they take no reader lease and write no state
        version.  Without a lease, a GC by a writer while Spark reads may delete a part
        of the version read: the job then fails naming the missing file; run it again.

        Raises:
            PersistSourceError: no shard has that name in ``stash``.
        """
        from spark.persist_common import registered_schemas

        table = cls(spark, shard, stash, blob, readonly=readonly)
        if registered_schemas(table.target) is None:
            from stash import redact

            raise PersistSourceError(
                f"persist shard {shard} does not exist in {redact(stash)}; "
                "create it with PersistTable.create or write to it first"
            )
        return table

    @classmethod
    def create(
        cls,
        spark: SparkSession,
        shard: str,
        key_schema: Any,
        value_schema: Any,
        *,
        stash: str,
        blob: str,
    ) -> PersistTable:
        """Create the shard with these schemas (``pyarrow.Schema`` or Spark
        ``StructType``), or open it when it exists with exactly these schemas.

        Raises:
            PersistSourceError: a schema of another kind; the shard exists with other
                key or value schemas (naming both); persist refuses the schemas (e.g.
                no key column).
        """
        from persist.errors import InvalidUsage

        keys = _arrow_schema(key_schema, "key_schema")
        values = _arrow_schema(value_schema, "value_schema")
        table = cls(spark, shard, stash, blob)
        from spark.persist_common import registered_schemas

        found = registered_schemas(table.target)
        if found is not None:
            if not (found[0].equals(keys) and found[1].equals(values)):
                raise PersistSourceError(
                    f"persist shard {shard} exists with key schema {_fmt(found[0])} and "
                    f"value schema {_fmt(found[1])}, not {_fmt(keys)} and {_fmt(values)}"
                )
            return table
        try:
            with table.client() as c:
                write, read = c.open(shard, keys, values)
                write.expire()
                read.expire()
        except InvalidUsage as e:
            raise PersistSourceError(f"cannot create persist shard {shard}: {e}") from None
        return table

    # ---------------------------------------------------------------- reading
    def to_df(
        self,
        as_of: int | None = None,
        columns: Sequence[str] | None = None,
        *,
        path: str = "auto",
    ) -> DataFrame:
        """The consolidated snapshot at ``as_of`` (default: the latest complete time,
        as ``format("persist")``): the key and value columns (or only ``columns``, key or
        value column names) and ``_diff`` (long), each distinct (key, value) once
        (on the native path, a (key, value) that several runs of inserts only each
        insert, such as two tasks of one Spark write, reads once per run with ``_diff``
        1: the same updates, not summed; :mod:`spark.native_plan`).

        Args:
            as_of: the read time.
            columns: key and value columns to keep (``_diff`` is always there).
            path: ``"native"`` (Spark's Parquet reader, :mod:`spark.native_read`),
                ``"python"`` (the ``persist`` data source) or ``"auto"``.

        Raises:
            PersistSourceError: unknown ``path`` or column; ``as_of`` before the since
                or not before the upper; ``path="native"`` on a store or column type
                Spark's Parquet reader cannot read (naming the blob store, its secrets
                redacted, and the reason).
        """
        if path not in READ_PATHS:
            raise PersistSourceError(f"path must be one of {', '.join(READ_PATHS)}, got {path!r}")
        if as_of is not None and (isinstance(as_of, bool) or not isinstance(as_of, int)):
            raise PersistSourceError(f"as_of must be an int time, got {as_of!r}")
        df, why = self._native(as_of, path == "native") if path != "python" else (None, "")
        if df is None:
            from stash import redact

            where = f"shard {self.shard} (blob store {redact(self.blob_uri)})"
            if path == "native":
                raise PersistSourceError(f"{where} cannot be read natively: {why}")
            if path == "auto":
                log.info("%s: to_df reads through the persist data source: %s", where, why)
            df = self._python(as_of)
        if columns is not None:
            names = [c for c in df.columns if c != "_diff"]
            bad = [c for c in columns if c not in names]
            if bad or not isinstance(columns, (list, tuple)):
                raise PersistSourceError(
                    f"columns {bad or columns!r} are not key or value columns of shard "
                    f"{self.shard} ({', '.join(names)})"
                )
            from spark.names import col

            df = df.select(*[col(c) for c in columns], "_diff")
        return df

    def _native(self, as_of: int | None, force: bool) -> tuple[DataFrame | None, str]:
        """The native read's DataFrame, or ``None`` and why not (with ``force``, only a
        store or a column type Spark cannot read says no)."""
        from spark.native_plan import plan_snapshot
        from spark.native_read import blob_paths_root, name_reason, snapshot_df, type_reason

        prefix, why = blob_paths_root(self.spark, self.blob_uri)
        if prefix is None:
            return None, why
        with self._lock:  # one plan at a time on the kept client; close() waits
            c = self._planning_client()
            st = self._state(c)
            keys, values = st.key_schema, st.value_schema
            reason = type_reason(keys, (st.schemas(), 0)) or name_reason(
                self.spark, keys, (st.schemas(), 0)
            )
            if reason is not None:
                return None, reason
            last = self._last
            plan = plan_snapshot(
                c, self.shard, keys, values, as_of, auto=not force, reuse=last and last[0]
            )
            if plan.declined is not None:
                return None, plan.declined
            if last is not None and plan is last[0]:
                log.debug("shard %s at %s: the last plan again", self.shard, plan.as_of)
                return last[1], ""
            log.debug("shard %s at %s: %s", self.shard, plan.as_of, plan.summary())
            df = snapshot_df(self.spark, plan, keys, prefix)
            self._last = (plan, df)
        return df, ""

    def _python(self, as_of: int | None) -> DataFrame:
        from spark.formats import register
        from spark.persist_planning import resolve_as_of

        register(self.spark)
        with self.client(readonly=self.readonly) as c:
            st = self._state(c)
            read = open_read(c, self.shard, st.key_schema, st.value_schema)
            try:
                # Decided after the reader's since hold was taken: the since cannot
                # pass the time decided on.
                st = self._state(c)
                t = resolve_as_of(st, as_of, self.shard, c.blob)
                if t is not None:
                    read.downgrade_since(t)
                # The data source plans again on each action: the since stays at or
                # before t for one reader lease (as the native path's parts stay).
                read.detach(hold_since=True)
            except BaseException:
                read.expire()
                raise
        r = self.spark.read.format("persist").option("stash", self.stash_url)
        r = r.option("blob", self.blob_uri)
        if self.readonly:
            r = r.option("readonly", "true")
        if t is not None:
            r = r.option("as_of", str(t))
        return r.load(self.shard)

    def _state(self, c: Any) -> Any:
        from persist.errors import InvalidUsage

        try:
            return c.inspect(self.shard)
        except InvalidUsage as e:
            raise PersistSourceError(str(e)) from None

    def history(self, limit: int | None = None) -> DataFrame:
        """The table's history, newest first, as ``persist.Table.history`` gives it
        (delta-spark's ``DeltaTable.history(limit)``): ``version``, ``time``,
        ``timestamp`` (UTC), ``operation`` (``create``, ``append``, ``upsert``,
        ``delete``, ``update``, ``merge``, ``restore``, ``optimize``, ``schema``,
        ``retention``, ``txn``), ``parameters`` and ``metrics`` (JSON text); the same
        rows as ``persist history NAME``.  Read without a lease.

        Args:
            limit: at most this many rows (``int >= 1``), the newest; ``None``: all.

        Raises:
            PersistSourceError: ``limit`` not ``None`` nor an int ``>= 1``; unknown shard.
        """
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise PersistSourceError(f"history limit must be an int >= 1 or None, got {limit!r}")
        if limit is not None and limit < 1:
            raise PersistSourceError(f"history limit must be an int >= 1 or None, got {limit}")
        rows = self._table_call(True, lambda t: t.history(limit))
        return self.spark.createDataFrame(rows)

    def versions(self, limit: int | None = None, *, leases: bool = False) -> DataFrame:
        """The shard's state versions the stash still holds (the rollup and the diffs
        after it; GC's truncation drops older ones), newest first, each compared with
        the version before it: what changed in consensus, below :meth:`history`.

        Columns: ``seqno``, ``operation`` (``create``, ``rollup``, ``append``,
        ``compaction``, ``schema``, ``since``, ``finalize``, ``other``; with ``leases``
        also ``lease`` and ``gc``), ``lower``/``upper`` (the time range the version
        added, ``[lower, upper)``, null when none), ``rows_added`` and ``bytes_added``
        (updates and encoded bytes of the batches it added), ``since`` and ``writers``
        (ids of the writers whose state entries it changed). The operation is read off
        which consensus entries differ from the previous committed version's
        (:func:`spark.table_history.operation`).

        Args:
            limit: at most this many rows (``int >= 1``), the newest; ``None``: all.
            leases: also the versions that change only leases or GC's bookkeeping
                (reader and writer heartbeats, registrations and expiries, reader holds
                that leave the shard's since where it is, GC forgetting deleted blobs):
                by default only versions that change data, a frontier or the schema.

        Raises:
            PersistSourceError: ``limit`` not ``None`` nor an int ``>= 1``; ``leases``
                not a bool; unknown shard.
        """
        from spark.table_history import history_rows, history_schema

        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise PersistSourceError(f"history limit must be an int >= 1 or None, got {limit!r}")
        if limit is not None and limit < 1:
            raise PersistSourceError(f"history limit must be an int >= 1 or None, got {limit}")
        if not isinstance(leases, bool):
            raise PersistSourceError(f"history leases must be a bool, got {leases!r}")
        with self.client(readonly=True) as c:
            self._state(c)
            rows = history_rows(c, self.shard, leases=leases)
        return self.spark.createDataFrame(rows[:limit], history_schema())

    # ------------------------------------------------ persist.Table delegates
    def _table_call(self, readonly: bool, call: Any) -> Any:
        """``call(table)`` on the shard's :class:`persist.Table` over a client of this
        table's stores (readonly: writes nothing); unknown shards raise
        :class:`PersistSourceError`."""
        with self.client(readonly=readonly or self.readonly) as c:
            self._state(c)
            return call(c.table(self.shard))

    def details(self) -> dict[str, Any]:
        """What the table is and holds: :meth:`persist.Table.details` (name, shard id,
        key, schema, since, upper, batches, runs, parts, updates, bytes, inline bytes,
        schema versions, retention, blob store redacted).  Writes nothing."""
        return self._table_call(True, lambda t: t.details())  # type: ignore[no-any-return]

    def restore(self, as_of: Any) -> Any:
        """Make the live rows those of ``as_of`` (a time or a timezone-aware
        ``datetime``) in one commit (delta-spark's ``DeltaTable.restoreToVersion``):
        :meth:`persist.Table.restore`; returns the :class:`persist.RowChanges`.

        Raises: as :meth:`persist.Table.restore` (``SinceViolation`` naming the since).
        """
        return self._table_call(False, lambda t: t.restore(as_of))

    def optimize(self) -> Any:
        """Merge every batch into one run consolidated at the since (delta-spark's
        ``DeltaTable.optimize().executeCompaction()``): :meth:`persist.Table.optimize`
        on the driver; returns its :class:`persist.optimize.OptimizeReport`."""
        return self._table_call(False, lambda t: t.optimize())

    def set_retention(self, duration: Any) -> None:
        """Keep the states of the last ``duration`` (a ``timedelta``; ``None`` clears
        it) readable: :meth:`persist.Table.set_retention`."""
        self._table_call(False, lambda t: t.set_retention(duration))

    def vacuum(self, grace_seconds: float | None = None) -> Any:
        """Move the since to where the retention puts it, then collect garbage
        (delta-spark's ``DeltaTable.vacuum``): :meth:`persist.Table.vacuum`; returns
        its :class:`persist.table.VacuumReport`."""
        return self._table_call(False, lambda t: t.vacuum(grace_seconds))

    # ------------------------------------------------------------ maintenance
    def compact(self) -> Any:
        """Answer every outstanding merge request of the shard, large ones as Spark
        jobs (:func:`spark.jobs.compact.compact_shard`); returns its
        :class:`~spark.jobs.compact.CompactJobReport`."""
        from spark.jobs.compact import compact_shard

        return compact_shard(self.spark, self.stash_url, self.blob_uri, self.shard)

    def gc(self, grace_seconds: float | None = None) -> Any:
        """Delete the shard's unreferenced blobs older than ``grace_seconds`` (default:
        the client's, one hour) and truncate its consensus versions
        (:func:`persist.collect_garbage`, as ``persist gc``); returns its
        :class:`persist.gc.GcReport`.

        Raises:
            persist.InvalidUsage: a grace period that is not a finite number ``>= 0``.
        """
        from persist import collect_garbage

        with self.client() as c:
            return collect_garbage(c, self.shard, grace_seconds=grace_seconds)

    # ----------------------------------------------------------- row changes
    def upsert(self, df: DataFrame) -> Any:
        """Insert ``df``'s rows, replacing the rows of the shard with the same key
        (:func:`spark.row_changes.upsert`); returns the :class:`persist.RowChanges`."""
        with noting("upsert"):
            return row_changes.upsert(self, df)

    def merge(
        self,
        source: DataFrame,
        on: Sequence[str] | None = None,
        source_alias: str = "source",
        target_alias: str = "target",
    ) -> Any:
        """A MERGE INTO the shard (delta-spark's ``DeltaTable.merge``): chain
        ``when_*`` clauses (conditions and values: Spark SQL strings or ``Column``s over
        ``source.<col>`` and ``target.<col>``, or the aliases given), then ``execute()``
        commits them as one change and returns a :class:`persist.MergeResult`.  The
        semantics are ``persist.WriteHandle.merge``'s (:mod:`persist.merge_into`); the
        source is collected to the driver (:mod:`spark.merge`).

        Args:
            source: a DataFrame (or Arrow data).
            on: the key columns to match on (default: every key column).
        """
        from spark.merge import merge_builder

        return merge_builder(self, source, on, source_alias, target_alias)

    def delete(self, condition: str | Column) -> Any:
        """Retract the rows ``condition`` (a SQL string or a ``Column``) holds for
        (:func:`spark.row_changes.delete`); returns the :class:`persist.RowChanges`."""
        with noting("delete", {"predicate": str(condition)}):
            return row_changes.delete(self, condition)

    def update(self, condition: str | Column, set: Mapping[str, str | Column]) -> Any:
        """Set columns (``set``: column -> SQL string or ``Column``) of the rows
        ``condition`` holds for (:func:`spark.row_changes.update`); returns the
        :class:`persist.RowChanges`."""
        with noting(
            "update", {"predicate": str(condition), "set": {k: str(v) for k, v in set.items()}}
        ):
            return row_changes.update(self, condition, set)


def _fmt(schema: pa.Schema) -> str:
    return "(" + ", ".join(f"{f.name} {f.type}" for f in schema) + ")"
