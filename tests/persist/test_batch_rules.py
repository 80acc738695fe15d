"""Issue 12 (persist side): the batch builder's exception safety and run extension, the
seed's batch-bound rules for ``compare_and_append_batch`` (``validate_truncate_batch``,
seed ``004``), ``rewrite_ts`` keeping the lower, listen progress at ``as_of`` and
``downgrade_since`` to an earlier frontier."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pytest

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
