"""``Stash.peek_range``: key ranges, prefixes and pages, on every backend of the
contract suite (memory, memory over SQLite, SQLite, Postgres), checked against the
whole contents filtered in Python (keys in the code point order of their stored text)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from stash import Antichain, Stash, StashError, TypedCollection
from stash import ranges as ranges_module
from stash.codec import canonical_json, to_json

A = Antichain.from_elem

KEYS = ["a/1", "a/10", "a/2", "a", "ab", "b/1", "b/x", 'q"uote', "é/1", "z", "\u00ff", "~"]


def _text(k: Any) -> str:
    return canonical_json(to_json(k))


def _all_pages(stash: Stash, c: Any, **kw: Any) -> list[tuple[Any, Any]]:
    out: list[tuple[Any, Any]] = []
    after = None
    while True:
        page = stash.peek_range(c, after=after, **kw)
        out += page.entries
        assert len(page.entries) <= kw.get("limit", len(page.entries))
        if not page.more:
            return out
        after = page.next_after


def test_ranges_prefixes_and_pages_of_string_keys(stash: Stash) -> None:
    tc: TypedCollection[str, int] = TypedCollection("files", "str", "int")
    tc.upsert(stash, [(k, i) for i, k in enumerate(KEYS)])
    c = tc.get(stash)
    everything = sorted(tc.peek_one(stash).items(), key=lambda e: _text(e[0]))
    assert stash.peek_range(c).entries == everything
    assert [k for k, _ in stash.peek_range(c, prefix="a/").entries] == ["a/1", "a/10", "a/2"]
    assert [k for k, _ in stash.peek_range(c, lower="a/10", upper="b/x").entries] == [
        "a/10",
        "a/2",
        "ab",
        "b/1",
    ]
    page = stash.peek_range(c, prefix="a", limit=2)
    assert [k for k, _ in page.entries] == ["a", "a/1"] and page.more
    assert page.next_after == "a/1" and page.time == stash.upper(c).as_option() - 1  # type: ignore[operator]
    rest = stash.peek_range(c, prefix="a", after=page.next_after)
    assert [k for k, _ in rest.entries] == ["a/10", "a/2", "ab"] and not rest.more
    for limit in (1, 2, 5, 50):
        assert _all_pages(stash, c, limit=limit) == everything
    assert stash.peek_range(c, prefix="nothing").entries == []
    assert stash.peek_range(c, lower="b", upper="a").entries == []


def test_random_ranges_agree_with_the_filtered_contents(stash: Stash) -> None:
    rnd = random.Random(44)
    alphabet = ["a", "b", "/", '"', "\\", "é", "\u00ff", "\U0001f600", " "]
    keys = {"".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 4))) for _ in range(80)}
    tc: TypedCollection[str, str] = TypedCollection("r", "str", "str")
    tc.upsert(stash, [(k, k.upper()) for k in keys])
    c = tc.get(stash)
    items = sorted(tc.peek_one(stash).items(), key=lambda e: _text(e[0]))
    for _ in range(40):
        lo, hi = rnd.choice(sorted(keys)), rnd.choice(sorted(keys))
        pre = rnd.choice(["", "a", "b/", '"', "é"])
        want = [(k, v) for k, v in items if _text(lo) <= _text(k) < _text(hi) and k.startswith(pre)]
        got = _all_pages(stash, c, lower=lo, upper=hi, prefix=pre, limit=rnd.randint(1, 7))
        assert got == want, (lo, hi, pre)


def test_tuple_prefixes(stash: Stash) -> None:
    tc: TypedCollection[tuple[str, ...], int] = TypedCollection("routes", tuple, "int")
    routes = [("EWR", "LAX"), ("EWR", "SFO"), ("EWR",), ("EWRX", "A"), ("JFK", "LAX"), ("E",)]
    tc.upsert(stash, [(r, i) for i, r in enumerate(routes)])
    c = tc.get(stash)
    got = [k for k, _ in stash.peek_range(c, prefix=("EWR",)).entries]
    assert sorted(got) == [("EWR",), ("EWR", "LAX"), ("EWR", "SFO")]
    assert [k for k, _ in stash.peek_range(c, prefix=("EWR", "SFO")).entries] == [("EWR", "SFO")]
    assert len(stash.peek_range(c, prefix=()).entries) == len(routes)


def test_read_at_a_time_between_since_and_upper(stash: Stash) -> None:
    c = stash.collection("h", key="str", value="int")
    for t in range(3):
        stash.update(c, ("k", t), t, 1)
        if t:
            stash.update(c, ("k", t - 1), t, -1)
    stash.seal(c, A(3))
    assert stash.peek_range(c, at=0).entries == [("k", 0)]
    assert stash.peek_range(c, at=1).entries == [("k", 1)]
    assert stash.peek_range(c).entries == [("k", 2)]
    with pytest.raises(StashError, match="cannot read at time 3: it is not sealed"):
        stash.peek_range(c, at=3)
    stash.compact(c, A(2))
    with pytest.raises(StashError, match=r"cannot read at time 1: it is compacted away"):
        stash.peek_range(c, at=1)


def test_keys_with_long_histories_across_batches(
    stash: Stash, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ranges_module, "BATCH_ROWS", 2)
    c = stash.collection("long", key="str", value="int")
    # Rows at several times per key (the since stays at 0): a key's rows span batches.
    for t in range(4):
        for k in ("a", "b", "c"):
            stash.update(c, (k, t), t, 1)
            if t:
                stash.update(c, (k, t - 1), t, -1)
    stash.update(c, ("d", 7), 0, 1)
    stash.seal(c, A(4))
    want = [("a", 3), ("b", 3), ("c", 3), ("d", 7)]
    assert stash.peek_range(c).entries == want
    for limit in (1, 2, 3):
        assert _all_pages(stash, c, limit=limit) == want
    assert stash.peek_range(c, at=1, limit=2).entries == [("a", 1), ("b", 1)]


def test_multiplicity_is_checked_on_the_page_only(stash: Stash) -> None:
    c = stash.collection("m", key="str", value="int")
    stash.update(c, ("a", 1), 0, 1)
    stash.update(c, ("b", 1), 0, 2)
    stash.seal(c, A(1))
    assert stash.peek_range(c, limit=1).entries == [("a", 1)]
    with pytest.raises(StashError, match="unexpected peek multiplicity: collection 'm' holds key"):
        stash.peek_range(c, lower="b")


def test_bad_arguments_are_refused(stash: Stash) -> None:
    c = stash.collection("x", key="str")
    stash.seal(c, A(1))
    with pytest.raises(StashError, match="limit must be a positive int"):
        stash.peek_range(c, limit=0)
    with pytest.raises(StashError, match="prefix must be a str or a tuple"):
        stash.peek_range(c, prefix=5)
    with pytest.raises(StashError, match="str codec: expected a str"):
        stash.peek_range(c, lower=3)
