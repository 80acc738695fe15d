"""Reading a shard: snapshots as of a time, listens to new updates, leased since holds.

A :class:`ReadHandle` is a leased reader of one shard (the persist-client ``ReadHandle``):
it holds the shard's since back at its own since hold until it downgrades it or its lease
expires (no heartbeat within the lease duration), so that data it may still read is never
compacted past what it needs.  Reads go through :func:`read_batch`, which is also the
entry point for other readers of hollow batches (compactor, Spark); it and the
snapshot building live in :mod:`persist.fetch`.

Invariants kept here:

* a hollow batch's updates are read with their times advanced to the batch's ``lower``
  and ``since`` (``t -> max(t, lower, since)``); for ordinary batches this changes
  nothing, for a batch whose timestamps were rewritten it applies the rewrite (see
  :mod:`persist.batch`);
* ``snapshot(as_of)`` is the shard's contents at ``as_of``: every update with time
  ``<= as_of``, consolidated, one row per distinct (key, value) with ``_time = as_of`` and
  its summed ``_diff``, rows summing to zero absent; it needs ``since <= as_of < upper``
  (``SinceViolation`` / ``InvalidUsage``), or waits for the upper with ``wait=True``;
* reads conform every part to the reader's view *before* consolidating
  (one step, :func:`persist.parts.read_parts` with ``conform``): a part written
  under another schema version comes back with the reader's columns (added ones null,
  widened ones cast, dropped ones gone), so rows differing only in a dropped column are
  one row;
* ``snapshot_stream(as_of)`` / :func:`stream_snapshot` yield exactly the rows of
  ``snapshot(as_of)``, in the same order, range of keys after range of keys, holding
  only the parts (and, for a bounded range, the Parquet row groups) overlapping the
  current range; parts without key samples are read whole;
  ``snapshot(as_of, filter=f, columns=c)`` is exactly ``snapshot(as_of).filter(f)
  .select(c)`` (or raises ``InvalidUsage`` naming ``f`` where that raises): a part is
  skipped only when its statistics prove it holds no update at or before ``as_of`` or
  no row a key/value filter keeps (:func:`prune_batches`), updates are filtered before
  consolidation only as :mod:`persist.filters` allows;
* a reader holds a *seqno* in the state (its lease's seqno hold): never later than the
  oldest version a read of this handle is using (a ``snapshot`` in progress, the last
  ``snapshot_batches``), so GC keeps every part those versions reference; a snapshot
  that meets a missing part re-reads the state and retries before it reports it;
* a :class:`Listen` emits every update with time ``> as_of`` exactly once, in time
  order of the batches' uppers, each ``updates`` event followed by the ``progress``
  frontier it completes, the first progress as soon as the upper passes ``as_of``; its
  own lease holds the since at most at the last progress minus one, so compaction never
  moves an update it has yet to emit into the range it already emitted; it emits only
  what it read from a state holding its lease, and once the lease is lost it fails for
  good (``LeaseExpired`` on every call, nothing more emitted);
* listens, and read handles during ``snapshot(wait=True)`` / ``snapshot_batches(wait=
  True)``, renew their lease in the background (:class:`persist.lease.LeaseKeeper`); a
  read by a handle whose lease is gone raises ``LeaseExpired``, never a bare
  ``SinceViolation``;
* every public entry point taking a time or frontier checks it is an i64 time (or an
  Antichain) before it takes a lease, raising ``InvalidUsage`` naming the argument.

Sources: Materialize's persist-client ``ReadHandle``, ``Listen`` and ``LeasedReaderState`` (
``src/persist-client/src/batch.rs``) and the first engine's listeners
(``src/persist/src/indexed/``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import pyarrow as pa
import pyarrow.compute as pc

from persist.errors import (
    CorruptPart,
    DiffOverflow,
    InvalidUsage,
    PersistError,
    SinceViolation,
)
from persist.fetch import read_batches, snapshot_table, stream_snapshot
from persist.filters import (
    check_columns,
    check_filter,
)
from persist.handle import ShardHandle
from persist.lease import DEFAULT_KEEPER, LeaseKeeper
from persist.machine import ShardMachine
from persist.parts import consolidate
from persist.state import LeaseExpired, ShardState
from persist.types import HollowBatch, as_frontier
from persist.updates import SchemaHistory
from stash import Antichain

if TYPE_CHECKING:
    from persist.context import PersistContext

__all__ = ["Listen", "ListenEvent", "ReadHandle"]

log = logging.getLogger(__name__)

#: How many times a snapshot re-reads the state after meeting a missing part.
_MISSING_RETRIES = 2


def _as_time(x: int | Antichain, what: str) -> int:
    if isinstance(x, Antichain):
        t = x.as_option()
        if t is None:
            raise InvalidUsage(f"{what} must be a time, not the empty antichain")
        return t
    if isinstance(x, bool) or not isinstance(x, int):
        raise InvalidUsage(f"{what} must be an int time or an Antichain, got {type(x).__name__}")
    if not -(2**63) <= x < 2**63:
        raise InvalidUsage(f"{what} {x} is outside the i64 range of times")
    return x


@dataclass(frozen=True)
class ListenEvent:
    """One event of a :class:`Listen`.

    Attributes:
        kind: ``"updates"`` or ``"progress"``.
        updates: for ``"updates"``: a table of the shard's updates schema, consolidated
            per (key, value, time), times in ``[previous progress, progress)``.
        progress: for ``"progress"``: the new frontier; every update before it was
            emitted.
    """

    kind: Literal["updates", "progress"]
    updates: pa.Table | None = None
    progress: Antichain | None = None


class ReadHandle(ShardHandle):
    """A leased reader of one shard.  Made by :meth:`persist.client.PersistClient.open`.

    Attributes:
        shard_id: the shard's id.  name: its registered name.
        reader_id: this reader's id in the shard state.
        key_schema, value_schema: the shard's schemas.
    """

    role = "reader"

    def __init__(
        self,
        ctx: PersistContext,
        machine: ShardMachine,
        name: str,
        reader_id: str,
        key_schema: pa.Schema,
        value_schema: pa.Schema,
        lease_seconds: float,
    ) -> None:
        super().__init__(ctx, machine, name, reader_id, key_schema, value_schema, lease_seconds)
        self.reader_id = reader_id
        self._last_heartbeat_ms = machine.now_ms()
        # Seqno holds (persist.gc): the seqnos of the versions this handle may still be
        # reading; its hold in the state never passes the oldest.
        self._seqno_leases: dict[int, int] = {}  # lease token -> seqno
        self._seqno_lock = threading.Lock()
        self._next_lease = 0
        self._batches_lease: int | None = None  # held for the last snapshot_batches
        self._held_beat: int | None = None  # keeper registration while that hold lives

    def read_schemas(self) -> tuple[SchemaHistory, int]:
        """``(the shard's schema history, this reader's schema id)``, for
        :func:`read_batches` / :func:`snapshot_table` of batches this handle listed:
        their parts are conformed to this reader's view.  The history is
        the latest this process knows, which holds every version a listed part names."""
        return self._machine.state().schemas(), self.schema_id

    # ------------------------------------------------------------ seqno holds
    def _lease_seqno(self) -> int:
        """Lease the seqno of the latest version this process knows (before reading a
        newer-or-equal one): until released, the reader's seqno hold stays at or before
        it.  Returns the lease token."""
        seqno = self._machine.state().seqno  # taken under the machine lock: see heartbeat
        with self._seqno_lock:
            self._next_lease += 1
            self._seqno_leases[self._next_lease] = seqno
            return self._next_lease

    def _release_seqno(self, token: int | None) -> None:
        if token is not None:
            with self._seqno_lock:
                self._seqno_leases.pop(token, None)

    def _seqno_hold(self) -> int | None:
        """The oldest leased seqno (``None``: no read in progress)."""
        with self._seqno_lock:
            return min(self._seqno_leases.values(), default=None)

    #: Renews leases in the background (inject a ``LeaseKeeper(thread=False)`` with a
    #: fake clock in tests).
    lease_keeper: LeaseKeeper = DEFAULT_KEEPER
    #: Interval of the background heartbeat in seconds (``None``: a quarter lease).
    heartbeat_seconds: float | None = None

    # ---------------------------------------------------------------- frontiers
    @property
    def since(self) -> Antichain:
        """This reader's since hold (the shard's since is at most this)."""
        self._check()
        st = self._machine.state()
        r = st.readers.get(self.reader_id)
        if r is None:
            st = self._machine.refresh()
        return st.reader(self.reader_id).since

    def shard_since(self) -> Antichain:
        """The shard's since, freshly read."""
        return self._machine.refresh().since

    # -------------------------------------------------------------------- leases
    def downgrade_since(self, since: Antichain | int) -> None:
        """Advance this reader's since hold to ``since``: it promises not to read before
        it; the shard's since follows the meet of the live readers' holds.  Also renews
        the lease.

        A ``since`` earlier than the current hold is a no-op (the hold stays; the lease
        is still renewed), as in Materialize's persist.

        Raises:
            InvalidUsage: ``since`` is not a time/frontier in the i64 range; the reader
                expired (:class:`~persist.state.LeaseExpired`).
        """
        self._check()
        frontier = as_frontier(since, "since")
        now = self._machine.now_ms()
        self._machine.downgrade_since(self.reader_id, frontier, now, self._seqno_hold)
        self._last_heartbeat_ms = now
        self._ctx.maintenance.since_moved(self.shard_id)

    def heartbeat(self) -> None:
        """Renew the lease now.

        Raises:
            LeaseExpired: the lease already ran out and another process dropped it.
        """
        self._check()
        now = self._machine.now_ms()
        # A read leasing its seqno after this runs reads this version or a newer one.
        self._machine.heartbeat_reader(self.reader_id, now, self._seqno_hold)
        self._last_heartbeat_ms = now

    def _maybe_heartbeat(self) -> None:
        if self._machine.now_ms() - self._last_heartbeat_ms > self._lease_ms // 4:
            self.heartbeat()

    def detach(self, *, hold_since: bool = False) -> None:
        """Hand the parts of the last :meth:`snapshot_batches` to readers elsewhere
        (e.g. Spark executors reading what a driver planned): this reader stops holding
        the since back, keeps its seqno hold until its lease runs out (the client's
        ``reader_lease_seconds`` from now), so GC deletes none of those parts meanwhile,
        and becomes unusable here (closing the client does not expire it).

        With ``hold_since``, it keeps holding the since too, until its lease runs out:
        for readers elsewhere that plan their read again later at a time not before
        this reader's since (e.g. a Spark data source planning each action anew).

        Raises:
            LeaseExpired: the reader's lease already ran out.
        """
        self._check()
        now = self._machine.now_ms()
        hold = self._seqno_hold()
        if hold_since:
            self._machine.heartbeat_reader(self.reader_id, now, lambda: hold)
        else:
            self._machine.detach_reader(self.reader_id, now, hold)
        self._expired = True
        self._stop_keeping_alive()  # the hold now lasts one lease, as documented
        self._ctx.handles.discard(self)
        self._ctx.maintenance.since_moved(self.shard_id)

    def expire(self) -> None:
        """Release the lease (the since hold goes away).  The handle is unusable after.
        Idempotent."""
        if self._expired:
            return
        self._expired = True
        self._stop_keeping_alive()
        self._release_seqno(self._batches_lease)
        self._batches_lease = None
        self._machine.expire_reader(self.reader_id)
        self._ctx.maintenance.since_moved(self.shard_id)

    # --------------------------------------------------------------------- reads
    @contextlib.contextmanager
    def _kept_alive(self) -> Iterator[None]:
        """Renew this reader's lease in the background (every
        :attr:`heartbeat_seconds`, default a quarter lease) for the duration."""

        def beat() -> bool:
            try:
                self.heartbeat()
            except LeaseExpired:
                return False  # the wait notices it in the state it reads
            return True

        interval = self.heartbeat_seconds or self._lease_ms / 4000
        keeper = self.lease_keeper
        ident = keeper.register(f"reader {self.reader_id}", max(interval, 0.001), beat)
        try:
            yield
        finally:
            keeper.unregister(ident)

    def _lease_lost(self, st: ShardState) -> LeaseExpired | None:
        """A :class:`LeaseExpired` if this reader is no longer in ``st``.

        Raises:
            InvalidUsage: the shard was finalized (dropped).
        """
        st.check_not_finalized()
        if self.reader_id in st.readers:
            return None
        e = LeaseExpired(self.shard_id, self.reader_id)
        e.args = (
            f"{e.args[0]}; the since hold it kept is gone, so what it was waiting to read "
            "may have been compacted",
        )
        return e

    def _state_for(self, as_of: int, wait: bool, timeout: float | None) -> ShardState:
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not 0 <= timeout < 1e9
        ):
            raise InvalidUsage(
                f"timeout must be None or a finite number of seconds >= 0, got {timeout!r}"
            )
        st = self._machine.recent()
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while True:
            lost = self._lease_lost(st)
            if lost is not None:
                raise lost
            if not st.since.less_equal(as_of):
                raise SinceViolation(as_of, st.since)
            if not st.upper.less_equal(as_of):
                return st
            if not wait:
                raise InvalidUsage(
                    f"snapshot as_of {as_of} of shard {self.name!r} is not before its upper "
                    f"{st.upper}: the data is not yet definite (use wait=True to wait)"
                )
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"shard {self.name!r}: upper {st.upper} did not pass as_of {as_of} "
                    f"within {timeout} s"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
            st = self._machine.recent()

    def snapshot_batches(
        self, as_of: int | Antichain, *, wait: bool = False, timeout: float | None = None
    ) -> list[HollowBatch]:
        """The hollow batches holding the shard's updates up to ``as_of`` (for callers
        that read parts themselves, e.g. Spark; read them with :func:`read_batches`
        using ``upper=as_of + 1``, then consolidate with ``since=as_of``).  While it
        waits (``wait=True``) the lease is renewed in the background.

        The reader holds the version they come from (its seqno hold, recorded in the
        state at its next heartbeat, stays at or before it) until its next
        ``snapshot_batches`` call or :meth:`expire`, and its lease is renewed in the
        background meanwhile, so GC deletes none of their parts however long the caller
        takes to read them.

        Raises: as :meth:`snapshot`.
        """
        self._check()
        t = _as_time(as_of, "as_of")
        token = self._lease_seqno()
        try:
            batches = self._batches_for(t, wait, timeout)
        except BaseException:
            self._release_seqno(token)
            raise
        old, self._batches_lease = self._batches_lease, token
        self._release_seqno(old)
        self._keep_alive_while_held()
        return batches

    def snapshot_stream(
        self,
        as_of: int | Antichain,
        *,
        wait: bool = False,
        timeout: float | None = None,
        max_chunk_rows: int = 64 * 1024,
    ) -> Iterator[pa.RecordBatch]:
        """The shard's contents as of ``as_of`` (what :meth:`snapshot` returns: one row
        per distinct (key, value) with ``_time = as_of`` and its summed ``_diff``, in key
        and value order), streamed as record batches of at most ``max_chunk_rows`` rows
        with bounded memory: a k-way merge of the sorted runs by key range
        (:func:`stream_snapshot`) holding about one part per run at a time.

        The version read is held (its seqno hold) until the iterator ends or is closed,
        and the lease is renewed in the background meanwhile.

        Raises: as :meth:`snapshot` (when the iteration starts); ``InvalidUsage`` if
            ``max_chunk_rows < 1``.
        """
        self._check()
        t = _as_time(as_of, "as_of")
        if (
            isinstance(max_chunk_rows, bool)
            or not isinstance(max_chunk_rows, int)
            or max_chunk_rows < 1
        ):
            raise InvalidUsage(f"max_chunk_rows must be an int >= 1, got {max_chunk_rows!r}")

        def gen() -> Iterator[pa.RecordBatch]:
            token = self._lease_seqno()
            try:
                with self._kept_alive():
                    batches = self._batches_for(t, wait, timeout)
                    for table in stream_snapshot(
                        self._ctx.blob,
                        batches,
                        self.schema,
                        self.key_schema.names,
                        self.value_schema.names,
                        t,
                        key_schema=self.key_schema,
                        max_workers=self._ctx.config.read_workers,
                        schemas=self.read_schemas(),
                    ):
                        yield from table.to_batches(max_chunksize=max_chunk_rows)
            except DiffOverflow as e:
                raise e.in_shard(f"{self.name!r} ({self.shard_id})") from e
            finally:
                self._release_seqno(token)

        return gen()

    def _keep_alive_while_held(self) -> None:
        """While the result of :meth:`snapshot_batches` is held (until :meth:`expire` or
        :meth:`detach`), renew the lease in the background, as persist-client's reader
        heartbeat task does, so the seqno hold outlives any read however long.  The keeper
        holds the handle weakly: a handle dropped without ``expire`` stops renewing, and
        its lease runs out like a crashed reader's."""
        if self._held_beat is not None:
            return
        ref = weakref.ref(self)

        def beat() -> bool:
            h = ref()
            if h is None or h._expired:
                return False
            try:
                h.heartbeat()
            except LeaseExpired:
                return False
            return True

        interval = self.heartbeat_seconds or self._lease_ms / 4000
        self._held_beat = self.lease_keeper.register(
            f"reader {self.reader_id} (held batches)", max(interval, 0.001), beat
        )

    def _stop_keeping_alive(self) -> None:
        ident, self._held_beat = self._held_beat, None
        if ident is not None:
            self.lease_keeper.unregister(ident)

    def _batches_for(self, t: int, wait: bool, timeout: float | None) -> list[HollowBatch]:
        self._maybe_heartbeat()
        if not wait:
            return self._batches_at(self._state_for(t, False, timeout), t)
        with self._kept_alive():
            return self._batches_at(self._state_for(t, True, timeout), t)

    @staticmethod
    def _batches_at(st: ShardState, t: int) -> list[HollowBatch]:
        return [b for b in st.batches() if b.len > 0 and b.desc.lower.less_equal(t)]

    def snapshot(
        self,
        as_of: int | Antichain,
        *,
        wait: bool = False,
        timeout: float | None = None,
        filter: pc.Expression | None = None,
        columns: Sequence[str] | None = None,
    ) -> pa.Table:
        """The shard's contents as of ``as_of``: one row per distinct (key, value) with
        ``_time = as_of`` and its summed ``_diff`` (never zero), sorted by key and value.

        With ``filter`` and ``columns`` the result is exactly
        ``snapshot(as_of).filter(filter).select(columns)``, read without fetching the
        parts whose statistics show they hold no row the filter keeps (when it reads
        only key and value columns) and, for data already consolidated, without decoding
        the other columns (see :func:`snapshot_table`).

        Args:
            as_of: a time (int) or ``{t}``.
            wait: if ``as_of`` is not yet before the upper, wait until it is (renewing
                the lease in the background meanwhile).
            timeout: with ``wait``, give up after this many seconds (``TimeoutError``).
            filter: a boolean ``pyarrow.compute`` expression over the key, value,
                ``_time`` and ``_diff`` columns, e.g. ``pc.field("id") < 10``.
            columns: the columns to return, in order (``None``: all).

        Raises:
            SinceViolation: ``as_of`` is before the shard's since.
            LeaseExpired: this reader's lease was lost (it was dropped from the shard
                state), e.g. while waiting.
            InvalidUsage: ``as_of`` is at or beyond the upper (without ``wait``); a
                bad ``filter`` or ``columns`` (checked before anything is read); a
                filter Arrow cannot evaluate on the snapshot's rows (where
                ``snapshot(as_of).filter(filter)`` raises).
            CorruptPart: a part is missing or corrupt (naming its blob key).
            DiffOverflow: the diffs of a row sum beyond int64 (naming the shard and
                the row).
            BlobError, ConsensusError: storage failed.
        """
        self._check()
        t = _as_time(as_of, "as_of")
        check_filter(filter, self.schema, self.key_schema.names, self.value_schema.names)
        check_columns(columns, self.schema)
        for attempt in range(_MISSING_RETRIES + 1):
            token = self._lease_seqno()  # GC keeps what this version references
            try:
                batches = self._batches_for(t, wait, timeout)
                return snapshot_table(
                    self._ctx.blob,
                    batches,
                    self.schema,
                    self.key_schema.names,
                    self.value_schema.names,
                    t,
                    max_workers=self._ctx.config.read_workers,
                    schemas=self.read_schemas(),
                    filter=filter,
                    columns=columns,
                )
            except DiffOverflow as e:
                raise e.in_shard(f"{self.name!r} ({self.shard_id})") from e
            except CorruptPart as e:
                # A part of an old version may be gone (e.g. the lease had lapsed): a
                # newer version may not reference it; report corruption only if the
                # latest version still does.
                if not e.missing or attempt == _MISSING_RETRIES:
                    raise
                log.info("snapshot of shard %s met a missing part, re-reading: %s", self.name, e)
                self._machine.refresh()
            finally:
                self._release_seqno(token)
        raise AssertionError("unreachable")  # pragma: no cover

    def listen(
        self,
        as_of: int | Antichain,
        *,
        poll_min_seconds: float = 0.001,
        poll_max_seconds: float = 0.25,
        hold_interval_seconds: float = 1.0,
        heartbeat_seconds: float | None = None,
    ) -> Listen:
        """An iterator of :class:`ListenEvent`\\ s: the updates with times ``> as_of`` as
        they commit, each batch of updates followed by the new upper (``progress``); the
        first progress comes as soon as the upper passes ``as_of``.  Polls consensus
        with exponential backoff between ``poll_min_seconds`` and ``poll_max_seconds``.
        Stops after the progress ``{}`` (the shard was closed).  The listen holds its
        own lease, renewed in the background every ``heartbeat_seconds`` (default a
        quarter of the lease) by :attr:`lease_keeper`, whose since hold follows the
        emitted progress (moved at most every ``hold_interval_seconds``, each move
        being a state change); close it (or use it as a context manager).

        Raises:
            InvalidUsage: ``as_of`` is not a time, or is the largest i64 time (no time
                is after it); checked before any lease is taken.
            SinceViolation: ``as_of`` is before the shard's since.
        """
        self._check()
        t = _as_time(as_of, "as_of")
        if t >= 2**63 - 1:
            raise InvalidUsage(
                f"listen as_of {t} is the largest i64 time: a listen emits updates after "
                "as_of, and no time is after it"
            )
        if heartbeat_seconds is not None and not heartbeat_seconds > 0:
            raise InvalidUsage(f"heartbeat_seconds must be > 0, got {heartbeat_seconds}")
        listen = Listen(
            self,
            t,
            poll_min_seconds,
            poll_max_seconds,
            hold_interval_seconds,
            heartbeat_seconds,
        )
        self._ctx.handles.add(listen)
        return listen

    def __enter__(self) -> ReadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.expire()
        except PersistError as e:  # pragma: no cover - best effort on exit
            log.warning("could not expire reader %s: %s", self.reader_id, e)


