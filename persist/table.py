"""The user-facing table: a shard anyone can open by name, write rows to and read rows
from, without ``_time``, ``_diff`` or explicit uppers (:class:`Table`).

A :class:`Table` is a thin layer over a shard's handles, after delta-rs's ``DeltaTable``
and pyiceberg's ``Table``: :meth:`PersistClient.create_table
<persist.client.PersistClient.create_table>` makes one (or returns the existing one with
the same schema), :meth:`PersistClient.table <persist.client.PersistClient.table>` opens
one with its newest schema.  Writes go through the shard's
:class:`~persist.write.WriteHandle` (row changes) or a :class:`~persist.txn.Txn`
(appends, retried at the next time without uploading again); reads go through one state
version and its parts, without a lease (:mod:`persist.version_read`).  The operating
side lives in modules of its own: history (:mod:`persist.history`, written by the
machine: :mod:`persist.history_record`), retention (:mod:`persist.retention`), full
compaction (:mod:`persist.optimize`), DuckDB (:mod:`persist.duckdb_read`), the blob
store's identity (:mod:`persist.store_identity`) and progress
(:mod:`persist.progress`).

Invariants kept here:

* every input goes through one conversion (:func:`persist.arrow_input.as_arrow_table`),
  then the shard's column check and casts (:func:`persist.rows.conform_rows`): a value
  that does not fit is refused and nothing is committed;
* ``append`` commits its rows at one time, the shard's upper when it commits (the
  smallest time that can commit), and returns it; with an app transaction
  (:mod:`persist.app_txn`) it commits them at most once per ``(app_id, version)``,
  decided on the app's record as committed, and a retry returns the time recorded;
* a change that changes nothing writes nothing (an append of no rows, an upsert,
  delete, update, merge or restore that changes no row): no version, no history
  entry; it returns ``upper - 1``;
* a closed table refuses every call (naming the table), committing nothing;
* a read is the consolidated snapshot of ONE state version at one ``as_of``, each row
  repeated by its multiplicity, without ``_time``/``_diff``; it registers no reader and
  writes nothing (so it works on a readonly stash): if GC deleted a part of that
  version meanwhile, it reads again on the newer version at the same ``as_of`` (exact
  while ``as_of`` is at or after the since), or fails naming the since;
* an ``as_of`` before the since raises :class:`~persist.errors.SinceViolation` naming
  the since; one at or beyond the upper raises :class:`~persist.errors.InvalidUsage`
  naming the upper; a ``datetime`` resolves to the time of the newest version
  committed at or before it (its history record);
* ``restore(as_of)`` is one commit of ``rows(as_of) - rows(now)``, consolidated, so
  afterwards ``to_arrow()`` equals ``to_arrow(as_of)``.

Sources: delta-rs's ``DeltaTable`` (``python/deltalake/table.py``) and pyiceberg's
``Table`` (``pyiceberg/table/__init__.py``): the calls users know; Materialize's
persist-client ``ReadHandle::snapshot_and_fetch`` for reading one version.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist import retention
from persist import rows as rows_mod
from persist.app_txn import (
    AppTransaction,
    AppTxnLog,
    Seen,
    check_app_id,
    earlier_fingerprints,
    rows_fingerprint,
)
from persist.arrow_input import as_arrow_table
from persist.closing import CloseGate, gated
from persist.commit_note import noting
from persist.compactor import Compactor
from persist.consolidation import consolidate
from persist.context import SHARD_ID_REF
from persist.duckdb_read import to_relation
from persist.errors import (
    InvalidUsage,
    SchemaMismatch,
    SinceViolation,
)
from persist.filters import check_columns, check_filter
from persist.gc import GcReport, collect_garbage
from persist.history import history_table, time_at
from persist.machine import ShardMachine
from persist.merge_into import MergeBuilder, MergeResult, as_source
from persist.merge_plan import check_names as check_duckdb_names
from persist.optimize import OptimizeReport, optimize
from persist.parts import updates_schema
from persist.progress import Progress
from persist.relation import expand_rows
from persist.rows import RowChanges
from persist.state import LeaseExpired, ShardState
from persist.txn import Txn, TxnUpperMismatch
from persist.version_read import read_version
from persist.write import WriteHandle
from stash import redact
from stash.antichain import I64_MAX

if TYPE_CHECKING:
    import pandas as pd

    from persist.shards import Shards

__all__ = ["Table", "VacuumReport"]


@dataclass(frozen=True)
class VacuumReport:
    """What :meth:`Table.vacuum` did: the ``since`` after it (``None``: empty) and the
    garbage collection's :class:`~persist.gc.GcReport` (``gc``)."""

    since: int | None
    gc: GcReport


log = logging.getLogger(__name__)


