"""Consolidation of updates: sum the diffs of equal data and drop zero diffs.

Invariants kept here: after :func:`consolidate_updates` every ``(data, time)`` appears at
most once, no diff is zero, and the multiset of updates (data, time) weighted by diff is
unchanged.  The rule on diff sums (:func:`diff_sums_fit`): for each ``(key, value)`` the
positive diffs of its stored rows sum to at most ``2**63 - 1`` and the negative ones to at
least ``-2**63``, so every sum a read or a consolidation takes of them, in any order,
fits in i64 (SQLite's ``sum`` fails on an overflow along the way; Postgres casts to
``bigint``); writes that would break it are refused.  Data are compared by value (stash data are
canonical encodings, so value equality is encoding equality).  Source of the idea: differential
dataflow's ``consolidate_updates``, used by Materialize's ``Stash`` trait
(``src/stash/src/lib.rs``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TypeVar

from stash.antichain import I64_MAX, I64_MIN
from stash.errors import StashError

DIFF_SUM_RULE = (
    "diff sums must fit in i64: the positive diffs of each (key, value) must sum to at "
    f"most {I64_MAX} and the negative ones to at least {I64_MIN}"
)

D = TypeVar("D", bound=Hashable)


def consolidate_updates(updates: Iterable[tuple[D, int, int]]) -> list[tuple[D, int, int]]:
    """Consolidate ``[(data, time, diff)]``: one entry per ``(data, time)``, no zero diff.

    The result keeps first-seen order; callers sort as they need.
    """
    acc: dict[tuple[D, int], int] = {}
    for data, time, diff in updates:
        k = (data, time)
        acc[k] = acc.get(k, 0) + diff
    return [(d, t, n) for (d, t), n in acc.items() if n != 0]


def consolidate(updates: Iterable[tuple[D, int]]) -> list[tuple[D, int]]:
    """Consolidate ``[(data, diff)]``: one entry per data, no zero diff."""
    acc: dict[D, int] = {}
    for data, diff in updates:
        acc[data] = acc.get(data, 0) + diff
    return [(d, n) for d, n in acc.items() if n != 0]


class DiffSumOverflow(StashError):
    """A write would break the rule on diff sums (see the module docstring).

    Attributes:
        collection_id: the collection's id.
    """

    def __init__(self, collection_id: int) -> None:
        super().__init__(f"collection id {collection_id}: {DIFF_SUM_RULE}")
        self.collection_id = collection_id


def diff_sums_fit(rows: Iterable[tuple[Hashable, int]]) -> bool:
    """Whether ``[(data, diff)]`` keeps the rule: per data, positive diffs sum to at most
    ``I64_MAX`` and negative ones to at least ``I64_MIN`` (exact Python integers)."""
    pos: dict[Hashable, int] = {}
    neg: dict[Hashable, int] = {}
    for data, d in rows:
        if d > 0:
            n = pos[data] = pos.get(data, 0) + d
            if n > I64_MAX:
                return False
        elif d < 0:
            n = neg[data] = neg.get(data, 0) + d
            if n < I64_MIN:
                return False
    return True
