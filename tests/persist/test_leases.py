"""A listen that lost its lease fails for good; listens and
``snapshot(wait=True)`` keep their lease alive with a background heartbeat
(:class:`persist.lease.LeaseKeeper`, clock and interval injected: no duration is
asserted); times are validated before any lease is taken."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pytest

from persist import InvalidUsage, LeaseExpired, MemoryBlob, PersistClient, SinceViolation
from persist.lease import LeaseKeeper
from stash import Antichain, Stash
from tests.support.clock import Clock

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])
LEASE = 10.0  # seconds of the fake clock


def ac(t: int) -> Antichain:
    return Antichain.from_elem(t)


def upd(k: str, v: int, t: int, d: int = 1) -> Any:
    return ((k,), (v,)), t, d


@pytest.fixture
def env() -> Iterator[tuple[Clock, PersistClient, PersistClient]]:
    """A fake clock and two clients (processes) sharing one stash and blob."""
    s = Stash.open("memory://", fenced=False)
    blob = MemoryBlob()
    clock = Clock(1_000_000.0)
    kw: dict[str, Any] = {"compaction": "inline", "reader_lease_seconds": LEASE, "clock": clock}
    c1 = PersistClient(s, blob, **kw)
    c2 = PersistClient(s, blob, **kw)
    yield clock, c1, c2
    c1.close()
    c2.close()
    s.close()


def _wait_until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def test_expired_listen_fails_for_good_and_emits_nothing(env: Any) -> None:
    clock, c1, c2 = env
    w, r = c1.open("t", KS, VS)
    r.lease_keeper = LeaseKeeper(clock=clock, thread=False)  # beats only when told
    w2, r2 = c2.open("t", KS, VS)
    w.compare_and_append([upd("a", 1, 0)], 0, 1)
    listen = r.listen(0, hold_interval_seconds=0)
    listen.poll()
    w.compare_and_append([upd("b", 1, 1)], 1, 3)
    clock.now += 2 * LEASE  # no heartbeat: every lease of c1 ran out
    r2.downgrade_since(2)  # another process drops them and moves the since past 1
    w2.compare_and_append([upd("c", 1, 3)], 3, 5)
    with pytest.raises(LeaseExpired):
        listen.poll()
    for _ in range(2):  # ...and stays failed: nothing queued is replayed
        with pytest.raises(LeaseExpired):
            listen.poll()
    with pytest.raises(LeaseExpired):
        next(listen)


def test_listen_heartbeat_keeps_the_lease(env: Any) -> None:
    clock, c1, c2 = env
    w, r = c1.open("t", KS, VS)
    keeper = LeaseKeeper(clock=clock, thread=False)
    r.lease_keeper = keeper
    w2, r2 = c2.open("t", KS, VS)
    listen = r.listen(0, heartbeat_seconds=LEASE / 4)
    r.expire()  # only the listen's own lease holds the since now
    w.compare_and_append([upd("a", 1, 0)], 0, 1)
    w.compare_and_append([upd("b", 1, 1)], 1, 2)
    for _ in range(8):  # 4 leases pass without a poll; the keeper beats
        clock.now += LEASE / 2
        assert keeper.run_due() == 1
        r2.downgrade_since(0)  # c2's applies drop expired leases
    assert listen.reader_id in c2.inspect("t").readers
    w2.compare_and_append([upd("c", 1, 2)], 2, 3)
    got = [
        (row["k"], row["_time"])
        for e in listen.poll()
        if e.updates
        for row in e.updates.to_pylist()
    ]
    assert sorted(got) == [("b", 1), ("c", 2)]
    listen.close()
    assert keeper.registered() == 0  # stopped on close


def test_listen_heartbeat_runs_in_a_daemon_thread(env: Any) -> None:
    clock, c1, _c2 = env
    _w, r = c1.open("t", KS, VS)
    keeper = LeaseKeeper()  # real thread, real monotonic clock
    r.lease_keeper = keeper
    listen = r.listen(0, heartbeat_seconds=0.01)
    beats = c1.inspect("t").readers[listen.reader_id].last_heartbeat_ms
    clock.now += 1
    _wait_until(
        lambda: c1.inspect("t").readers[listen.reader_id].last_heartbeat_ms > beats,
        "a background heartbeat",
    )
    listen.close()
    assert keeper.registered() == 0


def test_snapshot_wait_keeps_its_lease_and_reports_a_lost_one(env: Any) -> None:
    clock, c1, c2 = env
    w, r = c1.open("t", KS, VS)
    r.lease_keeper = LeaseKeeper()
    r.heartbeat_seconds = 0.01
    w2, r2 = c2.open("t", KS, VS)
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(r.snapshot(3, wait=True, timeout=60)))
    t.start()
    for _ in range(4):  # several leases pass while it waits
        before = c1.inspect("t").readers[r.reader_id].last_heartbeat_ms
        clock.now += LEASE / 2
        _wait_until(
            lambda b=before: c2.inspect("t").readers[r.reader_id].last_heartbeat_ms > b,
            "a heartbeat while waiting",
        )
        r2.downgrade_since(0)  # drops expired leases
    w2.compare_and_append([upd("a", 1, 2)], 0, 4)
    t.join(60)
    assert [row["k"] for row in out[0].to_pylist()] == ["a"]

    # A reader whose lease is lost while it waits says so (not SinceViolation).
    r3 = c1.open_reader("t", KS, VS)
    r3.lease_keeper = LeaseKeeper(clock=clock, thread=False)  # never beats
    clock.now += 2 * LEASE
    r2.downgrade_since(6)  # r3 (and r) dropped; the since passes 5
    with pytest.raises(LeaseExpired, match="lease"):
        r3.snapshot(5, wait=True, timeout=5)
    with pytest.raises(SinceViolation):
        r2.snapshot(5, wait=True, timeout=5)  # a live reader: a real since violation


def test_listen_at_the_largest_time_is_refused_before_any_lease(env: Any) -> None:
    _clock, c1, _c2 = env
    _w, r = c1.open("t", KS, VS)
    readers = set(c1.inspect("t").readers)
    for as_of in (2**63 - 1, 2**63, -(2**63) - 1):
        with pytest.raises(InvalidUsage, match="as_of"):
            r.listen(as_of)
    with pytest.raises(InvalidUsage, match="since"):
        r.downgrade_since(2**63)
    with pytest.raises(InvalidUsage, match="as_of"):
        r.snapshot(2**64, wait=True)
    assert set(c1.inspect("t").readers) == readers  # no lease was taken (or leaked)


def test_a_dropped_listen_stops_renewing_its_lease(env: Any) -> None:
    clock, c1, _c2 = env
    _w, r = c1.open("t", KS, VS)
    keeper = LeaseKeeper(clock=clock, thread=False)
    r.lease_keeper = keeper
    listen = r.listen(0)
    del listen  # never closed
    gc.collect()
    clock.now += LEASE
    keeper.run_due()
    assert keeper.registered() == 0


def test_read_functions_check_their_times(env: Any) -> None:
    import numpy as np

    from persist import read_batches
    from persist.fetch import snapshot_table

    _clock, c1, _c2 = env
    w, r = c1.open("t", KS, VS)
    w.compare_and_append([upd("a", 1, 0)], 0, 1)
    batches = r.snapshot_batches(0)
    with pytest.raises(InvalidUsage, match="upper"):
        read_batches(c1.blob, batches, r.schema, upper=2**63)
    with pytest.raises(InvalidUsage, match="lower"):
        read_batches(c1.blob, batches, r.schema, lower=1.5)  # type: ignore[arg-type]
    assert read_batches(c1.blob, batches, r.schema, upper=np.int64(1)).num_rows == 1
    with pytest.raises(InvalidUsage, match="as_of"):
        snapshot_table(c1.blob, batches, r.schema, ["k"], ["v"], 2**63)
