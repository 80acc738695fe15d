"""Key ranges over sorted runs: part key samples, range planning, slicing and merging.

Every run of a hollow batch is sorted by (key, value, time) (:mod:`persist.types`), so a
part of a run covers a contiguous key interval. A part written with its key columns known
records *key samples* (:func:`key_samples`): the keys of a few evenly spaced rows, the
first and last included, stored in its :class:`~persist.types.PartRef` as JSON scalars
(:func:`encode_keys` / :func:`decode_keys`). From them :func:`plan_ranges` cuts the key
space into ranges of about equal bytes and lists, per range, the parts overlapping it;
:func:`cut_positions` finds where each cut falls inside a sorted part, and
:func:`merge_slices` merges (consolidates) the slices of several runs that fall in one
range. Readers built on these (``persist.read``'s snapshot stream, the Spark source's
key-range partitions) read each range independently: all updates of one key fall in one
range, so a row's updates all meet in the same consolidation, and every distinct row of
the snapshot comes out of exactly one range.

Invariants kept here:

* key order is consolidation's (:mod:`persist.consolidation`): lexicographic over the key
  columns, nulls last, NaN after every number and before null, NaN equal to NaN, ``-0.0``
  equal to ``0.0``; every comparison goes through :func:`key_ranks`, which uses the same
  sort, so cuts, samples and rows agree on it;
* ranges are half-open ``[cut[i-1], cut[i])``, the first unbounded below and the last
  unbounded above; cuts are strictly increasing, so the ranges partition the key space;
* a part is listed for every range its first..last sampled keys overlap (a part without
  samples makes :func:`plan_ranges` refuse to cut: callers read such shards whole);
* encoding a key sample and decoding it with the same key schema gives back equal values
  (exactly, including NaN, infinities, ``-0.0``, whole floats beyond the integers a
  float holds exactly (which the stash's canonical JSON writes as integers), decimals,
  binary and temporal values);
* everything is vectorised (Arrow compute and numpy); Python loops run over parts, runs
  and cuts, never over every row (placing a cut in a sorted part reads about
  ``log2(rows)`` of its rows, :func:`cut_positions`).

Source of the idea: the sorted runs and their merges in the Spine (Materialize's
``src/persist-client/src/internal/trace.rs``) and persist-client's part key bounds (Materialize's
``HollowBatchPart`` stats), used here to split a consolidated read by key range without a shuffle.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist.consolidation import (
    _CODES_MIN_ROWS,
    _adjacent,
    _codes_order,
    _sort_view,
    consolidate,
)
from persist.errors import InvalidUsage
from persist.updates import TIME, is_supported_type

__all__ = [
    "RangePlan",
    "cut_positions",
    "decode_keys",
    "encode_keys",
    "key_ranks",
    "key_samples",
    "part_key_samples",
    "merge_slices",
    "plan_ranges",
    "sample_positions",
]

#: Number of intervals a part's key samples cut it into (so at most this + 1 samples).
SAMPLE_INTERVALS = 8

KeySample = tuple[Any, ...]


# ----------------------------------------------------------------- key encoding


def _int_view(t: pa.DataType) -> pa.DataType | None:
    """The integer type a temporal type is stored as (``None`` if not temporal)."""
    if pa.types.is_temporal(t):
        return pa.int32() if t.bit_width == 32 else pa.int64()
    return None


def _encode_float(x: float) -> float | str:
    """A float key value as JSON: finite numbers as numbers (the stash's canonical JSON
    then writes a whole one as an integer, which :func:`_decode_float` reads back
    exactly), NaN, infinities and ``-0.0`` as their ``repr`` strings."""
    if not math.isfinite(x) or (x == 0.0 and math.copysign(1.0, x) < 0):
        return repr(float(x))
    return x


def _decode_float(x: Any, t: pa.DataType) -> float:
    """The float of type ``t`` that :func:`_encode_float` encoded as ``x``, after a
    round trip through JSON: a string is parsed, an integer (a whole float written as
    one) converted exactly.

    Raises:
        ValueError: ``x`` is not such an encoding, or an integer the type cannot hold
            exactly (for ``float32`` also: a float it cannot hold).
    """
    if isinstance(x, bool) or not isinstance(x, int | float | str):
        raise ValueError(f"{x!r:.80} is not a {t} key value")
    f = float(x)  # an int beyond float64's range raises OverflowError (an ArithmeticError)
    exact = isinstance(x, str) or f == x or math.isnan(f)
    if exact and t.bit_width == 32 and math.isfinite(f):
        exact = float(np.float32(f)) == f
    if not exact:
        raise ValueError(f"{x!r:.80} is not exactly a {t} value")
    return f


def _encode_column(arr: pa.Array) -> list[Any]:
    t = arr.type
    view = _int_view(t)
    if view is not None:
        return list(arr.view(view).to_pylist())
    if pa.types.is_floating(t):
        return [None if x is None else _encode_float(x) for x in arr.to_pylist()]
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return [None if x is None else base64.b64encode(x).decode("ascii") for x in arr.to_pylist()]
    if pa.types.is_decimal(t):
        return [None if x is None else str(x) for x in arr.to_pylist()]
    return list(arr.to_pylist())


def _decode_column(values: Sequence[Any], t: pa.DataType) -> pa.Array:
    view = _int_view(t)
    if view is not None:
        return pa.array(values, view).view(t)
    if pa.types.is_floating(t):
        return pa.array([None if x is None else _decode_float(x, t) for x in values], t)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return pa.array([None if x is None else base64.b64decode(x) for x in values], t)
    if pa.types.is_decimal(t):
        return pa.array([None if x is None else Decimal(x) for x in values], t)
    return pa.array(values, t)


def encode_keys(keys: pa.Table) -> tuple[KeySample, ...]:
    """The rows of a table of key columns as tuples of JSON scalars (ints, floats, bools,
    strings, ``None``): temporal values as their integer storage, non-finite floats and
    ``-0.0`` as ``'nan'``/``'inf'``/``'-inf'``/``'-0.0'``, binary as base64, decimals as
    strings."""
    cols = [_encode_column(c.combine_chunks()) for c in keys.columns]
    return tuple(tuple(row) for row in zip(*cols, strict=True)) if cols else ()


def decode_keys(samples: Sequence[Sequence[Any]], key_schema: pa.Schema) -> pa.Table:
    """The inverse of :func:`encode_keys`: a table of ``key_schema`` with one row per
    sample.

    Raises:
        InvalidUsage: a sample does not have one value per key column, or a value does
            not fit its column's type.
    """
    n = len(key_schema)
    for s in samples:
        if len(s) != n:
            raise InvalidUsage(f"key sample {list(s)!r:.200} does not have {n} key values")
    try:
        arrays = [_decode_column([s[i] for s in samples], f.type) for i, f in enumerate(key_schema)]
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, ArithmeticError) as e:
        raise InvalidUsage(f"key samples do not fit the key schema: {str(e)[:200]}") from None
    return pa.Table.from_arrays(
        arrays, schema=pa.schema([f.with_nullable(True) for f in key_schema])
    )


def key_samples(
    table: pa.Table, key_names: Sequence[str], intervals: int = SAMPLE_INTERVALS
) -> tuple[KeySample, ...]:
    """The encoded keys of up to ``intervals + 1`` evenly spaced rows of ``table`` (sorted
    by key), its first and last row included; ``()`` for an empty table."""
    if table.num_rows == 0:
        return ()
    pos = sample_positions(table.num_rows, intervals)
    return encode_keys(table.select(list(key_names)).take(pa.array(pos, pa.int64())))


def part_key_samples(
    ref: Any, key_names: Sequence[str], schemas: Any = None
) -> tuple[KeySample, ...] | None:
    """The key samples of a part (a :class:`~persist.types.PartRef`): those recorded in
    the state, or, for an inline part (which records none: its bytes are in the state
    already, and sampling every one-row append cost a sixth of it), those of its decoded
    rows (an inline part is a slice of a sorted run); ``None`` when unknown (a blob part
    written before samples existed, or an inline part that does not decode: the read
    then reports it).

    ``schemas`` is what reads a schema-less inline part: the shard's
    :class:`~persist.updates.SchemaHistory` (the part is read with the updates schema of
    its ``schema_id``) or the part's updates schema (``pyarrow.Schema``); without it such
    a part has no samples."""
    if ref.key_samples:
        return tuple(ref.key_samples)
    if ref.inline is None:
        return None
    import pyarrow as pa

    from persist.decoding import INLINE_CACHE, decode_part
    from persist.errors import PersistError

    table = INLINE_CACHE.get(ref)
    if table is None:
        try:
            if schemas is None or isinstance(schemas, pa.Schema):
                schema = schemas
            else:
                schemas.check_id(ref.schema_id, f"part {ref.key or '<inline>'}")
                schema = schemas.updates_schema(ref.schema_id)
            table = decode_part(ref.inline, ref, schema=schema)
        except PersistError:
            return None
    try:
        return key_samples(table, key_names) or None
    except (KeyError, UnicodeDecodeError):  # a key string that is not UTF-8: unknown
        return None


def sample_positions(rows: int, intervals: int = SAMPLE_INTERVALS) -> np.ndarray:
    """The row positions (int64, ascending, distinct) :func:`key_samples` samples in a
    part of ``rows`` rows: ``intervals + 1`` evenly spaced ones (fewer in a smaller
    part), the first and the last row included."""
    if rows <= 0:
        return np.zeros(0, dtype=np.int64)
    k = min(intervals, rows - 1)
    return np.unique(np.round(np.linspace(0, rows - 1, k + 1)).astype(np.int64))


# ------------------------------------------------------------------ key order


def key_ranks(table: pa.Table, names: Sequence[str]) -> np.ndarray:
    """Dense rank (int64, from 0) of each row's key among the table's distinct keys, in
    consolidation's order: equal keys get equal ranks, a smaller key a smaller rank."""
    n = table.num_rows
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if not names:
        return np.zeros(n, dtype=np.int64)
    keys = table.select(list(names))
    same: np.ndarray | None
    if n >= _CODES_MIN_ROWS:
        order, same = _codes_order(keys, list(names))
    else:
        # Arrow's default order is consolidation's: nulls at the end, NaN before them.
        arrow_order = pc.sort_indices(
            _sort_view(keys, names), sort_keys=[(c, "ascending") for c in names]
        )
        order = np.asarray(arrow_order.to_numpy(), dtype=np.int64)
        same = (
            _adjacent(keys.take(arrow_order), list(names), check_order=False)[1] if n > 1 else None
        )
    step = np.ones(n, dtype=np.int64)
    step[0] = 0
    if same is not None:
        step[1:] = ~same
    ranks = np.empty(n, dtype=np.int64)
    ranks[order] = np.cumsum(step)
    return ranks


