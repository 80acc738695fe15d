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
  before: two updated rows mapped to one key, or an updated row mapped onto the key of
  a live row the update does not retract.  So a shard used with upsert keeps one live
  row per key through updates;
* ``retracted`` and ``inserted`` count rows with their multiplicity (the sum of the
  absolute counts); a change that matches nothing commits an empty append;
* a change from a handle of an older schema version than the shard's newest is refused
  (``SchemaMismatch``): its rows could not name the newer columns, so its retractions
  would not cancel the live rows.  Rows written under older versions are conformed to
  the handle's (the newest) view before they are compared or retracted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from persist.commit_note import note_rows, noting_unless_noted
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
            ``time + 1``.
        inserted: rows inserted (with multiplicity; int >= 0).
        retracted: rows retracted (with multiplicity; int >= 0).
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
def _key_tuple(row: Sequence[Any]) -> tuple[Any, ...]:
    """A hashable key with NaN made equal to NaN (Arrow groups NaNs together)."""
    return tuple(("nan",) if isinstance(v, float) and math.isnan(v) else v for v in row)


def _keys(table: pa.Table, key_names: Sequence[str]) -> list[tuple[Any, ...]]:
    cols = [table.column(k).to_pylist() for k in key_names]
    return [_key_tuple(r) for r in zip(*cols, strict=True)] if cols else [()] * table.num_rows


def _retractions(live: pa.Table, names: Sequence[str]) -> tuple[pa.Table, int]:
    diff = live.column(DIFF)
    out = live.select(list(names)).append_column(DIFF, pc.negate(diff))
    return out, int(pc.sum(pc.abs(diff)).as_py() or 0)


def _with_diff(rows: pa.Table, diff: pa.ChunkedArray | int) -> pa.Table:
    if isinstance(diff, int):
        return rows.append_column(DIFF, pa.array([diff] * rows.num_rows, pa.int64()))
    return rows.append_column(DIFF, diff)


def _concat(parts: Sequence[pa.Table], schema: pa.Schema) -> pa.Table:
    return pa.concat_tables([p.cast(schema) for p in parts]) if parts else schema.empty_table()


def _out_schema(schema: pa.Schema, names: Sequence[str]) -> pa.Schema:
    return pa.schema([schema.field(n) for n in names] + [pa.field(DIFF, pa.int64(), False)])


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


def key_filter(rows: pa.Table, key_names: Sequence[str]) -> pc.Expression | None:
    """A filter keeping at least the rows whose key is one of ``rows``' keys, for the
    statistics pruning of the read (:func:`persist.fetch.prune_batches`): per key
    column its ``[min, max]`` range (what part statistics can prune by: Arrow does not
    simplify ``is_in`` under a range) and an ``isin`` of its values, anded over the key
    columns; nulls kept when a key column has them; no range for a floating-point
    column (NaN is in no range).  ``None`` when ``rows`` is empty."""
    if rows.num_rows == 0:
        return None
    out: pc.Expression | None = None
    for k in key_names:
        col = rows.column(k)
        values = pc.unique(col.drop_null() if col.null_count else col)
        e = pc.field(k).isin(values)
        if len(values) and not pa.types.is_floating(col.type):
            mm = pc.min_max(values)
            e = (pc.field(k) >= mm["min"]) & (pc.field(k) <= mm["max"]) & e
        if col.null_count:
            e = e | pc.field(k).is_null()
        out = e if out is None else out & e
    return out


def _joinable(tables: Sequence[pa.Table], key_names: Sequence[str]) -> bool:
    """Whether Arrow's hash join and grouping match the key columns of ``tables`` as
    :func:`_key_tuple` does: no nulls (a join matches no null) and no floating-point
    key column (NaN, ``-0.0``)."""
    return bool(key_names) and all(
        not pa.types.is_floating(t.schema.field(k).type) and t.column(k).null_count == 0
        for t in tables
        for k in key_names
    )


def _duplicate_key(rows: pa.Table, key_names: Sequence[str]) -> list[Any] | None:
    """A key that two rows of ``rows`` share, or ``None``."""
    if _joinable([rows], key_names):
        counts = (
            rows.select(list(key_names)).group_by(list(key_names)).aggregate([([], "count_all")])
        )
        dup = counts.filter(pc.field("count_all") > 1)
        return [dup.column(k)[0].as_py() for k in key_names] if dup.num_rows else None
    seen: set[tuple[Any, ...]] = set()
    for key in _keys(rows, key_names):
        if key in seen:
            return list(key)
        seen.add(key)
    return None


def check_unique_keys(rows: pa.Table, key_names: Sequence[str]) -> set[tuple[Any, ...]]:
    """The keys of ``rows`` (NaN equal to NaN), checked distinct (as
    :func:`check_distinct_keys`, which does not build the set).

    Raises:
        InvalidUsage: two rows have one key (naming the key columns and the key).
    """
    check_distinct_keys(rows, key_names)
    return set(_keys(rows, key_names))


def check_distinct_keys(rows: pa.Table, key_names: Sequence[str]) -> None:
    """Check the keys of ``rows`` distinct (NaN equal to NaN, null to null); vectorised
    (Arrow's grouping) when no key column is floating-point or holds a null.

    Raises:
        InvalidUsage: two rows have one key (naming the key columns and the key).
    """
    key = _duplicate_key(rows, key_names)
    if key is not None:
        raise InvalidUsage(
            f"upsert: two rows have one key {list(key_names)} = {key}; "
            "each key may appear once; nothing was committed"
        )


