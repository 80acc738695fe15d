"""Tests of persist.parts: updates schemas and tables, consolidation against a plain-Python
reference (hypothesis; both sort paths), Parquet parts with checksums, and writing/reading
runs of parts through real blob stores (inline writes, parallel parts, faults)."""

from __future__ import annotations

import datetime as dt
import decimal
import math
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import persist.consolidation as consolidation
import persist.decoding as decoding
import persist.encoding as encoding
import persist.parts as parts
from persist.blob import Blob, BlobMetrics, FileBlob, MemoryBlob, UnreliableBlob
from persist.encoding import INLINE_ZSTD_MAGIC
from persist.errors import BlobError, CorruptPart, InvalidKey, InvalidUsage
from persist.parts import (
    INLINE_CACHE,
    consolidate,
    decode_part,
    encode_inline_part,
    encode_part,
    make_part_ref,
    read_parts,
    split_for_parts,
    to_updates_table,
    updates_schema,
    write_parts,
)
from persist.stats import table_stats
from tests.support.arrow_types import NARROW_DECIMALS

KS = pa.schema([("k", pa.int64()), ("name", pa.string())])
VS = pa.schema([("v", pa.float64())])


def _table(rows: list[tuple[Any, ...]], schema: pa.Schema | None = None) -> pa.Table:
    schema = schema or updates_schema(KS, VS)
    cols = list(zip(*rows, strict=True)) if rows else [[] for _ in schema]
    return pa.Table.from_arrays(
        [pa.array(c, f.type) for c, f in zip(cols, schema, strict=True)], schema=schema
    )


SORT_PATHS = ("arrow", "codes", "codes-narrow")


@contextmanager
def sort_path(path: str) -> Iterator[None]:
    """Force consolidate's sort path: "arrow" (multi-column sort_indices), "codes"
    (packed integer codes), or "codes-narrow" (codes with an 8-bit first word, so that
    most rows tie on it and the remaining columns resolve the order)."""
    old = consolidation._CODES_MIN_ROWS, consolidation._WORD_BITS
    consolidation._CODES_MIN_ROWS = 10**12 if path == "arrow" else 0
    consolidation._WORD_BITS = 8 if path == "codes-narrow" else 64
    try:
        yield
    finally:
        consolidation._CODES_MIN_ROWS, consolidation._WORD_BITS = old


# ------------------------------------------------------------------ schemas


def test_updates_schema_layout() -> None:
    s = updates_schema(KS, VS)
    assert s.names == ["k", "name", "v", "_time", "_diff"]
    assert s.field("_time").type == pa.int64() and not s.field("_time").nullable
    assert s.field("_diff").type == pa.int64() and not s.field("_diff").nullable


@pytest.mark.parametrize(
    ("keys", "values", "match"),
    [
        ([("_time", pa.int64())], [], "reserved"),
        ([("k", pa.int64())], [("_diff", pa.int64())], "reserved"),
        ([("_private", pa.int64())], [], "reserved"),
        ([("k", pa.int64()), ("k", pa.string())], [], "twice in the key schema"),
        ([("k", pa.int64())], [("k", pa.string())], "both the key and the value"),
        ([("", pa.int64())], [], "empty name"),
        ([("k", pa.list_(pa.int64()))], [], "'k' has unsupported type list"),
        ([("k", pa.int64())], [("s", pa.struct([("a", pa.int8())]))], "'s' has unsupported"),
        ([("k", pa.dictionary(pa.int8(), pa.string()))], [], "unsupported type dictionary"),
    ],
)
def test_updates_schema_rejects(keys: list[Any], values: list[Any], match: str) -> None:
    with pytest.raises(InvalidUsage, match=match):
        updates_schema(pa.schema(keys), pa.schema(values))


# ----------------------------------------------------------- updates tables


def test_to_updates_table_from_table_reorders_and_widens() -> None:
    t = pa.table(
        {
            "_diff": pa.array([1], pa.int32()),
            "v": pa.array([1.5], pa.float32()),
            "name": pa.array(["x"]).dictionary_encode(),
            "_time": pa.array([3], pa.int64()),
            "k": pa.array([7], pa.int16()),
        }
    )
    out = to_updates_table(t, KS, VS)
    assert out.schema == updates_schema(KS, VS)
    assert out.to_pylist() == [{"k": 7, "name": "x", "v": 1.5, "_time": 3, "_diff": 1}]
    rb = to_updates_table(t.to_batches()[0], KS, VS)
    assert rb.equals(out)


def test_to_updates_table_from_rows() -> None:
    out = to_updates_table([((1, "a"), (0.5,), 2, 1), ((None, None), (None,), 3, -1)][:0], KS, VS)
    assert out.num_rows == 0 and out.schema == updates_schema(KS, VS)
    out = to_updates_table([(((1, "a"), (0.5,)), 2, 1), (((None, None), (None,)), 3, -1)], KS, VS)
    assert out.to_pylist() == [
        {"k": 1, "name": "a", "v": 0.5, "_time": 2, "_diff": 1},
        {"k": None, "name": None, "v": None, "_time": 3, "_diff": -1},
    ]


@pytest.mark.parametrize(
    ("columns", "match"),
    [
        ({"k": pa.array([1], pa.float64())}, r"column 'k' has type double, the schema says int64"),
        ({"k": pa.array([1], pa.uint64())}, r"column 'k' has type uint64"),
        ({"name": pa.array([b"x"], pa.binary())}, r"column 'name' has type binary"),
        ({"_time": pa.array([1], pa.uint64())}, r"column '_time' has type uint64"),
        ({"_time": pa.array([None], pa.int64())}, r"'_time' has 1 nulls"),
        ({"_diff": pa.array([None], pa.int64())}, r"'_diff' has 1 nulls"),
        ({"extra": pa.array([1])}, r"unexpected \['extra'\]"),
        ({"v": None}, r"missing \['v'\]"),
    ],
)
def test_to_updates_table_rejects_bad_tables(columns: dict[str, Any], match: str) -> None:
    base: dict[str, Any] = {
        "k": pa.array([1], pa.int64()),
        "name": pa.array(["a"]),
        "v": pa.array([1.0]),
        "_time": pa.array([0], pa.int64()),
        "_diff": pa.array([1], pa.int64()),
    }
    base.update(columns)
    t = pa.table({k: v for k, v in base.items() if v is not None})
    with pytest.raises(InvalidUsage, match=match):
        to_updates_table(t, KS, VS)


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([(1, 2)], "update 0 is not"),
        ([(((1,), (0.5,)), 0, 1)], r"key \(1,\) is not a tuple of 2"),
        ([(((1, "a"), 0.5), 0, 1)], "value 0.5 is not a tuple of 1"),
        ([(((1, "a"), (0.5,)), "t", 1)], "time 't' is not an int"),
        ([(((1, "a"), (0.5,)), 0, 1.0)], "diff 1.0 is not an int"),
        ([(((1, "a"), (0.5,)), 0, True)], "diff True is not an int"),
        ([(((1, "a"), (0.5,)), 2**63, 1)], "column '_time'"),
        ([((("x", "a"), (0.5,)), 0, 1)], "column 'k': values do not fit type int64"),
    ],
)
def test_to_updates_table_rejects_bad_rows(rows: list[Any], match: str) -> None:
    with pytest.raises(InvalidUsage, match=match):
        to_updates_table(rows, KS, VS)


def test_to_updates_table_rejects_other_inputs() -> None:
    with pytest.raises(InvalidUsage, match="not dict"):
        to_updates_table({"k": [1]}, KS, VS)  # type: ignore[arg-type]


# ------------------------------------------------------------- consolidate


NAN = float("nan")  # the one NaN object: NaN rows are equal to each other


