"""Writing a shard: compare-and-append of updates or of pre-written batches.

A :class:`WriteHandle` appends to one shard (the persist-client ``WriteHandle``).  An
append writes the batch's parts to blob *first* (or keeps a small batch inline, in the
state itself: Materialize's inline writes, ``src/persist-client/src/batch.rs``), then commits the new state version by
compare-and-set in consensus.

Invariants kept here:

* every ``_time`` of an append lies in ``[expected_upper, new_upper)``, else
  ``UpdateNotBeyondLower`` / ``UpdateBeyondUpper`` and nothing is written anywhere;
* ``compare_and_append`` commits atomically or raises ``UpperMismatch`` (``.expected``,
  ``.current``) with nothing visible; the parts it had written are then deleted;
* a lost race on the seqno with the upper still matching (a reader, a compactor or GC
  changed the state) is retried on the metadata only: parts are uploaded once per batch,
  however many compare-and-set attempts the commit needs;
* ``compare_and_append_batch`` follows Materialize's ``validate_truncate_batch``: each batch
  covers the append (``batch.lower <= expected_upper``, ``new_upper <= batch.upper``,
  else ``InvalidBatchBounds``) and only its updates in ``[expected_upper, new_upper)``
  become visible (the rest is truncated away: metadata only when the batch's time range
  shows nothing to cut, else by writing the kept updates as a new run); a rewritten
  batch must end exactly at ``new_upper`` and mean no time before ``expected_upper``
  (``InvalidRewrite``); its rewrite is applied without a blob call when the append's
  rewritten batches share one frontier;
* an indeterminate commit (the stash lost the acknowledgement of COMMIT) is resolved by
  the append itself: it re-applies the same version, with the same idempotency token,
  re-reading consensus with backoff, until it learns the outcome (the token is recorded
  with the writer, which keeps its last few tokens, in the version that commits the
  append); an append of its own that landed is reported as success, never as
  ``UpperMismatch``.  If the outcome still cannot be learned, a ``ConsensusError`` with
  ``is_indeterminate()`` and ``idempotency_token`` is raised and the parts are left in
  place (GC collects them if the append did not land); a retry passing that token
  returns success without writing again if the append landed;
* a writer is registered in the shard state (its lease) before its first upload, and
  its parts' keys name it (:mod:`persist.keys`), stamped when each run is written; GC
  never deletes the parts of a writer registered in the state it decides on (it
  commits the expiry of the others first, :mod:`persist.gc`); a writer dropped from the
  state is never registered again, and an append refuses, committing nothing, a
  batch whose parts are gone (``PartsMissing``) or when this writer, or one whose
  parts it references, is not registered and live in the version it commits on
  (``LeaseExpired``): decided on that version, never on a cached one; a batch held unconsumed, or a builder holding uploaded parts,
  keeps the leases of its parts' writers alive in the background (:meth:`WriteHandle.hold`,
  every quarter lease, through the handle's :attr:`WriteHandle.lease_keeper`), so it
  stays appendable however long it is held; a writer already gone is never renewed;
  a handle that expires with batches it handed out and did not append hands its
  writer off (kept for the client's ``handoff_lease_seconds``, counted down by each
  append of those batches, dropped at zero), so bytes in transit stay appendable too;
* a :class:`BatchBuilder` checks times at ``add`` (``>= lower``) and ``finish``
  (``< upper``); a failed ``add`` leaves it exactly as before the call and a failed
  ``finish`` leaves it unfinished with every accepted update, so a finished batch never
  misses an accepted row; flushed chunks in (key, value, time) order extend one run;
  ``abort`` after a successful ``finish`` does nothing (the batch owns the parts);
* a part is appended once: an append pushing, as they are, parts the version it
  commits on references (or retired) is refused (``BatchAppended``), so a batch's
  transmittable bytes decoded twice never count twice, across calls as within one
  (parts named by blob key or inline nonce; a copy racing a GC is refused, never
  committed pointing at deleted parts: see :mod:`persist.appended`);
* an idempotency token names one append exactly, its bounds and contents
  (:mod:`persist.fingerprint`): a token reused on another append is refused
  (``InvalidUsage``), never taken for a landed retry.

Sources: the persist-client ``WriteHandle``, ``BatchBuilder`` and
``validate_truncate_batch`` (Materialize's ``src/persist-client/src/batch.rs``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from persist import metrics as persist_metrics
from persist.appended import inline_ids
from persist.batch import Batch
from persist.commands import AppendCmd
from persist.consolidation import _adjacent
from persist.errors import (
    BatchAppended,
    ConsensusError,
    DiffOverflow,
    InvalidBatchBounds,
    InvalidBounds,
    InvalidRewrite,
    InvalidUsage,
    PartsMissing,
    PersistError,
    UpdateBeyondUpper,
    UpdateNotBeyondLower,
)
from persist.fetch import read_batch
from persist.fingerprint import batches_fingerprint, check_same_append, updates_fingerprint
from persist.handle import ShardHandle
from persist.keys import key_writer_id, part_name_prefix
from persist.lease import DEFAULT_KEEPER, LeaseKeeper
from persist.machine import ShardMachine
from persist.parts import (
    TIME,
    consolidate_order,
    to_updates_table,
    write_parts,
)
from persist.spine import worth_compacting
from persist.state import (
    TOKEN_FOREIGN,
    TOKEN_SEP,
    TOKEN_UNKNOWN,
    token_for,
    token_verdict,
)
from persist.types import Description, HollowBatch, PartRef
from persist.updates import check_whole_days
from stash import Antichain

if TYPE_CHECKING:
    from persist.context import PersistContext

__all__ = ["BatchBuilder", "WriteHandle"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


@contextlib.contextmanager
def _carrying_token(token: str) -> Iterator[None]:
    """Set ``idempotency_token`` on an indeterminate :class:`PersistError` leaving the
    block (e.g. the writer's registration before an upload), so that the caller's retry
    with it stays idempotent whichever commit's outcome was lost."""
    try:
        yield
    except PersistError as e:
        if e.is_indeterminate() and e.idempotency_token is None:
            e.idempotency_token = token
        raise


Updates = Any
"""A ``pyarrow.Table``/``RecordBatch`` or a list of ``((key, value), time, diff)``."""


def _frontier(x: Antichain | int, what: str) -> Antichain:
    if isinstance(x, Antichain):
        return x
    if isinstance(x, bool) or not isinstance(x, int):
        raise InvalidUsage(f"{what} must be an Antichain or an int, got {type(x).__name__}")
    if not -(2**63) <= x < 2**63:
        raise InvalidUsage(f"{what} {x} is outside the i64 range of times")
    return Antichain.from_elem(x)


class _TokenSource:
    """Fresh idempotency tokens without a system call each (:func:`persist.state.token_for`):
    the first 16 hex digits of the writer's id (so the state tells which writer a token
    belongs to, :func:`persist.state.token_verdict`), 8 random ones per process
    (``os.urandom``, drawn again in a forked child) and an 8-digit counter, dot-separated,
    so tokens never repeat and
    a writer's tokens from one process are ordered by when they were drawn.  A forked
    child gets a fresh lock (:meth:`after_fork_in_child`), so a fork while another
    thread draws a token cannot deadlock the child.  (A ``uuid4`` per append costs a
    ``getrandom`` call, which releases the GIL and so waits for the compactor thread to
    hand it back.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._process = ""
        self._count = 0

    def after_fork_in_child(self) -> None:
        """Make the source usable in a forked child: a fresh lock (the parent's may have
        been held by a thread that does not exist in the child) and new random digits."""
        self._lock = threading.Lock()
        self._pid = -1

    def next(self, writer_id: str) -> str:
        with self._lock:
            pid = os.getpid()
            if pid != self._pid or self._count >= (1 << 32) - 1:
                self._pid, self._process, self._count = pid, os.urandom(4).hex(), 0
            self._count += 1
            return token_for(writer_id, self._process, self._count)


_tokens = _TokenSource()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_tokens.after_fork_in_child)


def _token(token: str | None, writer_id: str) -> str:
    """A fresh idempotency token of ``writer_id``, or ``token`` checked."""
    if token is None:
        return _tokens.next(writer_id)
    if not isinstance(token, str) or not 8 <= len(token) <= 128 or not token.isprintable():
        raise InvalidUsage(
            "idempotency_token must be a printable str of 8 to 128 characters "
            "(the one an indeterminate error carried)"
        )
    return token


def handed_off_owners(batches: Sequence[Batch], appender: str) -> dict[str, int]:
    """How many of ``batches`` each other writer wrote parts of (writer id -> batches):
    an append of them counts those batches down from the writers' hand-off (see
    :meth:`ShardState.release_handed_off`)."""
    out: dict[str, int] = {}
    for b in batches:
        for w in {key_writer_id(k) for k in b.blob_keys()}:
            if w is not None and w != appender:
                out[w] = out.get(w, 0) + 1
    return out


#: Tables of at most this many rows take the pure-Python paths of :func:`_time_range`
#: (a pyarrow compute call costs tens of microseconds however small its input).
_SMALL_ROWS = 32


def _time_range(table: pa.Table) -> tuple[int, int] | None:
    """The least and greatest ``_time`` of a normalized updates ``table`` (``_time`` is
    non-null int64), or ``None`` when it is empty."""
    n = table.num_rows
    if n == 0:
        return None
    if n <= _SMALL_ROWS:
        times = table.column(TIME).to_pylist()
        return min(times), max(times)
    mm = pc.min_max(table.column(TIME))
    return int(mm["min"].as_py()), int(mm["max"].as_py())


class WriteHandle(ShardHandle):
    """A writer of one shard.  Made by :meth:`persist.client.PersistClient.open`.

    Attributes:
        shard_id: the shard's id.  name: its registered name.
        writer_id: this writer's id in the shard state.
        key_schema, value_schema: the shard's schemas; ``schema`` the updates schema.
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
        self._created_ms = machine.now_ms()
        # _normalize: the last input schema found to have this handle's column names and
        # types in order, and the columns that must hold no null.
        self._conforming: pa.Schema | None = None
        self._not_null = [i for i, f in enumerate(self.schema) if not f.nullable]
        self._lent = 0  # builders handed out whose batch this handle has not appended
        # Batches of its builders, with blob parts, transmitted to another process.
        self._transmitted = 0

    # ---------------------------------------------------------------- frontiers
    @property
    def upper(self) -> Antichain:
        """The most recent upper this process knows of (no consensus call)."""
        return self._machine.state().upper

    # ------------------------------------------------------------------- writing
    def _key_prefix(self, kind: str = "b") -> str:
        """The stem of a run's blob keys, ``<shard_id>/<kind>/<writer id>-<unix ms>``,
        stamped now (call it per run); its parts are ``<stem>-<uuid>.parquet`` (see
        :mod:`persist.keys`): one flat directory per shard and kind."""
        name = part_name_prefix(self.writer_id, self._machine.now_ms())
        return f"{self.shard_id}/{kind}/{name[:-1]}"

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

    def _check_appendable(self, batches: Sequence[Batch], fresh: Batch | None) -> set[str]:
        """Before an append of pre-written ``batches``: every blob part they reference
        must exist (one listing per writer whose parts they hold).  Returns the writers
        the parts name, which must be live when the append commits.

        Raises:
            PartsMissing: a part is not in the blob store (nothing is committed).
        """
        owners: set[str] = set()
        keys = [k for b in batches if b is not fresh for k in b.blob_keys()]
        for b in batches:
            owners.update(w for k in b.blob_keys() if (w := key_writer_id(k)) is not None)
        if not keys:
            return owners
        prefixes: dict[str, list[str]] = {}
        for k in keys:
            w = key_writer_id(k)
            prefix = k if w is None else k[: k.index(w) + len(w) + 1]
            prefixes.setdefault(prefix, []).append(k)
        missing: list[str] = []
        blob = self._ctx.blob
        for prefix, ks in prefixes.items():
            present = {k for k, _ in blob.list_keys(prefix)}
            missing.extend(k for k in ks if k not in present)
        if missing:
            raise PartsMissing(self.shard_id, sorted(missing))
        return owners

    def _inline_max(self) -> int:
        """Inline writes are allowed while the state holds less than the total budget."""
        cfg = self._ctx.config
        if self._machine.state().inline_bytes() >= cfg.inline_total_max_bytes:
            return 0
        return cfg.inline_max_bytes

    def _normalize(self, updates: Updates) -> pa.Table:
        """``updates`` as a table of exactly :attr:`schema` (:func:`to_updates_table`).
        A table whose columns already have the schema's names and types, in order, with
        no null in a non-nullable column, is only relabelled with the schema (returned as
        it is if its schema is equal, metadata included): what :func:`to_updates_table`
        would rebuild it into, without looking each column up by name."""
        if isinstance(updates, pa.Table):
            schema = self.schema
            us = updates.schema
            if us.equals(schema, check_metadata=True):
                same = True
            elif self._conforming is not None and us.equals(self._conforming, check_metadata=True):
                same = False  # names and types checked before (``.types`` costs ~60 µs)
            elif us.names == schema.names and us.types == schema.types:
                self._conforming, same = us, False
            else:
                return to_updates_table(updates, self.key_schema, self.value_schema)
            if all(updates.column(i).null_count == 0 for i in self._not_null):
                return check_whole_days(
                    updates if same else pa.Table.from_arrays(updates.columns, schema=schema)
                )
        return to_updates_table(updates, self.key_schema, self.value_schema)

    def _write_run(
        self, table: pa.Table, value_schema: pa.Schema | None = None, schema_id: int | None = None
    ) -> list[PartRef]:
        """Consolidate (sort) ``table`` and write it as one run (:meth:`_write_sorted`);
        ``table`` has this handle's value schema, or ``value_schema`` (version
        ``schema_id``)."""
        vs = self.value_schema if value_schema is None else value_schema
        try:
            table, order = consolidate_order(table, self.key_schema.names, vs.names)
        except DiffOverflow as e:
            raise e.in_shard(f"{self.name!r} ({self.shard_id})") from e
        if (table.num_rows if order is None else len(order)) == 0:
            return []
        return self._write_sorted(table, order, schema_id)

    def _write_sorted(
        self, table: pa.Table, order: Any, schema_id: int | None = None
    ) -> list[PartRef]:
        """Write ``table`` (in ``order``, from :func:`consolidate_order`) as one run, its
        parts' keys stamped now (:meth:`_key_prefix`), the writer registered before the
        first upload."""
        ctx = self._ctx
        directory, name = self._key_prefix().rsplit("/", 1)
        refs = write_parts(
            ctx.blob,
            table,
            directory,
            target_part_bytes=ctx.config.target_part_bytes,
            inline_max_bytes=self._inline_max(),
            max_workers=ctx.config.write_workers,
            order=order,
            name_prefix=name + "-",
            before_upload=self._ensure_registered,
            key_names=self.key_schema.names,
        )
        # Each part records the schema version it was written with.
        sid = self.schema_id if schema_id is None else schema_id
        return refs if not sid else [replace(r, schema_id=sid) for r in refs]

    def builder(self, lower: Antichain | int) -> BatchBuilder:
        """A :class:`BatchBuilder` for a batch starting at ``lower``."""
        self._check()
        b = BatchBuilder(self, _frontier(lower, "lower"))
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
                nothing again, however many appends came since (the client settles the
                outcome from the next shard state it sees); if whether it landed can no
                longer be told, it raises an indeterminate :class:`ConsensusError` and
                writes nothing.  The token names that append exactly (its bounds and
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
        self._check()
        expected = _frontier(expected_upper, "expected_upper")
        new = _frontier(new_upper, "new_upper")
        if not expected <= new:
            raise InvalidBounds(expected, new)
        token = _token(idempotency_token, self.writer_id)
        table = self._normalize(updates)
        rng = _time_range(table)
        if rng is not None:
            if not expected.less_equal(rng[0]):
                raise UpdateNotBeyondLower(rng[0], expected)
            if new.less_equal(rng[1]):
                raise UpdateBeyondUpper(rng[1], new)
        fingerprint = updates_fingerprint(expected, new, table)
        if idempotency_token is not None and self._token_landed(token, fingerprint):
            return  # an earlier attempt landed: write nothing again
        if expected == new:
            # Nothing can be written into an empty range: just check the upper.
            self._append_batches([], expected, new, token, fingerprint=fingerprint)
            return
        with _carrying_token(token):
            run = self._write_run(table)
        hollow = HollowBatch(
            desc=Description(expected, new),
            parts=tuple(run),
            len=sum(p.rows for p in run),
        )
        batch = Batch(self._ctx.blob, self.shard_id, hollow, time_range=rng)
        try:
            self._append_batches(
                [batch], expected, new, token, fresh=batch, fingerprint=fingerprint
            )
        except PersistError as e:
            if not e.is_indeterminate():
                batch.delete()
            raise

    def append(self, updates: Updates, lower: Antichain | int, upper: Antichain | int) -> None:
        """Append ``updates`` at ``[lower, upper)``: the shard's upper must be ``lower``
        (the persist-client ``append``; same errors as :meth:`compare_and_append`)."""
        self.compare_and_append(updates, lower, upper)

    # ------------------------------------------------------ batch bounds (seed)
    @staticmethod
    def _validate_truncate(batches: Sequence[Batch], expected: Antichain, new: Antichain) -> None:
        """Materialize's ``validate_truncate_batch``: every batch must *cover* the append
        (``batch.lower <= expected`` and ``new <= batch.upper``; what lies outside
        ``[expected, new)`` is truncated away); if any batch was rewritten, every batch
        must end exactly at ``new`` and mean no time before ``expected``.

        Raises:
            InvalidRewrite, InvalidBatchBounds.
        """
        any_rewrite = any(b.rewritten for b in batches)
        for b in batches:
            if any_rewrite:
                if b.upper != new:
                    raise InvalidRewrite(
                        f"rewritten batches must end at the append's upper: {b!r} might "
                        f"have data past {new} up to {b.upper}"
                    )
                if not expected <= b.floor():
                    raise InvalidRewrite(
                        f"rewritten batches must not mean times before the append's lower: "
                        f"{b!r} might have data below {expected} at {b.floor()}"
                    )
            if not (b.lower <= expected and new <= b.upper):
                raise InvalidBatchBounds(
                    f"batch [{b.lower}, {b.upper}) does not cover the append "
                    f"[{expected}, {new}): a batch's lower must be <= the expected upper "
                    f"and its upper >= the new upper (updates outside are truncated away)"
                )

    def _assemble(
        self,
        batches: Sequence[Batch],
        expected: Antichain,
        new: Antichain,
        sources: list[str] | None = None,
    ) -> tuple[list[HollowBatch], list[Batch]]:
        """The hollow batches to push for an append ``[expected, new)`` of ``batches``
        (already validated), and the temporary batches written to truncate or rewrite
        some of them physically (their parts are pushed instead of the originals').
        ``sources`` (when given) collects the part keys of the batches rewritten into a
        non-empty temporary batch.

        One hollow batch ``[lo, new)`` holds every part, preceded by an empty
        ``[expected, lo)`` when every rewritten batch means times from ``lo`` on (readers
        advance a batch's times to its lower, which applies a single rewrite frontier
        without a blob call).  A batch whose data may lie outside ``[expected, new)``
        (truncation) or below ``lo`` while meaning a later time (several rewrite
        frontiers) is rewritten physically into a temporary batch.
        """
        live = [b for b in batches if b.len > 0]
        lo = expected
        if any(b.rewritten for b in live):
            lo = live[0].floor()
            for b in live[1:]:
                lo = lo.meet(b.floor())
        temps: list[Batch] = []
        use: list[Batch] = []
        try:
            for b in live:
                if self._needs_rewrite(b, lo, expected, new):
                    t = self._materialize(b, expected, new)
                    if t.len > 0:
                        temps.append(t)
                        use.append(t)
                        if sources is not None:
                            sources.extend(b.blob_keys())
                else:
                    use.append(b)
        except BaseException:
            for t in temps:
                t.delete()
            raise
        parts: list[PartRef] = []
        runs: list[int] = []
        n = 0
        for b in use:
            off = len(parts)
            if off:
                runs.append(off)
            runs.extend(off + r for r in b.hollow.runs)
            parts.extend(b.hollow.parts)
            n += b.len
        out: list[HollowBatch] = []
        if lo != expected:
            out.append(HollowBatch(Description(expected, lo)))
        out.append(HollowBatch(Description(lo, new), tuple(parts), n, tuple(sorted(set(runs)))))
        return out, temps

    @staticmethod
    def _needs_rewrite(b: Batch, lo: Antichain, expected: Antichain, new: Antichain) -> bool:
        """Whether ``b``'s parts cannot be pushed as they are in ``[lo, new)`` (whose
        readers advance every time to ``lo``)."""
        if b.rewritten:
            # It covers up to `new` exactly and means times from its floor (>= expected)
            # on; readers advance only to lo, so a later floor must be applied physically
            # unless no raw time lies below it.
            f = b.floor().as_option()
            raw = b.time_range
            return b.floor() != lo and (raw is None or f is None or raw[0] < f)
        raw = b.time_range
        if raw is None:
            # Unknown times: only a batch with the append's exact bounds is known to fit.
            return not (b.lower == expected and b.upper == new)
        return not expected.less_equal(raw[0]) or new.less_equal(raw[1])

    def _materialize(self, b: Batch, expected: Antichain, new: Antichain) -> Batch:
        """A temporary batch holding ``b``'s updates with its rewrite applied (times
        advanced to its rewrite frontier) and only the times in ``[floor, new)``
        (``floor`` its rewrite frontier, or ``expected``: the truncation), written as
        one run.  ``b`` is left as it was (the caller may still retry it)."""
        # Conformed to the newest schema version: the batch may mix parts of writers
        # opened with other versions.
        history = self._machine.state().schemas()
        if any(p.schema_id > history.newest for p in b.hollow.parts):
            history = self._machine.fetch().schemas()  # a version this process has not seen
        table = read_batch(
            self._ctx.blob,
            b.hollow,
            history.view_schema(history.newest),
            schemas=(history, history.newest),
        )
        f = b.rewrite_frontier
        lower = (expected if f is None else f).as_option()
        ti = table.schema.get_field_index(TIME)
        if f is not None and lower is not None and table.num_rows:
            times = pc.max_element_wise(table.column(TIME), pa.scalar(lower, pa.int64()))
            table = table.set_column(ti, table.schema.field(ti), times)
        up = new.as_option()
        mask = None
        if lower is not None:
            mask = pc.greater_equal(table.column(TIME), pa.scalar(lower, pa.int64()))
        if up is not None:
            m2 = pc.less(table.column(TIME), pa.scalar(up, pa.int64()))
            mask = m2 if mask is None else pc.and_(mask, m2)
        if mask is not None and table.num_rows:
            table = table.filter(mask)
        run = self._write_run(table, history.versions[history.newest], history.newest)
        hollow = HollowBatch(b.hollow.desc, tuple(run), sum(p.rows for p in run))
        return Batch(self._ctx.blob, self.shard_id, hollow, time_range=_time_range(table))

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
        expected = _frontier(expected_upper, "expected_upper")
        new = _frontier(new_upper, "new_upper")
        if not expected <= new:
            raise InvalidBounds(expected, new)
        if idempotency_token is None:
            # The same batches retried after an unknown outcome: the same token, so an
            # attempt that landed is recognised (never appended twice, never a race).
            pending = {getattr(b, "pending_token", None) for b in batches}
            if len(pending) == 1:
                idempotency_token = pending.pop()
        token = _token(idempotency_token, self.writer_id)
        with _carrying_token(token):
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
    ) -> None:
        """:meth:`compare_and_append_batch` after its arguments were converted;
        ``retry``: the token came from the caller (an earlier attempt may have landed);
        ``fresh``: a batch whose parts this call just wrote (not checked for existence,
        not one this writer lent out)."""
        if len({id(b) for b in batches}) != len(batches):
            raise InvalidUsage("the same batch is listed twice in one compare_and_append_batch")
        keys = [k for b in batches if isinstance(b, Batch) for k in b.part_ids()]
        if len(set(keys)) != len(keys):
            raise InvalidUsage(
                "two batches of one compare_and_append_batch share parts (one batch's "
                "transmittable bytes decoded twice?): its updates would be appended twice"
            )
        for b in batches:
            if not isinstance(b, Batch):
                raise InvalidUsage(f"expected a Batch, got {type(b).__name__}")
            if b.consumed:
                raise InvalidUsage(f"{b!r} was already appended, deleted or transmitted")
            if b.shard_id != self.shard_id:
                raise InvalidUsage(f"{b!r} was written for another shard than {self.shard_id}")
        self._validate_truncate(batches, expected, new)
        if fingerprint is None:  # the batches' parts (the same in copies and retries)
            fingerprint = batches_fingerprint(expected, new, batches)
        if retry and self._token_landed(token, fingerprint):
            for b in batches:  # an earlier attempt landed them
                b.mark_consumed()
            return
        # The retired collection's upper in a version read before the existence check:
        # the copy check below re-lists the parts once a GC may have forgotten some.
        checked_upper = self._machine.state().retired_upper
        owners = self._check_appendable(batches, fresh)  # parts exist; owners checked below
        handed = handed_off_owners(batches, self.writer_id)
        temps: list[Batch] = []
        # The given parts whose rows this append pushes, as they are or rewritten into
        # new parts: none may be in the shard already (see persist.appended).
        given: list[str] = []
        if expected == new:
            pieces: list[HollowBatch] = []
        else:
            pieces, temps = self._assemble(batches, expected, new, given)
        fresh_keys = {k for b in [fresh, *temps] if b is not None for k in b.blob_keys()}
        given.extend(
            p.key
            for hb in pieces
            for p in hb.parts
            if p.key is not None and p.key not in fresh_keys
        )
        if pieces:  # inline parts: their nonces name them (see PartRef.part_id)
            given.extend(inline_ids(b for b in batches if b is not fresh))
        wid = self.writer_id
        machine = self._machine
        # Compaction results offered by the compactor ride along in this version.
        merges = machine.take_merge_results() if pieces else []
        cmd = AppendCmd(
            writer_id=wid,
            token=token,
            recorded=f"{token}{TOKEN_SEP}{fingerprint}",
            expected=expected,
            pieces=tuple(pieces),
            lease_ms=self._lease_ms,
            registered=self._registered,
            owners=frozenset(owners),
            handed=tuple(handed.items()),
            merges=tuple(merges),
            given=tuple(given),
        )
        # Lists the given parts again once a GC may have forgotten some (see
        # persist.appended).
        relist = partial(self._check_appendable, batches, fresh)
        try:
            reqs = self._apply_resolving(
                partial(machine.compare_and_append, cmd, relist, checked_upper)
            )
        except PersistError as e:
            indeterminate = e.is_indeterminate()
            if merges and not indeterminate:
                machine.offer_merge_results(merges)  # still candidates; else GC's
            if indeterminate:
                e.idempotency_token = token
                for b in batches:  # a retry with these batches reuses the token
                    b.pending_token = token
                if pieces:  # learn the outcome from the next head (a retry asks it)
                    machine.note_unknown_token(token, wid)
            else:
                for t in temps:
                    t.delete()
            if isinstance(e, BatchAppended):  # copies: their parts are the shard's
                for b in batches:
                    if not set(e.keys).isdisjoint(b.part_ids()):
                        b.mark_consumed()
            raise
        if retry:
            machine.forget_token(token)  # landed now: the state answers for it
        if pieces:
            self._registered = True  # append_batch registered or renewed this writer
            self._last_heartbeat_ms = machine.now_ms()
        own = sum(
            1
            for b in batches
            if b is not fresh and all(key_writer_id(k) == self.writer_id for k in b.blob_keys())
        )
        self._lent = max(0, self._lent - own)
        if merges:
            self._ctx.maintenance.release_outputs(machine, merges)
        # Parts of a batch that this append truncated or rewrote physically are not
        # deleted here but left to GC (collected once this writer is gone and the grace
        # period passed): another copy of the same batch (its transmittable bytes decoded
        # twice, a retry after an unknown outcome) may have committed them already.
        for b in batches:
            b.mark_consumed()
        # Requests too small to pay for a physical merge are skipped (the compaction
        # heuristic, see persist.spine.COMPACTION_MIN_INPUTS): a later, larger request
        # covers their hollow batches.
        reqs = [r for r in reqs if worth_compacting(r)]
        if reqs:
            self._ctx.maintenance.after_append(machine, reqs)

    #: How many times an indeterminate commit is re-applied (re-reading consensus, with
    #: exponential backoff up to :attr:`resolve_max_wait` seconds) before giving up.
    resolve_attempts: int = 8
    resolve_max_wait: float = 1.0

    def _apply_resolving(self, apply: Callable[[], _T]) -> _T:
        """``apply()`` (a machine command), re-applied while its outcome is unknown (the command
        recognises its own committed effect by its token), with tenacity backoff, at
        most :attr:`resolve_attempts` times.  Once an attempt was indeterminate, a later
        attempt's consensus failure leaves the outcome unknown too (the earlier commit
        may have landed), so it is retried as well and, at the end, reported as
        indeterminate.

        Also used by the writer's registration (:meth:`heartbeat`), whose transition is
        idempotent.

        Raises:
            UpperMismatch (only when this append is known not to have landed), the
            transition's errors, ConsensusError.
        """
        try:
            first: _T = apply()  # the common case, without a retry loop
            return first
        except PersistError as e:
            if not e.is_indeterminate() or self.resolve_attempts <= 1:
                raise

        def retry(e: BaseException) -> bool:
            # The first attempt's commit may have landed: any consensus failure of a
            # later attempt leaves the outcome unknown too.
            return isinstance(e, ConsensusError) or (
                isinstance(e, PersistError) and e.is_indeterminate()
            )

        retrying = Retrying(
            stop=stop_after_attempt(self.resolve_attempts - 1),
            wait=wait_exponential_jitter(multiplier=0.005, max=self.resolve_max_wait, jitter=0.005),
            retry=retry_if_exception(retry),
            reraise=True,
        )
        try:
            out: _T = retrying(apply)
        except ConsensusError as e:
            if not e.is_indeterminate():
                raise ConsensusError(
                    f"the outcome of a change to shard {self.shard_id} is unknown: a commit "
                    f"was indeterminate and resolving it failed: {e}",
                    indeterminate=True,
                ) from e
            raise
        return out

    def _token_landed(self, token: str, fingerprint: str) -> bool:
        """Whether an append with the caller's ``token`` landed: recorded in the latest
        shard state, or settled by this client when the outcome was first learned (the
        writer may have appended many times since, or its lease run out: see
        :meth:`ShardMachine.note_unknown_token`); it must be this append
        (``fingerprint``, see :func:`_check_same_append`).

        Raises:
            ConsensusError: indeterminate: the outcome can no longer be learned.
        """
        st = self._machine.fetch()  # a head: also settles what it decides
        verdict, entry = token_verdict(st, token)
        if entry is None:
            known, entry = self._machine.token_outcome(token)
            if known and entry is None:
                return False
        if entry is None:
            if verdict == TOKEN_FOREIGN and self._registered and self.writer_id not in st.writers:
                # A caller's own token names no writer: this handle's record of its
                # earlier appends left the state with its registration (GC or another
                # process expired it), so whether one of them used the token is unknown.
                verdict = TOKEN_UNKNOWN
            if verdict != TOKEN_UNKNOWN or self._unregistered_within_lease(token):
                return False
            raise ConsensusError(
                f"the outcome of the append with idempotency token {token!r} on shard "
                f"{self.shard_id} cannot be learned: the state no longer holds its "
                "writer's record of it (the writer appended again or its lease ran out); "
                "read the shard to see whether its updates are there",
                indeterminate=True,
            )
        check_same_append(entry, token, fingerprint)
        return True

    def _unregistered_within_lease(self, token: str) -> bool:
        """Whether ``token`` is this handle's and this handle never registered in the
        shard state, within a lease of its creation: an append of it that landed would
        have registered the writer, and its record could not have expired yet."""
        return (
            token.startswith(self.writer_id[1:17])
            and not self._registered
            and self._machine.now_ms() - self._created_ms < self._lease_ms
        )

    def _count_transmitted(self) -> None:
        """A batch of this handle's builders, with blob parts, was transmitted."""
        self._transmitted += 1

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
        them renews the lease further (:meth:`hold`).  Otherwise (batches still held in this process, which renew the
        lease while held) the lease is left to run out by itself.
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


