"""Memoisation keyed by Arrow schemas that tells schemas apart by their metadata.

``pyarrow.Schema``'s ``==`` and ``hash`` ignore field and schema metadata, so a plain
:func:`functools.lru_cache` keyed by a schema hands a call the result computed for an
earlier schema that differs only in metadata (a shard would then store, and read back,
another shard's schema without its metadata).  :func:`schema_cache` is an
``lru_cache`` whose keys compare schemas (alone or in tuples) with
``Schema.equals(check_metadata=True)``.

Invariant kept here: a cached result is returned only for arguments equal to the ones
it was computed from, metadata included; the hash is still pyarrow's (equal schemas
hash equally), so lookups cost what they cost before, plus one exact comparison on a
hit by a different object.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import pyarrow as pa

__all__ = ["exactly_equal", "schema_cache"]

R = TypeVar("R")


def exactly_equal(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are equal, schemas (alone or inside tuples) compared with
    their metadata; any other value with ``==``."""
    if a is b:
        return True
    if isinstance(a, pa.Schema):
        return isinstance(b, pa.Schema) and a.equals(b, check_metadata=True)
    if isinstance(a, tuple):
        return (
            isinstance(b, tuple)
            and len(a) == len(b)
            and all(exactly_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return bool(a == b)


class _Exact:
    """A cache key holding one argument: pyarrow's hash, :func:`exactly_equal`."""

    __slots__ = ("_hash", "value")

    def __init__(self, value: Any) -> None:
        self.value = value
        self._hash = hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Exact) and exactly_equal(self.value, other.value)


def schema_cache(maxsize: int) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """``functools.lru_cache(maxsize)`` for a function of positional arguments, some of
    them schemas or tuples of schemas, that tells schemas apart by their metadata.

    The decorated function keeps ``cache_clear()``.
    """

    def decorate(fn: Callable[..., R]) -> Callable[..., R]:
        @functools.lru_cache(maxsize=maxsize)
        def cached(*keys: Any) -> R:
            return fn(*(k.value if type(k) is _Exact else k for k in keys))

        @functools.wraps(fn)
        def wrapper(*args: Any) -> R:
            return cached(*(_Exact(a) if isinstance(a, (pa.Schema, tuple)) else a for a in args))

        wrapper.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        return wrapper

    return decorate
