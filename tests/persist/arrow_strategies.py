"""Hypothesis strategies over every Arrow column type a shard accepts, the updates
written with them, and the filters a read accepts, plus the plain model the reads are
compared with (a multiset of rows under Python equality, after the shard's
canonicalisation).

Shared by the differential read properties of ``persist`` (``snapshot``,
``snapshot(filter, columns)``, ``snapshot_stream``) and of the Spark sources.

* :data:`COLUMN_TYPES`: every type :func:`persist.updates.updates_schema` accepts, in
  the variants that matter to a read (each timestamp unit and zone, date32/64,
  time32/64, decimal128/256, float32/64, int8..uint64, (large) string and binary,
  fixed-size binary, bool, durations);
* :func:`column_values`: values of one type, as Arrow storage (ints for temporal
  types), extremes, NaN, signed zeros, infinities, NUL and non-BMP characters and nulls
  included; :func:`arrow_array` builds the column;
* :func:`shard_schemas`, :func:`update_tables`: a shard's key and value schemas and
  updates tables (``_time`` and ``_diff`` columns), optionally dictionary-encoded on
  input (the write path decodes them);
* :func:`filters`: boolean expressions of every shape the read API accepts
  (comparisons, ``isin`` of values of the column's and of other types, ``is_null``,
  ``is_valid``, ``~``, ``|``, ``&``, ``and_kleene``/``or_kleene``/``and_``);
* :func:`canonical_rows`, :func:`model_snapshot`: the model.

The idea of drawing whole Arrow tables and comparing against a plain model follows
Hypothesis's stateful and differential testing guides and the Arrow project's own
``pyarrow.tests.strategies`` module (whose type coverage this extends to what a shard
holds).
"""

from __future__ import annotations

import decimal
import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import strategies as st

__all__ = [
    "COLUMN_TYPES",
    "NAN",
    "arrow_array",
    "canonical_rows",
    "canonical_value",
    "column_values",
    "filters",
    "literal",
    "model_snapshot",
    "shard_schemas",
    "update_tables",
    "written_values",
]

# ------------------------------------------------------------------------ types

_ZONES = (None, "UTC", "+01:00", "America/New_York")

#: Every column type a shard accepts, in the variants that matter to a read.
COLUMN_TYPES: tuple[pa.DataType, ...] = (
    pa.int8(),
    pa.int16(),
    pa.int32(),
    pa.int64(),
    pa.uint8(),
    pa.uint16(),
    pa.uint32(),
    pa.uint64(),
    pa.float32(),
    pa.float64(),
    pa.bool_(),
    pa.string(),
    pa.large_string(),
    pa.binary(),
    pa.large_binary(),
    pa.binary(3),
    pa.date32(),
    pa.date64(),
    pa.time32("s"),
    pa.time32("ms"),
    pa.time64("us"),
    pa.time64("ns"),
    *(pa.timestamp(u, tz) for u in ("s", "ms", "us", "ns") for tz in _ZONES),
    pa.duration("s"),
    pa.duration("ms"),
    pa.duration("us"),
    pa.duration("ns"),
    pa.decimal128(5, 2),
    pa.decimal128(38, 10),
    pa.decimal256(40, 3),
    pa.decimal256(76, 0),
)

#: Types that may be key columns: all of them (floats included: keys are sorted and
#: sampled by value).
KEY_TYPES = COLUMN_TYPES

_SECONDS_PER_DAY = 86_400
#: 0001-01-01 .. 9999-12-31 in days since the epoch (what Python's ``date`` holds).
_MIN_DAY, _MAX_DAY = -719_162, 2_932_896
_PER_SECOND = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}

#: Decimal arithmetic wide enough to scale any decimal256 exactly.
_EXACT = decimal.Context(prec=100)

#: The model's stand-in for NaN (NaN != NaN in Python; all NaNs are one value to a shard).
NAN = "<NaN>"


def _storage(t: pa.DataType) -> pa.DataType | None:
    """The integer type a temporal type is stored as, or ``None``."""
    if pa.types.is_temporal(t):
        return pa.int32() if t.bit_width == 32 else pa.int64()
    return None


