"""Protects: the Python path of :func:`persist.consolidation.consolidate_order` for
tables of a few rows (``_SMALL_ROWS``: a merge of one-row parts) gives exactly what the
Arrow path gives: the same rows in the same order, the same representative of each
group (``-0.0`` or ``0.0``, which NaN), the same chunks (hence the same encoded inline
part, byte for byte), and the same ``DiffOverflow``.

A differential hypothesis test over random small tables of every supported kind of
column (floats with NaN, ``-0.0`` and infinities, nulls everywhere, strings with NUL
and non-ASCII characters, binary, decimals, temporal types, booleans, unsigned
integers), diffs that cancel to zero, several times, a since, and several chunks."""

from __future__ import annotations

import math
from decimal import Decimal

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import persist.consolidation as consolidation
from persist.consolidation import consolidate_order
from persist.encoding import _ipc_stream
from persist.errors import DiffOverflow
from tests.support.arrow_types import NARROW_DECIMALS

NAN = float("nan")

SCHEMA = pa.schema(
    [
        ("f", pa.float64()),
        ("g", pa.float32()),
        ("s", pa.string()),
        ("u", pa.uint64()),
        ("ls", pa.large_string()),
        ("b", pa.bool_()),
        ("i8", pa.int8()),
        ("ts", pa.timestamp("ns", tz="Europe/Paris")),
        ("day", pa.date32()),
        ("tm", pa.time32("ms")),
        ("dur", pa.duration("s")),
        ("d", pa.decimal128(20, 2)),
        ("bin", pa.large_binary()),
        ("fb", pa.binary(2)),
        # Narrow decimals (pyarrow >= 18): sorted by value on both paths.
        *[(d, getattr(pa, d)(7, 2)) for d in NARROW_DECIMALS],
        ("_time", pa.int64()),
        ("_diff", pa.int64()),
    ]
)
NAMES = [f.name for f in SCHEMA][:-2]

VALUES = {
    "f": [None, NAN, -0.0, 0.0, 1.0, -1.5, 2.5e300, -math.inf, math.inf],
    "g": [None, NAN, -0.0, 0.0, 0.5, -2.0],
    "s": [None, "", "\x00", "a", "a\x00", "b", "é", "\U0001f600", "Z"],
    "u": [None, 0, 1, 2**63, 2**64 - 1],
    "ls": [None, "", "x", "xy", "ÿ"],
    "b": [None, True, False],
    "i8": [None, -128, 0, 127],
    "ts": [None, -1, 0, 10**18],
    "day": [None, -3, 0, 19000],
    "tm": [None, 0, 1, 86_399_999],
    "dur": [None, -(10**12), 0, 5],  # DiffOverflow names its row as Python values
    "d": [None, Decimal("0.00"), Decimal("-1.50"), Decimal("99999.99")],
    "bin": [None, b"", b"\x00", b"\xff", b"\x00\xff"],
    "fb": [None, b"\x00\x00", b"ab", b"\x00a", b"\xff\x00"],
    **{
        d: [None, Decimal("-1.00"), Decimal("0.50"), Decimal("0.00"), Decimal("-99999.99")]
        for d in NARROW_DECIMALS
    },
}


def _column(name: str, values: list[object], t: pa.DataType) -> pa.Array:
    if pa.types.is_temporal(t):
        storage = pa.int32() if t.bit_width == 32 else pa.int64()
        return pa.array(values, storage).view(t)
    return pa.array(values, t)


@st.composite
def tables(draw: st.DrawFn) -> pa.Table:
    n = draw(st.integers(2, 40))
    cols = [
        _column(
            f.name, draw(st.lists(st.sampled_from(VALUES[f.name]), min_size=n, max_size=n)), f.type
        )
        for f in SCHEMA
        if f.name in VALUES
    ]
    big = draw(st.booleans())
    diff_values = [-(2**62), 2**62, 2**63 - 1, -1, 1] if big else [-2, -1, 0, 1, 2]
    times = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    diffs = draw(st.lists(st.sampled_from(diff_values), min_size=n, max_size=n))
    cols += [pa.array(times, pa.int64()), pa.array(diffs, pa.int64())]
    table = pa.Table.from_arrays(cols, schema=SCHEMA)
    # Rows often repeat (so that groups form and diffs cancel): draw rows from a few.
    picks = draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=32))
    table = table.take(pa.array(picks, pa.int64()))
    # Equal rows of different representations: a zero's sign flipped in some copies.
    for name in ("f", "g"):
        flips = draw(st.lists(st.booleans(), min_size=len(picks), max_size=len(picks)))
        vals = [
            -v if flip and v == 0.0 else v
            for v, flip in zip(table.column(name).to_pylist(), flips, strict=True)
        ]
        i = table.schema.get_field_index(name)
        table = table.set_column(i, SCHEMA.field(name), pa.array(vals, SCHEMA.field(name).type))
    # A column carried along (neither key nor value): which row of a group represents it.
    table = table.append_column("row", pa.array(range(len(picks)), pa.int64()))
    cuts = draw(st.lists(st.integers(1, len(picks) - 1), max_size=4)) if len(picks) > 1 else []
    bounds = sorted({0, *cuts, len(picks)})
    return pa.concat_tables(
        [table.slice(a, b - a) for a, b in zip(bounds, bounds[1:], strict=False)]
    )


