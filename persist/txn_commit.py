"""The commit protocol of a transaction across shards and stash collections.

A :class:`~persist.txn.Txn` gathers what it writes (:class:`~persist.txn_rows.ShardWrites`, one per shard,
and stash :class:`~stash.AppendBatch` es); this module commits it, and learns whether an
attempt whose acknowledgement was lost landed:

* :func:`commit_shards` stages every written shard's next version
  (:meth:`~persist.machine.ShardMachine.stage_commit_txn`, the pure command
  :meth:`~persist.state.ShardState.commit_txn`) under the shard machines' locks, sends all
  of them with the stash batches in ONE stash transaction
  (:meth:`~persist.consensus.Consensus.append_atomic`), and installs the staged versions
  once it committed;
* :func:`find_landed` re-reads the written shards' heads for the transaction's token;
* :class:`TxnUpperMismatch` is the race a commit can lose, decided on a fresh read of
  every written shard (:func:`commit_shards` re-reads them before raising it).

Invariants kept here:

* **atomic across shards and stash collections**: every shard's version (a row of its
  stash log) and every stash batch go in one stash transaction, whose compare-and-set is
  each shard's seqno and each stash batch's lower: all of them commit or none does.  A staged version is installed
  in its machine only after the append committed;
* **a refused change commits nothing**: a shard whose upper is beyond the commit time
  (:class:`TxnUpperMismatch`), an expired writer, a finalized shard or a batch already
  appended is refused while staging, before the append; a stash batch whose lower check
  fails makes the append commit nothing;
* **a change that changes nothing writes nothing**: when the transaction's only
  writes are row changes that net to nothing (and it has no stash batch), no version
  and no part is written; :func:`commit_shards` returns the time asked for, having
  checked that every shard is still at the version its changes were planned on;
* **a lost seqno race is not a failure**: a reader, compactor or GC that moved a shard on
  (its upper still at or below the commit time) makes the attempt re-read every shard
  and stage again, on the metadata alone (no part is uploaded again);
* **an unknown outcome is settled by the token alone**: the transaction's token is
  recorded in each written shard's state under a writer id of the transaction's own;
  :func:`find_landed` reports the landed time only on finding it there, and "not landed"
  only on a head whose landed records (:mod:`persist.landed`, kept apart from writer
  leases) were not pruned past the version read before the first attempt.
  :class:`~persist.txn.Txn` settles an unknown outcome this way before it takes the next
  change or commit;
* **one lock order**: the shard machines' locks are taken first, in shard-id order; the
  client's transaction lock (``Shards._txn_lock``, taken by ``txn_done_ids`` /
  ``txn_done_forget``) is a leaf taken only inside them (see :mod:`persist.client`).

Sources of the idea: Materialize's ``src/persist-client/src/internal/machine.rs``
(``compare_and_append``: a lost compare-and-set re-reads the state and tries again, an
indeterminate one is settled by looking for the idempotency token) and ``src/txn-wal``
(one commit makes writes to many shards visible together); delta-rs's transaction commit
(``crates/core/src/operations/transaction/mod.rs``, ``CommitBuilder``) and pyiceberg's
``Transaction.commit_transaction`` (``pyiceberg/table/__init__.py``), which check at commit
what the changes require of the versions they were built on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial

from persist.batch import Batch
from persist.batch_rules import concat_runs
from persist.commands import TxnCmd
from persist.consensus import (
    APP_TXN_COLLECTION_PREFIX,
    HISTORY_LOG_PREFIX,
    REGISTRY_COLLECTION,
    RETIRED_COLLECTION_PREFIX,
    SHARD_COLLECTION_PREFIX,
)
from persist.context import PersistContext
from persist.errors import ConsensusError, InvalidUsage, UpperMismatch
from persist.keys import key_writer_id
from persist.machine import ShardMachine, Staged, Stale
from persist.shards import Shards
from persist.spine import FueledMergeReq
from persist.state import TOKEN_SEP, TOKEN_UNKNOWN, token_verdict
from persist.txn_rows import ShardWrites, plan_on_head
from persist.types import HollowBatch
from persist.write import handed_off_owners
from stash import Antichain, AppendBatch, Stash, StashError
from stash.logs import LogEntry

__all__ = [
    "check_stash_collections",
    "TxnUpperMismatch",
    "commit_shards",
    "find_landed",
    "is_timed",
    "lost_collection_upper",
    "merged_stash_batches",
    "timed_max",
    "unknown_outcome",
]


class TxnUpperMismatch(UpperMismatch):
    """``Txn.commit_at(ts)`` lost a race: nothing was committed.

    Attributes:
        ts: the commit time asked for.
        shards: shard name -> its current upper, for every written shard whose upper is
            beyond ``ts`` (retry with ``commit_at(t)`` for ``t >=`` the largest of them).
        collections: stash collection name -> its current upper, for every stash batch
            whose lower no longer matches (such a batch must be rebuilt).
        unfixable: names of shards whose upper passed a time a ``time_column`` write
            must be written at (no later ``ts`` can fix it).
        expected, current: as :class:`UpperMismatch` (``{ts}`` and the largest upper
            of the shards, or the collection's).
    """

    def __init__(
        self,
        ts: int,
        shards: Mapping[str, Antichain],
        collections: Mapping[str, Antichain] | None = None,
        *,
        unfixable: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        self.ts = ts
        self.unfixable = frozenset(unfixable)
        self.shards = dict(shards)
        self.collections = dict(collections or {})
        uppers = [*self.shards.values(), *self.collections.values()]
        current = uppers[0]
        for u in uppers[1:]:
            current = current.join(u)
        parts = [f"shard {n!r} upper {u}" for n, u in sorted(self.shards.items())]
        parts += [f"stash collection {n!r} upper {u}" for n, u in sorted(self.collections.items())]
        UpperMismatch.__init__(self, Antichain.from_elem(ts), current)
        self.args = (
            f"transaction cannot commit at {ts}, nothing was committed: "
            + "; ".join(parts)
            + (
                " (a stash batch's lower check failed: rebuild it)"
                if self.collections
                else " (writes with their own times are now below the upper)"
                if self.unfixable
                else " (retry at a later time)"
            ),
        )

    def __str__(self) -> str:
        return str(self.args[0])

    def retry_ts(self) -> int | None:
        """The smallest time a retry may commit at, or ``None`` if only a new stash batch
        (or nothing: a shard sealed for ever) can fix the race."""
        if self.collections or self.unfixable:
            return None
        ts = self.ts
        for u in self.shards.values():
            t = u.as_option()
            if t is None:
                return None
            ts = max(ts, t)
        return ts


def is_timed(b: Batch) -> bool:
    """Whether a transaction's batch keeps its own times (``time_column``)."""
    return bool(getattr(b, "txn_timed", False))


def timed_max(batches: Sequence[Batch]) -> int | None:
    """The latest time of a shard's timed (``time_column``) writes, or ``None``."""
    his = [b.time_range[1] for b in batches if is_timed(b) and b.time_range is not None]
    return max(his) if his else None


def unknown_outcome(token: str, why: str) -> ConsensusError:
    """The indeterminate :class:`~persist.errors.ConsensusError` of the transaction with
    ``token`` (its ``idempotency_token``): the outcome is unknown because of ``why``."""
    err = ConsensusError(
        f"the outcome of the transaction (token {token}) is unknown: {why}",
        indeterminate=True,
    )
    err.idempotency_token = token
    return err


def merged_stash_batches(batches: Sequence[AppendBatch]) -> list[AppendBatch]:
    """``batches`` with those for one collection merged into one (same lower, upper and
    compact, checked by :meth:`~persist.txn.Txn.stash_append`; entries in the order
    added).  The caller's batches are not changed."""
    groups: dict[str, list[AppendBatch]] = {}
    for b in batches:
        groups.setdefault(b.collection.name, []).append(b)
    merged: dict[str, AppendBatch] = {}
    for name, bs in groups.items():
        merged[name] = (
            bs[0]
            if len(bs) == 1
            else dataclasses.replace(bs[0], entries=[e for b in bs for e in b.entries])
        )
    return list(merged.values())


def lost_collection_upper(
    ctx: PersistContext, batches: Sequence[AppendBatch], lost: str
) -> Antichain:
    """The current upper of stash collection ``lost``, whose batch's lower check failed.

    Raises:
        ConsensusError: reading it failed.
    """
    sb = next(b for b in batches if b.collection.name == lost)
    try:
        return ctx.stash.upper(sb.collection)
    except StashError as e:
        raise ConsensusError(f"reading the upper of {lost} failed: {e}") from e


def commit_shards(
    shard_ops: Shards,
    writes: Mapping[str, ShardWrites],
    stash_batches: Sequence[AppendBatch],
    token: str,
    ts: int,
    *,
    max_races: int,
) -> int:
    """Stage every written shard's version at ``ts`` and send them with the stash batches
    as one stash append; re-stage on lost seqno races (at most ``max_races``).

    Args:
        shard_ops: the client's shards (its context, and the record ids of its
            acknowledged transactions, dropped from a shard's state by this commit).
        writes: shard id -> what the transaction writes to it (not empty).
        stash_batches: the stash batches to append with the shards (merged per
            collection by :func:`merged_stash_batches`).
        token: the transaction's idempotency token, recorded in each shard's state.
        ts: the commit time.

    Returns: the committed time: ``ts``, or the time of an earlier attempt of this
        transaction found landed while staging.  When the transaction writes nothing
        (its row changes changed nothing; no stash batch), nothing is sent, every
        shard's :attr:`ShardWrites.wrote` is set false and ``ts`` is returned.

    Raises:
        TxnUpperMismatch: a shard's upper is beyond ``ts`` (every written shard re-read
            first, each one beyond it named) or a stash batch's lower check failed.
        LeaseExpired, InvalidUsage: refused by a shard's command while staging.
        ConsensusError: the stash failed (``is_indeterminate()`` if it may have
            committed), or more than ``max_races`` seqno races were lost.
        In every case but an indeterminate error, nothing was committed.
    """
    c = shard_ops.ctx
    order = sorted(writes)
    machines = [c.machine(sid) for sid in order]
    fresh: dict[str, int] = {}  # shard id -> seqno of a version just read from consensus
    races = [0]
    while True:
        # Row changes are planned (parts read, their batch uploaded, the writer
        # registered by a pool thread) before the locks are taken: no blob I/O, and no
        # wait for a pool thread, under a machine's lock (see persist.machine).
        for sid, m in zip(order, machines, strict=True):
            rc = writes[sid].rows
            if rc is not None and rc.planned_on != (m.state().seqno, ts):
                plan_on_head(writes[sid], m, ts, token)
        with contextlib.ExitStack() as stack:
            # Lock order: the shard machines' locks first, in shard-id order (two
            # commits over overlapping shards never wait on each other); the client's
            # transaction lock (Shards._txn_lock) is a leaf, taken only inside them by
            # txn_done_ids and txn_done_forget, which call out to nothing.
            for m in machines:
                stack.enter_context(m.lock)
            out = _commit_locked(
                shard_ops, writes, stash_batches, token, ts, machines, fresh, races, max_races
            )
        if out is not None:
            return out


def _commit_locked(
    shard_ops: Shards,
    writes: Mapping[str, ShardWrites],
    stash_batches: Sequence[AppendBatch],
    token: str,
    ts: int,
    machines: Sequence[ShardMachine],
    fresh: dict[str, int],
    races: list[int],
    max_races: int,
) -> int | None:
    """:func:`commit_shards` under the machines' locks: stage and send until the commit
    lands, is refused, or a shard's version moved past the one its row changes were
    planned on (``None``: plan again, outside the locks).  ``fresh`` (shard id -> seqno
    read from consensus) and ``races`` (lost races so far) carry over between calls."""
    c = shard_ops.ctx
    order = sorted(writes)
    names = sorted(w.name for w in writes.values())
    while True:
        for sid, m in zip(order, machines, strict=True):
            rc = writes[sid].rows
            if rc is not None and rc.planned_on != (m.state().seqno, ts):
                return None  # planned on another version: plan again, unlocked
        staged: list[tuple[ShardMachine, Staged, list[FueledMergeReq]]] = []
        dropping: dict[str, tuple[str, ...]] = {}  # shard id -> done record ids
        mismatched: dict[str, Antichain] = {}
        landed_at: int | None = None
        restage = False
        for sid, m in zip(order, machines, strict=True):
            sw = writes[sid]
            cmd, relist = _shard_command(shard_ops, sw, token, ts, m)
            dropping[sid] = cmd.done
            try:
                is_fresh = fresh.get(sid) == m.state().seqno
                (kind, value), st = m.stage_commit_txn(cmd, is_fresh, relist)
            except Stale:
                fresh[sid] = m.refresh().seqno
                restage = True
                break
            if kind == "landed":
                landed_at = value
                break
            if kind == "mismatch":
                mismatched[sw.name] = value[0]
                continue
            assert st is not None
            staged.append((m, st, value))
        if restage:
            continue
        if landed_at is not None:
            for m in machines:  # an earlier attempt landed: learn its versions
                m.refresh()
            return landed_at
        if mismatched:
            # Uppers only advance: a cached upper beyond ts is a real race.  The
            # other shards' cached uppers may be older than theirs: re-read every
            # shard, so the report (and retry_ts) names each one beyond ts.
            raise _upper_mismatch(ts, writes, order, machines)
        if not stash_batches and all(
            sw.rows is not None and not sw.batches for sw in writes.values()
        ):
            # Row changes that changed nothing, and nothing else: write nothing (no
            # version, no part) once every shard is read again at the version its
            # changes were planned on (so all of them held at one instant).
            if all(m.refresh().seqno == st.expected for m, st, _reqs in staged):
                for sw in writes.values():
                    sw.wrote = False
                return ts
            races[0] += 1
            if races[0] > max_races:
                raise ConsensusError(
                    f"transaction at {ts}: gave up after {races[0]} re-plans of changes "
                    "that changed nothing"
                )
            for sid, m in zip(order, machines, strict=True):
                fresh[sid] = m.refresh().seqno
            continue
        batches: list[AppendBatch | LogEntry] = []
        for m, st, _reqs in staged:
            batches.extend(
                c.consensus.version_batches(
                    m.shard_id,
                    st.expected,
                    st.texts,
                    st.prev,
                    st.retired,
                    plan=st.plan,
                    history=st.history,
                )
            )
        batches.extend(merged_stash_batches(stash_batches))
        lost = c.consensus.append_atomic(batches, f"transaction commit at {ts} of shards {names}")
        if lost is None:
            for m, st, _reqs in staged:
                m.install(st)
                shard_ops.txn_done_forget(m.shard_id, dropping[m.shard_id])
            for m, _st, reqs in staged:
                if reqs:
                    c.maintenance.after_append(m, reqs)
            return ts
        sid_lost = next(
            (
                m.shard_id
                for m in machines
                if lost
                in (
                    SHARD_COLLECTION_PREFIX + m.shard_id,
                    RETIRED_COLLECTION_PREFIX + m.shard_id,
                )
            ),
            None,
        )
        if lost.startswith(HISTORY_LOG_PREFIX):
            raise ConsensusError(f"transaction at {ts}: history log {lost} is out of step")
        if sid_lost is None:
            others = [b for b in batches if isinstance(b, AppendBatch)]
            raise TxnUpperMismatch(ts, {}, {lost: lost_collection_upper(c, others, lost)})
        # A lost seqno race: re-read every shard (cheap when unchanged) and
        # stage again; no part is written again.
        races[0] += 1
        if races[0] > max_races:
            raise ConsensusError(
                f"transaction at {ts}: gave up after {races[0]} lost compare-and-set races"
            )
        for sid, m in zip(order, machines, strict=True):
            fresh[sid] = m.refresh().seqno  # only the diffs after the cached version
        if races[0] > 2:
            time.sleep(random.uniform(0, min(0.05, 0.0005 * 2 ** min(races[0], 10))))


def _upper_mismatch(
    ts: int,
    writes: Mapping[str, ShardWrites],
    order: Sequence[str],
    machines: Sequence[ShardMachine],
) -> TxnUpperMismatch:
    """The race at ``ts``, decided on a fresh read of every written shard: each shard
    whose upper is beyond ``ts`` with that upper (unfixable when its timed writes
    are now below it)."""
    shards: dict[str, Antichain] = {}
    unfixable: set[str] = set()
    for sid, m in zip(order, machines, strict=True):
        sw = writes[sid]
        upper = m.refresh().upper
        if not upper.less_equal(ts):
            shards[sw.name] = upper
        los = [
            b.time_range[0]
            for b in sw.batches
            if is_timed(b) and b.len > 0 and b.time_range is not None
        ]
        if los and not upper.less_equal(min(los)):
            shards[sw.name] = upper
            unfixable.add(sw.name)
    return TxnUpperMismatch(ts, shards, unfixable=unfixable)


def _shard_command(
    shard_ops: Shards, sw: ShardWrites, token: str, ts: int, m: ShardMachine
) -> tuple[TxnCmd, Callable[[], object]]:
    """One shard's part of the commit (:meth:`ShardState.commit_txn`, staged by
    :meth:`ShardMachine.stage_commit_txn`) and the listing of its given parts.  The
    command drops (``done``) the record ids of the client's acknowledged transactions on
    the shard, other than this one's."""
    w = sw.writer
    wid = w.writer_id
    new = Antichain.from_elem(ts + 1)
    owners = {wid}
    for b in sw.batches:
        owners.update(x for k in b.blob_keys() if (x := key_writer_id(k)) is not None)
    if not w._registered:
        owners.discard(wid)  # checked once registered
    timed = any(is_timed(b) for b in sw.batches)
    ranges = [b.time_range for b in sw.batches if b.len > 0 and b.time_range is not None]
    timed_lo = min(r[0] for r in ranges) if timed and ranges else None
    rid = sw.record_id
    done = [d for d in shard_ops.txn_done_ids(m.shard_id) if d != rid]

    def pieces(upper: Antichain) -> list[HollowBatch]:
        if timed:
            # The updates keep their times, all in [upper, ts]: one batch.
            return [concat_runs(upper, new, [b for b in sw.batches if b.len])]
        copies = []
        for b in sw.batches:
            cp = Batch(w._ctx.blob, b.shard_id, b.hollow, time_range=b.time_range)
            cp.rewrite_ts(Antichain.from_elem(ts), new)  # metadata only
            copies.append(cp)
        out, temps = w._assemble(copies, upper, new)
        if temps:  # pragma: no cover - one rewrite frontier never needs a rewrite
            for t in temps:
                t.delete()
            raise InvalidUsage("a transaction's batches needed a physical rewrite")
        return out

    cmd = TxnCmd(
        writer_id=wid,
        record_id=rid,
        token=token,
        ts=ts,
        lease_ms=w._lease_ms,
        registered=w._registered,
        owners=frozenset(owners),
        handed=tuple(handed_off_owners(sw.batches, wid).items()),
        given=tuple(k for b in sw.given for k in b.part_ids()),
        timed_lo=timed_lo,
        done=tuple(done),
        pieces=pieces,
    )
    return cmd, partial(w._check_appendable, sw.given, None)


def find_landed(
    ctx: PersistContext,
    writes: Mapping[str, ShardWrites],
    token: str,
    lo: int | None,
    *,
    attempts: int,
    max_wait: float,
) -> int | None:
    """Whether a commit of the transaction with ``token`` landed, decided on a fresh read
    of the first written shard's head (by shard id): the time it committed at if the
    token is recorded there, else ``None``.

    Args:
        ctx: the client's context.
        writes: shard id -> what the transaction writes to it (not empty).
        token: the transaction's idempotency token.
        lo: the seqno of a version of the first written shard read before the first
            attempt whose outcome is unknown (``None``: not known), see
            :mod:`persist.landed`.
        attempts, max_wait: how many times a failing read is tried, and the longest
            backoff between two tries (s).

    Raises:
        ConsensusError: indeterminate (``idempotency_token`` is ``token``): the reads kept
            failing, or the token is absent but the shard pruned records of versions
            after ``lo``, so its absence proves nothing.
    """
    order = sorted(writes)
    sid = order[0]
    m = ctx.machine(sid)
    last: Exception | None = None
    for attempt in range(attempts):
        try:
            st = m.refresh()
        except ConsensusError as e:
            last = e
            time.sleep(min(max_wait, 0.005 * 2**attempt))
            continue
        verdict, entry = token_verdict(st, token, lo)
        if entry is not None:
            _, _, fp = entry.partition(TOKEN_SEP)
            for other in order[1:]:
                with contextlib.suppress(ConsensusError):
                    ctx.machine(other).refresh()
            return int(fp[1:]) if fp.startswith("t") else -1
        if verdict == TOKEN_UNKNOWN:
            # A landed commit's record may have been pruned (persist.landed): its
            # absence proves nothing, so the outcome stays unknown.
            raise unknown_outcome(
                token,
                f"shard {sid} no longer holds the record of every transaction that "
                "landed since the commit's acknowledgement was lost",
            )
        return None
    assert last is not None
    raise unknown_outcome(token, f"re-reading shard {sid} failed: {last}")


_INTERNAL_PREFIXES = (SHARD_COLLECTION_PREFIX, RETIRED_COLLECTION_PREFIX, APP_TXN_COLLECTION_PREFIX)


def check_stash_collections(stash: Stash, batches: Sequence[AppendBatch], *, own: bool) -> None:
    """Refuse stash batches a transaction may not commit in ``stash``: a batch for one
    of persist's own collections (shard versions, the registry, a table's application
    transaction records), unless ``own`` (persist writing them, :mod:`persist.app_txn`);
    a batch whose collection is not ``stash``'s (another stash's handle, no collection
    of that name and id, other codecs).

    Raises:
        InvalidUsage: naming the collection and the rule broken (URLs redacted).
        ConsensusError: listing the stash's collections failed.
    """
    try:
        known = stash.collections()
    except StashError as e:
        raise ConsensusError(f"listing the stash's collections failed: {e}") from e
    for b in batches:
        c = b.collection
        if not own and (c.name == REGISTRY_COLLECTION or c.name.startswith(_INTERNAL_PREFIXES)):
            raise InvalidUsage(
                f"stash batch for collection {c.name!r} refused: persist's own "
                "collections are written only by persist"
            )
        mine = known.get(c.name)
        if (
            mine is None
            or mine.id != c.id
            or mine.stash_id != c.stash_id
            or mine.key_codec.name != c.key_codec.name
            or mine.value_codec.name != c.value_codec.name
        ):
            raise InvalidUsage(
                f"stash batch for collection {c.name!r} (id {c.id}) is not for this "
                f"client's stash {stash.redacted_url} (stash id "
                f"{next((k.stash_id for k in known.values()), '?')}): its handle was "
                "made by stash "
                f"{c.stash_url or '?'} (stash id {c.stash_id}); this stash has "
                + (
                    "no such collection"
                    if mine is None
                    else f"collection {mine.name!r} with id {mine.id}, codecs "
                    f"{mine.key_codec.name}/{mine.value_codec.name}"
                )
            )