def _int_range(t: pa.DataType) -> tuple[int, int]:
    """The storage range drawn for an integer or temporal type ``t``."""
    if pa.types.is_integer(t):
        bits = t.bit_width
        if pa.types.is_signed_integer(t):
            return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        return 0, 2**bits - 1
    if pa.types.is_date32(t):
        return _MIN_DAY, _MAX_DAY
    if pa.types.is_date64(t):
        return _MIN_DAY * _SECONDS_PER_DAY * 1000, _MAX_DAY * _SECONDS_PER_DAY * 1000
    if pa.types.is_time(t):
        return 0, _SECONDS_PER_DAY * _PER_SECOND[t.unit] - 1
    if pa.types.is_timestamp(t):
        per = _PER_SECOND[t.unit]
        if t.unit == "ns":  # int64 nanoseconds: 1677-09-21 .. 2262-04-11
            return -(2**63) + 1, 2**63 - 1
        # A day inside Python's range, so that any zone's local time is a datetime too.
        return (_MIN_DAY + 1) * _SECONDS_PER_DAY * per, _MAX_DAY * _SECONDS_PER_DAY * per
    if pa.types.is_duration(t):
        return -(2**62), 2**62
    raise TypeError(f"{t} has no integer range")


def column_values(t: pa.DataType, nullable: bool = True) -> st.SearchStrategy[Any]:
    """Values of a column of type ``t``, in the form :func:`arrow_array` takes: Python
    ints (the storage value) for integer and temporal types, floats, bools, ``str``,
    ``bytes``, ``Decimal``; ``None`` (null) when ``nullable``. Extremes, NaN, signed
    zeros and infinities, NUL and non-BMP characters come up often."""
    s: st.SearchStrategy[Any]
    if pa.types.is_date64(t):
        # date64 is milliseconds holding whole days (Arrow's spec; Parquet stores days).
        day = _SECONDS_PER_DAY * 1000
        s = column_values(pa.date32(), nullable=False).map(lambda d: d * day)
    elif pa.types.is_integer(t) or pa.types.is_temporal(t):
        lo, hi = _int_range(t)
        edges = sorted({lo, hi, 0 if lo <= 0 <= hi else lo, max(lo, -1), min(hi, 1)})
        s = st.one_of(
            st.sampled_from(edges),
            st.integers(lo, hi),
            st.integers(-3, 3).map(lambda n: min(max(n, lo), hi)),
        )
    elif pa.types.is_floating(t):
        width = t.bit_width
        big = 2.0**24 if width == 32 else 2.0**53
        special = [0.0, -0.0, math.nan, math.inf, -math.inf, big, big * 4, -big * 2, 1e16, 0.5]
        if width == 32:
            special = [x for x in special if math.isnan(x) or abs(x) <= 3.4e38]
        s = st.one_of(st.sampled_from(special), st.floats(width=width))
    elif pa.types.is_boolean(t):
        s = st.booleans()
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        s = st.one_of(
            st.sampled_from(["", "\x00", "a\x00b", "\U0001f600", "z", "é", "\uffff"]),
            st.text(max_size=12),
        )
    elif pa.types.is_fixed_size_binary(t):
        s = st.binary(min_size=t.byte_width, max_size=t.byte_width)
    elif pa.types.is_binary(t) or pa.types.is_large_binary(t):
        s = st.one_of(st.sampled_from([b"", b"\x00", b"\xff" * 3]), st.binary(max_size=12))
    elif pa.types.is_decimal(t):
        bound = 10**t.precision - 1
        s = st.one_of(st.sampled_from([-bound, bound, 0, 1, -1]), st.integers(-bound, bound)).map(
            lambda n, scale=t.scale: decimal.Decimal(n).scaleb(-scale, _EXACT)
        )
    else:
        raise TypeError(f"no values for type {t}")
    return st.one_of(st.none(), s) if nullable else s


def arrow_array(values: Sequence[Any], t: pa.DataType) -> pa.Array:
    """The Arrow array of type ``t`` holding ``values`` (as :func:`column_values`
    draws them)."""
    storage = _storage(t)
    if storage is not None:
        return pa.array(values, storage).view(t)
    return pa.array(values, t)


def literal(value: Any, t: pa.DataType) -> pa.Scalar:
    """The scalar of type ``t`` for a :func:`column_values` value."""
    return arrow_array([value], t)[0]


