"""A dict that notes which of its keys changed since it was copied: how a shard state's
leases and landed records report what a command touched.

A transition runs on a clone of the cached version (:meth:`persist.state.ShardState.clone`),
whose ``readers`` and ``writers`` maps are :class:`TrackedDict` copies of the
cached version's.  Whatever code mutates them, through any of the dict's methods, the
keys it set or removed are in :attr:`TrackedDict.changed`, so encoding the new version
(:func:`persist.state_codec.to_entries_delta`) looks only at those.  The 256 landed
records every append keeps (one in, the oldest out, in one function) are a plain
``dict`` copy, which ``dict.copy`` clones in C, written through a :class:`Noting`
that notes the keys it sets or removes (:func:`noted_keys`).

Invariants kept here: every key whose value may differ from the ``origin`` dict's
(set, replaced or removed through any mutating method of ``dict``) is in ``changed``
(a superset: a key set back to its old value stays listed); ``origin`` is the dict the
copy was made of, which its owner never mutates afterwards (a published version is
immutable), so ``changed`` is meaningful only while ``origin`` is the very dict compared
against (:func:`changed_keys` checks it, and compares every key otherwise).  A copy
keeps at most one version alive: copying a :class:`TrackedDict` drops that one's own
``origin`` (its version was encoded before it was copied; if not, its encoding falls
back to comparing every key), so the versions a shard went through are not chained.

Source of the idea: Materialize's persist-client ``internal/state_diff.rs``, whose
``StateDiff`` lists the changed entries of each collection of the state rather than
comparing whole versions.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, ValuesView
from typing import Any, Generic, TypeVar

__all__ = ["Noting", "TrackedDict", "changed_keys", "noted_keys"]

K = TypeVar("K")
V = TypeVar("V")

_MISSING: Any = object()


class TrackedDict(dict[K, V]):
    """A copy of ``origin`` (a mapping, or nothing) that records in :attr:`changed` the
    keys set or removed since (reads cost what a ``dict``'s do; a write a Python call)."""

    __slots__ = ("changed", "origin")

    def __init__(self, origin: Mapping[K, V] | None = None) -> None:
        if origin is None:
            super().__init__()
        else:
            super().__init__(origin)
            if type(origin) is TrackedDict:
                # The origin is copied again: its own version was encoded, so its
                # record of changes goes (else every version would keep the one
                # before it alive, back to the first).
                origin.origin = None
                origin.changed = set()
        self.origin: Mapping[K, V] | None = origin
        self.changed: set[K] = set()

    def __setitem__(self, key: K, value: V) -> None:
        self.changed.add(key)
        super().__setitem__(key, value)

    def __delitem__(self, key: K) -> None:
        super().__delitem__(key)
        self.changed.add(key)

    def pop(self, key: K, default: Any = _MISSING) -> Any:
        if key in self:
            self.changed.add(key)
            return super().pop(key)
        if default is _MISSING:
            raise KeyError(key)
        return default

    def popitem(self) -> tuple[K, V]:
        k, v = super().popitem()
        self.changed.add(k)
        return k, v

    def setdefault(self, key: K, default: Any = None) -> Any:
        if key not in self:
            self.changed.add(key)
        return super().setdefault(key, default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def __ior__(self, other: Any) -> TrackedDict[K, V]:  # type: ignore[override,misc]
        self.update(other)
        return self

    def clear(self) -> None:
        self.changed.update(self)
        super().clear()

    def __reduce__(self) -> tuple[Any, ...]:
        # Copied or pickled as a plain dict (the record of changes is this copy's own).
        return (dict, (dict(self),))


def changed_keys(old: Mapping[K, Any], new: Mapping[K, Any]) -> Iterable[K]:
    """The keys whose values may differ between ``old`` and ``new``: ``new``'s record of
    changes when it is a :class:`TrackedDict` copied from ``old`` itself, else every key
    of either (a full comparison)."""
    if type(new) is TrackedDict and new.origin is old:
        return new.changed
    keys: dict[K, None] = dict.fromkeys(old)
    keys.update(dict.fromkeys(new))
    return keys


class Noting(Generic[K, V]):
    """Writes to the plain dict ``target`` that note in ``changed`` the keys they set or
    remove: what a command of a shard state hands the one function that changes its
    landed records (:func:`persist.landed.record`), whose ``dict`` is copied at
    C speed (``dict.copy``; a :class:`TrackedDict` copy re-inserts every key of an
    origin that had a key removed, 256 records per append).  Only the methods that
    function calls are offered (any other is an ``AttributeError``, never a silent
    unnoted write)."""

    __slots__ = ("changed", "target")

    def __init__(self, target: dict[K, V], changed: set[K]) -> None:
        self.target = target
        self.changed = changed

    def __setitem__(self, key: K, value: V) -> None:
        self.changed.add(key)
        self.target[key] = value

    def pop(self, key: K, default: Any = _MISSING) -> Any:
        if key in self.target:
            self.changed.add(key)
            return self.target.pop(key)
        if default is _MISSING:
            raise KeyError(key)
        return default

    def get(self, key: K, default: Any = None) -> Any:
        return self.target.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self.target

    def __len__(self) -> int:
        return len(self.target)

    def __iter__(self) -> Iterator[K]:
        return iter(self.target)

    def values(self) -> ValuesView[V]:
        return self.target.values()


def noted_keys(
    old: Mapping[K, Any], new: Mapping[K, Any], notes: tuple[Mapping[K, Any], set[K]] | None
) -> Iterable[K]:
    """The keys whose values may differ between ``old`` and ``new``, a copy of ``old``
    changed only through a :class:`Noting` whose ``changed`` is ``notes[1]``, made when
    ``notes[0]`` was copied: those keys when ``notes[0]`` is ``old`` itself, else
    :func:`changed_keys` (every key, unless ``new`` is a :class:`TrackedDict`)."""
    if notes is not None and notes[0] is old:
        return notes[1]
    return changed_keys(old, new)
