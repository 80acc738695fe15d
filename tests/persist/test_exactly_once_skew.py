"""Protects: exactly once across lease expiry, clock skew, shared handles and restarts.

The attack: the record that an append (or a transaction) landed lived with its writer
(its last 8 tokens, or the transaction's own record writer), so it left the state with
the writer's lease, or was pushed out by 8 appends of other threads through one shared
handle.  A re-read after a lost acknowledgement then found no record and fell through to
the upper check: ``UpperMismatch`` for an append that landed (the caller then appends
again), "not landed" for a transaction (``commit()`` retries at a later time), and an
upper race for a restarted caller's retry with its own token.  Two appends racing with
one caller token and different contents acknowledged the loser, and a batch appended
after its parts were rewritten by truncation could be appended again.

Contract (persist/landed.py, persist/write.py): the shard keeps the record of a landed
token apart from every lease; a retry of an append that landed returns without writing;
an outcome the state can no longer tell is the indeterminate ``ConsensusError``, never
``UpperMismatch``; a token names one append (``InvalidUsage`` otherwise, also when two
appends race); a batch is appended once, also when its parts were rewritten.

Two clients on one stash play two processes; the second one's clock is ahead by more
than every lease.  A lost acknowledgement is :class:`AckLostStash`; "meanwhile" (while
the first process re-applies its command, or backs off between re-reads) is a hook on
the machine's command or on ``time.sleep``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import pytest

from persist import (
    BatchAppended,
    ConsensusError,
    InvalidUsage,
    MemoryBlob,
    PersistClient,
    UpperMismatch,
)
from stash import Antichain, Stash
from tests.support.clock import Clock
from tests.support.stash_faults import AckLostStash

pytestmark = pytest.mark.adversarial

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])
LEASE = 60.0
AHEAD = 10 * 86400.0  # ahead of every lease (writer, reader, hand-off)


def upd(k: str, v: int, t: int) -> Any:
    return ((k,), (v,)), t, 1


def contents(table: pa.Table) -> Counter[tuple[str, int]]:
    out: Counter[tuple[str, int]] = Counter()
    for r in table.to_pylist():
        out[(r["k"], r["v"])] += r["_diff"]
    return +out


class World:
    """Process A (acknowledgements can be lost) and process B, whose clock is ahead."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.inner = Stash.open("memory://", fenced=False)
        self.flaky = AckLostStash(self.inner)
        self.blob = MemoryBlob()
        kw: dict[str, Any] = {
            "compaction": "off",
            "writer_lease_seconds": LEASE,
            "reader_lease_seconds": LEASE,
            "handoff_lease_seconds": LEASE,
        }
        self.a = PersistClient(
            self.flaky,  # type: ignore[arg-type]
            self.blob,
            consensus_retries=1,
            clock=self.clock,
            **kw,
        )
        self.b = PersistClient(self.inner, self.blob, clock=lambda: self.clock() + AHEAD, **kw)

    def skewed_transition(self, name: str) -> None:
        """Any transition of B: it drops every lease of A (B's clock is ahead)."""
        self.b.open_reader(name, KS, VS).expire()

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture
def world() -> Iterator[World]:
    w = World()
    yield w
    w.close()


@pytest.fixture
def meanwhile(monkeypatch: pytest.MonkeyPatch) -> Callable[[Callable[[], None]], None]:
    """``meanwhile(fn)``: run ``fn`` (in another thread, joined) the first time the
    calling thread backs off (sleeps) between re-reads."""
    real = time.sleep

    def install(fn: Callable[[], None]) -> None:
        me = threading.get_ident()
        pending = [fn]

        def sleep(s: float) -> None:
            if pending and threading.get_ident() == me:
                f = pending.pop()
                t = threading.Thread(target=f)
                t.start()
                t.join()
            real(min(s, 0.001))

        monkeypatch.setattr(time, "sleep", sleep)

    return install


def before_retry(w: Any, fn: Callable[[], None]) -> None:
    """Run ``fn`` (in another thread, joined) just before the handle ``w`` applies its
    append's command a second time (its first attempt's outcome was unknown)."""
    m = w._machine
    orig = m.compare_and_append
    me = threading.get_ident()
    calls = [0]

    def wrapped(*args: Any, **kw: Any) -> Any:
        if threading.get_ident() == me:
            calls[0] += 1
            if calls[0] == 2:
                t = threading.Thread(target=fn)
                t.start()
                t.join()
        return orig(*args, **kw)

    m.compare_and_append = wrapped


