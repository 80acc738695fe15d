"""Tests of persist's fast paths: consolidation returning a row order instead of
a gathered table, parts gathered by their encoding threads, the one-row shortcut, reads
that skip the time filter, flat blob keys (no directory per batch), cached batch JSON,
and one-row appends kept inline with the client's defaults."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import persist.consolidation as consolidation
import persist.parts as parts
from persist import FileBlob, MemoryBlob, PersistClient
from persist.encoding import encode_inline_part
from persist.fetch import read_batches, snapshot_table
from persist.gc import collect_garbage, key_created_ms
from persist.parts import (
    consolidate,
    consolidate_order,
    read_parts,
    updates_schema,
    write_parts,
)
from persist.types import Description, HollowBatch, PartRef
from stash import Antichain, Stash

KS = pa.schema([("k", pa.int64()), ("name", pa.string())])
VS = pa.schema([("v", pa.float64())])
SCHEMA = updates_schema(KS, VS)


def _table(rows: list[tuple[Any, ...]]) -> pa.Table:
    cols = list(zip(*rows, strict=True)) if rows else [[] for _ in SCHEMA]
    return pa.Table.from_arrays(
        [pa.array(c, f.type) for c, f in zip(cols, SCHEMA, strict=True)], schema=SCHEMA
    )


def _random_table(n: int, seed: int, dup_every: int = 0, distinct: bool = False) -> pa.Table:
    rng = np.random.default_rng(seed)
    k = rng.permutation(n) if distinct else rng.integers(0, max(2, n // 3), n)
    names = np.array(["a", "b", None, "dd"], dtype=object)[rng.integers(0, 4, n)]
    v = rng.integers(0, 3, n).astype(np.float64)
    t = rng.integers(0, 5, n)
    d = rng.integers(1, 3, n) if distinct else rng.integers(-2, 3, n)
    if dup_every:
        d[::dup_every] = 0
    return pa.Table.from_arrays(
        [
            pa.array(k, pa.int64()),
            pa.array(names, pa.string()),
            pa.array(v, pa.float64()),
            pa.array(t, pa.int64()),
            pa.array(d, pa.int64()),
        ],
        schema=SCHEMA,
    )


_row = st.tuples(
    st.integers(0, 4),
    st.sampled_from(["a", "b", None]),
    st.sampled_from([0.0, 1.5, None]),
    st.integers(0, 4),
    st.integers(-2, 2),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_row, max_size=60), st.one_of(st.none(), st.integers(0, 5)), st.booleans())
def test_consolidate_order_gives_what_consolidate_gives(
    rows: list[tuple[Any, ...]], since: int | None, codes: bool
) -> None:
    table = _table(rows)
    old = consolidation._CODES_MIN_ROWS
    consolidation._CODES_MIN_ROWS = 0 if codes else 10**12
    try:
        base, order = consolidate_order(table, KS.names, VS.names, since)
        want = consolidate(table, KS.names, VS.names, since)
    finally:
        consolidation._CODES_MIN_ROWS = old
    got = base if order is None else base.take(pa.array(order, pa.int64()))
    assert got.equals(want)


@pytest.mark.parametrize(("dup_every", "distinct"), [(0, True), (7, True), (0, False)])
def test_consolidate_order_defers_the_gather_of_large_tables(
    dup_every: int, distinct: bool
) -> None:
    table = _random_table(30_000, seed=dup_every, dup_every=dup_every, distinct=distinct)
    base, order = consolidate_order(table, KS.names, VS.names)
    if distinct:  # no group to sum: only the permutation (minus zero diffs)
        assert order is not None and base is table
        assert len(order) == table.num_rows - (len(range(0, 30_000, dup_every)) if dup_every else 0)
        got = base.take(pa.array(order, pa.int64()))
    else:
        assert order is None
        got = base
    assert got.equals(consolidate(table, KS.names, VS.names))


def test_one_row_shortcut() -> None:
    one = _table([(1, "a", 2.0, 3, 5)])
    assert consolidate(one, KS.names, VS.names).equals(one)
    assert consolidate(one, KS.names, VS.names, since=2).equals(one)
    advanced = consolidate(one, KS.names, VS.names, since=7)
    assert advanced.column("_time").to_pylist() == [7] and advanced.schema == SCHEMA
    assert consolidate(_table([(1, "a", 2.0, 3, 0)]), KS.names, VS.names).num_rows == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_write_parts_with_order_writes_the_gathered_table(
    monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    monkeypatch.setattr(parts, "MIN_PARALLEL_PART_BYTES", 20_000)
    table = _random_table(20_000, seed=3, distinct=True)
    base, order = consolidate_order(table, KS.names, VS.names)
    assert order is not None
    want = base.take(pa.array(order, pa.int64()))
    blob = MemoryBlob()
    refs = write_parts(
        blob,
        base,
        "s/b",
        inline_max_bytes=0,
        max_workers=workers,
        order=order,
        name_prefix="1-x-",
        target_part_bytes=10**9,
    )
    assert len(refs) == (2 if workers == 2 else 1)
    assert all(r.key is not None and r.key.startswith("s/b/1-x-") for r in refs)
    assert read_parts(blob, refs, schema=SCHEMA).equals(want)
    # Every part is sorted on its own and the run continues across parts.
    assert consolidate(read_parts(blob, refs), KS.names, VS.names).equals(want)


def test_write_parts_with_a_subset_order() -> None:
    table = _random_table(50, seed=1)
    order = np.array([4, 2, 9], dtype=np.int64)
    blob = MemoryBlob()
    refs = write_parts(blob, table, "s/b", inline_max_bytes=0, order=order)
    assert read_parts(blob, refs).equals(table.take(pa.array(order)))


def _batch(blob: MemoryBlob, table: pa.Table, lower: int, upper: int) -> HollowBatch:
    refs = write_parts(blob, table, "s/b", inline_max_bytes=0)
    return HollowBatch(
        Description(Antichain.from_elem(lower), Antichain.from_elem(upper)),
        tuple(refs),
        table.num_rows,
    )


def test_read_batches_filters_only_out_of_range_times() -> None:
    blob = MemoryBlob()
    table = _table([(1, "a", 1.0, 2, 1), (2, "b", 1.0, 4, 1), (3, "a", 1.0, 0, 1)])
    b = _batch(blob, table, 0, 5)
    assert read_batches(blob, [b], SCHEMA).equals(table)  # in range: no copy needed
    inside = read_batches(blob, [b], SCHEMA, lower=0, upper=5)
    assert inside.column("_time").to_pylist() == [2, 4, 0]
    cut = read_batches(blob, [b], SCHEMA, lower=1, upper=4)
    assert cut.column("_time").to_pylist() == [2]
    # A batch whose lower is above its rows' times (rewritten) advances them first.
    late = HollowBatch(Description(Antichain.from_elem(3), Antichain.from_elem(6)), b.parts, b.len)
    assert read_batches(blob, [late], SCHEMA).column("_time").to_pylist() == [3, 4, 3]
    assert read_batches(blob, [late], SCHEMA, upper=4).column("_time").to_pylist() == [3, 3]


def test_hollow_batch_json_is_computed_once_and_round_trips() -> None:
    ref = PartRef(key=None, rows=1, encoded_size_bytes=3, checksum="ab" * 32, inline=b"abc")
    hb = HollowBatch(Description(Antichain.from_elem(0), Antichain.from_elem(2)), (ref,), 1)
    j = hb.to_json()
    assert hb.to_json() is j
    back = HollowBatch.from_json(j)
    assert back == hb and back.to_json() == j


def test_key_created_ms_reads_both_layouts() -> None:
    assert key_created_ms("s1/b/1700000000000-abcd-0123.parquet") == 1_700_000_000_000
    assert key_created_ms("s1/c/1700000000001-abcd/0123.parquet") == 1_700_000_000_001
    assert key_created_ms("s1/b/x-abcd-0123.parquet") is None
    assert key_created_ms("s1/b") is None


@pytest.fixture
def stash(tmp_path: Path) -> Iterator[Stash]:
    s = Stash.open(f"sqlite:///{tmp_path / 'stash.db'}", fenced=False)
    yield s
    s.close()


WIDE = pa.schema([(f"c{i}", pa.int64() if i % 3 else pa.string()) for i in range(19)])


def _wide_row(i: int, t: int) -> pa.Table:
    cols: dict[str, Any] = {
        f.name: pa.array([i if pa.types.is_integer(f.type) else f"r{i}"], f.type) for f in WIDE
    }
    cols["_time"] = pa.array([t], pa.int64())
    cols["_diff"] = pa.array([1], pa.int64())
    return pa.table(cols)


def test_one_row_appends_of_a_wide_schema_stay_inline_and_compaction_moves_them_out(
    stash: Stash, tmp_path: Path
) -> None:
    blob = FileBlob(tmp_path / "blob")
    # The inline cap lies halfway between the encoded sizes of one row and eight rows of
    # WIDE (about 250 and 330 bytes without the schema message, 610 and 680 with it):
    # one-row parts stay inline, merges of more than a few rows go to blob.
    sch = updates_schema(WIDE, pa.schema([]))

    def size(n: int) -> int:
        rows = pa.concat_tables([_wide_row(i, i) for i in range(n)]).cast(sch)
        return len(encode_inline_part(rows, schema=sch))

    cap = (size(1) + size(8)) // 2
    c = PersistClient(stash, blob, compaction="inline", inline_max_bytes=cap)
    try:
        w, r = c.open("wide", WIDE, pa.schema([]))
        for i in range(40):
            w.compare_and_append(_wide_row(i, i), i, i + 1)
            r.downgrade_since(i)
        st = c.inspect("wide")
        # The last append was inline.
        newest = st.batches()[-1]
        assert all(p.inline is not None for p in newest.parts)
        assert st.inline_bytes() <= c.inline_total_max_bytes
        snap = r.snapshot(39)
        assert snap.num_rows == 40 and sorted(snap.column("c1").to_pylist()) == list(range(40))
        # Blob keys (compaction outputs, if any) are flat: no directory per batch.
        keys = [k for k, _ in blob.list_keys(f"{st.shard_id}/")]
        assert keys and all(k.startswith(f"{st.shard_id}/c/") for k in keys)
        assert st.referenced_blob_keys() <= set(keys)
        assert all(len(k.split("/")) == 3 for k in keys)
        assert all(key_created_ms(k) is not None for k in keys)
        dirs = [p for p in (tmp_path / "blob" / st.shard_id).rglob("*") if p.is_dir()]
        assert {d.name for d in dirs} <= {"b", "c"}
        report = collect_garbage(c, "wide", grace_seconds=3600)
        assert not report.deleted_abandoned and not report.failed
    finally:
        c.close()


def test_writer_blob_keys_are_flat_and_collected(stash: Stash, tmp_path: Path) -> None:
    blob = FileBlob(tmp_path / "blob")
    now = [time.time()]
    c = PersistClient(
        stash,
        blob,
        compaction="off",
        inline_max_bytes=0,
        writer_lease_seconds=60,
        reader_lease_seconds=600,
        clock=lambda: now[0],
    )
    try:
        w, r = c.open("flat", WIDE, pa.schema([]))
        abandoned = w.batch(_wide_row(0, 0), 0, 1)
        (key,) = abandoned.blob_keys()
        assert len(key.split("/")) == 3 and key.startswith(f"{w.shard_id}/b/")
        w2 = c.open_writer("flat", WIDE, pa.schema([]))
        w2.compare_and_append(_wide_row(1, 0), 0, 1)
        # Its writer is live: kept, whatever the grace period.
        report = collect_garbage(c, "flat", grace_seconds=0)
        assert report.deleted_abandoned == [] and report.kept_live_writer == 1
        now[0] += 61  # the writers' leases run out; the reader heartbeats
        r.heartbeat()
        report = collect_garbage(c, "flat", grace_seconds=0)
        assert report.deleted_abandoned == [key]
        assert r.snapshot(0).num_rows == 1
    finally:
        c.close()


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.lists(_row, max_size=25), min_size=1, max_size=3),
    st.integers(0, 6),
    st.integers(0, 3),
    st.booleans(),
)
def test_snapshot_table_gives_what_read_and_consolidate_give(
    runs: list[list[tuple[Any, ...]]], as_of: int, since: int, single_time: bool
) -> None:
    """The snapshot's shortcut (one consolidated run at a single time is returned as
    read, its time set to ``as_of``) against the general path, on one batch of one run,
    one batch of several runs, and several batches; times below a batch's lower or since
    and above ``as_of`` included."""
    blob = MemoryBlob()
    batches: list[HollowBatch] = []
    for b, rows in enumerate(runs):
        if single_time:
            rows = [(*r[:3], 2, r[4]) for r in rows]
        table = consolidate(_table(rows), KS.names, VS.names)
        refs = write_parts(blob, table, f"s/b{b}", inline_max_bytes=2000 if b % 2 else 0)
        desc = Description(
            Antichain.from_elem(b), Antichain.from_elem(b + 5), Antichain.from_elem(since)
        )
        batches.append(HollowBatch(desc, tuple(refs), table.num_rows))
    if len(batches) == 3:  # two runs in one batch
        a, c = batches[0], batches[2]
        merged = HollowBatch(
            Description(a.desc.lower, c.desc.upper, a.desc.since),
            a.parts + c.parts,
            a.len + c.len,
            (len(a.parts),) if a.parts and c.parts else (),
        )
        batches = [merged, batches[1]]
    for chosen in (batches, batches[:1]):
        got = snapshot_table(blob, chosen, SCHEMA, KS.names, VS.names, as_of)
        table = read_batches(blob, chosen, SCHEMA, upper=as_of + 1)
        want = consolidate(table, KS.names, VS.names, since=as_of)
        assert got.equals(want), (got.to_pylist(), want.to_pylist())
