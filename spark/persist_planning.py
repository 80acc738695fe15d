"""Read planning for the ``persist`` Spark source: which parts each input partition reads.

Invariants kept here: partitions carry only picklable metadata (part references and
encoded key bounds, never data); a sliced batch keeps its runs, so a task never mixes the
parts of several runs into one consolidated run; a consolidated (``full``) read puts every
part that could cancel another in the same partition: either one key range per partition
(:func:`plan_key_ranges`; the ranges partition the key space and each partition holds every
part overlapping its range, so every update of a key is read by the task owning that key),
or, when some part has no key samples, every part in one partition; a pushed filter
(:func:`pushed_filter`) drops a part only when the part's statistics prove no row of it
passes (:func:`prune_for_filters`), and the same filter is then applied exactly by every
task, so Spark never sees a row it would have filtered out nor misses one it would have
kept.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    IsNotNull,
    IsNull,
    LessThan,
    LessThanOrEqual,
)

from spark.persist_common import PersistSourceError

log = logging.getLogger(__name__)


def plan_parts(batches: Sequence[Any], limit: int, full: bool) -> list[list[Any]]:
    """Split hollow batches into input partitions: lists of hollow batches, each holding
    a slice of one original batch's parts with its description (so that readers advance
    times exactly as :func:`persist.fetch.read_batches` does) and its runs (so that a slice
    holding parts of several runs is never taken for one consolidated run).

    One partition per part, except that consecutive small parts share a partition up to
    ``limit`` encoded bytes; ``full`` puts everything in one partition (then every update
    that could cancel another is read by the same task).
    """
    pieces: list[tuple[int, int]] = [
        (bi, pi) for bi, b in enumerate(batches) for pi in range(len(b.parts))
    ]
    if not pieces:
        return []
    if full:
        return [[b for b in batches if b.parts]]
    groups: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    size = 0
    for bi, pi in pieces:
        nbytes = batches[bi].parts[pi].encoded_size_bytes
        if current and size + nbytes > limit:
            groups.append(current)
            current, size = [], 0
        current.append((bi, pi))
        size += nbytes
    groups.append(current)
    out: list[list[Any]] = []
    for group in groups:
        by_batch: dict[int, list[int]] = {}
        for bi, pi in group:
            by_batch.setdefault(bi, []).append(pi)
        out.append([slice_batch(batches[bi], idx) for bi, idx in by_batch.items()])
    return out


def slice_batch(batch: Any, indexes: Sequence[int]) -> Any:
    """The hollow batch holding the parts of ``batch`` at ``indexes`` (ascending): same
    description, ``len`` the sliced parts' rows, and ``runs`` marking where the slice
    moves to another of ``batch``'s runs."""
    from persist.types import HollowBatch

    starts = [0, *batch.runs]
    run_of = [0] * len(batch.parts)
    for r, (a, b) in enumerate(zip(starts, [*batch.runs, len(batch.parts)], strict=True)):
        for i in range(a, b):
            run_of[i] = r
    parts = tuple(batch.parts[i] for i in indexes)
    runs = tuple(j for j in range(1, len(indexes)) if run_of[indexes[j]] != run_of[indexes[j - 1]])
    return HollowBatch(batch.desc, parts, sum(p.rows for p in parts), runs)


def plan_key_ranges(
    batches: Sequence[Any], key_schema: Any, partitions: int, history: Any = None
) -> list[tuple[list[Any], Any, Any]] | None:
    """Split a consolidated read into at most ``partitions`` key ranges of about equal
    bytes (:func:`persist.merge.plan_ranges` over the parts' key samples).

    Returns one ``(batches, lower, upper)`` per range: the sliced hollow batches holding
    every part that overlaps the range (runs kept, see :func:`slice_batch`) and the
    range's bounds as encoded keys (:func:`persist.merge.encode_keys`; ``None``:
    unbounded), ranges with no part left out; ``None`` when some part has no key samples
    (then the read cannot be cut by key: read it in one partition). ``history``, the
    shard's :class:`~persist.updates.SchemaHistory`, reads the rows of schema-less inline
    parts (:func:`persist.merge.part_key_samples`).
    """
    from persist.merge import encode_keys, part_key_samples, plan_ranges

    flat = [(bi, pi) for bi, b in enumerate(batches) for pi in range(len(b.parts))]
    if not flat:
        return []
    refs = [batches[bi].parts[pi] for bi, pi in flat]
    samples = [part_key_samples(r, key_schema.names, history) for r in refs]
    if any(not smp for smp in samples):
        return None
    plan = plan_ranges(
        [smp for smp in samples if smp],
        [r.encoded_size_bytes for r in refs],
        key_schema,
        max(1, partitions),
    )
    cuts = encode_keys(plan.cuts)
    out: list[tuple[list[Any], Any, Any]] = []
    for i, ps in enumerate(plan.parts):
        if not ps:
            continue
        by_batch: dict[int, list[int]] = {}
        for p in ps:
            bi, pi = flat[p]
            by_batch.setdefault(bi, []).append(pi)
        group = [slice_batch(batches[bi], idx) for bi, idx in by_batch.items()]
        lower = cuts[i - 1] if i > 0 else None
        upper = cuts[i] if i < len(cuts) else None
        out.append((group, lower, upper))
    return out


