"""Lifecycle model: writers, builders and batches held open, readers, GC,
compaction, heartbeats, clock jumps past every grace period and lease, blob outages at
any call (builders flush on every ``add``, so an outage can hit an ``add`` after earlier
ones were accepted), and stash commits whose acknowledgement is lost, against a
reference multiset.

A hypothesis stateful test.  Handles whose lease ran out are replaced by new ones; a
batch of a writer that is no longer live must be refused (``LeaseExpired`` /
``PartsMissing``) with nothing committed; an operation run during a blob outage may fail
but never half-commits.  After every step (blob available): every acknowledged write
reads back exactly (the snapshot equals the reference), and ``persist.fsck`` finds no
damage.  Figures are recorded for ``docs/reliability.md`` (four rows: the whole model,
the batches held across GC passes, the builders under blob outages, and the exactness
cases: idempotency tokens reused at random on other appends, one transmitted batch
decoded twice and appended twice, and a GC in another client, its clock ahead by more
than a lease, run while a writer's commit is in flight, injected at the consensus
layer between computing the state and the commit landing).

Exactly once across skewed clocks, shared handles and restarts: a second process whose
clock is ahead of every lease (writer, reader, hand-off) commits transitions, dropping
every lease the model's handles hold, while an append's or a transaction's
acknowledgement is lost and its re-reads fail; a thread pool appends through one shared
handle with acknowledgements lost at random; a restarted process retries with the token
an indeterminate error carried.  The caller follows the docs (``UpperMismatch``: re-read
the upper and append again; indeterminate: retry with the token), so a landed append
reported as a race, or a transaction decided "not landed", writes its rows twice and the
snapshot shows it.  A fifth figure row counts these cases.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from persist import (
    BatchAppended,
    BlobError,
    ConsensusError,
    InvalidUsage,
    LeaseExpired,
    MemoryBlob,
    PartsMissing,
    PersistClient,
    UnreliableBlob,
    UpperMismatch,
    collect_garbage,
    fsck,
)
from stash import Antichain, Stash
from tests.reliability.campaign import record, runs
from tests.support.clock import Clock
from tests.support.stash_faults import AckLostStash

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])
SHARD = "life"
LEASE = 600.0
GRACE = 300.0
#: The skewed process's lead: more than every lease (writer, reader, hand-off).
FAR = 2 * 86400.0
POOL_THREADS = 4

FIG: Counter[str] = Counter()
#: MODEL_SKIP=rule,rule: leave those rules out (to see the defect behind each other one).
SKIP = set(filter(None, os.environ.get("MODEL_SKIP", "").split(",")))


def enabled(name: str) -> Any:
    """A precondition: the rule ``name`` is not left out by ``MODEL_SKIP``."""
    return precondition(lambda _self: name not in SKIP)


def ac(t: int) -> Antichain:
    return Antichain.from_elem(t)


class Lifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.inner = MemoryBlob()
        self.blob = UnreliableBlob(self.inner, fail_probability=0.0, seed=1)
        self.blob.faults(False)
        self.raw_stash = Stash.open("memory://", fenced=False)
        self.stash = AckLostStash(self.raw_stash)
        kw: dict[str, Any] = {
            "compaction": "off",
            "inline_max_bytes": 0,
            "writer_lease_seconds": LEASE,
            "reader_lease_seconds": LEASE,
            "gc_grace_seconds": GRACE,
            "blob_retries": 1,
            "target_part_bytes": 1,  # a builder flushes (uploads) on every add
            "clock": self.clock,
        }
        self.c = PersistClient(self.stash, self.blob, **kw)
        self.other = PersistClient(self.stash, self.blob, **kw)  # GC and compaction
        # A GC process whose clock is ahead of everyone's by more than a lease.
        ahead = {**kw, "clock": lambda: self.clock.now + LEASE + 1}
        self.ahead = PersistClient(self.stash, self.blob, **ahead)
        # A second process whose clock is ahead of every lease: its transitions drop
        # every lease the model's handles hold.
        self.kw = kw
        self.far = PersistClient(self.raw_stash, self.blob, **{**kw, "clock": self.far_clock})
        self.tokens: list[str] = []  # caller tokens of acknowledged appends
        self.w, self.r = self.c.open(SHARD, KS, VS)
        self.model: Counter[tuple[int, str]] = Counter()
        self.upper = 0
        self.held: list[tuple[Any, Any, list[tuple[int, str]]]] = []  # (writer, batch, rows)
        self.open: list[tuple[Any, Any, list[tuple[int, str]]]] = []  # open builders
        self.outage = False
        self.gc_seen: set[int] = set()  # held batches a GC pass ran past
        FIG["runs"] += 1

    def teardown(self) -> None:
        FIG["lost_acks"] += self.stash.lost_acks
        self.blob.make_available()
        self.c.close()
        self.other.close()
        self.ahead.close()
        self.far.close()
        self.raw_stash.close()

    # ----------------------------------------------------------------- helpers
    def _live_writer(self) -> Any:
        try:
            self.w.heartbeat()
        except LeaseExpired:
            self.w = self.c.open_writer(SHARD, KS, VS)
        return self.w

    def _live_reader(self) -> Any:
        try:
            self.r.heartbeat()
        except LeaseExpired:
            self.r = self.c.open_reader(SHARD, KS, VS)
        return self.r

    def _guard(self, fn: Any) -> bool:
        """Run ``fn`` (under an outage if one is armed); True if it succeeded."""
        if self.outage:
            self.blob.make_unavailable()
        try:
            fn()
            return True
        except BlobError:
            assert self.outage, "a blob error without an outage"
            FIG["outage_errors"] += 1
            return False
        finally:
            if self.outage:
                self.blob.make_available()
                self.outage = False
                FIG["faults"] += 1

    def _shard_upper(self) -> int:
        u = self.c.inspect(SHARD).upper.as_option()
        assert u is not None
        return u

    def _committed(self, rows: list[tuple[int, str]]) -> None:
        for kv in rows:
            self.model[kv] += 1
        self.upper += 1
        FIG["acknowledged"] += 1

    def far_clock(self) -> float:
        return self.clock.now + FAR

    def _skewed_transition(self) -> None:
        """The process ahead of every lease commits a transition (a reader comes and
        goes): every lease of the others is dropped in its version."""
        self.far.open_reader(SHARD, KS, VS).expire()
        FIG["skewed_transitions"] += 1

    @staticmethod
    def _before_retry(w: Any, fn: Callable[[], None]) -> Callable[[], None]:
        """Run ``fn`` just before ``w`` applies its next append's command a second
        time (the first attempt's outcome was unknown); returns the undo."""
        m = w._machine
        orig = m.compare_and_append
        calls = [0]

        def wrapped(*a: Any, **kw: Any) -> Any:
            calls[0] += 1
            if calls[0] == 2:
                fn()
            return orig(*a, **kw)

        m.compare_and_append = wrapped
        return lambda: m.__dict__.pop("compare_and_append", None)

    def _follow_the_docs(
        self, w: Any, kv: tuple[int, str], up: int, token: str | None, tries: int = 4
    ) -> None:
        """An append as the docs say: on ``UpperMismatch`` nothing of it landed, so
        re-read the upper and append again; on ``LeaseExpired`` nothing committed, so
        append again through a new writer; on an indeterminate error, retry with the
        token it carried (raises an indeterminate error if that stays so)."""
        k, v = kv
        for _ in range(tries):
            try:
                w.compare_and_append([(((k,), (v,)), up, 1)], up, up + 1, idempotency_token=token)
                return
            except LeaseExpired:
                w = self._live_writer()
            except UpperMismatch as e:
                if token is not None:
                    FIG["upper_mismatch_of_a_retry"] += 1
                up_now = e.current.as_option()
                assert up_now is not None
                up, token = up_now, None
            except ConsensusError as e:
                if not e.is_indeterminate():
                    raise
                token = e.idempotency_token
        raise ConsensusError("still indeterminate", indeterminate=True)

    def _settle(self, rows: list[tuple[int, str]], others: int) -> None:
        """An append of ``rows`` whose outcome stayed unknown (``others`` appends of
        other threads landed meanwhile): the shard's upper tells (one writer here)."""
        FIG["outcome_unknown"] += 1
        for _ in range(others):
            self.upper += 1
        if self._shard_upper() > self.upper:
            self._committed(rows)

    def _pool_appends(self, w: Any, n: int, base: int) -> int:
        """``n`` appends through the one handle ``w`` by a thread pool, each following
        the docs; returns how many were acknowledged (their rows are in the model)."""
        done = threading.Lock()
        acked: list[tuple[int, str]] = []

        def one(i: int) -> None:
            kv = (base + i, "p")
            for _ in range(50):
                try:
                    up = w.fetch_recent_upper().as_option()
                    self._follow_the_docs(w, kv, up, None, tries=50)
                except ConsensusError as e:
                    if e.is_indeterminate():
                        raise
                    continue  # a failed read: nothing committed, try again
                with done:
                    acked.append(kv)
                return
            raise AssertionError("the pool's append never got through")

        with ThreadPoolExecutor(POOL_THREADS) as ex:
            list(ex.map(one, range(n)))
        for kv in acked:
            self.model[kv] += 1
        FIG["pool_appends"] += len(acked)
        return len(acked)

    # ------------------------------------------------------------------- rules
    @enabled("append_ack_lost")
    @rule(
        k=st.integers(0, 5),
        v=st.sampled_from("ab"),
        meanwhile=st.sampled_from(["skewed process", "shared handle"]),
    )
    def append_ack_lost(self, k: int, v: str, meanwhile: str) -> None:
        """An append lands, its acknowledgement is lost and the first re-read fails;
        before its command runs again, the skewed process drops its writer, or a
        thread pool appends 8 times through the same handle."""
        w = self._live_writer()
        up = self.upper
        others = [0]

        def act() -> None:
            self.stash.reads_to_fail = 0
            if meanwhile == "skewed process":
                self._skewed_transition()
            else:
                others[0] = self._pool_appends(w, 8, 100 + 10 * FIG["pool_rounds"])
                FIG["pool_rounds"] += 1

        self.stash.arm(reads=10)  # more than the consensus retries: the command fails
        undo = self._before_retry(w, act)
        try:
            self._follow_the_docs(w, (k, v), up, None)
        except ConsensusError:
            undo()
            self._settle([(k, v)], others[0])
        else:
            undo()
            for _ in range(others[0]):
                self.upper += 1
            self._committed([(k, v)])
        FIG["acks_lost_with_skew_or_pool"] += 1
        assert self._shard_upper() == self.upper

    @enabled("txn_ack_lost")
    @rule(k=st.integers(0, 5), v=st.sampled_from("ab"))
    def txn_ack_lost(self, k: int, v: str) -> None:
        """A transaction lands, its acknowledgement is lost and its first re-read
        fails; meanwhile the skewed process drops every lease.  ``commit()`` must learn
        that it landed, never retry it at a later time."""
        real = time.sleep
        pending = [True]
        me = threading.get_ident()

        def sleep(s: float) -> None:
            if pending and threading.get_ident() == me:
                pending.clear()
                self.stash.reads_to_fail = 0
                self._skewed_transition()
            real(min(s, 0.001))

        for attempt in range(2):
            txn = self.c.begin()
            time.sleep = sleep  # type: ignore[assignment]
            try:
                txn.write(SHARD, pa.table({"k": pa.array([k], pa.int64()), "v": [v]}))
                # Two failing reads: the consensus layer's retry backs off (sleeps) once.
                self.stash.arm(reads=2)
                txn.commit()
            except LeaseExpired:  # the transaction's writer was dropped: nothing committed
                assert attempt == 0
                txn.abort()
                self.stash.armed = False
                self.stash.reads_to_fail = 0
                FIG["refused"] += 1
                continue
            finally:
                time.sleep = real  # type: ignore[assignment]
            self._committed([(k, v)])
            FIG["txn_acks_lost"] += 1
            break
        assert self._shard_upper() == self.upper

    @enabled("retry_after_restart")
    @rule(k=st.integers(0, 5), v=st.sampled_from("ab"), own=st.booleans())
    def retry_after_restart(self, k: int, v: str, own: bool) -> None:
        """An append lands and its outcome stays unknown (every re-read fails); the
        process dies, the skewed process drops its writer, and a restarted process
        retries with the token the error carried (persist's, or the caller's own)."""
        w = self._live_writer()
        up = self.upper
        token = f"model-restart-{FIG['restarts']:08d}" if own else None
        FIG["restarts"] += 1
        w.resolve_attempts, w.resolve_max_wait = 2, 0.001
        self.stash.arm(reads=50)
        try:
            w.compare_and_append([(((k,), (v,)), up, 1)], up, up + 1, idempotency_token=token)
        except ConsensusError as e:
            assert e.is_indeterminate()
            carried = e.idempotency_token
        else:  # pragma: no cover - the acknowledgement is always lost here
            raise AssertionError("the acknowledgement was not lost")
        finally:
            self.stash.reads_to_fail = 0
            w.resolve_attempts, w.resolve_max_wait = 8, 1.0
        self._skewed_transition()  # the first writer's lease ran out
        restarted = PersistClient(self.raw_stash, self.blob, **self.kw)
        try:
            self._follow_the_docs(restarted.open_writer(SHARD, KS, VS), (k, v), up, carried)
        except ConsensusError:
            self._settle([(k, v)], 0)
        else:
            self._committed([(k, v)])
        finally:
            restarted.close()
        assert self._shard_upper() == self.upper

    @enabled("shared_handle_pool")
    @rule(n=st.integers(2, 10), p=st.sampled_from([0.2, 0.5]))
    def shared_handle_pool(self, n: int, p: float) -> None:
        """A thread pool appends through one shared handle, acknowledgements lost at
        random (the re-read after one fails at random too)."""
        w = self._live_writer()
        self.stash.p, self.stash.max_reads = p, 1
        try:
            got = self._pool_appends(w, n, 1000 + 20 * FIG["pool_rounds"])
        finally:
            self.stash.p, self.stash.reads_to_fail = 0.0, 0
        FIG["pool_rounds"] += 1
        for _ in range(got):
            self.upper += 1
        FIG["acknowledged"] += got
        assert self._shard_upper() == self.upper

    @rule(k=st.integers(0, 5), v=st.sampled_from("ab"), token=st.booleans())
    def write(self, k: int, v: str, token: bool) -> None:
        w = self._live_writer()
        up = self.upper
        tok = f"model-token-{FIG['tokens']:08d}" if token else None
        FIG["tokens"] += 1
        ok = self._guard(
            lambda: w.compare_and_append([(((k,), (v,)), up, 1)], up, up + 1, idempotency_token=tok)
        )
        if ok:
            self._committed([(k, v)])
            if tok is not None:
                self.tokens.append(tok)
        assert self._shard_upper() == self.upper  # all or nothing

    @rule(data=st.data(), k=st.integers(0, 5), v=st.sampled_from("ab"))
    def reuse_token(self, data: st.DataObject, k: int, v: str) -> None:
        """The token of an acknowledged append, passed to another append (at the
        current upper, so other bounds): refused while the state records the token,
        else (its record left the state) a new append; never "already landed" with
        nothing written (checked by the upper and the snapshot)."""
        if not self.tokens:
            return
        tok = self.tokens[data.draw(st.integers(0, len(self.tokens) - 1))]
        w = self._live_writer()
        up = self.upper
        try:
            w.compare_and_append([(((k,), (v,)), up, 1)], up, up + 1, idempotency_token=tok)
        except InvalidUsage as e:
            assert "names a different append" in str(e)
            FIG["tokens_refused"] += 1
        else:
            self._committed([(k, v)])
            FIG["tokens_forgotten"] += 1
        assert self._shard_upper() == self.upper

    @rule(k=st.integers(0, 5), v=st.sampled_from("ab"))
    def batch_decoded_twice(self, k: int, v: str) -> None:
        """One batch's transmittable bytes decoded twice, each decoding appended in its
        own call (the second after ``rewrite_ts`` to the new upper): the second is
        refused, nothing committed."""
        w = self._live_writer()
        out: list[Any] = []
        if not self._guard(lambda: out.append(w.batch([(((k,), (v,)), 0, 1)], 0, 1))):
            return
        data = out[0].into_transmittable()
        for n in range(2):
            copy = w.batch_from_transmittable(data)
            up = self.upper
            if up > 0:
                copy.rewrite_ts(ac(up), ac(up + 1))
            try:
                w.compare_and_append_batch([copy], up, up + 1)
            except BatchAppended:
                assert n == 1
                assert copy.consumed
                FIG["copies_refused"] += 1
            else:
                assert n == 0, "a second decoding of one batch was appended"
                self._committed([(k, v)])
            assert self._shard_upper() == self.upper

    @rule(k=st.integers(0, 5), v=st.sampled_from("ab"))
    def gc_ahead_during_a_slow_commit(self, k: int, v: str) -> None:
        """A writer's commit is in flight (its state computed, the stash commit not yet
        landed) while GC, its clock ahead by more than a lease, runs in another client:
        the commit either lands first (GC keeps the renewed writer's parts) or is
        refused (``LeaseExpired``, nothing committed); never acknowledged pointing at a
        part GC deleted (``fsck`` after every step)."""
        w = self._live_writer()
        w.heartbeat()  # registered: the compare-and-set delayed is the append's commit
        up = self.upper
        consensus = self.c.consensus
        original = consensus.compare_and_set
        ran: list[int] = []

        def slow(*a: Any, **kw: Any) -> bool:
            if not ran:
                ran.append(1)
                collect_garbage(self.ahead, SHARD)
                FIG["gc_passes"] += 1
            return original(*a, **kw)

        consensus.compare_and_set = slow  # type: ignore[method-assign]
        try:
            w.compare_and_append([(((k,), (v,)), up, 1)], up, up + 1)
        except LeaseExpired:
            FIG["refused_after_gc_ahead"] += 1
        else:
            self._committed([(k, v)])
            FIG["committed_despite_gc_ahead"] += 1
        finally:
            del consensus.compare_and_set
        assert self._shard_upper() == self.upper

    @rule(k=st.integers(0, 5), v=st.sampled_from("ab"))
    def start_builder(self, k: int, v: str) -> None:
        w = self._live_writer()
        b = w.builder(0)
        rows = [(k, v)]
        if self._guard(lambda: b.add([(((k,), (v,)), 0, 1)])):
            self.open.append((w, b, rows))

    @rule(data=st.data(), k=st.integers(0, 5), v=st.sampled_from("ab"), outage=st.booleans())
    def add_to_builder(self, data: st.DataObject, k: int, v: str, outage: bool) -> None:
        """Another ``add`` to an open builder (it flushes), half the time under a blob
        outage: then it fails and the builder keeps exactly the rows earlier ``add``
        calls accepted."""
        if not self.open:
            self.start_builder(k, v)
            if not self.open:
                return
        self.outage = self.outage or outage
        w, b, rows = self.open[data.draw(st.integers(0, len(self.open) - 1))]
        try:
            if self._guard(lambda: b.add([(((k,), (v,)), 0, 1)])):
                rows.append((k, v))
                FIG["builder_adds"] += 1
            else:
                FIG["builder_add_outages"] += 1
        except LeaseExpired:
            FIG["refused"] += 1  # its writer's lease ran out: finish will be refused

    @rule()
    def lose_next_ack(self) -> None:
        """The next stash commit (an append, a heartbeat, GC, compaction) lands but its
        acknowledgement is lost."""
        self.stash.arm()

    @rule(data=st.data())
    def finish_builder(self, data: st.DataObject) -> None:
        if not self.open:
            return
        i = data.draw(st.integers(0, len(self.open) - 1))
        w, b, rows = self.open.pop(i)
        out: list[Any] = []
        try:
            if self._guard(lambda: out.append(b.finish(1))):
                self.held.append((w, out[0], rows))
        except LeaseExpired:
            FIG["refused"] += 1  # its writer's lease ran out: it can write nothing more
            b.abort()

    @rule(data=st.data())
    def append_held(self, data: st.DataObject) -> None:
        if not self.held:
            return
        i = data.draw(st.integers(0, len(self.held) - 1))
        writer, batch, rows = self.held.pop(i)
        up = self.upper
        appender = self._live_writer()
        if up > 0:  # built at time 0: advance its times to the append's (metadata only)
            batch.rewrite_ts(ac(up), ac(up + 1))
        shard = self.c.inspect(SHARD)
        live = writer.writer_id in shard.live_writers(int(self.clock.now * 1000))
        try:
            ok = self._guard(lambda: appender.compare_and_append_batch([batch], up, up + 1))
        except (LeaseExpired, PartsMissing) as e:
            # Only a batch whose writer's lease ran out may be refused (nothing committed).
            assert not live, f"a live writer's batch was refused: {e}"
            FIG["refused"] += 1
            assert self._shard_upper() == self.upper
            batch.delete()
            return
        if ok:
            self._committed(rows)
            FIG["held_appended"] += 1
            if id(batch) in self.gc_seen:
                FIG["held_across_gc"] += 1
        else:
            self.held.append((writer, batch, rows))
        assert self._shard_upper() == self.upper

    @rule()
    def heartbeat(self) -> None:
        self._live_writer()
        self._live_reader()

    @rule(jump=st.sampled_from([1.0, GRACE + 1, LEASE / 2, LEASE + 1]))
    def clock_jump(self, jump: float) -> None:
        self.clock.now += jump
        FIG["clock_jumps"] += 1

    @rule()
    def gc(self) -> None:
        self.gc_seen.update(id(b) for _w, b, _rows in self.held)
        if self._guard(lambda: collect_garbage(self.other, SHARD)):
            FIG["gc_passes"] += 1

    @rule(jump=st.sampled_from([GRACE + 1, LEASE + 1]))
    def later_gc(self, jump: float) -> None:
        """Time passes (past the grace period, or every lease), then another process
        collects garbage: the path on which GC once deleted a held batch's parts."""
        self.clock_jump(jump)
        self.gc()

    @rule(k=st.integers(0, 5), v=st.sampled_from("ab"), passes=st.integers(1, 3))
    def batch_held_across_gc(self, k: int, v: str, passes: int) -> None:
        """A writer builds a batch and keeps it while heartbeating across several GC
        passes, each past the grace period (then it is held like the others)."""
        w = self._live_writer()
        out: list[Any] = []
        if not self._guard(lambda: out.append(w.batch([(((k,), (v,)), 0, 1)], 0, 1))):
            return
        for _ in range(passes):
            self.clock.now += GRACE + 1
            self._live_writer()
            self._live_reader()
            collect_garbage(self.other, SHARD)
            FIG["gc_passes"] += 1
        self.gc_seen.add(id(out[0]))
        self.held.append((w, out[0], [(k, v)]))

    @rule()
    def compact(self) -> None:
        r = self._live_reader()
        if self.upper > 1:
            r.downgrade_since(self.upper - 1)
        self._guard(lambda: self.other.compactor.compact_once(SHARD))

    @rule()
    def arm_outage(self) -> None:
        self.outage = True

    # -------------------------------------------------------------- invariant
    @invariant()
    def reads_back_and_fsck_clean(self) -> None:
        if self.outage:
            return
        assert self._shard_upper() == self.upper
        if self.upper > 0:
            r = self._live_reader()
            snap = r.snapshot(self.upper - 1)
            got = Counter(
                {
                    (k, v): d
                    for k, v, d in zip(
                        *(snap[c].to_pylist() for c in ("k", "v", "_diff")), strict=True
                    )
                }
            )
            want = Counter({kv: d for kv, d in self.model.items() if d})
            if got != want:
                FIG["lost"] += 1
            assert got == want
        report = fsck(self.c, SHARD)
        assert report.ok, report.damage()


@pytest.mark.campaign
@pytest.mark.timeout(runs(600, 5400))  # long-sized: 300 examples of up to 50 steps
def test_lifecycle_model() -> None:
    FIG.clear()
    n = runs(40, 300)
    run_state_machine_as_test(
        Lifecycle,
        settings=settings(
            max_examples=n,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    assert FIG["acknowledged"] > 0
    # Every figure below is asserted after each step (lost, unreadable), by the model
    # (duplicated, partial) or by the rules (unclear): a row reports them as 0.
    clean = {"runs": FIG["runs"], "lost": 0, "duplicated": 0, "partial": 0, "unclear": 0}
    clean |= {"unreadable": 0}  # persist's extra column: every acknowledged write read back
    record(
        "lifecycle model: persist builders and batches held, clock jumps, GC, compaction, "
        "blob outages",
        **clean,
        faults=FIG["faults"] + FIG["clock_jumps"],
        acknowledged=FIG["acknowledged"],
        refused_expired=FIG["refused"],
        gc_passes=FIG["gc_passes"],
        outage_errors=FIG["outage_errors"],
        lost_acks=FIG["lost_acks"],
    )
    record(
        "builders under blob outages: persist (a flush on every add)",
        **clean,
        faults=FIG["builder_add_outages"],
        acknowledged=FIG["builder_adds"],
        held_appended=FIG["held_appended"],
    )
    record(
        "lifecycle model: persist tokens reused on other appends, batches decoded twice, "
        "GC ahead by a lease during a slow commit",
        **clean,
        faults=FIG["tokens_refused"]
        + FIG["tokens_forgotten"]
        + FIG["copies_refused"]
        + FIG["refused_after_gc_ahead"]
        + FIG["committed_despite_gc_ahead"],
        tokens_refused=FIG["tokens_refused"],
        tokens_forgotten=FIG["tokens_forgotten"],
        copies_refused=FIG["copies_refused"],
        refused_after_gc_ahead=FIG["refused_after_gc_ahead"],
        committed_despite_gc_ahead=FIG["committed_despite_gc_ahead"],
    )
    record(
        "lifecycle model: persist acknowledgements lost while a process ahead of every "
        "lease drops the writers, a thread pool shares one handle, a restarted process "
        "retries with the carried token",
        **clean,
        faults=FIG["lost_acks"] + FIG["skewed_transitions"],
        acknowledged=FIG["acks_lost_with_skew_or_pool"]
        + FIG["txn_acks_lost"]
        + FIG["restarts"]
        + FIG["pool_appends"],
        skewed_transitions=FIG["skewed_transitions"],
        pool_appends=FIG["pool_appends"],
        restarts=FIG["restarts"],
        outcome_unknown=FIG["outcome_unknown"],
    )
    record(
        "batches held across GC: persist",
        **clean,
        faults=FIG["gc_passes"],
        acknowledged=FIG["held_appended"],
        held_across_gc=FIG["held_across_gc"],
        refused_expired=FIG["refused"],
    )
