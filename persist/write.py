"""Writing a shard: compare-and-append of updates or of pre-written batches.

A :class:`WriteHandle` appends to one shard (the persist-client ``WriteHandle``).  An
append writes the batch's parts to blob *first* (or keeps a small batch inline, in the
state itself: the seed's inline writes, ``004``), then commits the new state version by
compare-and-set in consensus.

Invariants kept here:

* every ``_time`` of an append lies in ``[expected_upper, new_upper)``, else
  ``UpdateNotBeyondLower`` / ``UpdateBeyondUpper`` and nothing is written anywhere;
* ``compare_and_append`` commits atomically or raises ``UpperMismatch`` (``.expected``,
  ``.current``) with nothing visible; the parts it had written are then deleted;
* a lost race on the seqno with the upper still matching (a reader, a compactor or GC
  changed the state) is retried on the metadata only: parts are uploaded once per batch,
  however many compare-and-set attempts the commit needs;
* an indeterminate commit (the stash lost the connection during COMMIT) is resolved by
  re-reading the state: each append carries a token recorded with the writer in the same
  version, so a committed append is recognised and reported as success; if the outcome
  still cannot be learned, a ``ConsensusError`` with ``is_indeterminate()`` is raised and
  the parts are left in place (GC collects them if the append did not land);
* a writer is registered in the shard state (its lease) before its first upload, and
  its parts' keys name it (:mod:`persist.keys`), stamped when each run is written; GC
  never deletes a live writer's parts; a writer whose lease ran out is never
  registered again, and ``compare_and_append_batch`` refuses, committing nothing, a
  batch whose parts are gone or whose writer is not live (``PartsMissing``,
  ``LeaseExpired``);
* a :class:`BatchBuilder` checks times at ``add`` (``>= lower``) and ``finish``
  (``< upper``), and writes each flushed chunk as one sorted run.

Sources: the persist-client ``WriteHandle``, ``BatchBuilder`` and
``validate_truncate_batch`` (seed ``004``).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from persist.batch import Batch
from persist.consensus import ShardMachine, Stale
from persist.errors import (
    InvalidBatchBounds,
    InvalidBounds,
    InvalidUsage,
    PartsMissing,
    PersistError,
    UpdateBeyondUpper,
    UpdateNotBeyondLower,
    UpperMismatch,
)
from persist.handle import ShardHandle
from persist.keys import key_writer_id, part_name_prefix
from persist.parts import (
    TIME,
    consolidate_order,
    to_updates_table,
    write_parts,
)
from persist.read import read_batch
from persist.spine import FueledMergeReq
from persist.state import LeaseExpired, ShardState
from persist.types import Description, HollowBatch, PartRef
from stash import Antichain

if TYPE_CHECKING:
    from persist.client import PersistClient

__all__ = ["BatchBuilder", "WriteHandle"]

log = logging.getLogger(__name__)

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


def _time_range(table: pa.Table) -> tuple[int, int] | None:
    if table.num_rows == 0:
        return None
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
        client: PersistClient,
        machine: ShardMachine,
        name: str,
        writer_id: str,
        key_schema: pa.Schema,
        value_schema: pa.Schema,
        lease_seconds: float,
    ) -> None:
        super().__init__(client, machine, name, writer_id, key_schema, value_schema, lease_seconds)
        self.writer_id = writer_id
        # Writer lease (persist.gc): registered before the first upload; once
        # registered, a writer found missing or expired is never registered again.
        self._registered = False
        self._last_heartbeat_ms = 0
        self._fresh_batch: Batch | None = None  # parts compare_and_append just wrote
        self._lent = 0  # builders handed out whose batch this handle has not appended

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
    def _writer_fn(self, now: int) -> Callable[[ShardState, bool], tuple[None, bool]]:
        wid, lease, registered = self.writer_id, self._lease_ms, self._registered

        def fn(st: ShardState, fresh: bool) -> tuple[None, bool]:
            if registered:
                try:
                    st.check_writer_live(wid, now)
                except LeaseExpired:
                    if not fresh:
                        raise Stale() from None
                    raise
            st.heartbeat_writer(wid, now, lease)
            return None, True

        return fn

    def heartbeat(self) -> None:
        """Register this writer in the shard state, or renew its lease.  A writer that
        keeps a builder or a written batch open must heartbeat within its lease
        duration: the parts of a live writer are never deleted by GC, whatever their
        age; those of a writer whose lease ran out may be.

        Raises:
            LeaseExpired: the lease already ran out (or the writer was expired): this
                handle can append nothing any more; open a new writer.
            ConsensusError: the stash failed.
        """
        self._check()
        now = self._machine.now_ms()
        self._machine.apply(self._writer_fn(now), keep=(self.writer_id,))
        self._registered = True
        self._last_heartbeat_ms = now

    def _ensure_registered(self) -> None:
        """Called before an upload: register the writer, or renew a lease past a
        quarter of its duration."""
        if not self._registered or (
            self._machine.now_ms() - self._last_heartbeat_ms > self._lease_ms // 4
        ):
            self.heartbeat()

    def _check_appendable(self, batches: Sequence[Batch]) -> set[str]:
        """Before an append of pre-written ``batches``: every blob part they reference
        must exist (one listing per writer whose parts they hold).  Returns the writers
        the parts name, which must be live when the append commits.

        Raises:
            PartsMissing: a part is not in the blob store (nothing is committed).
        """
        owners: set[str] = set()
        keys = [k for b in batches if b is not self._fresh_batch for k in b.blob_keys()]
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
        blob = self._client.blob
        for prefix, ks in prefixes.items():
            present = {k for k, _ in blob.list_keys(prefix)}
            missing.extend(k for k in ks if k not in present)
        if missing:
            raise PartsMissing(self.shard_id, sorted(missing))
        return owners

    def _check_owners(self, st: ShardState, owners: set[str], fresh: bool, now: int) -> None:
        """In the append's transition: this writer (once registered) and every writer
        whose parts the append references must be live (else GC may have deleted
        parts)."""
        need = set(owners)
        if self._registered:
            need.add(self.writer_id)
        for wid in sorted(need):
            try:
                st.check_writer_live(wid, now)
            except LeaseExpired as e:
                if not fresh:
                    raise Stale() from None
                if wid == self.writer_id:
                    raise
                raise LeaseExpired(self.shard_id, wid, "writer of an appended batch") from e

    def _inline_max(self) -> int:
        """Inline writes are allowed while the state holds less than the total budget."""
        c = self._client
        if self._machine.state().inline_bytes() >= c.inline_total_max_bytes:
            return 0
        return c.inline_max_bytes

    def _normalize(self, updates: Updates) -> pa.Table:
        return to_updates_table(updates, self.key_schema, self.value_schema)

    def _write_run(self, table: pa.Table, stem: str) -> list[PartRef]:
        """Consolidate (sort) ``table`` and write it as one run, its parts at keys
        ``<stem>-<uuid>.parquet`` (``stem`` from :meth:`_key_prefix`)."""
        table, order = consolidate_order(table, self.key_schema.names, self.value_schema.names)
        if (table.num_rows if order is None else len(order)) == 0:
            return []
        c = self._client
        directory, name = stem.rsplit("/", 1)
        return write_parts(
            c.blob,
            table,
            directory,
            target_part_bytes=c.target_part_bytes,
            inline_max_bytes=self._inline_max(),
            max_workers=c.write_workers,
            order=order,
            name_prefix=name + "-",
            before_upload=self._ensure_registered,
        )

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
        b = Batch.from_transmittable(self._client.blob, data)
        if b.shard_id != self.shard_id:
            raise InvalidUsage(
                f"transmitted batch was written for shard {b.shard_id}, not {self.shard_id}"
            )
        return b

    def compare_and_append(
        self,
        updates: Updates,
        expected_upper: Antichain | int,
        new_upper: Antichain | int,
    ) -> None:
        """Append ``updates`` if the shard's upper is ``expected_upper``, advancing it to
        ``new_upper``; atomically.

        Raises:
            InvalidBounds: ``expected_upper`` is not ``<= new_upper``.
            UpdateNotBeyondLower / UpdateBeyondUpper: a ``_time`` outside
                ``[expected_upper, new_upper)``.
            UpperMismatch: the shard's upper is not ``expected_upper`` (``.current``
                tells what it is); nothing was committed.
            InvalidUsage: bad schema or columns.
            BlobError, ConsensusError: storage failed; nothing was committed unless the
                error says ``is_indeterminate()``.
        """
        self._check()
        expected = _frontier(expected_upper, "expected_upper")
        new = _frontier(new_upper, "new_upper")
        if not expected <= new:
            raise InvalidBounds(expected, new)
        table = self._normalize(updates)
        rng = _time_range(table)
        if rng is not None:
            if not expected.less_equal(rng[0]):
                raise UpdateNotBeyondLower(rng[0], expected)
            if new.less_equal(rng[1]):
                raise UpdateBeyondUpper(rng[1], new)
        if expected == new:
            # Nothing can be written into an empty range: just check the upper.
            self.compare_and_append_batch([], expected, new)
            return
        run = self._write_run(table, self._key_prefix())
        hollow = HollowBatch(
            desc=Description(expected, new),
            parts=tuple(run),
            len=sum(p.rows for p in run),
        )
        batch = Batch(self._client.blob, self.shard_id, hollow)
        self._fresh_batch = batch  # its parts were just written: no existence check
        try:
            self.compare_and_append_batch([batch], expected, new)
        except PersistError as e:
            if not e.is_indeterminate():
                batch.delete()
            raise
        finally:
            self._fresh_batch = None

    def append(self, updates: Updates, lower: Antichain | int, upper: Antichain | int) -> None:
        """Append ``updates`` at ``[lower, upper)``: the shard's upper must be ``lower``
        (the persist-client ``append``; same errors as :meth:`compare_and_append`)."""
        self.compare_and_append(updates, lower, upper)

    def _assemble(
        self, batches: Sequence[Batch], expected: Antichain, new: Antichain
    ) -> list[HollowBatch]:
        """The hollow batches to push for this append: one (``[expected, new)``) holding
        every part, preceded by an empty one if rewritten batches start later."""
        live = [b for b in batches if b.len > 0]
        clampers = [b for b in live if b.rewritten]
        lo = expected
        if clampers:
            lo = live[0].lower
            for b in live[1:]:
                lo = lo.meet(b.lower)
            for b in clampers:
                if b.lower != lo:
                    self._materialize_rewrite(b)
        parts: list[PartRef] = []
        runs: list[int] = []
        n = 0
        for b in live:
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
        return out

    def _materialize_rewrite(self, b: Batch) -> None:
        """Write a rewritten batch's times physically (needed only when several batches
        with different rewrite frontiers share one append).  Done once per batch."""
        table = read_batch(self._client.blob, b.hollow, self.schema)
        old = b.blob_keys()
        run = self._write_run(table, self._key_prefix())
        b.hollow = HollowBatch(b.hollow.desc, tuple(run), sum(p.rows for p in run))
        b.rewritten = False
        for key in old:
            try:
                self._client.blob.delete(key)
            except PersistError as e:  # pragma: no cover - garbage for GC
                log.warning("could not delete rewritten part %s: %s", key, e)

    def compare_and_append_batch(
        self,
        batches: Sequence[Batch],
        expected_upper: Antichain | int,
        new_upper: Antichain | int,
    ) -> None:
        """Append pre-written batches if the shard's upper is ``expected_upper``,
        advancing it to ``new_upper``; atomically.  Each batch must lie within the
        append: ``expected_upper <= batch.lower`` and ``batch.upper <= new_upper``.  On
        success the batches are consumed; on ``UpperMismatch`` they are untouched (the
        caller may retry them, e.g. after :meth:`Batch.rewrite_ts`, without any upload).

        Raises:
            InvalidBounds, InvalidBatchBounds, InvalidUsage (a batch of another shard, or
            already consumed), UpperMismatch, ConsensusError (see
            :meth:`compare_and_append`).
        """
        self._check()
        expected = _frontier(expected_upper, "expected_upper")
        new = _frontier(new_upper, "new_upper")
        if not expected <= new:
            raise InvalidBounds(expected, new)
        if len({id(b) for b in batches}) != len(batches):
            raise InvalidUsage("the same batch is listed twice in one compare_and_append_batch")
        for b in batches:
            if not isinstance(b, Batch):
                raise InvalidUsage(f"expected a Batch, got {type(b).__name__}")
            if b.consumed:
                raise InvalidUsage(f"{b!r} was already appended, deleted or transmitted")
            if b.shard_id != self.shard_id:
                raise InvalidUsage(f"{b!r} was written for another shard than {self.shard_id}")
            if not (expected <= b.lower and b.upper <= new):
                raise InvalidBatchBounds(
                    f"batch [{b.lower}, {b.upper}) does not lie within the append "
                    f"[{expected}, {new}) of shard {self.shard_id}"
                )
        owners = self._check_appendable(batches)  # persist.gc: parts exist, owners live
        if expected == new:
            pieces: list[HollowBatch] = []
        else:
            pieces = self._assemble(batches, expected, new)
        token = uuid.uuid4().hex
        wid = self.writer_id
        lease = self._lease_ms
        machine = self._machine
        # Compaction results offered by the compactor ride along in this version.
        merges = machine.take_merge_results() if pieces else []

        def fn(st: ShardState, fresh: bool) -> tuple[list[FueledMergeReq], bool]:
            w = st.writers.get(wid)
            if w is not None and w.last_token == token:
                return [], False  # committed by an attempt whose outcome was indeterminate
            if st.upper != expected:
                if not fresh:
                    raise Stale()
                raise UpperMismatch(expected, st.upper)
            if not pieces:
                return [], False
            now = machine.now_ms()
            self._check_owners(st, owners, fresh, now)
            for res in merges:
                if not st.contains_batch(res.output):
                    st.apply_merge_res(res, now)
            reqs: list[FueledMergeReq] = []
            for hb in pieces:
                reqs.extend(st.append_batch(hb, wid, token, now, lease))
            return reqs, True

        try:
            reqs = machine.apply(fn, keep=(wid,))
        except PersistError as e:
            if merges and not e.is_indeterminate():
                machine.offer_merge_results(merges)  # still candidates; else GC's
            raise
        if pieces:
            self._registered = True  # append_batch registered or renewed this writer
            self._last_heartbeat_ms = machine.now_ms()
        own = sum(
            1
            for b in batches
            if b is not self._fresh_batch
            and all(key_writer_id(k) == self.writer_id for k in b.blob_keys())
        )
        self._lent = max(0, self._lent - own)
        if merges:
            self._client.compactor.release_outputs(machine, merges)
        for b in batches:
            b.mark_consumed()
        if reqs:
            self._client._on_merge_reqs(machine, reqs)

    def expire(self) -> None:
        """Unregister this writer from the shard state (GC may then delete the parts it
        left behind, once older than the grace period).  Idempotent.

        A writer whose builders produced batches it did not append itself (e.g. batches
        transmitted to another process, which appends them) is not unregistered: its
        lease runs out by itself, so the receiver can append them within the lease.
        """
        if self._expired:
            return
        self._expired = True
        if self._lent > 0:
            log.info(
                "writer %s of shard %s handed out %d batch(es) it did not append: its "
                "lease is left to run out",
                self.writer_id,
                self.shard_id,
                self._lent,
            )
            return

        def fn(st: ShardState, fresh: bool) -> tuple[None, bool]:
            return None, st.expire_writer(self.writer_id)

        self._machine.apply(fn)

    def __enter__(self) -> WriteHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.expire()
        except PersistError as e:  # pragma: no cover - best effort on exit
            log.warning("could not expire writer %s: %s", self.writer_id, e)


class BatchBuilder:
    """Builds a :class:`Batch` piece by piece (the persist-client ``BatchBuilder``).

    Updates are buffered; whenever the buffer exceeds the client's target part size
    (in-memory Arrow bytes) it is consolidated and written as one run of parts.
    """

    def __init__(self, handle: WriteHandle, lower: Antichain) -> None:
        self._h = handle
        self.lower = lower
        self._buffer: list[pa.Table] = []
        self._buffered_bytes = 0
        self._parts: list[PartRef] = []
        self._runs: list[int] = []
        self._max_time: int | None = None
        self._finished = False

    def add(self, updates: Updates) -> None:
        """Add updates (a Table/RecordBatch or a list of ``((k, v), t, d)``).

        Raises:
            UpdateNotBeyondLower: a ``_time`` is before ``lower`` (nothing is added).
            InvalidUsage: bad columns, or the builder is finished.
        """
        if self._finished:
            raise InvalidUsage("cannot add to a finished BatchBuilder")
        table = self._h._normalize(updates)
        rng = _time_range(table)
        if rng is None:
            return
        if not self.lower.less_equal(rng[0]):
            raise UpdateNotBeyondLower(rng[0], self.lower)
        self._max_time = rng[1] if self._max_time is None else max(self._max_time, rng[1])
        self._buffer.append(table)
        self._buffered_bytes += table.nbytes
        if self._buffered_bytes >= self._h._client.target_part_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._buffer:
            return
        table = pa.concat_tables(self._buffer)
        self._buffer, self._buffered_bytes = [], 0
        run = self._h._write_run(table, self._h._key_prefix())  # stamped per run
        if run:
            if self._parts:
                self._runs.append(len(self._parts))
            self._parts.extend(run)

    def finish(self, upper: Antichain | int) -> Batch:
        """Write what is buffered and return the :class:`Batch` ``[lower, upper)``.

        Raises:
            InvalidBounds: ``upper`` is before ``lower``.
            UpdateBeyondUpper: an added ``_time`` is not before ``upper`` (the parts
                already written are deleted).
        """
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
        hollow = HollowBatch(
            desc=Description(self.lower, up),
            parts=tuple(self._parts),
            len=sum(p.rows for p in self._parts),
            runs=tuple(self._runs),
        )
        return Batch(self._h._client.blob, self._h.shard_id, hollow)

    def abort(self) -> None:
        """Drop the buffer and delete the parts already written."""
        self._finished = True
        self._buffer = []
        Batch(
            self._h._client.blob,
            self._h.shard_id,
            HollowBatch(Description(self.lower, self.lower), tuple(self._parts)),
        ).delete()