@dataclass
class PartsPartition(InputPartition):
    """An input partition: the parts one task reads, and the read time."""

    parts: list[Any]
    as_of: int

    def __init__(self, parts: list[Any], as_of: int) -> None:
        self.parts = parts
        self.as_of = as_of


class KeyRangePartition(PartsPartition):
    """An input partition of a consolidated read cut by key range: the parts overlapping
    the range and its bounds (encoded keys, :func:`persist.merge.encode_keys`; ``None``:
    unbounded); its task returns the snapshot's rows with ``lower <= key < upper``."""

    lower: Any
    upper: Any

    def __init__(self, parts: list[Any], as_of: int, lower: Any, upper: Any) -> None:
        super().__init__(parts, as_of)
        self.lower = lower
        self.upper = upper


def resolve_as_of(state: Any, as_of: int | None, shard: str, blob: Any) -> int | None:
    """``as_of`` checked against the shard's since and upper, both from ``state`` (one
    version of the shard's state, :class:`persist.state.ShardState`); ``blob`` holds its
    parts.

    The default is the latest complete time, ``upper - 1``; for a closed shard (upper
    ``{}``: every time is complete) it is the greatest time any update has once advanced
    to its batch's lower and since (:func:`latest_data_time`), at least the since, so the
    default read holds every row, as ``ReadHandle.snapshot`` at that time does.
    ``None`` when there is no time to read: the shard has no complete time yet (upper
    ``{0}``), or it is closed with since ``{}`` too (finalized).

    Raises:
        PersistSourceError: ``as_of`` is before the since or not before the upper.
        persist.errors.CorruptPart: for a closed shard's default, a part without
            statistics could not be read.
    """
    since = state.since.as_option()
    upper = state.upper.as_option()
    if as_of is None:
        if upper is not None:
            return None if upper == 0 else upper - 1
        if state.since.is_empty():
            return None
        latest = latest_data_time(state.batches(), blob, state.schemas())
        return since if latest is None or latest < since else latest
    if since is not None and as_of < since:
        raise PersistSourceError(
            f"as_of {as_of} is before shard {shard}'s since {{{since}}}: those times are compacted"
        )
    if state.since.is_empty():
        raise PersistSourceError(
            f"as_of {as_of}: shard {shard} is finalized (since {{}}): nothing is readable"
        )
    if upper is not None and as_of >= upper:
        raise PersistSourceError(
            f"as_of {as_of} is not before shard {shard}'s upper {{{upper}}}: not yet complete"
        )
    return as_of


def latest_data_time(batches: Sequence[Any], blob: Any, history: Any = None) -> int | None:
    """The greatest time of any update in ``batches`` (hollow batches) once advanced to
    its batch's lower and since: from each batch's bounds (a batch with a finite upper
    holds times below it) and its parts' ``_time`` statistics; the ``_time`` column of a
    part without statistics in a batch with upper ``{}`` (an inline part, or one written
    before statistics existed) is read from ``blob`` (inline parts need no fetch), each
    part with its write schema from ``history`` (the shard's
    :class:`~persist.updates.SchemaHistory`; needed for schema-less inline parts).
    ``None`` when no batch holds updates.

    Raises:
        persist.errors.CorruptPart: a part without statistics is missing or corrupt.
    """
    import pyarrow.compute as pc

    from persist.parts import read_parts
    from persist.stats import max_time

    latest: int | None = None
    for b in batches:
        if not b.parts:
            continue
        floor = max(
            (e for e in (b.desc.lower.as_option(), b.desc.since.as_option()) if e is not None),
            default=-(2**63),
        )
        bound = b.desc.upper.as_option()
        unknown = []
        for p in b.parts:
            t = max_time(p.stats, floor)
            if bound is not None:
                t = bound - 1 if t is None else min(t, bound - 1)
            if t is None:
                unknown.append(p)
            else:
                latest = t if latest is None else max(latest, t)
        if unknown:
            conform = None if history is None else (history, history.newest)
            times = read_parts(blob, unknown, columns=["_time"], conform=conform)
            hi = pc.max(times.column("_time")).as_py()
            if hi is not None:
                t = max(hi, floor)
                latest = t if latest is None else max(latest, t)
    return latest


# ------------------------------------------------------------ filter pushdown

#: A pushed filter as picklable data: ``(op, column, values)``, ``op`` one of ``eq``,
#: ``gt``, ``ge``, ``lt``, ``le``, ``in``, ``null``, ``notnull``.
PushedFilter = tuple[str, str, tuple[Any, ...]]

_COMPARISONS: dict[type, str] = {
    EqualTo: "eq",
    GreaterThan: "gt",
    GreaterThanOrEqual: "ge",
    LessThan: "lt",
    LessThanOrEqual: "le",
}


