"""A record type used as a collection's KEY may gain a field with a default: keys are
stored without the fields that hold their default (``stash.record_codec.key_json``, the
proto3 rule), so ``KeyV1("a")`` and ``KeyV2("a")`` are one stored key, and the new
release finds, replaces and retracts what the old one stored (and the old release reads
what the new one writes with the field at its default).  Also for records nested in a
key record or in a tuple key, ``Optional`` fields defaulting to ``None`` and
``default_factory`` fields; a changed default and keys stored with their defaults by
earlier releases take a ``TypedCollection.migrate``.  Each test here failed on the
release that encoded keys with every field (it wrote a second entry for the key, or
missed it).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import pytest

from stash import Stash, TypedCollection
from stash.codec import resolve_codec, resolve_key_codec
from stash.record_codec import _plan


@dataclass(frozen=True)
class KeyV1:
    __stash_name__ = "app.Key"
    name: str


@dataclass(frozen=True)
class KeyV2:
    __stash_name__ = "app.Key"
    name: str
    region: str = ""


def test_a_key_type_gaining_a_defaulted_field_finds_and_replaces_the_stored_key() -> None:
    with Stash.open("memory://") as s:
        TypedCollection("c", key=KeyV1, value="int").upsert_key(s, KeyV1("a"), 1)
        v2 = TypedCollection("c", key=KeyV2, value="int")
        assert v2.peek_key_one(s, KeyV2("a")) == 1
        v2.upsert_key(s, KeyV2("a"), 2)
        assert v2.peek_one(s) == {KeyV2("a"): 2}


def _raw_keys(s: Stash, tc: TypedCollection[Any, Any]) -> list[str]:
    """The stored key texts of ``tc``'s sealed contents, one per entry."""
    return sorted(k for k, _, d in s._peek_raw(tc.get(s)) for _ in range(d))


def test_the_old_key_and_the_new_key_at_its_default_are_one_stored_key() -> None:
    assert resolve_key_codec(KeyV1).encode(KeyV1("a")) == '{"name":"a"}'
    assert resolve_key_codec(KeyV2).encode(KeyV2("a")) == '{"name":"a"}'
    assert resolve_key_codec(KeyV2).encode(KeyV2("a", "eu")) == '{"name":"a","region":"eu"}'
    assert resolve_key_codec(KeyV2).decode('{"name":"a"}') == KeyV2("a")
    # As a value the record keeps every field (stored values are not re-encoded).
    assert resolve_codec(KeyV2).encode(KeyV2("a")) == '{"name":"a","region":""}'
    assert str(resolve_key_codec(KeyV2).name) == str(resolve_codec(KeyV1).name)


def test_every_key_write_path_replaces_the_key_the_old_release_stored() -> None:
    with Stash.open("memory://") as s:
        v1 = TypedCollection("c", key=KeyV1, value="int")
        v1.upsert(s, [(KeyV1("a"), 1), (KeyV1("b"), 1), (KeyV1("c"), 1), (KeyV1("d"), 1)])
        v2 = TypedCollection("c", key=KeyV2, value="int")
        assert v2.insert_without_overwrite(s, KeyV2("a"), 9) == 1
        v2.upsert(s, [(KeyV2("b"), 2)])
        t = v2.table(s)
        t.set(KeyV2("c"), 2)
        t.commit()
        s.with_transaction(lambda tx: tx.table(v2).set(KeyV2("d"), 2))
        assert v2.peek_one(s) == {KeyV2("a"): 1, KeyV2("b"): 2, KeyV2("c"): 2, KeyV2("d"): 2}
        assert _raw_keys(s, v2) == [f'{{"name":"{n}"}}' for n in "abcd"]
        assert s.with_transaction(lambda tx: tx.peek_key_one(v2, KeyV2("d"))) == 2
        # The old release reads (and replaces) what the new one wrote.
        assert v1.peek_key_one(s, KeyV1("c")) == 2
        v1.upsert_key(s, KeyV1("c"), 3)
        assert v2.peek_one(s)[KeyV2("c")] == 3
        # A table deletes the stored key the new type names.
        t = v2.table(s)
        assert t.delete(lambda k, v: k == KeyV2("b")) == [(KeyV2("b"), 2)]
        t.commit()
        assert set(v1.peek_one(s)) == {KeyV1("a"), KeyV1("c"), KeyV1("d")}


