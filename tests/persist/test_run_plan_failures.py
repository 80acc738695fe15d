"""Attacks on a large run's encoding plan made in the shared pool while its rows sort
(persist/builder.py ``RunWriter.write_run``, persist/parts.py ``plan=``): the plan
failing, its task cancelled with the pool's queue, many threads writing at once, and a
forked child writing.  Each write either commits all its rows or raises a clear error
having committed nothing and left no part behind; none hangs."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import persist.builder as builder
import persist.parts as parts
import persist.pool as pool
from persist import MemoryBlob, PersistClient
from persist.encoding import EncodingPlan, encoding_plan
from stash import Stash

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("s", pa.string())])
ROWS = 20_000


def _updates(n: int = ROWS, base: int = 0) -> pa.Table:
    i = np.arange(base, base + n)
    return pa.table(
        {
            "k": pa.array((i * 7919) % (base + n + 7), pa.int64()),
            "s": pa.array([f"v{j % 37}" for j in range(n)], pa.string()),
            "_time": pa.array(np.zeros(n, np.int64)),
            "_diff": pa.array(np.ones(n, np.int64)),
        }
    )


@pytest.fixture
def client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[PersistClient, MemoryBlob]]:
    """Tables of a few thousand rows are planned ahead and cut into parts encoded in
    parallel."""
    monkeypatch.setattr(parts, "MIN_PARALLEL_PART_BYTES", 10_000)
    monkeypatch.setattr(builder, "_PLAN_AHEAD_ROWS", 1000)
    s = Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False)
    blob = MemoryBlob()
    c = PersistClient(s, blob, compaction="off", inline_max_bytes=0)
    yield c, blob
    c.close()
    s.close()


def _parts_left(c: PersistClient, blob: MemoryBlob, shard: str) -> set[str]:
    sid = c.inspect(shard).shard_id
    refs = {p.key for b in c.inspect(shard).batches() for p in b.parts if p.key}
    return {k for k, _ in blob.list_keys(sid) if "/b/" in k} - refs


def test_a_failing_plan_fails_the_write_and_leaves_nothing(
    client: tuple[PersistClient, MemoryBlob], monkeypatch: pytest.MonkeyPatch
) -> None:
    c, blob = client
    calls: list[int] = []

    def broken(table: pa.Table) -> EncodingPlan:
        calls.append(table.num_rows)
        raise MemoryError("no memory for the plan")

    monkeypatch.setattr(builder, "encoding_plan", broken)
    w, r = c.open("t", KS, VS)
    with pytest.raises(MemoryError, match="no memory for the plan"):
        w.compare_and_append(_updates(), 0, 1)
    assert calls == [ROWS]
    assert c.inspect("t").upper.as_option() == 0
    assert not c.inspect("t").batches() or not any(b.parts for b in c.inspect("t").batches())
    assert not _parts_left(c, blob, "t")
    monkeypatch.setattr(builder, "encoding_plan", encoding_plan)
    w.compare_and_append(_updates(), 0, 1)  # the writer still works
    assert r.snapshot(0).num_rows == ROWS


def test_a_plan_cancelled_with_the_pool_queue_is_made_by_the_writer(
    client: tuple[PersistClient, MemoryBlob], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan's task is cancelled before any pool thread starts it (a pool shut down
    with ``cancel_futures``, or a queue the caller outran): the write makes it itself."""
    c, _ = client
    real = pool.Background.__init__

    def cancelled(self: Any, fn: Any) -> None:
        real(self, fn)
        self._future.cancel()

    monkeypatch.setattr(pool.Background, "__init__", cancelled)
    w, r = c.open("t", KS, VS)
    w.compare_and_append(_updates(), 0, 1)
    assert r.snapshot(0).num_rows == ROWS


def test_many_threads_writing_large_runs_at_once(
    client: tuple[PersistClient, MemoryBlob],
) -> None:
    """More writers than the pool has threads, each planning in it: every write commits
    its rows once (no hang: the join is bounded)."""
    c, blob = client
    n = pool.POOL_THREADS + 4
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def write(i: int) -> None:
        try:
            w, _ = c.open(f"t{i}", KS, VS)
            barrier.wait()
            w.compare_and_append(_updates(base=i), 0, 1)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not errors
    for i in range(n):
        _, r = c.open(f"t{i}", KS, VS)
        assert r.snapshot(0).num_rows == ROWS
        assert not _parts_left(c, blob, f"t{i}")


def test_a_forked_child_writes_a_large_run(
    client: tuple[PersistClient, MemoryBlob], tmp_path: Path
) -> None:
    """A child forked after the parent used the pool (Spark forks its Python workers)
    plans in a pool of its own and writes (its own store: a file blob)."""
    c, _ = client
    w, _ = c.open("t", KS, VS)
    w.compare_and_append(_updates(), 0, 1)  # the parent's pool has threads now
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            from persist import FileBlob

            s = Stash.open(f"sqlite:///{tmp_path / 'child.db'}", fenced=False)
            cc = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off", inline_max_bytes=0)
            wc, rc = cc.open("t", KS, VS)
            wc.compare_and_append(_updates(), 0, 1)
            code = 0 if rc.snapshot(0).num_rows == ROWS else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_many_threads_appending_large_runs_to_one_table(
    client: tuple[PersistClient, MemoryBlob],
) -> None:
    """Threads appending planned runs to one table at once (its transactions race for
    the upper and retry): every row lands once, no part is left unreferenced."""
    c, blob = client
    t = c.create_table("one", pa.schema([("k", pa.int64()), ("s", pa.string())]), key=["k"])
    n = 4
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def write(i: int) -> None:
        try:
            barrier.wait()
            t.append(_updates(base=i * ROWS).select(["k", "s"]))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not any(th.is_alive() for th in threads)
    assert not errors
    assert t.to_arrow().num_rows == n * ROWS
    assert not _parts_left(c, blob, "one")
