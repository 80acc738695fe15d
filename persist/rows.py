"""Row-level changes on a shard: upsert, delete and update, planned as plain updates.

A shard's key columns identify a row.  A change is one ``compare_and_append`` of
retractions plus insertions at one new time ``t = upper``, planned on the consolidated
live rows as of ``upper - 1`` of the *same* state version whose upper the append
expects; a lost race (``UpperMismatch``) re-reads and re-plans.  So the changes of one
shard are serializable, and each is exact by construction.  The peers' row-level
operations this follows: delta-rs ``DeltaTable.merge`` / ``.delete`` / ``.update`` and
pyiceberg ``Table.upsert`` / ``.delete``; the read-then-compare-and-append loop is
Materialize's persist-client ``compare_and_append`` contract (``src/persist-client/src/
write.rs``), used as its storage controller uses it for tables.

This module holds :class:`RowChanges` (the result), the pure planning
(:func:`plan_upsert`, :func:`plan_delete`, :func:`plan_update`: live rows and a change
in, updates to append out; no I/O) and :func:`apply_change`, the read-plan-append loop
over a writer (:class:`ChangeWriter`: what :class:`persist.write.WriteHandle` offers).

Semantics (decisions recorded here):

* live rows are the consolidated snapshot: one row per distinct (key, value) with its
  count (``_diff``, which raw appends may make other than 1); a change retracts a live
  row with ``_diff = -count``, so the row is gone whatever its count;
* **upsert**: each incoming row replaces every live row with its key (all of them, so
  after an upsert a key has exactly one live row with ``_diff`` 1); two incoming rows
  with one key raise ``InvalidUsage`` naming the key columns, nothing committed;
* **delete**: every live row the filter keeps is retracted;
* **update**: every live row the filter keeps is retracted and re-inserted with the
  ``set`` values, keeping its count; a ``set`` value is a scalar or a
  ``pyarrow.compute`` expression evaluated on the old row;
* **an update may change key columns**; it is refused (``InvalidUsage``, nothing
  committed) when the result would give two live rows one key that did not share it
  before, checked per row: updated rows of different old keys mapped to one key, or a
  row whose key changes mapped onto the key of a live row the update keeps.  So a shard
  used with upsert keeps one live row per key through updates;
* keys are compared by :mod:`persist.key_identity` (as consolidation compares them:
  ``-0.0`` = ``0.0``, NaN = NaN, nulls equal, temporal values to the tick), and
  ``set`` scalars are converted exactly or refused before anything is read;
* **a change is netted** (:func:`net_changes`): its retractions and insertions are
  summed per row as consolidation sums them, so a row equal to its live row (an upsert
  of the same row, an update whose ``set`` changes nothing) is neither retracted nor
  inserted; ``inserted`` and ``retracted`` count what is left, with multiplicity (the
  rows the change adds to and removes from the live multiset);
* **a change that changes nothing writes nothing**: no part and no new state version
  (the upper does not move); its :class:`RowChanges` has ``time = upper - 1`` of the
  version read (the shard held the result as of that time already) and zero counts;
* a change from a handle of an older schema version than the shard's newest is refused
  (``SchemaMismatch``): its rows could not name the newer columns, so its retractions
  would not cancel the live rows.  Rows written under older versions are conformed to
  the handle's (the newest) view before they are compared or retracted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from persist import key_identity
from persist.casts import cast_column, set_scalar
from persist.commit_note import note_rows, noting_unless_noted
from persist.consolidation import consolidate
from persist.errors import CorruptPart, InvalidUsage, PersistError, UpperMismatch
from persist.parts import DIFF, TIME
from persist.state import ShardState

__all__ = [
    "ChangeContended",
    "ChangeWriter",
    "Planned",
    "RowChanges",
    "apply_change",
    "check_distinct_keys",
    "check_unique_keys",
    "key_filter",
    "plan_delete",
    "plan_update",
    "plan_upsert",
    "with_keys_of",
]

#: Attempts of one change before :class:`ChangeContended` (each re-reads and re-plans).
CHANGE_ATTEMPTS = 50


@dataclass(frozen=True)
class RowChanges:
    """The outcome of a committed row-level change.

    Attributes:
        time: the time the change committed at (int); the shard's upper was then
            ``time + 1``.  A change that changed nothing commits nothing: ``time`` is
            then ``upper - 1`` of the state version it read (a read as of ``time``
            already shows its result), and both counts are 0.  In a transaction,
            ``time`` is always the transaction's commit time.
        inserted: rows the change added to the live rows (with multiplicity; int >= 0;
            a row equal to its live row is not counted).
        retracted: rows the change removed from the live rows (with multiplicity;
            int >= 0).
    """

    time: int
    inserted: int
    retracted: int


@dataclass(frozen=True)
class Planned:
    """A planned change: ``updates`` (the key and value columns and ``_diff``, int64;
    no ``_time``) to append at one time, and its counts."""

    updates: pa.Table
    inserted: int
    retracted: int


class ChangeContended(UpperMismatch):
    """A row-level change lost the race for the shard's upper on every attempt.
    Nothing was committed.  Attributes: ``shard`` (str), ``attempts`` (int) and those of
    :class:`UpperMismatch` (of the last attempt)."""

    def __init__(self, shard: str, attempts: int, last: UpperMismatch) -> None:
        super().__init__(last.expected, last.current)
        self.shard = shard
        self.attempts = attempts
        self.args = (
            f"shard {shard}: row change lost the race for the upper {attempts} times "
            f"(last: expected {last.expected}, current upper is {last.current}); "
            "nothing was committed",
        )


# ------------------------------------------------------------------------ planning
def _retractions(live: pa.Table, names: Sequence[str]) -> pa.Table:
    return live.select(list(names)).append_column(DIFF, pc.negate(live.column(DIFF)))


def _with_diff(rows: pa.Table, diff: pa.ChunkedArray | int) -> pa.Table:
    if isinstance(diff, int):
        return rows.append_column(DIFF, pa.repeat(pa.scalar(diff, pa.int64()), rows.num_rows))
    return rows.append_column(DIFF, diff)


def _out_schema(schema: pa.Schema, names: Sequence[str]) -> pa.Schema:
    return pa.schema([schema.field(n) for n in names] + [pa.field(DIFF, pa.int64(), False)])


#: Same-key (retraction, insertion) pairs per update above which :func:`net_changes`
#: consolidates every update instead of comparing the pairs (keys with many live rows).
PAIRS_PER_UPDATE = 4


def _cancelling(
    both: pa.Table, key_names: Sequence[str], value_names: Sequence[str]
) -> pa.Array | None:
    """The positions of the rows of ``both`` (updates) that may cancel another one: a
    retraction and an insertion equal by key identity
    (:func:`persist.key_identity.identity_columns` of the key, then of the value
    columns), found by a hash join on the key and an element-wise comparison of the
    values of each same-key pair; ``None`` when there are too many pairs to compare
    (:data:`PAIRS_PER_UPDATE`)."""
    diff = both.column(DIFF)
    rows = pa.array(np.arange(both.num_rows, dtype=np.int64))
    neg, pos = rows.filter(pc.less(diff, 0)), rows.filter(pc.greater(diff, 0))
    if not len(neg) or not len(pos):
        return pa.array([], pa.int64())
    if not key_names:
        return None
    kid = key_identity.identity_columns(both, key_names)
    pairs = (
        kid.take(neg)
        .append_column("\x00neg", neg)
        .join(
            kid.take(pos).append_column("\x00pos", pos),
            keys=kid.column_names,
            join_type="inner",
            use_threads=False,
        )
    )
    if pairs.num_rows > PAIRS_PER_UPDATE * both.num_rows:
        return None
    a, b = pairs.column("\x00neg"), pairs.column("\x00pos")
    va, vb = key_identity.aligned([both.take(a), both.take(b)], value_names)
    same = pa.repeat(pa.scalar(True), pairs.num_rows)
    for x, y in zip(va.columns, vb.columns, strict=True):
        same = pc.and_(same, pc.equal(x, y))
    return pc.unique(
        pa.concat_arrays([a.filter(same).combine_chunks(), b.filter(same).combine_chunks()])
    )


def net_changes(
    parts: Sequence[pa.Table],
    key_names: Sequence[str],
    value_names: Sequence[str],
    *,
    consolidated: bool = False,
    retracting: Sequence[bool] | None = None,
) -> Planned:
    """The updates ``parts`` (key and value columns and ``_diff``, one schema) with
    every retraction and insertion of one row summed as consolidation sums them
    (:func:`persist.consolidation.consolidate`: equal rows by its equality, ``-0.0`` =
    ``0.0``, NaN = NaN, nulls equal), zero sums dropped, with their counts.  So a row retracted
    and inserted again by one change (an upsert or update that changes nothing) is
    neither written nor counted.  The one count of a change, for every path.

    Counts are by role when ``retracting`` says, per part, whether it holds the
    change's retractions (the live rows it removes, whatever the sign of their diffs:
    a live row of count -1 is retracted with ``_diff`` +1) or its insertions:
    ``retracted`` is the retractions' absolute diffs and ``inserted`` the insertions',
    each less what cancelled between the two (per row, ``(|r| + |i| - |r + i|) / 2``
    for its retraction ``r`` and insertion ``i``).  Without ``retracting``, by sign:
    ``inserted`` the positive net diffs, ``retracted`` the negative ones (absolute).

    Only the rows that may cancel (:func:`_cancelling`: a cheap same-key comparison) are
    consolidated, unless ``consolidated``: then all of them are (one row per distinct
    row: the live rows a table of updates gives).  Either way the counts are those of
    the full consolidation.

    Raises:
        DiffOverflow: a row's diffs sum beyond int64.
    """
    names = [*key_names, *value_names]
    if not parts:
        raise ValueError("net_changes: no updates")
    schema = _out_schema(parts[0].schema, names)
    both = pa.concat_tables([p.select([*names, DIFF]).cast(schema) for p in parts])
    which = None if consolidated else _cancelling(both, key_names, value_names)
    if which is None or len(which):
        chosen = both if which is None else both.take(which)
        chosen = chosen.append_column(TIME, pa.repeat(pa.scalar(0, pa.int64()), chosen.num_rows))
        net = consolidate(chosen, key_names, value_names).select([*names, DIFF])
        if which is not None:
            keep = np.ones(both.num_rows, dtype=bool)
            keep[np.asarray(which.to_numpy(), dtype=np.int64)] = False
            net = pa.concat_tables([both.filter(pa.array(keep)), net])
        both = net
    diff = both.column(DIFF)
    if retracting is None:
        inserted = int(pc.sum(pc.max_element_wise(diff, 0)).as_py() or 0)
        retracted = int(pc.sum(pc.max_element_wise(pc.negate(diff), 0)).as_py() or 0)
        return Planned(both, inserted, retracted)
    by_role = [0, 0]  # insertions, retractions: their absolute diffs
    for part, role in zip(parts, retracting, strict=True):
        by_role[role] += int(pc.sum(pc.abs(part.column(DIFF))).as_py() or 0)
    net = int(pc.sum(pc.abs(diff)).as_py() or 0)
    cancelled = (by_role[0] + by_role[1] - net) // 2
    return Planned(both, by_role[0] - cancelled, by_role[1] - cancelled)


def conform_rows(rows: pa.Table | pa.RecordBatch, schema: pa.Schema, what: str) -> pa.Table:
    """``rows`` as a table with exactly the key and value columns of ``schema`` (the
    updates schema; its ``_time`` and ``_diff`` are not taken), in its order and types.

    Raises:
        InvalidUsage: ``rows`` is not an Arrow table/batch, lacks a column, has one
            that is not a key or value column (``_time`` and ``_diff`` included), or a
            value does not fit its column's type.
    """
    if isinstance(rows, pa.RecordBatch):
        rows = pa.Table.from_batches([rows])
    if not isinstance(rows, pa.Table):
        raise InvalidUsage(f"{what}: rows must be a pyarrow Table or RecordBatch")
    names = [n for n in schema.names if n not in (TIME, DIFF)]
    extra = [n for n in rows.column_names if n not in names]
    missing = [n for n in names if n not in rows.column_names]
    if extra or missing:
        raise InvalidUsage(
            f"{what}: rows must have exactly the key and value columns {names}"
            f"{f'; unknown {extra}' if extra else ''}{f'; missing {missing}' if missing else ''}"
        )
    target = pa.schema([schema.field(n) for n in names])
    try:
        return rows.select(names).cast(target)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, ValueError) as e:
        # ValueError: nulls in a non-nullable column
        raise InvalidUsage(f"{what}: rows do not fit the shard's columns {target}: {e}") from None


key_filter = key_identity.key_filter


def check_distinct_keys(rows: pa.Table, key_names: Sequence[str]) -> None:
    """Check the keys of ``rows`` distinct by key identity
    (:func:`persist.key_identity.duplicate_key`).

    Raises:
        InvalidUsage: two rows have one key (naming the key columns and the key).
    """
    at = key_identity.duplicate_key(rows, key_names)
    if at is not None:
        raise InvalidUsage(
            f"upsert: two rows have one key {list(key_names)} = "
            f"{key_identity.show_key(rows, key_names, at)}; each key may appear once; nothing was committed"
        )


#: The former name of :func:`check_distinct_keys`.
check_unique_keys = check_distinct_keys


def with_keys_of(live: pa.Table, rows: pa.Table, key_names: Sequence[str]) -> pa.Table:
    """The rows of ``live`` whose key is one of ``rows``' (key identity:
    :func:`persist.key_identity.isin`)."""
    return live.filter(key_identity.isin(live, rows, key_names))


def plan_upsert(
    live: pa.Table,
    rows: pa.Table,
    key_names: Sequence[str],
    value_names: Sequence[str],
    *,
    net: bool = True,
) -> Planned:
    """Retract every live row whose key is one of ``rows``' and insert ``rows``, netted
    (:func:`net_changes`): a row equal to its key's one live row is left alone.

    Args:
        live: consolidated live rows (key, value columns, ``_diff``; any other columns
            ignored), at least those with the keys of ``rows``.
        rows: the incoming rows (exactly the key and value columns: :func:`conform_rows`).
        net: ``False`` for a caller that writes ``rows`` itself, whatever the live
            rows (a stream sink's tasks): then every live row with a key of ``rows``
            is retracted and every row of ``rows`` inserted, not netted (counts: all
            of them).

    Raises:
        InvalidUsage: two rows of ``rows`` have one key (naming the key columns and the
            key).
    """
    names = [*key_names, *value_names]
    check_distinct_keys(rows, key_names)
    old = with_keys_of(live, rows, key_names)
    parts = [_retractions(old, names), _with_diff(rows.select(names), 1)]
    if net:
        return net_changes(parts, key_names, value_names, retracting=(True, False))
    schema = _out_schema(rows.schema, names)
    retracted = int(pc.sum(pc.abs(old.column(DIFF))).as_py() or 0)
    return Planned(pa.concat_tables([p.cast(schema) for p in parts]), rows.num_rows, retracted)


def plan_delete(live: pa.Table, key_names: Sequence[str], value_names: Sequence[str]) -> Planned:
    """Retract every row of ``live`` (the live rows the delete's filter keeps)."""
    names = [*key_names, *value_names]
    return net_changes([_retractions(live, names)], key_names, value_names, retracting=(True,))


def check_set(
    set: Mapping[str, Any], schema: pa.Schema, key_names: Sequence[str], value_names: Sequence[str]
) -> dict[str, Any]:
    """``set`` checked, before anything is read or staged: a mapping of key or value
    column names to scalars or ``pyarrow.compute`` expressions; the scalars returned
    converted to their column's type exactly (:func:`set_scalar`), whether or not a
    row will match.

    Raises:
        InvalidUsage: ``set`` is not a mapping, is empty, names a column that is not a
            key or value column (``_time`` and ``_diff`` included), holds a scalar that
            does not fit its column (:func:`set_scalar`), or an expression that does
            not apply to the columns (e.g. an unknown field).
    """
    if not isinstance(set, Mapping) or not set:
        raise InvalidUsage("update: set must be a non-empty {column: scalar | expression}")
    names = [*key_names, *value_names]
    bad = [c for c in set if c not in names]
    if bad:
        raise InvalidUsage(f"update: set names {bad}, which are not key or value columns {names}")
    exprs = {c: v for c, v in set.items() if isinstance(v, pc.Expression)}
    if exprs:  # bound against the columns now, even if no row will match
        try:
            ds.dataset(schema.empty_table()).to_table(columns=exprs)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            raise InvalidUsage(
                f"update: a set expression does not apply to the rows: {e}"
            ) from None
    return {
        c: v if isinstance(v, pc.Expression) else set_scalar(v, schema.field(c), c)
        for c, v in set.items()
    }


def new_values(old: pa.Table, set: Mapping[str, Any], names: Sequence[str]) -> pa.Table:
    """``old``'s ``names`` columns with those of ``set`` (checked by :func:`check_set`)
    replaced: a scalar repeated, an expression evaluated on the old row and cast
    safely to the column's type.

    Raises:
        InvalidUsage: an expression result does not fit its column (naming it), or an
            expression Arrow cannot evaluate on the rows.
    """
    exprs = {c: v for c, v in set.items() if isinstance(v, pc.Expression)}
    evaluated: dict[str, pa.ChunkedArray] = {}
    if exprs and old.num_rows:
        try:
            evaluated = dict(
                zip(exprs, ds.dataset(old).to_table(columns=exprs).columns, strict=True)
            )
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            raise InvalidUsage(f"update: a set expression cannot be evaluated: {e}") from None
    cols: list[pa.Array | pa.ChunkedArray] = []
    for n in names:
        field = old.schema.field(n)
        if n not in set:
            cols.append(old.column(n))
            continue
        v = set[n]
        if n in evaluated:
            cols.append(
                cast_column(evaluated[n], field, f"update: set expression for column {n!r}")
            )
            continue
        try:
            if isinstance(v, pc.Expression):
                arr = pa.array([], field.type)
            else:
                scalar = v if isinstance(v, pa.Scalar) else set_scalar(v, field, n)
                arr = pa.repeat(scalar.cast(field.type), old.num_rows)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            raise InvalidUsage(f"update: set value for column {n!r} ({field.type}): {e}") from None
        if not field.nullable and arr.null_count:
            raise InvalidUsage(f"update: set gives nulls to the non-nullable column {n!r}")
        cols.append(arr)
    return pa.Table.from_arrays(cols, schema=pa.schema([old.schema.field(n) for n in names]))


def changes_key(set: Mapping[str, Any], key_names: Sequence[str]) -> bool:
    """Whether an update's ``set`` touches a key column."""
    return any(k in set for k in key_names)


def _check_key_change(
    live: pa.Table, new: pa.Table, at_new_keys: pa.Table | None, key_names: Sequence[str]
) -> None:
    """Refuse an update whose result gives two live rows one key that they did not
    share before (by key identity), checked per row: the updated rows mapped to one new
    key must all have had one old key, and a row whose key changes must not meet a
    live row the update keeps (one of ``at_new_keys`` that is not in ``live``).

    Raises:
        InvalidUsage: naming the key columns and the key.
    """
    old_id, new_id = key_identity.aligned([live, new], key_names)
    old_names = [f"\x00old{i}" for i in range(old_id.num_columns)]
    pairs = new_id.append_column(
        key_identity.ROW, pa.array(np.arange(new.num_rows, dtype=np.int64))
    )
    for name, col in zip(old_names, old_id.columns, strict=True):
        pairs = pairs.append_column(name, col)
    new_names = new_id.column_names
    distinct = pairs.group_by([*new_names, *old_names], use_threads=False).aggregate(
        [(key_identity.ROW, "min")]
    )
    per_new = distinct.group_by(new_names, use_threads=False).aggregate(
        [([], "count_all"), (f"{key_identity.ROW}_min", "min")]
    )
    merged = per_new.filter(pc.field("count_all") > 1)
    if merged.num_rows:
        at = int(pc.min(merged.column(f"{key_identity.ROW}_min_min")).as_py())
        raise InvalidUsage(
            f"update: two updated rows would get one key {list(key_names)} = "
            f"{key_identity.show_key(new, key_names, at)}; nothing was committed"
        )
    if at_new_keys is None or not at_new_keys.num_rows:
        return
    same = None
    for o, n in zip(old_id.columns, new_id.columns, strict=True):
        eq = pc.equal(o, n)
        same = eq if same is None else pc.and_(same, eq)
    moved = new.filter(pc.invert(same)) if same is not None else new.slice(0, 0)
    names = [n for n in live.column_names if n in at_new_keys.column_names and n != DIFF]
    names = [n for n in names if n != TIME]
    kept = at_new_keys.filter(pc.invert(key_identity.isin(at_new_keys, live, names)))
    hit = key_identity.isin(moved, kept, key_names)
    if pc.any(hit).as_py():
        at = int(pc.index(hit, True).as_py())
        raise InvalidUsage(
            f"update: an updated row would get the key {list(key_names)} = "
            f"{key_identity.show_key(moved, key_names, at)} of a live row it does not change; "
            "nothing was committed"
        )


def plan_update(
    live: pa.Table,
    set: Mapping[str, Any],
    key_names: Sequence[str],
    value_names: Sequence[str],
    at_new_keys: pa.Table | None = None,
) -> Planned:
    """Retract every row of ``live`` (the live rows the update's filter keeps) and
    insert it again with the ``set`` values (:func:`new_values`), with its count,
    netted (:func:`net_changes`: a row the update leaves equal is left alone).

    Args:
        at_new_keys: when ``set`` changes a key column, the live rows (of the same
            state) holding any of the new keys (at least those), to refuse a collision.

    Raises:
        InvalidUsage: bad ``set`` values (see :func:`new_values`); the update changes
            keys and two updated rows of different keys get one new key, or a row whose
            key changes gets the key of a live row the update does not change (naming
            the key columns and key).
    """
    names = [*key_names, *value_names]
    new = new_values(live, set, names)
    if changes_key(set, key_names) and live.num_rows:
        _check_key_change(live, new, at_new_keys, key_names)
    return net_changes(
        [_retractions(live, names), _with_diff(new, live.column(DIFF))],
        key_names,
        value_names,
        retracting=(True, False),
    )


# ------------------------------------------------------------------ the loop
class ChangeWriter(Protocol):
    """What :func:`apply_change` needs of a writer (a
    :class:`persist.write.WriteHandle`)."""

    name: str
    shard_id: str

    def change_state(self) -> ShardState:
        """The shard's state freshly read, checked fit for a change by this writer."""
        ...

    def read_live(self, state: ShardState, filter: pc.Expression | None) -> pa.Table:
        """The live rows of ``state`` (as of its upper - 1), at least those ``filter``
        keeps."""
        ...

    def compare_and_append(
        self, updates: pa.Table, expected_upper: int, new_upper: int
    ) -> None: ...


#: Re-reads of one change after a part went missing (a GC of a version it read, after
#: a compaction replaced the part), as :meth:`persist.read.ReadHandle.snapshot` retries.
MISSING_RETRIES = 2


def _retryable(missing: list[int]) -> Callable[[BaseException], bool]:
    """Retry every lost race; a missing part only :data:`MISSING_RETRIES` times (then
    it is reported: the latest version still names it)."""

    def retry(e: BaseException) -> bool:
        if isinstance(e, UpperMismatch):
            return True
        if isinstance(e, CorruptPart) and e.missing and missing[0] < MISSING_RETRIES:
            missing[0] += 1
            return True
        return False

    return retry


def apply_change(
    writer: ChangeWriter,
    plan: Callable[[Callable[[pc.Expression | None], pa.Table], int], Planned],
    *,
    attempts: int = CHANGE_ATTEMPTS,
    wait_max: float = 0.5,
    op: str = "update",
    params: Mapping[str, Any] | None = None,
) -> RowChanges:
    """Read, plan and compare-and-append one change, re-reading and re-planning on a
    lost race, ``attempts`` times at most with jittered exponential back-off (tenacity's
    ``wait_random_exponential``, up to ``wait_max`` seconds).

    ``plan(read, upper)`` gets ``read(filter)`` (the live rows as of ``upper - 1`` of the
    freshly read state, restricted to at least those ``filter`` keeps; an empty shard
    has none) and returns the :class:`Planned` updates; they are appended at
    ``[upper, upper + 1)``, unless there are none: then nothing is appended and the
    result is ``RowChanges(upper - 1, 0, 0)``.  An indeterminate commit is resolved by
    ``compare_and_append`` itself (its idempotency token): it is never re-planned, so a
    change is never applied twice.

    A part found missing (GC raced the version read) re-reads too, twice at most.
    History records the change as ``op`` with ``params`` (unless a table operation's
    note runs: :func:`persist.commit_note.noting_unless_noted`).

    Raises:
        ChangeContended: every attempt lost the race (naming the shard).
        CorruptPart: a part is missing or corrupt in the latest version read.
        InvalidUsage, SchemaMismatch: from ``plan`` or the handle; nothing committed.
        PersistError: storage failed (see ``compare_and_append``).
    """
    with noting_unless_noted(op, params):
        return _apply_change(writer, plan, attempts, wait_max)


def _apply_change(
    writer: ChangeWriter,
    plan: Callable[[Callable[[pc.Expression | None], pa.Table], int], Planned],
    attempts: int,
    wait_max: float,
) -> RowChanges:
    """:func:`apply_change` under its note."""
    shard = f"{writer.name!r} ({writer.shard_id})"
    try:
        for attempt in Retrying(
            stop=stop_after_attempt(attempts),
            wait=wait_random_exponential(multiplier=0.005, max=wait_max),
            retry=retry_if_exception(_retryable([0])),
            reraise=True,
        ):
            with attempt:
                state = writer.change_state()
                upper = state.upper.as_option()
                if upper is None:
                    raise InvalidUsage(f"shard {shard} is finalized: its upper is empty")

                def read(filter: pc.Expression | None, state: ShardState = state) -> pa.Table:
                    return writer.read_live(state, filter)

                planned = plan(read, upper)
                if planned.updates.num_rows == 0:
                    # A change that changes nothing writes nothing: no part, no new
                    # version; the shard held its result as of upper - 1 already.
                    return RowChanges(upper - 1, 0, 0)
                note_rows(planned.inserted, planned.retracted)
                table = planned.updates.append_column(
                    pa.field(TIME, pa.int64(), False),
                    pa.array([upper] * planned.updates.num_rows, pa.int64()),
                )
                writer.compare_and_append(table, upper, upper + 1)
                return RowChanges(upper, planned.inserted, planned.retracted)
    except UpperMismatch as e:
        raise ChangeContended(shard, attempts, e) from e
    except PersistError:
        raise
    raise AssertionError("unreachable")  # pragma: no cover