@dataclass(frozen=True)
class Inner1:
    __stash_name__ = "app.Inner"
    id: int


@dataclass(frozen=True)
class Inner2:
    __stash_name__ = "app.Inner"
    id: int
    zone: str | None = None  # Optional, default None
    tags: tuple[str, ...] = dataclasses.field(default_factory=tuple)


@dataclass(frozen=True)
class Outer1:
    __stash_name__ = "app.Outer"
    inner: Inner1


@dataclass(frozen=True)
class Outer2:
    __stash_name__ = "app.Outer"
    inner: Inner2
    version: int = 0


def test_a_record_nested_in_a_key_record_gains_defaulted_fields() -> None:
    with Stash.open("memory://") as s:
        TypedCollection("n", key=Outer1, value="int").upsert_key(s, Outer1(Inner1(1)), 1)
        v2 = TypedCollection("n", key=Outer2, value="int")
        assert v2.peek_key_one(s, Outer2(Inner2(1))) == 1
        v2.upsert_key(s, Outer2(Inner2(1)), 2)
        v2.upsert_key(s, Outer2(Inner2(2, "eu", ("x",)), 1), 5)
        assert v2.peek_one(s) == {Outer2(Inner2(1)): 2, Outer2(Inner2(2, "eu", ("x",)), 1): 5}
        assert _raw_keys(s, v2) == [
            '{"inner":{"id":1}}',
            '{"inner":{"id":2,"tags":["x"],"zone":"eu"},"version":1}',
        ]


def test_a_record_in_a_tuple_key_gains_a_defaulted_field() -> None:
    with Stash.open("memory://") as s:
        old = TypedCollection("t", key=tuple[str, KeyV1], value="int")
        old.upsert_key(s, ("x", KeyV1("a")), 1)
        new = TypedCollection("t", key=tuple[str, KeyV2], value="int")
        assert new.peek_key_one(s, ("x", KeyV2("a"))) == 1
        new.upsert_key(s, ("x", KeyV2("a")), 2)
        assert new.peek_one(s) == {("x", KeyV2("a")): 2}
        # The untyped tuple codec writes records in its keys by the same rule.
        plain = TypedCollection("u", key="tuple", value="int")
        plain.upsert_key(s, ("x", KeyV2("a")), 1)
        plain.upsert_key(s, ("x", KeyV1("a")), 2)
        assert _raw_keys(s, plain) == ['["x",{"name":"a"}]']


@dataclass(frozen=True)
class Group1:
    __stash_name__ = "app.Group"
    members: tuple[KeyV1, ...]


@dataclass(frozen=True)
class Group2:
    __stash_name__ = "app.Group"
    members: tuple[KeyV2, ...]


def test_records_in_a_tuple_field_and_in_a_list_inside_a_tuple_key() -> None:
    with Stash.open("memory://") as s:
        old = TypedCollection("g", key=Group1, value="int")
        old.upsert_key(s, Group1((KeyV1("a"), KeyV1("b"))), 1)
        new = TypedCollection("g", key=Group2, value="int")
        assert new.peek_key_one(s, Group2((KeyV2("a"), KeyV2("b")))) == 1
        new.upsert_key(s, Group2((KeyV2("a"), KeyV2("b"))), 2)
        assert new.peek_one(s) == {Group2((KeyV2("a"), KeyV2("b"))): 2}
        # A list of records inside an untyped tuple key: the same rule at every depth.
        plain = TypedCollection("l", key="tuple", value="int")
        plain.upsert_key(s, ("x", [KeyV1("a")]), 1)
        plain.upsert_key(s, ("x", [KeyV2("a")]), 2)
        assert _raw_keys(s, plain) == ['["x",[{"name":"a"}]]']
        assert plain.peek_key_one(s, ("x", [KeyV1("a")])) == 2


@dataclass(frozen=True)
class KeyEu:
    """The release after KeyV2: ``region`` defaults to "eu" now."""

    __stash_name__ = "app.Key"
    name: str
    region: str = "eu"


