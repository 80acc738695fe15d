"""Transactions from several threads on one ``PersistClient`` (with its background
compactor) neither deadlock nor lose a write: every thread's transactions commit, each
one visible in all its shards at its commit time.  The lock order this checks is the
one :mod:`persist.txn` documents (shard machines in shard-id order, then the client's
transaction bookkeeping lock, which calls out to nothing)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest

from persist import PersistClient
from stash import Stash

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])
SHARDS = ("t0", "t1", "t2")
THREADS, TXNS = 4, 15


@pytest.mark.timeout(200)
def test_threads_sharing_a_client_commit_transactions_without_deadlock(tmp_path: Path) -> None:
    s = Stash.open(f"sqlite:///{tmp_path}/stash.db", fenced=False)
    c = PersistClient(s, f"file://{tmp_path}/blob", compaction="background")
    for name in SHARDS:
        c.open(name, KS, VS)
    acks: dict[str, tuple[tuple[str, ...], int]] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(who: int) -> None:
        try:
            for i in range(TXNS):
                pair = (SHARDS[(who + i) % 3], SHARDS[(who + i + 1) % 3])
                tid = f"th{who}-{i}"
                txn = c.begin()
                for name in pair:
                    txn.write(name, pa.table({"k": [tid], "v": [who]}))
                ts = txn.commit()
                with lock:
                    acks[tid] = (pair, ts)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(THREADS)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 150
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = [t.name for t in threads if t.is_alive()]
        assert not hung, f"threads {hung} still running: a deadlock"
        assert not errors, errors
        assert len(acks) == THREADS * TXNS
        # Each shard at its latest time: every transaction's row exactly once, in the
        # shards it wrote only.
        snap = c.snapshot_many({n: c.inspect(n).upper.as_option() - 1 for n in SHARDS})
        seen = {n: {r["k"]: r["_diff"] for r in snap[n].to_pylist()} for n in SHARDS}
        for tid, (pair, ts) in acks.items():
            for n in SHARDS:
                assert seen[n].get(tid) == (1 if n in pair else None), (tid, n)
            # Visible in both its shards at its commit time, in neither before it.
            at = c.snapshot_many(dict.fromkeys(pair, ts))
            assert all(tid in at[n].column("k").to_pylist() for n in pair), tid
            if ts > 0:  # (the shards' since is 0)
                before = c.snapshot_many(dict.fromkeys(pair, ts - 1))
                assert all(tid not in before[n].column("k").to_pylist() for n in pair), tid
    finally:
        if not any(t.is_alive() for t in threads):
            c.close()
            s.close()
