"""The in-memory backend (``memory://``) and ``Memory(inner)``, a write-through read cache.

:class:`MemoryStash` keeps collections in process memory.  ``memory://`` opens a fresh
store; ``memory://NAME`` shares a named store between handles of one process (so reopen,
fencing and concurrent handles can be exercised).  Invariants kept here:

* a transaction changes the store in place under one lock and keeps an undo log, which
  it replays if the call fails, so a failed call changes nothing;
* rows are held consolidated by ``(key, value, time)`` (a dict of diffs, zero dropped);
* fencing follows the SQL backends: a writable fenced open bumps the store's epoch and
  every later call of an older fenced handle fails unrecoverably.

:class:`Memory` wraps any :class:`~stash.base.Stash` and caches frontiers, recorded codec
names and rows of the collections it reads, writing every change through and dropping the cached
state of the collections a write touched, as Materialize's ``Memory<S>`` does.  It is safe to share
between threads: cache fills are checked against a generation, so a fill read before a
write's invalidation is never installed, and a collection with a write in flight is read
from ``inner`` (see :class:`Memory`).  It caches only when the
inner handle is a fenced writable leader (Materialize's use); over any other handle it
passes every call through, since other writers could change what it would cache.  Even
for a leader, optimistic ``fenced=False`` writers of the same collections make the cache
stale: do not mix them with a cached leader.
"""

from __future__ import annotations

import copy
import secrets
import threading
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from sqlalchemy.engine import URL

from stash.base import Mode, Stash
from stash.consolidation import DiffSumOverflow, diff_sums_fit
from stash.errors import FenceError, StashError
from stash.txn import KeyProbe, LogRow, Row, Txn


@dataclass
class _Coll:
    name: str
    key_codec: str
    value_codec: str
    since: int | None = 0
    upper: int | None = 0
    rows: dict[tuple[str, str, int], int] = field(default_factory=dict)
    # time -> the wall clock (Unix ms) it was committed at (SQL: table commit_times)
    commit_times: dict[int, int] = field(default_factory=dict)


@dataclass
class _Store:
    lock: threading.RLock = field(default_factory=threading.RLock)
    colls: dict[int, _Coll] = field(default_factory=dict)
    by_name: dict[str, int] = field(default_factory=dict)
    epoch: int = 0
    nonce: bytes = b""
    # The store's identity (as a SQL stash's fence.stash_id): given at creation.
    stash_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Compare-and-set logs (SQL: table logs): name -> seqno -> (rollup, data).
    logs: dict[str, dict[int, tuple[bool, str]]] = field(default_factory=dict)


R = TypeVar("R")

_NAMED: dict[str, _Store] = {}
_NAMED_LOCK = threading.Lock()


def named_store(name: str) -> _Store:
    """The process-wide store called ``name`` (``""`` means a fresh private store)."""
    if not name:
        return _Store()
    with _NAMED_LOCK:
        return _NAMED.setdefault(name, _Store())


