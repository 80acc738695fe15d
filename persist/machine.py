"""The state machine of one shard in one process: one method per command.

:class:`ShardMachine` (after Materialize's persist-client ``internal/machine.rs`` and
``internal/apply.rs``) caches the last version of a shard's state it saw and runs each
command as: copy the cached state, call the :class:`~persist.state.ShardState` method of
the same name on the copy (a pure function of the state and the command's inputs, see
:mod:`persist.state`), and publish the next version by compare-and-set through
:class:`~persist.consensus.Consensus`; on a lost race it catches up by applying only the
log's newer diffs to its cached version (or, across a rollup, comparing the rollup's
entries with it), decoding only the entries that changed (:meth:`ShardMachine.refresh`,
also what every caller needing only the newest state uses), and runs the command again.  Once a version's diffs pass
the rollup bound it asks its maintenance (``on_rollup_due``) for a rollup, which
:meth:`ShardMachine.write_rollup` writes as a version of its own.  A command that would fail on a cached state raises
:class:`~persist.state.Stale` and is re-run on a fresh one, where failing is real.
Compaction results computed by this process may ride along in a writer's version
(:meth:`ShardMachine.offer_merge_results`), saving a compare-and-set per merge.
Transient consensus failures are retried with backoff (tenacity, in
:class:`~persist.consensus.Consensus`); an indeterminate commit is resolved by re-reading
the head and re-running the command, which recognises its own already-committed effect
(appends carry an idempotency token, the other commands are idempotent).

A multi-shard transaction (:mod:`persist.txn_commit`) stages each shard's next version
with :meth:`ShardMachine.stage_commit_txn` (under the machines' locks, taken in shard-id
order), builds its stash batches with :meth:`Consensus.version_batches`, sends them as one
:meth:`Consensus.append_atomic`, and caches the staged versions
(:meth:`ShardMachine.install`) only once committed.

Lock order (every thread takes locks in this order, never the reverse):

1. the shard machines' locks (:attr:`ShardMachine.lock`, re-entrant), several of them
   only in shard-id order (a multi-shard transaction,
   :func:`persist.txn_commit.commit_shards`);
2. leaves, taken inside them and calling out to nothing: the client's transaction lock
   (``Shards._txn_lock``), a machine's ``_offered_lock``, the lease keeper's condition,
   the maintenance worker's condition (:meth:`persist.maintenance.Maintenance.rollup_due`
   queues a rollup under it, called holding the machine's lock).

Under a machine's lock a thread does consensus calls and pure computation only: no blob
upload or part read, and no wait for a thread of the shared pools (:mod:`persist.pool`),
whose tasks may need that very lock (a writer registering before its first upload runs
a command of its shard's machine in whichever pool thread reaches the upload first).  So
a transaction plans and uploads its row changes before it takes the locks and stages
only on the version it planned on (:mod:`persist.txn_commit`); an append writes its
parts before its command runs.  A lease renewal (:mod:`persist.lease`) runs its
command holding its keeper entry's lock (taken before the machine's).

Invariants kept here: a version is only published on top of the version it was computed
from; this module is the only place a transition function reaches the applier (every
other module calls a named command); expired leases (except the command's own) are
dropped in the version a command publishes.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa

from persist import metrics as persist_metrics
from persist import retention, state_check, state_codec
from persist.commands import AppendCmd, Inputs, NeedsInput, TxnCmd
from persist.consensus import (
    Consensus,
    HistoryAppend,
    RetiredChange,
    VersionedData,
    VersionPlan,
)
from persist.errors import ConsensusError, PersistError
from persist.history_record import make_record
from persist.ids import validate_shard_id
from persist.retired_keys import retired_rows
from persist.spine import ApplyMergeResult, FueledMergeReq, FueledMergeRes
from persist.state import ShardState, Stale
from persist.types import HollowBatch
from stash import Antichain

__all__ = ["ShardMachine", "Stale", "Staged"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_MISSING = object()


@dataclass
class _Cache:
    state: ShardState
    version: VersionedData


@dataclass
class Staged:
    """A shard version computed by :meth:`ShardMachine._stage`, not yet published:
    ``expected`` (the seqno it builds on), the new ``state`` with its ``data`` and
    ``texts`` by entry key, the expected version ``prev`` (as stored), the ``retired``
    change to write with it and the ``plan`` of its stash updates
    (:meth:`Consensus.plan`), and the ``history`` record to write with it."""

    expected: int
    state: ShardState
    data: dict[str, Any]
    texts: dict[str, str]
    prev: VersionedData
    retired: RetiredChange | None
    plan: VersionPlan
    history: HistoryAppend | None = None


class ShardMachine:
    """The state machine of one shard within one process (thread-safe).

    Args:
        consensus: where versions live.
        shard_id: the shard.
        clock: wall-clock seconds (``time.time`` by default; injectable for tests).
        max_races: how many lost compare-and-set races one transition may suffer before
            giving up with :class:`ConsensusError` (a livelock guard; every lost race is
            someone else's progress).
        check: called with every state read from consensus before it is used (the
            client's blob store check, :mod:`persist.store_identity`); what it raises
            propagates, nothing cached.
        on_rollup_due: called (holding the machine's lock; it must only queue work or
            call :meth:`write_rollup`) after a version commits whose diffs passed the
            bound of :meth:`Consensus.rollup_due` (the client's maintenance,
            :mod:`persist.maintenance`); ``None``: nobody writes rollups but the hard
            cap of :meth:`Consensus.plan`.
    """

    def __init__(
        self,
        consensus: Consensus,
        shard_id: str,
        *,
        clock: Callable[[], float] = time.time,
        max_races: int = 10_000,
        check: Callable[[ShardState], None] | None = None,
        on_rollup_due: Callable[[ShardMachine], None] | None = None,
    ) -> None:
        self.consensus = consensus
        self.check = check
        self.on_rollup_due = on_rollup_due
        self.shard_id = validate_shard_id(shard_id)
        self.clock = clock
        self.max_races = max_races
        self._lock = threading.RLock()
        self._offered_lock = threading.Lock()
        _MACHINES.add(self)
        self._cache: _Cache | None = None
        self.metrics = {
            "cas": 0,
            "cas_lost": 0,
            "heads": 0,
            "indeterminate": 0,
            "catch_ups": 0,
            "rollups": 0,
        }
        self._offered: list[FueledMergeRes] = []
        # Idempotency tokens of appends whose outcome was left unknown -> the seqno of
        # a version read before their first attempt (persist.landed's ``lo``).
        self._attempted: OrderedDict[str, int] = OrderedDict()

    # ------------------------------------------------- merge results to piggyback
    def offer_merge_results(self, results: list[FueledMergeRes]) -> None:
        """Offer compaction results to the next transition of this process that wants
        them (a writer's append applies them in its own version, saving a
        compare-and-set); see :meth:`take_merge_results`."""
        with self._offered_lock:
            self._offered.extend(results)

    def take_merge_results(self) -> list[FueledMergeRes]:
        """Take every offered compaction result (the taker applies them or offers them
        back)."""
        with self._offered_lock:
            out, self._offered = self._offered, []
            return out

    def offered_count(self) -> int:
        """How many offered results are waiting."""
        with self._offered_lock:
            return len(self._offered)

    def now_ms(self) -> int:
        """The clock in integer milliseconds."""
        return int(self.clock() * 1000)

    # ------------------------------------------------------------------ reads
    def _load(self) -> _Cache | None:
        self.metrics["heads"] += 1
        h = self.consensus.head(self.shard_id)
        if h is None:
            return None
        try:
            st = ShardState.from_entries(h.data)
        except PersistError as e:
            if self.shard_id in str(e):
                raise
            raise PersistError(f"shard {self.shard_id}: {e}") from e
        return self._checked(st, h)

    def _checked(self, st: ShardState, h: VersionedData) -> _Cache:
        """``st``, decoded from the version ``h``, checked before it is cached."""
        if st.shard_id != self.shard_id:
            raise PersistError(
                f"shard {self.shard_id}: its state is corrupt: it names shard {st.shard_id!r}"
            )
        if st.seqno != h.seqno:  # pragma: no cover - both read the same entry
            raise ConsensusError(f"shard {self.shard_id}: seqno mismatch in state")
        if self.check is not None:
            self.check(st)
        return _Cache(st, h)

    def fetch(self) -> ShardState:
        """Re-read the head from consensus from scratch, decoding the whole state (and
        cache it): for a check of what is stored (fsck, an inspection) or a machine with
        no cached version.  A caller that needs only the newest state uses
        :meth:`refresh`, which gives the same state (checked in the test suite) by
        catching up from the cached version.

        Raises:
            PersistError: the shard has no state (it was never initialised).
        """
        with self._lock:
            c = self._load()
            if c is None:
                raise PersistError(f"shard {self.shard_id} has no state in consensus")
            self._cache = c
            return c.state

    def refresh(self) -> ShardState:
        """Catch up with the head (and cache it), as :meth:`fetch` but reading only the
        log rows after the cached version and decoding only the entries they set or
        removed (:meth:`Consensus.catch_up`, :meth:`ShardState.from_entries_delta`;
        Materialize's persist-client ``internal/apply.rs``): what a command does after
        a lost race.  A rollup among those rows (maintenance's,
        :meth:`write_rollup`) is compared entry by entry with the cached version's
        texts, and only the entries that differ are decoded.  Anything else (no cached
        version, a gap, a malformed row) reads the whole head (:meth:`fetch`).

        Raises:
            PersistError: the shard has no state.
        """
        with self._lock:
            c = self._cache
            if c is None:
                return self.fetch()
            got = self.consensus.catch_up(self.shard_id, c.version)
            if got is None:
                return self.fetch()
            h, changed = got
            if h is c.version:
                return c.state  # no newer version
            try:
                st = ShardState.from_entries_delta(c.state, h.data, changed)
            except PersistError as e:
                log.warning("shard %s: catching up failed (%s); reading the head", self.shard_id, e)
                return self.fetch()
            if state_check.ENABLED:
                state_check.check_catch_up(st, h.data, h.texts)
            self.metrics["catch_ups"] += 1
            self._cache = self._checked(st, h)
            return st

    # ------------------------------------------------------------- rollups
    def _rollup_due(self) -> None:
        """Ask for a rollup (:attr:`on_rollup_due`) if the cached version's diffs
        passed the bound (:meth:`Consensus.rollup_due`)."""
        c = self._cache
        if (
            self.on_rollup_due is not None
            and c is not None
            and c.version.stored is not None
            and self.consensus.rollup_due(c.version.stored)
        ):
            self.on_rollup_due(self)

    def write_rollup(self, attempts: int = 3) -> bool:
        """Maintenance: if the head's diffs passed the bound (:meth:`Consensus.rollup_due`),
        publish a version that changes nothing but its seqno as a rollup row, by its
        own compare-and-set (the rows before it are then truncated); after Materialize's
        persist-client ``internal/state_versions.rs`` (``write_rollup``), never part of
        a command's version.  It writes no history record (it changes nothing a user
        sees).  A lost race is no error: the cache catches up and, while a rollup is
        still due, it tries again, ``attempts`` times in all.

        Returns: whether a rollup was written.

        Raises:
            ConsensusError: the stash failed (after retries; an indeterminate outcome
                leaves the cache to catch up on the next command).
        """
        with self._lock:
            for _ in range(attempts):
                c = self._cache
                if c is None or c.version.stored is None:
                    return False
                if not self.consensus.rollup_due(c.version.stored):
                    return False
                st = c.state.clone()
                st.seqno = c.state.seqno + 1
                data, texts, touched = self._encode(c, st)
                if state_check.ENABLED:
                    state_check.check_version(c.state, c.version.texts, st, data, texts, touched)
                plan = self.consensus.plan_rollup(self.shard_id, c.state.seqno, texts)
                if self.consensus.compare_and_set(
                    self.shard_id, c.state.seqno, texts, c.version, plan=plan
                ):
                    self.metrics["rollups"] += 1
                    self._cache = _Cache(st, VersionedData(plan.seqno, data, texts, plan.stored))
                    return True
                self.refresh()
            return False

    # ------------------------------------------ appends of unknown outcome (tokens)
    def note_attempt(self, token: str, lo: int) -> None:
        """An append with idempotency ``token``, first tried after version ``lo``, ended
        with its outcome unknown: a retry with the token in this process asks
        :meth:`attempt_floor` (see :mod:`persist.landed`)."""
        with self._lock:
            prev = self._attempted.pop(token, lo)
            self._attempted[token] = min(prev, lo)
            while len(self._attempted) > _ATTEMPTS_KEPT:
                self._attempted.popitem(last=False)

    def attempt_floor(self, token: str) -> int | None:
        """The ``lo`` noted for ``token`` by :meth:`note_attempt` (``None``: none)."""
        with self._lock:
            return self._attempted.get(token)

    def recent(self) -> ShardState:
        """The latest state: the cached one if no version followed it (one cheap read of
        the log rows after it), else the cached one caught up with the newer diffs
        (:meth:`refresh`).

        Raises:
            PersistError: the shard has no state.
        """
        return self.refresh()

    def state(self) -> ShardState:
        """The cached state (read from consensus the first time).  Do not mutate it."""
        with self._lock:
            if self._cache is None:
                return self.fetch()
            return self._cache.state

    def seqno(self) -> int:
        """The cached state's seqno."""
        return self.state().seqno

    def initialize(
        self, initial: ShardState, prepare: Callable[[ShardState], None] | None = None
    ) -> ShardState:
        """Load the shard's state, writing ``initial`` as version 0 if it has none yet
        (``prepare`` is called on it first, e.g. to record the blob store's identity).

        Returns: the state now at the head (``initial`` or whatever won the race).
        """
        with self._lock:
            for _ in range(100):
                c = self._load()
                if c is not None:
                    self._cache = c
                    return c.state
                initial.seqno = 0
                if prepare is not None:
                    prepare(initial)
                now = self.now_ms()
                record: dict[str, Any] = {
                    "seqno": 0,
                    "time": None,
                    "ms": now,
                    "op": "create",
                    "params": {},
                    "metrics": {},
                }
                history = HistoryAppend(0, f"{0:020d}", record)
                initial.history_upper, initial.history_ms = 1, now
                data = initial.to_entries()
                texts = {k: Consensus.encode(v) for k, v in data.items()}
                plan = self.consensus.plan(self.shard_id, None, texts, None)
                if self.consensus.compare_and_set(
                    self.shard_id, None, texts, plan=plan, history=history
                ):
                    self._cache = _Cache(initial, VersionedData(0, data, texts, plan.stored))
                    return initial
            raise ConsensusError(f"could not initialise shard {self.shard_id}")

    # -------------------------------------------- multi-shard transactions
    @property
    def lock(self) -> threading.RLock:
        """The machine's lock: a multi-shard transaction (:mod:`persist.txn_commit`) holds the
        locks of all its shards (taken in shard-id order) around :meth:`_stage` and
        :meth:`install`."""
        return self._lock

    def _stage(
        self,
        fn: Callable[[ShardState, bool], tuple[T, bool]],
        fresh: bool,
        keep: tuple[str, ...] = (),
        op: str | None = None,
    ) -> tuple[T, Staged | None]:
        """Run a transition on a copy of the cached state, as :meth:`_apply` does, but
        do not publish it: return ``fn``'s result and the :class:`Staged` version
        (``None`` when nothing changed) for the caller to send with
        :meth:`Consensus.version_batches` and, once committed, :meth:`install`.  The
        caller holds :attr:`lock`.  ``fn`` may raise :class:`Stale` (the caller then
        re-reads with :meth:`fetch` and stages again).
        """
        if self._cache is None:
            self.fetch()
        cache = self._cache
        assert cache is not None
        st = cache.state.clone()
        result, changed = fn(st, fresh)
        return result, self._next_version(cache, st, changed, keep, op)

    def _next_version(
        self,
        cache: _Cache,
        st: ShardState,
        changed: bool,
        keep: tuple[str, ...],
        op: str | None = None,
    ) -> Staged | None:
        """Finish the version a transition made of ``cache``'s state, ``st``: drop expired
        leases (but ``keep``'s), move the keys it retired to a :class:`RetiredChange`,
        make its history record (:func:`persist.history_record.make_record`, for the
        command ``op``; none for lease-only versions) and encode the entries (reusing
        the cached text of each unchanged one).  ``None`` when nothing changed."""
        if st.expire_leases(self.now_ms(), keep):
            changed = True
        retired: RetiredChange | None = None
        if st.retire_adds or st.retire_removes:
            # A key is retired at the seqno of the version that stops referencing it
            # (GC compares it with the readers' seqno holds).
            at = cache.state.seqno + 1
            retired = RetiredChange(
                st.retired_upper,
                retired_rows(st.retire_adds, at),
                dict(st.retire_removes),
            )
            st.retire_adds, st.retire_removes = {}, {}
            st.retired_upper += 1
            changed = True
        if not changed:
            return None
        st.seqno = cache.state.seqno + 1
        history = None
        if op is not None:
            record = make_record(cache.state, st, op, self.now_ms())
            if record is not None:
                history = HistoryAppend(st.history_upper, f"{st.seqno:020d}", record)
                st.history_record = record
                st.history_upper += 1
                st.history_ms = record["ms"]
                if record["time"] is not None and st.retention_ms is not None:
                    retention.note_commit(st, record["ms"], record["time"])
                    retention.advance(st, self.now_ms())
        data, texts, touched = self._encode(cache, st)
        if state_check.ENABLED:
            state_check.check_version(cache.state, cache.version.texts, st, data, texts, touched)
        plan = self.consensus.plan(
            self.shard_id, cache.state.seqno, texts, cache.version, touched=touched
        )
        return Staged(cache.state.seqno, st, data, texts, cache.version, retired, plan, history)

    @staticmethod
    def _encode(cache: _Cache, st: ShardState) -> tuple[dict[str, Any], dict[str, str], set[str]]:
        """The entries of ``st``, a version made of ``cache``'s, their texts and the keys
        that may differ.  Only the entries the command may have touched are looked at
        (the state's spine batches are shared with the cached version's): the cost of
        a version follows what changed, not the state's size."""
        old, old_texts = cache.version.data, cache.version.texts
        data, touched = st.to_entries_delta(cache.state, old)
        texts = state_codec.copy_entries(old_texts)
        for k in touched:
            v = data.get(k, _MISSING)
            if v is _MISSING:
                texts.pop(k, None)
                continue
            # Unchanged components are mostly the very objects of the cached version
            # (memoized JSON of immutable batches): identity first, equality after.
            o = old.get(k, _MISSING)
            texts[k] = old_texts[k] if o is v or o == v else Consensus.encode(v)
        return data, texts, touched

    def install(self, staged: Staged) -> None:
        """Cache a staged version once the caller's atomic append committed it."""
        self.metrics["cas"] += 1
        with self._lock:
            self._cache = _Cache(staged.state, _published(staged))
            self._rollup_due()

    # ----------------------------------------------------------------- writes
    def _apply(
        self,
        fn: Callable[[ShardState, bool], tuple[T, bool]],
        *,
        keep: tuple[str, ...] = (),
        on_indeterminate: Callable[[], None] | None = None,
        op: str | None = None,
    ) -> T:
        """Apply a transition and publish it by compare-and-set.

        ``fn(state, fresh)`` mutates ``state`` (a private copy of the latest known
        version; ``fresh`` tells whether it was just read from consensus) and returns
        ``(result, changed)``.  It raises :class:`Stale` to ask for a fresh state before
        failing, or any other exception to abort (nothing is committed).  Expired leases
        (except the ids in ``keep``) are dropped in the same version.
        ``on_indeterminate()`` is called once a compare-and-set's outcome was
        indeterminate, before ``fn`` runs again (it may have committed).  ``op``: the
        command's name for history (``None``: the version changes only leases).

        Returns: ``fn``'s result from the run whose version was committed (or that
        needed no change).

        Raises:
            whatever ``fn`` raises; ConsensusError (after retries, or on an indeterminate
            outcome that re-reading could not resolve).
        """
        with self._lock:
            fresh = False
            races = 0
            indeterminate = 0
            if self._cache is None:
                self.fetch()
                fresh = True
            while True:
                cache = self._cache
                assert cache is not None
                st = cache.state.clone()
                try:
                    result, changed = fn(st, fresh)
                except Stale:
                    if fresh:
                        raise
                    self.refresh()
                    fresh = True
                    continue
                staged = self._next_version(cache, st, changed, keep, op)
                if staged is None:
                    return result
                self.metrics["cas"] += 1
                try:
                    ok = self.consensus.compare_and_set(
                        self.shard_id,
                        cache.state.seqno,
                        staged.texts,
                        cache.version,
                        staged.retired,
                        plan=staged.plan,
                        history=staged.history,
                    )
                except ConsensusError as e:
                    if not e.is_indeterminate():
                        raise
                    self.metrics["indeterminate"] += 1
                    indeterminate += 1
                    if on_indeterminate is not None:
                        on_indeterminate()
                    log.warning(
                        "indeterminate commit on shard %s: %s",
                        self.shard_id,
                        e,
                        extra={"shard": self.shard_id, "seqno": cache.state.seqno + 1},
                    )
                    if indeterminate > 5:
                        raise
                    # Learn the outcome: re-read; fn recognises its own committed effect.
                    try:
                        self.refresh()
                    except ConsensusError as e2:
                        raise ConsensusError(
                            f"{e}; and re-reading the head to learn the outcome failed: {e2}",
                            indeterminate=True,
                        ) from e2
                    fresh = True
                    continue
                if ok:
                    self._cache = _Cache(st, _published(staged))
                    persist_metrics.observe_commit(cache.state, st, self.now_ms())
                    self._rollup_due()
                    return result
                self.metrics["cas_lost"] += 1
                races += 1
                if races > self.max_races:
                    raise ConsensusError(
                        f"shard {self.shard_id}: gave up after {races} lost compare-and-set races"
                    )
                if races > 2:
                    time.sleep(random.uniform(0, min(0.05, 0.0005 * 2 ** min(races, 10))))
                self.refresh()  # only the diffs after the cached version
                fresh = True

    # ------------------------------------------------------------- commands
    # One method per command, each running the ShardState method of the same (or the
    # named) name through the applier (after Materialize's persist-client
    # internal/machine.rs).  The clock is read on every attempt unless ``now_ms`` is
    # given; a ``seqno_hold`` is read under the machine's lock on every attempt.

    def _now(self, now_ms: int | None) -> int:
        return self.now_ms() if now_ms is None else now_ms

    def open_reader(
        self,
        reader_id: str,
        lease_ms: int,
        key_schema: pa.Schema,
        value_schema: pa.Schema,
        schema_id: int | None = None,
    ) -> int | None:
        """Register a read handle's reader (:meth:`ShardState.open_reader`)."""
        return self._apply(
            lambda st, fresh: (
                st.open_reader(
                    reader_id, self.now_ms(), lease_ms, key_schema, value_schema, schema_id
                ),
                True,
            ),
            keep=(reader_id,),
        )

    def register_listen(self, reader_id: str, as_of: int, now_ms: int, lease_ms: int) -> None:
        """Register a listen's reader (:meth:`ShardState.register_listen`)."""
        self._apply(
            lambda st, fresh: (None, st.register_listen(reader_id, as_of, now_ms, lease_ms, fresh)),
            keep=(reader_id,),
        )

    def downgrade_since(
        self,
        reader_id: str,
        since: Antichain,
        now_ms: int,
        seqno_hold: Callable[[], int | None] | None = None,
    ) -> None:
        """Move a reader's since hold (:meth:`ShardState.downgrade_since`)."""

        def fn(st: ShardState, fresh: bool) -> tuple[None, bool]:
            hold = None if seqno_hold is None else seqno_hold()
            return None, st.downgrade_since(reader_id, since, now_ms, hold, fresh)

        self._apply(fn, keep=(reader_id,), op="since")

    def heartbeat_reader(
        self, reader_id: str, now_ms: int, seqno_hold: Callable[[], int | None]
    ) -> None:
        """Renew a reader's lease and seqno hold (:meth:`ShardState.renew_reader`)."""

        def fn(st: ShardState, fresh: bool) -> tuple[None, bool]:
            return None, st.renew_reader(reader_id, now_ms, seqno_hold(), fresh)

        self._apply(fn, keep=(reader_id,))

    def detach_reader(self, reader_id: str, now_ms: int, seqno: int | None) -> None:
        """Keep only a reader's seqno hold (:meth:`ShardState.detach`)."""
        self._apply(
            lambda st, fresh: (None, st.detach(reader_id, now_ms, seqno, fresh)),
            keep=(reader_id,),
        )

    def expire_reader(self, reader_id: str) -> None:
        """Drop a reader (:meth:`ShardState.expire_reader`)."""
        self._apply(lambda st, fresh: (None, st.expire_reader(reader_id)))

    def register_writer(self, writer_id: str, now_ms: int, lease_ms: int, registered: bool) -> None:
        """Register or renew a writer (:meth:`ShardState.register_writer`)."""
        self._apply(
            lambda st, fresh: (
                None,
                st.register_writer(writer_id, now_ms, lease_ms, registered, fresh),
            ),
            keep=(writer_id,),
        )

    def register_compactor(
        self, writer_id: str, fallback_id: str, renew: bool, now_ms: int, lease_ms: int
    ) -> str:
        """Register or renew a compactor's writer (:meth:`ShardState.register_compactor`);
        returns the id registered."""
        return self._apply(
            lambda st, fresh: (
                st.register_compactor(writer_id, fallback_id, renew, now_ms, lease_ms, fresh),
                True,
            ),
            keep=(writer_id,),
        )

    def renew_writers(self, writer_ids: tuple[str, ...]) -> bool:
        """Renew live writers' leases (:meth:`ShardState.renew_writers`); returns whether
        every one was renewed (one found gone is found so on a freshly read version)."""
        return self._apply(lambda st, fresh: st.renew_writers(writer_ids, self.now_ms(), fresh))

    def settle_handed_off(self, handed: tuple[tuple[str, int], ...]) -> None:
        """Count hand-offs down (:meth:`ShardState.settle_handed_off`; a writer absent
        from the cached version is looked for on a freshly read one)."""
        self._apply(lambda st, fresh: (None, st.settle_handed_off(handed, fresh)))

    def hand_off(self, writer_id: str, lease_ms: int, batches: int) -> bool:
        """Hand a writer off (:meth:`ShardState.hand_off`); returns whether it is still
        registered (decided on a freshly read version when the cached one shows it
        gone or expired: a holder of its batches may have renewed it)."""
        return self._apply(
            lambda st, fresh: st.hand_off(writer_id, self.now_ms(), lease_ms, batches, fresh),
            keep=(writer_id,),
        )

    def expire_writer(self, writer_id: str) -> None:
        """Drop a writer (:meth:`ShardState.expire_writer`)."""
        self._apply(lambda st, fresh: (None, st.expire_writer(writer_id)))

    def expire_leases(self, now_ms: int) -> ShardState:
        """Drop every expired lease (:meth:`ShardState.expire_leases`); returns the state
        committed (or found needing no change)."""
        return self._apply(lambda st, fresh: (st, st.expire_leases(now_ms)))

    def register_schema(
        self, key_schema: pa.Schema, value_schema: pa.Schema, drop: Collection[str] = ()
    ) -> int:
        """Register a value schema version on the latest state only
        (:meth:`ShardState.register_schema`); returns its id."""

        def fn(st: ShardState, fresh: bool) -> tuple[int, bool]:
            if not fresh:
                raise Stale()  # decide on the latest versions only
            return st.register_schema(key_schema, value_schema, drop)

        return self._apply(fn, op="schema")

    def finalize(self, now_ms: int) -> None:
        """Make the state a tombstone (:meth:`ShardState.finalize`)."""
        self._apply(lambda st, fresh: (None, st.finalize(now_ms)))

    def forget_retired(self, done: Mapping[str, int] | None = None) -> None:
        """Forget retired rows GC deleted (``done``), or every one (``None``), as of the
        version committed on (:meth:`ShardState.forget_listed`; the retired collection
        is re-read unless its upper read equals that version's ``retired_upper``)."""
        seen: list[tuple[int, dict[str, int]]] = []

        def fn(st: ShardState, fresh: bool) -> tuple[None, bool]:
            if not seen or seen[0][0] != st.retired_upper:
                upper, rows = self.consensus.retired_entries(self.shard_id)
                seen[:] = [(upper, {r.entry: r.ms for r in rows.values()})]
            return None, st.forget_listed(seen[0][0], seen[0][1], done, fresh)

        self._apply(fn)

    def apply_merge_results(self, results: list[FueledMergeRes]) -> list[ApplyMergeResult]:
        """Swap compaction results into the trace (:meth:`ShardState.apply_merge_results`,
        the one place merge results are applied)."""
        return self._apply(
            lambda st, fresh: st.apply_merge_results(results, self.now_ms(), fresh), op="optimize"
        )

    def replace_batches(self, prefix: tuple[HollowBatch, ...], output: HollowBatch) -> bool:
        """Swap a full compaction's output in for the oldest batches
        (:meth:`ShardState.replace_batches`); returns whether it was applied."""
        return self._apply(
            lambda st, fresh: (
                ok := st.replace_batches(prefix, output, self.now_ms(), fresh),
                ok,
            ),
            op="optimize",
        )

    def adopt_store(self, store_id: str, store_name: str) -> None:
        """Record the blob store's identity in a shard that has none (a shard made
        before identities existed; no history record)."""

        def fn(st: ShardState, fresh: bool) -> tuple[None, bool]:
            if st.store_id is not None:
                return None, False
            st.store_id, st.store_name = store_id, store_name
            return None, True

        self._apply(fn)

    def set_retention(
        self, retention_ms: int | None, marks: tuple[tuple[int, int], ...], hold: int | None
    ) -> bool:
        """Set or clear the retention (:func:`persist.retention.set_retention`)."""
        return self._apply(
            lambda st, fresh: (
                ch := retention.set_retention(st, retention_ms, marks, hold, self.now_ms()),
                ch,
            ),
            op="retention",
        )

    def advance_retention(self, hold: int | None) -> bool:
        """Move the retention hold (:func:`persist.retention.advance_to`)."""
        return self._apply(
            lambda st, fresh: (ch := retention.advance_to(st, hold, self.now_ms()), ch),
            op="retention",
        )

    def _with_inputs(
        self,
        st: ShardState,
        inputs: Inputs,
        relist: Callable[[], object] | None,
        run: Callable[[int], tuple[T, bool]],
    ) -> tuple[T, bool]:
        """Run a command, reading what it asks for (:class:`NeedsInput`) as of ``st``
        and running it again: the retired part ids from consensus, or a listing of the
        given parts by ``relist`` (which raises ``PartsMissing``)."""
        while True:
            try:
                return run(self.now_ms())
            except NeedsInput as e:
                if e.what == "retired":
                    _upper, rows = self.consensus.retired_entries(self.shard_id)
                    inputs.retired = (e.retired_upper, frozenset(rows))
                else:
                    if relist is not None:
                        relist()
                    inputs.listed_upper = e.retired_upper

    def compare_and_append(
        self,
        cmd: AppendCmd,
        relist: Callable[[], object] | None = None,
        listed_upper: int | None = None,
        maybe_landed: bool = False,
    ) -> list[FueledMergeReq]:
        """Append (:meth:`ShardState.compare_and_append`); returns the Spine's merge
        requests.  ``listed_upper``: the ``retired_upper`` of a version read before the
        given parts were listed (``relist`` lists them again once a newer one is
        committed on); ``maybe_landed``: an earlier attempt's outcome was unknown (so
        is one of this call once a compare-and-set of it is indeterminate)."""
        inputs = Inputs(listed_upper=listed_upper, maybe_landed=maybe_landed)

        def fn(st: ShardState, fresh: bool) -> tuple[list[FueledMergeReq], bool]:
            return self._with_inputs(
                st, inputs, relist, lambda now: st.compare_and_append(cmd, inputs, now, fresh)
            )

        def landed_maybe() -> None:
            inputs.maybe_landed = True

        return self._apply(fn, keep=(cmd.writer_id,), on_indeterminate=landed_maybe, op="append")

    def stage_commit_txn(
        self, cmd: TxnCmd, fresh: bool, relist: Callable[[], object] | None = None
    ) -> tuple[tuple[str, Any], Staged | None]:
        """Stage this shard's part of a transaction (:meth:`ShardState.commit_txn`)
        without publishing it (see :meth:`_stage`); the caller holds :attr:`lock`."""
        inputs = Inputs()

        def fn(st: ShardState, fresh: bool) -> tuple[tuple[str, Any], bool]:
            return self._with_inputs(
                st, inputs, relist, lambda now: st.commit_txn(cmd, inputs, now, fresh)
            )

        return self._stage(fn, fresh, keep=(cmd.writer_id,), op="txn")


#: Every machine of this process (weakly held), for :func:`_after_fork_in_child`.
_MACHINES: weakref.WeakSet[ShardMachine] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """In a child made by ``os.fork`` (Spark forks its Python workers): a thread of the
    parent (the maintenance worker writing a rollup, a lease renewal) may have held a
    machine's lock at the fork, and no thread of the child would ever release it, so
    every machine gets new locks.  Its cached version stays valid: a version is only
    published by compare-and-set, so a command the parent had under way is at worst a
    newer version the child catches up with."""
    for m in list(_MACHINES):
        m._lock = threading.RLock()
        m._offered_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)

#: How many tokens of appends of unknown outcome a machine remembers (oldest first).
_ATTEMPTS_KEPT = 4096


def _published(staged: Staged) -> VersionedData:
    """The version ``staged`` made, as stored once its plan committed."""
    return VersionedData(staged.plan.seqno, staged.data, staged.texts, staged.plan.stored)