def _follow_the_docs(w: Any, rows: list[Any], lo: int, hi: int) -> None:
    """An append as the docs say to do it: on UpperMismatch, re-read and append again
    (the upper moved, so nothing of this call landed)."""
    try:
        w.compare_and_append(rows, lo, hi)
    except UpperMismatch as e:
        up = e.current.as_option()
        w.compare_and_append([(kv, up, d) for kv, _t, d in rows], up, up + 1)


# ------------------------------------------------------------------- case 1
def test_a_landed_append_is_not_reported_as_upper_mismatch_after_a_skewed_expiry(
    world: World,
) -> None:
    """The acknowledgement is lost and re-reading fails; meanwhile B (clock ahead)
    drops A's writer.  The append landed: the call returns, the rows are there once."""
    w = world.a.open_writer("s", KS, VS)
    w.heartbeat()
    world.flaky.arm(reads=1)

    before_retry(w, lambda: world.skewed_transition("s"))
    _follow_the_docs(w, [upd("a", 1, 0)], 0, 1)
    r = world.b.open_reader("s", KS, VS)
    up = r.fetch_recent_upper().as_option()
    assert contents(r.snapshot(up - 1)) == Counter({("a", 1): 1})


def test_a_landed_append_is_not_reported_as_upper_mismatch_after_appends_of_other_threads(
    world: World,
) -> None:
    """No skew: while thread A backs off between failing re-reads, thread B appends 8
    times through the same handle (more than the tokens a writer kept)."""
    w = world.a.open_writer("s", KS, VS)
    w.heartbeat()
    world.flaky.arm(reads=1)

    def other_thread() -> None:
        world.flaky.reads_to_fail = 0
        for i in range(1, 9):
            w.compare_and_append([upd(f"b{i}", i, i)], i, i + 1)

    before_retry(w, other_thread)
    _follow_the_docs(w, [upd("a", 1, 0)], 0, 1)
    r = world.b.open_reader("s", KS, VS)
    got = contents(r.snapshot(r.fetch_recent_upper().as_option() - 1))
    assert got[("a", 1)] == 1, f"the landed append was written {got[('a', 1)]} times"


def test_an_outcome_the_state_cannot_tell_is_indeterminate_never_upper_mismatch(
    world: World, monkeypatch: Any
) -> None:
    """With records pruned past the append's first attempt (a tiny kept count), the
    re-read cannot tell: indeterminate, with the token, never UpperMismatch."""
    monkeypatch.setattr("persist.landed.TOKENS_KEPT", 2)
    w = world.a.open_writer("s", KS, VS)
    w.heartbeat()
    world.flaky.arm(reads=1)

    def other_thread() -> None:
        world.flaky.reads_to_fail = 0
        for i in range(1, 5):
            w.compare_and_append([upd(f"b{i}", i, i)], i, i + 1)

    before_retry(w, other_thread)
    with pytest.raises(ConsensusError) as e:
        w.compare_and_append([upd("a", 1, 0)], 0, 1)
    assert e.value.is_indeterminate() and e.value.idempotency_token
    assert not isinstance(e.value, UpperMismatch)
    r = world.b.open_reader("s", KS, VS)
    assert contents(r.snapshot(4))[("a", 1)] == 1


# ------------------------------------------------------------------- case 2
def test_a_transaction_whose_ack_was_lost_is_not_applied_twice_after_a_skewed_expiry(
    world: World, meanwhile: Callable[[Callable[[], None]], None]
) -> None:
    """The commit lands, its acknowledgement is lost and the first re-read fails;
    meanwhile B drops the transaction's record with its lease.  ``commit()`` must see
    that it landed, not retry at a later time."""
    w = world.a.open_writer("s", KS, VS)
    w.compare_and_append([upd("z", 0, 0)], 0, 1)
    w.expire()
    txn = world.a.begin()
    txn.write("s", pa.table({"k": ["a"], "v": [1]}))
    world.flaky.arm(reads=1)
    meanwhile(lambda: world.skewed_transition("s"))
    ts = txn.commit()
    r = world.b.open_reader("s", KS, VS)
    up = r.fetch_recent_upper().as_option()
    assert up == ts + 1
    assert contents(r.snapshot(up - 1)) == Counter({("z", 0): 1, ("a", 1): 1})


