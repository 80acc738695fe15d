"""Lifecycle model across processes: several clients on one stash (a SQLite file, or
Postgres) and one ``file://`` blob store, each a separate ``multiprocessing`` process
(spawn, :mod:`model_worker`) with a clock of its own, against a reference multiset.

A hypothesis stateful test.  Each example draws a skew per process (up to more than the
writer lease, ahead or behind) and mixes, on one shard:

* appends by any process, with no token, a fresh token, or a token already used on a
  *different* append (by this process or another); retries of an acknowledged append
  with its token (recognized as landed, or refused; never an upper mismatch), and of an
  append whose acknowledgement the stash lost;
* **a delay between computing a state and its commit landing**: a process's append (or
  schema evolution) is held at the consensus layer (``model_worker.PausingStash``, the
  n-th stash append of the operation) while another process runs GC, compaction, an
  append, a schema evolution or a transaction, with the model's time moved on (up to
  more than the writer lease) in between;
* GC and compaction by any process, time moving on past the grace period and the lease;
* **concurrent schema evolution**: processes add columns knowing only the schema they
  last saw; transactions written with the newest columns by a process whose cache may be
  older; ``snapshot_many`` at an explicit time; a transaction over two shards, one moved
  past the commit time by another process since this one read it, retried at
  ``retry_ts()``;
* **threads sharing one client**: appenders, transactions, a reader and the background
  compactor at once;
* a transmitted batch decoded twice and appended in two calls; diffs near ``2**62``.

Checked after every step: every acknowledged write reads back exactly (the shard's
snapshot at ``upper - 1`` with the newest schema equals the reference: 0 lost, 0
duplicated, no acknowledged value read as null), the shard's upper is the reference's
(so an operation that failed committed nothing), the newest schema has every column an
acknowledged evolution added, and ``persist.fsck`` finds no damage.  Every wait on a
process is bounded (``model_worker.STEP_TIMEOUT``): a deadlock fails the test.  The
guarantees checked are the README's and the docstrings' (``compare_and_append``'s
idempotency tokens, ``gc.py``'s "a live writer's keys are never deleted", ``client.py``'s
schema evolution "decided on the latest state, re-checked on every race",
``persist.txn``'s nothing-half-done).  Figures go to ``docs/reliability.md``.

Sources: Jepsen's method (clients in separate processes with skewed clocks, operations
held in flight, a checker over what was acknowledged), hypothesis' rule-based stateful
testing for the schedule, and the rule persist-client keeps (``internal/state.rs``):
a writer is expired through the state machine, so an append of an expired writer is
refused rather than left pointing at deleted parts.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from persist import LeaseExpired, PersistClient, fsck
from stash import Stash
from tests.reliability import model_worker
from tests.reliability.campaign import LONG, record, runs
from tests.reliability.model_worker import KS, STEP_TIMEOUT, row_values, value_schema

PROCS = 2
LEASE = 600.0
GRACE = 300.0
T0 = 1_700_000_000.0
SKEWS = [0.0, 0.0, LEASE / 4, -LEASE / 4, LEASE + 1, -(LEASE + 1), 2 * LEASE + GRACE]
JUMPS = [1.0, GRACE + 1, LEASE / 2, LEASE + 1]
#: Errors that refuse an operation with nothing committed (checked by the invariant).
REFUSALS = ("LeaseExpired", "PartsMissing", "InvalidUsage", "SchemaMismatch")
WORKER_KW: dict[str, Any] = {
    "compaction": "off",
    "inline_max_bytes": 0,  # every part goes to the blob store: GC can delete it
    "writer_lease_seconds": LEASE,
    "reader_lease_seconds": LEASE,
    "gc_grace_seconds": GRACE,
    "blob_retries": 1,
}

#: Shrinking a failure of several processes takes minutes: done in long mode (`make
#: reliability`) or with MODEL_SHRINK=1; short mode (`make test`) reports it as drawn.
SHRINK = os.environ.get("MODEL_SHRINK", "1" if LONG else "0") == "1"
#: MODEL_SKIP=rule,rule: leave those rules out (to survey the defects behind others).
SKIP = set(filter(None, os.environ.get("MODEL_SKIP", "").split(",")))


def enabled(name: str) -> Any:
    """A precondition: the rule ``name`` is not left out by ``MODEL_SKIP``."""
    return precondition(lambda _self: name not in SKIP)


FIG: Counter[str] = Counter()
_shards = itertools.count()


class Result:
    """A process's answer: ``ok`` with ``value``, or an error (class ``names``, ``msg``,
    ``indeterminate``, ``token``)."""

    def __init__(self, msg: tuple[Any, ...]) -> None:
        self.ok = msg[0] == "done"
        self.value = msg[1] if self.ok else None
        self.names: list[str] = [] if self.ok else msg[1]
        self.msg = "" if self.ok else msg[2]
        self.indeterminate = False if self.ok else bool(msg[3])
        self.token = None if self.ok else msg[4]

    def is_(self, *names: str) -> bool:
        return any(n in self.names for n in names)

    def __repr__(self) -> str:
        return "ok" if self.ok else f"{self.names[0]}: {self.msg}"


PAUSED = object()


class Procs:
    """The model's processes (spawned once per module, reused by every example; a
    stuck one is replaced)."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        for i in range(PROCS):
            self._spawn(i)

    def _spawn(self, i: int) -> None:
        ours, theirs = self.ctx.Pipe()
        p = self.ctx.Process(target=model_worker.serve, args=(theirs, i), daemon=True)
        p.start()
        if i < len(self.procs):
            self.procs[i], self.conns[i] = p, ours
        else:
            self.procs.append(p)
            self.conns.append(ours)

    def start(self, i: int, op: str, now: float, **kw: Any) -> None:
        self.conns[i].send(("run", op, now, kw))

    def wait(self, i: int) -> Any:
        """The process's next message: PAUSED or a Result.  A process that does not
        answer within the timeout is a deadlock: it is replaced, and the test fails."""
        if not self.conns[i].poll(STEP_TIMEOUT + 30):
            self.replace(i)
            FIG["deadlocks"] += 1
            raise AssertionError(f"deadlock: process {i} did not answer in {STEP_TIMEOUT} s")
        msg = self.conns[i].recv()
        if msg[0] == "paused":
            return PAUSED
        return Result(msg)

    def call(self, i: int, op: str, now: float, **kw: Any) -> Result:
        self.start(i, op, now, **kw)
        r = self.wait(i)
        assert r is not PAUSED
        if r.is_("Deadlock"):
            self.replace(i)  # its stuck threads hold the client's locks
            FIG["deadlocks"] += 1
            raise AssertionError(f"deadlock in process {i}: {r.msg}")
        return r  # type: ignore[no-any-return]

    def replace(self, i: int) -> None:
        """Kill process ``i`` and start a new one in its place."""
        self.procs[i].kill()
        self.procs[i].join(10)
        self._spawn(i)

    def release(self, i: int) -> None:
        self.conns[i].send(("release",))

    def close(self) -> None:
        for c in self.conns:
            c.send(("stop",))
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


