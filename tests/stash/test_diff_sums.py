"""Diff sums must fit in i64, on every backend alike: a write after which the positive (or
negative) diffs of a ``(key, value)`` would sum beyond i64 is refused with the same error
naming the collection and the rule, and commits nothing; reads never disagree."""

from __future__ import annotations

import pytest

from stash import Antichain, Stash, StashError
from stash.antichain import I64_MAX, I64_MIN
from tests.stash.conftest_helpers import tick

A = Antichain.from_elem


def _msg(name: str) -> str:
    return (
        f"stash error: write to collection {name} refused, nothing committed: diff sums "
        f"must fit in i64: the positive diffs of each (key, value) must sum to at most "
        f"{I64_MAX} and the negative ones to at least {I64_MIN}"
    )


def test_append_whose_sum_overflows_is_refused(stash: Stash) -> None:
    c = stash.collection("big", key="str", value="int")
    tick(stash, c, [("k", 1, I64_MAX)])
    before = (stash.upper(c), stash.since(c), stash.iter(c))
    with pytest.raises(StashError) as e:
        tick(stash, c, [("k", 1, I64_MAX)])
    assert str(e.value) == _msg("big")
    assert (stash.upper(c), stash.since(c), stash.iter(c)) == before
    assert stash.peek(c) == [("k", 1, I64_MAX)]
    # Other values and keys are independent; a retraction brings the sum back down.
    tick(stash, c, [("k", 2, I64_MAX), ("j", 1, I64_MAX)])
    tick(stash, c, [("k", 1, -I64_MAX)])
    tick(stash, c, [("k", 1, 5)])
    assert stash.peek(c) == [("j", 1, I64_MAX), ("k", 1, 5), ("k", 2, I64_MAX)]


def test_one_batch_that_sums_beyond_i64_is_refused(stash: Stash) -> None:
    c = stash.collection("one", key="str", value="int")
    other = stash.collection("other", key="str", value="int")
    b1, b2 = other.make_batch(stash), c.make_batch(stash)
    other.append_to_batch(b1, "fine", 0, 1)
    c.append_to_batch(b2, "k", 0, I64_MAX)
    c.append_to_batch(b2, "k", 0, 1)
    with pytest.raises(StashError) as e:
        stash.append([b1, b2])
    assert str(e.value) == _msg("one")
    assert stash.upper(other) == A(0) and stash.iter(other) == []
    assert stash.upper(c) == A(0) and stash.iter(c) == []


def test_update_whose_negative_sum_overflows_is_refused(stash: Stash) -> None:
    c = stash.collection("neg")
    stash.update(c, ("k", "v"), 0, I64_MIN)
    with pytest.raises(StashError) as e:
        stash.update(c, ("k", "v"), 3, -1)
    assert str(e.value) == _msg("neg")
    with pytest.raises(StashError) as e:
        stash.update_many(c, [(("x", "y"), 0, I64_MIN), (("x", "y"), 0, -1)])
    assert str(e.value) == _msg("neg")
    stash.seal(c, A(5))
    assert stash.peek(c) == [("k", "v", I64_MIN)]
    assert stash.iter(c) == [(("k", "v"), 0, I64_MIN)]


def test_sums_at_different_times_count_too(stash: Stash) -> None:
    """+MAX at time 1 and +1 at time 3 overflow a read at time 3 even if -1 at time 2
    would bring the total back: a backend adding them in another order would overflow, so
    the write is refused everywhere."""
    c = stash.collection("times", key="str", value="int")
    stash.update(c, ("k", 1), 1, I64_MAX)
    stash.update(c, ("k", 1), 2, -1)
    with pytest.raises(StashError) as e:
        stash.update(c, ("k", 1), 3, 1)
    assert str(e.value) == _msg("times")
    stash.seal(c, A(4))
    assert stash.peek(c) == [("k", 1, I64_MAX - 1)]
    stash.compact(c, A(3))
    stash.consolidate(c)
    assert stash.iter(c) == [(("k", 1), 3, I64_MAX - 1)]
    # Consolidated, there is room again.
    stash.update(c, ("k", 1), 5, 1)
    stash.seal(c, A(6))
    assert stash.peek(c) == [("k", 1, I64_MAX)]
