"""``TypedCollection.migrate``: a collection's entries and recorded codec names rewritten in
one transaction (issue 15, the stash side), on every backend."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import OpenStash

from stash import Antichain, StashError, TypedCollection


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
    assert tc.peek_one(s2)[1] == {"name": "ada"}  # s2 caches the old codecs
    new = tc.migrate(s1, "str", "json", lambda k, v: (str(k), v))
    with pytest.raises(StashError, match=r"now has codecs \(key=str, value=json\).*nothing"):
        tc.upsert_key(s2, 9, {"name": "old"})
    assert new.peek_one(s1) == {"1": {"name": "ada"}, "2": {"name": "bo"}}
    # Reopened with the new codecs, s2 writes again.
    new.upsert_key(s2, "9", {"name": "new"})
    assert new.peek_one(s1)["9"] == {"name": "new"}


def test_migrating_an_empty_collection_only_changes_codecs(open_stash: OpenStash) -> None:
    s = open_stash()
    tc: TypedCollection[Any, Any] = TypedCollection("empty", "json", "json")
    tc.get(s)
    new = tc.migrate(s, "str", "int", lambda k, v: (k, v))
    assert new.peek_one(s) == {}
    new.upsert_key(s, "a", 1)
    assert new.peek_one(s) == {"a": 1}
