"""Protects: consolidation sums each (key, value, time) exactly, on every sort path.

A property: consolidate equals a Counter model for chunked inputs of many
types, on every sort path (arrow / packed codes / narrow codes / the Python path of
small tables), and both sort kinds."""

import math
from collections import Counter
from contextlib import contextmanager
from decimal import Decimal

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import persist.consolidation as consolidation
from persist.consolidation import consolidate

pytestmark = pytest.mark.adversarial

NAN = float("nan")


@contextmanager
def path(kind: str, sort_kind: str | None):
    c = consolidation
    old = c._CODES_MIN_ROWS, c._WORD_BITS, c._sort_kind, c._SMALL_ROWS
    c._CODES_MIN_ROWS = 10**12 if kind == "arrow" else 0
    c._WORD_BITS = 8 if kind == "narrow" else 64
    c._SMALL_ROWS = 10**12 if kind == "small" else 0  # the Python path at any size
    if sort_kind is not None:
        c._sort_kind = lambda w: sort_kind  # type: ignore[assignment]
    try:
        yield
    finally:
        c._CODES_MIN_ROWS, c._WORD_BITS, c._sort_kind, c._SMALL_ROWS = old


def _norm(x):
    if isinstance(x, float):
        if math.isnan(x):
            return ("nan",)
        if x == 0.0:
            return 0.0
    return x


def _okey(x):
    if x is None:
        return (2, 0)
    if x == ("nan",):
        return (1, 0)
    return (0, x)


SCHEMA = pa.schema(
    [
        ("f", pa.float64()),
        ("g", pa.float32()),
        ("s", pa.string()),
        ("b", pa.bool_()),
        ("ts", pa.timestamp("us", tz="UTC")),
        ("d", pa.decimal128(20, 2)),
        ("fb", pa.binary(2)),
        ("_time", pa.int64()),
        ("_diff", pa.int64()),
    ]
)
KEYS = ["f", "g", "s"]
VALS = ["b", "ts", "d", "fb"]

floats = st.sampled_from([None, NAN, -0.0, 0.0, 1.0, -1.5, 2.5e300, -math.inf, math.inf, 3.0])
f32 = st.sampled_from([None, NAN, -0.0, 0.0, 0.5, -2.0])
strs = st.sampled_from([None, "", "\x00", "a", "a\x00", "a\x00b", "b", "é"])
row = st.tuples(
    floats,
    f32,
    strs,
    st.sampled_from([None, True, False]),
    st.sampled_from([None, 0, -1, 10**15]),
    st.sampled_from([None, Decimal("0.00"), Decimal("-1.50"), Decimal("99999.99")]),
    st.sampled_from([None, b"\x00\x00", b"ab", b"\x00a"]),
    st.integers(0, 4),
    st.integers(-2, 2),
)


def _table(rows, cuts):
    cols = list(zip(*rows, strict=True))
    arrays = []
    for c, f in zip(cols, SCHEMA, strict=True):
        if f.name == "ts":
            arr = pa.array([None if v is None else v for v in c], pa.int64()).cast(f.type)
        else:
            arr = pa.array(list(c), f.type)
        arrays.append(arr)
    t = pa.Table.from_arrays(arrays, schema=SCHEMA)
    bounds = sorted(set([0, *[min(x, len(rows)) for x in cuts], len(rows)]))
    batches = [t.slice(a, b - a) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
    return pa.concat_tables(batches) if batches else t


def _model(table, since):
    acc = Counter()
    for r in table.to_pylist():
        t = r["_time"] if since is None else max(r["_time"], since)
        k = tuple(_norm(r[c]) for c in [*KEYS, *VALS])
        acc[(k, t)] += r["_diff"]
    return {k: v for k, v in acc.items() if v != 0}


@settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(
    rows=st.lists(row, min_size=0, max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=10),
    since=st.one_of(st.none(), st.integers(0, 5)),
    kind=st.sampled_from(["arrow", "codes", "narrow", "small"]),
    sort_kind=st.sampled_from([None, "stable", "quicksort"]),
)
def test_consolidate_matches_model(rows, cuts, since, kind, sort_kind) -> None:
    if not rows:
        return
    table = _table(rows, cuts)
    with path(kind, sort_kind):
        out = consolidate(table, KEYS, VALS, since)
    got = {}
    recs = out.to_pylist()
    for r in recs:
        k = tuple(_norm(r[c]) for c in [*KEYS, *VALS])
        key = (k, r["_time"])
        assert key not in got, f"duplicate group {key}"
        got[key] = r["_diff"]
    assert got == _model(table, since)
    # sorted by (keys, values, time), nulls last, NaN after numbers
    keys = [
        tuple(_okey(x) for x in k) + (t,)
        for (k, t) in [(tuple(_norm(r[c]) for c in [*KEYS, *VALS]), r["_time"]) for r in recs]
    ]
    assert keys == sorted(keys)
    assert out.schema.equals(SCHEMA)


def test_many_small_chunks_large() -> None:
    # more rows than the combine threshold in total, many one-row chunks, codes path
    rng = np.random.default_rng(7)
    n = 3000
    k = rng.integers(0, 50, n)
    t = pa.table({"k": k, "_time": rng.integers(0, 3, n), "_diff": rng.integers(-1, 2, n)})
    chunked = pa.concat_tables([t.slice(i, 1) for i in range(n)])
    with path("codes", None):
        a = consolidate(chunked, ["k"], [], 1)
    b = consolidate(t, ["k"], [], 1)
    assert a.equals(b)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    values=st.lists(floats, min_size=1, max_size=40),
    under=st.lists(st.sampled_from([NAN, math.inf, -0.0, 7.25, 2.0**60]), min_size=40, max_size=40),
    prefix=st.integers(0, 9),
    typ=st.sampled_from([pa.float64(), pa.float32()]),
)
def test_float_codes_follow_the_order_whatever_lies_under_nulls(values, under, prefix, typ):
    """The sort codes of a float column (read from its values buffer as it lies) order
    and equate its values as consolidation does (numbers < NaN < null, NaN == NaN,
    -0.0 == 0.0), also for a slice at an offset with any bytes under its null slots (NaN,
    infinities, non-integral or huge values there never reach a code)."""
    n = len(values)
    filled = [under[i] if v is None else v for i, v in enumerate(values)]
    plain = pa.array(values, typ)
    validity = pa.array([1.0] * prefix + values, typ).buffers()[0]
    data = pa.array([1.5] * prefix + filled, typ).buffers()[1]
    laid = pa.Array.from_buffers(typ, prefix + n, [validity, data], null_count=-1).slice(prefix)
    codes, size = consolidation._float_codes(laid)
    assert np.array_equal(codes, consolidation._float_codes(plain)[0])
    assert len(codes) == n and int(codes.max()) < size
    want = [_okey(_norm(v)) for v in plain.to_pylist()]  # the values as stored
    for i in range(n):
        for j in range(n):
            assert (codes[i] < codes[j]) == (want[i] < want[j])
            assert (codes[i] == codes[j]) == (want[i] == want[j])