def split_schema(name: str, schema: pa.Schema, key: Sequence[str]) -> tuple[pa.Schema, pa.Schema]:
    """``schema`` split into the key schema (the ``key`` columns, in ``key``'s order)
    and the value schema (the other columns, in ``schema``'s order).

    Raises:
        InvalidUsage: ``schema`` is not a ``pyarrow.Schema``; ``key`` is not a
            non-empty list of distinct column names of ``schema``.
    """
    if not isinstance(schema, pa.Schema):
        raise InvalidUsage(
            f"table {name!r}: schema must be a pyarrow.Schema, not {type(schema).__name__}"
        )
    if isinstance(key, str) or not isinstance(key, Sequence) or not key:
        raise InvalidUsage(
            f"table {name!r}: key must be a non-empty list of column names, got {key!r}"
        )
    keys = list(key)
    unknown = [k for k in keys if not isinstance(k, str) or schema.get_field_index(k) < 0]
    if unknown:
        raise InvalidUsage(
            f"table {name!r}: key column(s) {unknown} are not in the schema {schema.names}"
        )
    if len(set(keys)) != len(keys):
        raise InvalidUsage(f"table {name!r}: key {keys} names a column twice")
    if len(set(schema.names)) != len(schema.names):
        raise InvalidUsage(f"table {name!r}: schema {schema.names} names a column twice")
    key_schema = pa.schema([schema.field(k) for k in keys])
    value_schema = pa.schema([f for f in schema if f.name not in set(keys)])
    return key_schema, value_schema