def _concat_keys(tables: Sequence[pa.Table], names: Sequence[str]) -> pa.Table:
    """The key columns of ``tables`` one after another (types as in the first; nullable)."""
    first = tables[0].select(list(names))
    schema = pa.schema([f.with_nullable(True) for f in first.schema])
    parts = [
        pa.Table.from_arrays(
            [t.column(c).cast(f.type) for c, f in zip(names, schema, strict=True)], schema=schema
        )
        for t in tables
    ]
    return pa.concat_tables(parts)


#: Tables with more rows locate cuts through a strided sample first (:func:`cut_positions`).
_DIRECT_ROWS = 4096
#: Rows of the strided sample :func:`cut_positions` ranks first.
_SAMPLE_ROWS = 512


def _positions(table: pa.Table, names: Sequence[str], cuts: pa.Table, side: str) -> np.ndarray:
    """:func:`cut_positions` by ranking every row of ``table`` with the cuts."""
    n = table.num_rows
    ranks = key_ranks(_concat_keys([table, cuts], names), names)
    # The table is sorted: its ranks are non-decreasing.
    found = np.searchsorted(ranks[:n], ranks[n:], side="left" if side == "left" else "right")
    return np.asarray(found, dtype=np.int64)


def _py_order(t: pa.DataType) -> Callable[[pa.ChunkedArray | pa.Array], Any] | None:
    """For a key column type whose consolidation order Python's comparison of
    ``(class, value)`` pairs reproduces, a function turning a column into one whose
    ``as_py`` values are ordered as consolidation orders the column's (temporal values
    through their integer storage); ``None`` for other types (then
    :func:`cut_positions` ranks rows instead of comparing them)."""
    if not is_supported_type(t):
        return None
    view = _int_view(t)
    if view is not None:

        def as_ints(col: pa.ChunkedArray | pa.Array) -> pa.Array:
            arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
            return arr.view(view)

        return as_ints
    # Strings: Python orders by code point, which is UTF-8's byte order (Arrow's).
    return lambda col: col


