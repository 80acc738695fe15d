"""Operations that delete blobs are refused over a stash that commits nothing, and bad
numbers for time limits are refused clearly.

A ``PersistClient`` over a *savepoint* handle of the live stash (what an operator trying
a change would open) used to delete real parts: ``finalize_shard`` deleted the live
shard's parts while its tombstone was never committed, and GC deleted parts that only
the savepoint's own (uncommitted) compaction had retired.  Both now raise
``InvalidUsage``, deleting nothing."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from click.testing import CliRunner

from persist import InvalidUsage, MemoryBlob, PersistClient, collect_garbage
from persist.cli import main as persist_main
from stash import Antichain, Stash
from tests.support.clock import Clock

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


def _row(k: str, v: int, t: int) -> Any:
    return (((k,), (v,)), t, 1)


def _live(tmp_path: Path, n: int) -> tuple[str, str, Stash, PersistClient, Any, Any]:
    url, blob = f"sqlite:///{tmp_path}/s.db", f"file://{tmp_path}/blob"
    s = Stash.open(url, fenced=False)
    c = PersistClient(s, blob, compaction="off", inline_max_bytes=0)
    w, r = c.open("sh", KS, VS)
    for i in range(n):
        w.compare_and_append([_row(f"a{i}", 1, i)], i, i + 1)
    return url, blob, s, c, w, r


def test_finalize_through_a_savepoint_stash_is_refused(tmp_path: Path) -> None:
    url, blob, s, c, _w, r = _live(tmp_path, 1)
    with Stash.open(url, mode="savepoint", fenced=False) as sp:
        cp = PersistClient(sp, blob, compaction="off")
        with pytest.raises(InvalidUsage, match="finalize_shard deletes blobs.*savepoint"):
            cp.finalize_shard("sh")
        cp.close()
    assert not c.inspect("sh").tombstone
    assert r.snapshot(0).to_pylist() == [{"k": "a0", "v": 1, "_time": 0, "_diff": 1}]
    c.close()
    s.close()


def test_gc_through_a_savepoint_stash_is_refused(tmp_path: Path) -> None:
    url, blob, s, c, _w, r = _live(tmp_path, 8)
    r.downgrade_since(Antichain([7]))
    clock = Clock(2e9)
    with Stash.open(url, mode="savepoint", fenced=False) as sp:
        cp = PersistClient(sp, blob, compaction="inline", inline_max_bytes=0, clock=clock)
        wp, rp = cp.open("sh", KS, VS)
        rp.expire()
        for i in range(8, 30):  # compaction in the savepoint retires the live parts
            wp.compare_and_append([_row(f"b{i}", 1, i)], i, i + 1)
        clock.now += 10**6  # past every grace period and lease
        with pytest.raises(InvalidUsage, match="collect_garbage deletes blobs"):
            collect_garbage(cp, "sh", grace_seconds=0)
        cp.close()
    assert len(r.snapshot(7).to_pylist()) == 8  # the committed data is intact
    c.close()
    s.close()


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1.0, "1"])
def test_snapshot_wait_refuses_a_timeout_that_is_not_a_finite_number(timeout: Any) -> None:
    """``timeout=nan`` was never reached: ``snapshot(wait=True)`` blocked forever."""
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off")
    w, r = c.open("sh", KS, VS)
    w.compare_and_append([_row("a", 1, 0)], 0, 1)
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            r.snapshot(5, wait=True, timeout=timeout)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion
            outcome.append(e)

    th = threading.Thread(target=call, daemon=True)
    th.start()
    th.join(30)  # a refusal is immediate; 30 s only bounds a regression
    assert outcome and isinstance(outcome[0], InvalidUsage), outcome
    assert "timeout" in str(outcome[0])
    c.close()
    s.close()


@pytest.mark.parametrize("grace", ["nan", "inf", "-inf", "-1"])
def test_persist_gc_refuses_a_grace_that_is_not_a_finite_number(tmp_path: Path, grace: str) -> None:
    """``persist gc --grace nan`` died with a bare ValueError, printing nothing."""
    url, blob, s, c, _w, _r = _live(tmp_path, 1)
    c.close()
    s.close()
    res = CliRunner().invoke(
        persist_main, ["--stash", url, "--blob", blob, "gc", "sh", "--grace", grace]
    )
    assert res.exit_code == 1, res.output
    message = res.output
    assert "grace_" in message and "must be a finite number" in message


def test_handles_opened_before_a_drop_say_the_shard_was_dropped() -> None:
    """After ``finalize_shard``, old handles said their lease expired (readers, listens)
    or lost an upper race to ``{}`` (writers); they now say the shard was dropped."""
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off")
    w, r = c.open("sh", KS, VS)
    w.compare_and_append([_row("a", 1, 0)], 0, 1)
    listen = r.listen(0)
    other = PersistClient(s, c.raw_blob, compaction="off")  # the same blob store
    other.finalize_shard("sh")
    with pytest.raises(InvalidUsage, match="was finalized"):
        r.snapshot(0)
    with pytest.raises(InvalidUsage, match="was finalized"):
        w.compare_and_append([_row("b", 1, 1)], 1, 2)
    with pytest.raises(InvalidUsage, match="was finalized"):
        listen.poll()
    other.close()
    c.close()
    s.close()