class BatchBuilder:
    """Builds a :class:`Batch` piece by piece (the persist-client ``BatchBuilder``).

    Updates are buffered; whenever the buffer exceeds the client's target part size
    (in-memory Arrow bytes) it is consolidated and written as parts.  A flushed chunk
    extends the current run when its first (key, value, time) sorts strictly after the
    run's last one (chunks arriving in order make one run, as Materialize's builder does);
    otherwise it starts a new run.

    Exception safety: a failed :meth:`add` leaves the builder exactly as it was before
    the call (the updates of earlier calls stay buffered or written; the failed call's
    updates are not added), so :meth:`finish` never returns a batch missing a row that
    an ``add`` accepted.  A failed :meth:`finish` leaves it unfinished, to retry or
    :meth:`abort`.  Safe to share between threads: ``add``, ``finish`` and ``abort`` are
    serialized.
    """

    def __init__(self, handle: WriteHandle, lower: Antichain) -> None:
        self._h = handle
        self.lower = lower
        self._buffer: list[pa.Table] = []
        self._buffered_bytes = 0
        self._parts: list[PartRef] = []
        self._runs: list[int] = []
        self._run_last: pa.Table | None = None  # last (key, value, time) of the run
        self._min_time: int | None = None
        self._max_time: int | None = None
        self._finished = False
        self._hold_id: int | None = None  # WriteHandle.hold of its writer's lease
        self._lock = threading.RLock()  # add, finish and abort are serialized

    def add(self, updates: Updates) -> None:
        """Add updates (a Table/RecordBatch or a list of ``((k, v), t, d)``).

        Raises:
            UpdateNotBeyondLower: a ``_time`` is before ``lower`` (nothing is added).
            InvalidUsage: bad columns, or the builder is finished.
            BlobError: writing a full buffer failed; the builder is as before the call
                (these updates were not added; earlier ones are kept).
        """
        with self._lock:
            self._add(updates)

    def _add(self, updates: Updates) -> None:
        if self._finished:
            raise InvalidUsage("cannot add to a finished BatchBuilder")
        table = self._h._normalize(updates)
        rng = _time_range(table)
        if rng is None:
            return
        if not self.lower.less_equal(rng[0]):
            raise UpdateNotBeyondLower(rng[0], self.lower)
        before = (self._min_time, self._max_time, self._buffered_bytes)
        self._min_time = rng[0] if self._min_time is None else min(self._min_time, rng[0])
        self._max_time = rng[1] if self._max_time is None else max(self._max_time, rng[1])
        self._buffer.append(table)
        self._buffered_bytes += table.nbytes
        if self._buffered_bytes >= self._h._ctx.config.target_part_bytes:
            try:
                self._flush()
            except BaseException:
                # Roll back to the state before this call: nothing of it was written
                # (write_parts deletes what a failed write uploaded).
                self._buffer.pop()
                self._min_time, self._max_time, self._buffered_bytes = before
                raise

    def _flush(self) -> None:
        """Write the buffer as parts; the buffer is emptied only once they are written."""
        if not self._buffer:
            return
        h = self._h
        table = pa.concat_tables(self._buffer)
        table, order = consolidate_order(table, h.key_schema.names, h.value_schema.names)
        n = table.num_rows if order is None else len(order)
        if n:
            run = h._write_sorted(table, order)  # keys stamped now, per run
            cols = [*h.key_schema.names, *h.value_schema.names, TIME]
            ends = [0, n - 1] if order is None else [int(order[0]), int(order[-1])]
            bounds = table.select(cols).take(pa.array(ends, pa.int64()))
            if self._parts and not self._extends_run(bounds.slice(0, 1)):
                self._runs.append(len(self._parts))
            if run and self._hold_id is None:
                # Uploaded parts: keep this writer's lease alive until finished.
                me = weakref.ref(self)
                self._hold_id = h.hold(
                    self, [h.writer_id], lambda: (b := me()) is not None and not b._finished
                )
            self._parts.extend(run)
            self._run_last = bounds.slice(1, 1)
        self._buffer, self._buffered_bytes = [], 0

    def _extends_run(self, first: pa.Table) -> bool:
        """Whether a chunk starting at ``first`` sorts strictly after the current run."""
        if self._run_last is None:
            return False
        pair = pa.concat_tables([self._run_last, first])
        in_order, same = _adjacent(pair, pair.schema.names, check_order=True)
        return in_order and same is None

    def finish(self, upper: Antichain | int) -> Batch:
        """Write what is buffered and return the :class:`Batch` ``[lower, upper)``.

        Raises:
            InvalidBounds: ``upper`` is before ``lower``.
            UpdateBeyondUpper: an added ``_time`` is not before ``upper`` (the parts
                already written are deleted).
            BlobError: writing the buffer failed; the builder stays unfinished with every
                accepted update (call ``finish`` again or :meth:`abort`).
        """
        with self._lock:
            return self._finish(upper)

    def _finish(self, upper: Antichain | int) -> Batch:
        if self._finished:
            raise InvalidUsage("BatchBuilder.finish was already called")
        up = _frontier(upper, "upper")
        if not self.lower <= up:
            raise InvalidBounds(self.lower, up)
        if self._max_time is not None and up.less_equal(self._max_time):
            self.abort()
            raise UpdateBeyondUpper(self._max_time, up)
        self._flush()
        self._finished = True
        self._release_hold()
        hollow = HollowBatch(
            desc=Description(self.lower, up),
            parts=tuple(self._parts),
            len=sum(p.rows for p in self._parts),
            runs=tuple(self._runs),
        )
        time_range = None
        if self._min_time is not None and self._max_time is not None:
            time_range = (self._min_time, self._max_time)
        batch = Batch(self._h._ctx.blob, self._h.shard_id, hollow, time_range=time_range)
        if batch.blob_keys():
            batch._on_transmit = self._h._count_transmitted
        return self._h._hold_batch(batch)

    def _release_hold(self) -> None:
        """Stop renewing the writer's lease for this builder (it holds no parts now: a
        finished batch holds them itself)."""
        ident, self._hold_id = self._hold_id, None
        if ident is not None:
            self._h.lease_keeper.unregister(ident)

    def abort(self) -> None:
        """Drop the buffer and delete the parts already written.  Idempotent; after a
        successful :meth:`finish` it does nothing (the batch owns the parts)."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
            self._h._lent = max(0, self._h._lent - 1)  # no batch of it will travel
            self._release_hold()
            self._buffer = []
            Batch(
                self._h._ctx.blob,
                self._h.shard_id,
                HollowBatch(Description(self.lower, self.lower), tuple(self._parts)),
            ).delete()