def _order_key(x: Any) -> tuple[int, Any]:
    """A Python value's place in consolidation's order: numbers (and other values) first,
    then NaN, then null (``-0.0`` equals ``0.0`` in Python already)."""
    if x is None:
        return (2, 0)
    if x != x:  # NaN
        return (1, 0)
    return (0, x)


def _bisect_positions(
    keys: pa.Table, cuts: pa.Table, views: Sequence[Callable[[Any], Any]], side: str
) -> np.ndarray:
    """:func:`cut_positions` by binary search: ``log2(rows)`` row comparisons per cut,
    each reading the key columns left to right only until they differ."""
    n = keys.num_rows
    cols = [v(c) for v, c in zip(views, keys.columns, strict=True)]
    cut_cols = [
        v(c.cast(k.type) if c.type != k.type else c)
        for v, c, k in zip(views, cuts.columns, keys.columns, strict=True)
    ]
    right = side == "right"
    out = np.empty(cuts.num_rows, dtype=np.int64)
    for j in range(cuts.num_rows):
        cut = [_order_key(c[j].as_py()) for c in cut_cols]
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) // 2
            # cmp: the row at mid against the cut, column by column.
            cmp = 0
            for col, ck in zip(cols, cut, strict=True):
                rk = _order_key(col[mid].as_py())
                if rk != ck:
                    cmp = -1 if rk < ck else 1
                    break
            if cmp < 0 or (cmp == 0 and right):
                lo = mid + 1
            else:
                hi = mid
        out[j] = lo
    return out


