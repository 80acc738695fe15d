"""Retention by wall-clock duration (``Stash.set_retention(c, keep_for=timedelta)``) on
every backend of the contract suite: the since becomes the newest time committed at or
before ``now - keep_for``, through every writer that picks a since (``upsert_key``,
``make_batch`` + ``append``, ``with_transaction``), never goes back, and keeps the
history a ``subscribe`` resumes from.  The stash's clock is injected (``clock=``): no
test sleeps to pass time."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import pytest

from stash import Antichain, Stash, StashError, TypedCollection
from stash.feed import Change, FeedCompacted, Progress
from tests.stash.conftest import OpenStash

A = Antichain.from_elem
S = dt.timedelta(seconds=1)


class Clock:
    """A wall clock the test moves (seconds since the epoch)."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def _upper(s: Stash, tc: TypedCollection[str, int]) -> int:
    u = s.upper(tc.get(s)).as_option()
    assert u is not None
    return u


def _by_upsert_key(s: Stash, tc: TypedCollection[str, int], k: str, v: int) -> None:
    tc.upsert_key(s, k, v)


def _by_make_batch(s: Stash, tc: TypedCollection[str, int], k: str, v: int) -> None:
    c = tc.get(s)
    old = tc.peek_one(s).get(k)
    batch = c.make_batch(s)
    if old is not None:
        c.append_to_batch(batch, k, old, -1)
    c.append_to_batch(batch, k, v, 1)
    s.append([batch])


def _by_with_transaction(s: Stash, tc: TypedCollection[str, int], k: str, v: int) -> None:
    def fn(tx: Any) -> None:
        tx.table(tc).set(k, v)

    s.with_transaction(fn)


WRITERS: dict[str, Callable[[Stash, TypedCollection[str, int], str, int], None]] = {
    "upsert_key": _by_upsert_key,
    "make_batch": _by_make_batch,
    "with_transaction": _by_with_transaction,
}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_the_since_follows_now_minus_keep_for(open_stash: OpenStash, writer: str) -> None:
    clock = Clock()
    s = open_stash(clock=clock)
    write = WRITERS[writer]
    tc: TypedCollection[str, int] = TypedCollection("runs", "str", "int")
    c = tc.get(s)
    s.set_retention(c, keep_for=15 * S)
    times = []
    for i in range(4):  # commits at +0 s, +10 s, +20 s, +30 s
        times.append(_upper(s, tc))
        write(s, tc, "k", i)
        clock.now += 10
    # The last commit was at +30 s: the newest time committed at or before +15 s is the
    # one committed at +10 s; it and every later time stay readable.
    assert s.since(c) == A(times[1])
    assert tc.peek_one(s) == {"k": 3}
    # Nothing committed since: a write at +55 s moves the since to the time of +30 s.
    clock.now += 15
    write(s, tc, "k", 9)
    assert s.since(c) == A(times[3])


def test_every_writer_leaves_the_same_since(open_stash: OpenStash) -> None:
    """Differential: the three writers, one clock, three collections, the same sinces."""
    clock = Clock()
    s = open_stash(clock=clock)
    tcs = {w: TypedCollection[str, int](f"runs_{w}", "str", "int") for w in WRITERS}
    for tc in tcs.values():
        s.set_retention(tc.get(s), keep_times=2, keep_for=25 * S)
    seen: list[set[Any]] = []
    for i, step in enumerate([0, 5, 30, 1, 1, 40, 3]):
        clock.now += step
        for w, tc in tcs.items():
            WRITERS[w](s, tc, f"k{i % 2}", i)
        sinces = {
            (s.since(tc.get(s)).as_option(), s.upper(tc.get(s)).as_option()) for tc in tcs.values()
        }
        seen.append(sinces)
    assert all(len(x) == 1 for x in seen), seen


def test_with_both_the_since_keeps_what_either_asks_for(open_stash: OpenStash) -> None:
    clock = Clock()
    s = open_stash(clock=clock)
    tc: TypedCollection[str, int] = TypedCollection("both", "str", "int")
    c = tc.get(s)
    s.set_retention(c, keep_times=2, keep_for=100 * S)
    for i in range(5):  # five commits one second apart: the duration keeps them all
        tc.upsert_key(s, "k", i)
        clock.now += 1
    assert s.since(c) == A(0)
    clock.now += 200  # now the count keeps more
    tc.upsert_key(s, "k", 5)
    upper = _upper(s, tc)
    assert s.since(c) == A(upper - 2)


def test_the_since_never_goes_back_when_the_clock_does(open_stash: OpenStash) -> None:
    clock = Clock()
    s = open_stash(clock=clock)
    tc: TypedCollection[str, int] = TypedCollection("back", "str", "int")
    c = tc.get(s)
    s.set_retention(c, keep_for=10 * S)
    for _ in range(3):
        tc.upsert_key(s, "k", _upper(s, tc))
        clock.now += 20
    since = s.since(c)
    assert since.as_option() not in (None, 0)
    clock.now -= 1000
    tc.upsert_key(s, "k", 99)
    assert s.since(c) == since


