"""The persist client: opens shards (by name) on a stash (consensus) and a blob store.

:class:`PersistClient` (the persist-client ``PersistClient``) ties together consensus
(:mod:`persist.consensus`, on a :class:`stash.Stash`), a blob store
(:mod:`persist.blob`), one :class:`~persist.machine.ShardMachine` per open shard, and a
:class:`~persist.compactor.Compactor` that answers the Spine's merge requests in the
background, inline after each append, or not at all.

Invariants kept here:

* a shard name maps to exactly one ShardId, for every process (the registry in
  consensus); its key schema is fixed when it is created; its value schema is versioned:
  opening it with a compatible evolution of the newest version
  registers a new version by compare-and-set (decided on the latest state, re-checked
  on every race), with a registered version uses that version (an older one keeps its
  view), and with anything else raises :class:`~persist.errors.SchemaMismatch` naming
  the column and the rule, changing nothing;
* a handle writes and reads with the schema id it was opened with: its parts record it,
  its reads are conformed to its view (:class:`~persist.updates.SchemaHistory`);
* names and ids are separate namespaces: every API taking a shard reference
  (:meth:`PersistClient.shard_id`) reads a plain string as a name, even one shaped like
  a ShardId; an id is written ``id:<shard id>``;
* a finalized shard (:meth:`PersistClient.finalize_shard`) is a tombstone: it is never
  opened again, and its parts are deleted;
* all handles of one shard in one client share one state machine (one cached version);
* compaction never fails an append: merge errors are logged, the merge request stays in
  the trace and is answered later (``compact_once`` re-issues every outstanding one).

Threads: a :class:`PersistClient` is thread-safe: its handles, transactions
(:meth:`PersistClient.begin`), :meth:`PersistClient.snapshot_many` and its background
compactor may run in several threads at once.  A :class:`~persist.txn.Txn` and a
:class:`~persist.write.BatchBuilder` are each used by one thread at a time.  Locks are
taken in ONE order, so no two threads can wait on each other:

1. a batch builder's lock (held while it uploads and registers its writer);
2. the shard machines' locks (:attr:`ShardMachine.lock`, reentrant), several of them
   only in shard-id order (a transaction's commit);
3. leaf locks, held only around their own bookkeeping, calling out to nothing: the
   client's transaction lock (``_txn_lock``: the writers and record ids its
   transactions reuse), the consensus and machine caches' locks, the compactor's
   condition and writer table.

Nothing is called while a leaf lock is held that could take a lock of levels 1-2 (the
writer a transaction reuses is looked up under ``_txn_lock``, but made, and its state
read, outside it).

Sources: the persist-client ``PersistClient`` / ``open`` and the first engine's
maintenance (``src/persist/src/indexed/``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Literal, TypeVar

import pyarrow as pa
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from persist import metrics as persist_metrics
from persist.blob import ArrowFsBlob, Blob, BlobMetrics, open_blob
from persist.blobdirs import remove_empty_dirs
from persist.compactor import Compactor
from persist.consensus import Consensus
from persist.errors import BlobError, InvalidKey, InvalidUsage, PersistError
from persist.ids import validate_shard_id, validate_shard_name
from persist.machine import ShardMachine
from persist.parts import DEFAULT_TARGET_PART_BYTES, updates_schema
from persist.read import Listen, ReadHandle
from persist.spine import FueledMergeReq
from persist.state import ShardState
from persist.write import WriteHandle
from stash import Stash, StashError

if TYPE_CHECKING:
    from persist.txn import Txn

__all__ = ["SHARD_ID_REF", "CompactionMode", "PersistClient", "RetryingBlob"]

#: The prefix that marks a shard reference as a shard id rather than a name
#: (:meth:`PersistClient.shard_id`).
SHARD_ID_REF = "id:"

log = logging.getLogger(__name__)

CompactionMode = Literal["background", "inline", "off"]
_T = TypeVar("_T")


class RetryingBlob:
    """A :class:`~persist.blob.Blob` wrapper retrying transient :class:`BlobError` s
    (not :class:`InvalidKey`) with exponential backoff, ``attempts`` tries per call.

    Every blob call persist makes is idempotent (a ``set`` writes immutable bytes under a
    fresh key; ``delete`` of a missing key is fine), so a retry is always safe.
    """

    def __init__(self, inner: Blob, attempts: int = 3) -> None:
        self.inner = inner
        self.attempts = max(1, attempts)

    def __repr__(self) -> str:
        return f"RetryingBlob({self.inner!r}, attempts={self.attempts})"

    @property
    def metrics(self) -> BlobMetrics:
        """The inner store's counters."""
        return self.inner.metrics

    @staticmethod
    def _retryable(e: BaseException) -> bool:
        return isinstance(e, BlobError) and not isinstance(e, InvalidKey)

    def _retry(self, fn: Callable[[], _T]) -> _T:
        try:
            return fn()  # the common case, without building a retry loop
        except BlobError as e:
            if self.attempts == 1 or not self._retryable(e):
                raise
        r = Retrying(
            stop=stop_after_attempt(self.attempts - 1),
            wait=wait_exponential_jitter(multiplier=0.005, max=0.25, jitter=0.005),
            retry=retry_if_exception(self._retryable),
            reraise=True,
        )
        return r(fn)

    def get(self, key: str) -> bytes | None:
        return persist_metrics.fetched(self._retry(lambda: self.inner.get(key)))

    def set(self, key: str, value: bytes) -> None:
        self._retry(lambda: self.inner.set(key, value))
        persist_metrics.written(value)

    def delete(self, key: str) -> None:
        self._retry(lambda: self.inner.delete(key))

    def list_keys(self, prefix: str = "") -> list[tuple[str, int]]:
        return self._retry(lambda: self.inner.list_keys(prefix))

    def close(self) -> None:
        self.inner.close()