class _MemTxn:
    """Mutates the store in place and keeps an undo log; ``rollback`` restores it."""

    def __init__(self, stash: MemoryStash, store: _Store) -> None:
        self.stash = stash
        self.store = store
        self.created: list[int] = []
        self.undo_front: dict[int, tuple[int | None, int | None]] = {}
        self.undo_rows: dict[tuple[int, tuple[str, str, int]], int | None] = {}
        self.undo_codecs: dict[int, tuple[str, str]] = {}
        self.undo_commit_times: dict[int, dict[int, int]] = {}
        # (log name, seqno) -> the entry before this transaction (None: absent)
        self.undo_logs: dict[tuple[str, int], tuple[bool, str] | None] = {}

    def _get(self, cid: int) -> _Coll:
        c = self.store.colls.get(cid)
        if c is None:
            raise StashError(f"collection id {cid} does not exist")
        return c

    def lookup_collection(self, name: str) -> tuple[int, str, str] | None:
        cid = self.store.by_name.get(name)
        if cid is None:
            return None
        c = self._get(cid)
        return cid, c.key_codec, c.value_codec

    def create_collection(self, name: str, key_codec: str, value_codec: str) -> int:
        cid = max([0, *self.store.colls]) + 1
        self.store.colls[cid] = _Coll(name, key_codec, value_codec)
        self.store.by_name[name] = cid
        self.created.append(cid)
        return cid

    def list_collections(self) -> list[tuple[str, int, str, str]]:
        return [(c.name, i, c.key_codec, c.value_codec) for i, c in self.store.colls.items()]

    def set_collection_codecs(self, cid: int, key_codec: str, value_codec: str) -> None:
        c = self._get(cid)
        self.undo_codecs.setdefault(cid, (c.key_codec, c.value_codec))
        c.key_codec, c.value_codec = key_codec, value_codec

    def lock(self, ids: Sequence[int]) -> None:
        for cid in ids:
            self._get(cid)

    def frontiers(self, cid: int) -> tuple[int | None, int | None]:
        c = self._get(cid)
        return c.since, c.upper

    def codecs(self, cid: int) -> tuple[str, str]:
        c = self._get(cid)
        return c.key_codec, c.value_codec

    def collection_name(self, cid: int) -> str:
        return self._get(cid).name

    def _save_front(self, cid: int) -> _Coll:
        c = self._get(cid)
        self.undo_front.setdefault(cid, (c.since, c.upper))
        return c

    def set_upper(self, cid: int, upper: int | None) -> None:
        self._save_front(cid).upper = upper

    def set_since(self, cid: int, since: int | None) -> None:
        self._save_front(cid).since = since

    def _set_row(self, cid: int, c: _Coll, kvt: tuple[str, str, int], n: int) -> None:
        self.undo_rows.setdefault((cid, kvt), c.rows.get(kvt))
        if n:
            c.rows[kvt] = n
        else:
            c.rows.pop(kvt, None)

    def insert(self, cid: int, rows: Sequence[Row]) -> None:
        c = self._get(cid)
        for k, v, t, d in rows:
            self._set_row(cid, c, (k, v, t), c.rows.get((k, v, t), 0) + d)

    def rows(self, cid: int, key: str | None = None) -> list[Row]:
        items = self._get(cid).rows.items()
        return [(k, v, t, d) for (k, v, t), d in items if key is None or k == key]

    def peek_rows(
        self, cid: int, ts: int, key: KeyProbe | None = None
    ) -> list[tuple[str, str, int]]:
        keys = (key,) if isinstance(key, str) else key
        acc: dict[tuple[str, str], int] = {}
        for (k, v, t), d in self._get(cid).rows.items():
            if t <= ts and (keys is None or k in keys):
                acc[(k, v)] = acc.get((k, v), 0) + d
        return [(k, v, d) for (k, v), d in acc.items() if d]

    def consolidate(self, cid: int, since: int | None, keys: Collection[str] | None) -> None:
        c = self._get(cid)
        if since is None:
            for kvt in list(c.rows):
                self._set_row(cid, c, kvt, 0)
            return
        moved = [
            (kvt, d)
            for kvt, d in c.rows.items()
            if kvt[2] < since and (keys is None or kvt[0] in keys)
        ]
        for kvt, _ in moved:
            self._set_row(cid, c, kvt, 0)
        self.insert(cid, [(k, v, since, d) for (k, v, _t), d in moved])
        # Rows are held one per (key, value, time) already (a dict of exact sums).
        mine = (((k, v), d) for (k, v, _t), d in c.rows.items() if keys is None or k in keys)
        if not diff_sums_fit(mine):
            raise DiffSumOverflow(cid)

    def record_commit_time(self, cid: int, time: int, at_ms: int, forget_before: int) -> None:
        c = self._get(cid)
        self.undo_commit_times.setdefault(cid, dict(c.commit_times))
        c.commit_times.setdefault(time, at_ms)
        for t in [t for t in c.commit_times if t < forget_before]:
            del c.commit_times[t]

    def newest_time_committed_by(self, cid: int, at_ms: int) -> int | None:
        return max(
            (t for t, at in self._get(cid).commit_times.items() if at <= at_ms), default=None
        )

    def _log_set(self, name: str, seqno: int, entry: tuple[bool, str] | None) -> None:
        log = self.store.logs.setdefault(name, {})
        self.undo_logs.setdefault((name, seqno), log.get(seqno))
        if entry is None:
            log.pop(seqno, None)
            if not log:
                del self.store.logs[name]
        else:
            log[seqno] = entry

    def log_insert(
        self, name: str, expected: int | None, seqno: int, rollup: bool, data: str
    ) -> bool:
        if max(self.store.logs.get(name, ()), default=None) != expected:
            return False
        self._log_set(name, seqno, (rollup, data))
        return True

    def log_rows(self, name: str, from_seqno: int | None) -> list[LogRow]:
        log = self.store.logs.get(name, {})
        if from_seqno is None:
            from_seqno = max((n for n, (r, _) in log.items() if r), default=0)
        return [(n, r, d) for n, (r, d) in sorted(log.items()) if n >= from_seqno]

    def log_head_seqno(self, name: str) -> int | None:
        return max(self.store.logs.get(name, ()), default=None)

    def log_truncate(self, name: str, before: int) -> int:
        log = self.store.logs.get(name, {})
        top = max(log, default=0)
        gone = [n for n in log if n < before and n < top]
        for n in gone:
            self._log_set(name, n, None)
        return len(gone)

    def log_names(self) -> list[str]:
        return sorted(self.store.logs)

    def check_fence(self) -> None:
        self.stash._check_fence(self.store)

    def stash_id(self) -> str:
        return self.store.stash_id

    def rollback(self) -> None:
        for (cid, kvt), old in self.undo_rows.items():
            rows = self.store.colls[cid].rows
            if old is None:
                rows.pop(kvt, None)
            else:
                rows[kvt] = old
        for cid, (since, upper) in self.undo_front.items():
            c = self.store.colls[cid]
            c.since, c.upper = since, upper
        for cid, (kname, vname) in self.undo_codecs.items():
            c = self.store.colls[cid]
            c.key_codec, c.value_codec = kname, vname
        for cid, times in self.undo_commit_times.items():
            self.store.colls[cid].commit_times = times
        for cid in self.created:
            c = self.store.colls.pop(cid)
            self.store.by_name.pop(c.name, None)
        for (name, seqno), entry in self.undo_logs.items():
            log = self.store.logs.setdefault(name, {})
            if entry is None:
                log.pop(seqno, None)
            else:
                log[seqno] = entry
            if not log:
                del self.store.logs[name]


