"""Which blob store holds a shard's parts: the store's identity, kept in the store (a
marker object) and in the shard's state (:class:`StoreIdentity`, :func:`check_store`).

Small data lives inline in the state, so a client pointed at the wrong blob store
could read and write a shard "fine" until a part is missing.  So a store carries an
identity: the object :data:`MARKER_KEY` at its root holds a random id, written the
first time a shard is created in it; a shard records that id (and a redacted
description of the store) in its state when it is created.  A client whose store has
another id (or none) is refused, naming both stores, before it writes anything to the
shard.  Shards created before identities existed adopt their store's identity when a
client over the store that holds their parts opens them (a store holding none of the
shard's blob parts is refused instead).

Invariants kept here: the marker is written once per store (never overwritten: a
writer that finds one uses it; two creating it at once both read back the one that
stayed); a check that refuses changes nothing; credentials never appear in a
description (:func:`stash.redact`).

Source of the idea: Delta Lake and Iceberg tables are found through their storage
location (the table *is* its path); Materialize's persist records its blob and
consensus URIs per environment and refuses a mismatched ``PersistLocation``.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import TypeVar

from tenacity import (
    Retrying,
    retry_if_exception_type,
    retry_if_not_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)

from persist.blob import Blob
from persist.errors import BlobError, InvalidKey, PersistError
from persist.state import ShardState
from stash import redact

__all__ = ["MARKER_KEY", "StoreIdentity", "StoreMismatch", "describe"]

#: The blob key of a store's identity marker (outside every shard's prefix, so GC and
#: finalization never touch it).
MARKER_KEY = "persist-store-id"


T = TypeVar("T")

#: Attempts of a marker read or write (it guards every open, so a transient blob error
#: there is retried more than a part's upload: the open would fail for nothing).
MARKER_ATTEMPTS = 6


def _retried(fn: Callable[[], T]) -> T:
    """``fn()``, retried on a :class:`BlobError` (not an invalid key) with backoff."""
    r = Retrying(
        stop=stop_after_attempt(MARKER_ATTEMPTS),
        wait=wait_exponential_jitter(multiplier=0.001, max=0.2, jitter=0.002),
        retry=retry_if_exception_type(BlobError) & retry_if_not_exception_type(InvalidKey),
        reraise=True,
    )
    return r(fn)


class StoreMismatch(PersistError):
    """A shard's parts live in another blob store than this client's.  Nothing was
    written.  Attributes: ``shard`` (name), ``recorded`` and ``this`` (store
    descriptions, redacted)."""

    def __init__(self, shard: str, recorded: str, this: str, why: str) -> None:
        self.shard, self.recorded, self.this = shard, recorded, this
        super().__init__(
            f"shard {shard!r} belongs to the blob store {recorded}, not to this client's "
            f"blob store {this} ({why}): is the blob URI right? Nothing was written"
        )


def describe(blob: Blob) -> str:
    """A store's description for messages and the state (credentials redacted)."""
    return redact(repr(blob))


class StoreIdentity:
    """The identity of one client's blob store, read once (thread-safe)."""

    def __init__(self, blob: Blob, raw: Blob) -> None:
        self.blob = blob
        self.name = describe(raw)
        self._lock = threading.Lock()
        self._id: str | None = None

    def current(self) -> str | None:
        """The store's id (``None``: it has no marker yet)."""
        with self._lock:
            if self._id is None:  # a store without a marker is asked again next time
                data = _retried(lambda: self.blob.get(MARKER_KEY))
                self._id = None if data is None else data.decode("ascii").strip()
            return self._id

    def ensure(self) -> str:
        """The store's id, writing a new marker if it has none (then reading it back,
        so that of two writers racing both use the marker that stayed)."""
        found = self.current()
        if found is not None:
            return found
        with self._lock:
            new = f"b{uuid.uuid4().hex}".encode("ascii")
            _retried(lambda: self.blob.set(MARKER_KEY, new))
            data = _retried(lambda: self.blob.get(MARKER_KEY))
            if data is None:  # pragma: no cover - a store that loses a write
                raise PersistError(f"blob store {self.name}: its identity marker vanished")
            self._id = data.decode("ascii").strip()
            return self._id

    def stamp(self, st: ShardState) -> None:
        """Record this store's identity in a new shard's state."""
        st.store_id = self.ensure()
        st.store_name = self.name

    def check(self, st: ShardState) -> None:
        """Refuse ``st`` if it records another store than this client's.

        Raises:
            StoreMismatch: naming both stores.
        """
        if st.store_id is None or st.tombstone:
            return
        mine = self.current()
        if mine == st.store_id:
            return
        why = (
            "this store has no identity marker"
            if mine is None
            else f"their identities differ: {st.store_id} vs {mine}"
        )
        raise StoreMismatch(st.name, st.store_name or st.store_id, self.name, why)

    def holds_parts(self, st: ShardState) -> bool:
        """Whether this store holds the shard's blob parts (any of them; ``True`` when
        the shard has none, all inline)."""
        keys = st.referenced_blob_keys()
        if not keys:
            return True
        listed = {k for k, _size in _retried(lambda: self.blob.list_keys(f"{st.shard_id}/"))}
        return bool(keys & listed)
