"""Protects: lease renewal, hand-off and its count-down decide on committed state.

The attack: ``renew_writers``, ``hand_off`` and ``settle_handed_off`` ran on the
process's cached state, and a command that changes nothing publishes nothing, so no
compare-and-set ever caught the stale read:

* a process holding another process's batch (decoded from its bytes, as a Spark driver
  holds its tasks' batches) whose cache predates that writer's registration found the
  writer "gone": the renewal stopped silently, and GC deleted the batch's parts;
* a writer's handle ending after a receiver renewed its lease saw itself "expired" in
  its own cache: no hand-off was recorded, and GC deleted a batch still in transit;
* deleting a decoded batch, in a process whose cache predates the writer, did not count
  the hand-off down: the writer stayed registered for the whole hand-off lease.

Contract (persist/write.py, persist/gc.py): a held or handed-off batch stays appendable;
a writer gone is found gone on a freshly read version only.  Clocks are injected; a
keeper with no thread runs the renewals when told.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from persist import MemoryBlob, PersistClient, collect_garbage, fsck
from persist.lease import LeaseKeeper
from stash import Stash
from tests.persist.test_held_batch_leases import HOUR, KS, LEASE, VS, stash, upd
from tests.persist.test_held_batch_leases import client as held_client
from tests.support.clock import Clock

__all__ = ["KS", "VS", "stash", "upd"]  # the shared setup, re-used here


def client(stash: Stash, blob: Any, clock: Clock, **kw: Any) -> PersistClient:
    """The held-batch tests' client, its readers leased for ten hours."""
    kw.setdefault("reader_lease_seconds", 10 * HOUR)
    return held_client(stash, blob, clock, **kw)


def rows(t: pa.Table) -> list[tuple[int, str, int]]:
    return sorted(zip(t["k"].to_pylist(), t["v"].to_pylist(), t["_diff"].to_pylist(), strict=True))


def pass_time(
    clock: Clock, gc_client: PersistClient, shard: str, leases: int, keeper: Any = None
) -> None:
    """``leases`` writer leases in steps of a sixth of one (the keeper's renewals run
    at each step), GC (grace: one lease) after each lease."""
    for step in range(leases * 6):
        clock.now += LEASE / 6
        if keeper is not None:
            keeper.run_due()
        if step % 6 == 5:
            collect_garbage(gc_client, shard, grace_seconds=LEASE)


def test_a_held_batch_is_renewed_when_the_holders_cache_predates_its_writer(
    stash: Stash,
) -> None:
    clock, blob = Clock(), MemoryBlob()
    driver = client(stash, blob, clock)
    executor = client(stash, blob, clock)
    gc_client = client(stash, blob, clock)
    w, r = driver.open("held", KS, VS)  # the driver's cache: no writer of the task yet
    task = executor.open_writer("held", KS, VS)
    data = task.batch([upd(1, "a")], 0, 1).into_transmittable()
    executor.close()  # the task is gone; its writer was lent out, so not unregistered
    keeper = w.lease_keeper = LeaseKeeper(clock=clock, thread=False)
    batch = w.batch_from_transmittable(data)
    pass_time(clock, gc_client, "held", 6, keeper)
    assert keeper.registered() == 1, "the renewal stopped"
    r.heartbeat()
    w.compare_and_append_batch([batch], 0, 1)
    assert rows(r.snapshot(0)) == [(1, "a", 1)]
    assert fsck(driver, "held").ok


def test_a_hand_off_sees_the_lease_a_receiver_renewed(stash: Stash) -> None:
    clock, blob = Clock(), MemoryBlob()
    executor = client(stash, blob, clock)
    driver = client(stash, blob, clock)
    gc_client = client(stash, blob, clock)
    task = executor.open_writer("moving", KS, VS)
    d1 = task.batch([upd(1, "a")], 0, 1).into_transmittable()
    d2 = task.batch([upd(2, "b", 1)], 0, 2).into_transmittable()  # still in transit
    w, r = driver.open("moving", KS, VS)
    keeper = w.lease_keeper = LeaseKeeper(clock=clock, thread=False)
    b1 = w.batch_from_transmittable(d1)
    pass_time(clock, gc_client, "moving", 2, keeper)  # the driver renews the task's lease
    task.expire()  # the task's own cache shows its lease run out
    assert task.writer_id in executor.inspect("moving").writers  # handed off
    w.compare_and_append_batch([b1], 0, 1)
    pass_time(clock, gc_client, "moving", 4)  # no one renews the bytes in transit
    w2 = driver.open_writer("moving", KS, VS)  # a later job of the driver
    w2.compare_and_append_batch([w2.batch_from_transmittable(d2)], 1, 2)
    assert rows(r.snapshot(1)) == [(1, "a", 1), (2, "b", 1)]
    assert fsck(driver, "moving").ok


def test_deleting_a_decoded_batch_counts_the_hand_off_down(stash: Stash) -> None:
    clock, blob = Clock(), MemoryBlob()
    executor = client(stash, blob, clock)
    driver = client(stash, blob, clock)
    w, _r = driver.open("dropped", KS, VS)  # the driver's cache predates the task
    with executor.open_writer("dropped", KS, VS) as task:
        data = task.batch([upd(1, "a")], 0, 1).into_transmittable()
        wid = task.writer_id
    assert wid in executor.inspect("dropped").writers  # handed off: one outstanding
    w.batch_from_transmittable(data).delete()
    assert wid not in driver.inspect("dropped").writers
