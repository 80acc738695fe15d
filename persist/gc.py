"""Garbage collection of a shard's blobs and consensus versions.

Blob keys of a shard all start with ``<shard_id>/`` and name the writer that wrote them
and when (:mod:`persist.keys`; keys of the older layouts, and of Spark compaction jobs,
name no writer).  :func:`collect_garbage` deletes

* *retired* keys: parts a compaction replaced.  The shard's retired collection records
  the seqno of the version that stopped referencing each and its wall-clock time; the
  key is deleted once every live reader's seqno hold is at or past that seqno (no reader
  may still be reading a version that references it), the retirement is older than the
  grace period, and GC's own state read is at or past that seqno;
* *abandoned* keys: keys no state references and that are not retired, whose writer is
  not registered in the state GC decides on (never registered, expired, or expired by
  ``expire()``) and which were written longer ago than the grace period: batches of
  writers that failed (crashed between upload and commit, lost an upper race and could
  not delete) and outputs of compactors that died before applying them.  A key without
  writer (older layouts) is abandoned after the grace period;

keys under the shard's prefix that persist's layouts could not have produced are never
deleted, only reported (``GcReport.unrecognized``).  It then truncates consensus.

GC commits its judgement before acting on it: it first expires, by compare-and-set, the
writers and readers whose leases ran out by its clock, and decides everything on the
state that decision is committed in (or on the head, read after its listing, when there
was nothing to expire).  Writers keep the other half of the contract: a writer is
registered before its first upload, a writer dropped from the state is never registered
again, and a commit (``compare_and_append``, ``compare_and_append_batch``, a
transaction's commit) whose writer, or a writer whose parts it references, is not
registered and live in the version it commits on is refused and commits nothing
(``LeaseExpired``; see :mod:`persist.write`).  The two are ordered by the
compare-and-set: either GC's expiry lands first and the writer's commit is refused, or
the writer's commit lands first, renewing its lease, and GC's expiry is re-decided on
it.

Invariants kept here: a key referenced by the latest state is never deleted; a key of a
writer registered in the committed state GC decides on is never deleted, whatever its
age (a builder or batch may stay open as long as its writer heartbeats); a key GC
deletes is never referenced by a later commit (its writer is gone from that state and
every later one); a retired key is never deleted while a live reader's seqno hold is
before its retirement; GC's own state changes go through compare-and-set, and
forgetting deleted retired keys retracts only rows present as of the version it commits
on, so overlapping or repeated GC passes are idempotent.

Time: leases are wall-clock leases, as in persist-client.  Whether a lease ran out is
judged by the clock of the process that commits the judgement (GC here, and every state
transition, which drops expired leases), against the heartbeat times the leaseholders
recorded with theirs; a heartbeat never moves a lease back (``max(old, now)``).  Clock
skew therefore never loses an acknowledged append: a process whose clock is ahead by
more than a lease expires live writers early, and their next commits are refused with
``LeaseExpired`` and nothing committed (the caller opens a new writer and writes
again); it does make those writers fail, so the processes sharing a shard should keep
their clocks in agreement to well within a lease (NTP does).  The record that an
append landed is the shard's, not the writer's (:mod:`persist.landed`): an expiry,
early or not, never makes a landed append look lost.

Sources: the first engine's blob bookkeeping (Materialize's ``src/persist/src/indexed/``);
persist-client's GC, writer-named blob keys and seqno holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from persist import metrics as persist_metrics
from persist.consensus import RetiredKey
from persist.context import HasContext, PersistContext, as_context
from persist.errors import BlobError, InvalidUsage
from persist.keys import key_created_ms, parse_part_key
from persist.machine import ShardMachine
from persist.state import ShardState
from persist.types import INLINE_ID_PREFIX

__all__ = ["GcReport", "collect_garbage", "key_created_ms"]

log = logging.getLogger(__name__)


@dataclass
class GcReport:
    """What a GC pass did.

    Attributes:
        shard_id: the shard.
        deleted_retired: retired keys deleted.
        deleted_abandoned: abandoned keys deleted.
        kept_recent: unreferenced keys kept because they are younger than the grace.
        kept_live_writer: unreferenced keys kept because their writer is live.
        kept_held: retired keys kept because a live reader's seqno hold needs them (or
            they are younger than the grace period).
        referenced: keys the latest state references.
        unrecognized: keys under the shard's prefix that persist could not have written
            (never deleted).
        failed: keys whose deletion failed (tried again next time).
        deleted_temporaries: temporary files of interrupted uploads deleted (FileBlob).
        forgot_inline: retired ids of inline parts (``inline:`` and a nonce, retired by
            a compaction: see :attr:`persist.types.PartRef.part_id`) forgotten after the
            grace period; they name no blob.
    """

    shard_id: str
    deleted_retired: list[str] = field(default_factory=list)
    deleted_abandoned: list[str] = field(default_factory=list)
    kept_recent: int = 0
    kept_live_writer: int = 0
    kept_held: int = 0
    referenced: int = 0
    unrecognized: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    deleted_temporaries: int = 0
    forgot_inline: list[str] = field(default_factory=list)


def collect_garbage(
    source: PersistContext | HasContext, shard: str, *, grace_seconds: float | None = None
) -> GcReport:
    """Delete a shard's unreferenced blobs older than the grace period and truncate its
    consensus versions (see the module docstring).

    Args:
        source: the client, or its :class:`~persist.context.PersistContext` (its stash
            and blob store).
        shard: the shard's name, or ``id:<shard id>`` (see
            :meth:`PersistContext.shard_id`).
        grace_seconds: the grace period (default: the client's ``gc_grace_seconds``), a
            finite number of seconds ``>= 0``.

    Raises:
        InvalidUsage: unknown shard, a grace period that is not a finite number ``>= 0``,
        or a stash that is not writable (``PersistContext.check_may_delete``).
        BlobError, ConsensusError: listing or the final state update failed (deletions
        already done are harmless).
    """
    ctx = as_context(source)
    grace = ctx.config.gc_grace_seconds if grace_seconds is None else grace_seconds
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace < 1e15:
        raise InvalidUsage(
            f"grace_seconds must be a finite number of seconds >= 0, got {grace_seconds!r}"
        )
    ctx.check_may_delete("collect_garbage")
    shard_id = ctx.shard_id(shard)
    m: ShardMachine = ctx.machine(shard_id)
    listed = ctx.blob.list_keys(f"{shard_id}/")
    # Decided after listing: a key listed was written by a writer registered before it
    # (so present in this state unless expired), or was retired by then (so in the
    # retired collection read below).
    st = _commit_expiry(m)
    _upper, retired = ctx.consensus.retired_entries(shard_id)
    now = m.now_ms()
    grace_ms = int(grace * 1000)
    referenced = st.referenced_blob_keys()
    live_writers = set(st.writers)
    hold = st.min_seqno_hold(now)
    report = GcReport(shard_id, referenced=len(referenced))

    def deletable(r: RetiredKey) -> bool:
        if r.ms + grace_ms > now:
            return False
        # Rows of the older format have no seqno: count them as retired at this version.
        at = st.seqno if r.seqno is None else r.seqno
        if at > st.seqno:  # retired after our read: readers we do not know of may hold it
            return False
        return hold is None or hold >= at

    due_retired = []
    for k, r in retired.items():
        if k.startswith(INLINE_ID_PREFIX):  # no blob: forgotten once due
            if deletable(r):
                report.forgot_inline.append(k)
            else:
                report.kept_held += 1
        elif parse_part_key(shard_id, k) is None:
            report.unrecognized.append(k)
        elif deletable(r):
            due_retired.append(k)
        else:
            report.kept_held += 1
    abandoned: list[str] = []
    for key, _size in listed:
        if key in referenced or key in retired:
            continue
        pk = parse_part_key(shard_id, key)
        if pk is None:
            report.unrecognized.append(key)
        elif pk.writer_id is not None and pk.writer_id in live_writers:
            report.kept_live_writer += 1
        elif pk.created_ms + grace_ms <= now:
            abandoned.append(key)
        else:
            report.kept_recent += 1
    if report.unrecognized:
        log.warning(
            "GC of shard %s: %d keys under its prefix are not persist's (kept): %s",
            shard_id,
            len(report.unrecognized),
            report.unrecognized[:5],
        )

    for key in due_retired:
        try:
            ctx.blob.delete(key)
            report.deleted_retired.append(key)
        except BlobError as e:
            log.warning(
                "GC could not delete retired part %s: %s", key, e, extra={"shard": shard_id}
            )
            report.failed.append(key)
    for key in abandoned:
        try:
            ctx.blob.delete(key)
            report.deleted_abandoned.append(key)
        except BlobError as e:
            log.warning(
                "GC could not delete abandoned part %s: %s", key, e, extra={"shard": shard_id}
            )
            report.failed.append(key)

    if report.deleted_retired or report.forgot_inline:
        done = {
            retired[k].entry: retired[k].ms
            for k in [*report.deleted_retired, *report.forgot_inline]
        }
        _forget(ctx, m, shard_id, done)
    sweep = getattr(ctx.raw_blob, "sweep_temporaries", None)
    if sweep is not None:  # a FileBlob: uploads killed mid-write leave temporary files
        report.deleted_temporaries = sweep(f"{shard_id}/", grace)
    ctx.consensus.truncate(shard_id)
    persist_metrics.observe_gc(report)
    return report


def _commit_expiry(m: ShardMachine) -> ShardState:
    """Expire, by compare-and-set, the readers and writers whose leases ran out by this
    process's clock, and return the state that decision is committed in: a state read
    after the caller's listing (the head, or the version this transition committed).

    A writer absent from it is gone for good (a writer is never registered again once
    dropped), and every later commit of it is refused for not being registered in the
    version it commits on, so its keys may be deleted.  Had GC deleted on a judgement
    of its own clock without committing it, a writer renewing meanwhile (or judged by a
    clock ahead of its own) could commit a part GC deleted.  Source: persist-client's
    ``internal/state.rs`` (``expire_writer``) and ``internal/maintenance.rs``, where
    writers are expired through the state machine, never behind it.
    """
    # Decide on the head as read after the listing, never on an older cache: catching
    # up (the log rows after the cached version, read now) gives that head without
    # decoding the whole state.
    m.refresh()
    return m.expire_leases(m.now_ms())


def _forget(ctx: PersistContext, m: ShardMachine, shard_id: str, done: dict[str, int]) -> None:
    """Retract the rows ``done`` (row key -> ms) from the retired collection, only those
    still present as of the version the retraction commits on.

    The rows are re-read unless the collection's upper they were read at equals that
    version's ``retired_upper``.  A row is retracted if it was present both when GC read
    it (before) and in the re-read (after the version was read): rows are added once and
    retracted once, so it is present in that version too; the compare-and-set commits
    only on that version.  So two overlapping GC passes, or a pass re-run after an
    indeterminate outcome, never retract a row twice (which would leave a ``-1`` row).
    """
    m.forget_retired(done)
