"""Writing a shard: compare-and-append of updates or of pre-written batches.

A :class:`WriteHandle` appends to one shard (the persist-client ``WriteHandle``).  An
append writes the batch's parts to blob *first* (or keeps a small batch inline, in the
state itself: Materialize's inline writes, ``src/persist-client/src/batch.rs``), then
commits the new state version by compare-and-set in consensus.

The walk of an append, one step after the other, each a call into a lower module that
never calls back into this one (but for the writer's registration before its first
upload, handed down as a plain function, step 2):

1. validate and plan: the bounds and the updates' times (:mod:`persist.batch_rules`:
   ``append_bounds``, ``check_times``; ``check_batches``, ``validate_truncate``,
   ``check_appendable`` and ``plan_pieces`` for batches; none of them for the one batch
   ``compare_and_append`` just wrote, :func:`fresh_alone`), the idempotency token
   (:mod:`persist.idempotency`) and the append's fingerprint (:mod:`persist.fingerprint`;
   for updates of many rows hashed in the shared pool, :func:`persist.pool.in_background`,
   while step 2 writes their parts, and awaited before the commit);
2. write parts: :meth:`persist.builder.RunWriter.write_run`, through
   :func:`persist.parts.write_parts` (given the handle's ``_ensure_registered`` as its
   ``before_upload`` function: the writer registers in the shard state before its
   first upload);
3. commit: :meth:`persist.machine.ShardMachine.compare_and_append` of an
   :class:`~persist.commands.AppendCmd`, re-applied while its outcome is unknown
   (:func:`persist.idempotency.apply_resolving`; given
   :func:`persist.batch_rules.check_appendable` as a plain function, to list the given
   parts again once a GC may have forgotten some);
4. maintenance: the compaction requests the command returned go to
   ``ctx.maintenance.after_append`` (:mod:`persist.maintenance`).

Invariants kept here (the batch rules, the builder's and the tokens' own are in
:mod:`persist.batch_rules`, :mod:`persist.builder` and :mod:`persist.idempotency`):

* every ``_time`` of an append lies in ``[expected_upper, new_upper)``, else
  ``UpdateNotBeyondLower`` / ``UpdateBeyondUpper`` and nothing is written anywhere;
* ``compare_and_append`` commits atomically or raises ``UpperMismatch`` (``.expected``,
  ``.current``) with nothing visible; the parts it had written are then deleted;
* a lost race on the seqno with the upper still matching (a reader, a compactor or GC
  changed the state) is retried on the metadata only: parts are uploaded once per batch,
  however many compare-and-set attempts the commit needs;
* ``compare_and_append_batch`` follows Materialize's ``validate_truncate_batch``
  (:mod:`persist.batch_rules`): only the batches' updates in ``[expected_upper,
  new_upper)`` become visible;
* an indeterminate commit (the stash lost the acknowledgement of COMMIT) is resolved by
  the append itself: it re-applies the same version, with the same idempotency token,
  re-reading consensus with backoff, until it learns the outcome.  The token is
  recorded, with the append's fingerprint, in the shard's landed records
  (:mod:`persist.landed`), apart from every writer lease: a writer's expiry, a process
  whose clock is ahead, or other appends through a shared handle never drop it.  An
  append of its own that landed is reported as success, never as ``UpperMismatch``;
  one whose record may have been pruned (the shard keeps the newest records) raises the
  indeterminate ``ConsensusError``.  If the outcome cannot be learned, a
  ``ConsensusError`` with ``is_indeterminate()`` and ``idempotency_token`` is raised
  and the parts are left in place (GC collects them if the append did not land); a
  retry passing that token, from this process or a restarted one, returns success
  without writing again if the append landed, appends if it did not, and raises the
  indeterminate error again if the records cannot tell;
* a writer is registered in the shard state (its lease) before its first upload, and
  its parts' keys name it (:mod:`persist.keys`), stamped when each run is written; GC
  never deletes the parts of a writer registered in the state it decides on (it
  commits the expiry of the others first, :mod:`persist.gc`); a writer dropped from the
  state is never registered again, and an append refuses, committing nothing, a
  batch whose parts are gone (``PartsMissing``) or when this writer, or one whose
  parts it references, is not registered and live in the version it commits on
  (``LeaseExpired``): decided on that version, never on a cached one; a batch held
  unconsumed, or a builder holding uploaded parts, keeps the leases of its parts'
  writers alive in the background (:meth:`WriteHandle.hold`, every quarter lease,
  through the handle's :attr:`WriteHandle.lease_keeper`), so it stays appendable however
  long it is held; a writer already gone is never renewed; a handle that expires with
  batches it handed out and did not append hands its writer off (kept for the client's
  ``handoff_lease_seconds``, counted down by each append of those batches, dropped at
  zero), so bytes in transit stay appendable too;
* a part is appended once: an append pushing, as they are, parts the version it
  commits on references (or retired) is refused (``BatchAppended``), so a batch's
  transmittable bytes decoded twice never count twice, across calls as within one
  (parts named by blob key or inline nonce; a copy racing a GC is refused, never
  committed pointing at deleted parts: see :mod:`persist.appended`);
* an idempotency token names one append exactly, its bounds and contents
  (:mod:`persist.fingerprint`): a token reused on another append is refused
  (``InvalidUsage``), never taken for a landed retry.

Row-level changes (:meth:`WriteHandle.upsert`, :meth:`~WriteHandle.delete`,
:meth:`~WriteHandle.update`) read the live rows of a freshly read state through
:func:`persist.rows_read.read_live_rows` (parts and row groups pruned by statistics), are planned by
:mod:`persist.rows` and committed by :meth:`WriteHandle.compare_and_append` at that
state's upper; :func:`persist.rows.apply_change` re-reads and re-plans on a lost race.

Sources: the persist-client ``WriteHandle`` (Materialize's
``src/persist-client/src/write.rs``) and its ``compare_and_append`` through
``src/persist-client/src/internal/machine.rs``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import pyarrow as pa

from persist import metrics as persist_metrics
from persist.batch import Batch
from persist.batch_rules import (
    append_bounds,
    assemble,
    check_appendable,
    check_batches,
    check_times,
    handed_off_owners,
    materialize,
    plan_pieces,
    validate_truncate,
)
from persist.builder import BatchBuilder, RunWriter, Updates, time_range
from persist.commands import AppendCmd
from persist.errors import BatchAppended, InvalidUsage, PersistError
from persist.fingerprint import batches_fingerprint, updates_fingerprint
from persist.idempotency import (
    TokenSource,
    apply_resolving,
    carrying_token,
    checked_token,
    token_floor,
    token_landed,
    tokens,
)
from persist.keys import key_writer_id
from persist.lease import DEFAULT_KEEPER, LeaseKeeper
from persist.lease_state import TOKEN_SEP
from persist.machine import ShardMachine
from persist.pool import Background, in_background
from persist.spine import FueledMergeRes, worth_compacting
from persist.types import Description, HollowBatch, as_frontier
from persist.write_rows import RowChangeMethods
from stash import Antichain

if TYPE_CHECKING:
    from persist.context import PersistContext

__all__ = ["BatchBuilder", "WriteHandle", "handed_off_owners"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Updates of at least this many rows are fingerprinted in the shared pool, while their
#: parts are written; smaller ones in the caller's thread (a thread hop costs tens of
#: microseconds, about what hashing a few hundred rows does).
_BACKGROUND_FINGERPRINT_ROWS = 4096

# The names this module held before its split, for their importers.
_TokenSource = TokenSource
_tokens = tokens
_token = checked_token
_carrying_token = carrying_token
_time_range = time_range


class AppendPlan(NamedTuple):
    """What an append of batches pushes and gives the shard (the fields of its
    :class:`~persist.commands.AppendCmd` that its batches decide): the hollow batches
    to push, the temporary batches written to rewrite some (deleted if it fails), the
    ids of the given parts it pushes, the writers whose parts they are, the other
    writers' hand-offs it counts down, and the given parts it retires."""

    pieces: tuple[HollowBatch, ...]
    temps: list[Batch]
    given: tuple[str, ...]
    owners: frozenset[str]
    handed: tuple[tuple[str, int], ...]
    consumed: tuple[str, ...]