class Table:
    """A table: one shard, opened by name (see the module docstring).  Made by
    :meth:`PersistClient.create_table <persist.client.PersistClient.create_table>` and
    :meth:`PersistClient.table <persist.client.PersistClient.table>`, never directly.

    Thread-safe: its methods may run in several threads at once (each write commits at
    its own time).

    Attributes:
        name: the table's (shard's) name.
        shard_id: the shard's id.
    """

    def __init__(self, shards: Shards, name: str, shard_id: str, compactor: Compactor) -> None:
        self._shards = shards
        self._compactor = compactor
        self._ctx = shards.ctx
        self.name = name
        self.shard_id = shard_id
        self._machine: ShardMachine = self._ctx.machine(shard_id)
        self._lock = threading.Lock()
        self._writer: WriteHandle | None = None
        self._gate = CloseGate(self._refuse)  # writes in flight; close() waits for them

    def __repr__(self) -> str:
        return f"Table({self.name!r}, key={self.key}, schema={self.schema.names})"

    def _check_open(self, verb: str) -> None:
        """Raises: InvalidUsage: the table was closed (naming it and ``verb``)."""
        self._gate.check(verb)

    def _refuse(self, verb: str) -> None:
        raise InvalidUsage(
            f"table {self.name!r} is closed: {verb} refused (nothing was committed); "
            "open it again with client.table(name)"
        )

    # ------------------------------------------------------------------ shape
    def _state(self) -> ShardState:
        """The latest state (the cached one if the head did not move)."""
        st = self._machine.recent()
        st.check_not_finalized()
        return st

    @property
    def schema(self) -> pa.Schema:
        """The table's columns (``pyarrow.Schema``): the key columns, then the value
        columns of the newest schema version."""
        st = self._machine.state()
        return pa.schema([*st.key_schema, *st.value_schema])

    @property
    def key(self) -> list[str]:
        """The names of the key columns."""
        return list(self._machine.state().key_schema.names)

    # ----------------------------------------------------------------- writes
    def _write_handle(self) -> WriteHandle:
        """The writer of this table, in the shard's newest schema (made again when
        another process evolved the schema, or its lease ran out: a table outlives its
        writers' leases, as :meth:`persist.shards.Shards.txn_writer` does).  Threads
        that find it stale at once replace it once: the writer one of them installed
        is the one the others use (never expired under it)."""
        st = self._state()
        newest = st.schemas().newest

        def usable(w: WriteHandle | None) -> bool:
            return w is not None and not w.lapsed(self._machine.now_ms()) and w.schema_id == newest

        with self._lock:
            self._check_open("a write")
            stale = self._writer
            if stale is not None and usable(stale):
                return stale
        new = self._shards.writer(self._machine, self.name, st.key_schema, st.value_schema, newest)
        unused: WriteHandle | None
        with self._lock:
            current = self._writer
            if self._gate.closed:  # closed meanwhile: the new writer is not kept
                w, unused = None, new
            elif current is not None and current is not stale and usable(current):
                w, unused = current, new  # another thread replaced it meanwhile
            else:
                w, unused, self._writer = new, current, new
        if unused is not None and unused is not w and not unused.lapsed(self._machine.now_ms()):
            unused.expire()  # a lapsed one is left to lease expiry: a no-op writes nothing
        if w is None:
            self._check_open("a write")
        assert w is not None
        return w

    @contextlib.contextmanager
    def _writing(self, w: WriteHandle) -> Iterator[None]:
        """Run a write through ``w``; if its writer is found expired (by another
        process, while its lease still ran: the write committed nothing), drop it, so
        the table's next write opens a new one."""
        try:
            yield
        except LeaseExpired:
            with self._lock:
                if self._writer is w:
                    self._writer = None
            raise

    def _rows(self, data: Any, what: str, w: WriteHandle) -> pa.Table:
        """``data`` (anything Arrow takes) as the table's key and value columns."""
        what = f"{what} table {self.name!r}"
        return rows_mod.conform_rows(as_arrow_table(data, what), w.schema, what)

    @gated("append")
    def append(self, data: Any, *, app_transaction: AppTransaction | None = None) -> int:
        """Insert the rows of ``data`` at the next time (the shard's upper when the
        commit lands; a race moves it later, without uploading again).

        Args:
            data: the table's columns (no ``_time``/``_diff``): a pyarrow ``Table``,
                ``RecordBatch`` or ``RecordBatchReader``, a pandas or polars
                ``DataFrame``, or any object with ``__arrow_c_stream__``.
            app_transaction: names this write ``(app_id, version)`` to make it
                exactly-once (:mod:`persist.app_txn`; delta-rs's
                ``CommitProperties(app_transactions=[Transaction(app_id, version)])``,
                delta-spark's ``txnAppId``/``txnVersion``): the record of the app id's
                newest version commits with the rows.  Called again with the version
                committed (a retry: after an indeterminate error, from another
                process, after the writer's lease ran out), it writes nothing and
                returns the time recorded; with a lower version it raises
                :class:`~persist.app_txn.StaleAppVersion`.

        Returns: the time the rows were committed at (int).

        Raises:
            InvalidUsage: unknown input kind, missing or unknown columns, a value that
                does not fit its column; an ``app_transaction`` whose version was
                committed with other rows, or on a readonly stash; nothing is
                committed.
            StaleAppVersion: ``app_transaction``'s version is below the app id's
                committed one (an InvalidUsage; nothing is committed).
            BlobError, ConsensusError: storage failed; nothing is committed, unless
                the error ``is_indeterminate()``: a lost acknowledgement the commit
                could not settle (it looks for its token first, see
                :class:`persist.txn.Txn`), so the rows may have landed.  With an
                ``app_transaction``, call ``append`` again with it: it appends the rows
                only if they did not land.  Without one, calling ``append`` again is a
                new append, not a retry: read the table (or :meth:`history`) before
                appending the rows again.
        """
        if app_transaction is not None and not isinstance(app_transaction, AppTransaction):
            raise InvalidUsage(
                f"table {self.name!r}: app_transaction must be a persist.AppTransaction, "
                f"not {type(app_transaction).__name__}"
            )
        app = app_transaction
        with Progress(f"table {self.name!r}: append") as progress:
            w = self._write_handle()
            progress.set_phase("converting")
            rows = self._rows(data, "append to", w)
            progress.rows, progress.nbytes = rows.num_rows, rows.nbytes
            log = fp = seen = None
            if app is not None:
                log, fp = AppTxnLog(self._ctx, self.shard_id, self.name), rows_fingerprint(rows)
                seen = log.read(app.app_id)
                if seen.record is not None and seen.record.version >= app.version:
                    return log.settle(
                        app, seen.record, fp, partial(self._earlier, rows, w.schema_id)
                    )
            if rows.num_rows == 0:
                # A change that changes nothing writes nothing (an app transaction's
                # version alone is recorded, apart from the shard).
                t = self._definite_time()
                if app is None:
                    return t
                assert log is not None and seen is not None and fp is not None
                return log.record_alone(seen, app, t, fp, self._machine.now_ms)
            params = {} if app is None else {"app_id": app.app_id, "version": app.version}
            txn = Txn(self._shards)
            try:
                with self._writing(w), noting("append", params) as note:
                    note.metrics.update(rows_inserted=rows.num_rows, rows_retracted=0)
                    progress.set_phase("writing parts")
                    txn.write(w, rows)
                    progress.set_phase("committing", rows.num_rows)
                    if app is None:
                        return txn.commit()
                    assert log is not None and seen is not None and fp is not None
                    earlier = partial(self._earlier, rows, w.schema_id)
                    return self._commit_app(txn, log, seen, app, rows.num_rows, fp, earlier)
            except BaseException:
                txn.abort()
                raise

    def _commit_app(
        self,
        txn: Txn,
        log: AppTxnLog,
        seen: Seen,
        app: AppTransaction,
        n: int,
        fp: str,
        earlier: Callable[[], Iterable[str]],
    ) -> int:
        """Commit ``txn`` (the rows of an append) with the record of ``app``, read in
        ``seen``, at the next time; a race on the shard moves the time later, a race on
        the app transaction records decides again on them (another writer may have
        committed ``app``: then ``txn`` is aborted and the recorded time returned;
        ``fp``, ``earlier``: as :meth:`persist.app_txn.AppTxnLog.settle`).

        Raises: as :meth:`persist.txn.Txn.commit`; the last race after
            ``txn.max_commit_attempts`` of them."""
        races = 0
        while True:
            up = self._machine.recent().upper.as_option()
            if up is None or up >= I64_MAX:
                txn.commit()  # raises the sealed or finalized shard's error
                raise AssertionError("unreachable")  # pragma: no cover
            ts = up
            while True:
                txn._replace_stash_batches(
                    [seen.batch(app, ts, n, fp, self._machine.now_ms())], own=True
                )
                try:
                    return txn.commit_at(ts)
                except TxnUpperMismatch as e:
                    races += 1
                    nxt = e.retry_ts()
                    if races >= txn.max_commit_attempts or (nxt is None and not e.collections):
                        raise
                    if e.collections:
                        break  # another app transaction committed: decide again
                    assert nxt is not None
                    ts = max(nxt, ts + 1)
            seen = log.read(app.app_id)
            if seen.record is not None and seen.record.version >= app.version:
                txn.abort()
                return log.settle(app, seen.record, fp, earlier)

    def _earlier(self, rows: pa.Table, schema_id: int) -> Iterator[str]:
        """:func:`persist.app_txn.earlier_fingerprints` of ``rows`` (of ``schema_id``)."""
        return earlier_fingerprints(rows, self._machine.state().schemas(), schema_id)

    def _definite_time(self) -> int:
        """The time a write that writes nothing reports: ``upper - 1`` of the latest
        state (a read as of it shows the table as the write left it), as
        :class:`~persist.rows.RowChanges` does."""
        up = self._state().upper.as_option()
        return (I64_MAX if up is None else up) - 1

    def transaction_version(self, app_id: str) -> int | None:
        """The newest version committed for ``app_id`` by an append with an
        :class:`~persist.app_txn.AppTransaction` (``None``: none), read now; writes
        nothing (works on a readonly stash).  delta-rs's
        ``DeltaTable.transaction_version``.

        Raises:
            InvalidUsage: ``app_id`` is not an app id (a printable str of 1 to 255
                characters, as :class:`~persist.app_txn.AppTransaction`'s).
            ConsensusError: the stash failed, or the record is malformed.
        """
        self._check_open("transaction_version")
        check_app_id(app_id)
        rec = AppTxnLog(self._ctx, self.shard_id, self.name).committed(app_id)
        return None if rec is None else rec.version

    @gated("upsert")
    def upsert(self, data: Any) -> RowChanges:
        """Replace every live row whose key is in ``data`` by ``data``'s row, at one
        new time (:meth:`WriteHandle.upsert <persist.write.WriteHandle.upsert>`).

        Raises: as :meth:`append`; also InvalidUsage when ``data`` has a key twice.
        """
        with Progress(f"table {self.name!r}: upsert") as progress:
            w = self._write_handle()
            progress.set_phase("converting")
            rows = self._rows(data, "upsert into", w)
            progress.rows, progress.nbytes = rows.num_rows, rows.nbytes
            progress.set_phase("reading live rows, writing changes, committing")
            with self._writing(w):
                return w.upsert(rows)

    def merge(
        self,
        source: Any,
        on: Sequence[str] | None = None,
        source_alias: str = "source",
        target_alias: str = "target",
    ) -> MergeBuilder[MergeResult]:
        """A MERGE INTO the table (delta-rs's ``DeltaTable.merge``): chain ``when_*``
        clauses, then ``execute()`` commits them as one change, recorded in history as
        ``merge`` with its predicate, clauses and metrics.  Semantics, errors and cost:
        :meth:`WriteHandle.merge <persist.write.WriteHandle.merge>` and
        :mod:`persist.merge_into`.

        Args:
            source: anything :meth:`append` takes.
            on: the key columns to match on (default: the table's key).
            source_alias, target_alias: the names conditions and values use.
        """
        self._check_open("merge")
        w = self._write_handle()
        # Read once (a reader is one-shot): the source of every writer's run.
        rows = as_source(source)
        builder = w.merge(rows, on, source_alias, target_alias)
        run = builder._run

        def execute(spec: Any) -> MergeResult:
            # The table's writer at execute(): the builder may outlive the lease of
            # the one it was made with.
            with self._gate.entered("merge"):
                now = self._write_handle()
                run_now = run if now is w else now.merge(rows, on, source_alias, target_alias)._run
                with self._writing(now):
                    return run_now(spec)

        builder._run = execute
        return builder

    @gated("delete")
    def delete(self, filter: pc.Expression) -> RowChanges:
        """Delete every live row ``filter`` (a boolean ``pyarrow.compute`` expression
        over the columns) keeps, at one new time (:meth:`WriteHandle.delete
        <persist.write.WriteHandle.delete>`)."""
        with Progress(f"table {self.name!r}: delete") as progress:
            progress.set_phase("reading live rows, writing retractions, committing")
            w = self._write_handle()
            with self._writing(w):
                return w.delete(filter)

    @gated("update")
    def update(self, filter: pc.Expression, set: Mapping[str, Any]) -> RowChanges:
        """Set columns of every live row ``filter`` keeps (``set``: column -> scalar or
        ``pyarrow.compute`` expression over the old row), at one new time
        (:meth:`WriteHandle.update <persist.write.WriteHandle.update>`)."""
        with Progress(f"table {self.name!r}: update") as progress:
            progress.set_phase("reading live rows, writing changes, committing")
            w = self._write_handle()
            with self._writing(w):
                return w.update(filter, set)

    # ------------------------------------------------------------------ reads
    def resolve_as_of(self, st: ShardState, as_of: Any) -> int | None:
        """The logical time a read ``as_of`` means on ``st``: the latest definite time
        for ``None`` (``None`` itself when nothing was ever committed), ``as_of`` for an
        int, the time of the newest version committed at or before it for a
        timezone-aware ``datetime`` (:func:`persist.history.time_at`).

        Raises:
            SinceViolation: before the since.  InvalidUsage: at or beyond the upper,
                not a time, a naive datetime, or a datetime before the first commit
                (naming the since).
        """
        upper, since = st.upper.as_option(), st.since.as_option()
        if isinstance(as_of, dt.datetime):
            records = self._ctx.consensus.history(self.shard_id)
            as_of = time_at(records, as_of, st.since, f"table {self.name!r}")
        if as_of is None:
            if not upper:
                return None
            return upper - 1 if since is None else max(upper - 1, since)
        if isinstance(as_of, bool) or not isinstance(as_of, int):
            raise InvalidUsage(
                f"table {self.name!r}: as_of must be an int time or a timezone-aware "
                f"datetime, not {type(as_of).__name__}"
            )
        if not st.since.less_equal(as_of):
            raise SinceViolation(as_of, st.since)
        if upper is None or as_of >= upper:
            raise InvalidUsage(
                f"table {self.name!r}: as_of {as_of} is not before its upper {st.upper}: "
                "no data is definite there yet"
            )
        return as_of

    def _snapshot(
        self,
        as_of: Any,
        columns: Sequence[str] | None,
        filter: pc.Expression | None,
    ) -> pa.Table:
        """The consolidated rows (with ``_diff``) of one state version at ``as_of``
        (:func:`persist.version_read.read_version`: no lease; a part GC removed meanwhile
        is read from the newer version at the same time)."""
        st = self._state()
        t = self.resolve_as_of(st, as_of)
        schema = pa.schema([*st.key_schema, *st.value_schema])
        cols = check_columns(columns, schema)
        wanted = [*(cols or schema.names), "_diff"]
        if t is None:
            check_filter(
                filter,
                updates_schema(st.key_schema, st.value_schema),
                st.key_schema.names,
                st.value_schema.names,
            )
            return updates_schema(st.key_schema, st.value_schema).empty_table().select(wanted)
        out = read_version(self._ctx, self._machine, st, t, columns=wanted, filter=filter)
        return out

    def to_arrow(
        self,
        as_of: Any = None,
        columns: Sequence[str] | None = None,
        filter: pc.Expression | None = None,
    ) -> pa.Table:
        """The live rows as of ``as_of``: each (key, value) row repeated by its
        multiplicity, sorted by key and value, without ``_time``/``_diff``.

        Args:
            as_of: ``None`` (the latest definite time), a time (int), or a
                timezone-aware ``datetime`` (the table as it was at that instant).
            columns: the columns to return, in order (``None``: all).
            filter: a boolean ``pyarrow.compute`` expression over the columns, e.g.
                ``pc.field("id") < 10`` (parts that cannot hold a kept row are not read).

        Raises:
            SinceViolation: ``as_of`` is before the since (naming it).
            InvalidUsage: ``as_of`` at or beyond the upper; bad columns or filter; a row
                with a negative multiplicity (more retractions than insertions).
            CorruptPart, BlobError, ConsensusError: storage failed.
        """
        self._check_open("read")
        with Progress(f"table {self.name!r}: read") as progress:
            progress.set_phase("reading and consolidating parts")
            out = expand_rows(self._snapshot(as_of, columns, filter), self.name)
            progress.rows, progress.nbytes = out.num_rows, out.nbytes
            return out

    def to_pandas(
        self,
        as_of: Any = None,
        columns: Sequence[str] | None = None,
        filter: pc.Expression | None = None,
    ) -> pd.DataFrame:
        """:meth:`to_arrow`'s rows as a pandas ``DataFrame`` (needs pandas), exactly:
        as pyarrow's ``Table.to_pandas``, except that an integer column holding a null
        is a pandas nullable integer column (``Int64``...; pyarrow's float64 rounds
        integers beyond 2**53), a float column holding a NaN is a nullable ``Float64``
        or ``Float32`` column (pandas reads NaN back as a null) and a ``time64[ns]``
        column is ``time64[ns][pyarrow]`` (Python's ``time`` holds microseconds), so
        ``upsert(to_pandas())`` writes nothing."""
        self._check_open("read")
        return exact_pandas(self.to_arrow(as_of, columns, filter))

    def to_reader(
        self,
        as_of: Any = None,
        columns: Sequence[str] | None = None,
        filter: pc.Expression | None = None,
    ) -> pa.RecordBatchReader:
        """:meth:`to_arrow`'s rows as a ``pyarrow.RecordBatchReader``."""
        self._check_open("read")
        t = self.to_arrow(as_of, columns, filter)
        return pa.RecordBatchReader.from_batches(t.schema, t.to_batches())

    # ------------------------------------------------------------- operating
    @gated("restore")
    def restore(self, as_of: Any) -> RowChanges:
        """Make the live rows those of ``as_of`` (a time or a timezone-aware
        ``datetime``, as :meth:`to_arrow`) in one commit at the next time: the rows
        live now and not then are retracted, those live then and not now inserted
        (multiplicities included); history records it as ``restore``.

        Raises:
            SinceViolation, InvalidUsage: as :meth:`to_arrow`'s ``as_of``.
            ChangeContended, BlobError, ConsensusError: as :meth:`upsert`.
        """
        t = self.resolve_as_of(self._state(), as_of)
        w = self._write_handle()
        names = [*w.key_schema.names, *w.value_schema.names]
        target = (
            self._snapshot(t, None, None).select([*names, "_diff"])
            if t is not None
            else w.schema.empty_table().select([*names, "_diff"])
        )
        with self._writing(w), noting("restore", {"time": t}):
            return rows_mod.apply_change(
                w, lambda read, upper: plan_restore(read(None), target, w), op="restore"
            )

    @gated("optimize")
    def optimize(self) -> OptimizeReport:
        """Merge every batch into one batch (one sorted run, parts cut by size),
        consolidated at the since (:func:`persist.optimize.optimize`); what every
        readable ``as_of`` sees is unchanged.  A table already so is left alone.
        History records it as ``optimize`` (``{"full": true}``).

        Returns: an :class:`~persist.optimize.OptimizeReport`.
        """
        with Progress(f"table {self.name!r}: optimize") as progress:
            st = self._machine.state()
            progress.rows, progress.nbytes = sum(b.len for b in st.batches()), st.blob_bytes()
            progress.set_phase("reading, consolidating, writing one run")
            return optimize(self._ctx, self._compactor, self._machine)

    def details(self) -> dict[str, Any]:
        """What the table is and holds, from its latest state (JSON-able; writes
        nothing): ``name``, ``shard_id``, ``key``, ``schema`` (``"name: type"`` per
        column), ``since`` and ``upper`` (ints, ``None`` for the empty frontier),
        ``batches``, ``runs``, ``parts``, ``updates`` (stored rows, not consolidated),
        ``bytes`` (blob parts), ``inline_bytes``, ``schema_versions``,
        ``retention_seconds`` (``None``: none), ``blob_store`` (credentials
        redacted)."""
        self._check_open("details")
        st = self._machine.refresh()
        batches = st.batches()
        return {
            "name": self.name,
            "shard_id": self.shard_id,
            "key": list(st.key_schema.names),
            "schema": [
                f"{f.name}: {f.type}{'' if f.nullable else ' not null'}"
                for f in [*st.key_schema, *st.value_schema]
            ],
            "since": st.since.as_option(),
            "upper": st.upper.as_option(),
            "batches": len(batches),
            "runs": sum(len(b.runs) + 1 for b in batches if b.parts),
            "parts": st.num_parts(),
            "updates": sum(b.len for b in batches),
            "bytes": st.blob_bytes(),
            "inline_bytes": st.inline_bytes(),
            "schema_versions": len(st.schema_history),
            "retention_seconds": None if st.retention_ms is None else st.retention_ms / 1000,
            "blob_store": redact(repr(self._ctx.raw_blob)),
        }

    # -------------------------------------------------------------- retention
    @property
    def retention(self) -> dt.timedelta | None:
        """The retention set by :meth:`set_retention` (``None``: none)."""
        ms = self._machine.state().retention_ms
        return None if ms is None else dt.timedelta(milliseconds=ms)

    @gated("set_retention")
    def set_retention(self, duration: dt.timedelta | None) -> None:
        """Keep the table's states of the last ``duration`` readable: from now on its
        since follows the newest time committed at or before ``now - duration``, at
        every commit and at :meth:`vacuum` (:mod:`persist.retention`); reader leases
        may hold it further back.  Kept in the shard's state; ``None`` clears it (the
        since stays where it is).  History records it as ``retention``.

        Raises:
            InvalidUsage: ``duration`` is not a ``timedelta`` >= 0 or ``None``.
        """
        if duration is not None and (
            not isinstance(duration, dt.timedelta) or duration < dt.timedelta(0)
        ):
            raise InvalidUsage(
                f"table {self.name!r}: retention must be a datetime.timedelta >= 0 or None, "
                f"got {duration!r}"
            )
        self._state()
        if duration is None:
            with noting("retention", {"duration_seconds": None}):
                self._machine.set_retention(None, (), None)
            return
        ms = int(duration / dt.timedelta(milliseconds=1))
        records = self._ctx.consensus.history(self.shard_id)
        now = self._machine.now_ms()
        marks = retention.marks_from(records, ms)
        hold = retention.exact_hold(records, now, ms)
        with noting("retention", {"duration_seconds": ms / 1000}):
            self._machine.set_retention(ms, marks, hold)

    @gated("vacuum")
    def vacuum(self, grace_seconds: float | None = None) -> VacuumReport:
        """Move the since exactly to where the retention puts it (the newest time
        committed at or before ``now - retention``, from history; reader leases may
        hold it back), then collect garbage
        (:func:`persist.gc.collect_garbage`: blobs no version references any more,
        older than the grace period).  Without a retention only the garbage is
        collected.

        Raises:
            InvalidUsage: a stash that is not writable.  BlobError, ConsensusError:
                storage failed.
        """
        self._ctx.check_may_delete("vacuum")
        st = self._machine.refresh()
        st.check_not_finalized()
        if st.retention_ms is not None:
            records = self._ctx.consensus.history(self.shard_id)
            hold = retention.exact_hold(records, self._machine.now_ms(), st.retention_ms)
            with noting("retention", {"vacuum": True}):
                self._machine.advance_retention(hold)
        gc = collect_garbage(self._ctx, SHARD_ID_REF + self.shard_id, grace_seconds=grace_seconds)
        return VacuumReport(self._machine.state().since.as_option(), gc)

    # ---------------------------------------------------------------- history
    def history(self, limit: int | None = None) -> pa.Table:
        """The table's versions that changed its contents, schema or retention, newest
        first (:func:`persist.history.history_table`): ``version`` (the state's seqno),
        ``time`` (the logical time its contents are read at), ``timestamp`` (UTC,
        never decreasing from one version to the next), ``operation``, ``parameters``
        and ``metrics`` (JSON text).  Writes nothing.

        Raises:
            InvalidUsage: a bad ``limit``.  ConsensusError: the stash failed.
        """
        self._check_open("history")
        return history_table(self._ctx.consensus.history(self.shard_id), limit)

    # ----------------------------------------------------------------- duckdb
    def to_duckdb(self, con: Any = None, as_of: Any = None) -> Any:
        """The live rows as of ``as_of`` (as :meth:`to_arrow`: a time, a timezone-aware
        ``datetime`` or ``None``) as a ``duckdb.DuckDBPyRelation`` of ``con`` (default:
        a new in-memory connection).

        DuckDB scans the Parquet parts that need no merge itself (the parts of
        compacted runs, or of appends of inserts only, whose keys no other part
        touches: the plan Spark's native read makes, :mod:`persist.direct_plan`);
        persist merges only the rest (recent upserts and deletes, inline parts) and
        hands it over as Arrow; the relation is the ``UNION ALL`` of both
        (:mod:`persist.duckdb_read`).  Either way its rows are exactly
        :meth:`to_arrow`'s, as a multiset (its row order is DuckDB's).  DuckDB scans
        only parts in a local directory store (:class:`~persist.blob.FileBlob`) of
        tables whose columns are all integers, floats, booleans, strings or dates;
        over an object store (S3) persist reads every part, as DuckDB's ``httpfs``
        would need the store's credentials.  Writes nothing (no lease): works on a
        readonly stash.

        Raises: as :meth:`to_arrow`; InvalidUsage: two columns whose names differ only
            in case (one name to DuckDB).
        """
        import duckdb

        self._check_open("to_duckdb")
        if con is None:
            con = duckdb.connect()
        st = self._state()
        check_duckdb_names(
            con, [*st.key_schema.names, *st.value_schema.names], f"table {self.name!r}"
        )
        t = self.resolve_as_of(st, as_of)
        if t is None:
            return con.from_arrow(self.to_arrow(t))
        return to_relation(self._ctx, self._machine, st, t, con)

    # ---------------------------------------------------------------- closing
    def close(self) -> None:
        """Close the table: wait for its writes in flight (other threads'; none commits
        after ``close`` returns), then expire its writer (its lease; the client's close
        does it too).  Afterwards every call of it (a write, a read, history,
        maintenance) raises :class:`~persist.errors.InvalidUsage` naming the table and
        that it is closed, committing nothing; ``name``, ``shard_id``, ``schema`` and
        ``key`` stay.  Idempotent (:class:`persist.closing.CloseGate`)."""
        self._gate.close()
        with self._lock:
            w, self._writer = self._writer, None
        if w is not None:
            w.expire()

    def __enter__(self) -> Table:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def exact_pandas(t: pa.Table) -> pd.DataFrame:
    """``t`` as a pandas ``DataFrame`` whose values convert back to ``t``'s exactly (see
    :meth:`Table.to_pandas`): the columns pyarrow's defaults would round or cannot hold
    are converted on their own with an exact dtype."""
    import pandas as pd

    def exact(f: pa.Field) -> Any:
        if pa.types.is_integer(f.type) and t.column(f.name).null_count:
            bits = f.type.bit_width
            return pd.api.types.pandas_dtype(
                f"{'Int' if pa.types.is_signed_integer(f.type) else 'UInt'}{bits}"
            )
        if pa.types.is_time64(f.type) and f.type.unit == "ns":
            return pd.ArrowDtype(f.type)
        if pa.types.is_floating(f.type) and pc.any(pc.is_nan(t.column(f.name))).as_py():
            # pandas reads NaN back as a null: a nullable Float column keeps NaN (a
            # value) apart from NA (a null).
            return pd.api.types.pandas_dtype(f"Float{f.type.bit_width}")
        return None

    special = {f.name: d for f in t.schema if (d := exact(f)) is not None}
    if not special:
        return t.to_pandas()
    df = t.drop_columns(list(special)).to_pandas()
    if df.shape[1] == 0:
        df = pd.DataFrame(index=pd.RangeIndex(t.num_rows))
    for i, name in enumerate(t.column_names):
        if name in special:
            series = t.column(name).to_pandas(types_mapper=lambda _t, d=special[name]: d)
            df.insert(i, name, series)
    return df


