"""Protects: the one-transaction typed writes (``upsert_key``, ``upsert``,
``insert_without_overwrite``) of a collection whose since reached its upper.

``compact(c, upper)`` (or an append whose batch compacts to its own upper) is allowed,
and consolidation then moves every row before the since to time ``upper``. The typed
writes read a key's value at ``upper - 1`` and so found nothing there: ``upsert_key``
wrote the new value without retracting the old one, leaving the key with two values
(every later ``peek_one`` failed with "duplicate peek keys"), and
``insert_without_overwrite`` overwrote a key that held a value."""

from __future__ import annotations

from typing import Any

import pytest

from stash import Antichain, Stash, TypedCollection

pytestmark = pytest.mark.adversarial

CFG = TypedCollection("cfg", key="str", value="int")


def _compacted_to_upper(s: Stash) -> Any:
    CFG.upsert(s, [("a", 1), ("b", 1)])
    c = CFG.get(s)
    s.compact(c, s.upper(c))
    s.consolidate(c)  # rows before the since now lie at the upper
    assert s.since(c) == s.upper(c)
    return c


def test_upsert_key_retracts_a_value_consolidated_to_the_upper(open_stash: Any) -> None:
    s = open_stash()
    _compacted_to_upper(s)
    CFG.upsert_key(s, "a", 2)
    assert CFG.peek_one(s) == {"a": 2, "b": 1}


def test_upsert_retracts_values_consolidated_to_the_upper(open_stash: Any) -> None:
    s = open_stash()
    _compacted_to_upper(s)
    CFG.upsert(s, [("a", 3), ("b", 3), ("c", 3)])
    assert CFG.peek_one(s) == {"a": 3, "b": 3, "c": 3}


def test_insert_without_overwrite_sees_a_value_consolidated_to_the_upper(
    open_stash: Any,
) -> None:
    s = open_stash()
    _compacted_to_upper(s)
    assert CFG.insert_without_overwrite(s, "a", 9) == 1  # writes nothing
    CFG.upsert_key(s, "b", 2)  # moves the upper past the since: peek_one reads again
    assert CFG.peek_one(s) == {"a": 1, "b": 2}


def test_a_batch_compacting_to_its_upper_then_upsert_key(open_stash: Any) -> None:
    s = open_stash()
    c = CFG.get(s)
    b = c.make_batch(s)
    c.append_to_batch(b, "a", 1, 1)
    b.compact = b.upper  # the append consolidates key "a" at its upper
    s.append([b])
    assert s.since(c) == s.upper(c) == Antichain.from_elem(1)
    CFG.upsert_key(s, "a", 2)
    assert CFG.peek_one(s) == {"a": 2}
