"""Keys stored by releases before the key rule, whose key type ALREADY had defaulted
fields then: every release before wrote such a key with every field
(``{"name":"a","region":""}``), the key rule writes it without the fields at their
default (``{"name":"a"}``).  After the upgrade, with the key type unchanged and no
migration, every key path finds such a key under its old text
(``stash.codec.key_texts``: both texts probed in one statement), replaces and deletes
it by retracting the text that is STORED (never a re-encoding: no multiplicity -1 for a
text that is not stored, no second entry), and refuses, committing nothing, a key held
under both of its texts.  Differentially: every path, on every backend, for a
dataclass key, a NamedTuple key (which cannot remember the text it was read from) and a
record inside a tuple key.  Each path's test of a legacy key failed before (a lookup
missed the key, an upsert added a second entry, a table deleted a text not stored).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest

from stash import Stash, TypedCollection
from stash.canonical import canonical_json
from stash.codec import resolve_codec, resolve_key_codec, to_json
from stash.errors import StashError, UniquenessViolation
from tests.stash.conftest import OpenStash


@dataclass(frozen=True)
class DKey:
    __stash_name__ = "legacy.DKey"
    name: str
    region: str = ""


class NKey(NamedTuple):
    name: str
    region: str = ""


@dataclass(frozen=True)
class Inner:
    __stash_name__ = "legacy.Inner"
    x: int
    tag: str = ""


class OldKeyCodec:
    """The key codec of the releases before the key rule: every field written (a copy of
    the old rule: ``to_json``), under the recorded name of today's codec."""

    def __init__(self, spec: Any) -> None:
        self._new = resolve_codec(spec)
        self.name = self._new.name

    def encode(self, value: Any) -> str:
        return canonical_json(to_json(value))

    def decode(self, text: str) -> Any:
        return self._new.decode(text)

    def sort_key(self, value: Any) -> Any:
        return self._new.sort_key(value)


#: (key codec spec, the key "a" at its defaults, its text of today, its old text, the
#: key "b" of another entry)
KINDS: dict[str, tuple[Any, Any, str, str, Any]] = {
    "dataclass": (DKey, DKey("a"), '{"name":"a"}', '{"name":"a","region":""}', DKey("b")),
    "namedtuple": (NKey, NKey("a"), '{"name":"a"}', '{"name":"a","region":""}', NKey("b")),
    "record-in-tuple": (
        tuple[str, Inner],
        ("a", Inner(1)),
        '["a",{"x":1}]',
        '["a",{"tag":"","x":1}]',
        ("b", Inner(1)),
    ),
}


def _raw(s: Stash, tc: TypedCollection[Any, Any]) -> list[tuple[str, str, int]]:
    """The consolidated stored rows ``(key text, value text, diff)`` (a retraction of a
    text not stored would show here with diff -1)."""
    return sorted(s._peek_raw(tc.get(s)))


def _others(s: Stash, tc: TypedCollection[Any, Any]) -> list[tuple[str, str, int]]:
    return [r for r in _raw(s, tc) if r[1] == "7"]


# --- every key path ------------------------------------------------------------------
# Each takes (stash, collection, key) and does one thing with the key: "find" returns
# what it read of the key, "replace" sets it to 2, "delete" removes it, "refuse" tries
# to add it again.


def _table_set(s: Stash, tc: TypedCollection[Any, Any], k: Any, v: Any) -> None:
    t = tc.table(s)
    t.set(k, v)
    t.commit()


def _tx_set(s: Stash, tc: TypedCollection[Any, Any], k: Any, v: Any) -> None:
    s.with_transaction(lambda tx: tx.table(tc).set(k, v))


def _eager_table(s: Stash, tc: TypedCollection[Any, Any]) -> Any:
    return tc.table(s, uniqueness_violation=lambda a, b: False)


def _eager_update(s: Stash, tc: TypedCollection[Any, Any], k: Any) -> None:
    t = _eager_table(s, tc)
    t.update(lambda kk, v: 2 if kk == k else None)
    t.commit()


def _eager_delete(s: Stash, tc: TypedCollection[Any, Any], k: Any) -> None:
    t = _eager_table(s, tc)
    assert t.delete(lambda kk, v: kk == k) == [(k, 1)]
    t.commit()


def _tx_delete_all_rows(s: Stash, tc: TypedCollection[Any, Any], k: Any) -> None:
    s.with_transaction(lambda tx: tx.table(tc).delete(lambda kk, v: kk == k))


def _insert(s: Stash, tc: TypedCollection[Any, Any], k: Any) -> Any:
    return tc.insert_without_overwrite(s, k, 9)


