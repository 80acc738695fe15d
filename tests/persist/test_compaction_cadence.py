"""The cadence of compaction under one-row appends (``persist/spine_merge.py``'s
heuristic, answered by ``persist/compactor.py``): how many physical merges the appends
cause, how many inputs each merges, and that the state stays small and reads back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from persist import MemoryBlob, PersistClient
from persist.compactor import Compactor
from persist.machine import ShardMachine
from persist.spine import FueledMergeReq, FueledMergeRes
from stash import Stash

ROW = pa.schema([("k", pa.int64())])


def _row(i: int) -> pa.Table:
    return pa.table(
        {"k": pa.array([i], pa.int64()), "_time": pa.array([i]), "_diff": pa.array([1])}
    )


@pytest.fixture
def client(tmp_path: Path) -> Iterator[PersistClient]:
    s = Stash.open(f"sqlite:///{tmp_path / 'stash.db'}", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="inline")
    yield c
    c.close()
    s.close()


def test_one_row_appends_merge_sixteen_batches_at_a_time(
    client: PersistClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A merge of one-row batches takes at least 16 of them (a merge costs a fixed half
    millisecond or so whatever its size), so 256 one-row appends do about 17 physical
    merges, not the 36 of a heuristic of 8; the hollow batches stay few and every row
    reads back."""
    merged: list[FueledMergeReq] = []
    compute = Compactor.compute

    def spy(
        self: Compactor, machine: ShardMachine, req: FueledMergeReq
    ) -> tuple[FueledMergeRes, int]:
        merged.append(req)
        return compute(self, machine, req)

    monkeypatch.setattr(Compactor, "compute", spy)
    w, r = client.open("cadence", ROW, pa.schema([]))
    machine = client.machine(client.shard_id("cadence"))
    n = 256
    most = 0
    for i in range(n):
        w.compare_and_append(_row(i), i, i + 1)
        most = max(most, machine.state().trace.num_hollow_batches())
    assert merged and all(len(q.inputs) >= 16 for q in merged)
    assert len(merged) <= n // 15 + 1
    assert client.compactor.totals.applied == len(merged)
    # At most 15 hollow batches wait per fueled spine batch: logarithmic in n.
    assert most <= 16 + 2 * n.bit_length()
    assert sorted(r.snapshot(n - 1).column("k").to_pylist()) == list(range(n))
