"""A written batch stays appendable however long it is held: whoever holds it (the
writer that built it, or the process that decoded its transmittable bytes) renews the
leases of its parts' writers in the background, so GC never deletes them (the
persist-client idea that the holder of a batch keeps its writer's lease).  Clocks are
injected: the keeper's beats run only when told, while the shard's clock passes several
leases and GC grace periods."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from persist import (
    LeaseExpired,
    MemoryBlob,
    PartsMissing,
    PersistClient,
    collect_garbage,
    fsck,
)
from persist.lease import LeaseKeeper
from stash import Antichain, Stash
from tests.support.clock import Clock

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])
HOUR = 3600.0
LEASE = 600.0  # the writers' lease (s)


@pytest.fixture
def stash() -> Iterator[Stash]:
    s = Stash.open("memory://", fenced=False)
    yield s
    s.close()


def client(stash: Stash, blob: Any, clock: Clock, **kw: Any) -> PersistClient:
    kw.setdefault("compaction", "off")
    kw.setdefault("inline_max_bytes", 0)
    kw.setdefault("writer_lease_seconds", LEASE)
    kw.setdefault("reader_lease_seconds", 3 * HOUR)
    return PersistClient(stash, blob, clock=clock, **kw)


def upd(k: int, v: str, t: int = 0) -> Any:
    return ((k,), (v,)), t, 1


def pass_time(clock: Clock, keeper: LeaseKeeper, gc_client: PersistClient, shard: str) -> None:
    """Two hours (12 writer leases) in steps of a sixth of a lease, GC (grace: one
    lease) every hour."""
    for step in range(72):
        clock.now += LEASE / 6
        keeper.run_due()
        if step % 36 == 35:
            collect_garbage(gc_client, shard, grace_seconds=LEASE)


def rows(t: pa.Table) -> list[tuple[int, str, int]]:
    return sorted(zip(t["k"].to_pylist(), t["v"].to_pylist(), t["_diff"].to_pylist(), strict=True))


def test_a_batch_held_by_its_writer_outlives_every_lease_and_grace(stash: Stash) -> None:
    clock, blob = Clock(), MemoryBlob()
    c = client(stash, blob, clock)
    gc_client = client(stash, blob, clock, reader_lease_seconds=10 * HOUR)
    w, r = c.open("held", KS, VS)
    keeper = w.lease_keeper = LeaseKeeper(clock=clock, thread=False)
    batch = w.batch([upd(1, "a"), upd(2, "b")], 0, 1)
    assert keeper.registered() == 1
    pass_time(clock, keeper, gc_client, "held")  # the writer itself does nothing
    r.heartbeat()
    w.compare_and_append_batch([batch], 0, 1)
    assert rows(r.snapshot(0)) == [(1, "a", 1), (2, "b", 1)]
    assert fsck(c, "held").ok
    assert keeper.registered() == 0  # appended: the renewal stopped


def test_a_batch_decoded_from_bytes_keeps_the_sending_writer_alive(stash: Stash) -> None:
    """As the Spark jobs do: an executor's writer writes a batch and hands its bytes to
    the driver, which holds it (e.g. between the transactions of a load) for hours."""
    clock, blob = Clock(), MemoryBlob()
    executor = client(stash, blob, clock)
    driver = client(stash, blob, clock)
    gc_client = client(stash, blob, clock, reader_lease_seconds=10 * HOUR)
    task = executor.open_writer("spark", KS, VS)
    data = task.batch([upd(1, "a")], 0, 1).into_transmittable()
    executor.close()  # the task is gone; its writer was lent out, so not unregistered
    w, r = driver.open("spark", KS, VS)
    keeper = w.lease_keeper = LeaseKeeper(clock=clock, thread=False)
    batch = w.batch_from_transmittable(data)
    assert keeper.registered() == 1
    pass_time(clock, keeper, gc_client, "spark")
    r.heartbeat()
    w.heartbeat()
    w.compare_and_append_batch([batch], 0, 1)
    assert rows(r.snapshot(0)) == [(1, "a", 1)]
    assert fsck(driver, "spark").ok


def test_a_builder_holding_parts_keeps_its_writer_alive(stash: Stash) -> None:
    clock, blob = Clock(), MemoryBlob()
    c = client(stash, blob, clock, target_part_bytes=1)  # every add is written at once
    gc_client = client(stash, blob, clock, reader_lease_seconds=10 * HOUR)
    w, r = c.open("building", KS, VS)
    keeper = w.lease_keeper = LeaseKeeper(clock=clock, thread=False)
    b = w.builder(0)
    b.add([upd(1, "a")])
    assert keeper.registered() == 1
    pass_time(clock, keeper, gc_client, "building")
    b.add([upd(2, "b")])
    batch = b.finish(1)
    assert keeper.registered() == 1  # the batch holds the parts now, not the builder
    r.heartbeat()
    w.compare_and_append_batch([batch], 0, 1)
    assert rows(r.snapshot(0)) == [(1, "a", 1), (2, "b", 1)]
    assert fsck(c, "building").ok


def test_a_writer_already_gone_is_never_brought_back(stash: Stash) -> None:
    """If the holder could not renew in time (its process paused past the lease), the
    writer's parts may be gone: the renewal stops and the append is refused, committing
    nothing."""
    clock, blob = Clock(), MemoryBlob()
    c = client(stash, blob, clock)
    w, r = c.open("paused", KS, VS)
    keeper = w.lease_keeper = LeaseKeeper(clock=clock, thread=False)
    batch = w.batch([upd(1, "a")], 0, 1)
    clock.now += 2 * LEASE  # no beat ran meanwhile
    r.heartbeat()  # a transition drops the expired writer
    assert w.writer_id not in c.inspect("paused").writers
    keeper.run_due()
    assert keeper.registered() == 0
    assert w.writer_id not in c.inspect("paused").writers
    with pytest.raises(LeaseExpired):
        w.compare_and_append_batch([batch], 0, 1)
    assert c.inspect("paused").upper == Antichain.from_elem(0)


@pytest.mark.parametrize("how", ["append", "delete", "transmit", "drop", "abort"])
def test_the_renewal_stops_when_the_batch_is_let_go(stash: Stash, how: str) -> None:
    clock, blob = Clock(), MemoryBlob()
    c = client(stash, blob, clock, target_part_bytes=1)
    w, _r = c.open("let-go", KS, VS)
    keeper = w.lease_keeper = LeaseKeeper(clock=clock, thread=False)
    b = w.builder(0)
    b.add([upd(1, "a")])
    if how == "abort":
        b.abort()
    else:
        batch = b.finish(1)
        assert keeper.registered() == 1
        if how == "append":
            w.compare_and_append_batch([batch], 0, 1)
        elif how == "delete":
            batch.delete()
        elif how == "transmit":
            batch.into_transmittable()
        else:
            del batch
            gc.collect()
    del b
    gc.collect()
    assert keeper.registered() == 0


def test_the_renewal_stops_when_the_client_closes(stash: Stash) -> None:
    clock, blob = Clock(), MemoryBlob()
    c = client(stash, blob, clock)
    w, _r = c.open("closing", KS, VS)
    keeper = w.lease_keeper = LeaseKeeper(clock=clock, thread=False)
    batch = w.batch([upd(1, "a")], 0, 1)
    c.close()
    clock.now += LEASE
    keeper.run_due()
    assert keeper.registered() == 0
    assert not batch.consumed


# ------------------------------------------------------------- hand-off of a writer
def _transmit(executor: PersistClient, shard: str, *batches: list[Any]) -> list[bytes]:
    """As a Spark task does: write each batch, hand its bytes out, end the handle."""
    with executor.open_writer(shard, KS, VS) as task:
        out = [task.batch(b, 0, 1).into_transmittable() for b in batches]
        task_id = task.writer_id
    assert task_id in executor.inspect(shard).writers  # handed off, not unregistered
    return out


def pass_hours(clock: Clock, gc_client: PersistClient, shard: str, hours: int) -> None:
    """``hours`` hours in steps of a sixth of a writer lease, with no one renewing
    anything (the batches are bytes in transit), GC (grace: one lease) every hour."""
    for step in range(hours * 36):
        clock.now += LEASE / 6
        if step % 36 == 35:
            collect_garbage(gc_client, shard, grace_seconds=LEASE)


def test_bytes_in_transit_outlive_their_writers_lease_until_the_hand_off_lease(
    stash: Stash,
) -> None:
    """A task's batch bytes wait hours for the job's commit while no process holds a
    Batch: the task's writer, handed off when its handle ended, keeps the parts from GC
    for the hand-off lease, and the driver appends them after 12 writer leases."""
    clock, blob = Clock(), MemoryBlob()
    executor = client(stash, blob, clock, handoff_lease_seconds=3 * HOUR)
    driver = client(stash, blob, clock)
    gc_client = client(stash, blob, clock, reader_lease_seconds=10 * HOUR)
    w, r = driver.open("transit", KS, VS)
    (data,) = _transmit(executor, "transit", [upd(1, "a"), upd(2, "b")])
    pass_hours(clock, gc_client, "transit", 2)
    r.heartbeat()
    w.heartbeat()
    w.compare_and_append_batch([w.batch_from_transmittable(data)], 0, 1)
    assert rows(r.snapshot(0)) == [(1, "a", 1), (2, "b", 1)]
    assert fsck(driver, "transit").ok
    # All its batches appended: the handed-off writer is gone at once.
    assert set(driver.inspect("transit").writers) == {w.writer_id}


def test_bytes_in_transit_past_the_hand_off_lease_are_refused_cleanly(stash: Stash) -> None:
    clock, blob = Clock(), MemoryBlob()
    executor = client(stash, blob, clock, handoff_lease_seconds=HOUR)
    driver = client(stash, blob, clock)
    gc_client = client(stash, blob, clock, reader_lease_seconds=10 * HOUR)
    w, r = driver.open("late", KS, VS)
    (data,) = _transmit(executor, "late", [upd(1, "a")])
    pass_hours(clock, gc_client, "late", 3)
    r.heartbeat()
    w.heartbeat()
    batch = w.batch_from_transmittable(data)
    with pytest.raises((LeaseExpired, PartsMissing)):
        w.compare_and_append_batch([batch], 0, 1)
    assert driver.inspect("late").upper == Antichain.from_elem(0)  # nothing committed


def _handed_off(
    stash: Stash, shard: str, *batches: list[Any]
) -> tuple[MemoryBlob, PersistClient, Any, Any, list[bytes], str]:
    """A driver's handles on ``shard`` and the bytes of ``batches`` an executor's task
    wrote and handed off: ``(blob, driver, write, read, payloads, task writer id)``."""
    clock, blob = Clock(), MemoryBlob()
    executor = client(stash, blob, clock)
    driver = client(stash, blob, clock)
    w, r = driver.open(shard, KS, VS)
    payloads = _transmit(executor, shard, *batches)
    (task,) = set(driver.inspect(shard).writers) - {w.writer_id}
    return blob, driver, w, r, payloads, task


def test_a_handed_off_writer_is_dropped_once_every_batch_is_appended(stash: Stash) -> None:
    _blob, driver, w, r, (first, second), task = _handed_off(
        stash, "two", [upd(1, "a")], [upd(2, "b")]
    )
    assert driver.inspect("two").writers[task].outstanding == 2
    w.compare_and_append_batch([w.batch_from_transmittable(first)], 0, 1)
    assert driver.inspect("two").writers[task].outstanding == 1
    b2 = w.batch_from_transmittable(second)
    b2.rewrite_ts(Antichain.from_elem(1), Antichain.from_elem(2))
    w.compare_and_append_batch([b2], 1, 2)
    assert task not in driver.inspect("two").writers
    assert rows(r.snapshot(1)) == [(1, "a", 1), (2, "b", 1)]


def test_a_transaction_counts_down_the_hand_off_too(stash: Stash) -> None:
    _blob, driver, w, r, (data,), task = _handed_off(stash, "txn", [upd(1, "a")])
    with driver.begin() as txn:
        txn.write_batches(w, [w.batch_from_transmittable(data)])
        ts = txn.commit()
    assert task not in driver.inspect("txn").writers
    assert rows(r.snapshot(ts)) == [(1, "a", 1)]


def test_a_writer_whose_builders_were_aborted_is_unregistered_not_handed_off(
    stash: Stash,
) -> None:
    clock, blob = Clock(), MemoryBlob()
    c = client(stash, blob, clock, target_part_bytes=1)  # every add is written at once
    w, _r = c.open("aborted", KS, VS)
    b = w.builder(0)
    b.add([upd(1, "a")])
    b.abort()
    b.abort()  # idempotent
    assert w.writer_id in c.inspect("aborted").writers  # registered by the upload
    w.expire()
    assert w.writer_id not in c.inspect("aborted").writers


@pytest.mark.parametrize("appended", [False, True])
def test_abort_after_finish_leaves_the_batch_alone(stash: Stash, appended: bool) -> None:
    """A finished builder's parts belong to its batch: a late ``abort`` (e.g. in a
    ``finally``) must not delete them, before or after the batch is appended."""
    clock, blob = Clock(), MemoryBlob()
    c = client(stash, blob, clock)
    w, r = c.open("late-abort", KS, VS)
    b = w.builder(0)
    b.add([upd(1, "a")])
    batch = b.finish(1)
    if appended:
        w.compare_and_append_batch([batch], 0, 1)
        b.abort()
    else:
        b.abort()
        w.compare_and_append_batch([batch], 0, 1)
    assert rows(r.snapshot(0)) == [(1, "a", 1)]
    assert fsck(c, "late-abort").ok


def test_a_batch_still_held_when_its_writer_is_handed_off_stays_appendable(
    stash: Stash,
) -> None:
    """A handle transmits one batch and still holds another when it ends: the hand-off
    counts both, so appending the transmitted one does not drop the writer under the
    one still held (whose hold keeps renewing it)."""
    clock, blob = Clock(), MemoryBlob()
    executor = client(stash, blob, clock)
    driver = client(stash, blob, clock)
    gc_client = client(stash, blob, clock, reader_lease_seconds=10 * HOUR)
    w, r = driver.open("mixed", KS, VS)
    task = executor.open_writer("mixed", KS, VS)
    keeper = task.lease_keeper = LeaseKeeper(clock=clock, thread=False)
    sent = task.batch([upd(1, "a")], 0, 1).into_transmittable()
    held = task.batch([upd(2, "b", 1)], 1, 2)
    task.expire()
    assert driver.inspect("mixed").writers[task.writer_id].outstanding == 2
    w.compare_and_append_batch([w.batch_from_transmittable(sent)], 0, 1)
    assert driver.inspect("mixed").writers[task.writer_id].outstanding == 1
    pass_time(clock, keeper, gc_client, "mixed")
    r.heartbeat()
    w2 = driver.open_writer("mixed", KS, VS)  # w's own lease ran out meanwhile
    w2.compare_and_append_batch([held], 1, 2)
    assert task.writer_id not in driver.inspect("mixed").writers
    assert rows(r.snapshot(1)) == [(1, "a", 1), (2, "b", 1)]
    assert fsck(driver, "mixed").ok


def test_deleting_a_decoded_batch_settles_the_hand_off(stash: Stash) -> None:
    """A job that fails deletes its tasks' batches instead of appending them: the
    handed-off writer is dropped then, so GC may collect anything it left at once."""
    blob, driver, w, _r, (data,), task = _handed_off(stash, "failed-job", [upd(1, "a")])
    batch = w.batch_from_transmittable(data)
    keys = batch.blob_keys()
    batch.delete()
    assert task not in driver.inspect("failed-job").writers
    assert not set(keys) & {k for k, _ in blob.list_keys("")}
