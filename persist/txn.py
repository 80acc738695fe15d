"""Transactions across shards and stash collections.

Every shard's versions live in a stash collection (:mod:`persist.consensus`), and a stash
``append`` is atomic across collections.  A :class:`Txn` therefore commits new versions
of several shards, plus any stash :class:`~stash.AppendBatch` es of the same stash (a
catalog), in ONE stash ``append``: a reader sees all of it or none of it.  The idea comes
from Materialize's ``txn-wal`` crate (one commit makes writes to many shards visible
together); here the stash's multi-collection append gives it directly, with no extra
transaction shard.

Usage::

    with client.begin() as txn:          # persist.Txn
        txn.write("orders", updates)      # key/value columns, optional _diff; no _time
        txn.write("order_lines", more)
        txn.stash_append([catalog_batch])
        txn.update("stock", pc.field("id") == 1, {"qty": pc.field("qty") - 1})
        txn.commit_at(ts)                 # or txn.commit(): the smallest valid ts

Row-level changes (``txn.upsert``, ``txn.delete``, ``txn.update``) are planned on the
version each shard's commit lands on (:mod:`persist.txn_rows`).

This module holds the user-facing :class:`Txn`: building a transaction (:meth:`Txn.write`,
:meth:`Txn.write_batches`, :meth:`Txn.stash_append`, :meth:`Txn.stash_replace`), the rules
a commit time must keep (:meth:`Txn.commit_at`, :meth:`Txn.commit`), the bookkeeping of an
attempt whose outcome is unknown, and :meth:`Txn.abort`.  The commit protocol itself (one
stash append for every shard's version, under the machines' locks) is
:mod:`persist.txn_commit`; cross-shard-consistent reads are :mod:`persist.snapshots`
(both re-exported here: ``from persist.txn import TxnUpperMismatch, snapshot_many``).

Invariants kept here:

* **data goes up early**: :meth:`Txn.write` writes its updates as a batch at once,
  through the shard's :class:`~persist.write.BatchBuilder` (writer registration before
  the first upload, blob keys naming the writer, inline parts for small batches: the
  same path as a normal append).  Parts hold the raw time ``I64_MIN``; a commit at
  ``ts`` applies :meth:`~persist.batch.Batch.rewrite_ts` to a *copy* of each batch
  (metadata only), so a retry at a later ``ts`` never uploads a part again;
* **one atomic step**: :meth:`Txn.commit_at` gives every written shard its updates at
  ``ts`` and upper ``ts + 1`` (``[old upper, ts)`` recorded empty) and appends the stash
  batches, all in one stash ``append`` (:func:`persist.txn_commit.commit_shards`): a
  reader sees all of it or none of it.  The transaction's idempotency token is recorded
  in each shard's version with its commit time, apart from every writer lease
  (:mod:`persist.landed`: no expiry, hand-off or skewed clock drops it; the builder's
  writer is renewed as by a normal append);
* **a race is not a failure**: a shard whose upper is already beyond ``ts`` makes
  ``commit_at`` raise :class:`TxnUpperMismatch` (an :class:`UpperMismatch`) naming every
  such shard with its current upper, and nothing is committed; :meth:`Txn.commit`
  retries it at a later time by itself.  A stash batch whose lower check fails raises
  :class:`TxnUpperMismatch` naming the collection (nothing committed; the caller
  rebuilds the batch and swaps it in with :meth:`Txn.stash_replace`, keeping the
  parts); stash batches for one collection are merged into one (they must be made
  from the same upper: refused at :meth:`Txn.stash_append` otherwise);
* **bounded state**: the record ids of a client's acknowledged transactions are
  dropped from a shard's state by that client's next transaction on the shard (their
  outcome is known), so a stream of transactions keeps the writer list small;
* **nothing half-done**: a shard opened with another schema, updates not fitting the
  shard's schema (checked before a shard is opened with newer schemas, so a refused
  write registers no schema), a ``_time`` column, ``time_column`` times already below
  the shard's upper, a closed client, an expired writer, and a stash batch for a
  collection of another stash (or a persist-internal collection) are refused with
  :class:`~persist.errors.InvalidUsage` before anything is written; committing to a
  finalized shard, or one whose upper is the largest time, is
  :class:`~persist.errors.InvalidUsage` naming the shard (not a race); a
  writer whose lease ran out by commit time raises
  :class:`~persist.state.LeaseExpired` (nothing is committed);
* **unknown outcomes are settled before the next change, never double-applied**: when
  the stash loses the acknowledgement of the append, the transaction looks for its
  token in the shards' heads (:func:`persist.txn_commit.find_landed`); if found it
  committed, if not the same staging is retried (at the same ``ts``, on the fresh
  seqnos, so an old in-flight commit and the retry can never both land).  If the
  outcome stays unknown a :class:`~persist.errors.ConsensusError` with
  ``is_indeterminate()`` and the ``idempotency_token`` is raised; the parts are then
  kept (never deleted by :meth:`Txn.abort`), and the next ``write``, ``stash_*``,
  ``commit_at`` or ``commit`` on the same ``Txn`` first looks for the token (a change
  to a transaction that landed is refused).  Once the shard pruned records of versions
  after the one read before the first unknown outcome, the token's absence proves
  nothing and the outcome stays indeterminate.  A transaction with
  stash batches and no shard write has no token to look for: its indeterminate outcome
  is reported as such, and so is a later failed lower check of a retry (never a
  definite "nothing was committed", which would invite appending the batches twice);
* **abort**: :meth:`Txn.abort` (or an exception leaving ``with client.begin() as
  txn:``) deletes the parts the transaction uploaded, unless a commit of it may have
  landed;
* **consistent reads**: after ``commit_at(ts)`` returns, every written shard's snapshot
  as of any ``t >= ts`` (below each shard's upper) shows the transaction, and as of any
  ``t < ts`` none of it; :func:`~persist.snapshots.snapshot_many`
  (``client.snapshot_many``) reads several shards at one ``as_of``.  Per-shard
  ``snapshot`` calls at *different* times, or at the latest time of each shard
  separately, are not consistent with each other.

Sources of the idea: Materialize ``src/txn-wal`` (``TxnsHandle::begin``, ``Txn::write``,
``Txn::commit_at`` and its ``UpperMismatch`` retry with a later timestamp); pyiceberg's
``Transaction`` (``pyiceberg/table/__init__.py``: changes gathered first, checked and
committed together, or not at all).
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

from persist.batch import Batch
from persist.errors import ConsensusError, DiffOverflow, InvalidUsage, PersistError
from persist.ids import validate_shard_name
from persist.parts import DIFF, TIME
from persist.shards import Shards
from persist.snapshots import snapshot_many
from persist.state import LeaseExpired
from persist.txn_commit import (
    TxnUpperMismatch,
    check_stash_collections,
    commit_shards,
    find_landed,
    is_timed,
    lost_collection_upper,
    merged_stash_batches,
    timed_max,
    unknown_outcome,
)
from persist.txn_rows import ShardWrites, TxnRowChanges, settle_replaced
from persist.updates import to_updates_table, updates_schema
from persist.write import WriteHandle
from stash import Antichain, AppendBatch
from stash.antichain import I64_MAX, I64_MIN

__all__ = ["Txn", "TxnUpperMismatch", "snapshot_many"]

log = logging.getLogger(__name__)

#: The raw time of every update a transaction writes (a commit at ``ts`` rewrites it).
RAW_TIME = I64_MIN


def _time_range(table: pa.Table) -> tuple[int, int] | None:
    if table.num_rows == 0:
        return None
    mm = pc.min_max(table.column(TIME))
    return int(mm["min"].as_py()), int(mm["max"].as_py())


def _check_time(ts: object) -> int:
    if isinstance(ts, bool) or not isinstance(ts, int):
        raise InvalidUsage(f"a commit time must be an int, got {type(ts).__name__}")
    if not I64_MIN <= ts < I64_MAX:
        raise InvalidUsage(f"commit time {ts} is outside [-2**63, 2**63 - 1)")
    return ts


class Txn(TxnRowChanges):
    """A transaction over several shards and stash collections of one client (see the
    module docstring); row-level changes (:meth:`upsert`, :meth:`delete`,
    :meth:`update`) are :mod:`persist.txn_rows`'.  Made by :meth:`persist.client.PersistClient.begin`.  Not
    thread-safe: one thread builds and commits a transaction; several threads may each
    run their own transactions on one client (its lock order is in
    :mod:`persist.client`: a commit holds its shards' machine locks, in shard-id order,
    and takes the client's transaction lock, a leaf, only inside them; both are taken in
    :func:`persist.txn_commit.commit_shards`).

    Attributes:
        token: the idempotency token recorded in each written shard's state (under the
            transaction's own writer id for that shard).
        committed_ts: the time the transaction committed at (``None`` until then).
    """

    #: How many times an unknown commit outcome is re-examined before giving up.
    resolve_attempts: int = 8
    resolve_max_wait: float = 1.0
    #: How many races ``commit`` retries before giving up with the last mismatch.
    max_commit_attempts: int = 1000
    #: How many lost seqno races (upper still <= ts) one ``commit_at`` re-stages.
    max_races: int = 10_000

    def __init__(self, shard_ops: Shards) -> None:
        shard_ops.ctx.check_open()
        self._shard_ops = shard_ops
        self._ctx = shard_ops.ctx
        self._shards: dict[str, ShardWrites] = {}  # by shard id
        self._stash_batches: list[AppendBatch] = []
        self._row_ops: list[tuple[str, int]] = []
        self.token = uuid.uuid4().hex
        self.committed_ts: int | None = None
        self._aborted = False
        self._maybe_landed = False
        self._unknown_lo: int | None = None  # a seqno read before the first unknown attempt

    def __repr__(self) -> str:
        names = sorted(w.name for w in self._shards.values())
        return (
            f"Txn(shards={names}, stash_batches={len(self._stash_batches)}, "
            f"committed_ts={self.committed_ts})"
        )

    # ----------------------------------------------------------------- building
    def _check_pending(self) -> None:
        self._ctx.check_open()
        if self.committed_ts is not None:
            raise InvalidUsage(f"this transaction already committed at {self.committed_ts}")
        if self._aborted:
            raise InvalidUsage("this transaction was aborted")

    def _check_changeable(self) -> None:
        """:meth:`_check_pending`, and an earlier commit whose outcome was left unknown
        is settled first: a change added to a transaction that already landed would be
        silently left out of it (a retry of the commit only learns that it landed).
        Settled as landed, the transaction is finished and the change refused; as not
        landed, the change is taken and the next commit starts afresh.

        Raises:
            InvalidUsage: the transaction is finished or aborted, or its earlier commit
                turned out to have landed (naming the time; nothing is changed).
            ConsensusError: indeterminate: the earlier outcome cannot be learned.
        """
        self._check_pending()
        if not self._maybe_landed or not self._shards:
            return  # a stash-only transaction's retry settles it (see commit_at)
        landed = self._resolve_landed()
        if landed is None:
            self._maybe_landed, self._unknown_lo = False, None
            return
        self._finish(landed)
        raise InvalidUsage(
            f"this transaction's earlier commit, whose outcome was unknown, landed at "
            f"{landed}: it is committed as it was then, and nothing more can be added "
            "to it (begin a new transaction for this change)"
        )

    @property
    def shards(self) -> list[str]:
        """Names of the shards written so far."""
        return sorted(w.name for w in self._shards.values())

    def write(
        self,
        shard: str | WriteHandle,
        updates: pa.Table | pa.RecordBatch,
        *,
        key_schema: pa.Schema | None = None,
        value_schema: pa.Schema | None = None,
        time_column: str | None = None,
    ) -> None:
        """Write ``updates`` to ``shard`` as part of this transaction; the parts are
        uploaded now (small batches stay inline), committed by :meth:`commit_at`.

        Args:
            shard: a shard name (the shard must exist, unless both schemas are given:
                then it is opened, created if needed, like
                :meth:`~persist.client.PersistClient.open`), or a
                :class:`~persist.write.WriteHandle` of this client.
            updates: a ``pyarrow.Table``/``RecordBatch`` with the shard's key and value
                columns and an optional int64 ``_diff`` (default 1); no ``_time`` (the
                commit time is every update's time).
            key_schema, value_schema: optional; checked against the shard's.
            time_column: an extension for loads that keep their own times (e.g. one
                time per day in a month committed at once): this integer column gives
                each update's time instead.  Every such time must be ``<= ts`` and
                ``>=`` the shard's upper when the transaction commits at ``ts`` (a race
                that moves the upper past one is a :class:`TxnUpperMismatch` that no
                later ``ts`` can fix); a shard takes either timed or untimed writes in
                one transaction, not both.

        Raises:
            InvalidUsage: unknown shard; a shard opened with other schemas; columns not
                fitting the shard's schema (naming the shard); a ``_time`` column; a
                bad or null ``time_column``; timed and untimed writes to one shard; an
                expired writer; a closed client; a finished transaction.  Nothing is
                written.
            DiffOverflow: the diffs of one row of ``updates`` sum beyond int64 (naming
                the shard and the row's key and value, and its time with
                ``time_column``).  Nothing is written.
            BlobError, ConsensusError: the upload (or the writer's registration) failed;
                nothing of this call is kept.
        """
        self._check_changeable()
        wname = shard if isinstance(shard, str) else shard.name
        if isinstance(updates, pa.RecordBatch):
            updates = pa.Table.from_batches([updates])
        if not isinstance(updates, pa.Table):
            raise InvalidUsage(
                f"Txn.write to shard {wname!r} takes a pyarrow Table or RecordBatch, "
                f"not {type(updates).__name__}"
            )
        table = updates
        if time_column is None:
            if TIME in table.column_names:
                raise InvalidUsage(
                    f"Txn.write to shard {wname!r}: updates must not have a {TIME!r} "
                    "column (the commit time is every update's time; pass "
                    f"time_column={TIME!r} to give each update its own time)"
                )
        elif time_column not in table.column_names:
            raise InvalidUsage(
                f"Txn.write to shard {wname!r}: time_column {time_column!r} is not a "
                f"column of the updates {table.column_names}"
            )
        n = table.num_rows
        if DIFF not in table.column_names:
            table = table.append_column(DIFF, pa.repeat(pa.scalar(1, pa.int64()), n))
        if time_column is None:
            table = table.append_column(TIME, pa.repeat(pa.scalar(RAW_TIME, pa.int64()), n))
        elif time_column != TIME:
            if TIME in table.column_names:
                raise InvalidUsage(
                    f"Txn.write to shard {wname!r}: updates have both {TIME!r} and "
                    f"time_column {time_column!r}"
                )
            names = [TIME if n == time_column else n for n in table.column_names]
            table = table.rename_columns(names)
        if isinstance(shard, str) and key_schema is not None and value_schema is not None:
            # Check the updates against the schemas given BEFORE opening the shard with
            # them: opening may register a newer value schema (nothing half-done).
            updates_schema(key_schema, value_schema)
            self._check_evolution(shard, key_schema, value_schema)  # SchemaMismatch
            try:
                to_updates_table(table, key_schema, value_schema)
            except InvalidUsage as e:
                raise InvalidUsage(f"Txn.write to shard {wname!r}: {e} (nothing written)") from e
        w = self._writer_for(shard, key_schema, value_schema)
        self._check_no_rows(w)
        try:
            table = w._normalize(table)
        except InvalidUsage as e:
            raise InvalidUsage(f"Txn.write to shard {w.name!r}: {e}") from e
        if time_column is None:
            lower, upper = RAW_TIME, RAW_TIME + 1
        else:
            rng = _time_range(table)
            if rng is not None and rng[1] >= I64_MAX:
                raise InvalidUsage(f"Txn.write to shard {w.name!r}: time {rng[1]} is too large")
            lower, upper = (0, 1) if rng is None else (rng[0], rng[1] + 1)
        self._check_mode(w, [time_column is not None])
        if time_column is not None:
            cur = w._machine.recent().upper  # uppers only advance: a cached one is safe
            if rng is not None and not cur.less_equal(rng[0]):
                raise InvalidUsage(
                    f"Txn.write to shard {w.name!r}: time_column {time_column!r} has times "
                    f"from {rng[0]} to {rng[1]}, but the shard's upper is already {cur}: "
                    "times below the upper can never be written (nothing was written)"
                )
        builder = w.builder(Antichain.from_elem(lower))
        try:
            builder.add(table)
            batch = builder.finish(Antichain.from_elem(upper))
        except DiffOverflow as e:
            builder.abort()
            # Untimed updates hold a placeholder time until the commit: not theirs.
            row = (
                e.row if time_column is not None else {k: v for k, v in e.row.items() if k != TIME}
            )
            raise DiffOverflow(row, f"{w.name!r} ({w.shard_id})") from e
        except BaseException as e:
            builder.abort()  # settles the builder the handle lent
            if isinstance(e, LeaseExpired):  # dropped (e.g. by a skewed clock): a new one
                self._shard_ops.forget_txn_writer(w)
            raise
        if time_column is not None:
            batch.txn_timed = True  # type: ignore[attr-defined]
        sw = self._shards.setdefault(w.shard_id, ShardWrites(w.name, w))
        sw.batches.append(batch)
        sw.lent[id(batch)] = w

    def _check_evolution(self, name: str, key_schema: pa.Schema, value_schema: pa.Schema) -> None:
        """Raise :class:`~persist.errors.SchemaMismatch` if an existing shard ``name``
        cannot be opened with these schemas (checked on a copy of its freshly read
        state: nothing is registered here)."""
        c = self._ctx
        validate_shard_name(name)
        sid = c.consensus.lookup(name)
        if sid is None:
            return  # created by the open
        st = c.machine(sid).refresh()
        if not st.tombstone:
            st.clone().register_schema(key_schema, value_schema)

    def write_batches(self, shard: str | WriteHandle, batches: Sequence[Batch]) -> None:
        """Add batches written elsewhere (e.g. by Spark executors, turned back from
        :meth:`~persist.batch.Batch.into_transmittable` bytes with
        :meth:`~persist.write.WriteHandle.batch_from_transmittable`) to this
        transaction, as if :meth:`write` had written them: a batch ``[RAW_TIME,
        RAW_TIME + 1)`` (:data:`RAW_TIME`) takes the commit time; any other batch keeps
        its updates' own times (its ``time_range`` must be known), as with
        ``time_column``.  Their writers' leases are renewed while the batches are held
        (:meth:`~persist.write.WriteHandle.hold`, from when they were decoded or
        built); a writer whose lease had already run out before that makes the commit
        raise ``LeaseExpired``.

        A batch is appended once (as by
        :meth:`~persist.write.WriteHandle.compare_and_append_batch`): a batch sharing a
        part (blob key or inline nonce, :attr:`persist.types.PartRef.part_id`) with
        one already added is refused here, and :meth:`commit` refuses one whose parts
        the version it commits on references or retired (``BatchAppended``) or that
        are no longer in the blob store (``PartsMissing``), committing nothing.

        Raises:
            InvalidUsage: a batch of another shard, consumed, rewritten, without a
                known time range (timed), listed twice, sharing a part with a batch
                already added (two decodings of one batch's bytes), or mixing timed and
                untimed batches for one shard; the checks of :meth:`write`.
        """
        self._check_changeable()
        w = self._writer_for(shard, None, None)
        self._check_no_rows(w)
        batches = list(batches)
        seen = {id(b) for sw in self._shards.values() for b in sw.batches}
        held = {k for sw in self._shards.values() for b in sw.batches for k in b.part_ids()}
        flags: list[bool] = []
        raw = (Antichain.from_elem(RAW_TIME), Antichain.from_elem(RAW_TIME + 1))
        for b in batches:
            if not isinstance(b, Batch):
                raise InvalidUsage(f"write_batches takes Batch objects, got {type(b).__name__}")
            if b.shard_id != w.shard_id:
                raise InvalidUsage(f"{b!r} was written for another shard than {w.name!r}")
            if b.consumed or b.rewritten or id(b) in seen:
                raise InvalidUsage(
                    f"{b!r} was already appended, deleted, transmitted, rewritten or added"
                )
            seen.add(id(b))
            again = held.intersection(b.part_ids())
            if again:
                raise InvalidUsage(
                    f"{b!r} shares part {sorted(again)[0]} with a batch already added to "
                    "this transaction (one batch's transmittable bytes decoded twice?): "
                    "its updates would be appended twice"
                )
            held.update(b.part_ids())
            timed = (b.lower, b.upper) != raw
            if timed and b.len > 0 and b.time_range is None:
                raise InvalidUsage(f"{b!r} does not record its time range: it cannot be added")
            flags.append(timed)
        self._check_mode(w, flags)
        for b, timed in zip(batches, flags, strict=True):
            if timed:
                b.txn_timed = True  # type: ignore[attr-defined]
        sw = self._shards.setdefault(w.shard_id, ShardWrites(w.name, w))
        sw.batches.extend(batches)
        sw.given.extend(batches)

    def _check_no_rows(self, w: WriteHandle) -> None:
        """A shard takes row-level changes or updates in one transaction, not both."""
        sw = self._shards.get(w.shard_id)
        if sw is not None and sw.rows is not None:
            raise InvalidUsage(
                f"Txn.write to shard {w.name!r}: this transaction already makes row-level "
                "changes to it; one transaction takes either row-level changes or updates "
                "for a shard, not both (nothing was written)"
            )

    def _check_mode(self, w: WriteHandle, flags: Sequence[bool]) -> None:
        """A shard takes timed or untimed writes in one transaction, not both."""
        sw = self._shards.get(w.shard_id)
        all_flags = {*(is_timed(b) for b in (sw.batches if sw else [])), *flags}
        if len(all_flags) > 1:
            raise InvalidUsage(
                f"Txn.write to shard {w.name!r}: one transaction writes a shard either with "
                "the commit time or with time_column (its own times), not both"
            )

    def _writer_for(
        self,
        shard: str | WriteHandle,
        key_schema: pa.Schema | None,
        value_schema: pa.Schema | None,
    ) -> WriteHandle:
        c, ops = self._ctx, self._shard_ops
        if isinstance(shard, WriteHandle):
            w = shard
            if w._ctx is not c:
                raise InvalidUsage(f"{w!r} belongs to another PersistClient than this transaction")
            w._check()  # an expired writer is refused, naming it and the shard
            if key_schema is not None or value_schema is not None:
                raise InvalidUsage("pass schemas with a shard name, not with a WriteHandle")
        elif (key_schema is None) != (value_schema is None):
            raise InvalidUsage("Txn.write takes both key_schema and value_schema, or neither")
        elif key_schema is not None and value_schema is not None:
            m, schema_id = ops.open_machine(shard, key_schema, value_schema)
            w = ops.txn_writer(m, shard, key_schema, value_schema, schema_id)
        else:
            sid = c.shard_id(shard)
            m = c.machine(sid)
            # The shard's newest schema in its latest state (another process may have
            # evolved it): never this process's cached version.
            st = m.recent()
            if st.tombstone:
                raise InvalidUsage(
                    f"shard {shard!r} ({sid}) was finalized (dropped): it cannot be written"
                )
            w = ops.txn_writer(m, st.name, st.key_schema, st.value_schema, st.schemas().newest)
        return w

    def stash_append(self, batches: Sequence[AppendBatch]) -> None:
        """Add stash batches (e.g. catalog entries made with
        ``collection.make_batch(stash)`` / ``append_to_batch``) to commit with the
        shards; each is appended under its own lower check.  The batches are not copied:
        do not change them until the commit.

        Raises:
            InvalidUsage: not an ``AppendBatch``; a collection of another stash (its
                handle carries another stash's identity, or no collection of that name
                and id in this client's stash, or other codecs; naming both stashes,
                URLs redacted); a persist-internal collection (shard versions, the registry,
                a table's application transaction records);
                a batch added twice; a batch for a collection already given a batch
                with another lower, upper or compact (batches for one collection are
                committed as one, their entries merged).  Nothing is added.
            ConsensusError: listing the stash's collections failed.
        """
        self._add_stash_batches(batches, own=False)

    def _add_stash_batches(self, batches: Sequence[AppendBatch], *, own: bool) -> None:
        """:meth:`stash_append`; ``own``: the batches are persist's own (a table's
        application transaction records, :mod:`persist.app_txn`), so the refusal of
        persist-internal collections does not apply to them."""
        self._check_changeable()
        batches = list(batches)
        for b in batches:
            if not isinstance(b, AppendBatch):
                raise InvalidUsage(
                    f"stash_append takes AppendBatch objects, got {type(b).__name__}"
                )
        if not batches:
            return
        check_stash_collections(self._ctx.stash, batches, own=own)
        # Batches for one collection are committed as one batch (their entries merged):
        # they must agree on lower, upper and compact.
        firsts = {b.collection.name: b for b in self._stash_batches}
        for b in batches:
            if any(b is o for o in self._stash_batches) or sum(b is o for o in batches) > 1:
                raise InvalidUsage(
                    f"stash batch for collection {b.collection.name!r} was added twice to "
                    "this transaction (its entries would be appended twice)"
                )
            first = firsts.setdefault(b.collection.name, b)
            if (first.lower, first.upper, first.compact) != (b.lower, b.upper, b.compact):
                raise InvalidUsage(
                    f"stash batches for collection {b.collection.name!r} disagree: lower "
                    f"{first.lower}, upper {first.upper}, compact {first.compact} vs lower "
                    f"{b.lower}, upper {b.upper}, compact {b.compact}; batches for one "
                    "collection in a transaction are appended as one and must be made "
                    "from the same upper (nothing was added; to rebuild a batch whose "
                    "lower check failed, use stash_replace)"
                )
        self._stash_batches.extend(batches)

    def stash_replace(self, batches: Sequence[AppendBatch]) -> None:
        """Replace every stash batch this transaction holds for the collections of
        ``batches`` with ``batches`` (checked as by :meth:`stash_append`), keeping the
        shard writes and their uploaded parts: the way to rebuild a stash batch whose
        lower check failed (:class:`TxnUpperMismatch` naming it in ``collections``)::

            except TxnUpperMismatch as e:
                batch = cat.make_batch(stash)          # from the collection's upper now
                cat.append_to_batch(batch, key, value, 1)
                txn.stash_replace([batch])
                txn.commit_at(ts)                      # no part is uploaded again

        The batches of collections not named in ``batches`` are kept.

        Raises:
            InvalidUsage: as :meth:`stash_append` (then nothing is replaced); a
                transaction with no shard write whose earlier commit's outcome is unknown
                (it has no token to tell whether the old batches landed, so new ones could
                append twice).
            ConsensusError: listing the stash's collections failed.
        """
        self._replace_stash_batches(batches, own=False)

    def _replace_stash_batches(self, batches: Sequence[AppendBatch], *, own: bool) -> None:
        """:meth:`stash_replace`; ``own`` as for :meth:`_add_stash_batches`."""
        self._check_changeable()
        if self._maybe_landed and not self._shards:
            raise InvalidUsage(
                "stash_replace refused: an earlier commit of this transaction has an unknown "
                "outcome and it writes no shard, so nothing tells whether its stash batches "
                "landed (replacing them could append their entries twice)"
            )
        names = {b.collection.name for b in batches if isinstance(b, AppendBatch)}
        before = self._stash_batches
        self._stash_batches = [b for b in before if b.collection.name not in names]
        try:
            self._add_stash_batches(batches, own=own)
        except BaseException:
            self._stash_batches = before
            raise

    # -------------------------------------------------------------- committing
    def commit_at(self, ts: int) -> int:
        """Commit everything at ``ts`` in one stash transaction (all or nothing): each
        written shard gets its updates at ``ts`` and its upper ``ts + 1`` (``[old
        upper, ts)`` recorded empty); each stash batch is appended under its lower
        check.

        Returns: the time the transaction committed at (``ts``, or an earlier attempt's
            time if that attempt's outcome was unknown and it turned out to have landed).

        Raises:
            TxnUpperMismatch: a shard's upper is beyond ``ts`` (naming every such shard
                and its upper) or a stash batch's lower check failed; nothing was
                committed, the parts are kept: retry with a later ``ts`` (no upload).
            LeaseExpired: a written shard's writer lease ran out (its parts may be gone);
                nothing committed.
            InvalidUsage: bad ``ts``; a ``time_column`` write with a time after ``ts``;
                a finalized shard; a finished transaction; a batch appended, deleted or
                transmitted since it was added (e.g. by another transaction).
            ConsensusError: the stash failed; nothing was committed unless
                ``is_indeterminate()`` (then ``idempotency_token`` is this ``token``;
                a stash-only transaction whose earlier attempt's outcome is unknown
                stays indeterminate when a retry's lower check fails).
        """
        self._check_pending()
        ts = _check_time(ts)
        for sw in self._shards.values():
            hi = timed_max(sw.batches)
            if hi is not None and hi > ts:
                raise InvalidUsage(
                    f"cannot commit at {ts}: the write to shard {sw.name!r} with its own "
                    f"times has time {hi}, after the commit time (nothing was committed)"
                )
        if not self._shards:
            return self._commit_stash_only(ts)
        landed = self._resolve_landed() if self._maybe_landed else None
        if landed is not None:
            return self._finish(landed)
        self._maybe_landed, self._unknown_lo = False, None  # it did not land
        self._check_not_consumed()
        indeterminate = 0
        while True:
            # Until this attempt's outcome is known, it may have landed: an exception that
            # is none of the answers below (an interrupt, an error the stash did not
            # wrap) leaves the parts to GC instead of letting abort delete them.
            prior = self._maybe_landed
            prior_lo: int | None = self._unknown_lo
            self._maybe_landed = True
            if self._unknown_lo is None:  # any attempt lands after this version
                self._unknown_lo = self._ctx.machine(sorted(self._shards)[0]).state().seqno
            try:
                out = self._attempt(ts)
            except ConsensusError as e:
                if not e.is_indeterminate():
                    self._maybe_landed, self._unknown_lo = prior, prior_lo
                    if indeterminate:
                        raise self._unknown(e) from e
                    raise
                self._maybe_landed = True
                for sw in self._shards.values():
                    if sw.rows is not None:  # the batches it sent may have landed
                        sw.rows.keep_replaced = True
                indeterminate += 1
                log.warning("indeterminate commit of a transaction at %s: %s", ts, e)
                landed = self._resolve_landed()
                if landed is not None:
                    return self._finish(landed)
                if indeterminate >= self.resolve_attempts:
                    raise self._unknown(e) from e
                time.sleep(min(self.resolve_max_wait, 0.005 * 2**indeterminate))
                continue
            except LeaseExpired as e:
                self._maybe_landed, self._unknown_lo = prior, prior_lo
                for sw in self._shards.values():
                    if sw.writer.writer_id == e.handle_id:
                        self._shard_ops.forget_txn_writer(sw.writer)
                if indeterminate:
                    landed = self._resolve_landed()
                    if landed is not None:
                        return self._finish(landed)
                raise
            except PersistError as e:
                self._maybe_landed, self._unknown_lo = prior, prior_lo
                if indeterminate and not isinstance(e, TxnUpperMismatch | LeaseExpired):
                    raise
                if indeterminate:
                    # A race now: but an earlier attempt may have landed.
                    landed = self._resolve_landed()
                    if landed is not None:
                        return self._finish(landed)
                raise
            return self._finish(out)

    def _check_not_consumed(self) -> None:
        """Refuse a batch that was appended, deleted or transmitted since it was added
        (e.g. committed by another transaction it was also added to): committing it
        again would add its updates twice.

        Raises:
            InvalidUsage: naming the batch and its shard; nothing is committed.
        """
        for sw in self._shards.values():
            for b in sw.batches:
                if b.consumed:
                    raise InvalidUsage(
                        f"{b!r} of the write to shard {sw.name!r} was appended, deleted or "
                        "transmitted since it was added to this transaction (nothing was "
                        "committed)"
                    )

    def _unknown(self, e: ConsensusError) -> ConsensusError:
        return unknown_outcome(self.token, str(e))

    def commit(self) -> int:
        """Commit at the smallest valid time: the largest upper of the written shards
        (freshly read) and time of their ``time_column`` writes, retrying by itself with
        a later time when a race moves an upper past it.

        Returns: the commit time.

        Raises: as :meth:`commit_at`, except that a shard race is retried (a stash
            batch's failed lower check is not: it raises :class:`TxnUpperMismatch`);
            also InvalidUsage naming the shard when a written shard was finalized or
            its upper is the largest time (no time is left to commit at).
        """
        self._check_pending()
        if not self._shards:
            return self.commit_at(0)
        ts = I64_MIN
        for sid in sorted(self._shards):
            m = self._ctx.machine(sid)
            up = m.recent().upper.as_option()
            name = self._shards[sid].name
            if up is None or up >= I64_MAX:
                st = m.refresh()
                if st.tombstone:
                    raise InvalidUsage(
                        f"cannot commit: shard {name!r} ({sid}) was finalized (dropped by "
                        "finalize_shard or `persist drop`): it can never be written again "
                        "(nothing was committed)"
                    )
                up = st.upper.as_option()
            if up is None:
                raise TxnUpperMismatch(0, {name: Antichain()})  # sealed for ever
            if up >= I64_MAX:
                raise InvalidUsage(
                    f"cannot commit: shard {name!r} ({sid}) has upper {{{up}}}, the "
                    "largest time: no time is left to write it at (nothing was committed)"
                )
            ts = max(ts, up)
            hi = timed_max(self._shards[sid].batches)
            if hi is not None:
                ts = max(ts, hi)
        for attempt in range(self.max_commit_attempts):
            try:
                return self.commit_at(ts)
            except TxnUpperMismatch as e:
                nxt = e.retry_ts()
                if nxt is None or attempt + 1 == self.max_commit_attempts:
                    raise
                ts = max(nxt, ts + 1) if nxt <= ts else nxt
                if attempt > 2:
                    time.sleep(random.uniform(0, min(0.05, 0.0005 * 2 ** min(attempt, 10))))
        raise AssertionError("unreachable")  # pragma: no cover

    def _commit_stash_only(self, ts: int) -> int:
        """Append the stash batches alone.  They carry no token, so once an attempt's
        outcome is unknown a later failed lower check cannot tell "another writer
        appended" from "our own append landed": it stays indeterminate (never a
        definite "nothing was committed", which would invite a duplicate)."""
        if not self._stash_batches:
            return self._finish(ts)
        c = self._ctx.consensus
        batches = merged_stash_batches(self._stash_batches)
        try:
            lost = c.append_atomic(batches, "a transaction's stash append")
        except ConsensusError as e:
            if e.is_indeterminate() or self._maybe_landed:
                self._maybe_landed = True
                raise self._unknown(e) from e
            raise
        if lost is not None:
            cur = lost_collection_upper(self._ctx, batches, lost)
            if self._maybe_landed:
                raise unknown_outcome(
                    self.token,
                    "an earlier attempt's acknowledgement was lost and stash collection "
                    f"{lost!r} moved on to upper {cur} (by that attempt or by another "
                    "writer; a stash-only transaction has no token to tell which)",
                )
            raise TxnUpperMismatch(ts, {}, {lost: cur})
        return self._finish(ts)

    def _attempt(self, ts: int) -> int:
        """One commit attempt at ``ts`` (:func:`persist.txn_commit.commit_shards`).
        Returns the committed time."""
        return commit_shards(
            self._shard_ops,
            self._shards,
            self._stash_batches,
            self.token,
            ts,
            max_races=self.max_races,
        )

    def _resolve_landed(self) -> int | None:
        """The time an earlier commit of this transaction landed at, or ``None`` if it
        did not (:func:`persist.txn_commit.find_landed`; raises its indeterminate
        :class:`~persist.errors.ConsensusError`)."""
        return find_landed(
            self._ctx,
            self._shards,
            self.token,
            self._unknown_lo,
            attempts=self.resolve_attempts,
            max_wait=self.resolve_max_wait,
        )

    def _finish(self, ts: int) -> int:
        self.committed_ts = ts
        self._maybe_landed = False
        for sid, sw in self._shards.items():
            if sw.wrote:  # else its changes changed nothing: no record, no registration
                self._shard_ops.txn_done_add(sid, sw.record_id)
            w = sw.writer
            for b in sw.batches:
                b.mark_consumed()
            settle_replaced(sw)
            self._return_lent(sw)
            if sw.wrote:
                w._registered = True
                w._last_heartbeat_ms = w._machine.now_ms()
        return ts

    # ------------------------------------------------------------------- abort
    def abort(self) -> None:
        """Give the transaction up: delete the parts it uploaded (kept for GC instead if
        a commit of it may have landed: an indeterminate outcome, or an attempt cut short
        by an exception before its outcome was known).  Idempotent; a no-op after a
        commit."""
        if self.committed_ts is not None or self._aborted:
            return
        self._aborted = True
        for sw in self._shards.values():
            for b in sw.batches:
                if self._maybe_landed:
                    b.mark_consumed()  # maybe referenced: GC decides
                else:
                    b.delete()
            if sw.rows is not None and self._maybe_landed:
                sw.rows.keep_replaced = True
            settle_replaced(sw)
            self._return_lent(sw)

    @staticmethod
    def _return_lent(sw: ShardWrites) -> None:
        """The builders :meth:`write` borrowed are settled (a handle whose lent
        batches were all appended or deleted may unregister on ``expire``)."""
        for h in sw.lent.values():
            h._lent = max(0, h._lent - 1)
        sw.lent.clear()

    def __enter__(self) -> Txn:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        """An exception aborts (deleting the uploaded parts); a clean exit commits what
        was not committed yet (with :meth:`commit`) and aborts if that fails."""
        if exc_type is not None:
            self.abort()
            return
        if self.committed_ts is None and not self._aborted:
            try:
                self.commit()
            except BaseException:
                self.abort()
                raise