class Env:
    """What one test shares across examples: the processes (shared by the tests of
    this module), the stash and blob store, and the model's own client (reading and
    checking, at the model's time, no skew)."""

    procs: Procs
    url: str
    blob: str
    client: PersistClient
    stash: Stash
    now: float = T0


ENV = Env()


class Model(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.P = ENV.procs
        self.c = ENV.client
        self.shard = f"m{next(_shards)}_{uuid.uuid4().hex[:6]}"
        self.side = f"{self.shard}_side"  # a second shard, for transactions over two
        self.model: Counter[tuple[Any, ...]] = Counter()
        self.cols: list[str] = ["a"]  # every column an acknowledged evolution added
        self.upper = 0
        self.skews = [0.0] * PROCS
        self.tokens: list[str] = []
        self.acked_last = [False] * PROCS  # the process's last append was acknowledged
        self.last_token: list[str | None] = [None] * PROCS  # the token it carried
        self.ncol = itertools.count(1)
        self.seeds = itertools.count(1)
        self.reader: Any = None
        ENV.now = T0  # each example starts at the same time (a replay draws the same)
        FIG["runs"] += 1

    # ----------------------------------------------------------------- helpers
    def t(self, i: int | None = None) -> float:
        """Process ``i``'s clock (the model's own without ``i``)."""
        return ENV.now + (0.0 if i is None else self.skews[i])

    def _shard_upper(self) -> int:
        u = self.c.inspect(self.shard).upper.as_option()
        assert u is not None
        return u

    def _add(self, k: int, seed: int, cols: list[str], diff: int = 1) -> None:
        vals = dict(zip(cols, row_values(cols, seed), strict=True))
        self.model[(k, tuple(sorted(vals.items())))] += diff

    def _refused(self, what: str, r: Result, *allowed: str) -> None:
        """``r`` refused the operation: it must be one of the allowed refusals, and it
        committed nothing (the upper and the contents are the model's: the invariant)."""
        assert r.is_(*(allowed or REFUSALS)), f"{what}: unexpected {r!r}"
        assert self._shard_upper() == self.upper, f"{what} was refused yet committed: {r!r}"
        FIG["refused"] += 1

    def _append_outcome(self, i: int, r: Result, k: int, seed: int, lower: int, what: str) -> None:
        """Judge an append of ``(k, seed)`` by process ``i`` at ``[lower, lower + 1)``."""
        self.acked_last[i] = False
        tries = 0
        while not r.ok and r.indeterminate and r.token and tries < 3:
            FIG["indeterminate_retried"] += 1
            tries += 1
            r = self.P.call(i, "retry_token", self.t(i), token=r.token)
        if r.ok:
            assert lower == self.upper, (
                f"{what}: acknowledged at [{lower}, {lower + 1}) but the upper was "
                f"already {self.upper} (two appends landed at one lower)"
            )
            got = self._shard_upper()
            if got != lower + 1:
                FIG["lost"] += 1
                raise AssertionError(
                    f"{what}: acknowledged at [{lower}, {lower + 1}) but the shard's upper "
                    f"is {got}: the write did not land (lost)"
                )
            self._add(k, seed, r.value)
            self.upper = lower + 1
            self.acked_last[i] = True
            FIG["acknowledged"] += 1
        elif r.is_("UpperMismatch"):
            assert lower != self.upper, f"{what}: UpperMismatch at the current upper: {r!r}"
            FIG["races_lost"] += 1
        else:
            self._refused(what, r)
            if r.is_("LeaseExpired", "PartsMissing"):
                FIG["refused_expired"] += 1

    def _rows(self) -> Counter[tuple[Any, ...]]:
        return Counter({kv: d for kv, d in self.model.items() if d})

    def _expected(self, names: list[str]) -> Counter[tuple[Any, ...]]:
        out: Counter[tuple[Any, ...]] = Counter()
        for (k, vals), d in self._rows().items():
            dv = dict(vals)
            out[(k, *(dv.get(c) for c in names))] += d
        return out

    def _newest_cols(self) -> list[str]:
        return list(self.c.inspect(self.shard).value_schema.names)

    # ------------------------------------------------------------------- setup
    @initialize(skews=st.lists(st.sampled_from(SKEWS), min_size=PROCS, max_size=PROCS))
    def setup(self, skews: list[float]) -> None:
        self.skews = skews
        self.c.open_writer(self.shard, KS, value_schema(["a"]))  # create the shard
        self.c.open_writer(self.side, KS, value_schema(["a"]))  # and the side shard
        for i in range(PROCS):
            r = self.P.call(
                i, "reset", self.t(i), url=ENV.url, blob=ENV.blob, shard=self.shard, kw=WORKER_KW
            )
            assert r.ok, r
        FIG["skew_beyond_lease"] += any(abs(s) > LEASE for s in skews)

    # ------------------------------------------------------------------- rules
    @enabled("append")
    @rule(
        i=st.integers(0, PROCS - 1),
        k=st.integers(0, 3),
        token=st.sampled_from(["none", "fresh", "reuse", "reuse"]),
        lose_ack=st.booleans(),
        data=st.data(),
    )
    def append(self, i: int, k: int, token: str, lose_ack: bool, data: st.DataObject) -> None:
        """An append, its token none, fresh, or one an earlier, different append used
        (never taken as landed: the write lands or is refused)."""
        tok: str | None = None
        if token == "fresh" or (token == "reuse" and not self.tokens):
            tok = uuid.uuid4().hex
            self.tokens.append(tok)
        elif token == "reuse":
            tok = data.draw(st.sampled_from(self.tokens))
            FIG["tokens_reused"] += 1
        seed = next(self.seeds)
        lower = self.upper
        r = self.P.call(
            i, "append", self.t(i), ks=[k], seeds=[seed], lower=lower, token=tok, lose_ack=lose_ack
        )
        FIG["lost_acks"] += lose_ack
        self._append_outcome(i, r, k, seed, lower, f"append by process {i} (token {token})")
        self.last_token[i] = tok

    @enabled("reuse_own_token")
    @rule(i=st.integers(0, PROCS - 1), k=st.integers(0, 3))
    def reuse_own_token(self, i: int, k: int) -> None:
        """Two appends by one process (other rows, consecutive times) with one token of
        the caller's: a token names one append, so the second must land or be refused,
        never be taken for the first."""
        tok = uuid.uuid4().hex
        for n in range(2):
            seed, lower = next(self.seeds), self.upper
            r = self.P.call(i, "append", self.t(i), ks=[k], seeds=[seed], lower=lower, token=tok)
            what = f"append by process {i} with a token used before" if n else "append"
            self._append_outcome(i, r, k, seed, lower, what)
        FIG["tokens_reused"] += 1
        self.last_token[i] = tok

    @enabled("retry_acknowledged")
    @rule(i=st.integers(0, PROCS - 1))
    def retry_acknowledged(self, i: int) -> None:
        """The last acknowledged append of a process again, with its token: recognized
        as landed (nothing written again), or refused; never an upper mismatch."""
        if not self.acked_last[i]:
            return
        r = self.P.call(i, "retry_last", self.t(i))
        if r.ok and r.value is None:
            return  # it carried no token of the caller's
        FIG["retries"] += 1
        if r.ok:
            got = self._shard_upper()
            if got != self.upper:
                FIG["duplicated"] += 1
            assert got == self.upper, "a retry with its token wrote again (duplicated)"
        else:
            assert not r.is_("UpperMismatch"), f"a landed append's retry was not recognized: {r!r}"
            self._refused("retry of a landed append", r, "LeaseExpired", "ConsensusError")

    @enabled("delayed_commit")
    @rule(
        i=st.integers(0, PROCS - 1),
        other=st.sampled_from(["gc", "compact", "append", "evolve", "txn", "heartbeat"]),
        mine=st.sampled_from(["append", "append", "evolve"]),
        at=st.integers(0, 2),
        advance=st.sampled_from([0.0, LEASE / 2, LEASE + 1]),
        k=st.integers(0, 3),
    )
    def delayed_commit(
        self, i: int, other: str, mine: str, at: int, advance: float, k: int
    ) -> None:
        """Process ``i`` computes a state version; before it lands (held at the stash
        append), time moves on and another process runs ``other``; then it lands."""
        j = (i + 1) % PROCS
        mine = "append" if mine in SKIP else mine
        other = "heartbeat" if other in SKIP else other
        seed, lower, col = next(self.seeds), self.upper, f"c{next(self.ncol)}"
        if mine == "append":
            self.P.start(i, "append", self.t(i), ks=[k], seeds=[seed], lower=lower, token=None,
                         pause_at=at)  # fmt: skip
        else:
            self.P.start(i, "evolve", self.t(i), col=col, pause_at=at)
        first = self.P.wait(i)
        paused = first is PAUSED
        if paused:
            FIG["delayed_commits"] += 1
            ENV.now += advance
            try:
                self._run_other(j, other)
            finally:  # the held commit lands (or fails) whatever the other did
                self.P.release(i)
                first = self.P.wait(i)
        assert first is not PAUSED
        if first.is_("Deadlock"):
            self.P.replace(i)
            raise AssertionError(f"deadlock in process {i}: {first.msg}")
        if mine == "append":
            self._append_outcome(i, first, k, seed, lower, f"delayed append by process {i}")
        else:
            self._evolve_outcome(i, first, col)
        if not paused:  # it had fewer stash appends than `at`: the other runs after it
            ENV.now += advance
            self._run_other(j, other)

    @enabled("delayed_append_gc")
    @rule(i=st.integers(0, PROCS - 1), at=st.integers(1, 2), k=st.integers(0, 3))
    def delayed_append_gc(self, i: int, at: int, k: int) -> None:
        """The case GC must get right: a writer's append is held past its lease while
        another process collects garbage (its part is then unreferenced and its writer
        looks dead); the append must then be refused, or its part kept."""
        self.delayed_commit(i, "gc", "append", at, LEASE + 1, k)

    def _run_other(self, j: int, other: str) -> None:
        if other == "gc":
            self.gc(j)
        elif other == "compact":
            self.compact(j)
        elif other == "append":
            self.append_plain(j, 0)
        elif other == "evolve":
            self.evolve(j)
        elif other == "txn":
            self.txn(j, 1)
        else:
            self.heartbeat(j)

    @enabled("append_plain")
    @rule(i=st.integers(0, PROCS - 1), k=st.integers(0, 3))
    def append_plain(self, i: int, k: int) -> None:
        seed, lower = next(self.seeds), self.upper
        r = self.P.call(i, "append", self.t(i), ks=[k], seeds=[seed], lower=lower, token=None)
        self._append_outcome(i, r, k, seed, lower, f"append by process {i}")

    @enabled("gc")
    @rule(i=st.integers(0, PROCS - 1))
    def gc(self, i: int) -> None:
        r = self.P.call(i, "gc", self.t(i))
        assert r.ok, f"GC by process {i}: {r!r}"
        FIG["gc_passes"] += 1

    @enabled("compact")
    @rule(i=st.integers(0, PROCS - 1))
    def compact(self, i: int) -> None:
        r = self.P.call(i, "compact", self.t(i))
        assert r.ok, f"compaction by process {i}: {r!r}"

    @enabled("heartbeat")
    @rule(i=st.integers(0, PROCS - 1))
    def heartbeat(self, i: int) -> None:
        r = self.P.call(i, "heartbeat", self.t(i))
        assert r.ok or r.is_("LeaseExpired"), f"heartbeat by process {i}: {r!r}"

    @enabled("clock_jump")
    @rule(jump=st.sampled_from(JUMPS))
    def clock_jump(self, jump: float) -> None:
        ENV.now += jump
        FIG["clock_jumps"] += 1

    @enabled("evolve")
    @rule(i=st.integers(0, PROCS - 1))
    def evolve(self, i: int) -> None:
        """Process ``i`` adds a column to the schema it knows (maybe not the newest)."""
        col = f"c{next(self.ncol)}"
        self._evolve_outcome(i, self.P.call(i, "evolve", self.t(i), col=col), col)

    def _evolve_outcome(self, i: int, r: Result, col: str) -> None:
        if r.ok:
            self.cols.append(col)
            FIG["columns_added"] += 1
        else:
            self._refused(f"adding column {col} by process {i}", r)
            self.P.call(i, "refresh", self.t(i))  # learn the newest, as a caller would
        newest = self._newest_cols()
        dropped = set(self.cols) - set(newest)
        assert not dropped, (
            f"adding column {col} by process {i} dropped {sorted(dropped)} (the newest "
            f"schema is {newest}): their acknowledged values now read as null"
        )

    @enabled("evolve_fresh")
    @rule(i=st.integers(0, PROCS - 1))
    def evolve_fresh(self, i: int) -> None:
        """Process ``i`` learns the newest schema, adds a column to it and writes a value
        in it (the other process's cache is left as it was: its reads and transactions
        must still see the column and the value)."""
        assert self.P.call(i, "refresh", self.t(i)).ok
        self.evolve(i)
        self.append_plain(i, 0)

    @enabled("refresh")
    @rule(i=st.integers(0, PROCS - 1))
    def refresh(self, i: int) -> None:
        assert self.P.call(i, "refresh", self.t(i)).ok

    @enabled("txn")
    @rule(i=st.integers(0, PROCS - 1), k=st.integers(0, 3))
    def txn(self, i: int, k: int) -> None:
        """A transaction writing the newest columns (the model's), by a process whose
        cached state may predate them."""
        seed = next(self.seeds)
        cols = self._newest_cols()
        r = self.P.call(i, "txn", self.t(i), ks=[k], seeds=[seed], cols=cols)
        if r.ok:
            ts = r.value
            assert ts >= self.upper, f"a transaction committed at {ts} below the upper"
            self._add(k, seed, cols)
            self.upper = ts + 1
            FIG["acknowledged"] += 1
            FIG["transactions"] += 1
        else:
            if not r.is_("LeaseExpired"):
                raise AssertionError(
                    f"a transaction with the newest schema {cols} by process {i} failed: {r!r}"
                )
            self._refused(f"transaction by process {i}", r, "LeaseExpired")

    @enabled("txn_stale_shard")
    @rule(i=st.integers(0, PROCS - 1), k=st.integers(0, 3), ahead=st.integers(1, 3))
    def txn_stale_shard(self, i: int, k: int, ahead: int) -> None:
        """A transaction over the model's shard and a side shard whose upper another
        process moved past the commit time since this process last read it: the commit
        is refused naming it, and ``commit_at(retry_ts())`` then commits."""
        j = (i + 1) % PROCS
        assert self.P.call(i, "side_touch", self.t(i), side=self.side).ok
        to = self.upper + ahead
        assert self.P.call(j, "side_advance", self.t(j), side=self.side, to=to).ok
        seed, cols = next(self.seeds), self._newest_cols()
        r = self.P.call(
            i, "txn_two", self.t(i), ks=[k], seeds=[seed], cols=cols, side=self.side, at=self.upper
        )
        if not r.ok and r.is_("LeaseExpired"):
            self._refused(f"transaction over two shards by process {i}", r, "LeaseExpired")
            return
        assert r.ok, f"a transaction retried at retry_ts() failed: {r!r}"
        ts = r.value["ts"]
        assert ts >= self.upper, f"a transaction committed at {ts} below the upper"
        self._add(k, seed, cols)
        self.upper = ts + 1
        FIG["acknowledged"] += 1
        FIG["transactions"] += 1
        FIG["txn_retried"] += r.value["retried"]

    @precondition(lambda self: self.upper > 0 and "snapshot_many" not in SKIP)
    @rule(i=st.integers(0, PROCS - 1))
    def snapshot_many(self, i: int) -> None:
        """``snapshot_many`` at an explicit time reads every acknowledged value, in the
        newest schema, from a process whose cache may be older."""
        as_of = self.upper - 1
        r = self.P.call(i, "snapshot_many", self.t(i), as_of=as_of)
        assert r.ok, f"snapshot_many by process {i}: {r!r}"
        names = self._newest_cols()
        got: Counter[tuple[Any, ...]] = Counter()
        for row in r.value:
            got[(row["k"], *(row.get(c) for c in names))] += row["_diff"]
        assert got == self._expected(names), (
            f"snapshot_many by process {i} as of {as_of} differs from the acknowledged "
            f"writes (columns {names})"
        )

    @enabled("threads")
    @rule(i=st.integers(0, PROCS - 1))
    def threads(self, i: int) -> None:
        """Threads sharing one client: appends, transactions, a reader, background
        compaction, all at once."""
        cols = self._newest_cols()
        r = self.P.call(i, "threads", self.t(i), n=3 if not LONG else 6, cols=cols)
        assert r.ok, f"threads in process {i}: {r!r}"
        errs = [e for e in r.value["errors"] if not e.startswith("LeaseExpired")]
        assert not errs, f"threads in process {i} failed: {errs}"
        times = [t for t, *_ in r.value["acked"]]
        assert len(times) == len(set(times)), "two acknowledged writes at one time"
        for _t, k, seed, wcols in r.value["acked"]:
            self._add(k, seed, wcols)
            FIG["acknowledged"] += 1
            FIG["thread_writes"] += 1
        self.upper = max([self.upper, *(t + 1 for t in times)])
        FIG["thread_runs"] += 1

    @enabled("transmit_twice")
    @rule(i=st.integers(0, PROCS - 1), k=st.integers(0, 3))
    def transmit_twice(self, i: int, k: int) -> None:
        """One transmitted batch decoded twice: its second append must be refused."""
        seed, lower = next(self.seeds), self.upper
        r = self.P.call(i, "transmit_twice", self.t(i), k=k, seed=seed, lower=lower)
        if not r.ok:
            self._refused(f"transmitted batch by process {i}", r)
            return
        self._add(k, seed, r.value["cols"])
        self.upper = lower + 1
        FIG["acknowledged"] += 1
        second = r.value["second"]
        if second is None:
            FIG["duplicated"] += 1
            raise AssertionError(
                "one transmitted batch, decoded twice, was appended twice (duplicated)"
            )
        assert self._shard_upper() == self.upper, f"a refused copy committed: {second}"

    @enabled("big_diff")
    @rule(i=st.integers(0, PROCS - 1))
    def big_diff(self, i: int) -> None:
        """A diff of ``2**62`` on one row (twice overflows int64): refused at append
        time, or read back exactly; a sum beyond int64 must then fail reads with an
        error naming the shard (not a wrong count), and a retraction of the excess,
        as the error advises, makes the shard readable again."""
        seed, lower = 0, self.upper
        r = self.P.call(
            i, "append", self.t(i), ks=[9], seeds=[seed], lower=lower, token=None, diff=2**62
        )
        if not r.ok:
            self._refused(f"append of diff 2**62 by process {i}", r)
            return
        assert self._shard_upper() == lower + 1
        self._add(9, seed, r.value, 2**62)
        self.upper = lower + 1
        FIG["acknowledged"] += 1
        FIG["big_diffs"] += 1
        if all(-(2**63) <= d < 2**63 for d in self.model.values()):
            return
        try:
            self._snapshot(self._newest_cols(), self.upper - 1)
        except Exception as e:  # the read must fail, naming the shard
            assert self.shard in str(e), f"a diff overflow reported without the shard: {e!r}"
        else:
            raise AssertionError("diffs summing beyond int64 read without an error")
        FIG["overflows_reported"] += 1
        lower = self.upper
        r = self.P.call(
            i, "append", self.t(i), ks=[9], seeds=[seed], lower=lower, token=None, diff=-(2**62)
        )
        assert r.ok, f"retracting an overflowing diff was refused: {r!r}"
        self._add(9, seed, r.value, -(2**62))
        self.upper = lower + 1
        FIG["acknowledged"] += 1

    # -------------------------------------------------------------- invariant
    @invariant()
    def reads_back_and_fsck_clean(self) -> None:
        if not self.cols:  # before setup
            return
        st = self.c.inspect(self.shard)  # one fresh read of the latest state
        assert st.upper.as_option() == self.upper, "the shard's upper is not the model's"
        newest = list(st.value_schema.names)
        assert set(newest) == set(self.cols), (
            f"the newest schema has columns {newest}, the acknowledged evolutions {self.cols}"
        )
        if self.upper > 0:
            snap = self._snapshot(newest, self.upper - 1)
            got: Counter[tuple[Any, ...]] = Counter()
            cols = [snap[c].to_pylist() for c in ["k", *newest, "_diff"]]
            for row in zip(*cols, strict=True):
                got[tuple(row[:-1])] += row[-1]
            want = self._expected(newest)
            if got != want:
                FIG["lost"] += 1
                missing, extra = want - got, got - want
                raise AssertionError(
                    f"read back differs from the acknowledged writes: missing "
                    f"{dict(list(missing.items())[:4])}, extra {dict(list(extra.items())[:4])}"
                )
        report = fsck(self.c, self.shard)
        assert report.ok, report.damage()

    def _snapshot(self, newest: list[str], as_of: int) -> Any:
        vs = value_schema(newest)
        if self.reader is None or not self.reader.value_schema.equals(vs):
            self.reader = self.c.open_reader(self.shard, KS, vs)
        try:
            return self.reader.snapshot(as_of)
        except LeaseExpired:  # another process's clock, ahead, expired it
            self.reader = self.c.open_reader(self.shard, KS, vs)
            return self.reader.snapshot(as_of)

    def teardown(self) -> None:
        if self.reader is not None:
            try:
                self.reader.expire()
            except Exception:  # expired by another process's clock: nothing to release
                pass


@pytest.fixture(scope="module")
def procs() -> Iterator[Procs]:
    """The model's processes, spawned once for the tests of this module."""
    p = Procs()
    try:
        yield p
    finally:
        p.close()


def _run(procs: Procs, url: str, tmp_path: Path, label: str, examples: int) -> None:
    FIG.clear()
    ENV.now = T0
    ENV.url, ENV.blob = url, f"file://{tmp_path}/blob"
    ENV.stash = Stash.open(url, fenced=False)
    ENV.client = PersistClient(ENV.stash, ENV.blob, clock=lambda: ENV.now, **WORKER_KW)
    ENV.procs = procs
    try:
        run_state_machine_as_test(
            Model,
            settings=settings(
                max_examples=runs(examples, 20),
                stateful_step_count=runs(15, 30),
                deadline=None,
                suppress_health_check=list(HealthCheck),
                phases=[p for p in Phase if p != Phase.shrink or SHRINK],
            ),
        )
    finally:
        for i in range(PROCS):  # their connections go before the test's database does
            procs.call(i, "close", ENV.now)
        ENV.client.close()
        ENV.stash.close()
    clean = {"runs": FIG["runs"], "lost": 0, "duplicated": 0, "partial": 0, "unclear": 0}
    record(
        f"lifecycle model, {PROCS} processes with skewed clocks on {label}: delayed commits, "
        "reused tokens, concurrent schema evolution, threads sharing a client",
        **clean,
        unreadable=0,
        faults=FIG["delayed_commits"] + FIG["clock_jumps"] + FIG["lost_acks"],
        acknowledged=FIG["acknowledged"],
        refused=FIG["refused"],
        refused_expired=FIG["refused_expired"],
        races_lost=FIG["races_lost"],
        delayed_commits=FIG["delayed_commits"],
        skew_beyond_lease=FIG["skew_beyond_lease"],
        tokens_reused=FIG["tokens_reused"],
        retries=FIG["retries"],
        lost_acks=FIG["lost_acks"],
        columns_added=FIG["columns_added"],
        transactions=FIG["transactions"],
        transactions_retried=FIG["txn_retried"],
        thread_writes=FIG["thread_writes"],
        gc_passes=FIG["gc_passes"],
        deadlocks=0,
    )


@pytest.mark.campaign
def test_lifecycle_processes_sqlite(procs: Procs, tmp_path: Path) -> None:
    _run(procs, f"sqlite:///{tmp_path}/stash.db", tmp_path, "one SQLite file", 4)


@pytest.mark.campaign
@pytest.mark.postgres
def test_lifecycle_processes_postgres(procs: Procs, tmp_path: Path, postgres_url: str) -> None:
    from tests.support.dbutil import migrate_to_head

    migrate_to_head(postgres_url)
    _run(procs, postgres_url, tmp_path, "Postgres", 3)