def cut_positions(
    table: pa.Table, names: Sequence[str], cuts: pa.Table, side: str = "left"
) -> np.ndarray:
    """For a table sorted by ``names``, the row position of each cut: the number of rows
    whose key is less than it (``side='left'``) or at most it (``'right'``), as int64.

    When every key column's type has a Python order equal to consolidation's
    (:func:`_py_order`: numbers, temporal values, decimals, booleans, strings, binary),
    each cut is placed by a binary search comparing rows to it (about
    ``cuts * log2(rows)`` row comparisons, each stopping at the first column that
    differs). Otherwise a big table is not ranked whole: the cuts are first placed among
    a strided sample of its rows, then each among the rows between two consecutive
    sampled rows, so the work is about ``_SAMPLE_ROWS + cuts * rows / _SAMPLE_ROWS``
    rows, not ``rows``. Both give the same positions (:func:`_ranked_cut_positions` is
    the reference).

    Raises:
        InvalidUsage: ``side`` is not ``'left'`` or ``'right'``.
    """
    if side not in ("left", "right"):
        raise InvalidUsage(f"side must be 'left' or 'right', got {side!r}")
    n, m = table.num_rows, cuts.num_rows
    if m == 0:
        return np.zeros(0, dtype=np.int64)
    if n == 0:
        return np.zeros(m, dtype=np.int64)
    keys = table.select(list(names))
    views = [_py_order(f.type) for f in keys.schema]
    if names and all(v is not None for v in views):
        return _bisect_positions(keys, cuts.select(list(names)), views, side)  # type: ignore[arg-type]
    return _ranked_cut_positions(table, names, cuts, side)


