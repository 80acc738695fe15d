"""Adversarial tests of the key rule (records in keys stored without the fields at
their default) against keys stored by releases before it (every field): paths and
corner cases the rule's own tests left out.  Each failed on the code before its fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest

from stash import Stash, TypedCollection
from stash.errors import StashError
from tests.stash.conftest import OpenStash
from tests.stash.test_record_key_legacy_texts import OldKeyCodec


@dataclass(frozen=True)
class PKey:
    __stash_name__ = "adversary.PKey"
    name: str
    region: str = ""


@dataclass(frozen=True)
class AnyKey:
    """A key whose field is annotated ``Any`` (here holding a record with a default)."""

    __stash_name__ = "adversary.AnyKey"
    name: str
    extra: Any


class NPKey(NamedTuple):
    name: str
    region: str = ""


def _pages(s: Stash, tc: TypedCollection[Any, Any], **kw: Any) -> list[Any]:
    c = tc.get(s)
    got: list[Any] = []
    after = None
    while True:
        page = s.peek_range(c, limit=1, after=after, **kw)
        got += page.entries
        if not page.more:
            return got
        after = page.next_after


def test_paging_past_a_legacy_key_skips_no_key(open_stash: OpenStash) -> None:
    """Pages of limit 1 over a collection whose key ``PKey("a")`` is stored as an
    earlier release wrote it (``{"name":"a","region":""}``): the next page starts after
    the text the key is STORED under.  Before, ``after`` was encoded by the key rule
    (``{"name":"a"}``), which sorts after ``{"name":"a","region":"x"}``: that key,
    stored all along, was skipped (no prefix, and a prefix without a record)."""
    s = open_stash()
    for name, K in (("p", PKey), ("n", NPKey)):
        old = s.collection(name, key=OldKeyCodec(K), value="int")
        s.update_many(old, [((K("a"), 1), 0, 1), ((K("a", "x"), 2), 0, 1)])
        s.seal(old, s.upper(old).from_elem(1))
        tc = TypedCollection(name, key=K, value="int")
        tc.upsert(s, [(K("b"), 3)])
        want = [(K("a"), 1), (K("a", "x"), 2), (K("b"), 3)]
        got = _pages(s, tc)
        assert sorted(got, key=repr) == sorted(want, key=repr) and len(got) == 3, name

    spec = tuple[str, PKey]
    old2 = s.collection("t", key=OldKeyCodec(spec), value="int")
    keys = [("k", PKey("a")), ("k", PKey("a", "x"))]
    s.update_many(old2, [((k, i), 0, 1) for i, k in enumerate(keys)])
    s.seal(old2, s.upper(old2).from_elem(1))
    tc2 = TypedCollection("t", key=spec, value="int")
    got = _pages(s, tc2, prefix=("k",))
    assert sorted(got, key=repr) == sorted([(k, i) for i, k in enumerate(keys)], key=repr)
    assert len(got) == 2


def test_range_bounds_at_a_legacy_key_admit_and_exclude_it(open_stash: OpenStash) -> None:
    """``lower=k`` admits the key ``k`` and ``upper=k`` excludes it whichever of its
    texts it is stored under.  Before, bounds were encoded by the key rule: a key stored
    by an earlier release with every field (``{"name":"a","region":""}`` sorts before
    ``{"name":"a"}``) was left out of ``peek_range(lower=k)`` and read by
    ``peek_range(upper=k)``, and came back once upserted (stored by the rule)."""
    s = open_stash()
    for name, K in (("p", PKey), ("n", NPKey)):
        old = s.collection(name, key=OldKeyCodec(K), value="int")
        s.update_many(old, [((K("a"), 1), 0, 1), ((K("a", "x"), 2), 0, 1), ((K("b"), 3), 0, 1)])
        s.seal(old, s.upper(old).from_elem(1))
        tc = TypedCollection(name, key=K, value="int")
        c = tc.get(s)
        assert (K("a"), 1) in s.peek_range(c, lower=K("a")).entries, name
        assert (K("b"), 3) not in s.peek_range(c, upper=K("b")).entries, name
        got = s.peek_range(c, lower=K("a"), upper=K("b")).entries
        assert (K("a"), 1) in got and (K("b"), 3) not in got, (name, got)
        tc.upsert_key(s, K("a"), 9)  # stored by the rule now: the same answers
        assert (K("a"), 9) in s.peek_range(c, lower=K("a")).entries, name


def test_a_handle_makes_its_record_key_codec_once(monkeypatch: Any) -> None:
    """Opening a collection handle (every ``TypedCollection`` call does) makes the
    record key codec once, in its key role, as releases before the key rule made it
    once: the key rule had it made twice (the value role, then ``as_key``), a fifth of
    ``peek_key_one``'s time on a memory stash for a record key without defaults."""
    from stash.record_codec import RecordCodec

    s = Stash.open("memory://", fenced=False)
    tc = TypedCollection("c", key=PKey, value="int")
    tc.upsert_key(s, PKey("a"), 1)
    made: list[bool] = []
    init = RecordCodec.__init__

    def counting(self: Any, *a: Any, **kw: Any) -> None:
        made.append(kw.get("key", False))
        init(self, *a, **kw)

    monkeypatch.setattr(RecordCodec, "__init__", counting)
    assert tc.peek_key_one(s, PKey("a")) == 1
    assert made == [True]
    s.close()


def test_a_page_refuses_a_key_held_under_both_texts(open_stash: OpenStash) -> None:
    """A key held under both of its texts (every field's, by an earlier release, and
    the key rule's) is refused by ``peek_range`` also when only one of the texts is in
    the page: pages of one key, or a bound between the two texts.  Before, pages of
    limit 1 returned one of its two values without a word, and a range whose lower
    bound lay between the texts returned the other."""
    s = open_stash()
    for name, K in (("p", PKey), ("n", NPKey)):
        old = s.collection(name, key=OldKeyCodec(K), value="int")
        s.update_many(old, [((K("a"), 1), 0, 1), ((K("b"), 3), 0, 1)])
        s.seal(old, s.upper(old).from_elem(1))
        tc = TypedCollection(name, key=K, value="int")
        c = tc.get(s)
        batch = c.make_batch(s)
        batch.entries.append((('{"name":"a"}', "5"), batch.timestamp, 1))  # by hand
        s.append([batch])
        for kw in ({"limit": 1}, {"lower": K("a", "x")}, {"upper": K("a", "x")}):
            with pytest.raises(StashError, match=f"duplicate key: collection '{name}' holds"):
                s.peek_range(c, **kw)
        assert s.peek_range(c, lower=K("b")).entries == [(K("b"), 3)]  # other keys read


def test_a_key_holding_a_record_in_a_field_annotated_any(open_stash: OpenStash) -> None:
    """A record key without defaults whose field is annotated ``Any`` and holds a record
    with a default: the key rule leaves the inner default out (it walks the values), so
    the key has two texts and every path probes both.  Before, the type was taken for
    one whose keys have one text (its annotations reach no defaulted field): a key
    stored by an earlier release was not found and ``upsert_key`` wrote a second
    entry."""
    s = open_stash()
    k = AnyKey("a", PKey("x"))
    old = s.collection("any", key=OldKeyCodec(AnyKey), value="int")
    s.update_many(old, [((k, 1), 0, 1)])
    s.seal(old, s.upper(old).from_elem(1))
    tc = TypedCollection("any", key=AnyKey, value="int")
    assert tc.peek_key_one(s, k) == 1
    tc.upsert_key(s, k, 2)
    assert s._peek_raw(tc.get(s)) == [('{"extra":{"name":"x"},"name":"a"}', "2", 1)]