class MemoryStash(Stash):
    """The pure in-memory backend (``memory://`` or ``memory://NAME``).

    Savepoint mode works on a private deep copy of the named store taken at open.
    """

    def __init__(self, name: str = "", *, mode: Mode = "writable", fenced: bool = True) -> None:
        super().__init__(mode, fenced)
        store = named_store(name)
        if mode == "savepoint":
            with store.lock:
                self._savepoint_of = store.stash_id
                store = _Store(
                    colls=copy.deepcopy(store.colls),
                    by_name=dict(store.by_name),
                    epoch=store.epoch,
                    nonce=store.nonce,
                    logs={n: dict(log) for n, log in store.logs.items()},
                    stash_id=uuid.uuid4().hex,  # its own: see stash.checks.check_handles_tx
                )
        self._store = store
        self._name = name
        self._epoch: int | None = None
        self._nonce = b""
        if fenced and mode == "writable":
            with store.lock:
                store.epoch += 1
                store.nonce = secrets.token_bytes(16)
                self._epoch, self._nonce = store.epoch, store.nonce

    @classmethod
    def _from_url(cls, url: URL, *, mode: Mode, fenced: bool, **options: Any) -> MemoryStash:
        """See :meth:`stash.base.Stash._from_url`: ``memory://`` is a fresh store,
        ``memory://NAME`` (host and path) a named one; ``options`` are ignored."""
        name = (url.host or "") + (("/" + url.database) if url.database else "")
        return cls(name, mode=mode, fenced=fenced)

    def _check_fence(self, store: _Store) -> None:
        if self._epoch is not None and (store.epoch, store.nonce) != (self._epoch, self._nonce):
            raise FenceError(
                f"stash fenced: this handle's epoch {self._epoch} was superseded by "
                f"epoch {store.epoch}"
            )

    @contextmanager
    def _txn(self, write: bool) -> Iterator[Txn]:
        store = self._store
        with store.lock:
            self._check_fence(store)
            tx = _MemTxn(self, store)
            try:
                yield tx
            except BaseException:
                tx.rollback()
                raise

    def __repr__(self) -> str:
        return f"MemoryStash(mode={self.mode!r}, fenced={self.fenced})"

    @property
    def redacted_url(self) -> str:
        return f"memory://{self._name}"