# ------------------------------------------------------------ schemas and tables


@st.composite
def shard_schemas(
    draw: st.DrawFn,
    types: Sequence[pa.DataType] = COLUMN_TYPES,
    max_keys: int = 2,
    max_values: int = 2,
) -> tuple[pa.Schema, pa.Schema]:
    """A shard's ``(key_schema, value_schema)``: 1..``max_keys`` key columns ``k0..``
    and 0..``max_values`` value columns ``v0..`` of types drawn from ``types``, each
    nullable or not."""
    nk = draw(st.integers(1, max_keys))
    nv = draw(st.integers(0, max_values))
    keys = [pa.field(f"k{i}", draw(st.sampled_from(types)), draw(st.booleans())) for i in range(nk)]
    vals = [pa.field(f"v{i}", draw(st.sampled_from(types)), draw(st.booleans())) for i in range(nv)]
    return pa.schema(keys), pa.schema(vals)


@st.composite
def update_tables(
    draw: st.DrawFn,
    key_schema: pa.Schema,
    value_schema: pa.Schema,
    times: Sequence[int] = (0,),
    max_rows: int = 12,
    dictionary: bool = True,
) -> pa.Table:
    """An updates table (key and value columns, ``_time`` drawn from ``times``, ``_diff``
    in -2..2 but 0) of up to ``max_rows`` rows. Rows repeat earlier (key, value) pairs
    often, with the other zero or another NaN, so consolidation has work to do. With
    ``dictionary``, string and binary columns may come dictionary-encoded (the write path
    decodes them)."""
    fields = [*key_schema, *value_schema]
    n = draw(st.integers(0, max_rows))
    rows: list[list[Any]] = []
    for _ in range(n):
        if rows and draw(st.integers(0, 2)) == 0:
            row = list(draw(st.sampled_from(rows)))
            for j in range(len(fields)):  # the same row again, maybe with the other zero
                if isinstance(row[j], float) and row[j] == 0.0:
                    row[j] = -row[j]
        else:
            row = [draw(column_values(f.type, f.nullable)) for f in fields]
        rows.append(row)
    cols = {}
    for j, f in enumerate(fields):
        arr = arrow_array([r[j] for r in rows], f.type)
        if (
            dictionary
            and (pa.types.is_string(f.type) or pa.types.is_binary(f.type))
            and draw(st.booleans())
        ):
            arr = arr.dictionary_encode()
        cols[f.name] = arr
    cols["_time"] = pa.array([draw(st.sampled_from(list(times))) for _ in rows], pa.int64())
    cols["_diff"] = pa.array(
        [draw(st.sampled_from([1, 1, 1, -1, 2, -2])) for _ in rows], pa.int64()
    )
    return pa.table(cols)


# ------------------------------------------------------------------------- model


def canonical_value(v: Any) -> Any:
    """``v`` as the model holds it: NaN as :data:`NAN`, ``-0.0`` as ``0.0``; other values
    unchanged (Python equality is then a shard's equality)."""
    if isinstance(v, float):
        if math.isnan(v):
            return NAN
        if v == 0.0:
            return 0.0
    return v


def _canonical_column(arr: pa.Array | pa.ChunkedArray) -> list[Any]:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    storage = _storage(arr.type)
    if storage is not None:
        arr = arr.view(storage)
    return [canonical_value(v) for v in arr.to_pylist()]


def written_values(table: pa.Table) -> dict[str, list[Any]]:
    """Column -> its values in :func:`column_values`' form (storage ints for temporal
    types; no canonicalisation), for :func:`filters`' ``seen``."""
    out = {}
    for name in table.column_names:
        arr = table.column(name).combine_chunks()
        if pa.types.is_dictionary(arr.type):
            arr = arr.dictionary_decode()
        storage = _storage(arr.type)
        out[name] = (arr.view(storage) if storage is not None else arr).to_pylist()
    return out


def canonical_rows(table: pa.Table, columns: Sequence[str] | None = None) -> list[tuple[Any, ...]]:
    """The rows of ``table`` (only ``columns``, if given) as tuples of canonical values
    (:func:`canonical_value`; temporal values as their integer storage)."""
    names = list(columns) if columns is not None else table.column_names
    cols = [_canonical_column(table.column(n)) for n in names]
    return list(zip(*cols, strict=True)) if cols else [() for _ in range(table.num_rows)]