def _canon(row: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(NAN if isinstance(x, float) and math.isnan(x) else x for x in row)


def _order_key(x: Any) -> tuple[int, Any]:
    """Arrow's order: values, then NaN, then null."""
    if x is None:
        return (2, 0)
    if x is NAN:
        return (1, 0)
    return (0, x)


def _reference(rows: list[tuple[Any, ...]], since: int | None) -> list[tuple[Any, ...]]:
    """Plain-Python consolidation: rows are (*key, *value, time, diff)."""
    acc: dict[tuple[Any, ...], int] = defaultdict(int)
    for *kv, t, d in map(_canon, rows):
        if since is not None:
            t = max(t, since)
        acc[(*kv, t)] += d
    out = [(*kvt, d) for kvt, d in acc.items() if d != 0]
    out.sort(key=lambda r: tuple(_order_key(x) for x in r[:-1]))
    return out


def _rows_of(table: pa.Table) -> list[tuple[Any, ...]]:
    return [_canon(tuple(r.values())) for r in table.to_pylist()]


_names = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=3)
_row = st.tuples(
    st.one_of(st.none(), st.integers(-3, 3), st.integers(-(2**63), 2**63 - 1)),
    st.one_of(st.none(), _names),
    st.one_of(st.none(), st.floats(width=64), st.sampled_from([0.0, -0.0, 1.0, NAN, 2.0])),
    st.integers(0, 4),
    st.integers(-2, 2),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_row, max_size=40), st.one_of(st.none(), st.integers(0, 5)), st.integers(1, 3))
def test_consolidate_matches_reference(
    rows: list[tuple[Any, ...]], since: int | None, chunks: int
) -> None:
    table = _table(rows)
    # Chunked input (as read_parts gives) must consolidate the same.
    step = max(1, math.ceil(len(rows) / chunks))
    chunked = pa.concat_tables([table.slice(i, step) for i in range(0, len(rows), step)] or [table])
    expected = _reference(rows, since)
    for path in SORT_PATHS:
        with sort_path(path):
            out = consolidate(chunked, ["k", "name"], ["v"], since=since)
        assert out.schema == table.schema
        assert _rows_of(out) == expected, path


_wide_types: list[tuple[pa.DataType, st.SearchStrategy[Any]]] = [
    (pa.int8(), st.integers(-128, 127)),
    (pa.uint64(), st.integers(0, 2**64 - 1)),
    (pa.float32(), st.floats(width=32)),
    (pa.float64(), st.sampled_from([-0.0, 0.0, 3.0, NAN, -7.0])),
    (pa.bool_(), st.booleans()),
    (pa.large_string(), _names),
    (pa.binary(), st.binary(max_size=3)),
    (pa.binary(2), st.binary(min_size=2, max_size=2)),
    (pa.date32(), st.dates()),
    (pa.timestamp("us", tz="UTC"), st.datetimes(timezones=st.just(dt.UTC))),
    (
        pa.duration("s"),
        st.timedeltas(min_value=dt.timedelta(days=-3), max_value=dt.timedelta(days=3)).map(
            lambda d: dt.timedelta(seconds=int(d.total_seconds()))
        ),
    ),
    (pa.decimal128(6, 2), st.decimals(min_value=-9999, max_value=9999, places=2, allow_nan=False)),
]


@st.composite
def _typed_rows(draw: st.DrawFn) -> tuple[pa.Schema, pa.Schema, list[tuple[Any, ...]]]:
    idx = draw(st.lists(st.integers(0, len(_wide_types) - 1), min_size=1, max_size=3))
    fields = [(f"c{i}", _wide_types[j]) for i, j in enumerate(idx)]
    nkeys = draw(st.integers(0, len(fields)))
    pools = [
        draw(st.lists(st.one_of(st.none(), strat), min_size=1, max_size=3))
        for _, (_, strat) in fields
    ]
    n = draw(st.integers(0, 30))
    rows = [
        (
            *(draw(st.sampled_from(p)) for p in pools),
            draw(st.integers(0, 3)),
            draw(st.integers(-1, 1)),
        )
        for _ in range(n)
    ]
    ks = pa.schema([(name, t) for name, (t, _) in fields[:nkeys]])
    vs = pa.schema([(name, t) for name, (t, _) in fields[nkeys:]])
    return ks, vs, rows


@settings(max_examples=120, deadline=None)
@given(_typed_rows(), st.one_of(st.none(), st.integers(0, 3)))
def test_consolidate_all_types_matches_reference(
    typed: tuple[pa.Schema, pa.Schema, list[tuple[Any, ...]]], since: int | None
) -> None:
    ks, vs, rows = typed
    schema = updates_schema(ks, vs)
    table = _table(rows, schema)
    # The reference compares the values pyarrow round-trips.
    expected = _reference(_rows_of(table), since)
    for path in SORT_PATHS:
        with sort_path(path):
            out = consolidate(table, ks.names, vs.names, since=since)
        assert _rows_of(out) == expected, path


@pytest.mark.parametrize(("low", "high", "top"), [(-1e300, 2.5, math.inf), (-3.0, 2.0, 5.0)])
def test_consolidate_float_nan_and_signed_zero(low: float, high: float, top: float) -> None:
    """General floats (bit order) and integral floats (integer codes) alike."""
    ks = pa.schema([("f", pa.float64())])
    schema = updates_schema(ks, pa.schema([]))
    nan = float("nan")
    rows = [(nan, 0, 1), (None, 0, 1), (high, 0, 1), (nan, 0, 1), (-0.0, 0, 1), (0.0, 0, 1)]
    rows += [(low, 0, 1), (top, 0, 1), (None, 0, 1)]
    for path in SORT_PATHS:
        with sort_path(path):
            out = consolidate(_table(rows, schema), ["f"], [])
        f = out.column("f").to_pylist()
        assert f[:4] == [low, 0.0, high, top] and math.isnan(f[4]) and f[5] is None
        assert out.column("_diff").to_pylist() == [1, 2, 1, 1, 2, 2], path


def test_consolidate_sorted_input_is_returned_as_is() -> None:
    t = _table([(1, "a", 0.5, 0, 1), (1, "b", None, 0, 2), (2, None, 0.0, 1, -1)])
    assert consolidate(t, ["k", "name"], ["v"]) is t
    assert consolidate(t, ["k", "name"], ["v"], since=0) is t


def test_consolidate_detects_unsorted_and_duplicates_cheaply_checked() -> None:
    t = _table([(2, "a", 0.5, 0, 1), (1, "b", None, 0, 2), (2, "a", 0.5, 0, -1)])
    out = consolidate(t, ["k", "name"], ["v"])
    assert out.to_pylist() == [{"k": 1, "name": "b", "v": None, "_time": 0, "_diff": 2}]


@pytest.mark.parametrize("descending_pair", [False, True])
def test_consolidate_few_ties_compare_sparsely(descending_pair: bool) -> None:
    """Sorted on (k, name) except two pairs that tie on both; only the value column
    decides them (the comparison of undecided pairs only, after the first columns)."""
    rows: list[tuple[Any, ...]] = [(0, f"n{i:03}", float(i), 0, 1) for i in range(200)]
    rows[11] = (0, "n010", 10.0, 0, 4)  # duplicate of row 10: consolidates
    second = (5.0, 4.0) if descending_pair else (4.0, 5.0)
    rows[50] = (0, "n050", second[0], 0, 1)
    rows[51] = (0, "n050", second[1], 0, 1)
    t = _table(rows)
    expected = _reference(rows, None)
    for path in SORT_PATHS:
        with sort_path(path):
            out = consolidate(t, ["k", "name"], ["v"])
        assert _rows_of(out) == expected, path
    in_order, same = consolidation._adjacent(t, ["k", "name", "v", "_time"], check_order=True)
    assert in_order is not descending_pair
    if not descending_pair:
        assert same is not None and list(np.flatnonzero(same)) == [10]


