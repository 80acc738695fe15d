"""The state of one shard: what a version in consensus holds, and its commands.

A :class:`ShardState` is one version of a shard's metadata (Materialize's persist-client
``State``): its identity and Arrow schemas, the flattened Spine :class:`~persist.spine.Trace`
(which carries the shard's ``since`` and ``upper``), the leased readers with their since
holds, the writers, the records of the appends that landed (:mod:`persist.landed`: the
answer to "did this idempotency token's append land, and at which upper", kept apart
from the writer leases), and the counter of the shard's *retired* collection (blob keys a
compaction stopped referencing, waiting for GC, kept by consensus beside the state so that
the state stays small however many parts wait for their grace period).  Versions
are numbered by ``seqno``; consensus (:mod:`persist.consensus`) stores them.

Every state change is a named command, a method of :class:`ShardState` run by the
:class:`~persist.machine.ShardMachine` method of the same name on a private copy of the
latest known version (after Materialize's persist-client ``internal/state.rs``):
``compare_and_append``, ``commit_txn``, ``apply_merge_results`` (the one place
compaction results are applied), ``open_reader``, ``register_listen``,
``downgrade_since``, ``renew_reader``, ``detach``, ``expire_reader``,
``register_writer``, ``register_compactor``, ``renew_writers``, ``hand_off``,
``settle_handed_off``, ``expire_writer``, ``expire_leases``, ``register_schema``,
``finalize`` and ``forget_listed``.  A command takes plain values (many of them as an
:class:`~persist.commands.AppendCmd` or :class:`~persist.commands.TxnCmd`), the clock
reading ``now_ms`` and ``fresh`` (whether the version was just read from consensus); it
does no I/O (a fact only storage knows is asked for with
:class:`~persist.commands.NeedsInput`), raises :class:`Stale` where failing on a cached
version could be wrong, and otherwise raises before changing anything when it refuses.
The fields and the primitive changes commands combine are in :mod:`persist.state_base`;
the codec in :mod:`persist.state_codec`; the lease records in :mod:`persist.lease_state`.

Invariants kept here (every transition keeps them or raises before changing anything):

* ``since`` and ``upper`` are the trace's; ``upper`` only advances (the trace only takes
  the batch starting at its upper) and ``since`` only advances;
* while at least one reader is registered, the shard's ``since`` is ``<=`` the meet
  (the earliest) of the live readers' since holds: a reader's hold is never passed; a
  reader's hold only advances; a new reader's hold starts at the shard's since;
* a reader or writer whose last heartbeat is older than its lease duration is expired and
  dropped by :meth:`ShardState.expire_leases` (its hold stops holding the since back);
* a reader also holds a *seqno*: the oldest version it may still be reading; it only
  advances, never past the version it is written in, so GC never deletes a blob key a
  version at or after a live reader's seqno hold references; a *seqno-only* lease
  (:meth:`ShardState.detach_reader`) keeps its seqno hold but holds no since;
* a writer id is registered over one contiguous interval: a handle whose lease ran out
  is never registered again (GC may have deleted its parts), and an output of a
  compactor that is no longer live is never applied;
* a ``tombstone`` state (a finalized shard) is final: no handle may use the shard;
* an append or a transaction that commits records its token and fingerprint in the
  version that commits it, apart from every lease; a recorded token with another
  fingerprint is refused (``InvalidUsage``) by the commit itself; a command that
  decides a writer is gone (so that GC may delete its parts) decides it on a freshly
  read version, never on a cached one (a command that changes nothing publishes
  nothing, so no compare-and-set would catch a stale read);
* a transition that stops referencing blob keys lists them in ``retire_adds`` (blob key
  -> wall-clock ms; consensus records them with the seqno of the new version), one that
  lets GC forget deleted ones in ``retire_removes`` (row key -> ms); consensus
  writes them to the retired collection in the same atomic append as the new version and
  bumps ``retired_upper`` (that collection's upper) in it; these two maps are transient
  (never serialised, empty in every published version);
* the value schema is versioned: ``schema_history`` only grows, a
  version's id (its index) never changes, the newest is ``value_schema``, each version
  is a compatible evolution of the one before (:meth:`ShardState.register_schema`
  checks it and changes nothing when it raises), the key schema never changes; a part
  records the id it was written with (states without versions read as schema 0);
* the readable JSON forms round-trip exactly: :meth:`ShardState.to_entries` /
  :meth:`ShardState.from_entries` (one JSON value per component, so that consensus can
  store a new version as the few entries that changed) and :meth:`ShardState.to_json` /
  :meth:`ShardState.from_json` (one document, for ``persist inspect --json``).

Sources of the ideas: Materialize's early persist engine's ``AppliedState``
(``src/persist/src/indexed/``), the Spine's flattened trace
(``src/persist-client/src/internal/trace.rs``), the persist-client batch and lease handling
(``src/persist-client/src/batch.rs``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from persist import state_codec
from persist.commands import AppendCmd, Inputs, NeedsInput, TxnCmd
from persist.errors import BatchAppended, InvalidUsage, SinceViolation, UpperMismatch
from persist.fingerprint import check_same_append
from persist.keys import key_writer_id
from persist.landed import OutcomeUnknown
from persist.lease_state import (
    TOKEN_FOREIGN,
    TOKEN_LANDED,
    TOKEN_NOT_LANDED,
    TOKEN_SEP,
    TOKEN_UNKNOWN,
    WRITER_TOKENS_KEPT,
    ReaderState,
    WriterState,
    token_for,
)
from persist.spine import ApplyMergeResult, FueledMergeReq, FueledMergeRes, Trace
from persist.state_base import (
    SEQNO_ONLY,
    LeaseExpired,
    ShardStateBase,
    Stale,
    token_entry,
    token_verdict,
)
from persist.state_codec import schema_from_json, schema_to_json
from persist.types import Description, HollowBatch
from stash import Antichain

__all__ = [
    "SEQNO_ONLY",
    "TOKEN_FOREIGN",
    "TOKEN_LANDED",
    "TOKEN_NOT_LANDED",
    "TOKEN_SEP",
    "TOKEN_UNKNOWN",
    "WRITER_TOKENS_KEPT",
    "token_entry",
    "token_for",
    "token_verdict",
    "LeaseExpired",
    "ReaderState",
    "ShardState",
    "Stale",
    "WriterState",
    "schema_from_json",
    "schema_to_json",
]


@dataclass
class ShardState(ShardStateBase):
    """One version of a shard's state (the fields: :class:`ShardStateBase`).  Mutable:
    commands change it in place, so the machine runs them on a :meth:`clone` and
    publishes it by compare-and-set."""

    # --------------------------------------------------------------- commands
    # One method per command of persist.machine.ShardMachine (after Materialize's
    # persist-client internal/state.rs): each decides on this version alone, does no I/O,
    # raises Stale where failing on a cached version (``fresh`` false) may be wrong, and
    # raises before changing anything when it refuses.

    def open_reader(
        self,
        reader_id: str,
        now_ms: int,
        lease_ms: int,
        key_schema: pa.Schema,
        value_schema: pa.Schema,
        schema_id: int | None,
    ) -> int | None:
        """Register a read handle's reader (holding the shard's since); returns its
        schema id: ``schema_id`` if given, else the version of this state equal to
        ``value_schema`` (``None``: none is, or the key schema differs)."""
        self.register_reader(reader_id, now_ms, lease_ms, "read handle")
        if schema_id is not None or not self.key_schema.equals(key_schema):
            return schema_id
        return self.schemas().id_of(value_schema)

    def register_listen(
        self, reader_id: str, as_of: int, now_ms: int, lease_ms: int, fresh: bool
    ) -> bool:
        """Register a listen's reader holding ``as_of`` (returns ``True``: changed).

        Raises:
            Stale: ``as_of`` is before the since of a cached version.
            InvalidUsage: the shard was finalized.  SinceViolation: ``as_of`` is before
                the shard's since.
        """
        if not self.since.less_equal(as_of):
            if not fresh:
                raise Stale()
            self.check_not_finalized()  # a dropped shard's since is empty: say dropped
            raise SinceViolation(as_of, self.since)
        hold = Antichain.from_elem(as_of)
        self.register_reader(reader_id, now_ms, lease_ms, "listen", since=hold)
        return True

    def _reader_known(self, reader_id: str, fresh: bool) -> None:
        """Raise :class:`Stale` if the reader is absent from a cached version."""
        if reader_id not in self.readers and not fresh:
            raise Stale()

    def downgrade_since(
        self, reader_id: str, since: Antichain, now_ms: int, seqno: int | None, fresh: bool
    ) -> bool:
        """Move the reader's since hold to the join of its hold and ``since`` (an
        earlier ``since`` only renews the lease), as :meth:`downgrade_reader_since`.

        Raises:
            Stale: the reader is absent from a cached version.  LeaseExpired: absent.
        """
        self._reader_known(reader_id, fresh)
        target = self.reader(reader_id).since.join(since)
        return self.downgrade_reader_since(reader_id, target, now_ms, seqno)

    def renew_reader(self, reader_id: str, now_ms: int, seqno: int | None, fresh: bool) -> bool:
        """:meth:`heartbeat_reader`, asking for a fresh version first when the reader is
        absent from a cached one (:class:`Stale`; then :class:`LeaseExpired`).  Returns
        ``True`` (changed)."""
        self._reader_known(reader_id, fresh)
        self.heartbeat_reader(reader_id, now_ms, seqno)
        return True

    def detach(self, reader_id: str, now_ms: int, seqno: int | None, fresh: bool) -> bool:
        """:meth:`detach_reader`, asking for a fresh version first when the reader is
        absent from a cached one (:class:`Stale`; then :class:`LeaseExpired`).  Returns
        ``True`` (changed)."""
        self._reader_known(reader_id, fresh)
        self.detach_reader(reader_id, now_ms, seqno)
        return True

    def register_writer(
        self, writer_id: str, now_ms: int, lease_ms: int, registered: bool, fresh: bool
    ) -> bool:
        """Register or renew a writer (:meth:`heartbeat_writer`); one that registered
        before must still be live (it is never registered again: GC may have deleted
        its parts).  Returns ``True`` (changed).

        Raises:
            Stale: it is not live in a cached version.  LeaseExpired: not live.
        """
        if registered:
            try:
                self.check_writer_live(writer_id, now_ms)
            except LeaseExpired:
                if not fresh:
                    raise Stale() from None
                raise
        self.heartbeat_writer(writer_id, now_ms, lease_ms)
        return True

    def register_compactor(
        self,
        writer_id: str,
        fallback_id: str,
        renew: bool,
        now_ms: int,
        lease_ms: int,
        fresh: bool,
    ) -> str:
        """Register or renew a compactor's writer ``writer_id``; when renewing one whose
        lease ran out, register ``fallback_id`` instead (an id is never reused).
        Returns the id registered.

        Raises:
            Stale: the renewed writer is not live in a cached version.
        """
        wid = writer_id
        if renew and wid not in self.live_writers(now_ms):
            if not fresh:
                raise Stale()
            wid = fallback_id
        self.heartbeat_writer(wid, now_ms, lease_ms)
        return wid

    def _writers_live(self, writer_ids: Iterable[str], now_ms: int, fresh: bool) -> None:
        """Raise :class:`Stale` if one of ``writer_ids`` is absent from, or expired in,
        a cached version: a lease another process renewed, or a writer registered
        after the cache was read, is only seen on a fresh one.  (A command that changes
        nothing publishes nothing, so no compare-and-set would catch the stale read.)"""
        if not fresh:
            for wid in writer_ids:
                w = self.writers.get(wid)
                if w is None or w.expired(now_ms):
                    raise Stale()

    def renew_writers(
        self, writer_ids: Iterable[str], now_ms: int, fresh: bool = True
    ) -> tuple[bool, bool]:
        """Renew each live writer of ``writer_ids`` (:meth:`renew_writer`); returns
        ``(all renewed, any renewed)``.  A writer found gone is found so on a fresh
        version (:class:`Stale`)."""
        ids = tuple(writer_ids)
        self._writers_live(ids, now_ms, fresh)
        renewed = [self.renew_writer(w, now_ms) for w in ids]
        return all(renewed), any(renewed)

    def settle_handed_off(self, handed: Iterable[tuple[str, int]], fresh: bool = True) -> bool:
        """Count hand-offs ``(writer id, batches)`` down (:meth:`release_handed_off`);
        returns whether anything changed.  A writer absent from a cached version is
        looked for on a fresh one (:class:`Stale`)."""
        pairs = tuple(handed)
        if not fresh and any(w not in self.writers for w, n in pairs if n > 0):
            raise Stale()
        changed = [self.release_handed_off(w, n) for w, n in pairs]
        return any(changed)

    def hand_off(
        self, writer_id: str, now_ms: int, lease_ms: int, batches: int, fresh: bool = True
    ) -> tuple[bool, bool]:
        """:meth:`hand_off_writer`; returns ``(writer still registered, changed)``.  A
        writer gone or expired in a cached version is looked for on a fresh one (a
        holder of its batches may have renewed it: :class:`Stale`)."""
        if batches > 0:
            self._writers_live((writer_id,), now_ms, fresh)
        changed = self.hand_off_writer(writer_id, now_ms, lease_ms, batches)
        return writer_id in self.writers, changed

    def replace_batches(
        self, prefix: tuple[HollowBatch, ...], output: HollowBatch, now_ms: int, fresh: bool
    ) -> bool:
        """Replace the trace's oldest batches ``prefix`` (exactly as read by a full
        compaction) by ``output`` (their updates consolidated at a since ``<=`` this
        one, spanning exactly their bounds), keeping the batches after them; the blob
        keys and inline ids no longer referenced are retired at ``now_ms``, as
        :meth:`apply_merge_res` does.  Returns whether it was applied: ``False`` when
        the trace no longer starts with ``prefix`` (a merge or another full compaction
        won the race; nothing changes), or when ``output``'s writer is not live.

        Raises:
            Stale: the prefix does not match a cached version.
            InvalidUsage: ``output`` does not span ``prefix`` or its since is beyond
                this one (nothing changes).
        """
        current = self.batches()
        if tuple(current[: len(prefix)]) != prefix or not prefix:
            if not fresh:
                raise Stale()
            return False
        d = output.desc
        if d.lower != prefix[0].desc.lower or d.upper != prefix[-1].desc.upper:
            raise InvalidUsage(f"full compaction output {d} does not span its inputs")
        if not d.since <= self.since:
            raise InvalidUsage(f"full compaction output since {d.since} is beyond {self.since}")
        live = self.live_writers(now_ms)
        for p in output.parts:
            wid = None if p.key is None else key_writer_id(p.key)
            if wid is not None and wid not in live:
                return False
        before = self.referenced_part_ids()
        trace = Trace()
        trace.downgrade_since(self.since)
        trace.push_batch_no_merge_reqs(output)
        for b in current[len(prefix) :]:
            trace.push_batch_no_merge_reqs(b)
        self.trace = trace
        for key in before - self.referenced_part_ids():
            self.retire_adds[key] = now_ms
        return True

    def finalize(self, now_ms: int) -> bool:
        """Make this state a tombstone: upper and since the empty antichain, no batch,
        reader or writer; every blob key it referenced is retired at ``now_ms``.
        Idempotent; returns whether anything changed."""
        if self.tombstone:
            return False
        before = self.referenced_blob_keys()
        trace = Trace()
        trace.push_batch(HollowBatch(Description(trace.upper, Antichain())))
        trace.downgrade_since(Antichain())
        self.trace = trace
        self.readers.clear()
        self.writers.clear()
        self.tombstone = True
        for k in before:
            self.retire_adds[k] = now_ms
        return True

    def forget_listed(
        self, upper: int, rows: Mapping[str, int], done: Mapping[str, int] | None, fresh: bool
    ) -> bool:
        """Forget retired rows (:meth:`forget_retired`) given the retired collection's
        ``rows`` (row key -> ms) read at its ``upper``: those of ``done`` (rows GC
        deleted) still present with the same ms, or, with ``done`` ``None``, every row
        (finalize).  Returns whether anything changed.

        Raises:
            Stale: (``done`` ``None``) ``upper`` is not this cached version's.
        """
        if done is None:
            if upper != self.retired_upper and not fresh:
                raise Stale()
            return self.forget_retired(dict(rows))
        return self.forget_retired({k: ms for k, ms in done.items() if rows.get(k) == ms})

    def _apply_merges(
        self, results: Iterable[FueledMergeRes], now_ms: int
    ) -> tuple[list[ApplyMergeResult], bool]:
        """Apply compaction results (:meth:`apply_merge_res`); one already in the trace
        (applied by an earlier attempt) counts as ``APPLIED_EXACT`` and changes nothing.
        Returns ``(result per input, changed)``."""
        out: list[ApplyMergeResult] = []
        changed = False
        for res in results:
            if self.contains_batch(res.output):
                out.append(ApplyMergeResult.APPLIED_EXACT)
                continue
            r = self.apply_merge_res(res, now_ms)
            changed = changed or r.applied()
            out.append(r)
        return out, changed

    def apply_merge_results(
        self, results: Iterable[FueledMergeRes], now_ms: int, fresh: bool
    ) -> tuple[list[ApplyMergeResult], bool]:
        """Swap compaction results into the trace: the one place merge results are
        applied (the compactor, Spark's compaction job, and a writer's append carrying
        them).  Returns ``(result per input, changed)``.

        Raises:
            Stale: some result did not apply to a cached version.
        """
        rs, changed = self._apply_merges(results, now_ms)
        if not all(r.applied() for r in rs) and not fresh:
            raise Stale()
        return rs, changed

    def _check_copies(self, given: tuple[str, ...], inputs: Inputs) -> None:
        """No given part may be referenced by, or retired from, this version, and the
        parts must have been listed at its ``retired_upper`` (see
        :mod:`persist.appended`).

        Raises:
            BatchAppended: naming a part already appended.  NeedsInput: the retired
                part ids or a listing of the parts at this version are needed.
        """
        if not given:
            return
        again = [k for k in given if self.trace.references_part(k)]
        if not again and self.retired_upper > 0:
            if inputs.retired is None or inputs.retired[0] != self.retired_upper:
                raise NeedsInput("retired", self.retired_upper)
            again = [k for k in given if k in inputs.retired[1]]
        if again:
            raise BatchAppended(self.shard_id, again)
        if inputs.listed_upper != self.retired_upper:
            raise NeedsInput("parts", self.retired_upper)

    def _check_owners(
        self,
        writer_id: str,
        registered: bool,
        owners: Iterable[str],
        now_ms: int,
        fresh: bool,
        wrap: bool,
    ) -> None:
        """Every owner (and the writer, once registered) must be live at ``now_ms``.

        Raises:
            Stale: one is not live in a cached version.  LeaseExpired: not live (for
                another owner than the writer, with ``wrap``, naming it as the writer
                of an appended batch).
        """
        need = set(owners)
        if registered:
            need.add(writer_id)
        for wid in sorted(need):
            try:
                self.check_writer_live(wid, now_ms)
            except LeaseExpired as e:
                if not fresh:
                    raise Stale() from None
                if wid == writer_id or not wrap:
                    raise
                raise LeaseExpired(self.shard_id, wid, "writer of an appended batch") from e

    def compare_and_append(
        self, cmd: AppendCmd, inputs: Inputs, now_ms: int, fresh: bool
    ) -> tuple[list[FueledMergeReq], bool]:
        """Append ``cmd.pieces`` if the shard's upper is ``cmd.expected`` (Materialize's
        ``compare_and_append``); returns ``(the Spine's merge requests, changed)``.  An
        append whose token this version records already landed (no change).

        Raises:
            Stale: a check failed on a cached version.  InvalidUsage: finalized.
            UpperMismatch: the upper differs.  BatchAppended, NeedsInput: see
            :meth:`_check_copies`.  LeaseExpired: a writer is not live.
            SchemaMismatch: see :meth:`append_batch`.
        """
        entry = token_entry(self, cmd.writer_id, cmd.token)
        if entry is not None:
            if entry != cmd.recorded:  # the token names another append (InvalidUsage)
                fingerprint = cmd.recorded.partition(TOKEN_SEP)[2]
                check_same_append(entry, cmd.token, fingerprint, cmd.earlier)
            return [], False  # committed by an attempt whose outcome was indeterminate
        self.check_not_finalized()
        if self.upper != cmd.expected:
            if not fresh:
                raise Stale()
            if (
                inputs.maybe_landed
                and cmd.pieces
                and token_verdict(self, cmd.token, cmd.lo)[0] != TOKEN_NOT_LANDED
            ):
                # An earlier attempt may have landed and its record been pruned: the
                # upper moved, perhaps by that very append (never UpperMismatch for it).
                raise OutcomeUnknown(cmd.token, self.shard_id)
            raise UpperMismatch(cmd.expected, self.upper)
        if not cmd.pieces:
            return [], False
        self._check_copies(cmd.given, inputs)
        self._check_owners(cmd.writer_id, cmd.registered, cmd.owners, now_ms, fresh, True)
        self._apply_merges(cmd.merges, now_ms)
        reqs: list[FueledMergeReq] = []
        for hb in cmd.pieces:
            reqs.extend(self.append_batch(hb, cmd.writer_id, now_ms, cmd.lease_ms))
        self.record_landed(cmd.recorded, now_ms)
        for k in cmd.consumed:  # truncated copies: a later copy is refused
            if not self.trace.references_part(k):
                self.retire_adds[k] = now_ms
        self.settle_handed_off(cmd.handed)
        return reqs, True

    def commit_txn(
        self, cmd: TxnCmd, inputs: Inputs, now_ms: int, fresh: bool
    ) -> tuple[tuple[str, Any], bool]:
        """This shard's part of a transaction committing at ``cmd.ts``: returns
        ``(("landed", ts), False)`` when its token is recorded (an earlier attempt
        committed at ``ts``), ``(("mismatch", (upper, retryable)), False)`` when the
        upper is past ``ts`` (``retryable``: a later ts may fix it), else
        ``(("ok", merge requests), True)``.

        Raises:
            Stale: a writer is not live in a cached version.  InvalidUsage: finalized.
            BatchAppended, NeedsInput: see :meth:`_check_copies`.  LeaseExpired.
        """
        entry = token_entry(self, cmd.record_id, cmd.token)
        if entry is not None:
            _, _, fp = entry.partition(TOKEN_SEP)
            return ("landed", int(fp[1:]) if fp.startswith("t") else cmd.ts), False
        self.check_not_finalized()
        if not self.upper.less_equal(cmd.ts):
            return ("mismatch", (self.upper, True)), False
        if cmd.timed_lo is not None and not self.upper.less_equal(cmd.timed_lo):
            return ("mismatch", (self.upper, False)), False  # no later ts fixes it
        self._check_copies(cmd.given, inputs)
        self._check_owners(cmd.writer_id, cmd.registered, cmd.owners, now_ms, fresh, False)
        pieces = cmd.pieces(self.upper)
        reqs: list[FueledMergeReq] = []
        for hb in pieces:
            reqs.extend(self.append_batch(hb, cmd.writer_id, now_ms, cmd.lease_ms))
        # The builder's writer is registered (or renewed) as by a normal append; the
        # token is recorded apart from it (persist.landed), with the commit time.
        self.heartbeat_writer(cmd.writer_id, now_ms, cmd.lease_ms)
        self.record_landed(f"{cmd.token}{TOKEN_SEP}t{cmd.ts}", now_ms)
        self.settle_handed_off(cmd.handed)
        # Record ids of acknowledged transactions are no longer needed: drop them.
        for d in cmd.done:
            self.writers.pop(d, None)
        return ("ok", reqs), True

    # ------------------------------------------------------------------- JSON

    def to_entries(self) -> dict[str, Any]:
        """The state flattened into one JSON value per component, keyed by a path
        (:func:`persist.state_codec.to_entries`)."""
        return state_codec.to_entries(self)

    def to_entries_delta(
        self, old: ShardState, old_entries: Mapping[str, Any]
    ) -> tuple[dict[str, Any], set[str]]:
        """:meth:`to_entries`, made from ``old``'s entries ``old_entries`` in time
        proportional to what changed, with the keys that may differ
        (:func:`persist.state_codec.to_entries_delta`)."""
        return state_codec.to_entries_delta(old, old_entries, self)

    @classmethod
    def from_entries(cls, entries: Mapping[str, Any]) -> ShardState:
        """Inverse of :meth:`to_entries`.

        Raises:
            PersistError: an entry is missing or malformed.
        """
        return cls(**state_codec.from_entries(entries))

    @classmethod
    def from_entries_delta(
        cls, prev: ShardState, entries: Mapping[str, Any], changed: Collection[str]
    ) -> ShardState:
        """:meth:`from_entries` of a newer version of ``prev``'s entries that differs
        from them at the keys ``changed`` only, decoding only those and sharing every
        other component with ``prev`` (:func:`persist.state_codec.from_entries_delta`).

        Raises:
            PersistError: an entry is missing or malformed, or the changes do not fit
                ``prev``.
        """
        return cls(**state_codec.from_entries_delta(prev, entries, changed))

    def to_json(self) -> dict[str, Any]:
        """One readable JSON document of this version (for inspection)."""
        return state_codec.to_json(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ShardState:
        """Inverse of :meth:`to_json`.

        Raises:
            PersistError: the document is malformed.
        """
        return cls(**state_codec.from_json(d))