def model_snapshot(
    tables: Sequence[pa.Table], as_of: int, data_columns: Sequence[str]
) -> Counter[tuple[Any, ...]]:
    """The model of ``snapshot(as_of)``: the multiset (row -> summed diff, zero sums
    dropped) of the canonical ``data_columns`` of every update at or before ``as_of``."""
    out: Counter[tuple[Any, ...]] = Counter()
    for t in tables:
        times = t.column("_time").to_pylist()
        diffs = t.column("_diff").to_pylist()
        for row, time, diff in zip(canonical_rows(t, data_columns), times, diffs, strict=True):
            if time <= as_of:
                out[row] += diff
    return Counter({r: d for r, d in out.items() if d != 0})


# ----------------------------------------------------------------------- filters


def _other_type(t: pa.DataType) -> st.SearchStrategy[pa.DataType]:
    """A type other than ``t`` whose values a filter may compare ``t``'s with (of the
    kinds users mix up: int/float/string/bool, dates/timestamps, zones)."""
    pool = [
        pa.int64(),
        pa.int8(),
        pa.float64(),
        pa.string(),
        pa.bool_(),
        pa.date32(),
        pa.timestamp("us"),
        pa.timestamp("us", "UTC"),
        pa.timestamp("ms", "+01:00"),
        pa.decimal128(5, 2),
    ]
    return st.sampled_from([x for x in pool if x != t])


@st.composite
def _leaf(draw: st.DrawFn, schema: pa.Schema, seen: dict[str, list[Any]]) -> pc.Expression:
    name = draw(st.sampled_from(schema.names))
    t = schema.field(name).type
    f = pc.field(name)
    known = [v for v in seen.get(name, []) if v is not None]

    def value_of(tt: pa.DataType) -> st.SearchStrategy[Any]:
        fresh = column_values(tt, nullable=False)
        return st.one_of(st.sampled_from(known), fresh) if known and tt == t else fresh

    shape = draw(st.sampled_from(["cmp", "cmp", "isin", "isin_other", "null", "valid"]))
    if shape == "null":
        return f.is_null()
    if shape == "valid":
        return f.is_valid()
    if shape == "cmp":
        tt = t if draw(st.integers(0, 3)) else draw(_other_type(t))
        lit = literal(draw(value_of(tt)), tt)
        op: Callable[[Any, Any], pc.Expression] = draw(
            st.sampled_from(
                [
                    lambda a, b: a == b,
                    lambda a, b: a != b,
                    lambda a, b: a < b,
                    lambda a, b: a <= b,
                    lambda a, b: a > b,
                    lambda a, b: a >= b,
                ]
            )
        )
        return op(f, lit)
    tt = t if shape == "isin" else draw(_other_type(t))
    values = draw(st.lists(value_of(tt), min_size=0, max_size=4))
    if draw(st.integers(0, 4)) == 0:
        values.append(None)
    return f.isin(arrow_array(values, tt))


@st.composite
def filters(
    draw: st.DrawFn,
    schema: pa.Schema,
    seen: dict[str, list[Any]] | None = None,
    depth: int = 2,
) -> pc.Expression:
    """A boolean filter over ``schema``'s columns: a leaf (a comparison with a literal of
    the column's type or another, ``isin`` of values of either, ``is_null``,
    ``is_valid``) or, up to ``depth`` levels, ``~``, ``|``, ``&``, ``and_kleene``,
    ``or_kleene`` or ``and_`` of filters. ``seen`` (column -> values written) makes
    literals hit the data often."""
    seen = seen or {}
    if depth <= 0 or draw(st.integers(0, 2)) == 0:
        return draw(_leaf(schema, seen))
    shape = draw(st.sampled_from(["not", "or", "and", "and_kleene", "or_kleene", "and_"]))
    a = draw(filters(schema, seen, depth - 1))
    if shape == "not":
        return ~a
    b = draw(filters(schema, seen, depth - 1))
    if shape == "or":
        return a | b
    if shape == "and":
        return a & b
    fn = {"and_kleene": pc.and_kleene, "or_kleene": pc.or_kleene, "and_": pc.and_}[shape]
    out: pc.Expression = fn(a, b)
    return out
