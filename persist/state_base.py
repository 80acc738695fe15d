"""The fields of a shard's state and the primitive changes the state's commands are made of.

:class:`ShardStateBase` holds one version of a shard's metadata (the fields, see
:class:`persist.state.ShardState`, its only subclass, for the invariants they keep) and
the small mutations the commands of :mod:`persist.state` combine: register, renew,
downgrade and expire leases, push a batch, swap a compaction result in, retire and forget
blob keys.  Each raises before changing anything when it refuses.  Also here: the
exceptions a command raises to ask for a fresh version (:class:`Stale`) or to report a
lost lease (:class:`LeaseExpired`), and what a version says of an idempotency token
(:func:`token_entry`, :func:`token_verdict`; the records are :mod:`persist.landed`'s).

Source: Materialize's persist-client ``internal/state.rs`` (``StateCollections``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Self, cast

import pyarrow as pa

from persist.errors import InvalidUsage, PersistError, SchemaMismatch
from persist.keys import key_writer_id
from persist.landed import NO_HORIZON, Landed, record, verdict
from persist.lease_state import (
    TOKEN_LANDED,
    TOKEN_NOT_LANDED,
    TOKEN_UNKNOWN,
    ReaderState,
    WriterState,
)
from persist.schemacache import schema_cache
from persist.spine import ApplyMergeResult, FueledMergeReq, FueledMergeRes, Trace
from persist.tracked import Noting, TrackedDict
from persist.types import HollowBatch
from persist.updates import SchemaHistory, check_schema_evolution
from stash import Antichain

__all__ = [
    "SEQNO_ONLY",
    "LeaseExpired",
    "ShardStateBase",
    "Stale",
    "token_entry",
    "token_verdict",
]


#: The purpose of a reader lease that holds a seqno but no since (see
#: :meth:`ShardState.detach_reader`).
SEQNO_ONLY = "seqno hold"


class Stale(Exception):
    """Raised by a command that would fail on a cached state (``fresh`` false): the
    machine re-reads the head and runs it again on the fresh state, where failing is then
    real (Materialize's persist-client returns the same "retry on a fresh state" from
    its ``internal/state.rs`` commands)."""


class LeaseExpired(InvalidUsage):
    """A reader or writer handle was used after its lease expired (it was dropped from the
    shard state because it did not heartbeat within its lease duration).

    Attributes: ``shard_id`` (str), ``handle_id`` (str).
    """

    def __init__(self, shard_id: str, handle_id: str, what: str = "reader") -> None:
        self.shard_id = shard_id
        self.handle_id = handle_id
        super().__init__(
            f"{what} {handle_id} of shard {shard_id} is not registered: its lease expired "
            "(no heartbeat within the lease duration) or it was expired"
        )


@schema_cache(256)
def _history(key_schema: pa.Schema, versions: tuple[pa.Schema, ...]) -> SchemaHistory:
    return SchemaHistory(key_schema, versions)


def token_entry(st: ShardStateBase, writer_id: str, token: str) -> str | None:
    """The recorded entry of the append with ``token`` (see :data:`TOKEN_SEP`): the
    shard's durable record (:mod:`persist.landed`), or, in a state written before those
    existed, one a writer (``writer_id`` first) still keeps."""
    rec = st.landed.get(token)
    if rec is not None:
        return rec.entry
    w = st.writers.get(writer_id)
    entry = None if w is None else w.token_entry(token)
    if entry is not None:
        return entry
    for w in st.writers.values():
        entry = w.token_entry(token)
        if entry is not None:
            return entry
    return None


def token_verdict(st: ShardStateBase, token: str, lo: int | None) -> tuple[str, str | None]:
    """What ``st`` (a version read from consensus) says of the append with ``token``
    whose first attempt started after version ``lo`` (``None``: unknown):
    ``(TOKEN_LANDED, entry)``, ``(TOKEN_NOT_LANDED, None)`` or ``(TOKEN_UNKNOWN, None)``
    (:func:`persist.landed.verdict`; a writer's record of a state written before the
    shard kept its own counts as landed)."""
    entry = token_entry(st, "", token)
    if entry is not None:
        return TOKEN_LANDED, entry
    v, _ = verdict(st.landed, st.landed_horizon, token, lo)
    return (TOKEN_NOT_LANDED if v == "not landed" else TOKEN_UNKNOWN), None


@dataclass
class ShardStateBase:
    """One version of a shard's state.  Mutable: transitions change it in place, so callers
    work on a :meth:`clone` and publish it by compare-and-set.

    Attributes:
        shard_id: ``"s"`` + a UUID.
        name: the shard's registered name.
        key_schema, value_schema: the Arrow schemas of the key and the value columns
            (``value_schema`` is the newest registered version).
        schema_history: the value schema versions, ``schema_history[i]`` being schema
            id ``i``; its last one is ``value_schema``; empty on
            construction means ``(value_schema,)`` (states written before schemas were
            versioned load so: every part of theirs has schema id 0).
        seqno: the version number in consensus (``-1`` before the first version).
        trace: the Spine holding the batches, ``since`` and ``upper``.
        readers: reader id -> :class:`ReaderState`.
        writers: writer id -> :class:`WriterState`.
        retired_upper: the upper of the shard's retired collection (see the module
            docstring).
        tombstone: the shard was finalized (dropped): no handle may use it again.
        landed: idempotency token -> :class:`~persist.landed.Landed`, the records of
            the newest appends and transactions that landed, oldest first (kept apart
            from the writers: :mod:`persist.landed`).
        landed_horizon: the highest seqno of a pruned record (``-1``: none).
        retire_adds, retire_removes: transient (not serialised) changes to the retired
            collection made by this transition: blob key -> retirement ms.
        history_upper: the length of the shard's history log (one record per
            version that changed the shard's contents, schema or retention; see
            :mod:`persist.history`); ``0`` for states written before it existed.
        history_ms: the commit timestamp (UTC ms) of the newest history record: the
            next one is never earlier.
        retention_ms: the table's retention (ms; ``None``: none): the since follows
            ``now - retention`` (see :mod:`persist.retention`).
        retention_marks: ``(commit ms, time)`` of recorded versions the retention may
            yet move the since to (one per :func:`persist.retention.mark_width`).
        retention_hold: the time the retention holds the since at (like a reader's
            hold; ``None``: none); only advances.
        store_id: the identity of the blob store holding the shard's parts (``None``
            until recorded; see :mod:`persist.store_identity`).
        store_name: that store's description (redacted), for messages.
        history_record: transient (not serialised): the record this transition asks to
            write with its version (set by the machine).
        landed_notes: transient (not serialised): in a :meth:`clone`, the landed
            records it was copied from and the tokens whose records it set or removed
            since (:class:`persist.tracked.Noting`); ``None`` otherwise.
    """

    shard_id: str
    name: str
    key_schema: pa.Schema
    value_schema: pa.Schema
    seqno: int = -1
    trace: Trace = field(default_factory=Trace)
    readers: dict[str, ReaderState] = field(default_factory=dict)
    writers: dict[str, WriterState] = field(default_factory=dict)
    retired_upper: int = 0
    tombstone: bool = False
    retire_adds: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    retire_removes: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    schema_history: tuple[pa.Schema, ...] = ()
    landed: dict[str, Landed] = field(default_factory=dict)
    landed_horizon: int = NO_HORIZON
    history_upper: int = 0
    history_ms: int = 0
    retention_ms: int | None = None
    retention_marks: tuple[tuple[int, int], ...] = ()
    retention_hold: int | None = None
    store_id: str | None = None
    store_name: str | None = None
    history_record: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    landed_notes: tuple[Mapping[str, Landed], set[str]] | None = field(
        default=None, init=False, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        if not self.schema_history:
            self.schema_history = (self.value_schema,)
        elif self.schema_history[-1] is not self.value_schema and not self.schema_history[
            -1
        ].equals(self.value_schema):
            raise PersistError(
                f"shard {self.shard_id}: the newest schema version is not the value schema"
            )

    # ----------------------------------------------------------------- schemas
    def schemas(self) -> SchemaHistory:
        """The shard's :class:`~persist.updates.SchemaHistory` (key schema and value
        schema versions)."""
        return _history(self.key_schema, self.schema_history)

    def register_schema(
        self, key_schema: pa.Schema, value_schema: pa.Schema, drop: Collection[str] = ()
    ) -> tuple[int, bool]:
        """The schema id of a handle opened with these schemas, registering
        ``value_schema`` as a new newest version if it is a compatible evolution of
        the newest one dropping no column but those ``drop``
        names.  Returns ``(schema id, registered)``.

        A value schema equal to a registered version gets that version's id (the
        newest such): a handle opened with an older schema keeps its view.

        Raises:
            SchemaMismatch: the key schema differs, or ``value_schema`` is not a
                compatible evolution of the newest version (naming column and rule; a
                column it lacks that ``drop`` does not name is one); nothing changes.
            InvalidUsage: ``drop`` names a column no version has, or one the schemas
                keep.
        """
        if isinstance(drop, str):
            raise InvalidUsage(f"drop must be a collection of column names, not the str {drop!r}")
        unknown = sorted(set(drop) - {n for v in self.schema_history for n in v.names})
        if unknown:
            raise InvalidUsage(
                f"shard {self.name!r} ({self.shard_id}): drop names {unknown}, which no "
                "version of its value schema has"
            )
        if not key_schema.equals(self.key_schema):
            check_schema_evolution(
                f"{self.name!r} ({self.shard_id})",
                self.key_schema,
                self.value_schema,
                key_schema,
                value_schema,
            )
        known = self.schemas().id_of(value_schema)
        if known is not None:
            return known, False
        check_schema_evolution(
            f"{self.name!r} ({self.shard_id})",
            self.key_schema,
            self.value_schema,
            key_schema,
            value_schema,
            drop,
        )
        self.schema_history = (*self.schema_history, value_schema)
        self.value_schema = value_schema
        return len(self.schema_history) - 1, True

    # ----------------------------------------------------------------- reading
    @property
    def since(self) -> Antichain:
        """The shard's since (the trace's)."""
        return self.trace.since

    @property
    def upper(self) -> Antichain:
        """The shard's upper (the trace's)."""
        return self.trace.upper

    def clone(self) -> Self:
        """An independent copy (batches and frontiers are immutable and shared).

        Made field by field (``dataclasses.replace`` would run ``__init__`` and
        ``__post_init__`` again, whose check the copy passes as the original did)."""
        new = object.__new__(type(self))
        fields = new.__dict__
        fields.update(self.__dict__)
        fields["trace"] = self.trace.copy()
        # Copies that note the keys a command sets or removes (persist.tracked):
        # encoding the new version looks only at those.
        fields["readers"] = TrackedDict(self.readers)
        fields["writers"] = TrackedDict(self.writers)
        # The landed records change on every append (one in, the oldest out): a plain
        # copy (dict.copy clones the table in C) whose writes go through a Noting
        # (record_landed), the keys noted in landed_notes.
        fields["landed"] = self.landed.copy()
        fields["landed_notes"] = (self.landed, set())
        fields["retire_adds"] = {}
        fields["retire_removes"] = {}
        fields["history_record"] = None
        return new

    def batches(self) -> list[HollowBatch]:
        """The trace's hollow batches, oldest first."""
        return list(self.trace.batches())

    def referenced_blob_keys(self) -> set[str]:
        """Blob keys of every part the trace references (inline parts have none)."""
        return {p.key for b in self.trace.batches() for p in b.parts if p.key is not None}

    def referenced_part_ids(self) -> set[str]:
        """:attr:`~persist.types.PartRef.part_id` of every part the trace references
        (blob keys, ``inline:`` nonces)."""
        # Each spine batch's part_index holds exactly its parts that have an id.
        return set().union(*self.trace.part_indexes())

    def inline_bytes(self) -> int:
        """Total size (bytes) of the inline parts held in this state (the trace's running
        counters: :meth:`persist.spine.Trace.inline_bytes`)."""
        return self.trace.inline_bytes()

    def blob_bytes(self) -> int:
        """Total size (bytes) of the blob parts the trace references."""
        return sum(
            p.encoded_size_bytes for b in self.trace.batches() for p in b.parts if p.key is not None
        )

    def num_parts(self) -> int:
        """Number of parts (inline and blob) the trace references."""
        return self.trace.num_parts()

    # ------------------------------------------------------------ transitions
    def register_reader(
        self,
        reader_id: str,
        now_ms: int,
        lease_ms: int,
        purpose: str = "",
        since: Antichain | None = None,
    ) -> Antichain:
        """Add a reader holding ``since`` (default: the shard's current since); returns
        its hold.

        Raises:
            InvalidUsage: ``since`` is before the shard's since.
        """
        hold = self.since if since is None else since
        if not self.since <= hold:
            raise InvalidUsage(
                f"reader {reader_id} of shard {self.shard_id} cannot hold since {hold}: "
                f"the shard's since is already {self.since}"
            )
        self.readers[reader_id] = ReaderState(hold, now_ms, lease_ms, purpose, max(self.seqno, 0))
        return hold

    def check_not_finalized(self) -> None:
        """Raise if the shard was finalized (dropped), so handles opened before the drop
        say so instead of reporting a lost lease or an upper race.

        Raises:
            InvalidUsage: the state is a tombstone.
        """
        if self.tombstone:
            raise InvalidUsage(
                f"shard {self.shard_id} was finalized (dropped by finalize_shard or "
                "`persist drop`): it can be neither read nor written"
            )

    def reader(self, reader_id: str) -> ReaderState:
        """The reader's state.

        Raises:
            LeaseExpired: the reader is not registered (expired or never registered).
        """
        r = self.readers.get(reader_id)
        if r is None:
            raise LeaseExpired(self.shard_id, reader_id)
        return r

    def _seqno_hold(self, r: ReaderState, seqno: int | None) -> int:
        """The reader's new seqno hold: ``seqno`` (default: this version's seqno, for a
        reader with no read in progress), capped at this version's, never backwards."""
        cur = max(self.seqno, 0)
        want = cur if seqno is None else min(seqno, cur)
        return max(r.seqno, want)

    def heartbeat_reader(self, reader_id: str, now_ms: int, seqno: int | None = None) -> None:
        """Renew the reader's lease and advance its seqno hold to ``seqno`` (the oldest
        version it may still be reading; ``None``: it reads none older than this one).

        Raises:
            LeaseExpired: the reader is not registered.
        """
        r = self.reader(reader_id)
        self.readers[reader_id] = replace(
            r,
            last_heartbeat_ms=max(now_ms, r.last_heartbeat_ms),
            seqno=self._seqno_hold(r, seqno),
        )

    def downgrade_reader_since(
        self, reader_id: str, since: Antichain, now_ms: int, seqno: int | None = None
    ) -> bool:
        """Advance the reader's since hold to ``since`` (and heartbeat, advancing its
        seqno hold as :meth:`heartbeat_reader`); the shard's since follows the meet of
        the holds.  Returns whether anything changed.

        Raises:
            LeaseExpired: the reader is not registered.
            InvalidUsage: ``since`` is earlier than the reader's current hold.
        """
        r = self.reader(reader_id)
        if not r.since <= since:
            raise InvalidUsage(
                f"reader {reader_id} of shard {self.shard_id} cannot move its since "
                f"backwards from {r.since} to {since}"
            )
        hold = self._seqno_hold(r, seqno)
        changed = since != r.since or now_ms > r.last_heartbeat_ms or hold != r.seqno
        self.readers[reader_id] = replace(
            r, since=since, last_heartbeat_ms=max(now_ms, r.last_heartbeat_ms), seqno=hold
        )
        return self._recompute_since() or changed

    def min_seqno_hold(self, now_ms: int) -> int | None:
        """The earliest seqno hold of the readers live at ``now_ms`` (``None``: none)."""
        holds = [r.seqno for r in self.readers.values() if not r.expired(now_ms)]
        return min(holds) if holds else None

    def live_writers(self, now_ms: int) -> set[str]:
        """Ids of the writers registered and not expired at ``now_ms``."""
        return {wid for wid, w in self.writers.items() if not w.expired(now_ms)}

    def check_writer_live(self, writer_id: str, now_ms: int) -> None:
        """Raise unless ``writer_id`` is registered and its lease has not run out at
        ``now_ms`` (GC may have deleted the keys of a writer that is not live).

        Raises:
            LeaseExpired: naming the writer and the shard.
        """
        w = self.writers.get(writer_id)
        if w is None or w.expired(now_ms):
            raise LeaseExpired(self.shard_id, writer_id, "writer")

    def expire_reader(self, reader_id: str) -> bool:
        """Drop the reader (its hold is released).  Returns whether it was registered."""
        if self.readers.pop(reader_id, None) is None:
            return False
        self._recompute_since()
        return True

    def expire_writer(self, writer_id: str) -> bool:
        """Drop the writer.  Returns whether it was registered."""
        return self.writers.pop(writer_id, None) is not None

    def expire_leases(self, now_ms: int, keep: Iterable[str] = ()) -> bool:
        """Drop readers and writers whose lease ran out at ``now_ms`` (except the ids in
        ``keep``, the caller's own handles).  Returns whether anything changed."""
        keep_set = set(keep)
        dead_r = [
            rid for rid, r in self.readers.items() if r.expired(now_ms) and rid not in keep_set
        ]
        dead_w = [
            wid for wid, w in self.writers.items() if w.expired(now_ms) and wid not in keep_set
        ]
        for rid in dead_r:
            del self.readers[rid]
        for wid in dead_w:
            del self.writers[wid]
        if dead_r:
            self._recompute_since()
        return bool(dead_r or dead_w)

    def detach_reader(self, reader_id: str, now_ms: int, seqno: int | None) -> None:
        """Turn the reader into a *seqno-only* lease (purpose :data:`SEQNO_ONLY`): it
        keeps its seqno hold (advanced to ``seqno``, see :meth:`heartbeat_reader`) until
        its lease runs out, but no longer holds the since back (for a planner whose
        listed parts others read after it is gone: the parts stay, whatever compaction
        does meanwhile).

        Raises:
            LeaseExpired: the reader is not registered.
        """
        self.heartbeat_reader(reader_id, now_ms, seqno)
        self.readers[reader_id] = replace(self.readers[reader_id], purpose=SEQNO_ONLY)
        self._recompute_since()

    def _recompute_since(self) -> bool:
        """Advance the trace's since to the meet of the holds: the readers' and the
        retention's (:attr:`retention_hold`); never backwards; with no hold the since
        stays where it is; seqno-only leases hold no since.  Returns whether it moved."""
        holds = [r.since for r in self.readers.values() if r.purpose != SEQNO_ONLY]
        if self.retention_hold is not None:
            holds.append(Antichain.from_elem(self.retention_hold))
        if not holds:
            return False
        meet = holds[0]
        for h in holds[1:]:
            meet = meet.meet(h)
        if self.trace.since < meet:
            self.trace.downgrade_since(meet)
            return True
        return False

    def append_batch(
        self, batch: HollowBatch, writer_id: str, now_ms: int, lease_ms: int
    ) -> list[FueledMergeReq]:
        """Push ``batch`` (which must start at the upper) into the trace and record the
        writer's heartbeat (the append's token is recorded by :meth:`record_landed`).
        Returns the Spine's merge requests.

        Raises:
            InvalidUsage: the batch does not start at the upper, or is empty in time
                (nothing changes).
            SchemaMismatch: a part was written under a schema version a later version
                dropped a column of (its values there would read as null for every
                reader); nothing changes.
        """
        if len(self.schema_history) > 1:
            history = self.schemas()
            for sid in sorted({p.schema_id for p in batch.parts}):
                if 0 <= sid < len(history.versions) and (lost := history.dropped_after(sid)):
                    raise SchemaMismatch(
                        f"{self.name!r} ({self.shard_id})",
                        lost[0],
                        f"this writer's schema version {sid} has the column, but version "
                        f"{history.newest} (or one between) dropped it, so its values "
                        "would read as null for every reader: open the shard again with "
                        "the newest schema (adding the column back makes a new column); "
                        "nothing was committed",
                    )
        try:
            reqs = self.trace.push_batch(batch)
        except ValueError as e:
            raise InvalidUsage(f"cannot append to shard {self.shard_id}: {e}") from e
        self.heartbeat_writer(writer_id, now_ms, lease_ms)
        return reqs

    def record_landed(self, entry: str, now_ms: int) -> None:
        """Record that the append named by ``entry`` (``token + TOKEN_SEP +
        fingerprint``) lands in the version this state becomes (seqno ``self.seqno +
        1``), pruning the oldest records (:func:`persist.landed.record`)."""
        notes = self.landed_notes
        landed = self.landed if notes is None else Noting(self.landed, notes[1])
        self.landed_horizon = record(
            cast(dict[str, Landed], landed), self.landed_horizon, entry, self.seqno + 1, now_ms
        )

    def heartbeat_writer(self, writer_id: str, now_ms: int, lease_ms: int) -> None:
        """Register or renew a writer, keeping its last token.  The heartbeat time never
        moves back (``max(old, now_ms)``, as the reader's heartbeat): a clock behind the
        one that last renewed it never shortens the lease.  (A handle that was
        registered before must check :meth:`check_writer_live` first: a writer id is
        registered over one contiguous interval, never again after its lease ran out.)"""
        w = self.writers.get(writer_id)
        if w is None:
            self.writers[writer_id] = WriterState(now_ms, lease_ms)
        else:
            self.writers[writer_id] = replace(
                w, last_heartbeat_ms=max(w.last_heartbeat_ms, now_ms), lease_duration_ms=lease_ms
            )

    def hand_off_writer(self, writer_id: str, now_ms: int, lease_ms: int, batches: int) -> bool:
        """Record that the live writer ``writer_id``, whose handle is going away, handed
        out ``batches`` batches it did not append (see :attr:`WriterState.handed_off`).
        If some are still outstanding (not yet settled by others' appends or
        deletions), its lease is renewed at ``now_ms`` and lengthened to at least
        ``lease_ms`` (the client's hand-off lease), so GC keeps their parts while they
        travel to whoever appends them (the receiver's
        :meth:`persist.write.WriteHandle.hold` renews it further while it holds them);
        if none is, the writer is dropped at once.  A writer that is gone or whose lease
        ran out is never brought back.  Returns whether the state changed."""
        w = self.writers.get(writer_id)
        if w is None or w.expired(now_ms) or batches <= 0:
            return False
        handed = replace(w, handed_off=w.handed_off + batches)
        if handed.settled >= handed.handed_off:
            del self.writers[writer_id]
            return True
        self.writers[writer_id] = replace(
            handed,
            last_heartbeat_ms=max(w.last_heartbeat_ms, now_ms),
            lease_duration_ms=max(w.lease_duration_ms, lease_ms),
        )
        return True

    def release_handed_off(self, writer_id: str, batches: int = 1) -> bool:
        """Count ``batches`` batches with parts of ``writer_id`` that another writer
        appended (or whose decoded copies it deleted) as settled (see
        :attr:`WriterState.settled`); a handed-off writer is dropped once none is
        outstanding.  Returns whether anything changed."""
        w = self.writers.get(writer_id)
        if w is None or batches <= 0:
            return False
        w = replace(w, settled=w.settled + batches)
        if w.handed_off and w.settled >= w.handed_off:
            del self.writers[writer_id]
        else:
            self.writers[writer_id] = w
        return True

    def renew_writer(self, writer_id: str, now_ms: int) -> bool:
        """Renew the lease of a writer that is live at ``now_ms`` (keeping its lease
        duration), on behalf of whoever holds a batch of its parts.  A writer that is
        gone or whose lease ran out is never brought back (GC may have deleted its
        parts).  The heartbeat time never moves back (``max(old, now_ms)``).  Returns
        whether it was renewed (live at ``now_ms``)."""
        w = self.writers.get(writer_id)
        if w is None or w.expired(now_ms):
            return False
        self.writers[writer_id] = replace(w, last_heartbeat_ms=max(w.last_heartbeat_ms, now_ms))
        return True

    def apply_merge_res(self, res: FueledMergeRes, now_ms: int) -> ApplyMergeResult:
        """Swap a compaction result into the trace; blob keys it stops referencing are
        retired at ``now_ms`` (listed in ``retire_adds``, for GC after its grace period),
        and so are the ids of inline parts it merged away (``inline:`` and a nonce, see
        :attr:`~persist.types.PartRef.part_id`: an append refuses a copy of them until
        GC forgets them).

        An output whose parts name a writer (the compactor that wrote them) that is not
        live at ``now_ms`` is not applied (``NOT_APPLIED_NO_MATCH``): GC may already have
        deleted its parts."""
        for p in res.output.parts:
            wid = None if p.key is None else key_writer_id(p.key)
            if wid is not None and wid not in self.live_writers(now_ms):
                return ApplyMergeResult.NOT_APPLIED_NO_MATCH
        before = self.referenced_part_ids()
        result = self.trace.apply_merge_res(res)
        if result.applied():
            after = self.referenced_part_ids()
            for key in before - after:
                self.retire_adds[key] = now_ms
        return result

    def contains_batch(self, batch: HollowBatch) -> bool:
        """Whether the trace holds exactly this hollow batch (e.g. a merge result that
        an earlier attempt already applied)."""
        n = batch.len
        return any(b is batch or (b.len == n and b == batch) for b in self.trace.batches())

    def forget_retired(self, retired: Mapping[str, int]) -> bool:
        """Remove rows (row key -> retirement ms, exactly as stored: see
        :class:`persist.consensus.RetiredKey`) from the retired collection, after GC
        deleted their blobs.  The caller must pass only rows present in the collection
        as of this version (GC checks ``retired_upper``); returns whether anything
        changed."""
        self.retire_removes.update(retired)
        return bool(retired)