def test_consolidate_overflow_is_an_error() -> None:
    t = _table([(1, "a", 0.5, 0, 2**62), (1, "a", 0.5, 0, 2**62)])
    with pytest.raises(InvalidUsage, match="beyond the int64 range"):
        consolidate(t, ["k", "name"], ["v"])
    big = _table([(1, "a", 0.5, 0, 2**62), (1, "a", 0.5, 0, -(2**62)), (1, "a", 0.5, 0, 5)])
    assert consolidate(big, ["k", "name"], ["v"]).column("_diff").to_pylist() == [5]


def test_consolidate_rejects_bad_tables() -> None:
    t = _table([(1, "a", 0.5, 0, 1)])
    with pytest.raises(InvalidUsage, match="no column 'nope'"):
        consolidate(t, ["nope"], [])
    bad = t.set_column(4, "_diff", pa.array([1], pa.int32()))
    with pytest.raises(InvalidUsage, match="'_diff' must be non-null int64"):
        consolidate(bad, ["k"], [])
    nested = t.append_column("l", pa.array([[1]]))
    with pytest.raises(InvalidUsage, match="'l' has unsupported type list"):
        consolidate(nested, ["k"], ["l"])


def test_consolidate_large_random_both_paths_agree() -> None:
    rng = np.random.default_rng(3)
    n = 60_000
    t = pa.table(
        {
            "k": pa.array(rng.integers(0, 500, n)),
            "name": pa.array(rng.choice(["x", "yy", "", "zzz"], n)).cast(pa.large_string()),
            "v": pa.array(
                np.where(rng.random(n) < 0.1, np.nan, rng.integers(0, 3, n).astype(float)),
                from_pandas=True,
            ),
            "_time": pa.array(rng.integers(0, 5, n)),
            "_diff": pa.array(rng.integers(-1, 2, n)),
        }
    )
    outs = []
    for path in SORT_PATHS:
        with sort_path(path):
            outs.append(consolidate(t, ["k", "name"], ["v"], since=2))
    assert outs[0].equals(outs[1])
    # Same multiset as the reference (Python dict over all rows).
    expected = _reference(_rows_of(t), 2)
    assert _rows_of(outs[0]) == expected


@pytest.mark.parametrize("name", NARROW_DECIMALS)
def test_narrow_decimals_sort_by_value_on_every_path(name: str) -> None:
    """``decimal32``/``decimal64`` keys (pyarrow >= 18): every sort path orders them by
    value, as decimal128 (Arrow's multi-column sort ordered them by their bytes, the
    codes path failed with ``ArrowNotImplementedError``: no dictionary kernel for them),
    and so does :func:`persist.merge.key_ranks` on a key of one such column (it failed:
    no sort kernel)."""
    from persist import merge as merge_module
    from persist.merge import key_ranks

    rng = np.random.default_rng(4)
    n = 3_000
    t = pa.table(
        {
            "k": pa.array(
                [
                    None if x < -380 else decimal.Decimal(int(x)) / 4
                    for x in rng.integers(-400, 400, n)
                ],
                getattr(pa, name)(9, 2),
            ),
            "j": pa.array(rng.integers(0, 3, n)),
            "_time": pa.array(rng.integers(0, 3, n)),
            "_diff": pa.array(rng.integers(-1, 2, n)),
        }
    )
    outs = []
    for path in SORT_PATHS:
        with sort_path(path):
            outs.append(consolidate(t, ["k", "j"], [], since=1))
    assert outs[0].num_rows > 0
    assert outs[1].equals(outs[0]) and outs[2].equals(outs[0])
    ks, js = outs[0].column("k").to_pylist(), outs[0].column("j").to_pylist()
    keys = [(k is None, k, j) for k, j in zip(ks, js, strict=True)]
    assert keys == sorted(keys)
    for path in SORT_PATHS:
        # key_ranks reads its own copy of the codes threshold.
        with sort_path(path), pytest.MonkeyPatch.context() as mp:
            mp.setattr(merge_module, "_CODES_MIN_ROWS", consolidation._CODES_MIN_ROWS)
            ranks = key_ranks(t, ["k"])
        want = {
            v: i
            for i, v in enumerate(sorted({v for v in t.column("k").to_pylist() if v is not None}))
        }
        got = t.column("k").to_pylist()
        assert all(r == want[v] for r, v in zip(ranks, got, strict=True) if v is not None), path


def test_sort_kind_is_timsort_unless_the_word_looks_random() -> None:
    """Timsort (numpy's "stable") for words sorted except within small neighbourhoods,
    as TPC-H lineitem's packed (order key, part key) word: most neighbour pairs
    descend there, but none at a stride; quicksort only for words disordered at both
    grains. (The old rule, by neighbour descents alone, chose quicksort for the first,
    which took 7x as long.)"""
    rng = np.random.default_rng(5)
    n = 200_000
    local = (np.arange(n, dtype=np.uint64) // 4) * np.uint64(1000) + rng.integers(
        0, 1000, n
    ).astype(np.uint64)
    assert np.count_nonzero(local[1:] < local[:-1]) * 4 >= n  # many neighbour descents
    assert consolidation._sort_kind(local) == "stable"
    assert consolidation._sort_kind(np.sort(local)) == "stable"
    assert consolidation._sort_kind(rng.integers(0, 2**60, n, dtype=np.uint64)) == "quicksort"


