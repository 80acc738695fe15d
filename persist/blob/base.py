"""The blob contract: the :class:`Blob` protocol, key validation and call counters.

Everything here is shared by every blob store of :mod:`persist.blob` (the stores
themselves live in one module each; :func:`persist.blob.open_blob` picks one by URI).

Invariants kept here:

* every key is validated by :func:`validate_key` before any I/O: keys are relative paths
  of ``/``-separated segments matching ``[A-Za-z0-9][A-Za-z0-9._=-]*``, so no key can
  name ``..``, an absolute path, a hidden file or anything outside the store's root;
  names starting with :data:`TMP_PREFIX` (a store's temporary files) are never keys;
* a :class:`Blob`'s ``set`` is atomic (a reader sees the previous value, or nothing, or
  the whole new value, never a prefix) and its ``delete`` idempotent; every failure of
  the underlying storage surfaces as :class:`~persist.errors.BlobError` (or its subclass
  :class:`~persist.errors.InvalidKey`);
* :class:`BlobMetrics` counts completed calls only, under a lock (thread-safe);
* a closed store (:class:`Closable`) refuses every later call with BlobError.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

from persist.errors import BlobError, InvalidKey

__all__ = [
    "MAX_KEY_LENGTH",
    "MAX_SEGMENT_LENGTH",
    "SEGMENT_RE",
    "TMP_PREFIX",
    "Blob",
    "BlobMetrics",
    "Closable",
    "is_valid_key",
    "key_repr",
    "validate_key",
    "validate_prefix",
]

#: Longest key accepted by :func:`validate_key`, in characters.
MAX_KEY_LENGTH = 1024
#: Longest segment (between ``/``) accepted, in characters (the usual file-name limit).
MAX_SEGMENT_LENGTH = 255
#: What every key segment matches (a name starting with ``.`` never does).
SEGMENT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=-]*")
#: The name prefix of a store's temporary files (never a valid key, so never listed).
TMP_PREFIX = ".tmp-"


# --------------------------------------------------------------------------- keys


def key_repr(key: object) -> str:
    """``repr`` of a key for error messages, cut to at most ~120 characters."""
    r = repr(key)
    return r if len(r) <= 120 else r[:100] + "...(" + str(len(r)) + " chars)"


def _key_rule_broken(key: object) -> str | None:
    if not isinstance(key, str):
        return f"a key must be a str, not {type(key).__name__}"
    if key == "":
        return "a key must not be empty"
    if len(key) > MAX_KEY_LENGTH:
        return f"a key must be at most {MAX_KEY_LENGTH} characters, this one has {len(key)}"
    if "\x00" in key:
        return "a key must not contain NUL"
    if "\\" in key:
        return "a key must not contain a backslash"
    if key.startswith("/"):
        return "a key must be relative (no leading '/')"
    for segment in key.split("/"):
        if segment == "":
            return "a key must not have empty segments ('//' or a trailing '/')"
        if segment in (".", ".."):
            return f"a key must not contain the segment {segment!r}"
        if len(segment) > MAX_SEGMENT_LENGTH:
            return f"a key segment must be at most {MAX_SEGMENT_LENGTH} characters"
        if not SEGMENT_RE.fullmatch(segment):
            return (
                f"segment {key_repr(segment)} must match [A-Za-z0-9][A-Za-z0-9._=-]* "
                "(start with a letter or digit; then letters, digits, '.', '_', '=', '-')"
            )
    return None


def validate_key(key: str) -> str:
    """Check that ``key`` is a valid blob key and return it unchanged.

    A key is a relative path of ``/``-separated segments, each matching
    ``[A-Za-z0-9][A-Za-z0-9._=-]*`` and at most 255 characters; the whole key is at most
    :data:`MAX_KEY_LENGTH` (1024) characters. Hence no ``..``, no empty segment, no
    leading ``/``, no backslash, no NUL: a valid key never escapes the store's root.

    Raises:
        InvalidKey: naming the key (``repr``-escaped) and the rule it breaks.
    """
    rule = _key_rule_broken(key)
    if rule is not None:
        raise InvalidKey(f"invalid blob key {key_repr(key)}: {rule}")
    return key


def validate_prefix(prefix: str) -> str:
    """Check a ``list_keys`` prefix and return it unchanged: ``""``, or a key, optionally
    followed by one ``/``.

    A prefix may end in the middle of a segment (``"shard/ab"`` matches ``"shard/abc"``).

    Raises:
        InvalidKey: naming the prefix and the rule it breaks.
    """
    if not isinstance(prefix, str):
        raise InvalidKey(f"invalid blob key prefix {key_repr(prefix)}: must be a str")
    if prefix == "":
        return prefix
    body = prefix[:-1] if prefix.endswith("/") else prefix
    rule = _key_rule_broken(body)
    if rule is not None:
        raise InvalidKey(f"invalid blob key prefix {key_repr(prefix)}: {rule}")
    return prefix


def is_valid_key(key: str) -> bool:
    """Whether ``key`` is a valid blob key (:func:`validate_key` without raising)."""
    return _key_rule_broken(key) is None


# ------------------------------------------------------------------------ metrics


@dataclass
class BlobMetrics:
    """Counters of completed blob calls (thread-safe; read them with :meth:`snapshot`).

    Attributes:
        sets: number of successful ``set`` calls.
        set_bytes: bytes written by them.
        gets: number of successful ``get`` calls (hits and misses).
        get_bytes: bytes returned by them.
        deletes: number of successful ``delete`` calls.
        lists: number of successful ``list_keys`` calls.
    """

    sets: int = 0
    set_bytes: int = 0
    gets: int = 0
    get_bytes: int = 0
    deletes: int = 0
    lists: int = 0
    _lock: threading.Lock = field(
        default_factory=threading.Lock, repr=False, compare=False, init=False
    )

    def record_set(self, nbytes: int) -> None:
        with self._lock:
            self.sets += 1
            self.set_bytes += nbytes

    def record_get(self, nbytes: int) -> None:
        with self._lock:
            self.gets += 1
            self.get_bytes += nbytes

    def record_delete(self) -> None:
        with self._lock:
            self.deletes += 1

    def record_list(self) -> None:
        with self._lock:
            self.lists += 1

    def snapshot(self) -> BlobMetrics:
        """A consistent copy of the counters."""
        with self._lock:
            return replace(self)


# ----------------------------------------------------------------------- protocol


@runtime_checkable
class Blob(Protocol):
    """A durable map of validated keys (see :func:`validate_key`) to byte values.

    Every method validates its key first and raises :class:`InvalidKey` for a bad one;
    storage failures raise :class:`BlobError`. Implementations are thread-safe.
    """

    @property
    def metrics(self) -> BlobMetrics:
        """Counters of the calls made through this handle."""
        ...

    def get(self, key: str) -> bytes | None:
        """The value at ``key``, or ``None`` if there is none."""
        ...

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` at ``key`` atomically (readers see all of it or none of it);
        an existing value is replaced."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; removing a missing key is not an error (idempotent)."""
        ...

    def list_keys(self, prefix: str = "") -> list[tuple[str, int]]:
        """``(key, size in bytes)`` of every key starting with ``prefix``, sorted by key."""
        ...

    def close(self) -> None:
        """Release resources; later calls raise :class:`BlobError`."""
        ...


class Closable:
    """What every store shares: a ``close`` after which calls raise BlobError."""

    _closed: bool = False

    def _check_open(self) -> None:
        if self._closed:
            raise BlobError(f"{self!r} is closed")

    def close(self) -> None:
        """Mark this handle closed; later calls raise :class:`BlobError`. Idempotent."""
        self._closed = True
