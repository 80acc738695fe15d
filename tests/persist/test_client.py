"""The public handles of persist (``persist/__init__.py``): PersistClient, WriteHandle,
ReadHandle, Batch."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from persist import (
    Batch,
    FileBlob,
    InvalidBatchBounds,
    InvalidBounds,
    InvalidRewrite,
    InvalidUsage,
    LeaseExpired,
    MemoryBlob,
    PersistClient,
    PersistError,
    SinceViolation,
    UpdateBeyondUpper,
    UpdateNotBeyondLower,
    UpperMismatch,
)
from stash import Antichain, Stash

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


def ac(t: int) -> Antichain:
    return Antichain.from_elem(t)


def rows(table: pa.Table) -> list[tuple[str, int, int, int]]:
    return [(r["k"], r["v"], r["_time"], r["_diff"]) for r in table.to_pylist()]


def upd(k: str, v: int, t: int, d: int = 1) -> tuple[tuple[tuple[str], tuple[int]], int, int]:
    return ((k,), (v,)), t, d


@pytest.fixture
def stash() -> Iterator[Stash]:
    s = Stash.open("memory://", fenced=False)
    yield s
    s.close()


@pytest.fixture
def client(stash: Stash) -> Iterator[PersistClient]:
    c = PersistClient(stash, MemoryBlob(), compaction="inline")
    yield c
    c.close()


def test_append_snapshot_and_retractions(client: PersistClient) -> None:
    w, r = client.open("orders", KS, VS)
    assert w.upper == ac(0) and r.since == ac(0)
    w.compare_and_append([upd("a", 1, 0), upd("b", 2, 0), upd("a", 1, 0)], ac(0), ac(1))
    w.compare_and_append([upd("a", 1, 1, -2), upd("c", 3, 2)], ac(1), ac(3))
    assert w.upper == ac(3) and w.fetch_recent_upper() == ac(3)
    assert rows(r.snapshot(0)) == [("a", 1, 0, 2), ("b", 2, 0, 1)]
    assert rows(r.snapshot(1)) == [("b", 2, 1, 1)]  # a summed to zero: absent
    assert rows(r.snapshot(ac(2))) == [("b", 2, 2, 1), ("c", 3, 2, 1)]
    snap = r.snapshot(2)
    assert snap.schema.names == ["k", "v", "_time", "_diff"]


def test_updates_as_arrow_tables(client: PersistClient) -> None:
    w, r = client.open("t", KS, VS)
    table = pa.table(
        {
            "_diff": pa.array([1, 1], pa.int64()),
            "k": ["x", "y"],
            "v": pa.array([1, 2], pa.int32()),  # safely widened
            "_time": pa.array([5, 6], pa.int64()),
        }
    )
    w.compare_and_append(table, ac(0), ac(7))
    w.compare_and_append(table.to_batches()[0].slice(0, 0), ac(7), ac(8))
    assert rows(r.snapshot(7)) == [("x", 1, 7, 1), ("y", 2, 7, 1)]


def test_upper_mismatch_commits_nothing(client: PersistClient) -> None:
    w, r = client.open("orders", KS, VS)
    w.compare_and_append([upd("a", 1, 0)], 0, 1)
    sets = client.raw_blob.metrics.snapshot().sets
    with pytest.raises(UpperMismatch) as e:
        w.compare_and_append([upd("b", 1, 0)], ac(0), ac(5))
    assert e.value.expected == ac(0) and e.value.current == ac(1)
    assert w.upper == ac(1)
    assert rows(r.snapshot(0)) == [("a", 1, 0, 1)]
    # An empty append only checks the upper.
    with pytest.raises(UpperMismatch):
        w.compare_and_append([], ac(3), ac(3))
    w.compare_and_append([], ac(1), ac(1))
    assert client.raw_blob.metrics.snapshot().sets == sets


def test_time_checks(client: PersistClient) -> None:
    w, _ = client.open("orders", KS, VS)
    w.compare_and_append([], 0, 5)
    with pytest.raises(UpdateNotBeyondLower) as e1:
        w.compare_and_append([upd("a", 1, 4)], ac(5), ac(9))
    assert e1.value.time == 4 and e1.value.lower == ac(5)
    with pytest.raises(UpdateBeyondUpper) as e2:
        w.compare_and_append([upd("a", 1, 9)], ac(5), ac(9))
    assert e2.value.time == 9
    with pytest.raises(InvalidBounds):
        w.compare_and_append([], ac(9), ac(5))
    with pytest.raises(UpdateBeyondUpper):
        w.compare_and_append([upd("a", 1, 5)], ac(5), Antichain.from_elem(5))
    with pytest.raises(InvalidUsage, match="columns"):
        w.compare_and_append(pa.table({"k": ["a"]}), ac(5), ac(6))
    assert w.fetch_recent_upper() == ac(5)
    w.append([upd("a", 1, 5)], ac(5), ac(6))
    assert w.upper == ac(6)


def test_snapshot_bounds_and_wait(client: PersistClient) -> None:
    w, r = client.open("orders", KS, VS)
    w.compare_and_append([upd("a", 1, 0)], 0, 3)
    with pytest.raises(InvalidUsage, match="not before its upper"):
        r.snapshot(3)
    r.downgrade_since(2)
    assert r.since == ac(2) and r.shard_since() == ac(2)
    with pytest.raises(SinceViolation) as e:
        r.snapshot(1)
    assert e.value.as_of == 1 and e.value.since == ac(2)
    assert rows(r.snapshot(2)) == [("a", 1, 2, 1)]

    def later() -> None:
        time.sleep(0.05)
        w.compare_and_append([upd("b", 1, 4)], 3, 5)

    t = threading.Thread(target=later)
    t.start()
    assert rows(r.snapshot(4, wait=True, timeout=10)) == [("a", 1, 4, 1), ("b", 1, 4, 1)]
    t.join()
    with pytest.raises(TimeoutError):
        r.snapshot(10, wait=True, timeout=0.05)


def test_reopen_with_other_schemas_fails_naming_both(client: PersistClient) -> None:
    client.open("orders", KS, VS)
    w2, _ = client.open("orders", KS, VS)  # same schemas: fine
    other = pa.schema([("v", pa.string())])
    with pytest.raises(InvalidUsage) as e:
        client.open("orders", KS, other)
    msg = str(e.value)
    assert "v: int64" in msg and "v: string" in msg and "orders" in msg
    with pytest.raises(InvalidUsage, match="shard name"):
        client.open("../etc", KS, VS)
    with pytest.raises(InvalidUsage, match="reserved"):
        client.open("x", pa.schema([("_time", pa.int64())]), VS)
    assert set(client.shards()) == {"orders"}
    assert w2.shard_id == client.shard_id("orders")


def test_reopen_from_another_client_sees_the_data(stash: Stash, tmp_path: Path) -> None:
    blob = FileBlob(tmp_path / "blob")
    c1 = PersistClient(stash, blob, compaction="off", inline_max_bytes=0)
    w, _ = c1.open("orders", KS, VS)
    w.compare_and_append([upd("a", 1, 0), upd("b", 2, 1)], 0, 2)
    assert blob.metrics.sets >= 1  # not inline: a real file
    c1.close()
    c2 = PersistClient(stash, f"file://{tmp_path}/blob", compaction="off")
    _, r = c2.open("orders", KS, VS)
    assert rows(r.snapshot(1)) == [("a", 1, 1, 1), ("b", 2, 1, 1)]
    c2.close()


def test_one_row_appends_are_inline(client: PersistClient) -> None:
    w, r = client.open("orders", KS, VS)  # creating it writes the store's identity
    before = client.raw_blob.metrics.snapshot()
    for t in range(20):
        w.compare_and_append([upd(f"k{t}", t, t)], t, t + 1)
    m = client.raw_blob.metrics.snapshot()
    assert m.sets == before.sets and m.gets == before.gets
    assert r.snapshot(19).num_rows == 20
    st = client.inspect("orders")
    assert st.inline_bytes() > 0 and st.blob_bytes() == 0


def test_inline_budget_spills_to_blob(stash: Stash) -> None:
    c = PersistClient(stash, MemoryBlob(), compaction="off", inline_total_max_bytes=3000)
    w, r = c.open("orders", KS, VS)
    n = 60  # one compressed inline part is a few hundred bytes: the budget runs out
    for t in range(n):
        w.compare_and_append([upd(f"k{t}", t, t)], t, t + 1)
        assert c.inspect("orders").inline_bytes() < 3000 + 4096
    assert c.raw_blob.metrics.sets > 0
    assert r.snapshot(n - 1).num_rows == n
    c.close()


def test_builder_runs_and_transmittable_batches(stash: Stash) -> None:
    c = PersistClient(stash, MemoryBlob(), compaction="off", target_part_bytes=1)
    w, r = c.open("orders", KS, VS)
    b = w.builder(ac(0))
    b.add([upd("z", 1, 0), upd("y", 1, 1)])
    b.add(pa.table({"k": ["a"], "v": [1], "_time": [2], "_diff": [1]}))
    with pytest.raises(UpdateNotBeyondLower):
        b.add([upd("q", 1, -1)])
    batch = b.finish(ac(3))
    assert batch.len == 3 and len(batch.hollow.runs) >= 1
    data = batch.into_transmittable()
    assert batch.consumed
    with pytest.raises(InvalidUsage):
        batch.into_transmittable()
    batch2 = w.batch_from_transmittable(data)
    w.compare_and_append_batch([batch2], ac(0), ac(3))
    assert batch2.consumed
    assert rows(r.snapshot(2)) == [("a", 1, 2, 1), ("y", 1, 2, 1), ("z", 1, 2, 1)]
    with pytest.raises(InvalidUsage, match="already"):
        w.compare_and_append_batch([batch2], ac(3), ac(4))
    batch2.delete()  # consumed: deletes nothing
    assert rows(r.snapshot(2)) == [("a", 1, 2, 1), ("y", 1, 2, 1), ("z", 1, 2, 1)]
    with pytest.raises(InvalidUsage, match="transmittable"):
        w.batch_from_transmittable(b"nope")
    _, other = c.open("other", KS, VS)
    w_other = c.open_writer("other", KS, VS)
    b3 = w.batch([upd("a", 1, 3)], 3, 4)
    with pytest.raises(InvalidUsage, match="was written for shard"):
        w_other.batch_from_transmittable(b3.into_transmittable())
    c.close()


def test_builder_finish_checks_upper_and_delete_removes_parts(stash: Stash) -> None:
    c = PersistClient(stash, MemoryBlob(), compaction="off", inline_max_bytes=0)
    w, _ = c.open("orders", KS, VS)
    b = w.builder(0)
    b.add([upd("a", 1, 5)])
    with pytest.raises(UpdateBeyondUpper):
        b.finish(5)
    with pytest.raises(InvalidBounds):
        w.builder(5).finish(4)
    batch = w.batch([upd("a", 1, 1)], 0, 2)
    keys = batch.blob_keys()
    assert keys and all(c.raw_blob.get(k) is not None for k in keys)
    batch.delete()
    assert all(c.raw_blob.get(k) is None for k in keys)
    c.close()


def test_compare_and_append_batch_bounds_and_multiple_batches(client: PersistClient) -> None:
    # Materialize's validate_truncate_batch (src/persist-client/src/batch.rs): every batch
    # must cover [expected, new).
    w, r = client.open("orders", KS, VS)
    b1 = w.batch([upd("a", 1, 0)], 0, 2)
    b2 = w.batch([upd("b", 1, 3)], 2, 4)
    with pytest.raises(InvalidBatchBounds):
        w.compare_and_append_batch([b1, b2], ac(0), ac(3))  # b2 starts after 0
    with pytest.raises(InvalidBatchBounds):
        w.compare_and_append_batch([b1], ac(0), ac(5))  # b1 ends before 5
    assert not b1.consumed and not b2.consumed
    b2.delete()
    b3 = w.batch([upd("b", 1, 1)], 0, 2)
    w.compare_and_append_batch([b1, b3], ac(0), ac(2))
    assert rows(r.snapshot(1)) == [("a", 1, 1, 1), ("b", 1, 1, 1)]


def test_rewrite_ts_is_metadata_only(client: PersistClient) -> None:
    # Materialize's rewrite_ts example (src/persist-client/src/batch.rs): a batch at [0, 1)
    # rewritten to time 2, upper 3.
    w, r = client.open("orders", KS, VS)
    batch = w.batch([upd("foo", 1, 0)], 0, 1)
    batch = w.batch_from_transmittable(batch.into_transmittable())
    sets = client.raw_blob.metrics.snapshot().sets
    batch.rewrite_ts(ac(2), ac(3))
    with pytest.raises(InvalidRewrite):
        batch.rewrite_ts(ac(1), ac(3))  # the frontier regresses
    with pytest.raises(InvalidRewrite):
        batch.rewrite_ts(ac(2), ac(2))  # upper regresses
    with pytest.raises(InvalidRewrite):
        batch.rewrite_ts(ac(5), ac(5))  # frontier not before the upper
    with pytest.raises(InvalidRewrite):
        batch.rewrite_ts(Antichain(), ac(9))
    with client.open_reader("orders", KS, VS).listen(0) as listen:
        w.compare_and_append_batch([batch], ac(0), ac(3))
        events = []
        for ev in listen:
            events.append(ev)
            if ev.kind == "progress" and ev.progress == ac(3):
                break
    ups = [rows(e.updates) for e in events if e.kind == "updates"]
    assert ups == [[("foo", 1, 2, 1)]]
    assert client.raw_blob.metrics.snapshot().sets == sets
    assert rows(r.snapshot(2)) == [("foo", 1, 2, 1)]
    assert r.snapshot(1).num_rows == 0  # nothing before the rewrite frontier


def test_rewrite_with_different_frontiers_in_one_append(stash: Stash) -> None:
    c = PersistClient(stash, MemoryBlob(), compaction="off", inline_max_bytes=0)
    w, r = c.open("orders", KS, VS)
    b1 = w.batch([upd("a", 1, 0)], 0, 1)
    b2 = w.batch([upd("b", 1, 0), upd("c", 1, 1)], 0, 2)
    b1.rewrite_ts(ac(3), ac(6))
    b2.rewrite_ts(ac(4), ac(6))
    w.compare_and_append_batch([b1, b2], ac(0), ac(6))
    assert rows(r.snapshot(3)) == [("a", 1, 3, 1)]
    assert rows(r.snapshot(5)) == [("a", 1, 5, 1), ("b", 1, 5, 1), ("c", 1, 5, 1)]
    assert rows(r.snapshot(4)) == [("a", 1, 4, 1), ("b", 1, 4, 1), ("c", 1, 4, 1)]
    c.close()


def test_listen_emits_each_update_once(client: PersistClient) -> None:
    w, r = client.open("orders", KS, VS)
    w.compare_and_append([upd("a", 1, 0), upd("b", 1, 1)], 0, 2)
    listen = r.listen(0)
    got: list[tuple[str, int, int, int]] = []
    progress: list[Antichain] = []

    def drain() -> None:
        for ev in listen.poll():
            if ev.kind == "updates":
                got.extend(rows(ev.updates))
            else:
                progress.append(ev.progress)

    drain()
    assert got == [("b", 1, 1, 1)] and progress == [ac(2)]
    assert listen.poll() == []
    w.compare_and_append([upd("c", 1, 2), upd("b", 1, 3, -1)], 2, 4)
    w.compare_and_append([], 4, 5)
    drain()
    assert got == [("b", 1, 1, 1), ("b", 1, 3, -1), ("c", 1, 2, 1)]  # sorted by key
    assert progress == [ac(2), ac(5)]  # one poll sees both appends: one progress
    # Closing the shard (upper {}) ends the listen.
    w.compare_and_append([upd("d", 1, 7)], ac(5), Antichain())
    drain()
    assert progress[-1] == Antichain() and got[-1] == ("d", 1, 7, 1)
    assert list(listen) == []
    with pytest.raises(SinceViolation):
        r.downgrade_since(5)
        r.listen(1)


def test_listen_blocks_until_new_data(client: PersistClient) -> None:
    w, r = client.open("orders", KS, VS)
    with r.listen(0) as listen:

        def later() -> None:
            time.sleep(0.05)
            w.compare_and_append([upd("a", 1, 0)], 0, 1)
            w.compare_and_append([upd("x", 1, 1)], 1, 2)

        t = threading.Thread(target=later)
        t.start()
        it = iter(listen)
        first = next(it)
        while first.kind != "updates":
            first = next(it)
        assert rows(first.updates) == [("x", 1, 1, 1)]
        t.join()
        assert listen.frontier <= ac(2)


def test_since_never_passes_a_live_reader(stash: Stash) -> None:
    now = [1000.0]
    c = PersistClient(
        stash, MemoryBlob(), compaction="inline", clock=lambda: now[0], reader_lease_seconds=10
    )
    w, r1 = c.open("orders", KS, VS)
    r2 = c.open_reader("orders", KS, VS)
    for t in range(6):
        w.compare_and_append([upd("a", t, t)], t, t + 1)
    r1.downgrade_since(5)
    assert c.inspect("orders").since == ac(0)  # r2 holds 0
    r2.downgrade_since(3)
    assert c.inspect("orders").since == ac(3)
    assert r2.snapshot(3).num_rows == 4
    # r2 stops heartbeating; r1 keeps going: r2 is expired and the since moves on.
    now[0] += 8
    r1.heartbeat()
    now[0] += 8
    r1.downgrade_since(5)
    st = c.inspect("orders")
    assert st.since == ac(5) and r2.reader_id not in st.readers
    with pytest.raises(LeaseExpired):
        r2.downgrade_since(6)
    r1.expire()
    with pytest.raises(InvalidUsage, match="expired"):
        r1.snapshot(5)
    c.close()


def test_handles_as_context_managers(client: PersistClient) -> None:
    w, r = client.open("orders", KS, VS)
    with w, r:
        w.compare_and_append([upd("a", 1, 0)], 0, 1)
    st = client.inspect("orders")
    assert w.writer_id not in st.writers and r.reader_id not in st.readers
    with pytest.raises(InvalidUsage):
        w.compare_and_append([], 1, 2)


def test_closed_client_refuses_to_open(stash: Stash) -> None:
    c = PersistClient(stash, "memory://", compaction="background")
    c.close()
    c.close()
    with pytest.raises(InvalidUsage, match="closed"):
        c.open("orders", KS, VS)
    with pytest.raises(InvalidUsage, match="compaction"):
        PersistClient(stash, "memory://", compaction="sometimes")  # type: ignore[arg-type]


def test_batch_repr_and_bounds(client: PersistClient) -> None:
    w, _ = client.open("orders", KS, VS)
    b = w.batch([upd("a", 1, 1)], 1, 3)
    assert isinstance(b, Batch) and b.lower == ac(1) and b.upper == ac(3)
    assert "rows=1" in repr(b)


def test_readonly_stash_reads_but_never_writes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/stash.db"
    blob = f"file://{tmp_path}/blob"
    Stash.open(url, fenced=False).close()  # create the database
    with Stash.open(url, mode="readonly", fenced=False) as ro:
        c = PersistClient(ro, blob, compaction="off")
        assert c.shards() == {}
        with pytest.raises(InvalidUsage, match="no shard named 'orders'"):
            c.inspect("orders")
        c.close()
    with Stash.open(url, fenced=False) as rw:
        c = PersistClient(rw, blob, compaction="off")
        w, _ = c.open("orders", KS, VS)
        w.compare_and_append([upd("a", 1, 0)], 0, 1)
        c.close()
    with Stash.open(url, mode="readonly", fenced=False) as ro:
        c = PersistClient(ro, blob, compaction="off")
        st = c.inspect("orders")
        assert st.upper == ac(1) and set(c.shards()) == {"orders"}
        with pytest.raises(PersistError):
            c.open("orders", KS, VS)  # registering a reader needs a write
        c.close()
