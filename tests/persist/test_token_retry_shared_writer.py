"""Protects: a token retry from a WriteHandle shared by threads, or from a new client
after the lease ran out, never writes the rows twice.

The attack: the token settling of commit 597712a ("a retry with the idempotency token of
an append whose outcome was unknown is answered even after its writer appended
again").  The settle assumes no append of the writer happens between the landing of
the indeterminate attempt and ``note_unknown_token``; a WriteHandle shared by threads
breaks that: the machine's lock is released between ``_apply_resolving``'s attempts
and before the note, and another thread's appends push the token out of the writer's
recent tokens.  The note then records a seqno after those appends, the next head
"shows" the writer present without the token, and the token is settled as NOT landed:
the retry writes the rows a second time.  (The records now live in the shard apart
from the writer, persist/landed.py; the hook point is ``note_attempt``.)
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest

from persist import ConsensusError, MemoryBlob, PersistClient, UpperMismatch
from persist.state import WRITER_TOKENS_KEPT
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


def _retry(w: Any, token: str) -> None:
    try:
        w.compare_and_append([upd("a", 1, 0)], 0, 1, idempotency_token=token)
    except UpperMismatch as e:
        up = e.current.as_option()
        w.compare_and_append([upd("a", 1, up)], up, up + 1, idempotency_token=token)


def test_token_pushed_out_by_another_thread_before_the_note_is_settled_as_not_landed() -> None:
    inner = Stash.open("memory://", fenced=False)
    flaky = AckLostStash(inner)
    c = PersistClient(flaky, MemoryBlob(), compaction="off", consensus_retries=1)  # type: ignore[arg-type]
    w, r = c.open("s", KS, VS)
    w.resolve_attempts = 2
    w.resolve_max_wait = 0.001
    w.heartbeat()
    m = w._machine
    orig_note = m.note_attempt

    def other_thread() -> None:
        # Thread B, sharing the handle: appends while thread A sorts out its outcome
        # (the machine's lock is free between A's failed apply and A's note).
        up = w.fetch_recent_upper().as_option()
        for i in range(WRITER_TOKENS_KEPT):
            w.compare_and_append([upd(f"b{i}", i, up + i)], up + i, up + i + 1)

    def note(token: str, lo: int) -> None:
        flaky.reads_to_fail = 0  # the server is back
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        orig_note(token, lo)

    m.note_attempt = note  # type: ignore[method-assign]
    flaky.arm(reads=50)
    with pytest.raises(ConsensusError) as e:
        w.compare_and_append([upd("a", 1, 0)], 0, 1)  # lands at [0, 1); ack lost
    assert e.value.is_indeterminate()
    token = e.value.idempotency_token
    m.note_attempt = orig_note  # type: ignore[method-assign]
    # Later tokens of the writer pushed the token out before the outcome was seen: the
    # retry may answer "landed" or say the outcome cannot be learned, never write again.
    with contextlib.suppress(ConsensusError):
        try:
            _retry(w, token)
        except ConsensusError as err:
            assert err.is_indeterminate() and "cannot be learned" in str(err)
            raise
    up = w.fetch_recent_upper().as_option()
    got = contents(r.snapshot(up - 1))
    assert got[("a", 1)] == 1, f"the landed append was written again: {got[('a', 1)]} copies"
    c.close()


def test_token_retry_from_a_new_client_after_the_lease_ran_out_writes_twice() -> None:
    """The usual retry after an unknown outcome is from a restarted process: a new
    client has no settled tokens, the writer's record left the state with its lease,
    and the retry neither answers nor raises "cannot be learned": it writes again."""
    clock = Clock()
    inner = Stash.open("memory://", fenced=False)
    flaky = AckLostStash(inner)
    blob = MemoryBlob()
    c = PersistClient(
        flaky,
        blob,
        compaction="off",
        consensus_retries=1,  # type: ignore[arg-type]
        writer_lease_seconds=60,
        clock=clock,
    )
    w, r = c.open("s", KS, VS)
    w.resolve_attempts = 2
    w.resolve_max_wait = 0.001
    w.heartbeat()
    flaky.arm(reads=50)
    with pytest.raises(ConsensusError) as e:
        w.compare_and_append([upd("a", 1, 0)], 0, 1)
    assert e.value.is_indeterminate()
    flaky.reads_to_fail = 0
    token = e.value.idempotency_token
    c.close()  # the process dies
    clock.now += 3600
    c2 = PersistClient(inner, blob, compaction="off", writer_lease_seconds=60, clock=clock)
    w2, r2 = c2.open("s", KS, VS)
    r2.heartbeat()  # drops the expired writer
    try:
        _retry(w2, token)
    except ConsensusError as err:  # refusing is acceptable: "cannot be learned"
        assert err.is_indeterminate()
    up = w2.fetch_recent_upper().as_option()
    got = contents(r2.snapshot(up - 1))
    assert got[("a", 1)] == 1, f"the landed append was written again: {got[('a', 1)]} copies"
    c2.close()
