"""Which blob store holds a shard's parts: the store's identity, kept in the store (a
marker object) and in the shard's state (:class:`StoreIdentity`, :func:`check_store`).

Small data lives inline in the state, so a client pointed at the wrong blob store
could read and write a shard "fine" until a part is missing.  So a store carries an
identity: an object ``persist-store-id/<id>`` at its root (:data:`MARKER_KEY`) names
a random id, written the first time a shard is created in it; a shard records that id (and a redacted
description of the store) in its state when it is created.  A client whose store has
another id (or none) is refused, naming both stores, before it writes anything to the
shard.  Shards created before identities existed adopt their store's identity when a
client over the store that holds their parts opens them (a store holding none of the
shard's blob parts is refused instead).

Invariants kept here: markers are never overwritten or deleted (a writer that finds
one uses it; two creating the first at once each add their own, and both name the
store: a blob store has no create-if-absent); a check that refuses changes nothing; credentials never appear in a
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

#: The blob key prefix of a store's identity markers, ``persist-store-id/<id>`` (outside
#: every shard's prefix, so GC and finalization never touch them).
MARKER_KEY = "persist-store-id"


T = TypeVar("T")

#: Attempts of a marker read or write on top of the client's own blob retries
#: (``PersistConfig.blob_retries``): one, as for every other blob call.  The layers
#: multiply (each of the blob's attempts may hold an S3 SDK's own retries), so an
#: unreachable store fails in seconds instead of minutes.
MARKER_ATTEMPTS = 1


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
    """The identity of one client's blob store (thread-safe): the ids of the markers
    under :data:`MARKER_KEY` (each a key ``persist-store-id/<id>``).  A store has one
    marker, unless several clients created its first shards at once: each then wrote
    its own (a blob store has no create-if-absent), and every one of them names the
    store, so a shard recording any of them belongs to it."""

    def __init__(self, blob: Blob, raw: Blob) -> None:
        self.blob = blob
        self.name = describe(raw)
        self._lock = threading.Lock()
        self._ids: frozenset[str] = frozenset()

    def _list(self) -> frozenset[str]:
        keys = _retried(lambda: self.blob.list_keys(MARKER_KEY + "/"))
        return frozenset(k.rsplit("/", 1)[1] for k, _size in keys)

    def ids(self, fresh: bool = False) -> frozenset[str]:
        """The store's marker ids (listed again when ``fresh`` or none is known)."""
        with self._lock:
            if fresh or not self._ids:
                self._ids = self._list()
            return self._ids

    def current(self) -> str | None:
        """One id of the store (the least; ``None``: it has no marker yet)."""
        ids = self.ids()
        return min(ids) if ids else None

    def ensure(self) -> str:
        """An id of the store, writing a marker if it has none."""
        found = self.current()
        if found is not None:
            return found
        with self._lock:
            new = f"b{uuid.uuid4().hex}"
            _retried(lambda: self.blob.set(f"{MARKER_KEY}/{new}", new.encode("ascii")))
            self._ids = self._list() | {new}
        return new

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
        if st.store_id in self.ids() or st.store_id in self.ids(fresh=True):
            return
        ids = self.ids()
        why = (
            "this store has no identity marker"
            if not ids
            else f"their identities differ: {st.store_id} vs {', '.join(sorted(ids))}"
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
