"""``Stash.subscribe`` (a change feed with progress, resumable across a restart) and
``Stash.set_retention`` (the since follows a retention instead of every append), on
every backend of the contract suite."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from stash import Antichain, Stash, TypedCollection, feed
from stash.feed import Change, FeedCompacted, Progress
from tests.stash.conftest import OpenStash

A = Antichain.from_elem


def _until_progress(it: Any, upper: int) -> list[Any]:
    """Events of ``it`` up to the first progress at or beyond ``upper``."""
    out = []
    for ev in it:
        out.append(ev)
        if isinstance(ev, Progress) and ev.upper >= upper:
            return out
    raise AssertionError(f"the feed ended before progress {upper}: {out}")


def _write_history(s: Stash, tc: TypedCollection[str, int]) -> list[int]:
    """Three sealed steps; returns the time of each."""
    c = tc.get(s)
    times = []
    tc.upsert(s, [("a", 1), ("b", 2)])
    times.append(s.upper(c).as_option() - 1)  # type: ignore[operator]
    tc.upsert_key(s, "a", 3)
    times.append(s.upper(c).as_option() - 1)  # type: ignore[operator]
    batch = c.make_batch(s)
    c.append_to_batch(batch, "c", 4, 1)
    c.append_to_batch(batch, "b", 2, -1)
    s.append([batch])
    times.append(batch.timestamp)
    return times


def test_snapshot_then_every_change_with_progress(open_stash: OpenStash) -> None:
    s = open_stash()
    tc: TypedCollection[str, int] = TypedCollection("jobs", "str", "int")
    c = tc.get(s)
    s.set_retention(c, keep_times=None)
    t1, t2, t3 = _write_history(s, tc)
    assert s.since(c) == A(0)  # held back by the retention
    events = list(s.subscribe([c], t1, poll_interval=0.01, idle_timeout=0.2))
    changes = [e for e in events if isinstance(e, Change)]
    # In time order; within a time in no particular order.
    assert sorted(changes, key=lambda e: (e.time, e.key, e.diff)) == [
        Change("jobs", "a", 1, t1, 1),
        Change("jobs", "b", 2, t1, 1),
        Change("jobs", "a", 1, t2, -1),
        Change("jobs", "a", 3, t2, 1),
        Change("jobs", "b", 2, t3, -1),
        Change("jobs", "c", 4, t3, 1),
    ]
    assert [e.time for e in changes] == sorted(e.time for e in changes)
    assert events[-1] == Progress("jobs", t3 + 1)
    # Without the snapshot: only the changes after as_of.
    later = [
        e for e in s.subscribe([c], t2, snapshot=False, idle_timeout=0.1) if isinstance(e, Change)
    ]
    assert {(e.key, e.time, e.diff) for e in later} == {("b", t3, -1), ("c", t3, 1)}


def test_resume_across_a_restart_from_the_last_progress(open_stash: OpenStash) -> None:
    s = open_stash()
    tc: TypedCollection[str, int] = TypedCollection("jobs", "str", "int")
    c = tc.get(s)
    s.set_retention(c, keep_times=None)
    tc.upsert(s, [("a", 1)])
    start = s.upper(c).as_option() - 1  # type: ignore[operator]
    tc.upsert_key(s, "b", 2)
    seen = _until_progress(s.subscribe([c], start, poll_interval=0.01), s.upper(c).as_option())  # type: ignore[arg-type]
    resume_at = seen[-1].upper
    s.close()  # the subscriber's process ends; writers go on
    w = open_stash()
    tc.upsert_key(w, "a", 5)
    tc.upsert_key(w, "c", 6)
    r = open_stash()  # the subscriber restarts
    rc = tc.get(r)
    resumed = list(r.subscribe([rc], resume_at - 1, snapshot=False, idle_timeout=0.2))
    both = [e for e in seen + resumed if isinstance(e, Change)]
    # Together: every change exactly once, and they add up to the contents.
    acc: dict[tuple[str, int], int] = {}
    for e in both:
        acc[(e.key, e.value)] = acc.get((e.key, e.value), 0) + e.diff
    assert {k: v for (k, v), d in acc.items() if d} == tc.peek_one(r) == {"a": 5, "b": 2, "c": 6}
    assert all(e.time >= resume_at for e in resumed if isinstance(e, Change))
    assert resumed[-1] == Progress("jobs", r.upper(rc).as_option())


def test_a_compacted_as_of_raises_clearly(open_stash: OpenStash) -> None:
    s = open_stash()
    tc: TypedCollection[str, int] = TypedCollection("nohist", "str", "int")
    c = tc.get(s)
    times = _write_history(s, tc)  # no retention: every append compacts
    assert s.since(c) == A(times[-1])
    with pytest.raises(FeedCompacted, match=r"collection nohist is compacted past time"):
        next(iter(s.subscribe([c], times[0])))


def test_a_retention_by_times_keeps_the_last_n_times(open_stash: OpenStash) -> None:
    s = open_stash()
    tc: TypedCollection[str, int] = TypedCollection("window", "str", "int")
    c = tc.get(s)
    s.set_retention(c, keep_times=2)
    for i in range(6):
        tc.upsert_key(s, "k", i)
    upper = s.upper(c).as_option()
    assert upper is not None and s.since(c) == A(upper - 2)
    history = [e for e in s.subscribe([c], upper - 2, idle_timeout=0.1) if isinstance(e, Change)]
    assert [(e.value, e.diff) for e in history] == [(4, 1), (4, -1), (5, 1)]
    with pytest.raises(FeedCompacted):
        next(iter(s.subscribe([c], upper - 3)))


def test_a_subscriber_wakes_for_a_concurrent_writer(open_stash: OpenStash) -> None:
    s, w = open_stash(), open_stash()
    tc: TypedCollection[str, int] = TypedCollection("live", "str", "int")
    c = tc.get(s)
    s.set_retention(c, keep_times=None)
    tc.upsert_key(s, "a", 1)
    start = s.upper(c).as_option() - 1  # type: ignore[operator]

    def write() -> None:
        time.sleep(0.2)
        tc.upsert_key(w, "b", 2)

    t = threading.Thread(target=write)
    t.start()
    got = []
    for ev in s.subscribe([c], start, poll_interval=0.05, idle_timeout=20):
        got.append(ev)
        if isinstance(ev, Change) and ev.key == "b":
            break
    t.join()
    assert Change("live", "b", 2, start + 1, 1) in got
    if getattr(s, "backend", None) == "postgresql":  # it listens (NOTIFY), not only polls
        listener = feed._Listener(s)
        try:
            assert listener.conn is not None
        finally:
            listener.close()
