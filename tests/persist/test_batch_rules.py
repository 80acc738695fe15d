"""The batch builder's exception safety and run extension, the batch-bound rules of
``compare_and_append_batch`` (``validate_truncate_batch`` in Materialize's
``src/persist-client/src/batch.rs``), ``rewrite_ts`` keeping the lower, listen progress at
``as_of`` and ``downgrade_since`` to an earlier frontier."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persist import (
    BlobError,
    InvalidBatchBounds,
    InvalidRewrite,
    MemoryBlob,
    PersistClient,
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


class FailingBlob(MemoryBlob):
    """A MemoryBlob whose ``set`` fails while ``failing`` is true."""

    failing = False

    def set(self, key: str, value: bytes) -> None:
        if self.failing:
            raise BlobError(f"injected failure of set {key!r}")
        super().set(key, value)


@pytest.fixture
def stash() -> Iterator[Stash]:
    s = Stash.open("memory://", fenced=False)
    yield s
    s.close()


# ------------------------------------------------------------- builder (item 2)
def test_failed_add_keeps_rows_accepted_before(stash: Stash) -> None:
    blob = FailingBlob()
    c = PersistClient(
        stash, blob, compaction="off", inline_max_bytes=0, target_part_bytes=4000, blob_retries=1
    )
    w, r = c.open("t", KS, VS)
    b = w.builder(0)
    b.add([upd("accepted", 1, 0)])  # buffered: below the target part size
    big = [upd(f"big{i:04d}", i, 1) for i in range(400)]
    blob.failing = True
    with pytest.raises(BlobError):
        b.add(big)  # fills the buffer: the flush fails
    blob.failing = False
    b.add([upd("later", 2, 1)])
    batch = b.finish(2)
    w.compare_and_append_batch([batch], ac(0), ac(2))
    assert rows(r.snapshot(1)) == [("accepted", 1, 1, 1), ("later", 2, 1, 1)]
    c.close()


def test_failed_finish_can_be_retried_without_losing_rows(stash: Stash) -> None:
    blob = FailingBlob()
    c = PersistClient(stash, blob, compaction="off", inline_max_bytes=0, blob_retries=1)
    w, r = c.open("t", KS, VS)
    b = w.builder(0)
    b.add([upd("a", 1, 0), upd("b", 1, 0)])
    blob.failing = True
    with pytest.raises(BlobError):
        b.finish(1)
    blob.failing = False
    batch = b.finish(1)
    w.compare_and_append_batch([batch], ac(0), ac(1))
    assert rows(r.snapshot(0)) == [("a", 1, 0, 1), ("b", 1, 0, 1)]
    c.close()


def test_builder_extends_run_when_chunks_arrive_in_order(stash: Stash) -> None:
    c = PersistClient(stash, MemoryBlob(), compaction="off", target_part_bytes=1)
    w, r = c.open("t", KS, VS)
    b = w.builder(0)
    for k in ("a", "b", "c"):
        b.add([upd(k, 1, 0)])  # each add is flushed (target 1 byte), in order
    batch = b.finish(1)
    assert len(batch.hollow.parts) == 3
    assert batch.hollow.runs == ()  # one run
    # Out of order, or the same (key, value, time) again: a new run.
    b2 = w.builder(1)
    b2.add([upd("b", 1, 1)])
    b2.add([upd("a", 1, 1)])
    b2.add([upd("a", 1, 1)])
    b2.add([upd("c", 1, 1)])
    batch2 = b2.finish(2)
    assert batch2.hollow.runs == (1, 2)
    w.compare_and_append_batch([batch], ac(0), ac(1))
    w.compare_and_append_batch([batch2], ac(1), ac(2))
    assert rows(r.snapshot(1)) == [("a", 1, 1, 3), ("b", 1, 1, 2), ("c", 1, 1, 2)]
    c.close()


# --------------------------------------- batch bounds (Materialize's validate_truncate_batch)
def test_batch_must_cover_the_append_and_is_truncated_to_it(stash: Stash) -> None:
    c = PersistClient(stash, MemoryBlob(), compaction="inline", inline_max_bytes=0)
    w, r = c.open("t", KS, VS)
    w.compare_and_append([], 0, 6)
    b = w.batch([upd("a", 1, 6), upd("b", 1, 7), upd("late", 1, 9)], 6, 10)
    with pytest.raises(InvalidBatchBounds):
        w.compare_and_append_batch([b], ac(6), ac(12))  # does not cover [10, 12)
    assert not b.consumed and w.fetch_recent_upper() == ac(6)
    w.compare_and_append_batch([b], ac(6), ac(8))  # covers [6, 8): 9 is truncated away
    assert b.consumed
    w.compare_and_append([upd("c", 1, 8)], 8, 12)
    assert rows(r.snapshot(11)) == [("a", 1, 11, 1), ("b", 1, 11, 1), ("c", 1, 11, 1)]
    c.close()


def test_truncation_below_the_expected_upper_drops_updates(stash: Stash) -> None:
    c = PersistClient(stash, MemoryBlob(), compaction="off")
    w, r = c.open("t", KS, VS)
    b = w.batch([upd("early", 1, 0), upd("mid", 1, 3)], 0, 5)
    w.compare_and_append([upd("x", 1, 0)], 0, 2)
    w.compare_and_append_batch([b], ac(2), ac(5))  # [0, 5) covers [2, 5): 0 truncated
    assert rows(r.snapshot(4)) == [("mid", 1, 4, 1), ("x", 1, 4, 1)]
    # Without time bounds (bytes of an older writer) the truncation is the same.
    b2 = w.batch([upd("old", 1, 4), upd("new", 1, 6)], 4, 8)
    b2.time_range = None
    w.compare_and_append_batch([b2], ac(5), ac(8))
    assert rows(r.snapshot(7)) == [("mid", 1, 7, 1), ("new", 1, 7, 1), ("x", 1, 7, 1)]
    c.close()


def test_rewrite_ts_keeps_lower_and_records_frontier(stash: Stash) -> None:
    c = PersistClient(stash, MemoryBlob(), compaction="off")
    w, r = c.open("t", KS, VS)
    b = w.batch([upd("foo", 1, 0)], 0, 1)
    b.rewrite_ts(ac(2), ac(4))
    assert b.lower == ac(0) and b.upper == ac(4) and b.rewrite_frontier == ac(2)
    b = w.batch_from_transmittable(b.into_transmittable())
    assert b.lower == ac(0) and b.rewrite_frontier == ac(2)
    with pytest.raises(InvalidRewrite):
        w.compare_and_append_batch([b], ac(0), ac(3))  # a rewritten batch ends at new
    w.compare_and_append([], 0, 3)
    with pytest.raises(InvalidRewrite):
        w.compare_and_append_batch([b], ac(3), ac(4))  # means time 2 < expected 3
    assert not b.consumed
    b.rewrite_ts(ac(3), ac(4))
    w.compare_and_append_batch([b], ac(3), ac(4))
    assert rows(r.snapshot(3)) == [("foo", 1, 3, 1)]
    c.close()


def test_listen_emits_progress_as_soon_as_upper_passes_as_of(stash: Stash) -> None:
    c = PersistClient(stash, MemoryBlob(), compaction="off")
    w, r = c.open("t", KS, VS)
    w.compare_and_append([upd("a", 1, 0)], 0, 1)
    with r.listen(0) as listen:
        assert [(e.kind, e.progress) for e in listen.poll()] == [("progress", ac(1))]
        assert listen.poll() == []
    with r.listen(5) as listen:
        assert listen.poll() == []  # upper 1 has not passed 5
        w.compare_and_append([upd("b", 1, 5)], 1, 6)
        assert [(e.kind, e.progress) for e in listen.poll()] == [("progress", ac(6))]
        w.compare_and_append([upd("c", 1, 6)], 6, 7)
        ev = listen.poll()
        assert [e.kind for e in ev] == ["updates", "progress"]
        assert ev[0].updates is not None and rows(ev[0].updates) == [("c", 1, 6, 1)]
    c.close()


def test_downgrade_since_to_an_earlier_frontier_is_a_noop(stash: Stash) -> None:
    c = PersistClient(stash, MemoryBlob(), compaction="off")
    w, r = c.open("t", KS, VS)
    w.compare_and_append([upd("a", 1, 0)], 0, 5)
    r.downgrade_since(3)
    r.downgrade_since(1)
    assert r.since == ac(3)
    c.close()


@settings(max_examples=25, deadline=None)
@given(
    times=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    bounds=st.tuples(st.integers(0, 10), st.integers(0, 10)),
    known=st.booleans(),
)
def test_truncation_keeps_exactly_the_updates_in_the_append(
    times: list[int], bounds: tuple[int, int], known: bool
) -> None:
    e, n = min(bounds), max(bounds)
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off", inline_max_bytes=0)
    w, r = c.open("t", KS, VS)
    b = w.batch([upd(f"k{i}", t, t) for i, t in enumerate(times)], 0, 10)
    if not known:
        b.time_range = None  # as from an older writer's bytes
    if e > 0:
        w.compare_and_append([], 0, e)
    w.compare_and_append_batch([b], ac(e), ac(n))
    w.compare_and_append([], n, 11)
    want = sorted((f"k{i}", t, 10, 1) for i, t in enumerate(times) if e <= t < n)
    assert rows(r.snapshot(10)) == want
    c.close()
    s.close()
