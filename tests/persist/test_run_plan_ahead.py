"""A large run's encoding plan is made in the shared pool while its rows are sorted.

The change (persist/builder.py ``RunWriter.write_run``): a table that will be cut into
parts encoded in parallel had its encoding plan made by the first encoding thread,
after the rows were sorted and gathered, while the other encoding thread waited for it.
It is now started before sorting (the plan samples the rows, which sorting only
permutes), on a core the sort leaves idle.  The parts are the same bytes; every path
out of the write, a failing one included, waits for the plan (no work of a write goes
on after it returned).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import persist.builder as builder
import persist.parts as parts
from persist import FileBlob, PersistClient
from persist.encoding import EncodingPlan, encoding_plan
from persist.errors import DiffOverflow
from stash import Stash

KS = pa.schema([("k", pa.int64()), ("s", pa.string())])
VS = pa.schema([("v", pa.float64())])


def _updates(n: int, diff: int = 1) -> pa.Table:
    i = np.arange(n)
    return pa.table(
        {
            "k": pa.array((i * 7919) % n, pa.int64()),
            "s": pa.array([f"s{j % 37}" for j in range(n)], pa.string()),
            "v": pa.array(i / 4, pa.float64()),
            "_time": pa.array(np.zeros(n, np.int64)),
            "_diff": pa.array(np.full(n, diff, np.int64)),
        }
    )


def _checksums(client: PersistClient, shard: str) -> list[str]:
    st = client.inspect(shard)
    return [p.checksum for b in st.batches() for p in b.parts]


@pytest.fixture
def small_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables of a few thousand rows are written as parts encoded in parallel."""
    monkeypatch.setattr(parts, "MIN_PARALLEL_PART_BYTES", 10_000)
    monkeypatch.setattr(builder, "_PLAN_AHEAD_ROWS", 1000)


def test_the_plan_is_made_ahead_once_and_the_parts_are_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_parallel: None
) -> None:
    """The writer plans the run (once, from all its rows), the encoding threads make no
    plan of their own, and the parts are the bytes they were when an encoding thread
    made the plan."""
    made: list[str] = []

    def spy(where: str) -> Any:
        def plan(table: pa.Table) -> EncodingPlan:
            made.append(f"{where} {table.num_rows}")
            return encoding_plan(table)

        return plan

    monkeypatch.setattr(builder, "encoding_plan", spy("writer"))
    monkeypatch.setattr(parts, "encoding_plan", spy("encoder"))
    s = Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False)
    c = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off", inline_max_bytes=0)
    try:
        t = _updates(20_000)
        w, r = c.open("ahead", KS, VS)
        w.compare_and_append(t, 0, 1)
        assert made == ["writer 20000"]
        ahead = _checksums(c, "ahead")
        assert len(ahead) == 2
        # Planned by an encoding thread (no plan ahead): the same bytes.
        made.clear()
        monkeypatch.setattr(builder, "_PLAN_AHEAD_ROWS", 10**9)
        w2, _ = c.open("behind", KS, VS)
        w2.compare_and_append(t, 0, 1)
        assert made == ["encoder 20000"]
        assert _checksums(c, "behind") == ahead
        got = r.snapshot(0).sort_by([("k", "ascending")])
        assert got.column("k").to_pylist() == sorted(t.column("k").to_pylist())
    finally:
        c.close()
        s.close()


def test_a_failing_write_waits_for_its_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_parallel: None
) -> None:
    """Consolidation refuses the updates (their diffs overflow) while the plan is being
    made: the write raises only after the plan has ended."""
    started, ended = threading.Event(), threading.Event()
    real_order = builder.consolidate_order

    def slow_plan(table: pa.Table) -> EncodingPlan:
        started.set()
        time.sleep(0.3)
        ended.set()
        return encoding_plan(table)

    def order(*args: Any) -> Any:
        assert started.wait(10)  # the plan is being made: then sort (and fail)
        return real_order(*args)

    monkeypatch.setattr(builder, "encoding_plan", slow_plan)
    monkeypatch.setattr(builder, "consolidate_order", order)
    s = Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False)
    c = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off", inline_max_bytes=0)
    try:
        w, _ = c.open("overflow", KS, VS)
        t = pa.concat_tables([_updates(3000, 2**62), _updates(3000, 2**62)])
        with pytest.raises(DiffOverflow):
            w.compare_and_append(t, 0, 1)
        assert ended.is_set()
    finally:
        c.close()
        s.close()
