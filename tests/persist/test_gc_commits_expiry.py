"""GC commits its judgement that a writer is gone before it deletes that writer's keys,
and a writer's commit is refused once the state it commits on no longer registers it.

The defect: a writer checked its lease when computing the new state, its stash commit
landed later; GC, in another process, judged the writer dead from a state without the
writer's renewal (or with a clock ahead by more than the lease), deleted the part the
writer had just uploaded, and the writer's commit then landed, acknowledged, pointing at
the deleted part.  Each case runs two clients on one SQLite stash file and one blob
directory (as two processes would), with injected clocks; one case runs GC in a
separate process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist import FileBlob, LeaseExpired, PersistClient, collect_garbage, fsck
from stash import Antichain, Stash
from tests.support.clock import Clock

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])
LEASE = 60.0


def upd(k: int, v: str, t: int, d: int = 1) -> Any:
    return ((k,), (v,)), t, d


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Callable[[Clock], PersistClient]]:
    """Clients on one SQLite stash file and one blob directory, each with its own stash
    connection and clock (as separate processes would have)."""
    made: list[tuple[PersistClient, Stash]] = []

    def mk(clock: Clock) -> PersistClient:
        s = Stash.open(f"sqlite:///{tmp_path / 'stash.db'}", fenced=False)
        c = PersistClient(
            s,
            FileBlob(tmp_path / "blob"),
            clock=clock,
            compaction="off",
            inline_max_bytes=0,
            writer_lease_seconds=LEASE,
            reader_lease_seconds=3600,
            gc_grace_seconds=0,
        )
        made.append((c, s))
        return c

    yield mk
    for c, s in made:
        c.close()
        s.close()


def _delay_commit(c: PersistClient, during: Callable[[], None]) -> list[int]:
    """Run ``during`` once, inside the next compare-and-set of ``c``'s consensus: after
    the writer computed its new state, before its stash commit lands."""
    original = c.consensus.compare_and_set
    calls: list[int] = []

    def delayed(*a: Any, **kw: Any) -> bool:
        if not calls:
            calls.append(1)
            during()
        return original(*a, **kw)

    c.consensus.compare_and_set = delayed  # type: ignore[method-assign]
    return calls


def _assert_nothing_committed(c: PersistClient, name: str) -> None:
    """The shard still holds only the first append: upper 1, no part missing."""
    assert c.inspect(name).upper == Antichain.from_elem(1)
    assert fsck(c, name).ok, "the state references a deleted part"


def _writer_with_one_append(c: PersistClient, name: str) -> Any:
    w, r = c.open(name, KS, VS)
    w.compare_and_append([upd(0, "base", 0)], 0, 1)
    return w, r


def test_gc_between_the_writers_state_and_its_commit_is_committed_first(env: Any) -> None:
    """The writer's lease runs out while its commit is in flight (time passes between
    computing the state and the stash commit landing); GC runs in between.  Before the
    fix GC deleted the freshly uploaded part and the commit then landed on top of it."""
    clock = Clock()
    c = env(clock)
    w, r = _writer_with_one_append(c, "inflight")
    gc_clock = Clock(clock.now)
    gc = env(gc_clock)

    def lease_runs_out_and_gc_runs() -> None:
        clock.now += LEASE + 1
        gc_clock.now = clock.now
        report = collect_garbage(gc, "inflight", grace_seconds=0)
        assert report.kept_live_writer == 0  # the writer is judged gone: committed first

    calls = _delay_commit(c, lease_runs_out_and_gc_runs)
    with pytest.raises(LeaseExpired):
        w.compare_and_append([upd(1, "a", 1)], 1, 2)
    assert calls
    assert w.writer_id not in gc.inspect("inflight").writers
    _assert_nothing_committed(gc, "inflight")


def test_gc_with_a_clock_ahead_by_more_than_the_lease_never_loses_a_commit(env: Any) -> None:
    """GC's clock is ahead of the writer's by more than the writer lease.  The writer's
    own clock says it is live when it commits; GC's committed judgement says it is gone,
    and that judgement is what the commit is decided on: refused, nothing committed, and
    never an acknowledged append pointing at a deleted part."""
    clock = Clock()
    c = env(clock)
    w, r = _writer_with_one_append(c, "skew")
    gc = env(Clock(clock.now + 2 * LEASE))
    deleted: list[str] = []

    def gc_runs() -> None:
        deleted.extend(collect_garbage(gc, "skew", grace_seconds=0).deleted_abandoned)

    _delay_commit(c, gc_runs)
    with pytest.raises(LeaseExpired):
        w.compare_and_append([upd(1, "a", 1)], 1, 2)
    assert deleted  # GC did delete the writer's fresh part: the commit had to be refused
    _assert_nothing_committed(gc, "skew")
    assert r.snapshot(0).num_rows == 1


def test_gc_in_another_process_with_a_clock_ahead(env: Any, tmp_path: Path) -> None:
    """The same with GC run by a separate process (its own stash connection and clock,
    ahead of the writer's by twice the lease) while the writer's commit is in flight."""
    clock = Clock()
    c = env(clock)
    w, r = _writer_with_one_append(c, "procs")
    script = textwrap.dedent(
        f"""
        import time
        from persist import FileBlob, PersistClient, collect_garbage
        from stash import Stash
        s = Stash.open({f"sqlite:///{tmp_path / 'stash.db'}"!r}, fenced=False)
        c = PersistClient(s, FileBlob({str(tmp_path / "blob")!r}), compaction="off",
                          clock=lambda: {clock.now + 2 * LEASE!r})
        print(len(collect_garbage(c, "procs", grace_seconds=0).deleted_abandoned))
        c.close(); s.close()
        """
    )
    out: list[str] = []

    def gc_process() -> None:
        root = str(Path(__file__).resolve().parents[2])  # this checkout's persist
        env_vars = {**os.environ, "PYTHONPATH": root}
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env_vars
        )
        assert done.returncode == 0, done.stderr
        out.append(done.stdout.strip())

    _delay_commit(c, gc_process)
    with pytest.raises(LeaseExpired):
        w.compare_and_append([upd(1, "a", 1)], 1, 2)
    assert out == ["1"]  # it deleted the fresh part, after committing the expiry
    _assert_nothing_committed(c, "procs")


def test_gc_keeps_the_parts_of_a_writer_whose_commit_landed_first(env: Any) -> None:
    """The other order of the race: the writer's commit lands first (renewing its
    lease); GC's expiry, computed on the older state, loses its compare-and-set, is
    re-judged on the state with the renewal and keeps the writer and its parts."""
    clock = Clock()
    c = env(clock)
    w, r = _writer_with_one_append(c, "order")
    gc_clock = Clock(clock.now + LEASE + 1)  # the writer's last renewal is a lease ago
    gc = env(gc_clock)
    gc.machine(gc.shard_id("order")).fetch()  # GC's cached state: before the renewal
    clock.now += LEASE - 1  # still live by its own clock: its append renews the lease
    w.compare_and_append([upd(1, "a", 1)], 1, 2)
    report = collect_garbage(gc, "order", grace_seconds=0)
    assert report.deleted_abandoned == [] and w.writer_id in gc.inspect("order").writers
    assert r.snapshot(1).num_rows == 2 and fsck(gc, "order").ok


def test_a_lagging_clock_never_shortens_a_writers_lease(env: Any) -> None:
    """``heartbeat_writer`` and ``renew_writer`` keep ``last_heartbeat_ms = max(old,
    now)``, as the reader's heartbeat does: a heartbeat or a holder's renewal from a
    clock behind the one that registered the writer never moves its lease back."""
    clock = Clock()
    c = env(clock)
    w, _r = c.open("lag", KS, VS)
    w.heartbeat()
    registered = c.inspect("lag").writers[w.writer_id].last_heartbeat_ms
    clock.now -= 30  # the writer's own clock steps back (NTP)
    w.heartbeat()
    assert c.inspect("lag").writers[w.writer_id].last_heartbeat_ms == registered
    behind = env(Clock(clock.now - 100))  # another process holding a batch of its parts
    m = behind.machine(behind.shard_id("lag"))
    now = m.now_ms()
    renewed = m._apply(lambda st, fresh: (st.renew_writer(w.writer_id, now),) * 2)
    assert renewed
    assert c.inspect("lag").writers[w.writer_id].last_heartbeat_ms == registered


def test_a_transaction_whose_writer_gc_expired_commits_nothing(env: Any) -> None:
    """A transaction's commit is decided the same way: its writer, expired by GC (whose
    clock is ahead by more than the lease) after the transaction uploaded its part, is
    no longer registered in the version the commit stages on, so the commit is refused
    and nothing is committed."""
    clock = Clock()
    c = env(clock)
    c.open("txn", KS, VS)
    txn = c.begin()
    txn.write("txn", pa.table({"k": [1], "v": ["a"], "_diff": pa.array([1], pa.int64())}))
    report = collect_garbage(env(Clock(clock.now + 2 * LEASE)), "txn", grace_seconds=0)
    assert report.deleted_abandoned  # the transaction's part
    with pytest.raises(LeaseExpired):
        txn.commit_at(5)
    st = c.inspect("txn")
    assert st.upper == Antichain.from_elem(0) and fsck(c, "txn").ok