class Listen:
    """A listen over a shard from ``as_of`` (see :meth:`ReadHandle.listen`).

    Its lease is kept alive by the handle's :class:`~persist.lease.LeaseKeeper` while it
    is open.  Once the lease is lost (the reader was dropped from the shard state, or
    the since passed what it has yet to emit), the listen fails for good: every later
    call raises :class:`~persist.state.LeaseExpired` and it emits nothing more.
    Thread-safe (one lock per listen).
    """

    def __init__(
        self,
        handle: ReadHandle,
        as_of: int,
        poll_min: float,
        poll_max: float,
        hold_interval: float = 1.0,
        heartbeat_seconds: float | None = None,
    ) -> None:
        self._h = handle
        self._machine = handle._machine
        self.as_of = as_of
        self._frontier = as_of + 1  # every time < frontier was emitted (or is <= as_of)
        self._emitted = False  # whether a progress was emitted
        self._poll_min = poll_min
        self._poll_max = poll_max
        self._hold_interval_ms = int(hold_interval * 1000)
        self._pending: list[ListenEvent] = []
        self._done = False
        self._closed = False
        self._failed: PersistError | None = None
        self._lock = threading.RLock()
        # A step is reading the batches of a version: the background heartbeat must not
        # move the seqno hold past it meanwhile (GC would delete what it reads).
        self._reading = False
        self.reader_id = "l" + uuid.uuid4().hex
        self._lease_ms = handle._lease_ms
        now = self._machine.now_ms()
        hold = Antichain.from_elem(as_of)
        self._machine.register_listen(self.reader_id, as_of, now, self._lease_ms)
        self._last_hold_ms = now
        self._hold = hold
        interval = heartbeat_seconds if heartbeat_seconds is not None else self._lease_ms / 4000
        self._keeper = handle.lease_keeper
        # A weak reference: a listen dropped without close() stops renewing its lease
        # (it then expires like any crashed reader) instead of living on in the keeper.
        beat = weakref.WeakMethod(self._beat)
        self._beat_id: int | None = self._keeper.register(
            f"listen {self.reader_id}",
            max(interval, 0.001),
            lambda: (m := beat()) is not None and m(),
        )

    @property
    def frontier(self) -> Antichain:
        """Every update before this frontier has been emitted."""
        return Antichain.from_elem(self._frontier) if not self._done else Antichain()

    def __iter__(self) -> Iterator[ListenEvent]:
        return self

    def __next__(self) -> ListenEvent:
        delay = self._poll_min
        while True:
            with self._lock:
                if self._failed is not None:
                    raise self._failed
                if self._pending:
                    return self._pending.pop(0)
                if self._done or self._closed:
                    raise StopIteration
                if self._step():
                    continue
            time.sleep(delay)
            delay = min(delay * 2, self._poll_max)

    def poll(self) -> list[ListenEvent]:
        """The events available now, without waiting (possibly none).

        Raises:
            LeaseExpired: the listen's lease was lost (now or earlier): it emits nothing
                more.
            ConsensusError, BlobError, CorruptPart: storage failed (nothing was
                consumed; the next poll tries again).
        """
        with self._lock:
            if self._failed is not None:
                raise self._failed
            if not self._done and not self._closed:
                self._step()
            out, self._pending = self._pending, []
            return out

    def _fail(self, e: PersistError) -> PersistError:
        """Fail for good with ``e``: drop queued events, stop the heartbeat, release."""
        self._failed = e
        self._pending = []
        self.close()
        return e

    def _lost(self, st: ShardState) -> PersistError | None:
        """Why the listen cannot read ``st``: not registered (lease expired) or the
        since passed the time it has yet to emit."""
        try:
            st.check_not_finalized()
        except InvalidUsage as e:
            return e
        if self.reader_id not in st.readers:
            return LeaseExpired(self._machine.shard_id, self.reader_id, "listen")
        if not st.since.less_equal(self._frontier - 1):
            return LeaseExpired(self._machine.shard_id, self.reader_id, "listen")
        return None

    def _step(self) -> bool:
        """Check consensus once; queue events if the upper moved past what was emitted
        (the first progress as soon as it passes ``as_of``).  Returns whether it queued
        any.  Nothing is queued unless the listen still held its lease in the state it
        read and kept it while renewing.  While it runs, the background heartbeat keeps
        the seqno hold where it is (at or before the version read)."""
        self._reading = True  # before the state is read: see _beat
        try:
            return self._step_reading()
        except DiffOverflow as e:
            raise e.in_shard(self._machine.shard_id) from e
        finally:
            self._reading = False

    def _step_reading(self) -> bool:
        st = self._machine.recent()
        lost = self._lost(st)
        if lost is not None:
            raise self._fail(lost)
        upper = st.upper
        u = upper.as_option()
        if u is not None and (u <= self.as_of or (self._emitted and u <= self._frontier)):
            self._renew(st)
            return False
        f = self._frontier
        events: list[ListenEvent] = []
        batches = [
            b
            for b in st.batches()
            if b.len > 0
            and not b.desc.upper.less_equal(f)
            and (u is None or b.desc.lower.less_than(u))
        ]
        if batches and (u is None or f < u):
            table = read_batches(
                self._h._ctx.blob,
                batches,
                self._h.schema,
                lower=f,
                upper=u,
                max_workers=self._h._ctx.config.read_workers,
                schemas=(st.schemas(), self._h.schema_id),
            )
            table = consolidate(table, self._h.key_schema.names, self._h.value_schema.names)
            if table.num_rows:
                events.append(ListenEvent("updates", updates=table))
        events.append(ListenEvent("progress", progress=upper))
        if u is not None:
            old = self._frontier
            self._frontier = max(u, f)
            try:
                self._renew(st, advanced=True)
            except BaseException:
                self._frontier = old  # nothing emitted: the next step reads it again
                raise
        self._pending.extend(events)
        self._emitted = True
        if u is None:
            self._done = True
            self.close()
        return True

    def _renew(self, st: ShardState, advanced: bool = False) -> None:
        """Move the listen's hold up to the emitted frontier minus one (at most every
        hold interval) and renew the lease (at least every quarter lease).

        Raises:
            LeaseExpired: the lease was lost (the listen fails for good).
        """
        now = self._machine.now_ms()
        if now - self._last_hold_ms < min(self._hold_interval_ms, self._lease_ms // 4):
            return
        if not advanced and now - self._last_hold_ms < self._lease_ms // 4:
            return
        target = Antichain.from_elem(self._frontier - 1)
        try:
            self._machine.downgrade_since(self.reader_id, target, now)
        except LeaseExpired as e:
            raise self._fail(e) from None
        self._last_hold_ms = now
        self._hold = target
        self._h._ctx.maintenance.since_moved(self._machine.shard_id)

    def _beat(self) -> bool:
        """The background heartbeat: renew the lease.  Returns ``False`` (stop) once the
        listen is closed or its lease is lost."""
        if self._closed or self._failed is not None:
            return False
        now = self._machine.now_ms()
        try:
            # The hold is read under the machine's lock, as the step's read of the state
            # is: a step that began before reads a version no older than this hold, and
            # one reading now keeps the hold unchanged (seqno 0: never moved backwards,
            # not forwards).
            self._machine.heartbeat_reader(
                self.reader_id, now, lambda: 0 if self._reading else None
            )
        except LeaseExpired as e:
            self._failed = e
            return False
        return True

    def close(self) -> None:
        """Release the listen's lease and stop its heartbeat.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        beat, self._beat_id = self._beat_id, None
        if beat is not None:
            self._keeper.unregister(beat)
        try:
            self._machine.expire_reader(self.reader_id)
        except PersistError as e:
            log.warning("could not release listen lease %s: %s", self.reader_id, e)

    def expire(self) -> None:
        """Same as :meth:`close`."""
        self.close()

    def __enter__(self) -> Listen:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
