"""Hand-off of writers, as a hypothesis state machine against a simple model: tasks
write batches and hand their bytes out, their handles end (the writer is handed off),
time passes (GC runs every step) and a driver appends or deletes the bytes it decodes.

Invariants checked after every step: the shard holds exactly the rows of the appends
that succeeded; an append of bytes whose writer is still within its lease or hand-off
lease succeeds; one outside both is refused and commits nothing; a handed-off writer
stays in the state exactly while some of its batches are neither appended nor deleted
and its hand-off lease has not run out.  Clocks are injected (seconds)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow as pa
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from persist import LeaseExpired, MemoryBlob, PartsMissing, PersistClient, collect_garbage
from stash import Antichain, Stash
from tests.support.clock import Clock

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])
LEASE = 600.0  # writer lease (s)
HANDOFF = 3 * 3600.0  # hand-off lease (s)
SHARD = "handoff"


class Task:
    """An executor task's writer: its handle, its payloads and when it ended."""

    def __init__(self, handle: Any, started: float) -> None:
        self.handle = handle
        self.writer_id: str = handle.writer_id
        self.last_beat = started  # its last heartbeat (registration, upload)
        self.ended: float | None = None  # when its handle expired (the hand-off)
        self.outstanding = 0  # payloads neither appended nor deleted
        self.handed_off = False  # whether its end handed the writer off (lease renewed)


class HandOff(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.stash = Stash.open("memory://", fenced=False)
        self.clock = Clock()
        self.blob = MemoryBlob()
        kw: dict[str, Any] = {
            "compaction": "off",
            "inline_max_bytes": 0,
            "writer_lease_seconds": LEASE,
            "handoff_lease_seconds": HANDOFF,
            "reader_lease_seconds": 1000 * HANDOFF,
            "clock": self.clock,
        }
        self.executor = PersistClient(self.stash, self.blob, **kw)
        self.driver = PersistClient(self.stash, self.blob, **kw)
        self.gc = PersistClient(self.stash, self.blob, **kw)
        _w, self.reader = self.driver.open(SHARD, KS, VS)
        self.tasks: list[Task] = []
        self.transit: list[tuple[Task, bytes, int]] = []  # (task, payload, key)
        self.rows: Counter[int] = Counter()
        self.next_key = 0

    # ------------------------------------------------------------------ rules
    @rule()
    def start_task(self) -> None:
        h = self.executor.open_writer(SHARD, KS, VS)
        self.tasks.append(Task(h, self.clock.now))

    @precondition(lambda self: any(t.ended is None for t in self.tasks))
    @rule(data=st.data())
    def task_writes(self, data: st.DataObject) -> None:
        open_tasks = [t for t in self.tasks if t.ended is None]
        t = data.draw(st.sampled_from(open_tasks))
        if self.clock.now > t.last_beat + LEASE:
            return  # its lease ran out: a real task would have failed already
        k = self.next_key
        self.next_key += 1
        payload = t.handle.batch([(((k,), (f"v{k}",)), 0, 1)], 0, 1).into_transmittable()
        t.last_beat = self.clock.now  # the upload registered or renewed it
        t.outstanding += 1
        self.transit.append((t, payload, k))

    @precondition(lambda self: any(t.ended is None for t in self.tasks))
    @rule(data=st.data())
    def task_ends(self, data: st.DataObject) -> None:
        open_tasks = [t for t in self.tasks if t.ended is None]
        t = data.draw(st.sampled_from(open_tasks))
        t.handle.expire()
        t.ended = self.clock.now
        if t.outstanding and self.clock.now <= t.last_beat + LEASE:
            t.last_beat = self.clock.now  # the hand-off renewed it
            t.handed_off = True

    @rule(seconds=st.sampled_from([60.0, 450.0, 1500.0, 4000.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds
        self.reader.heartbeat()
        collect_garbage(self.gc, SHARD, grace_seconds=LEASE)

    def _live(self, t: Task) -> bool:
        # A task whose lease ran out before it ended was never handed off: its bytes
        # lived only as long as its own lease (found by a fresh-clone run: the model gave
        # them the hand-off lease, while GC had rightly deleted them).
        lease = HANDOFF if t.ended is not None and t.outstanding and t.handed_off else LEASE
        if t.ended is not None and not t.outstanding:
            return False
        return self.clock.now <= t.last_beat + lease

    @precondition(lambda self: bool(self.transit))
    @rule(data=st.data(), append=st.booleans())
    def driver_takes(self, data: st.DataObject, append: bool) -> None:
        i = data.draw(st.integers(0, len(self.transit) - 1))
        t, payload, k = self.transit.pop(i)
        live = self._live(t)
        w = self.driver.open_writer(SHARD, KS, VS)
        batch = w.batch_from_transmittable(payload)
        if not append:
            batch.delete()
            t.outstanding -= 1
            w.expire()
            return
        upper = w.upper.as_option()
        assert upper is not None
        batch.rewrite_ts(Antichain.from_elem(upper), Antichain.from_elem(upper + 1))
        if live:
            w.compare_and_append_batch([batch], upper, upper + 1)
            self.rows[k] += 1
            t.outstanding -= 1
        else:
            try:
                w.compare_and_append_batch([batch], upper, upper + 1)
            except (LeaseExpired, PartsMissing):
                assert w.upper == Antichain.from_elem(upper)  # nothing committed
                batch.delete()
                t.outstanding -= 1
            else:
                raise AssertionError(f"bytes of writer {t.writer_id} past every lease appended")
        w.expire()

    # ------------------------------------------------------------- invariants
    @invariant()
    def rows_are_exactly_the_successful_appends(self) -> None:
        upper = self.driver.inspect(SHARD).upper.as_option()
        assert upper is not None
        if upper == 0:
            assert not self.rows
            return
        snap = self.reader.snapshot(upper - 1)
        got = Counter(snap["k"].to_pylist())
        assert got == self.rows

    @invariant()
    def handed_off_writers_stay_exactly_while_needed(self) -> None:
        writers = self.driver.inspect(SHARD).writers
        for t in self.tasks:
            if t.ended is None:
                continue
            if t.outstanding and self.clock.now <= t.last_beat + HANDOFF:
                if t.last_beat >= t.ended:  # it was live when handed off
                    assert writers[t.writer_id].outstanding == t.outstanding
            elif not t.outstanding:
                assert t.writer_id not in writers

    def teardown(self) -> None:
        for c in (self.executor, self.driver, self.gc):
            c.close()
        self.stash.close()


TestHandOff = HandOff.TestCase
TestHandOff.settings = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
