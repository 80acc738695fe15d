"""Row-level changes (upsert, delete, update) inside a transaction.

:meth:`Txn.upsert`, :meth:`Txn.delete` and :meth:`Txn.update` (mixed into
:class:`persist.txn.Txn` by :class:`TxnRowChanges`) take the same arguments as
:meth:`persist.write.WriteHandle.upsert` / ``delete`` / ``update`` and follow
:mod:`persist.rows`' semantics, but are committed with the rest of the transaction: all
of the transaction's shards and stash batches, or nothing.

Decided against committed state: the changes of a shard are planned by
:func:`plan_on_head`, called by :func:`persist.txn_commit.commit_shards` under the
shard machine's lock, on the very state version the transaction's one stash ``append``
is staged on (its compare-and-set is that version's seqno).  The live rows are those of
that version as of its ``upper - 1``; the shard's upper is at most the commit time
``ts`` and ``[upper, ts)`` stays empty, so they are the live rows as of ``ts - 1``; the
retractions and insertions are appended at ``ts``.  Every re-staging (a lost seqno
race, a race that moves ``ts``) plans again on the version re-staged on.

Uploads are not repeated: the changes of a shard are planned together and netted
(:func:`persist.rows.net_changes`: a row retracted and inserted again is neither, so a
change that changes nothing uploads no part) into one batch per shard, uploaded when
planned and kept while a re-plan gives the same updates (a digest of their content): a
race that did not touch the rows the changes read uploads nothing again.  A batch a
re-plan replaces is deleted when the transaction finishes, unless an attempt whose
outcome was unknown may have sent it (then GC decides).  A shard whose changes net to
nothing is still committed (its upper moves to ``ts + 1``, with no part) when the
transaction writes anything else: its commit is what checks that the rows it planned
on are still the live ones at ``ts``.  A transaction whose only writes are row changes
that changed nothing writes nothing at all (:func:`persist.txn_commit.commit_shards`):
no version, no part, no upper moved; its commit returns the time asked for, and
:meth:`TxnRowChanges.row_changes` count nothing.

Several changes to one shard in one transaction apply in order: each sees the live rows
with the earlier ones' updates applied (consolidated).  A shard takes either row-level
changes or :meth:`Txn.write` / :meth:`Txn.write_batches` in one transaction, not both
(refused with :class:`~persist.errors.InvalidUsage`).

Sources of the idea: Materialize's ``src/txn-wal`` (writes of many shards made visible
by one commit; a lost race retried at a later timestamp) with its storage controller's
read-then-``compare_and_append`` of table writes; pyiceberg's ``Transaction``
(``pyiceberg/table/__init__.py``: ``upsert``, ``delete`` and ``overwrite`` staged in a
transaction and checked against the snapshot committed on).
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa
import pyarrow.compute as pc

from persist import rows as rows_mod
from persist.batch import Batch
from persist.errors import CorruptPart, InvalidUsage, SchemaMismatch
from persist.filters import apply_filter, check_filter, update_filter
from persist.merge_into import MergeBuilder, as_source, check_spec, plan_on_read, read_filter
from persist.merge_plan import MergeCounts, MergeResult, MergeSpec
from persist.parts import DIFF, TIME
from persist.rows import Planned, RowChanges
from persist.state import ShardState, token_entry
from persist.write import WriteHandle
from stash import Antichain
from stash.antichain import I64_MIN

if TYPE_CHECKING:
    from persist.machine import ShardMachine

__all__ = ["RowOp", "ShardRowChanges", "ShardWrites", "TxnRowChanges", "plan_on_head"]

#: The raw time of a transaction's updates (as :data:`persist.txn.RAW_TIME`).
RAW_TIME = I64_MIN
#: Plans of one shard per staging before giving up (a part GC'd under the read, or
#: the writer registered by the first upload, moves the version planned on).
PLAN_ATTEMPTS = 5

Kind = Literal["upsert", "delete", "update", "merge"]


@dataclass(frozen=True)
class RowOp:
    """One row-level change of a transaction: ``kind`` and its checked arguments
    (``rows`` for an upsert, conformed; ``filter`` and ``set`` for a delete/update)."""

    kind: Kind
    rows: pa.Table | None = None
    filter: pc.Expression | None = None
    set: Mapping[str, Any] | None = None
    row_filter: bool = True
    merge: MergeSpec | None = None
    #: a merge's counts as last planned (a one-element list, replaced by each plan)
    merge_counts: list[MergeCounts] = field(default_factory=list)


@dataclass
class ShardRowChanges:
    """The row-level changes of one transaction to one shard, and their uploads.

    Attributes:
        ops: the changes in the order given, with their index in the transaction.
        planned: the batch of the shard's updates as last planned (``None`` before
            the first plan, or when there are none), and ``digest`` their content's.
        replaced: batches a re-plan replaced (deleted when the transaction finishes).
        results: per change, its counts as last planned (``time`` filled on commit).
        uploads: how many planned batches were written (for tests and metrics).
        planned_on: ``(seqno, ts)`` of the version last planned on for a commit at
            ``ts`` (``None``: never planned); the commit at ``ts`` stages on that
            version only.
    """

    ops: list[tuple[int, RowOp]] = field(default_factory=list)
    planned: Batch | None = None
    digest: bytes | None = None
    replaced: list[Batch] = field(default_factory=list)
    results: dict[int, tuple[int, int]] = field(default_factory=dict)
    uploads: int = 0
    keep_replaced: bool = False
    planned_on: tuple[int, int] | None = None


def upload(w: WriteHandle, updates: pa.Table) -> Batch:
    """Write ``updates`` (key and value columns and ``_diff``) as a transaction batch
    at :data:`RAW_TIME` (a commit at ``ts`` rewrites its time, metadata only)."""
    t = updates.append_column(
        pa.field(TIME, pa.int64(), False), pa.repeat(pa.scalar(RAW_TIME, pa.int64()), len(updates))
    )
    t = w._normalize(t)
    builder = w.builder(Antichain.from_elem(RAW_TIME))
    try:
        builder.add(t)
        return builder.finish(Antichain.from_elem(RAW_TIME + 1))
    except BaseException:
        builder.abort()
        raise


def _digest(updates: pa.Table) -> bytes:
    """A digest of ``updates``' content, independent of row order when it can be
    sorted."""
    try:
        updates = updates.sort_by([(n, "ascending") for n in updates.column_names])
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        pass  # a column Arrow cannot sort: the order of the (deterministic) plan
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, updates.schema) as out:
        out.write_table(updates)
    return hashlib.sha256(sink.getvalue().to_pybytes()).digest()


def _with_earlier(
    live: pa.Table,
    earlier: list[pa.Table],
    filter: pc.Expression | None,
    schema: pa.Schema,
    keys: list[str],
    values: list[str],
) -> pa.Table:
    """The live rows ``live`` (those ``filter`` keeps) with the ``earlier`` changes'
    updates applied, consolidated as a shard consolidates them
    (:func:`persist.rows.net_changes`), then ``filter`` applied: the earlier updates
    are first filtered as updates are (:func:`persist.filters.update_filter`: every
    update of a row the filter keeps, whichever zero or NaN it holds)."""
    if not earlier:
        return live
    names = [*keys, *values]
    prior = pa.concat_tables(earlier)
    if filter is not None:
        prior = apply_filter(prior, update_filter(filter, schema))
    parts = [live.select([*names, DIFF]), prior]
    both = rows_mod.net_changes(parts, keys, values, consolidated=True).updates
    return both if filter is None else apply_filter(both, filter)


def _plan_op(
    op: RowOp,
    read: Callable[[pc.Expression | None], pa.Table],
    schema: pa.Schema,
    keys: list[str],
    values: list[str],
) -> Planned:
    """One change planned on ``read`` (:mod:`persist.rows`, as the handle plans it)."""
    if op.kind == "merge":
        assert op.merge is not None and op.rows is not None
        data = pa.schema([schema.field(n) for n in [*keys, *values]])
        planned, counts = plan_on_read(read, op.rows, op.merge, data, keys)
        op.merge_counts[:] = [counts]
        return planned
    if op.kind == "upsert":
        assert op.rows is not None
        rows = op.rows
        live = read(rows_mod.key_filter(rows, keys)) if rows.num_rows else schema.empty_table()
        return rows_mod.plan_upsert(live, rows, keys, values)
    if op.kind == "delete":
        return rows_mod.plan_delete(read(op.filter), keys, values)
    assert op.set is not None
    live = read(op.filter)
    at_new = None
    if rows_mod.changes_key(op.set, keys) and live.num_rows:
        new = rows_mod.new_values(live, op.set, [*keys, *values])
        at_new = read(rows_mod.key_filter(new, keys))
    return rows_mod.plan_update(live, op.set, keys, values, at_new)


def plan_changes(
    rc: ShardRowChanges,
    read: Callable[[pc.Expression | None], pa.Table],
    schema: pa.Schema,
    keys: list[str],
    values: list[str],
) -> pa.Table:
    """Plan every change of ``rc`` in order on the live rows ``read`` gives (each
    change seeing the earlier ones' updates), record their counts in ``rc.results``,
    and return the shard's updates (key and value columns and ``_diff``): every
    change's, netted together (:func:`persist.rows.net_changes`).

    Raises:
        InvalidUsage: a change refused by its planning (see :mod:`persist.rows`).
    """
    names = [*keys, *values]
    out_schema = pa.schema([schema.field(n) for n in names] + [pa.field(DIFF, pa.int64(), False)])
    earlier: list[pa.Table] = []  # every planned update so far
    for i, op in rc.ops:

        def read_op(filter: pc.Expression | None) -> pa.Table:
            return _with_earlier(read(filter), earlier, filter, schema, keys, values)

        planned = _plan_op(op, read_op, schema, keys, values)
        earlier.append(planned.updates.cast(out_schema))
        rc.results[i] = (planned.inserted, planned.retracted)
    if not earlier:
        return out_schema.empty_table()
    return rows_mod.net_changes(earlier, keys, values).updates


def plan_on_head(sw: ShardWrites, m: ShardMachine, ts: int, token: str) -> None:
    """Plan the row-level changes of ``sw`` (a shard with :attr:`ShardWrites.rows`) on
    ``m``'s head version, the one the commit at ``ts`` is staged on, uploading their
    batch only when its content changed; ``sw.batches`` then holds it, and
    ``sw.rows.planned_on`` that version's seqno and ``ts``.  The caller holds NO machine lock (the
    upload's writer registration may run in a pool thread, and needs ``m``'s); a
    version moved by the planning itself (the writer registered by its upload) is
    planned on again.  A shard whose upper is beyond ``ts`` is not
    planned (the staging reports the race), nor one whose state records ``token`` (an
    earlier attempt of the transaction landed: the staging reports it).

    Raises:
        SchemaMismatch: the shard's schema evolved since the change was added.
        InvalidUsage: a change refused by its planning; nothing is committed.
        CorruptPart: a part of the head version is missing or corrupt.
    """
    rc = sw.rows
    assert rc is not None
    w = sw.writer
    keys, values = list(w.key_schema.names), list(w.value_schema.names)
    for attempt in range(PLAN_ATTEMPTS):
        st = m.recent()
        if st.tombstone or not st.upper.less_equal(ts) or token_entry(st, "", token) is not None:
            rc.planned_on = (st.seqno, ts)
            return  # refused, a race or landed: the staging says which
        newest = st.schemas().newest
        if newest != w.schema_id:
            raise SchemaMismatch(
                repr(sw.name),
                "*",
                f"a row change needs the shard's newest schema version {newest}",
                f"the transaction's change was added under version {w.schema_id}; "
                "nothing was committed",
            )

        def read(filter: pc.Expression | None, st: ShardState = st) -> pa.Table:
            return w.read_live(st, filter)

        try:
            updates = plan_changes(rc, read, w.schema, keys, values)
        except CorruptPart as e:
            if not e.missing or attempt + 1 == PLAN_ATTEMPTS:
                raise
            m.refresh()  # a GC raced the version read: plan on the latest
            continue
        _use(sw, updates)
        if m.recent().seqno == st.seqno:
            rc.planned_on = (st.seqno, ts)
            return
    raise InvalidUsage(  # pragma: no cover - the version keeps moving under the lock
        f"shard {sw.name!r}: its version moved under every plan of the transaction's "
        "row changes (nothing was committed)"
    )


def _use(sw: ShardWrites, updates: pa.Table) -> None:
    """Make ``updates`` the shard's planned batch, uploading it only if its content
    differs from the current one's (none when there are no updates)."""
    rc = sw.rows
    assert rc is not None
    d = _digest(updates)
    if rc.digest == d:
        return
    old = rc.planned
    new = upload(sw.writer, updates) if updates.num_rows else None
    if new is not None:
        rc.uploads += 1
        sw.batches.append(new)
        sw.lent[id(new)] = sw.writer
    if old is not None:
        sw.batches.remove(old)
        rc.replaced.append(old)
    rc.planned, rc.digest = new, d


