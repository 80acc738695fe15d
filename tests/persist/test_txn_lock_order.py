"""Protects: the lock order of persist/machine.py: no blob I/O under a shard machine's
lock that a thread of the shared pools may need.

The attack: a transaction's row changes (``Txn.update``, ``Txn.delete``, an upsert's
retractions) were planned and uploaded while the commit held the shard's lock.  Written
as two or more parts, the upload ran in pool threads, and the first of them to reach
its upload registered (or renewed) the writer: a command needing that very lock, held
by the committing thread, which waited for the registration.  A deadlock with no other
thread of the caller's involved (a 300k-row ``Txn.update`` hung with default settings).

Here the committing thread's own encodings are slowed down, so that a pool thread is
first to register; a deadlocked commit is seen as a commit thread still running long
after every other one finished (no duration is asserted: it never finishes).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import persist.parts as parts_mod
from persist import MemoryBlob, PersistClient, UpperMismatch
from stash import Stash
from tests.support.clock import Clock

KEY = pa.schema([pa.field("id", pa.int64(), False)])
VAL = pa.schema([pa.field("v", pa.int64())])
ROWS = 20_000
LEASE = 60.0


@pytest.fixture
def slow_caller(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[int]]:
    """Slow down part encodings of the threads whose ids the test adds to the set."""
    slowed: set[int] = set()
    real = parts_mod.encode_part
    gate = threading.Event()

    def encode(*a: Any, **kw: Any) -> Any:
        if threading.get_ident() in slowed:
            gate.wait(0.3)  # let a pool thread reach the upload first
        return real(*a, **kw)

    monkeypatch.setattr(parts_mod, "encode_part", encode)
    yield slowed


def _commit_in_thread(fn: Any, slowed: set[int]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        slowed.add(threading.get_ident())
        try:
            out.append(fn())
        except BaseException as e:  # reported by the test
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


@pytest.mark.parametrize("change", ["update", "delete", "upsert"])
def test_row_changes_written_as_several_parts_do_not_deadlock_the_commit(
    slow_caller: set[int], change: str
) -> None:
    clock = Clock()
    stash = Stash.open("memory://", fenced=False)
    c = PersistClient(
        stash,
        MemoryBlob(),
        compaction="off",
        inline_max_bytes=0,
        target_part_bytes=4096,  # several parts
        write_workers=2,
        writer_lease_seconds=LEASE,
        clock=clock,
    )
    w, r = c.open("s", KEY, VAL)
    ids = pa.array(range(ROWS), pa.int64())
    vals = pa.array([(i * 2654435761) % 1_000_003 for i in range(ROWS)], pa.int64())
    w.compare_and_append(
        pa.table({"id": ids, "v": vals, "_time": [0] * ROWS, "_diff": [1] * ROWS}), 0, 1
    )
    for round_ in range(2):  # the second: the transaction's writer renews its lease
        clock.now += LEASE / 2

        def commit(round_: int = round_) -> int:
            txn = c.begin()
            if change == "update":
                txn.update("s", pc.field("id") >= 0, {"v": pc.field("v") + 1})
            elif change == "delete":
                txn.delete("s", (pc.field("id") < ROWS // 2) if round_ else (pc.field("id") >= 0))
            else:
                rows = pa.table({"id": ids, "v": vals}, schema=pa.schema([*KEY, *VAL]))
                txn.upsert("s", rows)
            return txn.commit()

        t, out = _commit_in_thread(commit, slow_caller)
        t.join(120)
        assert not t.is_alive(), "the commit deadlocked (its thread never finished)"
        assert out and not isinstance(out[0], BaseException), out
    c.close()
    stash.close()


def test_threads_of_one_client_follow_the_lock_order(slow_caller: set[int]) -> None:
    """Threads sharing one client: two commit transactions with row changes over shards
    ``a`` and ``b`` (given in opposite orders), one appends through a handle the others
    share, all with slowed encodings (pool threads register the writers).  Every thread
    finishes, and every increment counts once."""
    stash = Stash.open("memory://", fenced=False)
    c = PersistClient(
        stash,
        MemoryBlob(),
        compaction="off",
        inline_max_bytes=0,
        target_part_bytes=4096,
        write_workers=2,
    )
    n = 4000
    ids = pa.array(range(n), pa.int64())
    for name in ("a", "b"):
        w, _ = c.open(name, KEY, VAL)
        w.compare_and_append(
            pa.table(
                {"id": ids, "v": pa.array([0] * n, pa.int64()), "_time": [0] * n, "_diff": [1] * n}
            ),
            0,
            1,
        )
    shared, _ = c.open("a", KEY, VAL)
    rounds = 2

    def txns(names: tuple[str, str]) -> None:
        slow_caller.add(threading.get_ident())
        for _ in range(rounds):
            txn = c.begin()
            for name in names:
                txn.update(name, pc.field("id") < n // 2, {"v": pc.field("v") + 1})
            txn.commit()

    def appends() -> None:
        for i in range(rounds):
            while True:
                up = shared.fetch_recent_upper().as_option()
                try:
                    shared.compare_and_append([(((n + i,), (0,)), up, 1)], up, up + 1)
                    break
                except UpperMismatch:  # a race with a transaction: append again
                    continue

    errors: list[BaseException] = []

    def guarded(fn: Any, *a: Any) -> Any:
        def run() -> None:
            try:
                fn(*a)
            except BaseException as e:
                errors.append(e)

        return run

    threads = [
        threading.Thread(target=guarded(txns, ("a", "b")), daemon=True),
        threading.Thread(target=guarded(txns, ("b", "a")), daemon=True),
        threading.Thread(target=guarded(appends), daemon=True),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a thread deadlocked"
    assert not errors, errors
    for name in ("a", "b"):
        r = c.open_reader(name, KEY, VAL)
        snap = r.snapshot(r.fetch_recent_upper().as_option() - 1)
        got = pc.sum(pc.multiply(snap["v"], snap["_diff"])).as_py()
        assert got == 2 * rounds * (n // 2), (name, got)
    c.close()
    stash.close()