@pytest.mark.parametrize("kind", ["stable", "quicksort"])
def test_consolidate_is_the_same_whichever_sort_kind(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sort kind changes the order of rows tied on the packed word only, which the
    tie resolution sorts by the remaining columns: the result is the reference's."""
    rng = np.random.default_rng(8)
    n = 30_000
    t = pa.table(
        {
            "k": pa.array(np.arange(n) // 3 + rng.integers(0, 2, n)),
            "name": pa.array(rng.choice(["x", "yy", ""], n)).cast(pa.large_string()),
            "v": pa.array(rng.integers(0, 3, n).astype(float)),
            "_time": pa.array(rng.integers(0, 3, n)),
            "_diff": pa.array(rng.integers(-1, 2, n)),
        }
    )
    monkeypatch.setattr(consolidation, "_sort_kind", lambda word: kind)
    with sort_path("codes-narrow"):
        narrow = consolidate(t, ["k", "name"], ["v"])
    with sort_path("codes"):
        wide = consolidate(t, ["k", "name"], ["v"])
    assert narrow.equals(wide)
    assert _rows_of(wide) == _reference(_rows_of(t), None)


# ------------------------------------------------------------------ parts


def _sample(n: int = 100) -> pa.Table:
    return pa.table(
        {
            "k": pa.array(range(n), pa.int64()),
            "name": pa.array([f"n{i % 7}" for i in range(n)], pa.large_string()),
            "ts": pa.array(
                [dt.datetime(2024, 1, 1, tzinfo=dt.UTC)] * n, pa.timestamp("ms", tz="UTC")
            ),
            "d": pa.array([decimal.Decimal("1.25")] * n, pa.decimal128(5, 2)),
            "_time": pa.array([i % 3 for i in range(n)], pa.int64()),
            "_diff": pa.array([1] * n, pa.int64()),
        }
    )


def test_encode_decode_round_trip() -> None:
    t = _sample()
    data = encode_part(t)
    ref = make_part_ref("s1/p.parquet", data, t.num_rows)
    assert ref.encoded_size_bytes == len(data) and ref.rows == 100 and len(ref.checksum) == 64
    back = decode_part(data, ref)
    assert back.equals(t) and back.schema == t.schema
    assert decode_part(data, ref, columns=["name", "_diff"]).column_names == ["name", "_diff"]


@pytest.mark.parametrize("inline", [False, True])
def test_corrupt_parts_name_their_key(inline: bool) -> None:
    data = encode_part(_sample())
    ref = make_part_ref(None if inline else "shard-1/part-9.parquet", data, 100, inline=inline)
    name = "<inline>" if inline else "shard-1/part-9.parquet"
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    for bad, why in [
        (bytes(flipped), "SHA-256"),
        (data[:-10], "size"),
        (data + b"x", "size"),
        (b"", "size"),
    ]:
        with pytest.raises(CorruptPart, match=why) as info:
            decode_part(bad, ref)
        assert info.value.key == name and name in str(info.value)


def test_garbage_with_matching_checksum_is_corrupt() -> None:
    garbage = b"PAR1 definitely not parquet PAR1"
    ref = make_part_ref("k/x.parquet", garbage, 3)
    with pytest.raises(CorruptPart, match=r"k/x\.parquet.*not readable as Parquet"):
        decode_part(garbage, ref)
    data = encode_part(_sample(10))
    with pytest.raises(CorruptPart, match="has 10 rows, the reference says 11"):
        decode_part(data, make_part_ref("k/y.parquet", data, 11))
    with pytest.raises(CorruptPart, match=r"has no column\(s\) \['missing'\]"):
        decode_part(data, make_part_ref("k/y.parquet", data, 10), columns=["k", "missing"])


def test_inline_parts_are_compressed_arrow_ipc_and_older_forms_still_read() -> None:
    """Inline parts are zstd-compressed Arrow IPC streams (cheap for a few rows, and
    small in the shard state); the format is told by the magic bytes, so an inline part
    written as a plain IPC stream or as Parquet still decodes. A blob part is only ever
    read as Parquet."""
    t = _sample(5)
    inline = encode_inline_part(t)
    assert inline[:4] == INLINE_ZSTD_MAGIC
    stream = _plain_stream(t)
    assert int.from_bytes(inline[4:8], "little") == len(stream)
    assert len(inline) < len(stream)  # the schema message compresses too
    ref = make_part_ref(None, inline, 5, inline=True)
    back = decode_part(inline, ref)
    assert back.equals(t) and back.schema == t.schema  # types (tz, decimal) round-trip
    assert decode_part(inline, ref, columns=["_diff", "k"]).column_names == ["_diff", "k"]
    with pytest.raises(CorruptPart, match=r"<inline>.*has no column\(s\) \['missing'\]"):
        decode_part(inline, ref, columns=["k", "missing"])
    with pytest.raises(CorruptPart, match="has 5 rows, the reference says 6"):
        decode_part(inline, make_part_ref(None, inline, 6, inline=True))
    with pytest.raises(CorruptPart, match="not readable as Parquet"):
        decode_part(inline, make_part_ref("k/ipc.parquet", inline, 5))
    # Older inline forms: a plain IPC stream and a Parquet file.
    assert decode_part(stream, make_part_ref(None, stream, 5, inline=True)).equals(t)
    pq_bytes = encode_part(t)
    assert decode_part(pq_bytes, make_part_ref(None, pq_bytes, 5, inline=True)).equals(t)


def _plain_stream(t: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    return bytes(sink.getvalue())


@pytest.mark.parametrize(
    "damage",
    ["torn frame", "torn stream", "length too long", "length too short", "huge length", "header"],
)
def test_a_damaged_compressed_inline_part_is_corrupt_not_misread(damage: str) -> None:
    """Bytes whose checksum matches their ref (so damaged before the ref was made) but
    whose zstd frame or announced stream length is wrong are reported as a corrupt
    inline part, never decoded into other rows nor allowed to allocate a huge buffer."""
    t = _sample(5)
    good = encode_inline_part(t)
    n = int.from_bytes(good[4:8], "little")
    head = good[:4]
    bad = {
        "torn frame": good[: len(good) - 5],
        "torn stream": head
        + (n // 2).to_bytes(4, "little")
        + pa.Codec("zstd").compress(_plain_stream(t)[: n // 2], asbytes=True),
        "length too long": head + (n + 8).to_bytes(4, "little") + good[8:],
        "length too short": head + (n - 8).to_bytes(4, "little") + good[8:],
        "huge length": head + (2**32 - 1).to_bytes(4, "little") + good[8:],
        "header": head + b"\x01",
    }[damage]
    with pytest.raises(CorruptPart, match="<inline>.*not readable as Arrow IPC"):
        decode_part(bad, make_part_ref(None, bad, 5, inline=True))


def test_a_well_compressed_inline_part_is_cached(tmp_path: Path) -> None:
    """A part compressed more than four times over is cached all the same (written
    inline, the cache keeps its Arrow IPC stream, whatever its zstd frame's size)."""
    t = _sample(256)
    refs = write_parts(FileBlob(tmp_path / "b"), t, "s1/batch-1", inline_max_bytes=64 * 1024)
    assert len(refs) == 1 and refs[0].inline is not None
    size = t.get_total_buffer_size() + len(refs[0].inline)
    assert size > 4 * len(refs[0].inline) + 4096  # compressed well
    cached = INLINE_CACHE.get(refs[0])
    assert cached is not None and cached.equals(t)


def test_a_slice_of_a_larger_table_is_cached_as_its_own_rows(tmp_path: Path) -> None:
    """A one-row slice of a big table (a batch cut row by row) kept inline is cached as
    the rows its inline bytes decode to, read back from the stream just encoded: the
    cached table holds no more than the stream's bytes (the parent's buffers are not
    pinned) and equals the decoded part, so a compaction reading it decodes nothing."""
    big = _sample(5000)
    row = big.slice(1234, 1)
    assert row.get_total_buffer_size() > 100 * 1024  # shares the parent's buffers
    refs = write_parts(FileBlob(tmp_path / "b"), row, "s1/batch-1", inline_max_bytes=64 * 1024)
    assert len(refs) == 1 and refs[0].inline is not None
    cached = INLINE_CACHE.get(refs[0])
    assert cached is not None and cached.equals(row)
    assert cached.get_total_buffer_size() < 8 * 1024
    decoded = decoding.decode_part(refs[0].inline, refs[0])
    assert cached.equals(decoded)


def test_make_part_ref_rules() -> None:
    with pytest.raises(InvalidUsage, match="needs a blob key"):
        make_part_ref(None, b"x", 1)
    with pytest.raises(InvalidKey):
        make_part_ref("../x", b"x", 1)
    ref = make_part_ref("ignored", b"abc", 1, inline=True)
    assert ref.key is None and ref.inline == b"abc"


@pytest.mark.parametrize("target", [1, 500, 4096, 10**9])
def test_split_for_parts(target: int) -> None:
    t = _sample(1000)
    pieces = split_for_parts(t, target)
    assert pa.concat_tables(pieces).equals(t)
    assert len(pieces) >= min(1000, math.ceil(t.nbytes / target))
    per_row = t.nbytes / t.num_rows
    assert all(p.num_rows == 1 or p.num_rows * per_row <= target for p in pieces)
    sizes = [p.num_rows for p in pieces]
    assert max(sizes) - min(sizes) <= 1  # balanced slices
    assert split_for_parts(t.slice(0, 0), target) == []
    assert len(split_for_parts(t, 10**9, min_parts=4)) == 4
    # Several parts come in a multiple of the encoding threads; one part stays one.
    for workers in (2, 3):
        count = len(split_for_parts(t, target, multiple_of=workers))
        assert count == 1 or count % workers == 0 or count == t.num_rows
    assert len(split_for_parts(t, 10**9, multiple_of=2)) == 1
    with pytest.raises(InvalidUsage):
        split_for_parts(t, 0)
    with pytest.raises(InvalidUsage):
        split_for_parts(t, target, multiple_of=0)


# ------------------------------------------------------- write/read parts


def test_small_batch_is_inline(tmp_path: Path) -> None:
    blob = FileBlob(tmp_path / "b")
    t = _sample(3)
    refs = write_parts(blob, t, "s1/batch-1", inline_max_bytes=64 * 1024)
    assert len(refs) == 1 and refs[0].inline is not None and refs[0].key is None
    assert refs[0].inline[:4] == INLINE_ZSTD_MAGIC  # compressed Arrow IPC
    assert blob.metrics.sets == 0 and blob.list_keys() == []
    assert read_parts(blob, refs).equals(t)
    INLINE_CACHE.clear()
    assert read_parts(blob, refs).equals(t)  # decoded, not cached


def test_empty_batch_has_no_parts(tmp_path: Path) -> None:
    blob = FileBlob(tmp_path / "b")
    assert write_parts(blob, _sample(0), "s1/b") == []
    with pytest.raises(InvalidUsage, match="needs a schema"):
        read_parts(blob, [])
    empty = read_parts(blob, [], schema=_sample(0).schema, columns=["k"])
    assert empty.num_rows == 0 and empty.column_names == ["k"]


@pytest.mark.parametrize("workers", [1, 3])
def test_write_read_many_parts_in_order(tmp_path: Path, workers: int) -> None:
    blob = FileBlob(tmp_path / "b")
    t = _sample(5000)
    refs = write_parts(
        blob, t, "s1/batch-2", target_part_bytes=20_000, inline_max_bytes=0, max_workers=workers
    )
    assert len(refs) == math.ceil(t.nbytes / 20_000)
    assert sum(r.rows for r in refs) == 5000
    keys = [k for k, _ in blob.list_keys("s1/batch-2/")]
    assert sorted(r.key for r in refs if r.key) == keys
    assert all(k.endswith(".parquet") for k in keys)
    assert blob.metrics.sets == len(refs)
    back = read_parts(blob, refs, max_workers=workers, schema=t.schema)
    assert back.equals(t)
    proj = read_parts(blob, refs, columns=["k"], max_workers=workers)
    assert proj.column("k").to_pylist() == list(range(5000))
    # Key-and-size metadata matches the store.
    sizes = dict(blob.list_keys())
    assert all(sizes[r.key] == r.encoded_size_bytes for r in refs if r.key)


def test_big_tables_are_split_for_parallel_encoding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(parts, "MIN_PARALLEL_PART_BYTES", 10_000)
    blob = MemoryBlob()
    t = _sample(5000)
    refs = write_parts(blob, t, "s/b", inline_max_bytes=0, max_workers=2)
    assert len(refs) == 2
    assert read_parts(blob, refs).equals(t)
    assert len(write_parts(blob, t, "s/c", inline_max_bytes=0, max_workers=1)) == 1


def test_corrupt_or_missing_part_on_disk_names_key(tmp_path: Path) -> None:
    blob = FileBlob(tmp_path / "b")
    t = _sample(5000)
    refs = write_parts(blob, t, "shard-x/batch", target_part_bytes=20_000, inline_max_bytes=0)
    bad = refs[1]
    assert bad.key is not None
    path = tmp_path / "b" / bad.key
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptPart) as info:
        read_parts(blob, refs)
    assert info.value.key == bad.key and bad.key in str(info.value)
    # Other parts keep working.
    assert read_parts(blob, [refs[0]]).num_rows == refs[0].rows
    blob.delete(bad.key)
    with pytest.raises(CorruptPart, match="missing from the blob store") as info:
        read_parts(blob, refs)
    assert info.value.key == bad.key


def test_read_parts_schema_mismatch_is_corrupt(tmp_path: Path) -> None:
    blob = MemoryBlob()
    refs = write_parts(blob, _sample(10), "s/b", inline_max_bytes=0)
    other = pa.schema([("k", pa.string())])
    with pytest.raises(CorruptPart, match="does not match"):
        read_parts(
            blob, refs, columns=["k"], schema=pa.schema([*other, ("name", pa.large_string())])
        )


class _FailSecondSet:
    """A blob whose second set fails after writing (to test cleanup of a failed batch)."""

    def __init__(self) -> None:
        self.inner = MemoryBlob()
        self.calls = 0

    @property
    def metrics(self) -> BlobMetrics:
        return self.inner.metrics

    def get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def set(self, key: str, value: bytes) -> None:
        self.calls += 1
        self.inner.set(key, value)
        if self.calls == 2:
            raise BlobError(f"injected failure after writing {key!r}")

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def list_keys(self, prefix: str = "") -> list[tuple[str, int]]:
        return self.inner.list_keys(prefix)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_failed_write_cleans_up_its_parts(workers: int) -> None:
    blob = _FailSecondSet()
    with pytest.raises(BlobError, match="injected failure"):
        write_parts(
            blob,
            _sample(5000),
            "s/b",
            target_part_bytes=20_000,
            inline_max_bytes=0,
            max_workers=workers,
        )
    assert blob.list_keys() == []


class _SlowBlob(MemoryBlob):
    """A memory blob whose ``set`` takes ``delay`` seconds (an fsync, a network upload),
    counting the uploads in flight; ``fail_first`` makes the first ``set`` fail."""

    def __init__(self, delay: float, fail_first: bool = False) -> None:
        super().__init__()
        self.delay = delay
        self.fail_first = fail_first
        self.lock = threading.Lock()
        self.in_flight = 0
        self.peak = 0
        self.sets = 0

    def set(self, key: str, value: bytes) -> None:
        with self.lock:
            self.sets += 1
            first = self.sets == 1
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            time.sleep(self.delay)
            if first and self.fail_first:
                raise BlobError("injected failure of the first upload")
            super().set(key, value)
        finally:
            with self.lock:
                self.in_flight -= 1


@pytest.mark.parametrize("workers", [1, 2])
def test_uploads_overlap_encoding_and_end_before_return(workers: int) -> None:
    """Parts upload in the upload pool while later parts encode, at most 2 * workers
    waiting at once; write_parts returns only after every upload ended."""
    blob = _SlowBlob(delay=0.02)
    t = _sample(5000)
    refs = write_parts(
        blob, t, "s/b", target_part_bytes=10_000, inline_max_bytes=0, max_workers=workers
    )
    assert len(refs) > 8
    assert blob.in_flight == 0
    assert 1 < blob.peak <= 2 * workers
    assert read_parts(blob, refs).equals(t)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_part_uploads_while_its_checksum_is_computed(
    workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part's upload is handed to the upload pool as soon as it is encoded, before its
    checksum is computed (which overlaps the write and fsync of its bytes); its ref
    still describes exactly the bytes uploaded, with the statistics of its rows."""
    submitted: list[str] = []
    described: list[int] = []
    real_submit, real_ref = parts.submit_io, parts.make_part_ref
    lock = threading.Lock()

    def submit(fn: Any, key: str, data: bytes) -> Any:
        with lock:
            submitted.append(key)
        return real_submit(fn, key, data)

    def ref(*args: Any, **kwargs: Any) -> Any:
        with lock:
            described.append(len(submitted))
        return real_ref(*args, **kwargs)

    monkeypatch.setattr(parts, "submit_io", submit)
    monkeypatch.setattr(parts, "make_part_ref", ref)
    blob = MemoryBlob()
    t = _sample(5000)
    refs = write_parts(
        blob, t, "s/b", target_part_bytes=10_000, inline_max_bytes=0, max_workers=workers
    )
    assert len(described) == len(refs) > 2
    # The k-th part described (in any thread) had at least k uploads submitted before.
    assert all(n >= k + 1 for k, n in enumerate(described))
    rows = 0
    for r in refs:
        assert r.key is not None
        data = blob.get(r.key)
        assert data is not None
        assert r == real_ref(r.key, data, r.rows, stats=table_stats(t.slice(rows, r.rows)))
        rows += r.rows
    assert read_parts(blob, refs).equals(t)


@pytest.mark.parametrize("workers", [1, 2])
def test_the_parts_of_a_run_are_described_while_they_encode(
    workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With several parts, a part's statistics are computed in the shared pool while the
    part encodes (a core the encoding threads leave idle takes them), not after its
    encoding in the thread that encodes it."""
    started: list[int] = []
    during: list[bool] = []
    encoded = [0]
    real_encode, real_stats = parts.encode_part, parts.table_stats
    lock = threading.Lock()
    cond = threading.Condition(lock)

    def stats(table: pa.Table) -> Any:
        with cond:
            started.append(table.num_rows)
            cond.notify_all()
        return real_stats(table)

    def encode(table: pa.Table, plan: Any = None) -> bytes:
        with cond:
            encoded[0] += 1
            want = encoded[0] if workers == 1 else 1
            # This part's statistics start while it encodes.
            during.append(cond.wait_for(lambda: len(started) >= want, timeout=30))
        return real_encode(table, plan)

    monkeypatch.setattr(parts, "encode_part", encode)
    monkeypatch.setattr(parts, "table_stats", stats)
    blob = MemoryBlob()
    t = _sample(5000)
    refs = write_parts(
        blob, t, "s/b", target_part_bytes=20_000, inline_max_bytes=0, max_workers=workers
    )
    assert len(refs) > 2 and during and all(during)
    assert read_parts(blob, refs).equals(t)


def test_no_part_is_encoded_after_an_upload_failed() -> None:
    blob = _SlowBlob(delay=0.01, fail_first=True)
    with pytest.raises(BlobError, match="first upload"):
        write_parts(blob, _sample(20_000), "s/b", target_part_bytes=5_000, inline_max_bytes=0)
    assert blob.in_flight == 0
    assert blob.list_keys() == []
    parts_count = len(split_for_parts(_sample(20_000), 5_000))
    assert parts_count > 50 and blob.sets < parts_count // 2


class _RecordingBlob(MemoryBlob):
    """A memory blob recording, in one list shared with ``before_upload``, the order of
    registrations and uploads."""

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def set(self, key: str, value: bytes) -> None:
        self.events.append("set")
        super().set(key, value)


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_before_upload_runs_once_before_every_upload(workers: int) -> None:
    """The owner's registration runs in the shared pool or an encoding thread,
    overlapping the encoding of parts, but exactly once and before the first upload;
    never for an inline table."""
    events: list[str] = []
    lock = threading.Lock()

    def register() -> None:
        with lock:
            events.append("register")
        time.sleep(0.02)  # a consensus commit: the other threads encode meanwhile
        with lock:
            events.append("registered")

    blob = _RecordingBlob(events)
    t = _sample(5000)
    refs = write_parts(
        blob,
        t,
        "s/b",
        target_part_bytes=10_000,
        inline_max_bytes=0,
        max_workers=workers,
        before_upload=register,
    )
    assert len(refs) > 4
    assert events[:2] == ["register", "registered"]
    assert events.count("register") == 1 and events.count("set") == len(refs)
    assert read_parts(blob, refs).equals(t)
    inline: list[str] = []
    small = write_parts(
        _RecordingBlob(inline), _sample(3), "s/b", before_upload=lambda: inline.append("x")
    )
    assert small[0].inline and inline == []


def test_before_upload_overlaps_the_encoding_of_other_parts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the registration runs, another thread encodes the next part (the
    registration is a consensus commit: no reason to keep the other core idle)."""
    encoded = threading.Event()
    count = [0]
    lock = threading.Lock()
    real = parts.encode_part

    def counting(table: pa.Table, plan: Any = None) -> bytes:
        with lock:
            count[0] += 1
            if count[0] >= 2:
                encoded.set()
        return real(table, plan)

    monkeypatch.setattr(parts, "encode_part", counting)
    seen: list[bool] = []

    def register() -> None:
        seen.append(encoded.wait(timeout=10))  # a second part encodes meanwhile

    blob = MemoryBlob()
    t = _sample(5000)
    refs = write_parts(
        blob,
        t,
        "s/b",
        target_part_bytes=10_000,
        inline_max_bytes=0,
        max_workers=2,
        before_upload=register,
    )
    assert seen == [True]
    assert read_parts(blob, refs).equals(t)


@pytest.mark.parametrize("workers", [1, 2])
def test_before_upload_starts_before_the_first_part_is_encoded(
    workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registration (a durable commit: an fsync or a round trip) starts as soon as
    the table is known to go to blob parts, overlapping the encoding of the first part,
    however many encoding threads there are (before, it waited for a part's encoding,
    and with one worker nothing overlapped it)."""
    started = threading.Event()
    waited: list[bool] = []
    real = parts.encode_part

    def encoding(table: pa.Table, plan: Any = None) -> bytes:
        waited.append(started.wait(timeout=5))  # the registration runs meanwhile
        return real(table, plan)

    monkeypatch.setattr(parts, "encode_part", encoding)
    blob = MemoryBlob()
    t = _sample(5000)
    refs = write_parts(
        blob,
        t,
        "s/b",
        target_part_bytes=10_000,
        inline_max_bytes=0,
        max_workers=workers,
        before_upload=started.set,
    )
    assert waited and all(waited)
    assert read_parts(blob, refs).equals(t)


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_a_failing_before_upload_is_raised_as_is_with_nothing_uploaded(workers: int) -> None:
    calls: list[int] = []

    class Refused(Exception):
        pass

    def register() -> None:
        calls.append(1)
        raise Refused("the lease ran out")

    events: list[str] = []
    blob = _RecordingBlob(events)
    with pytest.raises(Refused, match="lease ran out"):
        write_parts(
            blob,
            _sample(5000),
            "s/b",
            target_part_bytes=10_000,
            inline_max_bytes=0,
            max_workers=workers,
            before_upload=register,
        )
    assert calls == [1]
    assert events == [] and blob.list_keys() == []


def test_write_parts_rejects_bad_prefix_and_sizes() -> None:
    with pytest.raises(InvalidKey):
        write_parts(MemoryBlob(), _sample(3), "../escape")
    with pytest.raises(InvalidUsage):
        write_parts(MemoryBlob(), _sample(3), "ok", max_workers=0)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.integers(0, 2**32))
def test_write_read_under_random_blob_faults(tmp_path: Path, seed: int) -> None:
    """Every write either returns refs whose parts all read back exactly, or raises
    BlobError; faults never produce a wrong read."""
    inner: Blob = FileBlob(tmp_path / f"faults-{seed}", fsync=False)
    u = UnreliableBlob(inner, fail_probability=0.2, seed=seed)
    t = _sample(1500)
    for attempt in range(4):
        try:
            refs = write_parts(u, t, f"s/b{attempt}", target_part_bytes=15_000, inline_max_bytes=0)
        except BlobError:
            continue
        for _ in range(5):
            try:
                assert read_parts(u, refs).equals(t)
                break
            except BlobError:
                continue
    u.faults(False)
    for key, _ in u.list_keys():
        assert not key.rsplit("/", 1)[-1].startswith(".")


def test_part_encoding_settings() -> None:
    """Blob parts: dictionaries only on columns with few distinct values, and only for
    parts of more than a few rows, but not on integer-like columns of more than a
    handful of values spanning about as few bits as a dictionary index; the other
    integer-like columns DELTA_BINARY_PACKED and uncompressed; everything else LZ4
    (LZ4_RAW); decimals of precision <= 18 as integers (as delta-rs and pyiceberg write
    them)."""
    n = 20_000
    t = pa.table(
        {
            "unique": pa.array(range(n), pa.int64()),
            "few": pa.array([f"s{i % 7}" for i in range(n)], pa.string()),
            # 500 values spanning 2**40: dictionary indices (9 bits) are far narrower.
            "sparse": pa.array([(i % 500) << 40 for i in range(n)], pa.int64()),
            "dec": pa.array(
                [decimal.Decimal(i % 500) / 100 for i in range(n)], pa.decimal128(15, 2)
            ),
            "text": pa.array([f"row {i}" for i in range(n)], pa.string()),
            "price": pa.array([decimal.Decimal(i) / 100 for i in range(n)], pa.decimal128(15, 2)),
            "wide": pa.array([decimal.Decimal(i) / 100 for i in range(n)], pa.decimal128(30, 2)),
            "_time": pa.array([0] * n, pa.int64()),
            "_diff": pa.array([1] * n, pa.int64()),
        }
    )
    assert encoding._dictionary_columns(t) == ["few", "sparse", "_time", "_diff"]
    assert encoding._dictionary_columns(t.slice(0, 10)) == []
    data = encode_part(t)
    meta = pq.ParquetFile(pa.BufferReader(data)).metadata
    assert meta.schema.column(3).physical_type == "INT64"
    assert meta.schema.column(6).physical_type == "FIXED_LEN_BYTE_ARRAY"
    col = {meta.schema.column(i).name: meta.row_group(0).column(i) for i in range(9)}
    delta = {"unique", "dec", "price"}
    for name, c in col.items():
        assert ("DELTA_BINARY_PACKED" in c.encodings) == (name in delta), name
        assert ("RLE_DICTIONARY" in c.encodings) == (name in {"few", "sparse", "_time", "_diff"}), (
            name
        )
        assert c.compression == ("UNCOMPRESSED" if name in delta else "LZ4"), name
    assert decode_part(data, make_part_ref("k/p.parquet", data, n)).equals(t)
    # Few rows: no dictionaries, so every integer-like column is delta-encoded.
    small = t.slice(0, 10)
    data = encode_part(small)
    meta = pq.ParquetFile(pa.BufferReader(data)).metadata
    assert "DELTA_BINARY_PACKED" in meta.row_group(0).column(7).encodings
    assert "RLE_DICTIONARY" not in meta.row_group(0).column(1).encodings
    assert decode_part(data, make_part_ref("k/p.parquet", data, 10)).equals(small)


@pytest.mark.parametrize(
    ("type_", "step"),
    [
        (pa.int32(), 1),
        (pa.uint64(), 1),
        (pa.date32(), 1),
        (pa.timestamp("us", tz="UTC"), 1),
        (pa.time64("ns"), 1),
        (pa.duration("ms"), 1),
        (pa.decimal128(18, 3), decimal.Decimal("0.001")),
        # pyarrow >= 18: no min_max kernel for these (their range is read as decimal128)
        *[(getattr(pa, d)(9, 3), decimal.Decimal("0.001")) for d in NARROW_DECIMALS],
    ],
    ids=str,
)
def test_integer_like_columns_of_a_dense_range_are_delta_encoded(
    type_: pa.DataType, step: Any, tmp_path: Path
) -> None:
    """Few distinct integer-like values in a dense range (hours, minutes, codes) are
    delta-encoded rather than dictionary-encoded, whatever the integer storage (plain
    integers, temporal types, decimals); the same values spread over a wide range keep
    their dictionary, and so does a handful of values (months); all read back exactly,
    also by DuckDB (for the types it holds exactly)."""
    n = 5_000
    names = ("dense", "sparse", "handful")
    dense = [(i * 7919) % 60 for i in range(n)]  # 60 values, scattered: 6 bits either way
    sparse = [v << 24 for v in dense]  # the same 60 values over 2**30: dictionary
    handful = [v % encoding._DICTIONARY_ALWAYS for v in dense]
    if pa.types.is_decimal(type_):
        cols = [pa.array([v * step for v in xs], type_) for xs in (dense, sparse, handful)]
    elif pa.types.is_integer(type_):
        cols = [pa.array(xs, type_) for xs in (dense, sparse, handful)]
    else:
        storage = pa.int32() if type_.bit_width == 32 else pa.int64()
        cols = [pa.array(xs, storage).view(type_) for xs in (dense, sparse, handful)]
    t = pa.table(dict(zip(names, cols, strict=True)))
    plan = encoding.encoding_plan(t)
    assert plan.dictionary == ["sparse", "handful"]
    assert plan.encoding == {"dense": "DELTA_BINARY_PACKED"}
    data = encode_part(t, plan)
    assert decode_part(data, make_part_ref("k/p.parquet", data, n)).equals(t)
    if pa.types.is_time(type_) or pa.types.is_duration(type_):
        return  # DuckDB's TIME and INTERVAL do not hold these exactly
    path = tmp_path / "p.parquet"
    path.write_bytes(data)
    got = duckdb.sql("select * from read_parquet($p)", params={"p": str(path)}).to_arrow_table()
    for name in names:
        assert got.column(name).cast(type_).equals(t.column(name)), name


def test_one_encoding_plan_for_every_part_of_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parts of one run are encoded with one plan, made once from a sample of all its
    rows (in the order given when the writer gathers them itself), and they read back as
    the run, the same rows as a one-part write of it."""
    monkeypatch.setattr(parts, "MIN_PARALLEL_PART_BYTES", 10_000)
    made: list[int] = []
    real = encoding.encoding_plan

    def spy(table: pa.Table) -> encoding.EncodingPlan:
        made.append(table.num_rows)
        return real(table)

    monkeypatch.setattr(parts, "encoding_plan", spy)
    t = _sample(5000)
    reverse = np.arange(t.num_rows - 1, -1, -1, dtype=np.int64)
    blob = MemoryBlob()
    for order in (None, reverse):
        made.clear()
        refs = write_parts(blob, t, "s/b", inline_max_bytes=0, max_workers=2, order=order)
        assert len(refs) == 2 and made == [5000]
        want = t if order is None else t.take(pa.array(order))
        assert read_parts(blob, refs).equals(want)
        one = write_parts(blob, want, "s/c", inline_max_bytes=0, max_workers=1)
        assert len(one) == 1 and read_parts(blob, one).equals(read_parts(blob, refs))


def _times(unit_us: int) -> st.SearchStrategy[dt.time]:
    return st.times().map(lambda t: t.replace(microsecond=t.microsecond // unit_us * unit_us))


#: Every column type a shard accepts (``updates_schema``), with values spanning its range
#: (extremes included, so delta encoding wraps around).
_all_types: list[tuple[pa.DataType, st.SearchStrategy[Any]]] = [
    *_wide_types,
    (pa.int16(), st.integers(-(2**15), 2**15 - 1)),
    (pa.int32(), st.integers(-(2**31), 2**31 - 1)),
    (pa.int64(), st.integers(-(2**63), 2**63 - 1)),
    (pa.uint8(), st.integers(0, 255)),
    (pa.uint16(), st.integers(0, 2**16 - 1)),
    (pa.uint32(), st.integers(0, 2**32 - 1)),
    (pa.string(), _names),
    (pa.large_binary(), st.binary(max_size=3)),
    (pa.date64(), st.dates()),
    (pa.time32("s"), _times(1_000_000)),
    (pa.time32("ms"), _times(1_000)),
    (pa.time64("us"), st.times()),
    (
        pa.timestamp("ns"),
        st.datetimes(min_value=dt.datetime(1700, 1, 1), max_value=dt.datetime(2250, 1, 1)),
    ),
    (
        pa.decimal128(18, 3),
        st.decimals(min_value=-(10**14), max_value=10**14, places=3, allow_nan=False),
    ),
    (pa.decimal128(30, 2), st.decimals(min_value=-(10**27), max_value=10**27, places=2)),
]


@st.composite
def _column_values(draw: st.DrawFn, strat: st.SearchStrategy[Any]) -> list[Any]:
    """Enough rows for dictionaries to be considered: mostly distinct values, or a few
    repeated ones."""
    value = st.one_of(st.none(), strat)
    n = draw(st.integers(encoding._DICTIONARY_MIN_ROWS + 1, 300))
    if draw(st.booleans()):
        pool = draw(st.lists(value, min_size=1, max_size=4))
        return [draw(st.sampled_from(pool)) for _ in range(n)]
    return draw(st.lists(value, min_size=n, max_size=n))


@pytest.mark.parametrize(("type_", "strat"), _all_types, ids=[str(t) for t, _ in _all_types])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.data_too_large])
@given(data=st.data())
def test_every_supported_type_round_trips_through_a_part(
    type_: pa.DataType, strat: st.SearchStrategy[Any], data: st.DataObject
) -> None:
    """A Parquet part gives back exactly the table it was made of, types included: for
    ``date64`` and ``time32[s]``, which Parquet stores as 32-bit dates and milliseconds,
    the reader used to give ``date32`` / ``time32[ms]`` and every read of such a shard
    failed its schema check."""
    values = data.draw(_column_values(strat))
    schema = updates_schema(pa.schema([("c", type_)]), pa.schema([]))
    n = len(values)
    t = pa.Table.from_arrays(
        [pa.array(values, type_), pa.array(range(n), pa.int64()), pa.array([1] * n, pa.int64())],
        schema=schema,
    )
    data_ = encode_part(t)
    ref = make_part_ref("k/p.parquet", data_, n)
    back = decode_part(data_, ref)
    assert back.schema == schema
    assert _rows_of(back) == _rows_of(t)  # NaN equal to NaN
    blob = MemoryBlob()
    refs = write_parts(blob, t, "s1/b", inline_max_bytes=0)
    assert _rows_of(read_parts(blob, refs, schema=schema)) == _rows_of(t)


_byte_array_types = [
    (pa.string(), st.text(max_size=12)),
    (pa.large_string(), st.text(max_size=12)),
    (pa.binary(), st.binary(max_size=12)),
    (pa.large_binary(), st.binary(max_size=12)),
]


@contextmanager
def _dictionary_reads_from(rows: int) -> Iterator[None]:
    """Read string and binary dictionary columns as dictionaries from parts of at least
    ``rows`` rows (the decoder's threshold, lowered so that small parts take the path)."""
    old = decoding._DICTIONARY_READ_MIN_ROWS
    decoding._DICTIONARY_READ_MIN_ROWS = rows
    try:
        yield
    finally:
        decoding._DICTIONARY_READ_MIN_ROWS = old


@pytest.mark.parametrize(
    ("type_", "strat"), _byte_array_types, ids=[str(t) for t, _ in _byte_array_types]
)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.data_too_large])
@given(data=st.data())
def test_dictionary_read_string_and_binary_columns_come_back_exactly(
    type_: pa.DataType, strat: st.SearchStrategy[Any], data: st.DataObject
) -> None:
    """A part whose string or binary columns the decoder reads as dictionaries (and
    expands) gives back exactly the table it was made of: values, nulls, types, for all
    columns or a selection, one row group or several."""
    few = data.draw(_column_values(strat))
    n = len(few)
    many = data.draw(st.lists(st.one_of(st.none(), strat), min_size=n, max_size=n))
    schema = updates_schema(pa.schema([("a", type_), ("b", type_)]), pa.schema([]))
    t = pa.Table.from_arrays(
        [
            pa.array(few, type_),
            pa.array(many, type_),
            pa.array(range(n), pa.int64()),
            pa.array([1] * n, pa.int64()),
        ],
        schema=schema,
    )
    old_groups = encoding.ROW_GROUP_MIN_ROWS
    encoding.ROW_GROUP_MIN_ROWS = data.draw(st.sampled_from([16, 10**6]))
    try:
        data_ = encode_part(t)
    finally:
        encoding.ROW_GROUP_MIN_ROWS = old_groups
    ref = make_part_ref("k/p.parquet", data_, n)
    with _dictionary_reads_from(0):
        back = decode_part(data_, ref)
        some = decode_part(data_, ref, ["b", "a"])
    assert back.schema == schema
    assert back.equals(t)
    assert some.equals(t.select(["b", "a"]))


def test_dictionary_string_columns_are_read_as_dictionaries_and_expanded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Big enough parts read their dictionary-encoded string columns as dictionaries
    (the faster path), only those, and give back the stored types; smaller ones do
    not; a column whose pages fell back from dictionary to plain encoding still reads
    back exactly."""
    n = 20_000
    rng = np.random.default_rng(4)
    t = pa.table(
        {
            "few": pa.array(rng.choice(["x", "yy", "zzz"], n)).cast(pa.large_string()),
            "fewb": pa.array([b"ab", None, b"c", b"ab"] * (n // 4), pa.binary()),
            "many": pa.array([f"value-{i}" for i in range(n)], pa.string()),
            "k": pa.array(range(n), pa.int64()),
        }
    )
    expanded: list[list[str]] = []
    real = decoding._expand_dictionaries

    def spy(table: pa.Table, names: Any, arrow: pa.Schema) -> pa.Table:
        expanded.append(list(names))
        for name in names:
            assert pa.types.is_dictionary(table.schema.field(name).type)
        return real(table, names, arrow)

    monkeypatch.setattr(decoding, "_expand_dictionaries", spy)
    data_ = encode_part(t)
    assert decode_part(data_, make_part_ref("k/p.parquet", data_, n)).equals(t)
    assert expanded == [["few", "fewb"]]
    expanded.clear()
    small = encode_part(t.slice(0, decoding._DICTIONARY_READ_MIN_ROWS - 1))
    back = decode_part(small, make_part_ref("k/s.parquet", small, len(t.slice(0, 4095))))
    assert back.equals(t.slice(0, decoding._DICTIONARY_READ_MIN_ROWS - 1))
    assert expanded == []
    # Dictionary pages that fill up fall back to plain pages within the chunk.
    sink = pa.BufferOutputStream()
    pq.write_table(t, sink, use_dictionary=True, dictionary_pagesize_limit=1024, store_schema=True)
    fallback = sink.getvalue().to_pybytes()
    back = decode_part(fallback, make_part_ref("k/f.parquet", fallback, n))
    assert back.schema == t.schema
    assert back.equals(t)


def test_a_slice_kept_inline_is_read_back_only_when_first_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writing a one-row slice as an inline part reads nothing back: the cache keeps the
    stream just encoded and reads its rows on the first lookup (an append whose part is
    never read pays nothing for the cache), and those rows equal the decoded part."""
    big = _sample(5000)
    row = big.slice(4321, 1)
    reads: list[object] = []
    real = decoding._read_stream

    def counting(held: decoding._Stream) -> pa.Table:
        reads.append(held)
        return real(held)

    monkeypatch.setattr(decoding, "_read_stream", counting)
    refs = write_parts(FileBlob(tmp_path / "b"), row, "s1/batch-1", inline_max_bytes=64 * 1024)
    assert len(refs) == 1 and refs[0].inline is not None
    assert reads == []  # nothing read back by the write
    cached = INLINE_CACHE.get(refs[0])
    assert cached is not None and cached.equals(row) and len(reads) == 1
    assert INLINE_CACHE.get(refs[0]) is cached and len(reads) == 1  # read once
    assert cached.get_total_buffer_size() < 8 * 1024
    assert cached.equals(decoding.decode_part(refs[0].inline, refs[0]))


@pytest.mark.parametrize("workers", [1, 2])
def test_a_part_description_failing_in_the_pool_leaves_no_part(
    workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The statistics of one part of several (found in the shared pool while it encodes
    and uploads) fail: the write raises that error once every upload and description
    has ended, and every part it uploaded, before or after the failing one, is
    deleted."""
    real_stats = parts.table_stats
    calls = [0]
    lock = threading.Lock()

    def stats(table: pa.Table) -> Any:
        with lock:
            calls[0] += 1
            n = calls[0]
        if n == 3:
            raise ValueError("injected failure of a part's statistics")
        return real_stats(table)

    monkeypatch.setattr(parts, "table_stats", stats)
    blob = _SlowBlob(delay=0.005)
    with pytest.raises(ValueError, match="injected failure"):
        write_parts(
            blob,
            _sample(5000),
            "s/b",
            target_part_bytes=10_000,
            inline_max_bytes=0,
            max_workers=workers,
        )
    assert blob.sets >= 3 and blob.in_flight == 0
    assert blob.list_keys() == []
