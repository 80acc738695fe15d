"""A hypothesis stateful test of a shard against a reference multiset of updates.

Random appends (with retractions, through compare_and_append, the batch builder, several
batches in one compare_and_append_batch, rewritten batches), wrong-upper appends (which
must commit nothing), since downgrades, compactions, GC passes and reopenings of the
client.  After every step, every readable ``as_of`` (``since <= as_of < upper``) gives
exactly the reference's consolidated contents, a listen started at the beginning has
emitted exactly the reference's updates up to its frontier, the shard's since never
passed the reader's hold, and the Spine validates.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from persist import (
    FileBlob,
    MemoryBlob,
    PersistClient,
    UpperMismatch,
    collect_garbage,
)
from persist.blob import Blob
from stash import Antichain, Stash
from tests.reliability.campaign import runs

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])

Update = tuple[int, str, int, int]  # (k, v, t, d)

updates_st = st.lists(
    st.tuples(
        st.integers(0, 4),
        st.sampled_from(["a", "b"]),
        st.integers(0, 3),  # time offset inside the append's range
        st.integers(-2, 2).filter(lambda d: d != 0),
    ),
    max_size=6,
)


def consolidated(updates: list[Update], as_of: int) -> Counter[tuple[int, str]]:
    acc: Counter[tuple[int, str]] = Counter()
    for k, v, t, d in updates:
        if t <= as_of:
            acc[(k, v)] += d
    return Counter({kv: d for kv, d in acc.items() if d != 0})


def as_counter(table: pa.Table, as_of: int) -> Counter[tuple[int, str]]:
    out: Counter[tuple[int, str]] = Counter()
    for r in table.to_pylist():
        assert r["_time"] == as_of, r
        assert r["_diff"] != 0, r
        assert (r["k"], r["v"]) not in out, ("not consolidated", r)
        out[(r["k"], r["v"])] = r["_diff"]
    return out


class ShardMachineTest(RuleBasedStateMachine):
    use_files = False

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="persist-stateful-"))
        if self.use_files:
            self.stash = Stash.open(f"sqlite:///{self.tmp}/stash.db", fenced=False)
            self.blob: Blob = FileBlob(self.tmp / "blob", fsync=False)
        else:
            self.stash = Stash.open("memory://", fenced=False)
            self.blob = MemoryBlob()
        self.inline_max = 4096
        self._open()
        self.updates: list[Update] = []
        self.upper = 0
        self.hold = 0  # the reader's since hold
        # A listen from a separate client, never reopened.
        self.lclient = PersistClient(self.stash, self.blob, compaction="off")
        _, self.lr = self.lclient.open("shard", KS, VS)
        self.listen = self.lr.listen(0, hold_interval_seconds=0)
        self.heard: list[Update] = []
        self.listen_frontier = 1

    def _open(self) -> None:
        self.client = PersistClient(
            self.stash,
            self.blob,
            compaction="off",
            inline_max_bytes=self.inline_max,
            target_part_bytes=200,
        )
        self.w, self.r = self.client.open("shard", KS, VS)

    def teardown(self) -> None:
        self.listen.close()
        self.client.close()
        self.lclient.close()
        self.stash.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # ------------------------------------------------------------------ rules
    def _rows(self, ups: list[Any], width: int) -> list[Any]:
        return [(((k,), (v,)), self.upper + (dt % width), d) for k, v, dt, d in ups]

    def _record(self, ups: list[Any], width: int) -> None:
        for k, v, dt, d in ups:
            self.updates.append((k, v, self.upper + (dt % width), d))
        self.upper += width

    @rule(ups=updates_st, width=st.integers(1, 3))
    def compare_and_append(self, ups: list[Any], width: int) -> None:
        self.w.compare_and_append(self._rows(ups, width), self.upper, self.upper + width)
        self._record(ups, width)

    @rule(ups=updates_st, width=st.integers(1, 3), split=st.integers(0, 6))
    def append_two_batches(self, ups: list[Any], width: int, split: int) -> None:
        rows = self._rows(ups, width)
        b1 = self.w.batch(rows[:split], self.upper, self.upper + width)
        bld = self.w.builder(self.upper)
        bld.add(rows[split:])
        b2 = bld.finish(self.upper + width)
        self.w.compare_and_append_batch([b1, b2], self.upper, self.upper + width)
        self._record(ups, width)

    @rule(ups=updates_st, width=st.integers(1, 3))
    def append_rewritten_batch(self, ups: list[Any], width: int) -> None:
        # Written as if at time 0.., then moved to the current upper.
        rows = [(((k,), (v,)), dt % width, d) for k, v, dt, d in ups]
        b = self.w.batch(rows, 0, width)
        b.rewrite_ts(Antichain.from_elem(self.upper), Antichain.from_elem(self.upper + width))
        self.w.compare_and_append_batch([b], self.upper, self.upper + width)
        for k, v, dt, d in ups:
            self.updates.append((k, v, max(dt % width, self.upper), d))
        self.upper += width

    @rule(ups=updates_st, wrong=st.integers(1, 3))
    def append_with_wrong_upper(self, ups: list[Any], wrong: int) -> None:
        exp = self.upper + wrong
        rows = [(((k,), (v,)), exp, d) for k, v, _, d in ups]
        with pytest.raises(UpperMismatch) as e:
            self.w.compare_and_append(rows, exp, exp + 1)
        assert e.value.current == Antichain.from_elem(self.upper)

    @rule(delta=st.integers(0, 3))
    def downgrade_since(self, delta: int) -> None:
        self.hold = min(self.hold + delta, self.upper + 1)
        self.r.downgrade_since(self.hold)
        # The listen's handle follows (its listen holds its own lease): the shard's
        # since moves, and merge requests made before it moved meet a later since.
        self.lr.downgrade_since(self.hold)

    @rule()
    def compact(self) -> None:
        before = self.client.inspect("shard")
        old = set(before.trace.batches())
        self.client.compactor.compact_once("shard")
        # Outputs are consolidated at the since of the (fresh) state the pass read, not
        # at the since their merge began at; nothing else moves it meanwhile.
        for b in self.client.inspect("shard").trace.batches():
            if b not in old and b.len:
                assert b.desc.since == before.since, (b.desc, before.since)

    @rule()
    def gc(self) -> None:
        collect_garbage(self.client, "shard", grace_seconds=0)

    @rule(inline=st.booleans())
    def reopen(self, inline: bool) -> None:
        self.r.expire()
        self.client.close()
        self.inline_max = 4096 if inline else 0
        self._open()
        # The new reader starts at the shard's since; move it to the model's hold.
        assert self.r.since <= Antichain.from_elem(self.hold)
        self.r.downgrade_since(self.hold)

    @precondition(lambda self: self.upper > 0)
    @rule()
    def listen_poll(self) -> None:
        self._drain_listen()

    def _drain_listen(self) -> None:
        for ev in self.listen.poll():
            if ev.kind == "updates":
                for r in ev.updates.to_pylist():
                    self.heard.append((r["k"], r["v"], r["_time"], r["_diff"]))
            else:
                t = ev.progress.as_option()
                assert t is not None
                self.listen_frontier = t

    # ------------------------------------------------------------- invariants
    @invariant()
    def reads_match_the_reference(self) -> None:
        st_ = self.client.inspect("shard")
        st_.trace.validate()
        assert st_.upper == Antichain.from_elem(self.upper)
        since = st_.since.as_option()
        assert since is not None and since <= self.hold  # never passes the live reader
        candidates = sorted({since, self.upper - 1, (since + self.upper) // 2, self.hold})
        for as_of in candidates:
            if since <= as_of < self.upper:
                got = as_counter(self.r.snapshot(as_of), as_of)
                assert got == consolidated(self.updates, as_of), as_of
        # Every referenced blob part exists.
        for key in st_.referenced_blob_keys():
            assert self.blob.get(key) is not None, key

    @invariant()
    def listen_heard_exactly_the_updates(self) -> None:
        self._drain_listen()
        want: Counter[tuple[int, str, int]] = Counter()
        for k, v, t, d in self.updates:
            if 0 < t < self.listen_frontier:
                want[(k, v, t)] += d
        got: Counter[tuple[int, str, int]] = Counter()
        for k, v, t, d in self.heard:
            got[(k, v, t)] += d
        assert {x: n for x, n in got.items() if n} == {x: n for x, n in want.items() if n}


class FilesShardMachineTest(ShardMachineTest):
    use_files = True


TestShardStateful = pytest.mark.sized(ShardMachineTest.TestCase)
TestShardStateful.settings = settings(
    max_examples=runs(15, 60),
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

TestShardStatefulFiles = FilesShardMachineTest.TestCase
TestShardStatefulFiles.settings = settings(
    max_examples=10,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
