"""Catch-up against a full read, over every command that writes a shard version.

Three clients share one shard (and a second one, for transactions) in a SQLite stash
and a blob directory, each with its own cached versions, compaction mode, rollup bound
(``max_diffs``: 0, 1, 2, 32) and part format (blob parts with statistics, or inline
parts): appends on stale caches, transactions over both shards, compaction, GC (which
truncates the log below the head's rollup) with leases expiring on an injected clock,
maintenance rollups (some whose writer dies before truncating the log below them), a
value schema evolving, readers moving their since.  After every
step each client's machine catches up (:meth:`persist.machine.ShardMachine.refresh`) and
must hold exactly the stored head: the state a full read decodes
(:meth:`~persist.machine.ShardMachine.fetch`), the head's entries and their texts, and
the head's stored layout (the rollup and the diffs after it, which the next version's
plan builds on).  Finally every acknowledged row reads back exactly once.

(``tests/persist/test_rollup_maintenance.py`` races two machines over appends, readers
and rollups of inline parts and compares states; this adds parts with statistics,
schema evolution, transactions, compaction, GC truncation, lease expiry, and the stored
layout.)
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from persist import LeaseExpired, PersistClient, UpperMismatch
from persist.consensus import Consensus
from persist.gc import collect_garbage
from persist.machine import ShardMachine
from stash import Antichain, Stash
from tests.reliability.campaign import runs

pytestmark = pytest.mark.sized

KS = pa.schema([("k", pa.string())])
V0 = pa.schema([("z", pa.int64()), ("a", pa.string())])
V1 = pa.schema([("z", pa.int64()), ("a", pa.string()), ("w", pa.float64())])

clients_ = st.integers(0, 2)


class CatchUp(RuleBasedStateMachine):
    @initialize(
        modes=st.lists(st.sampled_from(["off", "inline"]), min_size=3, max_size=3),
        bounds=st.lists(st.sampled_from([0, 1, 2, 32]), min_size=3, max_size=3),
        inline=st.lists(st.booleans(), min_size=3, max_size=3),
    )
    def setup(self, modes: list[str], bounds: list[int], inline: list[bool]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="catchup"))
        self.stash = Stash.open(f"sqlite:///{self.dir / 's.db'}", fenced=False)
        self.now = [1_000_000.0]
        self.clients = [
            PersistClient(
                self.stash,
                f"file://{self.dir / 'blob'}",
                compaction=modes[i],  # type: ignore[arg-type]
                clock=lambda: self.now[0],
                reader_lease_seconds=30,
                writer_lease_seconds=30,
                gc_interval_seconds=None,
                inline_max_bytes=1 << 16 if inline[i] else 0,
            )
            for i in range(3)
        ]
        for c, b in zip(self.clients, bounds, strict=True):
            c.consensus.max_diffs = b
        self.vs = V0  # the newest value schema
        self.handles = [c.open("t", KS, V0) for c in self.clients]
        self.hvs = [V0, V0, V0]  # each client's handles' value schema
        for c in self.clients:
            c.open_writer("u", KS, V0)
        self.acked: Counter[tuple[str, int]] = Counter()
        self.n = 0

    def _row(self, k: str, vs: pa.Schema) -> tuple[tuple[str], tuple[Any, ...]]:
        self.n += 1
        v: tuple[Any, ...] = (self.n, f"a{self.n}")
        if vs is V1:
            v += (None,)
        return (k,), v

    @rule(i=clients_, fresh=st.booleans())
    def append(self, i: int, fresh: bool) -> None:
        w, _ = self.handles[i]
        lo = (w.fetch_recent_upper() if fresh else w.upper).as_option()
        assert lo is not None
        row = self._row(f"c{i}", self.hvs[i])
        for _ in range(3):
            try:
                w.compare_and_append(
                    [(row, lo, 1)], Antichain.from_elem(lo), Antichain.from_elem(lo + 1)
                )
                break
            except UpperMismatch as e:
                lo = e.current.as_option()
            except LeaseExpired:  # GC expired it (the clock moved past its lease)
                self.reopen(i)
                w = self.handles[i][0]
                row = (row[0], row[1][:2] + ((None,) if self.hvs[i] is V1 else ()))
        else:
            raise AssertionError("the append never landed")
        self.acked[(row[0][0], row[1][0])] += 1

    @rule(i=clients_)
    def transaction(self, i: int) -> None:
        k, v = self._row(f"x{i}", self.vs)
        cols = {"k": list(k), "z": [v[0]], "a": [v[1]]}
        if self.vs is V1:
            cols["w"] = pa.array([None], pa.float64())
        txn = self.clients[i].begin()
        txn.write("t", pa.table(cols), key_schema=KS, value_schema=self.vs)
        txn.write("u", pa.table({"k": ["u"], "z": [1], "a": ["u"]}))
        txn.commit()
        self.acked[(k[0], v[0])] += 1

    @rule(i=clients_)
    def compact(self, i: int) -> None:
        self.clients[i].compactor.compact_once("t")

    @rule(i=clients_)
    def rollup(self, i: int) -> None:
        self.handles[i][0]._machine.write_rollup()

    @rule(i=clients_)
    def rollup_then_crash(self, i: int) -> None:
        # A rollup whose writer dies before truncating the rows below it (a rollup
        # owed or not): older rollups and diffs stay in the log until GC truncates.
        cons = self.clients[i].consensus
        cons.rollup_due = lambda stored: bool(stored.diffs)  # type: ignore[method-assign]
        cons._after_commit = lambda entries: None  # type: ignore[method-assign]
        try:
            self.handles[i][0]._machine.write_rollup()
        finally:
            del cons.rollup_due, cons._after_commit

    @rule(i=clients_, seconds=st.sampled_from([1, 40]))
    def gc(self, i: int, seconds: int) -> None:
        self.now[0] += seconds  # past every lease with 40: expired ones go
        collect_garbage(self.clients[i], "t", grace_seconds=0)

    @rule(i=clients_)
    def evolve(self, i: int) -> None:
        self.vs = self.hvs[i] = V1
        self.handles[i] = self.clients[i].open("t", KS, V1)

    @rule(i=clients_)
    def reopen(self, i: int) -> None:
        # A client whose lease may have expired opens anew (on the newest schema).
        self.hvs[i] = self.vs
        self.handles[i] = self.clients[i].open("t", KS, self.vs)

    @rule(i=clients_)
    def since(self, i: int) -> None:
        w, r = self.handles[i]
        up = w.fetch_recent_upper().as_option()
        if up:
            try:
                r.downgrade_since(Antichain.from_elem(up - 1))
            except LeaseExpired:  # GC expired it (the clock moved past its lease)
                self.reopen(i)

    @invariant()
    def caught_up_is_the_stored_head(self) -> None:
        if not hasattr(self, "clients"):
            return
        for c in self.clients:
            for sid, m in list(c._machines.items()):
                got = m.refresh()
                head = Consensus(self.stash).head(sid)
                assert head is not None
                full = ShardMachine(Consensus(self.stash), sid).fetch()
                assert got == full
                v = m._cache.version  # type: ignore[union-attr]
                assert (v.seqno, v.texts, v.data) == (head.seqno, head.texts, head.data)
                assert v.stored is not None and head.stored is not None
                assert dict(v.stored.base) == dict(head.stored.base)
                assert v.stored.diffs == head.stored.diffs
                assert v.stored.diff_chars == head.stored.diff_chars

    def teardown(self) -> None:
        if not hasattr(self, "clients"):
            return
        try:
            c = self.clients[0]
            w, r = c.open("t", KS, self.vs)
            up = w.fetch_recent_upper().as_option()
            got: Counter[tuple[str, int]] = Counter()
            if up:
                for row in r.snapshot(up - 1).to_pylist():
                    got[(row["k"], row["z"])] += row["_diff"]
            assert got == self.acked
        finally:
            for c in self.clients:
                c.close()
            self.stash.close()


TestCatchUp = CatchUp.TestCase
TestCatchUp.settings = settings(
    max_examples=runs(6, 100),
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