def _table_insert(s: Stash, tc: TypedCollection[Any, Any], k: Any) -> Any:
    t = tc.table(s)
    try:
        t.insert(k, 9)
    except UniquenessViolation as e:
        assert "key already exists" in str(e)
    else:
        raise AssertionError("table.insert added a second entry of a key")
    t.commit()
    return t.get(k)


Path = Callable[[Stash, TypedCollection[Any, Any], Any], Any]

FIND: dict[str, Path] = {
    "peek_key_one": lambda s, tc, k: tc.peek_key_one(s, k),
    "tx.peek_key_one": lambda s, tc, k: s.with_transaction(lambda tx: tx.peek_key_one(tc, k)),
    "table.get": lambda s, tc, k: tc.table(s).get(k),
    "tx.table.get": lambda s, tc, k: s.with_transaction(lambda tx: tx.table(tc).get(k)),
    "eager table.get": lambda s, tc, k: _eager_table(s, tc).get(k),
    "peek_one": lambda s, tc, k: tc.peek_one(s)[k],
}
#: A key's history (not checked for two texts: it lists what is stored).
HISTORY: dict[str, Path] = {
    "iter_key": lambda s, tc, k: sum(v * d for v, _, d in s.iter_key(tc.get(s), k)),
}
REPLACE: dict[str, Path] = {
    "upsert_key": lambda s, tc, k: tc.upsert_key(s, k, 2),
    "upsert": lambda s, tc, k: tc.upsert(s, [(k, 2), (KINDS_OTHER[type(k)], 7)]),
    "table.set": lambda s, tc, k: _table_set(s, tc, k, 2),
    "tx.table.set": lambda s, tc, k: _tx_set(s, tc, k, 2),
    "eager table.update": _eager_update,
}
DELETE: dict[str, Path] = {
    "table.set(None)": lambda s, tc, k: _table_set(s, tc, k, None),
    "tx.table.set(None)": lambda s, tc, k: _tx_set(s, tc, k, None),
    "eager table.delete": _eager_delete,
    "tx.table.delete": _tx_delete_all_rows,
}
REFUSE: dict[str, Path] = {
    "insert_without_overwrite": _insert,
    "table.insert": _table_insert,
}
KINDS_OTHER = {DKey: DKey("b"), NKey: NKey("b"), tuple: ("b", Inner(1))}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_path_finds_replaces_deletes_and_refuses_a_legacy_key(
    open_stash: OpenStash, kind: str
) -> None:
    """One store per backend and kind; each path runs on a fresh collection holding the
    legacy key "a" (and "b"), and the raw consolidated rows are checked after it."""
    _, key, new, old, _ = KINDS[kind]
    s = open_stash()
    names = [("find", n) for n in {**FIND, **HISTORY}] + [("replace", n) for n in REPLACE]
    names += [("delete", n) for n in DELETE] + [("refuse", n) for n in REFUSE]
    for i, (what, name) in enumerate(names):
        # Each path on a collection of its own (named after it).
        tc = _legacy_named(s, kind, f"c{i}")
        before = _raw(s, tc)
        assert (old, "1", 1) in before, name
        path = {**FIND, **HISTORY, **REPLACE, **DELETE, **REFUSE}[name]
        got = path(s, tc, key)
        raw = _raw(s, tc)
        mine = [r for r in raw if r[1] != "7"]
        assert all(d == 1 for _, _, d in raw), (name, raw)
        assert len(_others(s, tc)) == 1, (name, raw)
        if what == "find":
            assert got == 1, name
            assert mine == [(old, "1", 1)], (name, raw)
        elif what == "replace":
            assert mine == [(new, "2", 1)], (name, raw)  # the stored text retracted
            assert tc.peek_key_one(s, key) == 2
        elif what == "delete":
            assert mine == [], (name, raw)
            assert tc.peek_key_one(s, key) is None
        else:
            assert got == 1, name
            assert mine == [(old, "1", 1)], (name, raw)


