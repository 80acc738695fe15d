"""``TableTransaction``: SQL-table-like edits of one collection's contents, committed as
one append batch.

Invariants kept here:

* ``items()`` is always the initial contents with the pending changes applied
  (read-your-writes);
* no two visible values violate the uniqueness predicate, and no key appears twice:
  an ``insert``/``update``/``set`` that would break this raises and changes nothing;
* ``pending()`` lists, in key order, for each changed key its retraction (diff -1) before
  its insertion (diff +1); a key set back to its initial value yields nothing.

Source of the idea: the seed's ``TableTransaction`` (``003``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

from stash.codec import json_sort_key
from stash.errors import StashError

K = TypeVar("K")
V = TypeVar("V")

_DELETED: Any = object()


def _sort_key(k: Any) -> Any:
    try:
        return json_sort_key(k)
    except Exception:  # pragma: no cover - non-JSON keys (records) sort by repr
        return (9, repr(k))


class TableTransaction(Generic[K, V]):
    """Pending edits over ``initial`` with uniqueness checks.

    Args:
        initial: the current contents, ``{key: value}`` (e.g. ``stash.peek_one(c)``).
        uniqueness_violation: ``f(a, b) -> bool``, true when two distinct rows' values may
            not coexist (e.g. the same name); ``None`` for no constraint beyond the key.
    """

    def __init__(
        self,
        initial: Mapping[K, V],
        uniqueness_violation: Callable[[V, V], bool] | None = None,
    ) -> None:
        self.initial: dict[K, V] = dict(initial)
        self._pending: dict[K, Any] = {}
        self._violates = uniqueness_violation

    # ------------------------------------------------------------ reading
    def for_values(self, f: Callable[[K, V], None]) -> None:
        """Call ``f(key, value)`` for every visible row (pending changes applied)."""
        for k, v in self._pending.items():
            if v is not _DELETED:
                f(k, v)
        for k, v in self.initial.items():
            if k not in self._pending:
                f(k, v)

    def items(self) -> dict[K, V]:
        """The visible rows as a dict in key order."""
        out: dict[K, V] = {}
        self.for_values(out.__setitem__)
        return dict(sorted(out.items(), key=lambda kv: _sort_key(kv[0])))

    def get(self, key: K) -> V | None:
        """The visible value of ``key`` or ``None``."""
        if key in self._pending:
            v = self._pending[key]
            return None if v is _DELETED else v
        return self.initial.get(key)

    def _visible(self, key: K) -> bool:
        if key in self._pending:
            return self._pending[key] is not _DELETED
        return key in self.initial

    def pending(self) -> list[tuple[K, V, int]]:
        """The changes as ``[(key, value, diff)]``: per changed key in key order, the
        retraction of its initial value (-1) then its new value (+1)."""
        out: list[tuple[K, V, int]] = []
        for k in sorted(self._pending, key=_sort_key):
            new = self._pending[k]
            if k in self.initial:
                old = self.initial[k]
                if new is not _DELETED and new == old:
                    continue
                out.append((k, old, -1))
            if new is not _DELETED:
                out.append((k, new, 1))
        return out

    # ------------------------------------------------------------ checks
    def _verify(self, changes: Mapping[K, Any]) -> None:
        violates = self._violates
        if violates is None:
            return
        trial = dict(self._pending)
        trial.update(changes)
        visible: list[tuple[K, V]] = [(k, v) for k, v in trial.items() if v is not _DELETED]
        visible += [(k, v) for k, v in self.initial.items() if k not in trial]
        changed = [(k, v) for k, v in changes.items() if v is not _DELETED]
        for ck, cv in changed:
            for k, v in visible:
                if k != ck and (violates(cv, v) or violates(v, cv)):
                    raise StashError("uniqueness violation")

    # ------------------------------------------------------------ writing
    def insert(self, key: K, value: V) -> None:
        """Add a new row.

        Raises:
            StashError: the key exists (``key already exists``) or the value violates
                uniqueness (``uniqueness violation``); nothing changes then.
        """
        if self._visible(key):
            raise StashError("uniqueness violation: key already exists")
        self._verify({key: value})
        self._pending[key] = value

    def update(self, f: Callable[[K, V], V | None]) -> int:
        """Replace the value of every row for which ``f(key, value)`` returns a value;
        return the number of rows changed.

        Raises:
            StashError: the new values violate uniqueness; nothing changes then.
        """
        changes: dict[K, Any] = {}

        def visit(k: K, v: V) -> None:
            new = f(k, v)
            if new is not None:
                changes[k] = new

        self.for_values(visit)
        self._verify(changes)
        self._pending.update(changes)
        return len(changes)

    def delete(self, f: Callable[[K, V], bool]) -> list[tuple[K, V]]:
        """Delete every row for which ``f(key, value)`` is true; return them."""
        deleted: list[tuple[K, V]] = []

        def visit(k: K, v: V) -> None:
            if f(k, v):
                deleted.append((k, v))

        self.for_values(visit)
        for k, _ in deleted:
            self._pending[k] = _DELETED
        return deleted

    def set(self, key: K, value: V | None) -> None:
        """Set ``key`` to ``value`` (insert or replace); ``None`` deletes the key.

        Raises:
            StashError: the value violates uniqueness; nothing changes then.
        """
        if value is None:
            self._pending[key] = _DELETED
            return
        self._verify({key: value})
        self._pending[key] = value

    def set_many(self, entries: Iterable[tuple[K, V | None]]) -> None:
        """:meth:`set` for several keys, checked together (all or nothing)."""
        changes = {k: (_DELETED if v is None else v) for k, v in entries}
        self._verify(changes)
        self._pending.update(changes)