def test_a_changed_default_is_migrated_from_the_old_type_to_the_new() -> None:
    """A stored key without ``region`` meant the old default: decoding with the old type
    and encoding with the new one keeps every key's meaning."""
    with Stash.open("memory://") as s:
        v2 = TypedCollection("c", key=KeyV2, value="int")
        v2.upsert(s, [(KeyV2("a"), 1), (KeyV2("b", "eu"), 2)])
        eu = v2.migrate(s, KeyEu, "int", lambda k, v: (KeyEu(k.name, k.region), v))
        assert eu.peek_one(s) == {KeyEu("a", ""): 1, KeyEu("b"): 2}
        assert eu.peek_key_one(s, KeyEu("b")) == 2
        assert _raw_keys(s, eu) == ['{"name":"a","region":""}', '{"name":"b"}']


@dataclass(frozen=True)
class LegacyKey:
    """A key type that had a defaulted field before the key rule."""

    __stash_name__ = "app.LegacyKey"
    name: str
    region: str = ""


@dataclass(frozen=True)
class LegacyKeyGrown:
    """``LegacyKey`` after the key rule, grown by a second defaulted field."""

    __stash_name__ = "app.LegacyKey"
    name: str
    region: str = ""
    zone: str = ""


def test_keys_stored_with_their_defaults_by_earlier_releases_are_found_without_migration(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An earlier release wrote a key type's defaults into its keys: a lookup by a fresh
    key value finds such a key (its old full text is one of its candidate texts), a
    table's update retracts the stored text and writes the key by the key rule, and
    nothing is logged (no migration is needed)."""
    _plan(LegacyKey).legacy_keys_seen = False  # warned once per type and process
    with Stash.open("memory://") as s, caplog.at_level(logging.WARNING, "stash.record_codec"):
        v2 = TypedCollection("c", key=LegacyKey, value="int")
        c = v2.get(s)
        batch = c.make_batch(s)
        batch.entries.append((('{"name":"a","region":""}', "1"), batch.timestamp, 1))
        s.append([batch])
        assert _raw_keys(s, v2) == ['{"name":"a","region":""}']
        assert v2.peek_one(s) == {LegacyKey("a"): 1}
        assert v2.peek_key_one(s, LegacyKey("a")) == 1
        t = v2.table(s, uniqueness_violation=lambda a, b: False)
        t.update(lambda k, v: v + 1)
        t.commit()
        assert _raw_keys(s, v2) == ['{"name":"a"}']
        assert v2.peek_one(s) == {LegacyKey("a"): 2}
        assert not caplog.records


def test_keys_stored_by_a_release_whose_type_had_fewer_fields_need_the_migration(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A key stored by a release before the key rule whose type had FEWER defaulted
    fields than the type of today holds some fields at their default and not others:
    neither candidate text matches it, so a lookup misses it; reading it logs a warning
    (once per type) naming the type and the fix, and the identity migration rewrites the
    collection by the key rule, after which lookups find it."""
    _plan(LegacyKeyGrown).legacy_keys_seen = False
    with Stash.open("memory://") as s, caplog.at_level(logging.WARNING, "stash.record_codec"):
        v3 = TypedCollection("c", key=LegacyKeyGrown, value="int")
        c = v3.get(s)
        batch = c.make_batch(s)
        batch.entries.append((('{"name":"a","region":""}', "1"), batch.timestamp, 1))
        s.append([batch])
        assert v3.peek_key_one(s, LegacyKeyGrown("a")) is None  # neither text matches
        assert v3.peek_one(s) == {LegacyKeyGrown("a"): 1}
        (warned,) = [r.getMessage() for r in caplog.records]
        assert "record:app.LegacyKey(name)" in warned and "region" in warned
        assert "migrate(stash, K, V, lambda k, v: (k, v))" in warned
        v3.migrate(s, LegacyKeyGrown, "int", lambda k, v: (k, v))
        assert _raw_keys(s, v3) == ['{"name":"a"}']
        assert v3.peek_key_one(s, LegacyKeyGrown("a")) == 1


@dataclass(frozen=True)
class WithId:
    name: str
    token: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    when: tuple[int, ...] = dataclasses.field(default_factory=lambda: (1, 2))


def test_a_default_factory_with_a_new_value_per_call_is_always_written() -> None:
    kc = resolve_key_codec(WithId)
    assert kc.encode(WithId("a", "t")) == '{"name":"a","token":"t"}'
    assert kc.encode(WithId("a", "t", (3,))) == '{"name":"a","token":"t","when":[3]}'
    k = WithId("a")
    assert kc.decode(kc.encode(k)) == k