def _schema_str(s: pa.Schema) -> str:
    return "[" + ", ".join(f"{f.name}: {f.type}" for f in s) + "]"


class PersistClient:
    """Opens shards stored in ``blob`` with their state in ``stash``.

    Args:
        stash: an open :class:`stash.Stash` (``fenced=False`` to share it between
            processes); the client does not close it.
        blob: a blob URI (``file:///path``, ``memory://``, any ``pyarrow.fs`` URI) or a
            :class:`~persist.blob.Blob`.
        compaction: ``"background"`` (a daemon thread answers merge requests),
            ``"inline"`` (the writer answers them right after its append; handy in
            tests) or ``"off"`` (use :meth:`Compactor.compact_once` / ``persist compact``).
        reader_lease_seconds, writer_lease_seconds: lease durations (seconds); a handle
            that does not heartbeat (any operation does) within it is expired by others.
        handoff_lease_seconds: the lease (seconds) a writer is kept for when its handle
            expires with batches it handed to another process and did not append (e.g.
            a Spark task's batch waiting for the job's commit on the driver): their parts
            stay safe from GC that long after the handle's end (and longer while the
            receiver holds the decoded batches, which renew it); the writer is dropped as
            soon as they are all appended.  24 hours by default.
        inline_max_bytes: a batch whose inline encoding (a zstd-compressed Arrow IPC
            stream) is at most this many bytes is kept inline in the state (no blob
            call). The default, 16 KiB, keeps small appends of wide schemas inline (a
            one-row part of the 19-column flights table is about 1 KiB); compaction
            outputs above it go to blob, so compaction moves inline data out as it
            merges.
        inline_total_max_bytes: no new inline part while the state already holds this
            many inline bytes (they go to blob instead); bounds the state's size when
            compaction falls behind or is off.
        target_part_bytes: target in-memory size (bytes) of a part.
        write_workers, read_workers: threads for uploading / fetching parts.
        blob_retries, consensus_retries: attempts per blob / consensus call on transient
            errors.
        gc_grace_seconds, gc_interval_seconds: the background compactor also runs GC on a
            shard it compacted, at most every ``gc_interval_seconds``, deleting blobs
            unreferenced for ``gc_grace_seconds``; ``gc_interval_seconds=None`` disables.
        piggyback_seconds: the background compactor offers its results this long to the
            next append of this process, which applies them in its own version (one
            compare-and-set instead of two), before applying them itself.
        clock: wall-clock seconds (``time.time``), injectable for tests.
    """

    def __init__(
        self,
        stash: Stash,
        blob: str | Blob,
        *,
        compaction: CompactionMode = "background",
        reader_lease_seconds: float = 900.0,
        writer_lease_seconds: float = 3600.0,
        handoff_lease_seconds: float = 86400.0,
        inline_max_bytes: int = 16 * 1024,
        inline_total_max_bytes: int = 1024 * 1024,
        target_part_bytes: int = DEFAULT_TARGET_PART_BYTES,
        write_workers: int = 2,
        read_workers: int = 4,
        blob_retries: int = 3,
        consensus_retries: int = 4,
        gc_grace_seconds: float = 3600.0,
        gc_interval_seconds: float | None = 300.0,
        piggyback_seconds: float = 0.05,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if compaction not in ("background", "inline", "off"):
            raise InvalidUsage(
                f"compaction must be 'background', 'inline' or 'off', got {compaction!r}"
            )
        self.stash = stash
        self._owns_blob = isinstance(blob, str)
        raw = open_blob(blob) if isinstance(blob, str) else blob
        self.raw_blob = raw
        self.blob: Blob = RetryingBlob(raw, blob_retries)
        self.consensus = Consensus(stash, retries=consensus_retries)
        self.compaction = compaction
        self.reader_lease_seconds = reader_lease_seconds
        self.writer_lease_seconds = writer_lease_seconds
        if not handoff_lease_seconds > 0:
            raise InvalidUsage(
                f"handoff_lease_seconds must be > 0 seconds, got {handoff_lease_seconds!r}"
            )
        self.handoff_lease_seconds = handoff_lease_seconds
        self.inline_max_bytes = inline_max_bytes
        self.inline_total_max_bytes = inline_total_max_bytes
        self.target_part_bytes = target_part_bytes
        self.write_workers = write_workers
        self.read_workers = read_workers
        self.gc_grace_seconds = gc_grace_seconds
        self.gc_interval_seconds = gc_interval_seconds
        self.piggyback_seconds = piggyback_seconds
        self.clock = clock
        self._machines: dict[str, ShardMachine] = {}
        self._handles: weakref.WeakSet[WriteHandle | ReadHandle | Listen] = weakref.WeakSet()
        self._closed = False
        self._txn_writers: dict[str, WriteHandle] = {}
        self._txn_lock = threading.Lock()
        # shard id -> record ids of acknowledged transactions, dropped from the shard's
        # state by this client's next transaction on it (see persist.txn).
        self._txn_done: dict[str, list[str]] = {}
        self.compactor = Compactor(self)
        if compaction == "background":
            self.compactor.start()

    def __repr__(self) -> str:
        return f"PersistClient({self.stash!r}, {self.raw_blob!r}, compaction={self.compaction!r})"

    # ------------------------------------------------------------------ shards
    def machine(self, shard_id: str) -> ShardMachine:
        """The state machine of ``shard_id`` (shared by this client's handles)."""
        validate_shard_id(shard_id)
        m = self._machines.get(shard_id)
        if m is None:
            m = self._machines.setdefault(
                shard_id, ShardMachine(self.consensus, shard_id, clock=self.clock)
            )
        return m

    def shards(self) -> dict[str, str]:
        """Every registered shard: name -> shard id."""
        return self.consensus.shards()

    def shard_id(self, shard: str) -> str:
        """Resolve a shard reference to a shard id.  Names and ids are kept apart: a
        plain string is always a *name* (even one shaped like a shard id); a shard id is
        given as ``"id:<shard id>"`` (``:`` is never part of a name).

        Raises:
            InvalidUsage: no shard has that name; a malformed name or ``id:`` reference.
        """
        if not isinstance(shard, str):
            raise InvalidUsage(f"a shard reference must be a str, got {type(shard).__name__}")
        if shard.startswith(SHARD_ID_REF):
            return validate_shard_id(shard[len(SHARD_ID_REF) :])
        validate_shard_name(shard)
        sid = self.consensus.lookup(shard)
        if sid is None:
            raise InvalidUsage(f"no shard named {shard!r}")
        return sid

    def _open_machine(
        self,
        name: str,
        key_schema: pa.Schema,
        value_schema: pa.Schema,
        drop: Collection[str] = (),
    ) -> tuple[ShardMachine, int]:
        """The shard's machine (creating the shard if needed) and the schema id of
        handles opened with these schemas (registered if new; see
        :meth:`_register_schema`)."""
        self._check_open()
        validate_shard_name(name)
        updates_schema(key_schema, value_schema)  # validates the schemas
        now_ms = int(self.clock() * 1000)
        shard_id = self.consensus.register(name, now_ms)
        m = self.machine(shard_id)
        st = m.initialize(ShardState(shard_id, name, key_schema, value_schema))
        if st.tombstone:
            raise InvalidUsage(
                f"shard {name!r} ({shard_id}) was finalized (dropped): it cannot be opened"
            )
        return m, self._register_schema(m, st, key_schema, value_schema, drop)

    def _register_schema(
        self,
        m: ShardMachine,
        st: ShardState,
        key_schema: pa.Schema,
        value_schema: pa.Schema,
        drop: Collection[str] = (),
    ) -> int:
        """The schema id of handles opened with these schemas, registering a compatible
        newer value schema by compare-and-set.  The check runs on a
        freshly read state and again on every compare-and-set race, so two processes
        evolving the schema at once both end with a version of theirs, or a
        :class:`SchemaMismatch` against the other's, checked on the state that holds it
        (a schema lacking a column the other added is refused unless ``drop`` names it:
        never a silent drop).  Ids are resolved on the state read, never cached: a
        version a later one dropped a column of is not reused.

        Raises:
            SchemaMismatch: not a compatible evolution of the newest schema (nothing is
                committed).
        """
        # ``st`` was just read: a schema equal to a version is that version (the newest
        # such, none of whose columns a later version dropped), anything else is
        # decided by compare-and-set.
        known = st.schemas().id_of(value_schema) if st.key_schema.equals(key_schema) else None
        if known is not None:
            return known
        return m.register_schema(key_schema, value_schema, drop)

    def _schema_id(self, m: ShardMachine, key_schema: pa.Schema, value_schema: pa.Schema) -> int:
        """The schema id of these schemas in the shard's latest state (registering them
        if they are a compatible evolution dropping nothing)."""
        return self._register_schema(m, m.recent(), key_schema, value_schema)

    def open(
        self,
        shard_name: str,
        key_schema: pa.Schema,
        value_schema: pa.Schema,
        *,
        drop: Collection[str] = (),
    ) -> tuple[WriteHandle, ReadHandle]:
        """Open (creating if needed) the shard ``shard_name``: a writer and a leased reader
        (holding the shard's current since).  The writer registers itself in the shard
        state with its first append (building batches touches no state).

        Args:
            shard_name: the shard's name.
            key_schema, value_schema: the handles' schemas: the shard's, a registered
                version of its value schema, or a compatible evolution of the newest one
                (registered now).
            drop: value columns of the newest version this evolution drops; a schema
                lacking a column of the newest version that ``drop`` does not name is
                refused (so a writer planned against an older version never drops a
                column another writer added meanwhile).

        Raises:
            InvalidUsage: bad name or schemas; the shard exists with other schemas
                (:class:`SchemaMismatch`, naming the column and the rule).
            ConsensusError: the stash failed.
        """
        m, sid = self._open_machine(shard_name, key_schema, value_schema, drop)
        return (
            self._writer(m, shard_name, key_schema, value_schema, sid),
            self._reader(m, shard_name, key_schema, value_schema, sid),
        )

    def open_writer(
        self,
        shard_name: str,
        key_schema: pa.Schema,
        value_schema: pa.Schema,
        *,
        drop: Collection[str] = (),
    ) -> WriteHandle:
        """Open (creating if needed) the shard and return a writer only (no state change:
        the writer is registered by its first append, so e.g. Spark executors that only
        build batches cost nothing in consensus).  Arguments as :meth:`open`."""
        m, sid = self._open_machine(shard_name, key_schema, value_schema, drop)
        return self._writer(m, shard_name, key_schema, value_schema, sid)

    def _writer(
        self,
        m: ShardMachine,
        name: str,
        key_schema: pa.Schema,
        value_schema: pa.Schema,
        schema_id: int | None = None,
    ) -> WriteHandle:
        wid = "w" + uuid.uuid4().hex
        w = WriteHandle(self, m, name, wid, key_schema, value_schema, self.writer_lease_seconds)
        w.schema_id = (
            self._schema_id(m, key_schema, value_schema) if schema_id is None else schema_id
        )
        self._handles.add(w)
        return w

    # ------------------------------------------------------------ transactions
    def begin(self) -> Txn:
        """A new :class:`~persist.txn.Txn`: writes to several shards and stash batches
        committed together in one stash transaction.

        Raises:
            InvalidUsage: the client is closed.
        """
        from persist.txn import Txn

        return Txn(self)

    def snapshot_many(
        self, as_ofs: Mapping[str, int | None] | Sequence[str]
    ) -> dict[str, pa.Table]:
        """Cross-shard-consistent snapshots: see :func:`persist.txn.snapshot_many`."""
        from persist.txn import snapshot_many

        self._check_open()
        return snapshot_many(self, as_ofs)

    def _txn_writer(
        self,
        m: ShardMachine,
        name: str,
        key_schema: pa.Schema | None = None,
        value_schema: pa.Schema | None = None,
        schema_id: int | None = None,
    ) -> WriteHandle:
        """The writer this client's transactions use for a shard, with the given schemas
        and schema id (default: the shard's newest, in its latest state, read now): one
        per shard, so a stream of transactions does not register a writer each;
        replaced once expired or when the schemas or the id asked for change (an
        evolution since it was made, by any process)."""
        # The client's ``_txn_lock`` is a leaf lock (see the module docstring): the
        # state is read and a new writer made (both take the shard machine's lock)
        # outside it.
        if key_schema is None or value_schema is None:
            st = m.recent()
            key_schema, value_schema = st.key_schema, st.value_schema
            schema_id = st.schemas().newest
        elif schema_id is None:
            schema_id = self._schema_id(m, key_schema, value_schema)
        with self._txn_lock:
            w = self._txn_writers.get(m.shard_id)
        if w is not None and not (
            w._expired
            or (w._registered and m.now_ms() - w._last_heartbeat_ms > w._lease_ms)
            or w.schema_id != schema_id
            or not (w.key_schema.equals(key_schema) and w.value_schema.equals(value_schema))
        ):
            return w
        fresh = self._writer(m, name, key_schema, value_schema, schema_id)
        with self._txn_lock:
            if self._txn_writers.get(m.shard_id) is w:
                self._txn_writers[m.shard_id] = fresh
        return fresh

    def _txn_done_add(self, shard_id: str, record_id: str) -> None:
        """Note that the transaction recorded under ``record_id`` is acknowledged."""
        with self._txn_lock:
            ids = self._txn_done.setdefault(shard_id, [])
            ids.append(record_id)
            del ids[:-1024]  # older ones expire with their leases

    def _txn_done_ids(self, shard_id: str) -> tuple[str, ...]:
        """Record ids of acknowledged transactions still in ``shard_id``'s state."""
        with self._txn_lock:
            return tuple(self._txn_done.get(shard_id, ()))

    def _txn_done_forget(self, shard_id: str, record_ids: Sequence[str]) -> None:
        """``record_ids`` were dropped from ``shard_id``'s state."""
        if not record_ids:
            return
        gone = set(record_ids)
        with self._txn_lock:
            ids = self._txn_done.get(shard_id)
            if ids:
                ids[:] = [i for i in ids if i not in gone]

    def _forget_txn_writer(self, w: WriteHandle) -> None:
        """Stop using ``w`` for transactions (its lease ran out)."""
        with self._txn_lock:
            if self._txn_writers.get(w.shard_id) is w:
                del self._txn_writers[w.shard_id]

    def open_reader(
        self,
        shard_name: str,
        key_schema: pa.Schema,
        value_schema: pa.Schema,
        *,
        drop: Collection[str] = (),
    ) -> ReadHandle:
        """Open (creating if needed) the shard and return a leased reader only (registered
        in the shard state, holding the shard's current since).  Arguments as
        :meth:`open`."""
        m, sid = self._open_machine(shard_name, key_schema, value_schema, drop)
        return self._reader(m, shard_name, key_schema, value_schema, sid)

    def _reader(
        self,
        m: ShardMachine,
        name: str,
        key_schema: pa.Schema,
        value_schema: pa.Schema,
        schema_id: int | None = None,
    ) -> ReadHandle:
        """A leased reader; without ``schema_id``, its id is resolved on the state that
        registers it (the version equal to ``value_schema`` there)."""
        rid = "r" + uuid.uuid4().hex
        rl = self.reader_lease_seconds
        sid = m.open_reader(rid, int(rl * 1000), key_schema, value_schema, schema_id)
        r = ReadHandle(self, m, name, rid, key_schema, value_schema, rl)
        r.schema_id = self._schema_id(m, key_schema, value_schema) if sid is None else sid
        self._handles.add(r)
        return r

    def inspect(self, shard: str) -> ShardState:
        """The latest state of a shard (a name, or ``id:<shard id>``), freshly read."""
        return self.machine(self.shard_id(shard)).fetch()

    def check_may_delete(self, what: str) -> None:
        """Refuse an operation that deletes blobs (GC, :meth:`finalize_shard`) unless
        the stash is writable.  A ``savepoint`` stash commits none of its state changes,
        so what it judges unreferenced may still be referenced by the live state that
        shares the blob store; a ``readonly`` one cannot record what it deleted.

        Raises:
            InvalidUsage: the stash's mode is not ``writable`` (names ``what``).
        """
        mode = getattr(self.stash, "mode", "writable")
        if mode != "writable":
            raise InvalidUsage(
                f"{what} deletes blobs and needs a writable stash, not a {mode} one: its "
                "state changes are never committed, so it could delete parts the live "
                "state still references"
            )

    def finalize_shard(self, shard: str) -> int:
        """Drop a shard (Materialize's ``Destroy``; persist-client's finalization): its
        state becomes a tombstone (upper and since advanced to the empty antichain, no
        batch, no reader, no writer), then every blob under its prefix that persist
        wrote is deleted, and on object stores the empty "directory" objects under it
        (a key persist did not write is kept, with its directories).  Later :meth:`open` calls of the name raise
        :class:`InvalidUsage`; handles still open fail on their next state change
        (their lease is gone).  Idempotent: finalizing a tombstone deletes what is
        left.  Returns the number of blobs deleted.

        Args:
            shard: a name, or ``id:<shard id>``.

        Raises:
            InvalidUsage: unknown shard, or a stash that is not writable (see
                :meth:`check_may_delete`).  ConsensusError, BlobError: storage failed
                (call again: the tombstone, once written, stays).
        """
        self._check_open()
        self.check_may_delete("finalize_shard")
        from persist.keys import parse_part_key

        shard_id = self.shard_id(shard)
        m = self.machine(shard_id)
        m.finalize(m.now_ms())
        n = 0
        for key, _size in self.blob.list_keys(f"{shard_id}/"):
            if parse_part_key(shard_id, key) is None:
                log.warning("finalize of shard %s: key %s is not persist's: kept", shard_id, key)
                continue
            self.blob.delete(key)
            n += 1
        if isinstance(self.raw_blob, ArrowFsBlob):
            # Object stores: the empty "directory" objects left under the prefix go too.
            remove_empty_dirs(self.raw_blob, f"{shard_id}/")
        _u, retired = self.consensus.retired_entries(shard_id)
        if retired:
            m.forget_retired()
        self.consensus.truncate(shard_id)
        return n

    # -------------------------------------------------------------- compaction
    def _on_merge_reqs(self, machine: ShardMachine, reqs: list[FueledMergeReq]) -> None:
        """Called by a writer after a successful append that produced merge requests."""
        if self.compaction == "inline":
            try:
                self.compactor.run_reqs(machine, reqs)
            except PersistError as e:
                log.warning("inline compaction of shard %s failed: %s", machine.shard_id, e)
        elif self.compaction == "background":
            self.compactor.notify(machine.shard_id)

    def _notify_compactor(self, shard_id: str) -> None:
        """Called when a shard's since may have moved."""
        if self.compaction == "background":
            self.compactor.notify(shard_id)

    # ----------------------------------------------------------------- closing
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidUsage("this PersistClient is closed")

    def close(self) -> None:
        """Stop the background compactor, expire the handles this client opened (their
        leases and since holds go away; best effort), and close the blob store if the
        client opened it from a URI.  The stash is the caller's.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.compactor.stop()
        self.compactor.expire_writers()
        for h in list(self._handles):
            try:
                h.expire()
            except (PersistError, StashError) as e:
                log.info("could not expire %r on close: %s", h, e)
        if self._owns_blob:
            try:
                self.raw_blob.close()
            except BlobError:  # pragma: no cover
                pass

    def __enter__(self) -> PersistClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
