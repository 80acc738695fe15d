"""Consolidation of updates: sum the diffs of equal data and drop zero diffs.

Invariants kept here: after :func:`consolidate_updates` every ``(data, time)`` appears at
most once, no diff is zero, and the multiset of updates (data, time) weighted by diff is
unchanged.  Data are compared by value (stash data are canonical encodings, so value
equality is encoding equality).  Source of the idea: differential dataflow's
``consolidate_updates``, used by the seed Stash trait (``003``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TypeVar

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
