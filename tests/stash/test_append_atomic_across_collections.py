"""Protects: a stash append commits all of its batches or none.

append is atomic across collections: a bad batch anywhere (lower mismatch, an entry
before the upper, a compact beyond the upper, a diff-sum overflow) commits nothing in any
collection, also through a warm Memory cache; and a TableTransaction's pending() over
two collections commits together."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from stash import Antichain, Memory, Stash, StashError, TypedCollection
from tests.support.dbutil import backend_url

pytestmark = pytest.mark.adversarial


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    return backend_url(request, request.param, tmp_path)


def _state(s: Stash) -> Any:
    return {n: (s.since(c), s.upper(c), s.iter(c)) for n, c in sorted(s.collections().items())}


def _bad_lower(s: Stash, a: Any, b: Any) -> list:
    ba, bb = a.make_batch(s), b.make_batch(s)
    a.append_to_batch(ba, "x", 1, 1)
    bb.lower = Antichain.from_elem(0)
    return [ba, bb]


def _bad_time(s: Stash, a: Any, b: Any) -> list:
    ba, bb = a.make_batch(s), b.make_batch(s)
    a.append_to_batch(ba, "x", 1, 1)
    bb.entries.append(((b.key_codec.encode("y"), b.value_codec.encode(2)), 0, 1))
    return [ba, bb]


def _bad_compact(s: Stash, a: Any, b: Any) -> list:
    ba, bb = a.make_batch(s), b.make_batch(s)
    a.append_to_batch(ba, "x", 1, 1)
    bb.compact = Antichain.from_elem(10**6)
    return [ba, bb]


def _overflow(s: Stash, a: Any, b: Any) -> list:
    ba, bb = a.make_batch(s), b.make_batch(s)
    a.append_to_batch(ba, "x", 1, 1)
    b.append_to_batch(bb, "big", 1, 2**63 - 1)
    return [ba, bb]


BAD: dict[str, Callable[..., list]] = {
    "lower": _bad_lower,
    "time": _bad_time,
    "compact": _bad_compact,
    "overflow": _overflow,
}


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "Memory"])
def test_bad_batch_commits_nothing(url: str, bad: str, wrap: bool) -> None:
    s = Stash.open(url, fenced=True)
    if wrap:
        s = Memory(s)
    try:
        a, b = s.collection("a"), s.collection("b")
        s.update_many(b, [(("big", 1), 0, 1)])
        for c in (a, b):
            s.seal(c, Antichain.from_elem(5))
        before = _state(s)
        s.peek_one(a), s.peek_one(b)  # warm the cache
        batches = BAD[bad](s, a, b)
        for order in (batches, list(reversed(batches))):
            with pytest.raises(StashError):
                s.append(order)
            assert _state(s) == before
            assert s.peek_one(a) == {} and s.peek_one(b) == {"big": 1}
    finally:
        s.close()
    with Stash.open(url, fenced=False) as fresh:
        assert _state(fresh) == before


def test_two_table_transactions_commit_together(url: str) -> None:
    with Stash.open(url, fenced=True) as s:
        users, names = TypedCollection("users"), TypedCollection("names")
        users.upsert(s, [(1, {"name": "x"}), (2, {"name": "y"})])
        names.upsert(s, [("x", 1), ("y", 2)])
        tu = users.table(s, lambda p, q: p["name"] == q["name"])
        tn = names.table(s)
        # swap the names of 1 and 2 in one update, then mirror in the index
        assert tu.update(lambda k, v: {"name": {"x": "y", "y": "x"}[v["name"]]}) == 2
        tn.set_many([("x", 2), ("y", 1)])
        cu, cn = users.get(s), names.get(s)
        bu, bn = cu.make_batch(s), cn.make_batch(s)
        for k, v, d in tu.pending():
            cu.append_to_batch(bu, k, v, d)
        for k, v, d in tn.pending():
            cn.append_to_batch(bn, k, v, d)
        s.append([bu, bn])
        assert users.peek_one(s) == {1: {"name": "y"}, 2: {"name": "x"}}
        assert names.peek_one(s) == {"x": 2, "y": 1}
