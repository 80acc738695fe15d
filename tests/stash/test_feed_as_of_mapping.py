"""``Stash.subscribe`` with ``as_of`` as a mapping must give a time for every subscribed
collection: one left out (or misspelt) raised a bare ``KeyError``; now a ``StashError``
naming it.  Names it does not subscribe are ignored (one progress map for several
feeds)."""

from __future__ import annotations

import pytest

from stash import Stash, StashError, TypedCollection


@pytest.mark.parametrize("as_of", [{"a": 0}, {"a": 0, "B": 0}], ids=["left-out", "misspelt"])
def test_an_as_of_mapping_must_name_the_subscribed_collections(as_of: dict[str, int]) -> None:
    with Stash.open("memory://") as s:
        a, b = (
            TypedCollection("a", key="str", value="int"),
            TypedCollection("b", key="str", value="int"),
        )
        a.upsert_key(s, "x", 1)
        b.upsert_key(s, "y", 1)
        with pytest.raises(StashError, match=r"no time for the subscribed collection\(s\) \['b'\]"):
            list(s.subscribe([a.get(s), b.get(s)], as_of, idle_timeout=0.1))
        progress = {"a": 0, "b": 0, "other": 7}
        got = list(s.subscribe([a.get(s), b.get(s)], progress, idle_timeout=0.1))
        assert [type(e).__name__ for e in got] == ["Change", "Progress", "Change", "Progress"]
