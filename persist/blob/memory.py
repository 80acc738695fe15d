"""An in-process blob store for tests: :class:`MemoryBlob`.

Invariants kept here:

* a value is copied in on ``set`` (``bytes(value)``) and handed out as is (``bytes`` are
  immutable), under the store's lock, so ``set`` is atomic for every reader;
* a named store (``memory://NAME``) is one dict per process and name, shared by every
  handle of that name, for as long as the process lives; an unnamed one is private.
"""

from __future__ import annotations

import threading
from urllib.parse import SplitResult

from persist.blob.base import (
    BlobMetrics,
    Closable,
    is_valid_key,
    key_repr,
    validate_key,
    validate_prefix,
)
from persist.errors import InvalidKey, InvalidUsage
from stash import redact

__all__ = ["MemoryBlob"]


class _MemoryStore:
    """The shared dict behind one or more :class:`MemoryBlob` handles."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data: dict[str, bytes] = {}


_NAMED_STORES: dict[str, _MemoryStore] = {}
_NAMED_STORES_LOCK = threading.Lock()


class MemoryBlob(Closable):
    """An in-process blob store (for tests): a dict guarded by a lock.

    Args:
        name: ``None`` for a fresh private store; a name shares the store with every
            other ``MemoryBlob`` of that name in this process (``open_blob("memory://n")``).
            The name must be a valid single key segment.

    Raises:
        InvalidKey: the name is not a valid key segment.
    """

    def __init__(self, name: str | None = None) -> None:
        self.name = name
        self.metrics = BlobMetrics()
        if name is None:
            self._store = _MemoryStore()
        else:
            if "/" in name:
                raise InvalidKey(f"invalid memory blob name {key_repr(name)}: no '/' allowed")
            validate_key(name)
            with _NAMED_STORES_LOCK:
                self._store = _NAMED_STORES.setdefault(name, _MemoryStore())

    def __repr__(self) -> str:
        return "MemoryBlob()" if self.name is None else f"MemoryBlob({self.name!r})"

    @classmethod
    def from_uri(cls, uri: str, parts: SplitResult) -> MemoryBlob:
        """The store of ``memory://`` (a fresh private one) or ``memory://NAME`` (the one
        this process shares under that name), ``parts`` being ``urlsplit(uri)``
        (:func:`persist.blob.open_blob` calls this).

        Raises:
            InvalidUsage: a path, query, fragment or user info, or a name that is not one
                key segment (the message carries the redacted URI).
        """
        if parts.path or parts.query or parts.fragment or "@" in parts.netloc:
            raise InvalidUsage(
                f"malformed blob URI {redact(uri)!r}: use memory:// or memory://NAME"
            )
        if parts.netloc == "":
            return cls()
        if not is_valid_key(parts.netloc) or "/" in parts.netloc:
            raise InvalidUsage(
                f"malformed blob URI {redact(uri)!r}: the memory store name must be "
                "one key segment ([A-Za-z0-9][A-Za-z0-9._=-]*)"
            )
        return cls(parts.netloc)

    def get(self, key: str) -> bytes | None:
        """The bytes at ``key`` or ``None``. Raises InvalidKey, BlobError (closed)."""
        validate_key(key)
        self._check_open()
        with self._store.lock:
            value = self._store.data.get(key)
        self.metrics.record_get(0 if value is None else len(value))
        return value

    def set(self, key: str, value: bytes) -> None:
        """Store a copy of ``value`` at ``key``. Raises InvalidKey, BlobError (closed)."""
        validate_key(key)
        self._check_open()
        data = bytes(value)
        with self._store.lock:
            self._store.data[key] = data
        self.metrics.record_set(len(data))

    def delete(self, key: str) -> None:
        """Remove ``key`` (idempotent). Raises InvalidKey, BlobError (closed)."""
        validate_key(key)
        self._check_open()
        with self._store.lock:
            self._store.data.pop(key, None)
        self.metrics.record_delete()

    def list_keys(self, prefix: str = "") -> list[tuple[str, int]]:
        """Sorted ``(key, size)`` of keys starting with ``prefix``."""
        validate_prefix(prefix)
        self._check_open()
        with self._store.lock:
            out = [(k, len(v)) for k, v in self._store.data.items() if k.startswith(prefix)]
        out.sort()
        self.metrics.record_list()
        return out
