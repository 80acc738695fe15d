"""``TypedCollection.migrate``: a collection's entries and recorded codec names rewritten in
one transaction (the stash side of schema evolution), on every backend."""

from __future__ import annotations

from typing import Any

import pytest

from stash import Antichain, StashError, TypedCollection
from stash.codec import JsonCodec
from tests.stash.conftest import OpenStash


def _seed(stash: Any) -> TypedCollection[Any, Any]:
    tc: TypedCollection[Any, Any] = TypedCollection("users", "int", "json")
    tc.upsert(stash, [(1, {"name": "ada"}), (2, {"name": "bob"})])
    tc.upsert_key(stash, 2, {"name": "bo"})  # history: a retraction and a new value
    return tc


def test_migrate_rewrites_entries_and_codecs(open_stash: OpenStash) -> None:
    s = open_stash()
    tc = _seed(s)
    upper = tc.upper(s).as_option()
    assert upper is not None
    new = tc.migrate(s, "str", "json", lambda k, v: (f"u{k}", {**v, "id": k}))
    assert new.peek_one(s) == {"u1": {"name": "ada", "id": 1}, "u2": {"name": "bo", "id": 2}}
    c = s.collection("users", "str", "json")
    assert s.since(c) == Antichain.from_elem(upper) and s.upper(c) == Antichain.from_elem(upper + 1)
    # Physically consolidated: only the new encodings remain, at the migration's time.
    assert sorted((k, v, t, d) for (k, v), t, d in s.iter(c)) == [
        ("u1", {"name": "ada", "id": 1}, upper, 1),
        ("u2", {"name": "bo", "id": 2}, upper, 1),
    ]
    # The recorded codec names changed: every handle (and a fresh one) sees them.
    fresh = open_stash()
    assert {n: (c.key_codec.name, c.value_codec.name) for n, c in fresh.collections().items()}[
        "users"
    ] == ("str", "json")
    with pytest.raises(StashError, match=r"created with codecs \(key=str, value=json\)"):
        fresh.collection("users", "int", "json")
    new.upsert_key(fresh, "u3", {"name": "cy", "id": 3})
    assert set(new.peek_one(s)) == {"u1", "u2", "u3"}


def test_a_failed_migration_commits_nothing(open_stash: OpenStash) -> None:
    s = open_stash()
    tc = _seed(s)
    before = tc.peek_one(s)
    c = tc.get(s)
    frontiers = (s.since(c), s.upper(c))

    def boom(k: Any, v: Any) -> Any:
        if k == 2:
            raise RuntimeError("fn failed")
        return k, v

    with pytest.raises(RuntimeError, match="fn failed"):
        tc.migrate(s, "int", "json", boom)
    with pytest.raises(StashError, match=r"keys 1 and 2 both map to key 0"):
        tc.migrate(s, "int", "json", lambda k, v: (0, v))
    with pytest.raises(StashError, match="does not encode"):
        tc.migrate(s, "int", "str", lambda k, v: (k, v))  # a dict is not a str
    for h in (s, open_stash()):
        assert tc.peek_one(h) == before
        assert (h.since(tc.get(h)), h.upper(tc.get(h))) == frontiers


def test_a_stale_handle_cannot_write_after_a_migration(open_stash: OpenStash) -> None:
    s1, s2 = open_stash(), open_stash()
    tc = _seed(s1)
    c2 = tc.get(s2)  # made with the old codecs, before the migration
    assert s2.peek_one(c2)[1] == {"name": "ada"}
    new = tc.migrate(s1, "str", "json", lambda k, v: (str(k), v))
    batch = c2.make_batch(s2)  # frontiers do not depend on codecs
    c2.append_to_batch(batch, 9, {"name": "old"}, 1)
    with pytest.raises(StashError, match=r"now has codecs \(key=str, value=json\).*nothing"):
        s2.append([batch])
    # A TypedCollection with the old codecs cannot even get the collection any more.
    with pytest.raises(StashError, match=r"created with codecs \(key=str, value=json\)"):
        tc.upsert_key(s2, 9, {"name": "old"})
    assert new.peek_one(s1) == {"1": {"name": "ada"}, "2": {"name": "bo"}}
    # Reopened with the new codecs, s2 writes again.
    new.upsert_key(s2, "9", {"name": "new"})
    assert new.peek_one(s1)["9"] == {"name": "new"}