def _run(table: pa.Table, keys: list[str], values: list[str], since: int | None, small: bool):
    old = consolidation._SMALL_ROWS
    consolidation._SMALL_ROWS = 10**6 if small else 0
    try:
        base, order = consolidate_order(table, keys, values, since)
    except DiffOverflow as e:
        return ("overflow", repr(e.row) if hasattr(e, "row") else str(e))
    finally:
        consolidation._SMALL_ROWS = old
    assert order is None  # tables this small are gathered at once on both paths
    return ("ok", base.schema, [c.num_chunks for c in base.columns], _ipc_stream(base).to_pybytes())


@settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(
    table=tables(),
    split=st.integers(0, len(NAMES)),
    perm_seed=st.integers(0, 2**32 - 1),
    since=st.one_of(st.none(), st.integers(0, 4)),
    own_times=st.booleans(),
)
def test_small_path_matches_arrow_path(
    table: pa.Table, split: int, perm_seed: int, since: int | None, own_times: bool
) -> None:
    names = list(NAMES)
    rng = np.random.default_rng(perm_seed)
    rng.shuffle(names)
    keys, values = names[:split], names[split:]
    if own_times:
        # A merge of one-row batches, each at its own time (the since may still make
        # some equal): rows tied on every key and value column are told apart by time.
        times = pa.array(rng.permutation(table.num_rows) + 3, pa.int64())
        i = table.schema.get_field_index("_time")
        table = table.set_column(i, table.schema.field(i), times)
    assert _run(table, keys, values, since, small=True) == _run(
        table, keys, values, since, small=False
    )


def test_small_path_is_taken_for_a_merge_of_one_row_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    # Eight one-row parts (one chunk each), out of order, two equal rows whose diffs cancel.
    rows = [
        (3, "c", 1, 1),
        (1, "a", 1, 1),
        (2, "b", 2, 1),
        (1, "a", 1, -1),
        (5, "e", 3, 1),
        (4, "d", 1, 1),
        (0, "z", 0, 1),
        (2, "b", 1, 1),
    ]
    parts = [pa.table({"k": [k], "v": [v], "_time": [t], "_diff": [d]}) for k, v, t, d in rows]
    table = pa.concat_tables(parts)
    calls: list[int] = []
    real = consolidation._small_order
    monkeypatch.setattr(
        consolidation, "_small_order", lambda t, c: calls.append(t.num_rows) or real(t, c)
    )
    base, order = consolidate_order(table, ["k"], ["v"], since=1)
    assert calls == [8]
    got = base.take(order) if order is not None else base
    assert got.to_pylist() == [
        {"k": 0, "v": "z", "_time": 1, "_diff": 1},
        {"k": 2, "v": "b", "_time": 1, "_diff": 1},
        {"k": 2, "v": "b", "_time": 2, "_diff": 1},
        {"k": 3, "v": "c", "_time": 1, "_diff": 1},
        {"k": 4, "v": "d", "_time": 1, "_diff": 1},
        {"k": 5, "v": "e", "_time": 3, "_diff": 1},
    ]


