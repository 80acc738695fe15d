"""Key ranges over sorted runs (persist.merge) and the streamed snapshot.

The property: for random shards (several appends, batches of several runs, tiny parts so
that runs span parts and equal keys span part boundaries, retractions, compactions, keys
with nulls, NaN and strings), cutting the read by key range into any number of ranges and
merging each range's runs gives exactly the snapshot, each row once; and
``ReadHandle.snapshot_stream`` equals ``snapshot``.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
import tracemalloc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import persist.consolidation as consolidation
from persist import PersistClient
from persist.blob import MemoryBlob
from persist.errors import InvalidUsage
from persist.fetch import stream_snapshot
from persist.merge import (
    cut_positions,
    decode_keys,
    encode_keys,
    key_ranks,
    key_samples,
    plan_ranges,
)
from persist.updates import updates_schema
from stash import Stash

KEYS = pa.schema([("s", pa.string()), ("f", pa.float64())])
#: Proxy pools made by tests: kept alive, since freeing a buffer after its pool crashes.
_PROXY_POOLS: list[pa.MemoryPool] = []
VALUES = pa.schema([("v", pa.int64())])


@pytest.fixture
def stash() -> Iterator[Stash]:
    s = Stash.open("memory://", fenced=False)
    yield s
    s.close()


# ------------------------------------------------------------------ encoding


def test_key_samples_round_trip_every_supported_type() -> None:
    """Encoded keys decode to equal values, NaN, infinities, nulls, binary, decimals and
    temporal values included, and survive JSON."""
    import json

    schema = pa.schema(
        [
            ("i", pa.int64()),
            ("u", pa.uint64()),
            ("f", pa.float64()),
            ("g", pa.float32()),
            ("s", pa.large_string()),
            ("b", pa.binary()),
            ("x", pa.binary(2)),
            ("d", pa.decimal128(10, 3)),
            ("day", pa.date32()),
            ("ts", pa.timestamp("us", tz="UTC")),
            ("t", pa.time32("s")),
            ("dur", pa.duration("ns")),
            ("ok", pa.bool_()),
        ]
    )
    rows = {
        "i": [-(2**63), 2**63 - 1, None],
        "u": [0, 2**64 - 1, None],
        "f": [math.nan, -math.inf, None],
        "g": [1.5, math.inf, None],
        "s": ["", "é\x00z", None],
        "b": [b"", b"\xff\x00", None],
        "x": [b"ab", b"\x00\x01", None],
        "d": [decimal.Decimal("-1.250"), decimal.Decimal("9999999.999"), None],
        "day": [dt.date(1, 1, 1), dt.date(9999, 12, 31), None],
        "ts": [
            dt.datetime(2020, 1, 1, tzinfo=dt.UTC),
            dt.datetime(1969, 1, 1, tzinfo=dt.UTC),
            None,
        ],
        "t": [dt.time(0, 0, 1), dt.time(23, 59, 59), None],
        "dur": [dt.timedelta(microseconds=1), dt.timedelta(days=-3), None],
        "ok": [True, False, None],
    }
    table = pa.table(rows, schema=schema)
    encoded = json.loads(json.dumps(encode_keys(table), allow_nan=False))
    back = decode_keys(encoded, schema)
    assert back.schema.types == schema.types
    for name in schema.names:
        a, b = table.column(name).to_pylist(), back.column(name).to_pylist()
        for x, y in zip(a, b, strict=True):
            assert (x == y) or (isinstance(x, float) and math.isnan(x) and math.isnan(y))


def test_decode_keys_refuses_samples_of_the_wrong_width() -> None:
    with pytest.raises(InvalidUsage, match="does not have 2 key values"):
        decode_keys([("a",)], KEYS)
    with pytest.raises(InvalidUsage, match="do not fit the key schema"):
        decode_keys([("a", "not a float")], KEYS)


def test_plan_ranges_refuses_parts_without_samples() -> None:
    with pytest.raises(InvalidUsage, match="part 1 has no key samples"):
        plan_ranges([(("a", 1.0),), ()], [10, 10], KEYS, 2)
    with pytest.raises(InvalidUsage, match="ranges must be >= 1"):
        plan_ranges([(("a", 1.0),)], [10], KEYS, 0)


# ------------------------------------------------------------------ key order

KEY_VALUES = st.tuples(
    st.one_of(st.none(), st.sampled_from(["", "a", "b", "é", "aa"])),
    st.one_of(st.none(), st.sampled_from([math.nan, -0.0, 0.0, -1.5, 2.0, math.inf])),
)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(KEY_VALUES, min_size=1, max_size=40), big=st.booleans())
def test_key_ranks_follow_consolidation_order(rows: list[tuple[Any, Any]], big: bool) -> None:
    """Ranks order keys as consolidation sorts them (nulls last, NaN after numbers,
    NaN == NaN, -0.0 == 0.0), on both of its sort paths."""
    table = pa.table(
        {"s": [r[0] for r in rows], "f": [r[1] for r in rows]},
        schema=KEYS,
    )
    import persist.merge as merge

    old = merge._CODES_MIN_ROWS
    try:
        if big:  # exercise the packed-codes path on small tables
            merge._CODES_MIN_ROWS = 0
        ranks = key_ranks(table, KEYS.names)
    finally:
        merge._CODES_MIN_ROWS = old

    def sort_key(r: tuple[Any, Any]) -> tuple[Any, ...]:
        s, f = r
        fk = (2, 0.0) if f is None else ((1, 0.0) if math.isnan(f) else (0, f + 0.0))
        return (s is None, s or "", fk)

    expected = {sort_key(r) for r in rows}
    order = sorted(expected)
    want = [order.index(sort_key(r)) for r in rows]
    assert ranks.tolist() == want


def test_cut_positions_on_a_sorted_table() -> None:
    table = pa.table(
        {"s": ["a", "a", "b", "b", None], "f": [1.0, math.nan, 0.0, 0.0, None]}, schema=KEYS
    )
    cuts = decode_keys([("a", math.nan), ("b", -0.0), ("c", 0.0), (None, None)], KEYS)
    assert cut_positions(table, KEYS.names, cuts).tolist() == [1, 2, 4, 4]
    assert cut_positions(table, KEYS.names, cuts, side="right").tolist() == [2, 4, 4, 5]
    with pytest.raises(InvalidUsage, match="side"):
        cut_positions(table, KEYS.names, cuts, side="middle")


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(KEY_VALUES, min_size=0, max_size=60),
    cuts=st.lists(KEY_VALUES, min_size=1, max_size=5),
    side=st.sampled_from(["left", "right"]),
)
def test_cut_positions_through_a_sample_equal_ranking_every_row(
    rows: list[tuple[Any, Any]], cuts: list[tuple[Any, Any]], side: str
) -> None:
    """Big tables place cuts among a strided sample first: the positions are those of
    ranking every row (tiny thresholds here, so small tables take that path)."""
    import persist.merge as merge

    table = pa.table({"s": [r[0] for r in rows], "f": [r[1] for r in rows]}, schema=KEYS)
    table = table.take(pc.sort_indices(table, sort_keys=[("s", "ascending"), ("f", "ascending")]))
    cut_table = pa.table({"s": [c[0] for c in cuts], "f": [c[1] for c in cuts]}, schema=KEYS)
    want = (
        merge._positions(table, KEYS.names, cut_table, side).tolist() if rows else [0] * len(cuts)
    )
    old = merge._DIRECT_ROWS, merge._SAMPLE_ROWS
    try:
        merge._DIRECT_ROWS, merge._SAMPLE_ROWS = 4, 3
        got = merge._ranked_cut_positions(table, KEYS.names, cut_table, side)
    finally:
        merge._DIRECT_ROWS, merge._SAMPLE_ROWS = old
    assert got.tolist() == want


#: Key columns of every type the binary search of ``cut_positions`` compares in Python.
MANY_KEYS = pa.schema(
    [
        ("ok", pa.bool_()),
        ("i", pa.int32()),
        ("u", pa.uint64()),
        ("g", pa.float32()),
        ("b", pa.large_binary()),
        ("d", pa.decimal128(6, 2)),
        ("day", pa.date32()),
        ("ts", pa.timestamp("ns", tz="UTC")),
        ("s", pa.string()),
    ]
)
MANY_VALUES = st.tuples(
    st.one_of(st.none(), st.booleans()),
    st.one_of(st.none(), st.sampled_from([-(2**31), -1, 0, 7, 2**31 - 1])),
    st.one_of(st.none(), st.sampled_from([0, 1, 2**63, 2**64 - 1])),
    st.one_of(st.none(), st.sampled_from([math.nan, -math.inf, -0.0, 0.0, 0.5])),
    st.one_of(st.none(), st.sampled_from([b"", b"\x00", b"\xff", b"a\x00"])),
    st.one_of(st.none(), st.sampled_from(["-1.50", "0.00", "3.25"])),
    st.one_of(st.none(), st.sampled_from([dt.date(1, 1, 1), dt.date(1970, 1, 1)])),
    st.one_of(st.none(), st.sampled_from([-5, 0, 10**18])),
    st.one_of(st.none(), st.sampled_from(["", "a", "é", "z", "\U0001f600"])),
)


def _many_table(rows: list[tuple[Any, ...]]) -> pa.Table:
    cols = list(zip(*rows, strict=True)) if rows else [()] * len(MANY_KEYS)
    arrays = []
    for f, col in zip(MANY_KEYS, cols, strict=True):
        vals = list(col)
        if pa.types.is_decimal(f.type):
            vals = [None if v is None else decimal.Decimal(v) for v in vals]
        if pa.types.is_timestamp(f.type):
            arrays.append(pa.array(vals, pa.int64()).view(f.type))
            continue
        arrays.append(pa.array(vals, f.type))
    return pa.Table.from_arrays(arrays, schema=MANY_KEYS)


@settings(max_examples=80, deadline=None)
@given(
    rows=st.lists(MANY_VALUES, min_size=0, max_size=50),
    cuts=st.lists(MANY_VALUES, min_size=1, max_size=6),
    from_rows=st.lists(st.integers(0, 49), max_size=4),
    side=st.sampled_from(["left", "right"]),
    prefix=st.integers(1, len(MANY_KEYS)),
)
def test_cut_positions_by_binary_search_equal_ranking_every_row(
    rows: list[tuple[Any, ...]],
    cuts: list[tuple[Any, ...]],
    from_rows: list[int],
    side: str,
    prefix: int,
) -> None:
    """The binary search (Python comparisons of the rows' values) places every cut where
    ranking every row with the cuts in consolidation's order does, for every key type it
    takes, nulls, NaN, -0.0, unsigned 64-bit and non-ASCII strings included, for cuts
    between rows and equal to rows, on both sides."""
    import persist.merge as merge

    names = MANY_KEYS.names[:prefix]
    table = _many_table(rows)
    if rows:
        table = table.take(pa.array(np.argsort(key_ranks(table, names), kind="stable")))
        cuts = cuts + [rows[i % len(rows)] for i in from_rows]
    cut_table = _many_table(cuts).select(names)
    table = table.select(names)
    assert all(merge._py_order(f.type) is not None for f in table.schema)
    want = merge._ranked_cut_positions(table, names, cut_table, side)
    got = merge._bisect_positions(
        table, cut_table, [merge._py_order(f.type) for f in table.schema], side
    )
    assert got.tolist() == want.tolist()
    assert cut_positions(table, names, cut_table, side).tolist() == want.tolist()


def test_key_samples_hold_the_first_and_last_key() -> None:
    table = pa.table({"s": [str(i).zfill(3) for i in range(100)], "f": [0.0] * 100}, schema=KEYS)
    samples = key_samples(table, KEYS.names)
    assert samples[0] == ("000", 0.0) and samples[-1] == ("099", 0.0)
    assert len(samples) == 9
    assert key_samples(table.slice(0, 1), KEYS.names) == (("000", 0.0),)
    assert key_samples(table.slice(0, 0), KEYS.names) == ()


# ------------------------------------------------------------------ property

UPDATE = st.tuples(
    KEY_VALUES,
    st.integers(0, 2),  # value
    st.integers(0, 2),  # time offset in the append
    st.sampled_from([-1, 1, 1, 2]),
)


@st.composite
def shards(draw: Any) -> dict[str, Any]:
    return {
        "appends": draw(
            st.lists(
                st.lists(st.lists(UPDATE, max_size=12), min_size=1, max_size=3),  # runs
                min_size=1,
                max_size=4,
            )
        ),
        "compact_after": draw(st.integers(0, 4)),
        # 1 byte: a part per row; else parts of a few rows, cut inside by the ranges.
        "part_bytes": draw(st.sampled_from([1, 150, 400])),
        # Rows per Parquet row group (None: the default, one group in these tiny parts),
        # so that key-range reads skip row groups.
        "group_rows": draw(st.sampled_from([None, 1, 2])),
        "as_of_frac": draw(st.floats(0, 1)),
        "dup_key": draw(st.booleans()),
    }


def _build(stash: Stash, spec: dict[str, Any]) -> tuple[PersistClient, Any, int]:
    import persist.encoding as encoding

    old = encoding.ROW_GROUP_MIN_ROWS, encoding.ROW_GROUPS_PER_PART
    if spec.get("group_rows") is not None:
        encoding.ROW_GROUP_MIN_ROWS, encoding.ROW_GROUPS_PER_PART = spec["group_rows"], 10**9
    try:
        return _write(stash, spec)
    finally:
        encoding.ROW_GROUP_MIN_ROWS, encoding.ROW_GROUPS_PER_PART = old


def _write(stash: Stash, spec: dict[str, Any]) -> tuple[PersistClient, Any, int]:
    client = PersistClient(
        stash,
        MemoryBlob(),
        compaction="off",
        inline_max_bytes=0,
        target_part_bytes=spec["part_bytes"],
    )
    write, read = client.open("m", KEYS, VALUES)
    upper = 0
    for i, runs in enumerate(spec["appends"]):
        if i == spec["compact_after"]:
            client.compaction = "inline"
        builder = write.builder(upper)
        for run in runs:
            updates = [(((k[0], k[1]), (v,)), upper + t, d) for k, v, t, d in run]
            if spec["dup_key"]:  # one key over several parts of the same run
                updates += [((("dup", 1.0), (v,)), upper, 1) for v in range(3)]
            if updates:
                builder.add(updates)
        batch = builder.finish(upper + 3)
        write.compare_and_append_batch([batch], upper, upper + 3)
        upper += 3
    as_of = int(spec["as_of_frac"] * (upper - 1))
    return client, read, as_of


def _rows(table: pa.Table) -> list[tuple[Any, ...]]:
    def norm(x: Any) -> Any:
        return "NaN" if isinstance(x, float) and math.isnan(x) else x

    return [tuple(norm(x) for x in r.values()) for r in table.to_pylist()]


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(spec=shards())
def test_key_range_reads_equal_the_snapshot(spec: dict[str, Any]) -> None:
    from spark.persist_planning import plan_key_ranges

    s = Stash.open("memory://", fenced=False)
    client, read, as_of = _build(s, spec)
    try:
        snap = read.snapshot(as_of)
        batches = read.snapshot_batches(as_of)
        schema = updates_schema(KEYS, VALUES)
        assert all(p.key_samples is not None for b in batches for p in b.parts)
        for ranges in (1, 2, 3, 7, 16):
            planned = plan_key_ranges(batches, KEYS, ranges)
            assert planned is not None and len(planned) <= ranges
            pieces = []
            for group, lo, hi in planned:
                lower = None if lo is None else decode_keys([lo], KEYS)
                upper = None if hi is None else decode_keys([hi], KEYS)
                pieces += stream_snapshot(
                    client.blob,
                    group,
                    schema,
                    KEYS.names,
                    VALUES.names,
                    as_of,
                    key_schema=KEYS,
                    lower=lower,
                    upper=upper,
                )
            got = pa.concat_tables(pieces) if pieces else schema.empty_table()
            # The same rows in the same (key, value) order, each once.
            assert _rows(got) == _rows(snap), ranges
        streamed = pa.Table.from_batches(
            list(read.snapshot_stream(as_of, max_chunk_rows=2)), schema
        )
        assert _rows(streamed) == _rows(snap)
    finally:
        client.close()
        s.close()


def test_parts_without_samples_read_whole(stash: Stash) -> None:
    """Parts written before key samples were recorded: the stream reads the snapshot at
    once and the Spark planning falls back to one partition."""
    import dataclasses

    from persist.types import HollowBatch
    from spark.persist_planning import plan_key_ranges

    client = PersistClient(stash, MemoryBlob(), inline_max_bytes=0, target_part_bytes=1)
    try:
        write, read = client.open("old", KEYS, VALUES)
        write.compare_and_append([((("b", 1.0), (1,)), 0, 1), ((("a", None), (2,)), 0, 1)], 0, 1)
        batches = read.snapshot_batches(0)
        old = [
            HollowBatch(
                b.desc,
                tuple(dataclasses.replace(p, key_samples=None) for p in b.parts),
                b.len,
                b.runs,
            )
            for b in batches
        ]
        assert plan_key_ranges(old, KEYS, 4) is None
        schema = updates_schema(KEYS, VALUES)
        got = list(
            stream_snapshot(client.blob, old, schema, KEYS.names, VALUES.names, 0, key_schema=KEYS)
        )
        assert _rows(pa.concat_tables(got)) == _rows(read.snapshot(0))
    finally:
        client.close()


# ------------------------------------------------------------------ memory


def test_snapshot_stream_memory_is_bounded_by_parts_not_the_shard(
    stash: Stash, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard several times larger than the memory the stream may use: every Arrow
    allocation (through a proxy pool standing in for the default and the scratch pool)
    and every Python/numpy allocation (tracemalloc) peaks well below the shard's size."""
    client = PersistClient(
        stash, MemoryBlob(), compaction="off", inline_max_bytes=0, target_part_bytes=256 * 1024
    )
    try:
        write, read = client.open("big", KEYS, VALUES)
        rng = np.random.default_rng(7)
        n = 200_000
        for t in range(3):  # three overlapping runs
            keys = rng.integers(0, 50_000, n)
            table = pa.table(
                {
                    "s": pa.array([f"k{k:06d}" for k in keys.tolist()], pa.string()),
                    "f": pa.array(rng.random(n)),
                    "v": pa.array(rng.integers(0, 10, n)),
                    "_time": pa.array(np.full(n, t, np.int64)),
                    "_diff": pa.array(np.ones(n, np.int64)),
                }
            )
            write.compare_and_append(table, t, t + 1)
        shard_bytes = read.snapshot(2).nbytes
        proxy = pa.proxy_memory_pool(pa.default_memory_pool())
        _PROXY_POOLS.append(proxy)  # buffers it allocated may outlive the test (caches)
        monkeypatch.setattr(consolidation, "_scratch_pool", lambda: proxy)
        previous = pa.default_memory_pool()
        pa.set_memory_pool(proxy)
        tracemalloc.start()
        try:
            rows = 0
            for rb in read.snapshot_stream(2):
                rows += rb.num_rows
            _, py_peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            pa.set_memory_pool(previous)
        assert rows == 3 * n  # random floats: every update is its own row
        arrow_peak = proxy.max_memory()
        assert arrow_peak < shard_bytes / 3, (arrow_peak, shard_bytes)
        assert py_peak < shard_bytes / 3, (py_peak, shard_bytes)
    finally:
        client.close()


def test_inline_parts_record_no_samples_and_are_planned_by_their_rows() -> None:
    """Inline parts carry no key samples in the state (sampling every one-row append
    was a sixth of its cost); planning samples their rows instead, so a shard of
    inline and blob parts still reads by key range, equal to the snapshot."""
    from stash import Stash

    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off")
    try:
        ks, vs = pa.schema([("k", pa.int64())]), pa.schema([("v", pa.string())])
        w, r = c.open("s", ks, vs)
        w.append([(((k,), (f"big{k}",)), 0, 1) for k in range(0, 40_000, 2)], 0, 1)
        for t in range(1, 6):  # one-row appends: inline parts
            w.append([(((t * 7,), (f"small{t}",)), t, 1), (((1,), ("big0",)), t, -1)], t, t + 1)
        parts = [p for b in c.inspect("s").batches() for p in b.parts]
        inline = [p for p in parts if p.inline is not None]
        assert inline and all(p.key_samples is None for p in inline)
        assert any(p.inline is None and p.key_samples for p in parts)
        snap = r.snapshot(5)
        st = c.inspect("s")
        pieces = list(
            stream_snapshot(
                c.blob,
                [b for b in st.batches() if b.parts],
                updates_schema(ks, vs),
                ["k"],
                ["v"],
                5,
                key_schema=ks,
            )
        )
        assert len(pieces) > 1  # cut by key range, not read whole
        assert pa.concat_tables(pieces).to_pylist() == snap.to_pylist()
        streamed = pa.Table.from_batches(list(r.snapshot_stream(5)))
        assert streamed.to_pylist() == snap.to_pylist()
    finally:
        c.close()
        s.close()
