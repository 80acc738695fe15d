"""The persist client: opens shards (by name) on a stash (consensus) and a blob store.

:class:`PersistClient` (the persist-client ``PersistClient``) is a facade: it builds
the client's knobs (:class:`~persist.config.PersistConfig`), what its handles share
(:class:`~persist.context.PersistContext`: consensus on a :class:`stash.Stash`, a blob
store, one :class:`~persist.machine.ShardMachine` per open shard), the shard opener
(:class:`~persist.shards.Shards`), a :class:`~persist.compactor.Compactor` and the
background worker (:class:`~persist.maintenance.Maintenance`) that answers the Spine's
merge requests in the background, inline after each append, or not at all; and it hands
out handles.  The handles hold the context, never the client.

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
   client's transaction lock (``Shards._txn_lock``: the writers and record ids its
   transactions reuse), the consensus and machine caches' locks, the background
   worker's condition and the compactor's writer table.

Nothing is called while a leaf lock is held that could take a lock of levels 1-2 (the
writer a transaction reuses is looked up under ``_txn_lock``, but made, and its state
read, outside it).

Sources: the persist-client ``PersistClient`` / ``open`` and the first engine's
maintenance (``src/persist/src/indexed/``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence

import pyarrow as pa

from persist.blob import Blob, RetryingBlob, open_blob
from persist.compactor import Compactor
from persist.config import DEFAULT_TARGET_PART_BYTES, CompactionMode, PersistConfig
from persist.consensus import Consensus
from persist.context import SHARD_ID_REF, PersistContext
from persist.errors import BlobError, PersistError
from persist.machine import ShardMachine
from persist.maintenance import Maintenance
from persist.read import ReadHandle
from persist.shards import Shards
from persist.snapshots import snapshot_many
from persist.state import ShardState
from persist.table import Table, create_table, open_table
from persist.txn import Txn
from persist.write import WriteHandle
from stash import Stash, StashError

__all__ = ["SHARD_ID_REF", "CompactionMode", "PersistClient", "RetryingBlob"]

log = logging.getLogger(__name__)


class PersistClient:
    """Opens shards stored in ``blob`` with their state in ``stash``.

    Args:
        stash: an open :class:`stash.Stash` (``fenced=False`` to share it between
            processes); the client does not close it.
        blob: a blob URI (``file:///path``, ``memory://``, any ``pyarrow.fs`` URI) or a
            :class:`~persist.blob.Blob`.  Over a ``mode="readonly"`` stash a missing
            local root is not created (it reads as empty).
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
        config = PersistConfig(
            compaction=compaction,
            reader_lease_seconds=reader_lease_seconds,
            writer_lease_seconds=writer_lease_seconds,
            handoff_lease_seconds=handoff_lease_seconds,
            inline_max_bytes=inline_max_bytes,
            inline_total_max_bytes=inline_total_max_bytes,
            target_part_bytes=target_part_bytes,
            write_workers=write_workers,
            read_workers=read_workers,
            blob_retries=blob_retries,
            consensus_retries=consensus_retries,
            gc_grace_seconds=gc_grace_seconds,
            gc_interval_seconds=gc_interval_seconds,
            piggyback_seconds=piggyback_seconds,
            clock=clock,
        )
        self._owns_blob = isinstance(blob, str)
        # A readonly stash writes nothing, so neither does its client: not even the
        # root of a blob store named by a wrong URI.
        readonly = getattr(stash, "mode", None) == "readonly"
        raw = open_blob(blob, create=not readonly) if isinstance(blob, str) else blob
        self._ctx = PersistContext(
            config,
            stash,
            RetryingBlob(raw, config.blob_retries),
            raw,
            Consensus(stash, retries=config.consensus_retries),
        )
        self._shard_ops = Shards(self._ctx)
        self.compactor = Compactor(self._ctx)
        self.maintenance = Maintenance(self._ctx, self.compactor)
        if config.compaction == "background":
            self.maintenance.start()

    def __repr__(self) -> str:
        return f"PersistClient({self.stash!r}, {self.raw_blob!r}, compaction={self.compaction!r})"

    # ------------------------------------------------------------------ parts
    @property
    def context(self) -> PersistContext:
        """What this client's handles share (:class:`~persist.context.PersistContext`)."""
        return self._ctx

    @property
    def shard_ops(self) -> Shards:
        """This client's shard opener (:class:`~persist.shards.Shards`)."""
        return self._shard_ops

    @property
    def config(self) -> PersistConfig:
        """This client's knobs (:class:`~persist.config.PersistConfig`)."""
        return self._ctx.config

    @property
    def stash(self) -> Stash:
        """The stash holding consensus (the caller's to close)."""
        return self._ctx.stash

    @property
    def blob(self) -> Blob:
        """The blob store handles use (retrying transient errors)."""
        return self._ctx.blob

    @property
    def raw_blob(self) -> Blob:
        """The blob store under :attr:`blob`."""
        return self._ctx.raw_blob

    @property
    def consensus(self) -> Consensus:
        """The shards' versioned log in the stash."""
        return self._ctx.consensus

    @property
    def compaction(self) -> CompactionMode:
        """How merge requests are answered (see the class docstring); settable (a new
        :class:`~persist.config.PersistConfig`; the background thread is not started or
        stopped by it)."""
        return self._ctx.config.compaction

    @compaction.setter
    def compaction(self, mode: CompactionMode) -> None:
        self._ctx.config = self._ctx.config.replace(compaction=mode)

    @property
    def reader_lease_seconds(self) -> float:
        """A reader's lease (seconds)."""
        return self._ctx.config.reader_lease_seconds

    @property
    def writer_lease_seconds(self) -> float:
        """A writer's lease (seconds)."""
        return self._ctx.config.writer_lease_seconds

    @property
    def handoff_lease_seconds(self) -> float:
        """A writer's lease while others hold its batches (seconds)."""
        return self._ctx.config.handoff_lease_seconds

    @property
    def inline_max_bytes(self) -> int:
        """The largest batch kept inline in the state (bytes)."""
        return self._ctx.config.inline_max_bytes

    @property
    def inline_total_max_bytes(self) -> int:
        """The most inline bytes the state holds (bytes)."""
        return self._ctx.config.inline_total_max_bytes

    @property
    def target_part_bytes(self) -> int:
        """Target in-memory size of a part (bytes)."""
        return self._ctx.config.target_part_bytes

    @property
    def write_workers(self) -> int:
        """Threads uploading parts."""
        return self._ctx.config.write_workers

    @property
    def read_workers(self) -> int:
        """Threads fetching parts."""
        return self._ctx.config.read_workers

    @property
    def gc_grace_seconds(self) -> float:
        """GC's grace period (seconds)."""
        return self._ctx.config.gc_grace_seconds

    @property
    def gc_interval_seconds(self) -> float | None:
        """The background GC interval (seconds; None: none)."""
        return self._ctx.config.gc_interval_seconds

    @property
    def piggyback_seconds(self) -> float:
        """How long results are offered to this process's appends (s)."""
        return self._ctx.config.piggyback_seconds

    @property
    def clock(self) -> Callable[[], float]:
        """The wall clock (seconds)."""
        return self._ctx.config.clock

    @property
    def _machines(self) -> dict[str, ShardMachine]:
        """Shard id -> the state machine this client's handles share."""
        return self._ctx.machines

    # ------------------------------------------------------------------ shards
    def machine(self, shard_id: str) -> ShardMachine:
        """The state machine of ``shard_id`` (shared by this client's handles)."""
        return self._ctx.machine(shard_id)

    def shards(self) -> dict[str, str]:
        """Every registered shard: name -> shard id."""
        return self._ctx.consensus.shards()

    def shard_id(self, shard: str) -> str:
        """Resolve a shard reference to a shard id (:meth:`PersistContext.shard_id`):
        a plain string is always a *name*; a shard id is given as ``"id:<shard id>"``.

        Raises:
            InvalidUsage: no shard has that name; a malformed name or ``id:`` reference.
        """
        return self._ctx.shard_id(shard)

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
        ops = self._shard_ops
        m, sid = ops.open_machine(shard_name, key_schema, value_schema, drop)
        return (
            ops.writer(m, shard_name, key_schema, value_schema, sid),
            ops.reader(m, shard_name, key_schema, value_schema, sid),
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
        ops = self._shard_ops
        m, sid = ops.open_machine(shard_name, key_schema, value_schema, drop)
        return ops.writer(m, shard_name, key_schema, value_schema, sid)

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
        ops = self._shard_ops
        m, sid = ops.open_machine(shard_name, key_schema, value_schema, drop)
        return ops.reader(m, shard_name, key_schema, value_schema, sid)

    def create_table(self, name: str, schema: pa.Schema, key: Sequence[str]) -> Table:
        """The table ``name`` (:class:`~persist.table.Table`) with columns ``schema``
        and key columns ``key``, created if it does not exist; an existing table with
        exactly this key and schema is returned as it is.

        Args:
            name: the table's (shard's) name.
            schema: its columns (``pyarrow.Schema``); the shard keeps the key columns
                first (in ``key``'s order), then the others in ``schema``'s order.
            key: the key columns' names (a non-empty list).

        Raises:
            SchemaMismatch: the table exists with another key or schema (naming both);
                nothing is changed.
            InvalidUsage: a bad name, schema or key; a dropped table.
            ConsensusError: the stash failed.
        """
        return create_table(self._shard_ops, self.compactor, name, schema, key)

    def table(self, name: str) -> Table:
        """The existing table ``name`` (:class:`~persist.table.Table`), in its newest
        schema.  Writes nothing: works on a readonly stash.

        Raises:
            UnknownShard: no table has that name (offering close names: "did you
                mean").  InvalidUsage: the table was dropped.
        """
        return open_table(self._shard_ops, self.compactor, name)

    def inspect(self, shard: str) -> ShardState:
        """The latest state of a shard (a name, or ``id:<shard id>``), freshly read."""
        return self._shard_ops.inspect(shard)

    def check_may_delete(self, what: str) -> None:
        """:meth:`PersistContext.check_may_delete`: refuse an operation that deletes
        blobs unless the stash is writable.

        Raises:
            InvalidUsage: the stash's mode is not ``writable`` (names ``what``).
        """
        self._ctx.check_may_delete(what)

    def finalize_shard(self, shard: str) -> int:
        """Drop a shard (:meth:`persist.shards.Shards.finalize_shard`): its state
        becomes a tombstone and every blob persist wrote under its prefix is deleted.
        Returns the number of blobs deleted.

        Raises:
            InvalidUsage: unknown shard, a closed client, or a stash that is not
                writable.  ConsensusError, BlobError: storage failed (call again).
        """
        return self._shard_ops.finalize_shard(shard)

    # ------------------------------------------------------------ transactions
    def begin(self) -> Txn:
        """A new :class:`~persist.txn.Txn`: writes to several shards and stash batches
        committed together in one stash transaction.

        Raises:
            InvalidUsage: the client is closed.
        """
        return Txn(self._shard_ops)

    def snapshot_many(
        self, as_ofs: Mapping[str, int | None] | Sequence[str]
    ) -> dict[str, pa.Table]:
        """Cross-shard-consistent snapshots: see :func:`persist.snapshots.snapshot_many`."""
        self._ctx.check_open()
        return snapshot_many(self._shard_ops, as_ofs)

    # ----------------------------------------------------------------- closing
    def close(self) -> None:
        """Stop the background worker, expire the handles this client opened (their
        leases and since holds go away; best effort), and close the blob store if the
        client opened it from a URI.  The stash is the caller's.  Idempotent."""
        ctx = self._ctx
        if ctx.closed:
            return
        ctx.closed = True
        self.maintenance.stop()
        self.compactor.expire_writers()
        for h in list(ctx.handles):
            try:
                h.expire()
            except (PersistError, StashError) as e:
                log.info("could not expire %r on close: %s", h, e)
        if self._owns_blob:
            try:
                ctx.raw_blob.close()
            except BlobError:  # pragma: no cover
                pass

    def __enter__(self) -> PersistClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