@pytest.mark.parametrize("make", NARROW_DECIMALS)
def test_narrow_decimals_sort_by_value_on_both_paths(make: str) -> None:
    """``decimal32``/``decimal64`` columns (pyarrow >= 18; ``is_decimal`` accepts them):
    Arrow has no sort kernel for them and its multi-column sort ordered them by their
    bytes (``0.50`` before ``-1.00``), while Python orders them by value: both paths
    now sort them by value, as every decimal128."""
    t = getattr(pa, make)(9, 2)
    vals = [Decimal(i - 20) / 4 for i in (5, 3, 40, 1, 17, 22, 9, 0, 33, 5)]
    n = len(vals)
    table = pa.table(
        {
            "k": pa.array(vals, t),
            "v": pa.array(range(n), pa.int64()),
            "_time": pa.array([0] * n, pa.int64()),
            "_diff": pa.array([1, -1] * (n // 2), pa.int64()),
        }
    )
    small = _run(table, ["k"], ["v"], None, small=True)
    assert small == _run(table, ["k"], ["v"], None, small=False)
    base, _order = consolidate_order(table, ["k"], ["v"])
    assert base.column("k").to_pylist() == sorted(vals)


def test_strings_that_are_not_utf8_take_the_arrow_path() -> None:
    """A string column whose bytes are not UTF-8 (Arrow does not check them unless
    asked; ``to_updates_table`` takes them, and a part written by another process holds
    what it was given): the Python path cannot make Python strings of them, and leaves
    the table to Arrow, which orders them by their bytes, rather than failing a merge of
    a few parts with ``UnicodeDecodeError`` (a larger merge of the same rows passes)."""
    data = b"\xff\xfeb\x80a\xff"
    offsets = pa.py_buffer(np.array([0, 1, 2, 3, 4, 5, 6], dtype=np.int32).tobytes())
    s = pa.Array.from_buffers(pa.string(), 6, [None, offsets, pa.py_buffer(data)])
    table = pa.table(
        {
            "s": s,
            "_time": pa.array([0] * 6, pa.int64()),
            "_diff": pa.array([1, 1, 1, 1, 1, -1], pa.int64()),
        }
    )
    got = _run(table, ["s"], [], None, small=True)
    assert got == _run(table, ["s"], [], None, small=False)


def test_small_path_converts_only_the_columns_that_break_ties(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight one-row parts told apart by their first key column: the Python path sorts
    them converting that column alone (and the one whose ties the second breaks), not
    every key and value column: converting each cost ~12 us of a merge of one-row
    parts."""
    n = 8
    firsts = [3, 1, 2, 2, 7, 5, 0, 4]
    table = pa.table(
        {
            "a": pa.array(firsts, pa.int64()),
            "b": pa.array([f"b{i % 3}" for i in range(n)], pa.string()),
            **{f"c{j}": pa.array([float(i * j) for i in range(n)]) for j in range(10)},
            "_time": pa.array(range(n), pa.int64()),
            "_diff": pa.array([1] * n, pa.int64()),
        }
    )
    parts = pa.concat_tables([table.slice(i, 1) for i in range(n)])
    converted: list[str] = []
    real = consolidation._py_values
    monkeypatch.setattr(
        consolidation, "_py_values", lambda col: converted.append(col.type) or real(col)
    )
    keys = ["a", "b", *[f"c{j}" for j in range(10)]]
    got = _run(parts, keys, [], None, small=True)
    assert converted == [pa.int64(), pa.string()]  # a, then b for the tied 2s
    monkeypatch.undo()
    assert got == _run(parts, keys, [], None, small=False)


@pytest.mark.parametrize("tied", [False, True])
def test_strings_that_are_not_utf8_after_the_deciding_column(tied: bool) -> None:
    """A string column whose bytes are not UTF-8 after a key column that tells every row
    apart is never converted (the Python path gives the Arrow path's result); when the
    rows tie on that key, the Python path needs it and leaves the table to Arrow."""
    data = b"\xff\xfeb\x80a\xff"
    offsets = pa.py_buffer(np.array([0, 1, 2, 3, 4, 5, 6], dtype=np.int32).tobytes())
    s = pa.Array.from_buffers(pa.string(), 6, [None, offsets, pa.py_buffer(data)])
    table = pa.table(
        {
            "k": pa.array([0] * 6 if tied else [5, 3, 4, 0, 1, 2], pa.int64()),
            "s": s,
            "_time": pa.array([0] * 6, pa.int64()),
            "_diff": pa.array([1, 1, 1, 1, 1, -1], pa.int64()),
        }
    )
    assert _run(table, ["k", "s"], [], None, small=True) == _run(
        table, ["k", "s"], [], None, small=False
    )


def test_a_merge_of_eight_small_runs_takes_the_python_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The compactor's next merge up (eight runs of eight rows: 64 rows) is sorted in
    Python too, with the Arrow path's result."""
    runs = [
        pa.table(
            {
                "k": pa.array([(r * 5 + i * 3) % 11 for i in range(8)], pa.int64()),
                "v": pa.array([f"v{(r + i) % 4}" for i in range(8)], pa.string()),
                "_time": pa.array([r * 8 + i for i in range(8)], pa.int64()),
                "_diff": pa.array([1, -1] * 4, pa.int64()),
            }
        )
        for r in range(8)
    ]
    table = pa.concat_tables(runs)
    calls: list[int] = []
    real = consolidation._small_order
    monkeypatch.setattr(
        consolidation, "_small_order", lambda t, c: calls.append(t.num_rows) or real(t, c)
    )
    base, order = consolidate_order(table, ["k"], ["v"], since=20)
    assert calls == [64]
    monkeypatch.undo()
    got = base.take(order) if order is not None else base
    old = consolidation._SMALL_ROWS
    consolidation._SMALL_ROWS = 0
    try:
        arrow_base, arrow_order = consolidate_order(table, ["k"], ["v"], since=20)
    finally:
        consolidation._SMALL_ROWS = old
    want = arrow_base.take(arrow_order) if arrow_order is not None else arrow_base
    assert got.equals(want)