STALE = r"collection c now has codecs \(key=str, value={new}\) \(migrated.*\(key=str, value=str\)"


def test_a_stale_handles_writes_are_all_refused(open_stash: OpenStash) -> None:
    """Every write that encodes through a handle made before a migration (by another
    stash handle, or by the migrating one) is refused and commits nothing: ``update``,
    ``update_many``, ``append`` and a committed ``TableTransaction``.  (Before the
    fix, ``update`` committed old-encoded entries, after which every
    reader with the new codecs failed.)"""
    a, b = open_stash(), open_stash()
    tc: TypedCollection[str, str] = TypedCollection("c", key="str", value="str")
    ca = tc.get(a)
    a.update(ca, ("k", "1"), 0, 1)
    a.seal(ca, Antichain.from_elem(1))
    cb = tc.get(b)
    table = tc.table(b)  # read before the migration
    new = tc.migrate(a, "str", "int", lambda k, v: (k, int(v)))
    up = b.upper(cb).as_option()  # reads of frontiers work through a stale handle
    assert up is not None
    refused = STALE.format(new="int") + r".*nothing was committed"
    for h, c in ((b, cb), (a, ca)):
        with pytest.raises(StashError, match=refused):
            h.update(c, ("z", "not-an-int"), up, 1)
        with pytest.raises(StashError, match=refused):
            h.update_many(c, [(("z", "x"), up, 1), (("y", "x"), up + 1, 1)])
        batch = c.make_batch(h)
        c.append_to_batch(batch, "z", "not-an-int", 1)
        with pytest.raises(StashError, match=refused):
            h.append([batch])
    with pytest.raises(StashError, match=STALE.format(new="int")):
        table.insert("z", "not-an-int")  # the table reads the key: through the stale handle
    batch = cb.make_batch(b)
    cb.append_to_batch(batch, "z", "not-an-int", 1)
    for k, v, d in table.pending():
        cb.append_to_batch(batch, k, v, d)
    with pytest.raises(StashError, match=refused):
        b.append([batch])
    # A batch of another, unmigrated collection in the same append commits nothing either.
    other = b.collection("other", key="str", value="str")
    ob = other.make_batch(b)
    other.append_to_batch(ob, "o", "1", 1)
    with pytest.raises(StashError, match=refused):
        b.append([ob, batch])
    assert b.iter(other) == [] and b.upper(other) == Antichain.from_elem(0)
    # Nothing old-encoded reached the collection: a new-codec reader reads it.
    for h in (a, b, open_stash()):
        assert new.peek_one(h) == {"k": 1}
        assert h.iter(new.get(h)) == [(("k", 1), up - 1, 1)]
    # Frontier-only calls still work through the stale handle.
    b.seal(cb, Antichain.from_elem(up + 1))
    assert new.upper(a) == Antichain.from_elem(up + 1)