def settle_replaced(sw: ShardWrites) -> None:
    """Delete the batches re-plans replaced (never committed), or leave them to GC
    when an attempt whose outcome was unknown may have sent one."""
    rc = sw.rows
    if rc is None:
        return
    for b in rc.replaced:
        if rc.keep_replaced:
            b.mark_consumed()
        else:
            b.delete()
    rc.replaced.clear()


class TxnRowChanges:
    """The row-level changes of :class:`persist.txn.Txn` (mixed into it)."""

    _shards: dict[str, ShardWrites]
    _row_ops: list[tuple[str, int]]  # (shard id, index) in the order given
    committed_ts: int | None

    def _check_changeable(self) -> None:  # pragma: no cover - Txn's
        raise NotImplementedError

    def _writer_for(
        self, shard: str | WriteHandle, key_schema: pa.Schema | None, value_schema: pa.Schema | None
    ) -> WriteHandle:  # pragma: no cover - Txn's
        raise NotImplementedError

    def upsert(self, shard: str | WriteHandle, rows: pa.Table | pa.RecordBatch) -> None:
        """Replace, for each row of ``rows``, every live row of ``shard`` with its key by
        it, when the transaction commits (:mod:`persist.txn_rows`; the semantics of
        :meth:`persist.write.WriteHandle.upsert`).  The rows are uploaded when the
        commit plans them (only those that change a live row).

        Args:
            shard: an existing shard's name, or a write handle of this client.
            rows: a pyarrow ``Table``/``RecordBatch`` of exactly the shard's key and
                value columns (no ``_time`` or ``_diff``), each key at most once.

        Raises:
            InvalidUsage: unknown shard; bad columns; two rows with one key (naming the
                key columns); a shard this transaction also writes with ``write``; a
                finished transaction.  Nothing is added.
            SchemaMismatch: the handle's schema version is not the shard's newest, or
                not that of the transaction's earlier changes to the shard.
        """
        self._check_changeable()
        w = self._row_writer(shard)
        table = rows_mod.conform_rows(rows, w.schema, f"Txn.upsert into shard {w.name!r}")
        rows_mod.check_distinct_keys(table, w.key_schema.names)
        self._add_op(self._row_shard(w), RowOp("upsert", rows=table))

    def delete(self, shard: str | WriteHandle, filter: pc.Expression) -> None:
        """Retract every live row of ``shard`` that ``filter`` (a boolean
        ``pyarrow.compute`` expression over its columns) keeps, when the transaction
        commits (the semantics of :meth:`persist.write.WriteHandle.delete`).

        Raises:
            InvalidUsage: unknown shard; a bad filter; as :meth:`upsert`.
        """
        self._check_changeable()
        w = self._row_writer(shard)
        keys, values = w.key_schema.names, w.value_schema.names
        _, row = check_filter(filter, w.schema, keys, values)
        self._add_op(self._row_shard(w), RowOp("delete", filter=filter, row_filter=row))

    def update(
        self, shard: str | WriteHandle, filter: pc.Expression, set: Mapping[str, Any]
    ) -> None:
        """Retract every live row of ``shard`` that ``filter`` keeps and insert it again
        with ``set`` (``{column: scalar | pyarrow.compute expression}``, evaluated on
        the old row), when the transaction commits (the semantics of
        :meth:`persist.write.WriteHandle.update`).

        Raises:
            InvalidUsage: unknown shard; a bad filter or ``set`` (a scalar that does
                not fit its column exactly, :func:`persist.rows.set_scalar`, is refused
                here, before anything is staged); as :meth:`upsert`.  An expression
                result that does not fit its column, or key columns changed onto a
                live key, is refused by :meth:`commit` (nothing committed).
            SchemaMismatch: as :meth:`upsert`.
        """
        self._check_changeable()
        w = self._row_writer(shard)
        keys, values = w.key_schema.names, w.value_schema.names
        _, row = check_filter(filter, w.schema, keys, values)
        changes = rows_mod.check_set(set, w.schema, keys, values)
        op = RowOp("update", filter=filter, set=changes, row_filter=row)
        self._add_op(self._row_shard(w), op)

    def merge(
        self,
        shard: str | WriteHandle,
        source: Any,
        on: Sequence[str] | None = None,
        source_alias: str = "source",
        target_alias: str = "target",
    ) -> MergeBuilder[None]:
        """A MERGE INTO ``shard`` when the transaction commits: the builder of
        :meth:`persist.write.WriteHandle.merge` (the same clauses and semantics), whose
        ``execute()`` adds the merge to the transaction instead of committing it.  Its
        :class:`~persist.MergeResult` is in :meth:`merge_results` after the commit.

        Raises:
            InvalidUsage: unknown shard; a bad source, ``on`` or aliases; as
                :meth:`upsert`.  Bad clauses are refused by :meth:`commit` (nothing
                committed).
        """
        self._check_changeable()
        w = self._row_writer(shard)
        src = as_source(source)
        keys = w.key_schema.names
        spec = check_spec(on, source_alias, target_alias, keys)
        data = pa.schema([w.schema.field(n) for n in [*keys, *w.value_schema.names]])

        def stage(spec: MergeSpec) -> None:
            self._check_changeable()
            read_filter(src, spec, data, keys)  # a bad source is refused now
            self._add_op(self._row_shard(w), RowOp("merge", rows=src, merge=spec))

        return MergeBuilder(spec, stage)

    def merge_results(self) -> list[MergeResult]:
        """The committed merges' results, in the order they were added (the counts of
        the last plan, as :meth:`row_changes` says).

        Raises:
            InvalidUsage: the transaction has not committed.
        """
        if self.committed_ts is None:
            raise InvalidUsage("merge_results: the transaction has not committed")
        out = []
        for sid, i in self._row_ops:
            rc = self._shards[sid].rows
            assert rc is not None
            op = dict(rc.ops)[i]
            if op.kind == "merge":
                counts = op.merge_counts[0] if op.merge_counts else MergeCounts()
                out.append(counts.result(self.committed_ts))
        return out

    def row_changes(self) -> list[RowChanges]:
        """The committed row-level changes' outcomes, in the order they were added
        (counts with multiplicity, as :class:`persist.rows.RowChanges`).  The counts
        are those of the last plan; when a commit whose acknowledgement was lost turns
        out to have landed, they may be those of a later re-plan than the one that
        landed (the rows themselves are exactly the landed plan's).

        Raises:
            InvalidUsage: the transaction has not committed.
        """
        if self.committed_ts is None:
            raise InvalidUsage("row_changes: the transaction has not committed")
        out = []
        for sid, i in self._row_ops:
            rc = self._shards[sid].rows
            assert rc is not None
            ins, ret = rc.results.get(i, (0, 0))
            out.append(RowChanges(self.committed_ts, ins, ret))
        return out

    # ------------------------------------------------------------------ helpers
    def _row_writer(self, shard: str | WriteHandle) -> WriteHandle:
        """The writer of a row change to ``shard``, checked: the shard takes row
        changes in this transaction, and the writer has the shard's newest schema
        version (as the state last read knows it; the commit checks again) and that of
        the transaction's earlier changes to it (their rows name the same columns).

        Raises:
            InvalidUsage: the transaction writes the shard with ``write``.
            SchemaMismatch: naming the shard and both versions; nothing is added.
        """
        w = self._writer_for(shard, None, None)
        sw = self._shards.get(w.shard_id)
        if sw is not None and sw.rows is None:
            raise InvalidUsage(
                f"shard {w.name!r}: this transaction already writes it with write or "
                "write_batches; one transaction takes either row-level changes or "
                "updates for a shard, not both (nothing was added)"
            )
        newest = w._machine.recent().schemas().newest
        if w.schema_id != newest:
            raise SchemaMismatch(
                repr(w.name),
                "*",
                f"a row change needs the shard's newest schema version {newest}",
                f"this handle has version {w.schema_id}; nothing was added",
            )
        if sw is not None and sw.writer.schema_id != w.schema_id:
            raise SchemaMismatch(
                repr(w.name),
                "*",
                f"the transaction's earlier changes to the shard have schema version "
                f"{sw.writer.schema_id}",
                f"this change has version {w.schema_id}; nothing was added",
            )
        return w

    def _row_shard(self, w: WriteHandle) -> ShardWrites:
        sw = self._shards.get(w.shard_id)
        if sw is None:
            sw = self._shards[w.shard_id] = ShardWrites(w.name, w, rows=ShardRowChanges())
        return sw

    def _add_op(self, sw: ShardWrites, op: RowOp) -> None:
        rc = sw.rows
        assert rc is not None
        if not op.row_filter and rc.ops or any(not o.row_filter for _, o in rc.ops):
            raise InvalidUsage(
                f"shard {sw.name!r}: a filter reading _time or _diff is taken only by the "
                "sole row-level change of a shard in a transaction (nothing was added)"
            )
        i = len(self._row_ops)
        rc.ops.append((i, op))
        self._row_ops.append((sw.writer.shard_id, i))


@dataclass
class ShardWrites:
    """What a transaction writes to one shard."""

    name: str
    writer: WriteHandle
    batches: list[Batch] = field(default_factory=list)
    # The writer id this transaction alone records its token under in this shard's
    # state: it appends once, so the token is its ``last_token`` and no later append
    # (through a shared or the caller's handle) can push it out.
    record_id: str = field(default_factory=lambda: "w" + uuid.uuid4().hex)
    lent: dict[int, WriteHandle] = field(default_factory=dict)  # batch id -> its builder's handle
    # The batches added by write_batches (written elsewhere: possibly copies of a batch
    # the shard already has), checked against the version committed on.
    given: list[Batch] = field(default_factory=list)
    # Its row-level changes (persist.txn_rows), planned on the version staged on.
    rows: ShardRowChanges | None = None
    # False when the commit wrote nothing to the shard (its changes changed nothing).
    wrote: bool = True
