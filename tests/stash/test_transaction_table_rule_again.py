"""Protects: a uniqueness rule given to ``tx.table`` is enforced even when the
transaction already has a table of that collection.

``Transaction.table`` returns one table per collection, so a rule passed after an
earlier ``tx.table(c)`` (a helper that read a key first) was dropped without a word: the
transaction committed two rows the rule forbids. Now a rule given again is enforced too:
the table's pending changes are checked against it at once, and every later change."""

from __future__ import annotations

from typing import Any

import pytest

from stash import TypedCollection, UniquenessViolation

pytestmark = pytest.mark.adversarial

TABLES = TypedCollection("tables", key="str", value="int")


def _same(a: int, b: int) -> bool:
    return a == b


def test_a_rule_given_after_a_lazy_table_is_enforced(open_stash: Any) -> None:
    s = open_stash()
    TABLES.upsert(s, [("orders", 1)])

    def fn(tx: Any) -> None:
        assert tx.table(TABLES).get("orders") == 1
        tx.table(TABLES, _same).insert("sales", 1)

    with pytest.raises(UniquenessViolation) as e:
        s.with_transaction(fn)
    assert (e.value.collection, e.value.key, e.value.existing_key) == ("tables", "sales", "orders")
    assert TABLES.peek_one(s) == {"orders": 1}


def test_a_rule_given_again_checks_the_pending_changes(open_stash: Any) -> None:
    s = open_stash()
    TABLES.upsert(s, [("orders", 1)])

    def fn(tx: Any) -> None:
        tx.table(TABLES).insert("sales", 1)
        tx.table(TABLES, _same)

    with pytest.raises(UniquenessViolation):
        s.with_transaction(fn)
    assert TABLES.peek_one(s) == {"orders": 1}


def test_two_rules_are_both_enforced_and_the_same_rule_is_kept_once(open_stash: Any) -> None:
    s = open_stash()
    TABLES.upsert(s, [("orders", 1)])

    def fn(tx: Any) -> int:
        t = tx.table(TABLES, _same)
        assert tx.table(TABLES, _same) is t
        tx.table(TABLES, lambda a, b: a + b == 10)
        with pytest.raises(UniquenessViolation):
            t.insert("x", 9)  # 1 + 9: the second rule
        with pytest.raises(UniquenessViolation):
            t.insert("y", 1)  # the first rule
        t.insert("z", 2)
        return len(t.items())

    assert s.with_transaction(fn) == 2
    assert TABLES.peek_one(s) == {"orders": 1, "z": 2}