def pushable_type(t: pa.DataType) -> bool:
    """Column types whose Spark comparisons equal Arrow's: integers, booleans, strings
    (Spark's default binary collation), binary, dates and decimals. Not floats (Spark
    orders NaN above every number and equates NaNs, Arrow does neither) and not
    timestamps (their Python literals' time zone depends on the session)."""
    return bool(
        pa.types.is_integer(t)
        or pa.types.is_boolean(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_date(t)
        or pa.types.is_decimal(t)
    )


def _column(attribute: tuple[str, ...], columns: pa.Schema) -> pa.Field | None:
    """The key or value column a filter's attribute names (exactly, else the one
    matching ignoring case, as Spark resolves names), or ``None``."""
    if len(attribute) != 1:
        return None
    name = attribute[0]
    if columns.get_field_index(name) >= 0:
        return columns.field(name)
    matches = [f for f in columns if f.name.lower() == name.lower()]
    return matches[0] if len(matches) == 1 else None


def _literal(value: Any, t: pa.DataType) -> Any:
    """``value`` as a value of type ``t`` (its Python form), or raise ``ValueError``
    unless it is exactly that value: a Python literal of the column's kind (no float for
    an integer, no datetime for a date) that converts without loss."""
    import datetime as dt
    import decimal

    if value is None:
        raise ValueError("a null literal")
    if pa.types.is_boolean(t):
        ok = isinstance(value, bool)
    elif pa.types.is_integer(t):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif pa.types.is_decimal(t):
        ok = isinstance(value, (decimal.Decimal, int)) and not isinstance(value, bool)
    elif pa.types.is_date(t):
        ok = isinstance(value, dt.date) and not isinstance(value, dt.datetime)
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        ok = isinstance(value, str)
    else:
        ok = isinstance(value, (bytes, bytearray))
    if not ok:
        raise ValueError(f"literal {value!r:.80} is not a {t} value")
    converted = pa.scalar(value, t).as_py()
    if converted != value:
        raise ValueError(f"literal {value!r:.80} is not exactly a {t} value")
    return converted


def pushed_filter(f: Filter, columns: pa.Schema) -> PushedFilter | None:
    """The filter as :data:`PushedFilter` when the source can apply it exactly: one of
    ``EqualTo``, ``In``, ``GreaterThan(OrEqual)``, ``LessThan(OrEqual)``, ``IsNull``,
    ``IsNotNull`` on a key or value column (``columns``) of a :func:`pushable_type`,
    whose literals convert exactly to the column's type; else ``None`` (Spark applies
    it)."""
    attribute = getattr(f, "attribute", None)
    if not isinstance(attribute, tuple):
        return None
    field = _column(attribute, columns)
    if field is None or not pushable_type(field.type):
        return None
    try:
        if isinstance(f, IsNull):
            return ("null", field.name, ())
        if isinstance(f, IsNotNull):
            return ("notnull", field.name, ())
        if isinstance(f, In):
            # A null in the list never makes the predicate true: Spark drops such rows.
            values = tuple(_literal(v, field.type) for v in f.value if v is not None)
            return ("in", field.name, values)
        op = _COMPARISONS.get(type(f))
        if op is not None:
            return (op, field.name, (_literal(f.value, field.type),))
    except (ValueError, TypeError, OverflowError, pa.ArrowException):
        return None
    return None


def filter_expression(pushed: Sequence[PushedFilter], columns: pa.Schema) -> Any:
    """The conjunction of pushed filters as a ``pyarrow.compute.Expression`` over the
    key and value ``columns``, or ``None`` when there are none. Rows where a comparison
    is null are dropped (as Spark's ``WHERE`` does)."""
    import pyarrow.compute as pc

    out = None
    for op, name, values in pushed:
        t = columns.field(name).type
        col = pc.field(name)
        if op == "null":
            e = col.is_null()
        elif op == "notnull":
            e = col.is_valid()
        elif op == "in":
            e = pc.is_in(col, value_set=pa.array(list(values), t), skip_nulls=True)
        else:
            lit = pa.scalar(values[0], t)
            e = {
                "eq": col == lit,
                "gt": col > lit,
                "ge": col >= lit,
                "lt": col < lit,
                "le": col <= lit,
            }[op]
        out = e if out is None else out & e
    return out


def prune_for_filters(
    batches: Sequence[Any],
    schema: pa.Schema,
    columns: pa.Schema,
    as_of: int,
    pushed: Sequence[PushedFilter],
    schemas: Any = None,
) -> list[Any]:
    """``batches`` without the parts that cannot contribute at ``as_of`` (all their
    times later) or hold no row the ``pushed`` filters keep, by the parts' statistics
    (:func:`persist.fetch.prune_batches`; parts without statistics are kept). Each kept
    batch keeps its runs. ``schemas`` (the shard's schema history and the read version)
    makes a part's statistics count only for the columns it holds under the read view."""
    from persist.fetch import prune_batches

    return prune_batches(batches, schema, as_of, filter_expression(pushed, columns), schemas)