def fresh_alone(
    batches: Sequence[Batch],
    fresh: Batch | None,
    expected: Antichain,
    new: Antichain,
    appender: str,
) -> AppendPlan | None:
    """The :class:`AppendPlan` of an append ``[expected, new)`` whose only batch is
    ``fresh``, the batch :meth:`WriteHandle.compare_and_append` just wrote: one run
    (or none) described exactly ``[expected, new)``, of updates in that range, never
    rewritten nor appended: it pushes ``fresh``'s own hollow batch, gives no part (its
    parts are new) and counts down no hand-off but those of parts of other writers than
    ``appender`` (none: its parts are the appender's).  What the batch rules and
    :meth:`WriteHandle._plan_batches` make of it, without their passes (a differential
    test checks they agree); ``None`` for any other append (planned in full)."""
    if fresh is None or len(batches) != 1 or batches[0] is not fresh:
        return None
    hb = fresh.hollow
    d = hb.desc
    rng = fresh.time_range
    if (
        fresh.rewritten
        or fresh.consumed
        or hb.runs
        or (hb.len == 0) != (not hb.parts)
        or d.lower != expected
        or d.upper != new
        or d.since != _MINIMUM_SINCE
        or (rng is not None and (not expected.less_equal(rng[0]) or new.less_equal(rng[1])))
    ):
        return None
    owners = frozenset(w for p in hb.parts if p.key is not None and (w := key_writer_id(p.key)))
    handed = tuple((w, 1) for w in owners if w != appender)
    return AppendPlan((hb,), [], (), owners, handed, ())