def _legacy_named(s: Stash, kind: str, name: str) -> TypedCollection[Any, Any]:
    spec, key, _, _, other = KINDS[kind]
    old = s.collection(name, key=OldKeyCodec(spec), value="int")
    s.update_many(old, [((key, 1), 0, 1), ((other, 7), 0, 1)])
    s.seal(old, s.upper(old).from_elem(1))
    return TypedCollection(name, key=spec, value="int")


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_key_held_under_both_of_its_texts_is_refused_by_every_path(
    open_stash: OpenStash, kind: str
) -> None:
    """The legacy text and the text of today both live for one key are two entries of
    one key: every key path raises the error ``peek_one`` raises (naming the collection
    and the key) and commits nothing."""
    spec, key, new, old, _ = KINDS[kind]
    s = open_stash()
    tc = _legacy_named(s, kind, "both")
    c = tc.get(s)
    batch = c.make_batch(s)
    batch.entries.append(((new, "5"), batch.timestamp, 1))  # by hand: the text of today
    s.append([batch])
    before = _raw(s, tc)
    assert [r[0] for r in before if r[1] != "7"] == sorted([new, old])
    paths = {**FIND, **REPLACE, **DELETE, **REFUSE}
    for name, path in paths.items():
        with pytest.raises(StashError, match="duplicate key: collection 'both' holds key"):
            path(s, tc, key)
        assert _raw(s, tc) == before, name


def test_the_key_texts_are_one_definition() -> None:
    """``key_texts`` of every key codec: today's text first, the old full text second
    when it differs; one text for keys without a field at its default."""
    from stash.codec import key_texts

    for spec, key, new, old, _ in KINDS.values():
        kc = resolve_key_codec(spec)
        assert key_texts(kc, key) == (new, old)
        assert kc.encode(key) == new
    assert key_texts(resolve_key_codec(DKey), DKey("a", "eu")) == ('{"name":"a","region":"eu"}',)
    assert key_texts(resolve_key_codec("int"), 3) == ("3",)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_retraction_encoded_by_hand_retracts_the_legacy_text(
    open_stash: OpenStash, kind: str
) -> None:
    """An append batch's entry encoded by hand with a key's old text (as the rows of
    ``peek`` give it) stays that text, so the retraction removes the stored entry
    (before, a NamedTuple or tuple key's text was re-encoded by the key rule: a
    multiplicity -1 for a text not stored, the entry left live)."""
    _, key, _, old, _ = KINDS[kind]
    s = open_stash()
    tc = _legacy_named(s, kind, "byhand")
    c = tc.get(s)
    batch = c.make_batch(s)
    batch.entries.append(((old, "1"), batch.timestamp, -1))
    s.append([batch])
    assert [r for r in _raw(s, tc) if r[1] != "7"] == []
    assert tc.peek_key_one(s, key) is None


@pytest.mark.parametrize("limit", [None, 1])
def test_peek_range_by_a_prefix_holding_a_record_finds_keys_under_both_texts(
    open_stash: OpenStash, limit: int | None
) -> None:
    """A tuple prefix holding a record with a field at its default admits the keys
    stored under either text (the key rule's and every field's): both ranges are read,
    merged in text order, and paged without repeating or skipping a key; a key held
    under both texts raises the duplicate error."""
    spec = tuple[str, Inner, str]
    s = open_stash()
    old = s.collection("r", key=OldKeyCodec(spec), value="int")
    legacy = [("a", Inner(1), "p"), ("a", Inner(1), "r"), ("a", Inner(2), "x")]
    s.update_many(old, [((k, i), 0, 1) for i, k in enumerate(legacy)])
    s.seal(old, s.upper(old).from_elem(1))
    tc = TypedCollection("r", key=spec, value="int")
    tc.upsert(s, [(("a", Inner(1), "q"), 10), (("b", Inner(1), "p"), 11)])
    want = [(("a", Inner(1), "q"), 10), (("a", Inner(1), "p"), 0), (("a", Inner(1), "r"), 1)]
    c = tc.get(s)
    got: list[Any] = []
    after = None
    while True:
        page = s.peek_range(c, prefix=("a", Inner(1)), limit=limit, after=after)
        got += page.entries
        if not page.more:
            break
        after = page.next_after
    # In stored text order: '["a",{"tag":"","x":1},...' (every field) before '["a",{"x":1},'.
    assert sorted(got) == sorted(want) and len(got) == len(want)
    assert s.peek_range(c, prefix=("a", Inner(2))).entries == [(("a", Inner(2), "x"), 2)]
    # The key ("a", Inner(1), "p") under its text of today as well: one key, two entries.
    batch = c.make_batch(s)
    batch.entries.append((('["a",{"x":1},"p"]', "5"), batch.timestamp, 1))
    s.append([batch])
    with pytest.raises(StashError, match="duplicate key: collection 'r' holds key"):
        s.peek_range(c, prefix=("a", Inner(1)))
    with pytest.raises(StashError, match="duplicate key: collection 'r' holds key"):
        s.peek_range(c, prefix=("a",))
