"""Opening shards and what goes with it: :class:`Shards`.

It holds what the client did to open a shard (register its name, initialize its state,
register a compatible value schema), to make the handles of an open shard (a writer, a
leased reader), to keep the writer and the record ids its transactions reuse, and to
inspect and finalize a shard.  :class:`~persist.client.PersistClient` and
:class:`~persist.txn.Txn` use it; it holds the client's
:class:`~persist.context.PersistContext`, never the client.

Invariants kept here:

* a shard name maps to exactly one ShardId, for every process (the registry in
  consensus); its key schema is fixed when it is created; its value schema is versioned:
  opening it with a compatible evolution of the newest version registers a new version
  by compare-and-set (decided on the latest state, re-checked on every race), with a
  registered version uses that version, and with anything else raises
  :class:`~persist.errors.SchemaMismatch` naming the column and the rule, changing
  nothing;
* a finalized shard (:meth:`Shards.finalize_shard`) is a tombstone: it is never opened
  again, and its parts are deleted;
* one writer per shard serves the transactions of one client (replaced once expired or
  when the schemas it was asked for change); ``_txn_lock`` is a leaf lock: no state is
  read and no handle made while it is held.

Source of the idea: Materialize's persist-client ``src/persist-client/src/lib.rs``
(``PersistClient::open``, ``open_writer``, ``open_leased_reader``) and
``src/persist-client/src/internal/state.rs`` (``register_schema``, finalization).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Collection, Sequence

import pyarrow as pa

from persist.blob import ArrowFsBlob
from persist.blob.dirs import remove_empty_dirs
from persist.context import PersistContext
from persist.errors import InvalidUsage
from persist.ids import validate_shard_name
from persist.keys import parse_part_key
from persist.machine import ShardMachine
from persist.parts import updates_schema
from persist.read import ReadHandle
from persist.state import ShardState
from persist.store_identity import StoreMismatch
from persist.write import WriteHandle

__all__ = ["Shards"]

log = logging.getLogger(__name__)


class Shards:
    """Opens the shards of one client and makes their handles (see the module
    docstring).  Thread-safe.

    Attributes:
        ctx: the client's :class:`~persist.context.PersistContext`.
        consensus: ``ctx.consensus``.
    """

    def __init__(self, ctx: PersistContext) -> None:
        self.ctx = ctx
        self.consensus = ctx.consensus
        self._txn_writers: dict[str, WriteHandle] = {}
        self._txn_lock = threading.Lock()
        # shard id -> record ids of acknowledged transactions, dropped from the shard's
        # state by this client's next transaction on it (see persist.txn_commit).
        self._txn_done: dict[str, list[str]] = {}

    def __repr__(self) -> str:
        return f"Shards({self.ctx!r})"

    def open_machine(
        self,
        name: str,
        key_schema: pa.Schema,
        value_schema: pa.Schema,
        drop: Collection[str] = (),
    ) -> tuple[ShardMachine, int]:
        """The shard's machine (creating the shard if needed) and the schema id of
        handles opened with these schemas (registered if new; see
        :meth:`register_schema`)."""
        self.ctx.check_open()
        validate_shard_name(name)
        updates_schema(key_schema, value_schema)  # validates the schemas
        now_ms = int(self.ctx.config.clock() * 1000)
        shard_id = self.consensus.register(name, now_ms)
        m = self.ctx.machine(shard_id)
        st = m.initialize(
            ShardState(shard_id, name, key_schema, value_schema), self.ctx.store.stamp
        )
        self.adopt_store(m, st)
        if st.tombstone:
            raise InvalidUsage(
                f"shard {name!r} ({shard_id}) was finalized (dropped): it cannot be opened"
            )
        return m, self.register_schema(m, st, key_schema, value_schema, drop)

    def adopt_store(self, m: ShardMachine, st: ShardState) -> None:
        """Record this client's blob store in a shard that records none (made before
        stores had identities) if the store holds its parts, on a writable stash; a
        store holding none of its blob parts is refused.

        Raises:
            StoreMismatch: the store holds none of the shard's blob parts.
        """
        if st.store_id is not None or st.tombstone:
            return
        store = self.ctx.store
        if not store.holds_parts(st):
            raise StoreMismatch(
                st.name,
                "that holds its parts",
                store.name,
                f"this one holds none of its {len(st.referenced_blob_keys())} blob parts",
            )
        if getattr(self.ctx.stash, "mode", "writable") == "writable":
            m.adopt_store(store.ensure(), store.name)

    def register_schema(
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

    def schema_id(self, m: ShardMachine, key_schema: pa.Schema, value_schema: pa.Schema) -> int:
        """The schema id of these schemas in the shard's latest state (registering them
        if they are a compatible evolution dropping nothing)."""
        return self.register_schema(m, m.recent(), key_schema, value_schema)

    def writer(
        self,
        m: ShardMachine,
        name: str,
        key_schema: pa.Schema,
        value_schema: pa.Schema,
        schema_id: int | None = None,
    ) -> WriteHandle:
        wid = "w" + uuid.uuid4().hex
        w = WriteHandle(
            self.ctx, m, name, wid, key_schema, value_schema, self.ctx.config.writer_lease_seconds
        )
        w.schema_id = (
            self.schema_id(m, key_schema, value_schema) if schema_id is None else schema_id
        )
        self.ctx.handles.add(w)
        return w

    def reader(
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
        rl = self.ctx.config.reader_lease_seconds
        sid = m.open_reader(rid, int(rl * 1000), key_schema, value_schema, schema_id)
        r = ReadHandle(self.ctx, m, name, rid, key_schema, value_schema, rl)
        r.schema_id = self.schema_id(m, key_schema, value_schema) if sid is None else sid
        self.ctx.handles.add(r)
        return r

    def txn_writer(
        self,
        m: ShardMachine,
        name: str,
        key_schema: pa.Schema | None = None,
        value_schema: pa.Schema | None = None,
        schema_id: int | None = None,
    ) -> WriteHandle:
        """The writer the transactions use for a shard, with the given schemas
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
            schema_id = self.schema_id(m, key_schema, value_schema)
        with self._txn_lock:
            w = self._txn_writers.get(m.shard_id)
        if w is not None and not (
            w.lapsed(m.now_ms())
            or w.schema_id != schema_id
            or not (w.key_schema.equals(key_schema) and w.value_schema.equals(value_schema))
        ):
            return w
        fresh = self.writer(m, name, key_schema, value_schema, schema_id)
        with self._txn_lock:
            if self._txn_writers.get(m.shard_id) is w:
                self._txn_writers[m.shard_id] = fresh
        return fresh

    def txn_done_add(self, shard_id: str, record_id: str) -> None:
        """Note that the transaction recorded under ``record_id`` is acknowledged."""
        with self._txn_lock:
            ids = self._txn_done.setdefault(shard_id, [])
            ids.append(record_id)
            del ids[:-1024]  # older ones expire with their leases

    def txn_done_ids(self, shard_id: str) -> tuple[str, ...]:
        """Record ids of acknowledged transactions still in ``shard_id``'s state."""
        with self._txn_lock:
            return tuple(self._txn_done.get(shard_id, ()))

    def txn_done_forget(self, shard_id: str, record_ids: Sequence[str]) -> None:
        """``record_ids`` were dropped from ``shard_id``'s state."""
        if not record_ids:
            return
        gone = set(record_ids)
        with self._txn_lock:
            ids = self._txn_done.get(shard_id)
            if ids:
                ids[:] = [i for i in ids if i not in gone]

    def forget_txn_writer(self, w: WriteHandle) -> None:
        """Stop using ``w`` for transactions (its lease ran out)."""
        with self._txn_lock:
            if self._txn_writers.get(w.shard_id) is w:
                del self._txn_writers[w.shard_id]

    def inspect(self, shard: str) -> ShardState:
        """The latest state of a shard (a name, or ``id:<shard id>``), freshly read."""
        # A full read from scratch, not a catch-up from the cache: an inspection shows
        # what is stored (a corrupt or foreign state raises here).
        return self.ctx.machine(self.ctx.shard_id(shard)).fetch()

    def finalize_shard(self, shard: str) -> int:
        """Drop a shard (Materialize's ``Destroy``; persist-client's finalization): its
        state becomes a tombstone (upper and since advanced to the empty antichain, no
        batch, no reader, no writer), then every blob under its prefix that persist
        wrote is deleted, and on object stores the empty "directory" objects under it
        (a key persist did not write is kept, with its directories).  Later opens of the name raise
        :class:`InvalidUsage`; handles still open fail on their next state change
        (their lease is gone).  Idempotent: finalizing a tombstone deletes what is
        left.  Returns the number of blobs deleted.

        Args:
            shard: a name, or ``id:<shard id>``.

        Raises:
            InvalidUsage: unknown shard, or a stash that is not writable (see
                :meth:`PersistContext.check_may_delete`).  ConsensusError, BlobError: storage failed
                (call again: the tombstone, once written, stays).
        """
        self.ctx.check_open()
        self.ctx.check_may_delete("finalize_shard")
        shard_id = self.ctx.shard_id(shard)
        m = self.ctx.machine(shard_id)
        m.finalize(m.now_ms())
        n = 0
        for key, _size in self.ctx.blob.list_keys(f"{shard_id}/"):
            if parse_part_key(shard_id, key) is None:
                log.warning("finalize of shard %s: key %s is not persist's: kept", shard_id, key)
                continue
            self.ctx.blob.delete(key)
            n += 1
        if isinstance(self.ctx.raw_blob, ArrowFsBlob):
            # Object stores: the empty "directory" objects left under the prefix go too.
            remove_empty_dirs(self.ctx.raw_blob, f"{shard_id}/")
        _u, retired = self.consensus.retired_entries(shard_id)
        if retired:
            m.forget_retired()
        self.consensus.truncate(shard_id)
        return n