def with_keys_of(live: pa.Table, rows: pa.Table, key_names: Sequence[str]) -> pa.Table:
    """The rows of ``live`` whose key is one of ``rows``' (NaN equal to NaN, null to
    null), in ``live``'s column order; vectorised (Arrow's hash semi-join) when no key
    column is floating-point or holds a null, else by Python tuples."""
    if not live.num_rows or not rows.num_rows:
        return live.slice(0, 0)
    if _joinable([live, rows], key_names):
        keys = rows.select(list(key_names))
        return live.join(keys, keys=list(key_names), join_type="left semi").select(
            live.column_names
        )
    seen = set(_keys(rows, key_names))
    return live.filter(pa.array([k in seen for k in _keys(live, key_names)], pa.bool_()))


def plan_upsert(
    live: pa.Table, rows: pa.Table, key_names: Sequence[str], value_names: Sequence[str]
) -> Planned:
    """Retract every live row whose key is one of ``rows``' and insert ``rows``.

    Args:
        live: consolidated live rows (key, value columns, ``_diff``; any other columns
            ignored), at least those with the keys of ``rows``.
        rows: the incoming rows (exactly the key and value columns: :func:`conform_rows`).

    Raises:
        InvalidUsage: two rows of ``rows`` have one key (naming the key columns and the
            key).
    """
    names = [*key_names, *value_names]
    check_distinct_keys(rows, key_names)
    retract, retracted = _retractions(with_keys_of(live, rows, key_names), names)
    schema = _out_schema(rows.schema, names)
    out = _concat([retract, _with_diff(rows.select(names), 1)], schema)
    return Planned(out, rows.num_rows, retracted)


def plan_delete(live: pa.Table, key_names: Sequence[str], value_names: Sequence[str]) -> Planned:
    """Retract every row of ``live`` (the live rows the delete's filter keeps)."""
    names = [*key_names, *value_names]
    retract, retracted = _retractions(live, names)
    return Planned(retract.cast(_out_schema(live.schema, names)), 0, retracted)


def check_set(
    set: Mapping[str, Any], schema: pa.Schema, key_names: Sequence[str], value_names: Sequence[str]
) -> dict[str, Any]:
    """``set`` checked: a mapping of key or value column names to scalars or
    ``pyarrow.compute`` expressions.

    Raises:
        InvalidUsage: ``set`` is not a mapping, is empty, names a column that is not a
            key or value column (``_time`` and ``_diff`` included), or holds an
            expression that does not apply to the columns (e.g. an unknown field).
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
    return dict(set)


def new_values(old: pa.Table, set: Mapping[str, Any], names: Sequence[str]) -> pa.Table:
    """``old``'s ``names`` columns with those of ``set`` replaced: a scalar repeated, an
    expression evaluated on the old row; cast to the column's type.

    Raises:
        InvalidUsage: a value or expression result does not fit its column (naming it),
            or an expression Arrow cannot evaluate on the rows.
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
        try:
            if n in evaluated:
                arr: pa.Array | pa.ChunkedArray = evaluated[n].cast(field.type)
            elif isinstance(v, pc.Expression):
                arr = pa.array([], field.type)
            else:
                arr = pa.array([v] * old.num_rows, field.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            raise InvalidUsage(f"update: set value for column {n!r} ({field.type}): {e}") from None
        if not field.nullable and arr.null_count:
            raise InvalidUsage(f"update: set gives nulls to the non-nullable column {n!r}")
        cols.append(arr)
    return pa.Table.from_arrays(cols, schema=pa.schema([old.schema.field(n) for n in names]))


def changes_key(set: Mapping[str, Any], key_names: Sequence[str]) -> bool:
    """Whether an update's ``set`` touches a key column."""
    return any(k in set for k in key_names)


def plan_update(
    live: pa.Table,
    set: Mapping[str, Any],
    key_names: Sequence[str],
    value_names: Sequence[str],
    at_new_keys: pa.Table | None = None,
) -> Planned:
    """Retract every row of ``live`` (the live rows the update's filter keeps) and
    insert it again with the ``set`` values (:func:`new_values`), with its count.

    Args:
        at_new_keys: when ``set`` changes a key column, the live rows (of the same
            state) holding any of the new keys (at least those), to refuse a collision.

    Raises:
        InvalidUsage: bad ``set`` values (see :func:`new_values`); the update changes
            keys and two updated rows get one new key, or an updated row gets the key
            of a live row the update does not retract (naming the key columns and key).
    """
    names = [*key_names, *value_names]
    retract, retracted = _retractions(live, names)
    new = new_values(live, set, names)
    if changes_key(set, key_names) and live.num_rows:
        old_keys = _keys(live, key_names)
        new_keys = _keys(new, key_names)
        # A key shared by old rows (e.g. one key with two values) may stay shared, but
        # no two distinct old keys may merge, and no new key may meet a kept row.
        first: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        for o, n in zip(old_keys, new_keys, strict=True):
            if first.setdefault(n, o) != o:
                raise InvalidUsage(
                    f"update: two updated rows would get one key {list(key_names)} = "
                    f"{list(n)}; nothing was committed"
                )
        retracted_keys = {*old_keys}
        if at_new_keys is not None and at_new_keys.num_rows:
            for k in _keys(at_new_keys, key_names):
                if k in first and k not in retracted_keys:
                    raise InvalidUsage(
                        f"update: an updated row would get the key {list(key_names)} = "
                        f"{list(k)} of a live row it does not change; nothing was committed"
                    )
    out = _concat([retract, _with_diff(new, live.column(DIFF))], _out_schema(live.schema, names))
    return Planned(out, retracted, retracted)


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
    ``[upper, upper + 1)``.  An indeterminate commit is resolved by
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