def plan_restore(live: pa.Table, target: pa.Table, w: WriteHandle) -> rows_mod.Planned:
    """The updates that turn ``live`` (consolidated, with ``_diff``) into ``target``
    (likewise): ``target`` minus ``live``, consolidated (rows equal in both cancel)."""
    names = [*w.key_schema.names, *w.value_schema.names]
    kv = pa.schema([w.schema.field(n) for n in names])
    cols = pa.schema([*kv, pa.field("_diff", pa.int64(), False)])
    now = live.select([*names, "_diff"]).cast(cols)
    now = now.set_column(len(names), cols.field("_diff"), pc.negate(now.column("_diff")))
    both = pa.concat_tables([target.cast(cols), now])
    both = both.append_column("_time", pa.array(np.zeros(both.num_rows, np.int64)))
    out = consolidate(both, w.key_schema.names, w.value_schema.names).drop_columns(["_time"])
    diffs = out.column("_diff")
    inserted = pc.sum(pc.if_else(pc.greater(diffs, 0), diffs, 0)).as_py() or 0
    retracted = -(pc.sum(pc.if_else(pc.less(diffs, 0), diffs, 0)).as_py() or 0)
    return rows_mod.Planned(out, inserted, retracted)


def create_table(
    shards: Shards, compactor: Compactor, name: str, schema: pa.Schema, key: Sequence[str]
) -> Table:
    """:meth:`PersistClient.create_table <persist.client.PersistClient.create_table>`."""
    shards.ctx.check_open()
    key_schema, value_schema = split_schema(name, schema, key)
    updates_schema(key_schema, value_schema)  # validates names and types
    ctx = shards.ctx
    shard_id = ctx.consensus.register(name, int(ctx.config.clock() * 1000))
    m = ctx.machine(shard_id)
    st = m.initialize(ShardState(shard_id, name, key_schema, value_schema), ctx.store.stamp)
    st.check_not_finalized()
    shards.adopt_store(m, st)
    if not (st.key_schema.equals(key_schema) and st.value_schema.equals(value_schema)):
        have = pa.schema([*st.key_schema, *st.value_schema])
        raise SchemaMismatch(
            repr(name),
            "*",
            f"the table exists with key {st.key_schema.names} and schema "
            f"{_fields(have)}, not key {list(key_schema.names)} and schema "
            f"{_fields(pa.schema([*key_schema, *value_schema]))}",
            "open it with client.table(name); nothing was changed",
        )
    return Table(shards, name, shard_id, compactor)


def open_table(shards: Shards, compactor: Compactor, name: str) -> Table:
    """:meth:`PersistClient.table <persist.client.PersistClient.table>`."""
    shards.ctx.check_open()
    shard_id = shards.ctx.shard_id(name)
    m = shards.ctx.machine(shard_id)
    st = m.refresh()
    if st.tombstone:
        raise InvalidUsage(f"table {name!r} ({shard_id}) was dropped: it cannot be opened")
    shards.adopt_store(m, st)
    return Table(shards, st.name, shard_id, compactor)


def _fields(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}{'' if f.nullable else ' not null'}" for f in schema)
