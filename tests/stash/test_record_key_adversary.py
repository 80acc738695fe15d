"""Adversarial tests of the key rule (records in keys stored without the fields at
their default) against keys stored by releases before it (every field): paths and
corner cases the rule's own tests left out.  Each failed on the code before its fix."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from stash import Stash, TypedCollection
from stash.errors import StashError, UniquenessViolation
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


@dataclass(frozen=True)
class Base:
    __stash_name__ = "adversary.Base"
    x: int


@dataclass(frozen=True)
class Derived(Base):
    __stash_name__ = "adversary.Derived"
    tag: str = ""


@dataclass(frozen=True)
class BaseKey:
    """A key without defaults whose field is annotated with a record type that has
    none, holding a subclass that has one."""

    __stash_name__ = "adversary.BaseKey"
    name: str
    inner: Base


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


def test_a_key_holding_a_subclass_with_a_default_in_a_field_of_its_base(
    open_stash: OpenStash,
) -> None:
    """A field annotated ``Base`` (no default) holding a ``Derived`` (a defaulted field):
    the key rule leaves the default out, so the key has two texts, whatever the
    annotations say.  Before, a key stored by an earlier release was not found and
    ``upsert_key`` wrote a second entry."""
    s = open_stash()
    k = BaseKey("a", Derived(1))
    old = s.collection("sub", key=OldKeyCodec(BaseKey), value="int")
    s.update_many(old, [((k, 1), 0, 1)])
    s.seal(old, s.upper(old).from_elem(1))
    tc = TypedCollection("sub", key=BaseKey, value="int")
    assert tc.peek_key_one(s, k) == 1
    tc.upsert_key(s, k, 2)
    assert s._peek_raw(tc.get(s)) == [('{"inner":{"x":1},"name":"a"}', "2", 1)]


# --- a stateful model: an earlier release's keys, then every key path of today -------

_names = st.sampled_from(["a", "b"])
_regions = st.sampled_from(["", "x"])
_values = st.integers(0, 9)


class EveryPathAfterUpgrade(RuleBasedStateMachine):
    """A collection of NamedTuple keys (which cannot remember the text they were read
    from) written by a release before the key rule (every field), then through every
    key path of today, against a model ``{key: value}``: lookups, writes, multi-step
    table transactions, and pages of ``peek_range`` (every limit, bounds at keys) list
    exactly the model, one entry per key.  Paged ranges failed before (a key skipped
    after a page ending at a key stored with every field)."""

    backend = "memory"

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp()
        url = "memory://" if self.backend == "memory" else f"sqlite:///{self.dir}/s.db"
        self.s = Stash.open(url, fenced=False)
        self.tc = TypedCollection("c", key=NPKey, value="int")
        self.model: dict[NPKey, int] = {}
        self.upgraded = False

    def teardown(self) -> None:
        self.s.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @precondition(lambda self: not self.upgraded)
    @rule(name=_names, region=_regions, value=_values)
    def old_write(self, name: str, region: str, value: int) -> None:
        old = TypedCollection("c", key=OldKeyCodec(NPKey), value="int")
        old.upsert_key(self.s, NPKey(name, region), value)
        self.model[NPKey(name, region)] = value

    @precondition(lambda self: not self.upgraded)
    @rule()
    def upgrade(self) -> None:
        self.upgraded = True

    @precondition(lambda self: self.upgraded)
    @rule(name=_names, region=_regions, value=_values, how=st.sampled_from(["key", "many", "tx"]))
    def write(self, name: str, region: str, value: int, how: str) -> None:
        k = NPKey(name, region)
        if how == "key":
            self.tc.upsert_key(self.s, k, value)
        elif how == "many":
            self.tc.upsert(self.s, [(k, value)])
        else:
            self.s.with_transaction(lambda tx: tx.table(self.tc).set(k, value))
        self.model[k] = value

    @precondition(lambda self: self.upgraded)
    @rule(name=_names, region=_regions, value=_values)
    def insert_without_overwrite(self, name: str, region: str, value: int) -> None:
        k = NPKey(name, region)
        assert self.tc.insert_without_overwrite(self.s, k, value) == self.model.setdefault(k, value)

    @precondition(lambda self: self.upgraded)
    @rule(
        steps=st.lists(
            st.tuples(st.sampled_from(["set", "del", "ins", "get"]), _names, _regions, _values),
            min_size=1,
            max_size=4,
        ),
        eager=st.booleans(),
    )
    def table(self, steps: list[tuple[str, str, str, int]], eager: bool) -> None:
        t = self.tc.table(self.s, uniqueness_violation=lambda a, b: False) if eager else None
        t = t if t is not None else self.tc.table(self.s)
        want = dict(self.model)
        for op, name, region, value in steps:
            k = NPKey(name, region)
            if op == "set":
                t.set(k, value)
                want[k] = value
            elif op == "del":
                t.set(k, None)
                want.pop(k, None)
            elif op == "ins":
                try:
                    t.insert(k, value)
                except UniquenessViolation:
                    assert k in want
                else:
                    assert k not in want
                    want[k] = value
            else:
                assert t.get(k) == want.get(k)
        t.commit()
        self.model = want

    @precondition(lambda self: self.upgraded)
    @rule(limit=st.integers(1, 3), lower=st.none() | _names, upper=st.none() | _names)
    def pages(self, limit: int, lower: str | None, upper: str | None) -> None:
        c = self.tc.get(self.s)
        if self.s.upper(c).as_option() == 0:
            return
        lo = None if lower is None else NPKey(lower)
        hi = None if upper is None else NPKey(upper)
        got: list[Any] = []
        after = None
        while True:
            page = self.s.peek_range(c, lower=lo, upper=hi, limit=limit, after=after)
            got += page.entries
            if not page.more:
                break
            after = page.next_after
        # lower/upper at a key admit/exclude that key itself, whichever text it is under
        everything = self.s.peek_range(c).entries
        assert len(everything) == len(self.model) and dict(everything) == self.model
        assert len(got) == len(dict(got))
        if lo is not None and hi is None and lo in self.model:
            assert (lo, self.model[lo]) in got
        if hi is not None:
            assert hi not in dict(got)
        if lo is None and hi is None:
            assert dict(got) == self.model

    @invariant()
    def one_entry_per_key(self) -> None:
        c = self.tc.get(self.s)
        if self.s.upper(c).as_option() == 0:
            return
        assert self.tc.peek_one(self.s) == self.model
        assert all(d == 1 for _, _, d in self.s.peek(c))
        for k, v in self.model.items():
            assert self.tc.peek_key_one(self.s, k) == v


class EveryPathAfterUpgradeSqlite(EveryPathAfterUpgrade):
    backend = "sqlite"


_SETTINGS = settings(
    max_examples=10,
    stateful_step_count=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
EveryPathAfterUpgrade.TestCase.settings = _SETTINGS
EveryPathAfterUpgradeSqlite.TestCase.settings = _SETTINGS
test_every_path_after_upgrade_memory = EveryPathAfterUpgrade.TestCase
test_every_path_after_upgrade_sqlite = EveryPathAfterUpgradeSqlite.TestCase