def test_a_stale_handle_does_not_misread_after_a_migration(open_stash: OpenStash) -> None:
    """Every read that decodes through a handle made before a migration raises an error
    naming the collection and both codec pairs, instead of decoding the new encoding with
    the old codecs (a peek used to return the bytes' base64 text as the str value)."""
    a, b = open_stash(), open_stash()
    tc: TypedCollection[str, str] = TypedCollection("c", key="str", value="str")
    ca = tc.get(a)
    a.update(ca, ("k", "hello"), 0, 1)
    a.seal(ca, Antichain.from_elem(1))
    cb = tc.get(b)
    assert b.peek_one(cb) == {"k": "hello"}
    new = tc.migrate(a, "str", "bytes", lambda k, v: (k, v.encode()))
    stale = STALE.format(new="bytes")
    for h, c in ((b, cb), (a, ca)):
        for read, args in (
            (h.peek_one, ()),
            (h.peek, ()),
            (h.peek_key_one, ("k",)),
            (h.iter, ()),
            (h.iter_key, ("k",)),
        ):
            with pytest.raises(StashError, match=stale):
                read(c, *args)
        # Frontiers do not depend on codecs.
        assert h.peek_timestamp(c) == 1 and h.since(c) == Antichain.from_elem(1)
    for h in (a, b):
        assert new.peek_one(h) == {"k": b"hello"}
        assert h.peek_key_one(new.get(h), "k") == b"hello"


def test_a_stale_handle_cannot_reopen_with_the_old_codecs(open_stash: OpenStash) -> None:
    """``collection(name, old codecs)`` on a handle that opened the collection before
    another handle migrated it is refused (it used to be answered from the handle's
    cache), as on a fresh handle; with the new codecs it opens."""
    a, b = open_stash(), open_stash()
    tc: TypedCollection[str, str] = TypedCollection("c", key="str", value="str")
    tc.get(a)
    tc.get(b)
    new = tc.migrate(a, "str", "bytes", lambda k, v: (k, v.encode()))
    for h in (open_stash(), b, a):
        with pytest.raises(
            StashError, match=r"created with codecs \(key=str, value=bytes\).*opened with "
        ):
            h.collection("c", key="str", value="str")
        with pytest.raises(StashError, match="created with codecs"):
            tc.peek_one(h)
        assert new.get(h).value_codec.name == "bytes"


def test_a_cached_leader_sees_its_own_migration(open_stash: OpenStash) -> None:
    """Over ``Memory`` (the cache is on for a fenced leader), a handle made before the
    leader's migration is refused although the collection's state was cached."""
    s = open_stash(fenced=True)
    tc: TypedCollection[str, str] = TypedCollection("c", key="str", value="str")
    tc.upsert(s, [("k", "1")])
    c = tc.get(s)
    assert s.peek_one(c) == {"k": "1"} and s.peek_one(c) == {"k": "1"}  # cached
    new = tc.migrate(s, "str", "int", lambda k, v: (k, int(v)))
    with pytest.raises(StashError, match=STALE.format(new="int")):
        s.peek_one(c)
    assert new.peek_one(s) == {"k": 1}
    assert new.peek_one(s) == {"k": 1}


class _Custom(JsonCodec):
    """A codec no other process can resolve by its recorded name."""

    name = "custom-json"


def test_a_collection_with_an_unresolvable_codec_still_lists_and_reads(
    open_stash: OpenStash,
) -> None:
    """``collections()`` hands out JSON handles for codecs it cannot resolve; they keep
    the recorded names, so the codec check lets them read (and refuses them once the
    collection is migrated)."""
    s = open_stash()
    c = s.collection("c", key="str", value=_Custom())
    s.update(c, ("k", {"a": 1}), 0, 1)
    s.seal(c, Antichain.from_elem(1))
    listed = open_stash().collections()["c"]
    assert listed.codec_names == ("str", "custom-json")
    assert s.peek_one(listed) == {"k": {"a": 1}}
    TypedCollection("c", "str", _Custom()).migrate(s, "str", "json", lambda k, v: (k, v))
    with pytest.raises(StashError, match=r"now has codecs \(key=str, value=json\)"):
        s.peek_one(listed)


def test_migrating_an_empty_collection_only_changes_codecs(open_stash: OpenStash) -> None:
    s = open_stash()
    tc: TypedCollection[Any, Any] = TypedCollection("empty", "json", "json")
    tc.get(s)
    new = tc.migrate(s, "str", "int", lambda k, v: (k, v))
    assert new.peek_one(s) == {}
    new.upsert_key(s, "a", 1)
    assert new.peek_one(s) == {"a": 1}
