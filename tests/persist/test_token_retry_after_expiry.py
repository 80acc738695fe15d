"""Protects: a retry with the idempotency token of an append that landed never
writes it again, after other appends or past the writer's lease.

The attack: ``compare_and_append`` retried with the idempotency token of an
indeterminate append that in fact landed.

Contract (persist/write.py module docstring): "If the outcome still cannot
be learned, a ConsensusError with is_indeterminate() and idempotency_token is raised ...
a retry passing that token returns success without writing again if the append
landed"; and tests/persist/test_idempotency.py shows the caller's retry pattern: same
rows with the token, possibly at a fresh upper the caller re-read.  The token is only
remembered among a writer's last WRITER_TOKENS_KEPT appends, and only while the writer
is registered: past either, the retry writes the rows a second time.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow as pa
import pytest

from persist import ConsensusError, MemoryBlob, PersistClient, UpperMismatch
from stash import Stash
from tests.support.clock import Clock
from tests.support.stash_faults import AckLostStash

pytestmark = pytest.mark.adversarial

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


def upd(k: str, v: int, t: int) -> Any:
    return ((k,), (v,)), t, 1


def contents(table: pa.Table) -> Counter[tuple[str, int]]:
    out: Counter[tuple[str, int]] = Counter()
    for r in table.to_pylist():
        out[(r["k"], r["v"])] += r["_diff"]
    return out


def _landed_but_unknown(flaky: AckLostStash, w: Any) -> str:
    """The append of ("a", 1) at [0, 1) commits; its outcome stays unknown."""
    w.resolve_attempts = 2
    w.resolve_max_wait = 0.001
    w.heartbeat()
    flaky.arm(reads=50)
    with pytest.raises(ConsensusError) as e:
        w.compare_and_append([upd("a", 1, 0)], 0, 1)
    assert e.value.is_indeterminate()
    flaky.reads_to_fail = 0
    token = e.value.idempotency_token
    assert token
    return token


def _retry(w: Any, token: str) -> None:
    """The caller's retry: with the token; on UpperMismatch, at the fresh upper."""
    try:
        w.compare_and_append([upd("a", 1, 0)], 0, 1, idempotency_token=token)
    except UpperMismatch as e:
        up = e.current.as_option()
        w.compare_and_append([upd("a", 1, up)], up, up + 1, idempotency_token=token)


def test_token_retry_after_other_appends_of_the_same_writer_duplicates() -> None:
    """A WriteHandle shared by threads: while one thread sorts out its unknown outcome,
    others append through the same handle (8 appends)."""
    inner = Stash.open("memory://", fenced=False)
    flaky = AckLostStash(inner)
    c = PersistClient(flaky, MemoryBlob(), compaction="off", consensus_retries=1)  # type: ignore[arg-type]
    w, r = c.open("s", KS, VS)
    token = _landed_but_unknown(flaky, w)
    for t in range(1, 9):
        w.compare_and_append([upd(f"other{t}", t, t)], t, t + 1)
    _retry(w, token)
    up = w.fetch_recent_upper().as_option()
    got = contents(r.snapshot(up - 1))
    assert got[("a", 1)] == 1, f"the landed append was written again: {got[('a', 1)]} copies"
    c.close()


def test_token_retry_after_the_writer_lease_ran_out_duplicates() -> None:
    """The process that got the unknown outcome retries after a pause longer than the
    writer lease, through a new handle (as test_idempotency does for batches)."""
    clock = Clock()
    inner = Stash.open("memory://", fenced=False)
    flaky = AckLostStash(inner)
    c = PersistClient(
        flaky,  # type: ignore[arg-type]
        MemoryBlob(),
        compaction="off",
        consensus_retries=1,
        writer_lease_seconds=60,
        clock=clock,
    )
    w, r = c.open("s", KS, VS)
    token = _landed_but_unknown(flaky, w)
    clock.now += 3600
    r.heartbeat()  # any state change drops expired leases
    w2 = c.open_writer("s", KS, VS)
    _retry(w2, token)
    up = w2.fetch_recent_upper().as_option()
    got = contents(r.snapshot(up - 1))
    assert got[("a", 1)] == 1, f"the landed append was written again: {got[('a', 1)]} copies"
    c.close()


def test_token_retry_after_the_writer_left_the_state_is_answered_landed() -> None:
    """The writer leaves the state (its lease runs out, dropped by another client's
    transition) before this client sees any head after the unknown outcome: the
    shard's own record of the token (persist/landed.py) still answers the retry, which
    writes nothing again (it raised an indeterminate error while the record lived with
    the writer)."""
    clock = Clock()
    inner = Stash.open("memory://", fenced=False)
    flaky = AckLostStash(inner)
    c = PersistClient(
        flaky,  # type: ignore[arg-type]
        MemoryBlob(),
        compaction="off",
        consensus_retries=1,
        writer_lease_seconds=60,
        clock=clock,
    )
    other = PersistClient(inner, c.blob, compaction="off", writer_lease_seconds=60, clock=clock)
    w, r = c.open("s", KS, VS)
    token = _landed_but_unknown(flaky, w)
    clock.now += 3600
    w_other, r_other = other.open("s", KS, VS)  # its transition drops the expired writer
    w_other.compare_and_append([upd("z", 9, 1)], 1, 2)
    w2 = c.open_writer("s", KS, VS)
    _retry(w2, token)
    got = contents(r_other.snapshot(1))
    assert got[("a", 1)] == 1, got
    other.close()
    c.close()


def test_a_callers_own_hex_token_is_used_as_given() -> None:
    """A caller's own token (a uuid's hex, not persist's form): the first attempt writes,
    a retry of the landed append writes nothing again."""
    import uuid

    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off")
    w, r = c.open("s", KS, VS)
    tok = uuid.uuid4().hex
    w.compare_and_append([upd("a", 1, 0)], 0, 1, idempotency_token=tok)
    w.compare_and_append([upd("a", 1, 0)], 0, 1, idempotency_token=tok)
    assert contents(r.snapshot(0)) == Counter({("a", 1): 1})
    c.close()
