"""Protects: a TableTransaction reads keys written as JSON arrays as peek_one does.

The attack: TypedCollection.table over a collection whose keys are JSON arrays (a tuple key
written with the default JSON codec): peek_one turns them into tuples (stash.peek.frozen_key),
but the TableTransaction built from the same contents keeps them as lists, so items()
and initial -- the read-your-writes view -- crash with a raw TypeError."""

from __future__ import annotations

import pytest

from stash import Stash, TypedCollection

pytestmark = pytest.mark.adversarial


def test_table_items_with_array_keys() -> None:
    with Stash.open("memory://", fenced=False) as s:
        t = TypedCollection("c")
        t.upsert(s, [((1, 2), "a"), ((3, 4), "b")])
        assert t.peek_one(s) == {(1, 2): "a", (3, 4): "b"}  # holds
        tt = t.table(s, lambda x, y: x == y)
        assert tt.get((1, 2)) == "a"  # holds
        # Expected: the same dict peek_one gives. Actual: TypeError: unhashable type: 'list'.
        assert tt.items() == {(1, 2): "a", (3, 4): "b"}


def test_table_initial_with_array_keys() -> None:
    with Stash.open("memory://", fenced=False) as s:
        t = TypedCollection("c")
        t.upsert(s, [((1, 2), "a")])
        tt = t.table(s)
        assert tt.initial == {(1, 2): "a"}