#: The since of a new batch's description (:class:`~persist.types.Description`'s default).
_MINIMUM_SINCE = Description(Antichain.from_elem(0), Antichain.from_elem(1)).since


class WriteHandle(RowChangeMethods):
    """A writer of one shard.  Made by :meth:`persist.client.PersistClient.open`.

    Attributes:
        shard_id: the shard's id.  name: its registered name.
        writer_id: this writer's id in the shard state.
        key_schema, value_schema: the shard's schemas; ``schema`` the updates schema.
        runs: the :class:`~persist.builder.RunWriter` writing this writer's parts.
    """

    role = "writer"

    def __init__(
        self,
        ctx: PersistContext,
        machine: ShardMachine,
        name: str,
        writer_id: str,
        key_schema: pa.Schema,
        value_schema: pa.Schema,
        lease_seconds: float,
    ) -> None:
        super().__init__(ctx, machine, name, writer_id, key_schema, value_schema, lease_seconds)
        self.writer_id = writer_id
        # Writer lease (persist.gc): registered before the first upload; once
        # registered, a writer found missing or expired is never registered again.
        self._registered = False
        self._last_heartbeat_ms = 0
        self.runs = RunWriter(
            ctx.blob,
            ctx.config,
            machine,
            name,
            key_schema,
            value_schema,
            writer_id,
            before_upload=self._ensure_registered,
        )
        self._lent = 0  # builders handed out whose batch this handle has not appended
        # Batches of its builders, with blob parts, transmitted to another process.
        self._transmitted = 0

    # ---------------------------------------------------------------- frontiers
    @property
    def upper(self) -> Antichain:
        """The most recent upper this process knows of (no consensus call)."""
        return self._machine.state().upper

    # -------------------------------------------------------------------- lease
    #: Runs the background renewals of :meth:`hold` (tests inject one with a clock).
    lease_keeper: LeaseKeeper = DEFAULT_KEEPER

    def hold(self, holder: object, owners: Sequence[str], alive: Callable[[], bool]) -> int:
        """Keep the leases of the writers ``owners`` alive while ``holder`` (a batch or
        a builder holding their parts) lives and ``alive()`` is true: every quarter of
        the shortest of their leases (and of this handle's), a transition renews each
        one still live (:meth:`ShardState.renew_writer`); the parts of a live writer
        are never deleted by GC.  The renewal stops when ``holder`` is garbage-collected,
        ``alive()`` turns false, an owner is found gone or expired (it is never brought
        back: its parts may be deleted, and the append then raises ``LeaseExpired``), or
        the client is closed.  A failed renewal (the stash is down) is tried again at the
        next interval.  Returns the registration id in :attr:`lease_keeper` (unregister
        it to stop earlier).  Source of the idea: persist-client, where whoever holds a
        batch keeps its writer's lease (``src/persist-client/src/batch.rs``).
        """
        wids = tuple(sorted(set(owners)))
        keeper = self.lease_keeper
        machine = self._machine
        ctx = self._ctx
        ref = weakref.ref(holder)
        st = machine.state()
        lease = min(
            [self._lease_ms] + [st.writers[w].lease_duration_ms for w in wids if w in st.writers]
        )

        def beat() -> bool:
            if ref() is None or not alive() or ctx.closed:
                return False
            return machine.renew_writers(wids)

        ident = keeper.register(
            f"holder of {len(wids)} writer(s)' parts in shard {self.shard_id}",
            max(lease / 4000, 0.001),
            beat,
        )
        weakref.finalize(holder, keeper.unregister, ident)
        return ident

    def release_hold(self, ident: int) -> None:
        """Stop the renewals of :meth:`hold` registration ``ident``."""
        self.lease_keeper.unregister(ident)

    def _hold_batch(self, batch: Batch) -> Batch:
        """:meth:`hold` the owners of ``batch``'s blob parts until it is consumed."""
        owners = [w for k in batch.blob_keys() if (w := key_writer_id(k)) is not None]
        if owners and not batch.consumed:
            ident = self.hold(batch, owners, lambda: True)
            keeper = self.lease_keeper
            batch._on_consumed = partial(keeper.unregister, ident)
        return batch

    def heartbeat(self) -> None:
        """Register this writer in the shard state, or renew its lease.  The parts of a
        live writer are never deleted by GC, whatever their age; those of a writer whose
        lease ran out may be.  A batch or builder holding parts renews their writers'
        leases by itself (:meth:`hold`).

        Raises:
            LeaseExpired: the lease already ran out (or the writer was expired): this
                handle can append nothing any more; open a new writer.
            ConsensusError: the stash failed.
        """
        self._check()
        now = self._machine.now_ms()
        # Resolves a lost acknowledgement (registering is idempotent).
        self._apply_resolving(
            partial(
                self._machine.register_writer,
                self.writer_id,
                now,
                self._lease_ms,
                self._registered,
            )
        )
        self._registered = True
        self._last_heartbeat_ms = now

    def _ensure_registered(self) -> None:
        """Called before an upload: register the writer, or renew a lease past a
        quarter of its duration."""
        if not self._registered or (
            self._machine.now_ms() - self._last_heartbeat_ms > self._lease_ms // 4
        ):
            self.heartbeat()

    def builder(self, lower: Antichain | int) -> BatchBuilder:
        """A :class:`BatchBuilder` for a batch starting at ``lower``."""
        self._check()
        b = BatchBuilder(self, as_frontier(lower, "lower"))
        self._lent += 1
        return b

    def batch(self, updates: Updates, lower: Antichain | int, upper: Antichain | int) -> Batch:
        """Write ``updates`` as a batch ``[lower, upper)`` without appending it.

        Raises:
            InvalidBounds, UpdateNotBeyondLower, UpdateBeyondUpper, InvalidUsage;
            BlobError (nothing is left behind but garbage for GC).
        """
        b = self.builder(lower)
        b.add(updates)
        return b.finish(upper)

    def batch_from_transmittable(self, data: bytes) -> Batch:
        """Turn :meth:`Batch.into_transmittable` bytes back into a :class:`Batch`.

        Raises:
            InvalidUsage: malformed bytes, or a batch written for another shard.
        """
        b = Batch.from_transmittable(self._ctx.blob, data)
        if b.shard_id != self.shard_id:
            raise InvalidUsage(
                f"transmitted batch was written for shard {b.shard_id}, not {self.shard_id}"
            )
        handed = handed_off_owners([b], self.writer_id)
        if handed:
            b._on_delete = partial(self._settle_handed_off, handed)
        return self._hold_batch(b)

    def handed_out(self, batch: Batch) -> Batch:
        """A batch a builder of this handle finished: its parts' writers' leases are
        held until it is consumed, and its transmission is counted (see
        :meth:`expire`)."""
        if batch.blob_keys():
            batch._on_transmit = self._count_transmitted
        return self._hold_batch(batch)

    def builder_aborted(self) -> None:
        """A builder of this handle was aborted: no batch of it will travel."""
        self._lent = max(0, self._lent - 1)

    def _settle_handed_off(self, handed: dict[str, int]) -> None:
        """A decoded batch is deleted instead of appended: count it down from its
        writers' hand-off (best effort: if the stash fails, the hand-off lease runs out
        by itself)."""
        try:
            self._machine.settle_handed_off(tuple(handed.items()))
        except PersistError as e:
            log.warning(
                "could not settle the hand-off of a deleted batch in shard %s: %s",
                self.shard_id,
                e,
                extra={"shard": self.shard_id},
            )

    @persist_metrics.timed_append
    def compare_and_append(
        self,
        updates: Updates,
        expected_upper: Antichain | int,
        new_upper: Antichain | int,
        *,
        idempotency_token: str | None = None,
    ) -> None:
        """Append ``updates`` if the shard's upper is ``expected_upper``, advancing it to
        ``new_upper``; atomically.

        Args:
            updates: a ``pyarrow.Table``/``RecordBatch`` or ``((key, value), time, diff)``
                rows.
            expected_upper, new_upper: frontiers (or int times).
            idempotency_token: the token of an earlier attempt of this same append (from
                the ``idempotency_token`` of the indeterminate :class:`ConsensusError` it
                raised): if that attempt landed, this call returns at once, writing
                nothing again, however many appends came since and whatever became of
                the writer (the shard keeps the record apart from its lease,
                :mod:`persist.landed`); if it did not land, this call appends; if whether
                it landed can no longer be told (its record may have been pruned), it
                raises an indeterminate :class:`ConsensusError` and writes nothing.  The token names that append exactly (its bounds and
                its updates in their order, :mod:`persist.fingerprint`): passed to any
                other append it raises ``InvalidUsage`` and writes nothing.  By
                default a fresh token.

        Raises:
            InvalidBounds: ``expected_upper`` is not ``<= new_upper``.
            UpdateNotBeyondLower / UpdateBeyondUpper: a ``_time`` outside
                ``[expected_upper, new_upper)``.
            UpperMismatch: the shard's upper is not ``expected_upper`` (``.current``
                tells what it is); nothing was committed.  Never raised for an append
                of this call that landed (its own indeterminate commit is resolved).
            InvalidUsage: bad schema or columns, a malformed token, or a token of
                another append.
            DiffOverflow: the diffs of one row sum beyond int64 (nothing written).
            LeaseExpired: this writer is not registered in the version it commits on
                (GC or another process expired it); nothing was committed.
            BlobError, ConsensusError: storage failed; nothing was committed unless the
                error says ``is_indeterminate()``; then ``idempotency_token`` is set on it
                and a retry passing it stays idempotent.
        """
        # 1. validate and plan
        self._check()
        expected, new = append_bounds(expected_upper, new_upper)
        token = checked_token(idempotency_token, self.writer_id, self._machine.state().seqno)
        table = self.runs.normalize(updates)
        rng = check_times(table, expected, new)
        retry = idempotency_token is not None
        hashing: Background[str] | None = None
        # This append's fingerprint in another version: a record made before the
        # current one is checked against it (persist.fingerprint.check_same_append).
        earlier = partial(updates_fingerprint, expected, new, table)
        if retry or expected == new or table.num_rows < _BACKGROUND_FINGERPRINT_ROWS:
            fingerprint = updates_fingerprint(expected, new, table)
        else:
            # Needed only by the commit: hashed in the shared pool while the parts are
            # sorted and encoded (xxhash and pyarrow release the GIL).
            hashing = in_background(partial(updates_fingerprint, expected, new, table))
        seen: int | None = None
        if retry:
            landed, seen = self._token_landed(token, fingerprint, earlier)
            if landed:
                return  # an earlier attempt landed: write nothing again
        if expected == new:
            # Nothing can be written into an empty range: just check the upper.
            self._append_batches(
                [], expected, new, token, fingerprint=fingerprint, seen=seen, earlier=earlier
            )
            return
        # 2. write parts
        try:
            with carrying_token(token):
                run = self.runs.write_run(table, self.schema_id)
        except BaseException:
            if hashing is not None:
                hashing.wait()  # no work of this call goes on after it
            raise
        hollow = HollowBatch(
            desc=Description(expected, new),
            parts=tuple(run),
            len=sum(p.rows for p in run),
        )
        batch = Batch(self._ctx.blob, self.shard_id, hollow, time_range=rng)
        if hashing is not None:
            try:
                fingerprint = hashing.result()
            except BaseException:
                batch.delete()  # nothing was committed: the parts are garbage
                raise
        # 3. commit and 4. maintenance
        try:
            self._append_batches(
                [batch],
                expected,
                new,
                token,
                retry,
                fresh=batch,
                fingerprint=fingerprint,
                seen=seen,
                earlier=earlier,
            )
        except PersistError as e:
            if not e.is_indeterminate():
                batch.delete()
            raise

    def append(self, updates: Updates, lower: Antichain | int, upper: Antichain | int) -> None:
        """Append ``updates`` at ``[lower, upper)``: the shard's upper must be ``lower``
        (the persist-client ``append``; same errors as :meth:`compare_and_append`)."""
        self.compare_and_append(updates, lower, upper)

    def _normalize(self, updates: Updates) -> pa.Table:
        """``updates`` as a table of exactly :attr:`schema`
        (:meth:`persist.builder.RunWriter.normalize`)."""
        return self.runs.normalize(updates)

    def _check_appendable(self, batches: Sequence[Batch], fresh: Batch | None) -> set[str]:
        """The writers whose parts ``batches`` reference, every blob part of them (but
        ``fresh``'s) checked to exist (:func:`persist.batch_rules.check_appendable`).

        Raises:
            PartsMissing: a part is not in the blob store (nothing is committed).
        """
        return check_appendable(self._ctx.blob, self.shard_id, batches, fresh)

    def _assemble(
        self,
        batches: Sequence[Batch],
        expected: Antichain,
        new: Antichain,
        sources: list[str] | None = None,
    ) -> tuple[list[HollowBatch], list[Batch]]:
        """The hollow batches to push for an append ``[expected, new)`` of ``batches``
        and the temporary batches written for them (:func:`persist.batch_rules.assemble`,
        rewriting with :func:`persist.batch_rules.materialize`)."""
        return assemble(batches, expected, new, self._rewriter(expected, new), sources)

    def _rewriter(self, expected: Antichain, new: Antichain) -> Callable[[Batch], Batch]:
        """The physical rewrite of a batch for an append ``[expected, new)``."""
        machine, runs = self._machine, self.runs
        return lambda b: materialize(b, expected, new, machine, runs)

    @persist_metrics.timed_append
    def compare_and_append_batch(
        self,
        batches: Sequence[Batch],
        expected_upper: Antichain | int,
        new_upper: Antichain | int,
        *,
        idempotency_token: str | None = None,
    ) -> None:
        """Append pre-written batches if the shard's upper is ``expected_upper``,
        advancing it to ``new_upper``; atomically.

        Materialize's batch rules (``validate_truncate_batch``): each batch must *cover*
        the append, ``batch.lower <= expected_upper`` and ``new_upper <= batch.upper``;
        its updates outside ``[expected_upper, new_upper)`` are truncated away.  If any
        batch was rewritten (:meth:`Batch.rewrite_ts`), every batch must have ``upper ==
        new_upper`` and a rewrite frontier (or lower) ``>= expected_upper``.  On success
        the batches are consumed; on ``UpperMismatch`` they are untouched (the caller may
        retry them, e.g. after :meth:`Batch.rewrite_ts`, without any upload).

        An indeterminate commit (the stash lost the acknowledgement) is resolved here:
        the same version, with the same idempotency token, is re-applied (re-reading
        consensus with backoff) until its outcome is known, so this call never reports
        as a lost race an append of its own that landed.

        Args:
            idempotency_token: see :meth:`compare_and_append`.

        Raises:
            InvalidBounds, InvalidBatchBounds, InvalidRewrite, InvalidUsage (a batch of
            another shard, or already consumed; two batches sharing a part, e.g. two
            decodings of one batch's bytes), BatchAppended (a copy of a batch the
            shard already references or did before a compaction: another decoding of
            its transmittable bytes, named by its parts' blob keys and inline parts'
            nonces, checked on the version committed on and the ids it retired;
            an inline part is recognised until GC forgets its retired id, see
            :mod:`persist.appended`; nothing committed, the copy is marked consumed),
            PartsMissing (a part is not in the blob store, checked before the
            transition and again in it once a GC may have deleted retired parts),
            LeaseExpired (this writer, or one whose parts a batch holds, is not
            registered and live in the version committed on), UpperMismatch,
            ConsensusError (see
            :meth:`compare_and_append`; an indeterminate one carries
            ``idempotency_token``, and the batches stay unconsumed for a retry).
        """
        self._check()
        expected, new = append_bounds(expected_upper, new_upper)
        if idempotency_token is None:
            # The same batches retried after an unknown outcome: the same token, so an
            # attempt that landed is recognised (never appended twice, never a race).
            pending = {getattr(b, "pending_token", None) for b in batches}
            if len(pending) == 1:
                idempotency_token = pending.pop()
        token = checked_token(idempotency_token, self.writer_id, self._machine.state().seqno)
        with carrying_token(token):
            self._append_batches(batches, expected, new, token, idempotency_token is not None)

    def _append_batches(
        self,
        batches: Sequence[Batch],
        expected: Antichain,
        new: Antichain,
        token: str,
        retry: bool = False,
        fresh: Batch | None = None,
        fingerprint: str | None = None,
        seen: int | None = None,
        earlier: Callable[[str], str] | None = None,
    ) -> None:
        """:meth:`compare_and_append_batch` after its arguments were converted;
        ``retry``: the token came from the caller (an earlier attempt may have landed);
        ``fresh``: a batch whose parts this call just wrote (not checked for existence,
        not one this writer lent out); ``seen``: the seqno of a state the caller already
        found not to record the retried token (:meth:`_token_landed`); ``earlier``: the
        append's ``fingerprint`` in another version (see
        :func:`persist.fingerprint.check_same_append`)."""
        # 1. validate and plan (persist.batch_rules): a batch this call just wrote
        # from updates in [expected, new) alone has nothing to check or rewrite.
        only_fresh = fresh_alone(batches, fresh, expected, new, self.writer_id)
        if only_fresh is None:
            check_batches(batches, self.shard_id)
            validate_truncate(batches, expected, new)
        if fingerprint is None:  # the batches' parts (the same in copies and retries)
            fingerprint = batches_fingerprint(expected, new, batches)
        machine = self._machine
        # Any attempt of this append lands after version ``lo`` (persist.landed).
        lo = token_floor(machine, token)
        if retry and seen is None:
            landed, seen = self._token_landed(token, fingerprint, earlier)
            if landed:
                for b in batches:  # an earlier attempt landed them
                    b.mark_consumed()
                return
        if seen is not None:
            lo = seen  # no attempt landed at or before the version read
        # The retired collection's upper in a version read before the existence check:
        # the copy check of the commit re-lists the parts once a GC may have forgotten
        # some.
        checked_upper = machine.state().retired_upper
        plan = only_fresh or self._plan_batches(batches, expected, new, fresh)
        # Compaction results offered by the compactor ride along in this version.
        merges = machine.take_merge_results() if plan.pieces else []
        cmd = AppendCmd(
            writer_id=self.writer_id,
            token=token,
            recorded=f"{token}{TOKEN_SEP}{fingerprint}",
            earlier=earlier,
            expected=expected,
            pieces=plan.pieces,
            lease_ms=self._lease_ms,
            registered=self._registered,
            owners=plan.owners,
            handed=plan.handed,
            merges=tuple(merges),
            given=plan.given,
            lo=lo,
            consumed=plan.consumed,
        )
        temps = plan.temps
        # 3. commit (the parts were written by the caller or by plan_pieces' rewrites).
        # The machine lists the given parts again (a plain function of batch_rules) once
        # a GC may have forgotten some (see persist.appended).
        relist = partial(check_appendable, self._ctx.blob, self.shard_id, batches, fresh)
        attempts = [0]

        def attempt() -> list[Any]:
            # After an attempt of unknown outcome (or a caller's retry), a missing
            # record may be a pruned one: the command then never says UpperMismatch.
            attempts[0] += 1
            return machine.compare_and_append(
                cmd, relist, checked_upper, maybe_landed=retry or attempts[0] > 1
            )

        try:
            reqs = self._apply_resolving(attempt)
        except PersistError as e:
            self._append_failed(e, batches, temps, merges, token, bool(plan.pieces), lo)
            raise
        if plan.pieces:
            self._registered = True  # the append registered or renewed this writer
            self._last_heartbeat_ms = machine.now_ms()
        own = sum(
            1
            for b in batches
            if b is not fresh and all(key_writer_id(k) == self.writer_id for k in b.blob_keys())
        )
        self._lent = max(0, self._lent - own)
        # Parts of a batch that this append truncated or rewrote physically are not
        # deleted here but left to GC (collected once this writer is gone and the grace
        # period passed): another copy of the same batch (its transmittable bytes decoded
        # twice, a retry after an unknown outcome) may have committed them already.
        for b in batches:
            b.mark_consumed()
        # 4. maintenance.  Requests too small to pay for a physical merge are skipped
        # (the compaction heuristic, see persist.spine.COMPACTION_MIN_INPUTS): a later,
        # larger request covers their hollow batches.
        maintenance = self._ctx.maintenance
        if merges:
            maintenance.release_outputs(machine, merges)
        reqs = [r for r in reqs if worth_compacting(r)]
        if reqs:
            maintenance.after_append(machine, reqs)

    def _plan_batches(
        self, batches: Sequence[Batch], expected: Antichain, new: Antichain, fresh: Batch | None
    ) -> AppendPlan:
        """The :class:`AppendPlan` of an append ``[expected, new)`` of ``batches``
        (validated; ``fresh``: the one whose parts this call just wrote): every blob part
        but ``fresh``'s checked to exist (:func:`persist.batch_rules.check_appendable`),
        the hollow batches to push (:func:`persist.batch_rules.plan_pieces`, rewriting
        physically what metadata cannot express), the parts given and consumed.

        Raises:
            PartsMissing: a part is not in the blob store (nothing is committed).
        """
        owners = self._check_appendable(batches, fresh)  # parts exist; owners checked later
        pieces, temps, given = plan_pieces(
            batches, expected, new, fresh, self._rewriter(expected, new)
        )
        fresh_keys = {k for b in [fresh, *temps] if b is not None for k in b.part_ids()}
        kept = {k for hb in pieces for p in hb.parts if (k := p.part_id) is not None}
        # Given parts rewritten (truncated) into new ones: retired by the commit, so a
        # copy of their batch is refused as appended.
        consumed = tuple(
            k
            for b in batches
            if b is not fresh
            for k in b.part_ids()
            if k not in kept and k not in fresh_keys
        )
        return AppendPlan(
            tuple(pieces),
            temps,
            tuple(given),
            frozenset(owners),
            tuple(handed_off_owners(batches, self.writer_id).items()),
            consumed if pieces else (),
        )

    def _append_failed(
        self,
        e: PersistError,
        batches: Sequence[Batch],
        temps: list[Batch],
        merges: list[FueledMergeRes],
        token: str,
        pushed: bool,
        lo: int | None,
    ) -> None:
        """Settle a failed commit of an append of ``batches`` (``pushed``: it pushed
        hollow batches): give back the compaction results it carried, and either keep
        everything for a retry with ``token`` (an unknown outcome) or delete the
        temporary batches it wrote; copies of appended batches are marked consumed."""
        machine = self._machine
        indeterminate = e.is_indeterminate()
        if merges and not indeterminate:
            machine.offer_merge_results(merges)  # still candidates; else GC's
        if indeterminate:
            e.idempotency_token = token
            for b in batches:  # a retry with these batches reuses the token
                b.pending_token = token
            if pushed:  # a retry in this process knows when it was first tried
                machine.note_attempt(token, -1 if lo is None else lo)
        else:
            for t in temps:
                t.delete()
        if isinstance(e, BatchAppended):  # copies: their parts are the shard's
            for b in batches:
                if not set(e.keys).isdisjoint(b.part_ids()):
                    b.mark_consumed()

    #: How many times an indeterminate commit is re-applied (re-reading consensus, with
    #: exponential backoff up to :attr:`resolve_max_wait` seconds) before giving up.
    resolve_attempts: int = 8
    resolve_max_wait: float = 1.0

    def _apply_resolving(self, apply: Callable[[], _T]) -> _T:
        """``apply()`` (a machine command), re-applied while its outcome is unknown
        (:func:`persist.idempotency.apply_resolving`, at most :attr:`resolve_attempts`
        times).  Also used by the writer's registration (:meth:`heartbeat`), whose
        transition is idempotent."""
        return apply_resolving(
            apply,
            attempts=self.resolve_attempts,
            max_wait=self.resolve_max_wait,
            shard_id=self.shard_id,
        )

    def _token_landed(
        self, token: str, fingerprint: str, earlier: Callable[[str], str] | None = None
    ) -> tuple[bool, int]:
        """Whether the append with the caller's ``token`` (and ``fingerprint``; in
        another version ``earlier``) landed, and the seqno of the state that says so
        (:func:`persist.idempotency.token_landed`).

        Raises:
            InvalidUsage: the token names another append.
            ConsensusError: indeterminate: the outcome can no longer be learned.
        """
        return token_landed(self._machine, token, fingerprint, earlier)

    def _count_transmitted(self) -> None:
        """A batch of this handle's builders, with blob parts, was transmitted."""
        self._transmitted += 1

    def lapsed(self, now_ms: int) -> bool:
        """Whether this writer can no longer write: it was expired, or it registered
        and its lease ran out (no heartbeat within ``lease_seconds`` of ``now_ms``, ms
        on the machine's clock).  Its owner then opens a new writer: the one test that
        :meth:`persist.shards.Shards.txn_writer` and :class:`persist.table.Table` use."""
        return self._expired or (
            self._registered and now_ms - self._last_heartbeat_ms > self._lease_ms
        )

    def expire(self) -> None:
        """Unregister this writer from the shard state (GC may then delete the parts it
        left behind, once older than the grace period).  Idempotent.

        A writer whose builders produced batches it did not append itself is not
        unregistered.  If some of them, with blob parts, were transmitted to another
        process (:meth:`Batch.into_transmittable`), which appends them, the writer is
        *handed off* (:meth:`ShardState.hand_off_writer`): its lease is renewed and
        lengthened to the client's ``handoff_lease_seconds``, so that GC keeps those
        parts while the bytes travel; each append of one of them, or deletion of a
        decoded copy, counts one down, and the writer is dropped once none is left (or
        when its lease runs out, e.g. for bytes never decoded).  The receiver holding
        them renews the lease further (:meth:`hold`).  Otherwise (batches still held in
        this process, which renew the lease while held) the lease is left to run out by
        itself.
        """
        if self._expired:
            return
        self._expired = True
        if self._transmitted > 0 and self._registered:
            # Batches still held here count too: they are appended by another handle,
            # or deleted (then the hand-off lease runs out by itself).
            wid, sent = self.writer_id, max(self._lent, self._transmitted)
            lease_ms = int(self._ctx.config.handoff_lease_seconds * 1000)
            kept = self._machine.hand_off(wid, lease_ms, sent)
            log.info(
                "writer %s of shard %s handed off %d batch(es) to other processes: %s",
                wid,
                self.shard_id,
                sent,
                "kept for the hand-off lease" if kept else "none outstanding, or no longer live",
                extra={"shard": self.shard_id, "writer_id": wid},
            )
            return
        if self._lent > 0:
            log.info(
                "writer %s of shard %s handed out %d batch(es) it did not append: its "
                "lease is left to run out",
                self.writer_id,
                self.shard_id,
                self._lent,
                extra={"shard": self.shard_id, "writer_id": self.writer_id},
            )
            return
        self._machine.expire_writer(self.writer_id)

    def __enter__(self) -> WriteHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.expire()
        except PersistError as e:  # pragma: no cover - best effort on exit
            log.warning(
                "could not expire writer %s: %s",
                self.writer_id,
                e,
                extra={"shard": self.shard_id, "writer_id": self.writer_id},
            )
