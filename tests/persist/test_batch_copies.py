"""A batch and its copies:
the transmittable bytes of one batch decoded twice, a retry of the same batch after an
unknown commit outcome, and one builder shared by threads.  No acknowledged row is lost
or read twice."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest

from persist import (
    InvalidUsage,
    MemoryBlob,
    PersistClient,
    PersistError,
    UpperMismatch,
    fsck,
)
from stash import Antichain, Stash
from tests.support.clock import Clock
from tests.support.stash_faults import AckLostStash

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])
HOUR = 3600.0


def ac(t: int) -> Antichain:
    return Antichain.from_elem(t)


def upd(k: int, v: str, t: int, d: int = 1) -> Any:
    return ((k,), (v,)), t, d


def rows(t: pa.Table) -> Counter[tuple[int, str, int]]:
    out: Counter[tuple[int, str, int]] = Counter()
    for r in t.to_pylist():
        out[(r["k"], r["v"], r["_time"])] += r["_diff"]
    return +out


@pytest.fixture
def stash() -> Any:
    s = Stash.open("memory://", fenced=False)
    yield s
    s.close()


def mk(stash: Any, blob: Any, clock: Clock, **kw: Any) -> PersistClient:
    kw.setdefault("compaction", "off")
    kw.setdefault("inline_max_bytes", 0)
    kw.setdefault("writer_lease_seconds", 3 * HOUR)
    kw.setdefault("reader_lease_seconds", 3 * HOUR)
    return PersistClient(stash, blob, clock=clock, **kw)


def test_second_copy_of_a_transmitted_batch_keeps_the_parts_of_a_committed_append(
    stash: Stash,
) -> None:
    """A transmittable batch is decoded twice (a driver re-sending a commit message, a
    retried Spark commit).  The first copy is appended truncated to [0, 1); the second,
    appended at [1, 3), is empty after truncation.  It must not delete the parts the
    first, acknowledged append references (it did: ``CorruptPart``, part missing)."""
    clock, blob = Clock(), MemoryBlob()
    c = mk(stash, blob, clock)
    w, r = c.open("f1", KS, VS)
    data = w.batch([upd(1, "a", 0)], 0, 3).into_transmittable()
    w.compare_and_append_batch([w.batch_from_transmittable(data)], 0, 1)
    assert rows(r.snapshot(0)) == Counter({(1, "a", 0): 1})  # acknowledged and readable
    w.compare_and_append_batch([w.batch_from_transmittable(data)], 1, 3)  # empty: no-op
    assert rows(r.snapshot(2)) == Counter({(1, "a", 2): 1})  # still readable, once
    assert fsck(c, "f1").ok


def test_retry_of_an_indeterminate_batch_append_neither_races_nor_loses_it() -> None:
    """``compare_and_append_batch([b], 0, 1)`` lands but its acknowledgement is lost and
    consensus stays unreadable past the append's own resolution: the error is
    indeterminate and ``b`` stays unconsumed.  The caller retries with the same batch and
    no token: it is recognised as landed (the batch remembers its token), neither a lost
    race (``UpperMismatch``) nor a second append.  A further copy at the next range,
    empty after truncation, deletes nothing the landed append references."""
    inner = Stash.open("memory://", fenced=False)
    flaky = AckLostStash(inner)
    c = PersistClient(
        flaky,  # type: ignore[arg-type]
        MemoryBlob(),
        compaction="off",
        consensus_retries=1,
        inline_max_bytes=0,
    )
    w, r = c.open("f1b", KS, VS)
    w.resolve_max_wait = 0.001
    w.resolve_attempts = 2
    w.heartbeat()
    b = w.batch([upd(1, "a", 0)], 0, 3)
    data = b.into_transmittable()
    b = w.batch_from_transmittable(data)
    flaky.arm(reads=50)
    with pytest.raises(PersistError) as e:
        w.compare_and_append_batch([b], 0, 1)
    assert e.value.is_indeterminate()
    assert b.pending_token == e.value.idempotency_token
    flaky.reads_to_fail = 0  # consensus is back
    w.compare_and_append_batch([b], 0, 1)  # no UpperMismatch: its own append landed
    assert b.consumed
    assert rows(r.snapshot(0)) == Counter({(1, "a", 0): 1})
    with pytest.raises(UpperMismatch):  # a real race is still one
        w.compare_and_append_batch([w.batch_from_transmittable(data)], 0, 1)
    w.compare_and_append_batch([w.batch_from_transmittable(data)], 1, 3)
    assert rows(r.snapshot(2)) == Counter({(1, "a", 2): 1})
    c.close()
    inner.close()


def test_one_transmitted_batch_decoded_twice_is_refused_in_one_append(stash: Stash) -> None:
    """Two decodings of the same transmittable bytes (the same parts) in one
    ``compare_and_append_batch`` would append the updates twice: refused, nothing
    committed."""
    clock, blob = Clock(), MemoryBlob()
    c = mk(stash, blob, clock)
    w, r = c.open("f3", KS, VS)
    data = w.batch([upd(1, "a", 0)], 0, 1).into_transmittable()
    b1 = w.batch_from_transmittable(data)
    b2 = w.batch_from_transmittable(data)
    with pytest.raises(InvalidUsage, match="share parts"):
        w.compare_and_append_batch([b1, b2], 0, 1)
    assert c.inspect("f3").upper == ac(0)
    w.compare_and_append_batch([b1], 0, 1)
    assert rows(r.snapshot(0)) == Counter({(1, "a", 0): 1})


def test_batch_builder_shared_by_threads_loses_and_duplicates_rows(stash: Stash) -> None:
    """Three threads ``add`` distinct rows to one BatchBuilder: the finished batch holds
    every accepted row once (it held 86 of 90, one with diff 2, before the builder
    serialized its calls)."""
    clock, blob = Clock(), MemoryBlob()
    c = mk(stash, blob, clock, target_part_bytes=200)
    w, r = c.open("f2", KS, VS)
    b = w.builder(0)
    errs: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(30):
                b.add([upd(i * 1000 + j, "v" * 20, j % 3)])
        except Exception as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errs, errs
    batch = b.finish(3)
    w.compare_and_append_batch([batch], 0, 3)
    expected = Counter({(i * 1000 + j, "v" * 20, 2): 1 for i in range(3) for j in range(30)})
    assert rows(r.snapshot(2)) == expected