class Memory(Stash):
    """A write-through read cache over any stash (Materialize's ``Memory<S>``).

    Reads of a collection are served from a cache entry (its frontiers, codec names and
    all its rows, read together in one transaction of ``inner``); every write goes to ``inner`` and
    drops the entries of the collections it touched.  Safe to share between threads:

    * a write marks each collection it touches as *in flight* (dropping its entry) before
      it commits, and again when it ends (committed or not); while a collection is in
      flight no transaction reads or fills its entry;
    * a read notes the cache's generation before its transaction of ``inner`` begins and
      installs what it read only if the collection was not invalidated since, so a fill
      computed from a read that started before an invalidation is never installed;
    * a transaction that reads one collection twice sees one entry (or one ``inner``
      snapshot) throughout, never frontiers from one state and rows from another.

    Caching is on only over a fenced writable handle (the single leader, Materialize's use);
    other writers of the same collections through other handles are not seen.

    Args:
        inner: the stash that holds the durable state.
    """

    def __init__(self, inner: Stash) -> None:
        super().__init__(inner.mode, inner.fenced)
        self.inner = inner
        self.clock = inner.clock
        self._savepoint_of = inner._savepoint_of
        # Caching is sound only for the single leader: a fenced writable handle.
        self.caching = inner.fenced and inner.mode == "writable"
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self._gen = 0  # bumped by every invalidation
        self._invalidated: dict[int, int] = {}  # collection id -> generation of its last one
        self._in_flight: dict[int, int] = {}  # collection id -> writes touching it now

    def _invalidate(self, cid: int, delta: int) -> None:
        """Drop ``cid``'s entry and bump the generation; ``delta`` (+1 at a write's first
        touch, -1 when it ends) counts the writes in flight. Caller holds ``_lock``."""
        self._gen += 1
        self._invalidated[cid] = self._gen
        self._entries.pop(cid, None)
        n = self._in_flight.get(cid, 0) + delta
        if n:
            self._in_flight[cid] = n
        else:
            self._in_flight.pop(cid, None)

    def _cached(self, cid: int, gen: int) -> _Entry | None | Literal[False]:
        """The usable entry of ``cid``; ``None`` if a read may fill it; ``False`` if it
        must go to ``inner`` without filling (a write in flight or an invalidation since
        generation ``gen``)."""
        with self._lock:
            if self._in_flight.get(cid) or self._invalidated.get(cid, 0) > gen:
                return False
            return self._entries.get(cid)

    def _install(self, cid: int, gen: int, entry: _Entry) -> None:
        with self._lock:
            if not self._in_flight.get(cid) and self._invalidated.get(cid, 0) <= gen:
                self._entries[cid] = entry

    def _run(self, write: bool, fn: Callable[[Txn], R]) -> R:
        marked: set[int] = set()
        with self._lock:
            gen = self._gen

        def attempt(itx: Txn) -> R:
            tx = _CachedTxn(self, itx, write or not self.caching, gen, marked)
            return fn(tx)

        try:
            return self.inner._run(write, attempt)
        finally:
            if marked:
                with self._lock:
                    for cid in marked:
                        self._invalidate(cid, -1)

    @contextmanager
    def _txn(self, write: bool) -> Iterator[Txn]:  # pragma: no cover - _run is used
        raise NotImplementedError("Memory runs transactions through the inner stash")
        yield

    def _close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"Memory({self.inner!r})"

    @property
    def redacted_url(self) -> str:
        return self.inner.redacted_url


@dataclass(frozen=True)
class _Entry:
    """A collection's cached state: ``(since, upper)``, the recorded codec names and
    every row, read together."""

    front: tuple[int | None, int | None]
    codecs: tuple[str, str]
    rows: list[Row]