def test_times_committed_before_the_setting_hold_the_since_back(open_stash: OpenStash) -> None:
    clock = Clock()
    s = open_stash(clock=clock)
    tc: TypedCollection[str, int] = TypedCollection("older", "str", "int")
    c = tc.get(s)
    s.set_retention(c, keep_times=None)
    for i in range(3):
        tc.upsert_key(s, "k", i)
    s.set_retention(c, keep_for=10 * S)  # replaces keep_times=None
    clock.now += 1000
    first = _upper(s, tc)
    tc.upsert_key(s, "k", 3)  # the first time with a recorded commit wall clock
    assert s.since(c) == A(0)  # no recorded time is old enough yet
    clock.now += 11
    tc.upsert_key(s, "k", 4)
    assert s.since(c) == A(first)


def test_a_subscriber_resumes_at_an_as_of_the_duration_keeps(open_stash: OpenStash) -> None:
    clock = Clock()
    s = open_stash(clock=clock)
    tc: TypedCollection[str, int] = TypedCollection("feed", "str", "int")
    c = tc.get(s)
    s.set_retention(c, keep_for=60 * S)
    tc.upsert_key(s, "a", 1)
    start = _upper(s, tc) - 1
    events = list(s.subscribe([c], start, idle_timeout=0.05))
    resume_at = events[-1].upper
    assert isinstance(events[-1], Progress)
    # The subscriber is away; writers go on, 20 s apart: all within the minute.
    for i in range(3):
        clock.now += 20
        tc.upsert_key(s, "b", i)
    resumed = list(s.subscribe([c], resume_at - 1, snapshot=False, idle_timeout=0.05))
    changes = [e for e in resumed if isinstance(e, Change)]
    assert [(e.key, e.value, e.diff) for e in changes if e.diff > 0] == [
        ("b", 0, 1),
        ("b", 1, 1),
        ("b", 2, 1),
    ]
    assert resumed[-1] == Progress("feed", _upper(s, tc))
    # Away for longer than the retention: the since passes the resume point, and the
    # feed says so rather than skipping history.
    clock.now += 300
    tc.upsert_key(s, "b", 7)
    # The newest time committed at or before now - 60 s is the one before this write.
    assert s.since(c) == A(_upper(s, tc) - 2)
    with pytest.raises(FeedCompacted, match=r"collection feed is compacted past time"):
        next(iter(s.subscribe([c], resume_at - 1, snapshot=False)))


def test_with_transaction_follows_a_retention(open_stash: OpenStash) -> None:
    """``with_transaction`` compacted to every commit's time whatever the retention."""
    s = open_stash()
    tc: TypedCollection[str, int] = TypedCollection("txn", "str", "int")
    c = tc.get(s)
    s.set_retention(c, keep_times=None)
    for i in range(3):
        _by_with_transaction(s, tc, "k", i)
    assert s.since(c) == A(0)
    assert _upper(s, tc) == 3


@pytest.mark.parametrize(
    ("kw", "rule"),
    [
        ({}, "give keep_times"),
        ({"keep_for": dt.timedelta(0)}, "keep_for must be a positive"),
        ({"keep_for": -S}, "keep_for must be a positive"),
        ({"keep_for": 15}, "keep_for must be a positive"),
        ({"keep_times": None, "keep_for": S}, "keep_times=None keeps every time"),
        ({"keep_times": 0, "keep_for": S}, "keep_times must be a positive int"),
    ],
)
def test_a_bad_retention_is_refused_and_writes_nothing(
    open_stash: OpenStash, kw: dict[str, Any], rule: str
) -> None:
    s = open_stash()
    tc: TypedCollection[str, int] = TypedCollection("bad", "str", "int")
    c = tc.get(s)
    s.set_retention(c, keep_times=3)
    with pytest.raises(StashError, match=rule):
        s.set_retention(c, **kw)
    settings = TypedCollection[str, Any]("stash.retention", "str", "json")
    assert settings.peek_one(s) == {"bad": {"keep_times": 3}}


def test_a_savepoint_writes_under_a_duration_retention(open_stash: OpenStash) -> None:
    clock = Clock()
    s = open_stash(clock=clock)
    tc: TypedCollection[str, int] = TypedCollection("sp", "str", "int")
    s.set_retention(tc.get(s), keep_for=S)
    tc.upsert_key(s, "a", 1)
    sp = open_stash(mode="savepoint", clock=clock)
    clock.now += 5
    tc.upsert_key(sp, "a", 2)
    tc.upsert_key(sp, "b", 3)
    assert tc.peek_one(sp) == {"a": 2, "b": 3}
    assert tc.peek_one(s) == {"a": 1}
