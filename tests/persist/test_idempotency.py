"""An unknown commit outcome never duplicates data nor reports a race
that was the append's own success.  The fault injected: the COMMIT lands, its
acknowledgement is lost, and the re-reads that follow fail too."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow as pa
import pytest

from persist import ConsensusError, InvalidUsage, MemoryBlob, PersistClient, WriteHandle
from stash import Antichain, Stash
from tests.support.stash_faults import AckLostStash

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


def ac(t: int) -> Antichain:
    return Antichain.from_elem(t)


def upd(k: str, v: int, t: int, d: int = 1) -> Any:
    return ((k,), (v,)), t, d


def contents(table: pa.Table) -> Counter[tuple[str, int, int]]:
    out: Counter[tuple[str, int, int]] = Counter()
    for r in table.to_pylist():
        out[(r["k"], r["v"], r["_time"])] += r["_diff"]
    return out


@pytest.fixture
def setup() -> Any:
    inner = Stash.open("memory://", fenced=False)
    flaky = AckLostStash(inner)
    blob = MemoryBlob()
    c = PersistClient(
        flaky,  # type: ignore[arg-type]
        blob,
        compaction="off",
        consensus_retries=1,
        inline_max_bytes=0,
    )
    w, r = c.open("idem", KS, VS)
    w.resolve_max_wait = 0.001
    yield flaky, blob, c, w, r
    c.close()
    inner.close()


def test_lost_ack_with_failing_rereads_is_resolved_by_the_append(setup: Any) -> None:
    flaky, _blob, _c, w, r = setup
    w.compare_and_append([upd("a", 1, 0)], 0, 1)
    flaky.arm(reads=3)  # fewer failing reads than the append's resolve attempts
    w.compare_and_append([upd("b", 1, 1)], 1, 2)  # landed: reported as success
    assert flaky.lost_acks == 1
    assert w.fetch_recent_upper() == ac(2)
    assert contents(r.snapshot(1)) == Counter({("a", 1, 1): 1, ("b", 1, 1): 1})


def test_unresolved_outcome_carries_a_token_that_keeps_the_retry_idempotent(
    setup: Any,
) -> None:
    flaky, blob, _c, w, r = setup
    w.resolve_attempts = 2
    w.heartbeat()  # registered: the lost acknowledgement is the append's own commit
    flaky.arm(reads=50)  # consensus stays unreadable longer than the append tries
    with pytest.raises(ConsensusError) as e:
        w.compare_and_append([upd("a", 1, 0)], 0, 1)
    assert e.value.is_indeterminate()
    token = e.value.idempotency_token
    assert token
    flaky.reads_to_fail = 0  # consensus is back
    sets = blob.metrics.snapshot().sets
    # Retried as the caller would: same rows and bounds, and the token.
    w.compare_and_append([upd("a", 1, 0)], 0, 1, idempotency_token=token)
    # ...or with a fresh upper (the caller re-read it): another append (a token names
    # its bounds too), refused, so still not written twice.
    with pytest.raises(InvalidUsage, match="names a different append"):
        w.compare_and_append([upd("a", 1, 1)], 1, 2, idempotency_token=token)
    assert blob.metrics.snapshot().sets == sets  # nothing uploaded again
    assert w.fetch_recent_upper() == ac(1)
    assert contents(r.snapshot(0)) == Counter({("a", 1, 0): 1})


def test_token_of_a_landed_batch_append_still_known_after_later_appends(setup: Any) -> None:
    flaky, _blob, c, w, r = setup
    w.resolve_attempts = 1
    batch = w.batch([upd("x", 1, 0)], 0, 1)
    flaky.arm(reads=50)
    with pytest.raises(ConsensusError) as e:
        w.compare_and_append_batch([batch], ac(0), ac(1))
    token = e.value.idempotency_token
    assert e.value.is_indeterminate() and token and not batch.consumed
    flaky.reads_to_fail = 0
    w.compare_and_append([upd("y", 1, 1)], 1, 2)  # the same writer appends again
    other = c.open_writer("idem", KS, VS)  # a retry may come from another handle
    assert isinstance(other, WriteHandle)
    other.compare_and_append_batch([batch], ac(0), ac(1), idempotency_token=token)
    assert batch.consumed
    assert contents(r.snapshot(1)) == Counter({("x", 1, 1): 1, ("y", 1, 1): 1})


def test_bad_token_is_refused(setup: Any) -> None:
    _flaky, _blob, _c, w, _r = setup
    with pytest.raises(InvalidUsage, match="idempotency_token"):
        w.compare_and_append([upd("a", 1, 0)], 0, 1, idempotency_token="x")
    assert w.fetch_recent_upper() == ac(0)


def test_lost_ack_of_the_writers_registration_is_resolved_or_carries_the_token(
    setup: Any,
) -> None:
    """A writer registers before its first upload; that commit's acknowledgement can be
    lost too.  It is re-applied until known (registration is idempotent), and when it
    cannot be known the append's error still carries a token that keeps a retry
    idempotent."""
    flaky, _blob, _c, w, r = setup
    flaky.arm(reads=2)  # fewer failing reads than the resolve attempts: resolved
    w.compare_and_append([upd("a", 1, 0)], 0, 1)
    assert flaky.lost_acks == 1
    w2, _ = _c.open("idem2", KS, VS)
    w2.resolve_attempts = 2
    w2.resolve_max_wait = 0.001
    flaky.arm(reads=50)  # the new writer's registration stays unknown
    with pytest.raises(ConsensusError) as e:
        w2.compare_and_append([upd("b", 1, 0)], 0, 1)
    assert e.value.is_indeterminate() and e.value.idempotency_token
    flaky.reads_to_fail = 0
    w2.compare_and_append([upd("b", 1, 0)], 0, 1, idempotency_token=e.value.idempotency_token)
    with pytest.raises(InvalidUsage, match="names a different append"):  # other bounds
        w2.compare_and_append([upd("b", 1, 1)], 1, 2, idempotency_token=e.value.idempotency_token)
    assert contents(r.snapshot(0)) == Counter({("a", 1, 0): 1})
    _, r2 = _c.open("idem2", KS, VS)
    assert contents(r2.snapshot(0)) == Counter({("b", 1, 0): 1})


def test_a_token_names_one_append_and_refuses_another(setup: Any) -> None:
    """Passing the token of a landed append to a *different* append returned success and
    wrote nothing (an acknowledged write that never happened) before the fix.  It is
    refused, naming the rule; the real retry still succeeds."""
    _flaky, _blob, c, w, r = setup
    token = "tok-0123456789"
    w.compare_and_append([upd("a", 1, 0)], 0, 1, idempotency_token=token)
    with pytest.raises(InvalidUsage, match="names a different append"):
        w.compare_and_append([upd("b", 2, 1), upd("c", 3, 1)], 1, 2, idempotency_token=token)
    w2, _ = c.open("idem", KS, VS)  # another handle, someone else's token
    with pytest.raises(InvalidUsage, match="names a different append"):
        w2.compare_and_append([upd("d", 4, 1), upd("e", 5, 1)], 1, 2, idempotency_token=token)
    w.compare_and_append([upd("a", 1, 0)], 0, 1, idempotency_token=token)  # the retry
    assert w.fetch_recent_upper() == ac(1)
    assert contents(r.snapshot(0)) == Counter({("a", 1, 0): 1})
    b = w.batch([upd("f", 6, 1)], 1, 2)
    w.compare_and_append_batch([b], 1, 2, idempotency_token="tok-batch-0001")
    other = w.batch([upd("g", 7, 2)], 2, 3)
    with pytest.raises(InvalidUsage, match="names a different append"):
        w.compare_and_append_batch([other], 2, 3, idempotency_token="tok-batch-0001")
    assert contents(r.snapshot(1)) == Counter({("a", 1, 1): 1, ("f", 6, 1): 1})