def _ranked_cut_positions(
    table: pa.Table, names: Sequence[str], cuts: pa.Table, side: str = "left"
) -> np.ndarray:
    """:func:`cut_positions` by ranking rows with the cuts (any key type)."""
    n, m = table.num_rows, cuts.num_rows
    if m == 0:
        return np.zeros(0, dtype=np.int64)
    if n == 0:
        return np.zeros(m, dtype=np.int64)
    keys = table.select(list(names))
    if n <= _DIRECT_ROWS:
        return _positions(keys, names, cuts, side)
    step = -(-n // _SAMPLE_ROWS)
    idx = np.arange(0, n, step, dtype=np.int64)
    sample = keys.take(pa.array(idx))
    # Sampled rows before each cut: the cut's position lies in (idx[b-1], idx[b]].
    blocks = _positions(sample, names, cuts, side)
    out = np.empty(m, dtype=np.int64)
    for b in np.unique(blocks).tolist():
        which = np.flatnonzero(blocks == b)
        start = 0 if b == 0 else int(idx[b - 1]) + 1
        stop = n if b == len(idx) else int(idx[b])
        if stop <= start:
            out[which] = start
            continue
        block = keys.slice(start, stop - start)
        out[which] = start + _positions(block, names, cuts.take(pa.array(which)), side)
    return out


# ------------------------------------------------------------------ planning


@dataclass(frozen=True)
class RangePlan:
    """Key ranges and the parts overlapping each.

    Attributes:
        cuts: the cut keys, a table of the key columns with strictly increasing rows;
            range ``i`` is ``[cuts[i-1], cuts[i])`` (``i = 0`` unbounded below, the last
            unbounded above), so there are ``cuts.num_rows + 1`` ranges.
        parts: for each range, the indexes (ascending) of the parts overlapping it.
    """

    cuts: pa.Table
    parts: list[list[int]]

    def bounds(self, i: int) -> tuple[pa.Table | None, pa.Table | None]:
        """Range ``i``'s lower and upper cut as one-row tables (``None``: unbounded)."""
        lo = self.cuts.slice(i - 1, 1) if i > 0 else None
        hi = self.cuts.slice(i, 1) if i < self.cuts.num_rows else None
        return lo, hi


def plan_ranges(
    samples: Sequence[Sequence[KeySample] | None],
    sizes: Sequence[int],
    key_schema: pa.Schema,
    ranges: int,
) -> RangePlan:
    """Cut the key space into at most ``ranges`` ranges of about equal bytes.

    Each part contributes its samples, the bytes between two consecutive samples (an
    equal share of ``sizes[i]``) attributed to the first of them; the cuts are the
    sampled keys where the running total of bytes, in key order, crosses each multiple
    of ``total / ranges``. Equal cuts collapse, and a cut at or below the smallest key is
    dropped, so fewer ranges may come out (never an empty one at the low end).

    Args:
        samples: per part, its key samples (from :func:`key_samples`, first and last key
            of the part included).
        sizes: per part, its size (e.g. encoded bytes).
        key_schema: the key columns' schema (order of comparison).
        ranges: the wanted number of ranges (>= 1).

    Raises:
        InvalidUsage: ``ranges < 1``, lengths differ, or a part has no samples.
    """
    if ranges < 1:
        raise InvalidUsage(f"ranges must be >= 1, got {ranges}")
    if len(samples) != len(sizes):
        raise InvalidUsage(f"{len(samples)} sample lists for {len(sizes)} parts")
    names = key_schema.names
    empty_cuts = decode_keys([], key_schema)
    if not samples:
        return RangePlan(empty_cuts, [[]])
    flat: list[KeySample] = []
    weights: list[float] = []
    firsts: list[int] = []
    lasts: list[int] = []
    for i, (ss, size) in enumerate(zip(samples, sizes, strict=True)):
        if not ss:
            raise InvalidUsage(f"part {i} has no key samples: its key range is unknown")
        firsts.append(len(flat))
        share = float(size) / max(1, len(ss) - 1)
        for j, s in enumerate(ss):
            flat.append(tuple(s))
            weights.append(share if j < len(ss) - 1 or len(ss) == 1 else 0.0)
        if len(ss) == 1:
            weights[-1] = float(size)
        lasts.append(len(flat) - 1)
    keys = decode_keys(flat, key_schema)
    ranks = key_ranks(keys, names)
    w = np.asarray(weights, dtype=np.float64)
    # Total weight per distinct key, in key order.
    uniq, inverse = np.unique(ranks, return_inverse=True)
    per_key = np.zeros(len(uniq), dtype=np.float64)
    np.add.at(per_key, inverse, w)
    total = float(per_key.sum())
    cut_ranks: list[int] = []
    if ranges > 1 and total > 0 and len(uniq) > 1:
        before = np.concatenate(([0.0], np.cumsum(per_key)[:-1]))  # bytes below each key
        targets = total * np.arange(1, ranges) / ranges
        idx = np.searchsorted(before, targets, side="left")
        idx = np.unique(idx[(idx > 0) & (idx < len(uniq))])
        cut_ranks = [int(uniq[i]) for i in idx]
    # A representative sample row for each cut rank.
    first_row: dict[int, int] = {}
    for row, r in enumerate(ranks.tolist()):
        first_row.setdefault(r, row)
    cut_rows = [first_row[r] for r in cut_ranks]
    cuts = keys.take(pa.array(cut_rows, pa.int64())) if cut_rows else empty_cuts
    lo = ranks[np.asarray(firsts, dtype=np.int64)]
    hi = ranks[np.asarray(lasts, dtype=np.int64)]
    cr = np.asarray(cut_ranks, dtype=np.int64)
    # Part p overlaps range i iff lo[p] < cut[i] (or i is last) and hi[p] >= cut[i-1]
    # (or i is first): ranges [first_range(p), last_range(p)].
    first_range = np.searchsorted(cr, lo, side="right")  # the range holding lo
    last_range = np.searchsorted(cr, hi, side="right")  # the range holding hi
    out: list[list[int]] = [[] for _ in range(len(cr) + 1)]
    for p in range(len(samples)):
        for i in range(int(first_range[p]), int(last_range[p]) + 1):
            out[i].append(p)
    return RangePlan(cuts, out)


# ------------------------------------------------------------------ merging


def slice_range(
    table: pa.Table, names: Sequence[str], lo: pa.Table | None, hi: pa.Table | None
) -> pa.Table:
    """The rows of ``table`` (sorted by ``names``) with ``lo <= key < hi`` (a ``None``
    bound is unbounded), a zero-copy slice."""
    if table.num_rows == 0 or (lo is None and hi is None):
        return table
    bounds = [b for b in (lo, hi) if b is not None]
    pos = cut_positions(table, names, pa.concat_tables(bounds))
    start = int(pos[0]) if lo is not None else 0
    stop = int(pos[-1]) if hi is not None else table.num_rows
    return table.slice(start, max(0, stop - start))


def merge_slices(
    slices: Sequence[pa.Table],
    key_names: Sequence[str],
    value_names: Sequence[str],
    since: int | None,
    schema: pa.Schema,
) -> pa.Table:
    """Merge sorted runs' slices of one key range into consolidated updates (sorted by
    key, value, time; one row per distinct (key, value, time) with its summed diff, never
    zero, times advanced to ``since``).

    The slices are concatenated run after run and consolidated: the sort of
    :func:`persist.consolidation.consolidate` recognises an input that is one sorted run
    and, for several, sorts the packed key words with a timsort, which merges the
    presorted runs (a k-way merge in O(n log k), vectorised).
    """
    live = [s for s in slices if s.num_rows]
    if not live:
        return schema.empty_table()
    if len(live) == 1 and since is not None:
        # One run's slice is consolidated per (key, value, time) (every writer of a run
        # consolidates it); if it holds a single time at most ``since``, advancing that
        # time keeps its rows distinct: nothing to sort or sum.
        one = live[0]
        ti = one.schema.get_field_index(TIME)
        mm = pc.min_max(one.column(ti))
        lo_t, hi_t = mm["min"].as_py(), mm["max"].as_py()
        if lo_t == hi_t and hi_t <= since:
            times = pa.array(np.full(one.num_rows, since, dtype=np.int64))
            return one.set_column(ti, one.schema.field(ti), times)
    table = live[0] if len(live) == 1 else pa.concat_tables(live)
    return consolidate(table, list(key_names), list(value_names), since=since)