class _CachedTxn:
    """One transaction of ``Memory``: reads through its cache, writes through to ``inner``.

    Args:
        cache: the ``Memory``.
        inner: the inner transaction.
        bypass: read everything from ``inner`` (a write transaction, or caching is off).
        gen: the cache's generation when the call began (before ``inner``'s transaction).
        marked: the collections this call's writes marked in flight (shared by retries).
    """

    def __init__(self, cache: Memory, inner: Txn, bypass: bool, gen: int, marked: set[int]) -> None:
        self.cache = cache
        self.inner = inner
        self.bypass = bypass
        self.gen = gen
        self.marked = marked
        # What this transaction reads each collection from: an entry, or None (inner).
        self.views: dict[int, _Entry | None] = {}

    def _touch(self, cid: int) -> None:
        if cid not in self.marked:
            with self.cache._lock:
                self.cache._invalidate(cid, +1)
            self.marked.add(cid)
        self.views[cid] = None

    def _view(self, cid: int) -> _Entry | None:
        """The entry this transaction reads ``cid`` from, or ``None`` to read ``inner``."""
        if self.bypass or cid in self.marked:
            return None
        if cid in self.views:
            return self.views[cid]
        found = self.cache._cached(cid, self.gen)
        entry: _Entry | None
        if found is False:
            entry = None
        elif found is None:
            # Fill: frontiers, codec names and rows in this one transaction of inner.
            front = self.inner.frontiers(cid)
            entry = _Entry(front, self.inner.codecs(cid), self.inner.rows(cid))
            self.cache._install(cid, self.gen, entry)
        else:
            entry = found
        self.views[cid] = entry
        return entry

    def lookup_collection(self, name: str) -> tuple[int, str, str] | None:
        return self.inner.lookup_collection(name)

    def create_collection(self, name: str, key_codec: str, value_codec: str) -> int:
        return self.inner.create_collection(name, key_codec, value_codec)

    def list_collections(self) -> list[tuple[str, int, str, str]]:
        return self.inner.list_collections()

    def set_collection_codecs(self, cid: int, key_codec: str, value_codec: str) -> None:
        self._touch(cid)
        self.inner.set_collection_codecs(cid, key_codec, value_codec)

    def lock(self, ids: Sequence[int]) -> None:
        self.inner.lock(ids)

    def frontiers(self, cid: int) -> tuple[int | None, int | None]:
        entry = self._view(cid)
        return self.inner.frontiers(cid) if entry is None else entry.front

    def codecs(self, cid: int) -> tuple[str, str]:
        entry = self._view(cid)
        return self.inner.codecs(cid) if entry is None else entry.codecs

    def collection_name(self, cid: int) -> str:
        return self.inner.collection_name(cid)

    def set_upper(self, cid: int, upper: int | None) -> None:
        self._touch(cid)
        self.inner.set_upper(cid, upper)

    def set_since(self, cid: int, since: int | None) -> None:
        self._touch(cid)
        self.inner.set_since(cid, since)

    def insert(self, cid: int, rows: Sequence[Row]) -> None:
        self._touch(cid)
        self.inner.insert(cid, rows)

    def rows(self, cid: int, key: str | None = None) -> list[Row]:
        entry = self._view(cid)
        if entry is None:
            return self.inner.rows(cid, key)
        return [r for r in entry.rows if key is None or r[0] == key]

    def peek_rows(
        self, cid: int, ts: int, key: KeyProbe | None = None
    ) -> list[tuple[str, str, int]]:
        entry = self._view(cid)
        if entry is None:
            return self.inner.peek_rows(cid, ts, key)
        keys = (key,) if isinstance(key, str) else key
        acc: dict[tuple[str, str], int] = {}
        for k, v, t, d in entry.rows:
            if t <= ts and (keys is None or k in keys):
                acc[(k, v)] = acc.get((k, v), 0) + d
        return [(k, v, d) for (k, v), d in acc.items() if d]

    def consolidate(self, cid: int, since: int | None, keys: Collection[str] | None) -> None:
        self._touch(cid)
        self.inner.consolidate(cid, since, keys)

    def record_commit_time(self, cid: int, time: int, at_ms: int, forget_before: int) -> None:
        self.inner.record_commit_time(cid, time, at_ms, forget_before)

    def newest_time_committed_by(self, cid: int, at_ms: int) -> int | None:
        return self.inner.newest_time_committed_by(cid, at_ms)

    def log_insert(
        self, name: str, expected: int | None, seqno: int, rollup: bool, data: str
    ) -> bool:
        return self.inner.log_insert(name, expected, seqno, rollup, data)

    def log_rows(self, name: str, from_seqno: int | None) -> list[LogRow]:
        return self.inner.log_rows(name, from_seqno)

    def log_head_seqno(self, name: str) -> int | None:
        return self.inner.log_head_seqno(name)

    def log_truncate(self, name: str, before: int) -> int:
        return self.inner.log_truncate(name, before)

    def log_names(self) -> list[str]:
        return self.inner.log_names()

    def check_fence(self) -> None:
        self.inner.check_fence()

    def stash_id(self) -> str:
        return self.inner.stash_id()