# ------------------------------------------------------------------- case 3
@pytest.mark.parametrize("own_token", [False, True])
def test_a_retry_after_a_restart_and_the_lease_ran_out_writes_nothing_again(
    world: World, own_token: bool
) -> None:
    """A restarted process retries with the token the indeterminate error carried
    (persist's, or the caller's own), after the first writer's lease ran out and B
    dropped it: the append landed, so the retry writes nothing."""
    w = world.a.open_writer("s", KS, VS)
    w.resolve_attempts = 2
    w.resolve_max_wait = 0.001
    w.heartbeat()
    world.flaky.arm(reads=50)
    token = "caller-token-0001" if own_token else None
    with pytest.raises(ConsensusError) as e:
        w.compare_and_append([upd("a", 1, 0)], 0, 1, idempotency_token=token)
    assert e.value.is_indeterminate()
    world.flaky.reads_to_fail = 0
    carried = e.value.idempotency_token
    assert carried is not None and (token is None or carried == token)
    world.a.close()  # the process dies
    world.skewed_transition("s")  # the writer's lease ran out
    c2 = PersistClient(world.inner, world.blob, compaction="off", clock=world.clock)
    try:
        w2 = c2.open_writer("s", KS, VS)
        try:
            w2.compare_and_append([upd("a", 1, 0)], 0, 1, idempotency_token=carried)
        except UpperMismatch as um:  # the docs: re-read, append again at the upper
            up = um.current.as_option()
            w2.compare_and_append([upd("a", 1, up)], up, up + 1, idempotency_token=carried)
        r = c2.open_reader("s", KS, VS)
        up = r.fetch_recent_upper().as_option()
        got = contents(r.snapshot(up - 1))
        assert got[("a", 1)] == 1, f"the landed append was written {got[('a', 1)]} times"
    finally:
        c2.close()


def test_a_callers_token_whose_record_may_be_pruned_is_indeterminate_after_a_restart(
    world: World, monkeypatch: Any
) -> None:
    """The same retry once the shard pruned records (a tiny kept count) and the retry
    cannot know when the first attempt was: indeterminate, nothing written, never
    UpperMismatch."""
    monkeypatch.setattr("persist.landed.TOKENS_KEPT", 2)
    w = world.b.open_writer("s", KS, VS)
    for i in range(4):
        w.compare_and_append([upd(f"x{i}", i, i)], i, i + 1)
    c2 = PersistClient(world.inner, world.blob, compaction="off", clock=world.clock)
    try:
        w2 = c2.open_writer("s", KS, VS)
        with pytest.raises(ConsensusError) as e:
            w2.compare_and_append([upd("a", 1, 0)], 0, 1, idempotency_token="caller-token-2")
        assert e.value.is_indeterminate() and not isinstance(e.value, UpperMismatch)
        assert world.b.inspect("s").upper == Antichain.from_elem(4)
    finally:
        c2.close()


# ------------------------------------------------------------------- case 4
def test_a_copy_of_a_batch_whose_parts_were_truncated_is_refused(world: World) -> None:
    """The first append truncated the batch physically (new parts); a second decoding
    of its bytes, rewritten to a later time, must be refused, not counted again."""
    c = PersistClient(world.inner, world.blob, compaction="off", inline_max_bytes=0)
    try:
        w, r = c.open("t", KS, VS)
        w.compare_and_append([upd("z", 0, 0)], 0, 2)
        data = w.batch([upd(f"k{i}", i, i) for i in range(4)], 0, 4).into_transmittable()
        w.compare_and_append_batch([w.batch_from_transmittable(data)], 2, 4)  # truncates
        copy = w.batch_from_transmittable(data)
        copy.rewrite_ts(Antichain.from_elem(4), Antichain.from_elem(5))
        with pytest.raises(BatchAppended):
            w.compare_and_append_batch([copy], 4, 5)
        assert c.inspect("t").upper == Antichain.from_elem(4)
        assert contents(r.snapshot(3)) == Counter({("z", 0): 1, ("k2", 2): 1, ("k3", 3): 1})
    finally:
        c.close()


# ------------------------------------------------------------------- case 5
def test_a_token_reused_with_other_content_is_refused_when_the_appends_race(
    world: World,
) -> None:
    """Two appends race with one caller token and different content: B lands between
    A's check of the token and A's commit.  A must be refused (InvalidUsage), not
    acknowledged for rows it never wrote."""
    wa = world.a.open_writer("s", KS, VS)
    wb = world.a.open_writer("s", KS, VS)
    checked = wa._token_landed

    def racing(token: str, fingerprint: str, *earlier: Any) -> Any:
        out = checked(token, fingerprint, *earlier)
        wb.compare_and_append([upd("b", 2, 0)], 0, 1, idempotency_token="shared-token-1")
        return out

    wa._token_landed = racing  # type: ignore[method-assign]
    with pytest.raises(InvalidUsage, match="different append"):
        wa.compare_and_append([upd("a", 1, 0)], 0, 1, idempotency_token="shared-token-1")
    r = world.b.open_reader("s", KS, VS)
    assert contents(r.snapshot(0)) == Counter({("b", 2): 1})
