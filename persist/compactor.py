"""The compactor: answers the Spine's merge requests (physical compaction).

For a :class:`~persist.spine.FueledMergeReq` the compactor reads the inputs' parts
(times advanced to each batch's lower and since, see :func:`persist.fetch.read_batches`),
advances every time to the request's since, consolidates (vectorised, with
:func:`persist.consolidation.consolidate`), writes the result as one sorted run (inline if small)
and swaps it into the trace by compare-and-set
(:meth:`~persist.machine.ShardMachine.apply_merge_results`),
re-applied on seqno races.  It runs inline after an append, as a background thread of
the client (:mod:`persist.maintenance`), from ``persist compact``, or from any process
(Spark) holding a client.  The compactor itself runs no thread: it holds the client's
:class:`~persist.context.PersistContext`, never the client.
After an append (inline or in the background) only requests that pass the compaction
heuristic (:func:`persist.spine.worth_compacting`: enough inputs, parts or updates) are
answered; the smaller ones are covered by a later request, or by :meth:`compact_once`
(``persist compact``), which answers every outstanding request.

Invariants kept here:

* a merge never changes what any readable ``as_of`` (``>= since``) sees: the output
  holds exactly the inputs' updates with times advanced to the since of the committed
  state version the compactor read (or the request's, if later), which is ``<=`` the
  shard's since at apply time, and the output's description records that since;
* a merge rewrites its inputs under the newest value schema version: each
  input part is conformed to it before consolidation, so a row is the same whichever
  version wrote it, and the output's parts record that version's id;
* blob keys the applied output replaces are *retired* in the same version (GC deletes
  them after the grace period, so readers of an older version keep working); an output
  that was not applied is deleted at once unless the latest state references or
  retired it (which only an indeterminate commit can cause);
* a failed merge changes nothing but leaves garbage for GC; the request stays in the
  trace and :meth:`Compactor.compact_once` issues it again;
* the compactor is a writer: it registers in a shard's state (with the client's writer
  lease, renewed as it works) before it writes outputs there, and names its outputs'
  keys after itself (:mod:`persist.keys`), so GC never deletes an output, applied or
  offered to a writer's append, while the compactor lives; an output of a compactor
  that is no longer live is never applied.

Sources: the first engine's maintenance requests (Materialize's ``src/persist/src/indexed/``)
and the Spine's ``FueledMergeReq``/``apply_merge_res``
(``src/persist-client/src/internal/trace.rs``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

from persist import metrics as persist_metrics
from persist.context import PersistContext
from persist.errors import PersistError
from persist.fetch import read_batches
from persist.keys import new_writer_id, part_name_prefix
from persist.machine import ShardMachine
from persist.parts import consolidate_order, updates_schema, write_parts
from persist.spine import ApplyMergeResult, FueledMergeReq, FueledMergeRes
from persist.spine_merge import merge_output_desc
from persist.types import HollowBatch


class BackgroundWorker(Protocol):
    """The thread that answers merge requests in the background
    (:class:`persist.maintenance.Maintenance`), as the compactor's thread-facing
    methods see it."""

    def start(self) -> None: ...
    def notify(self, shard_id: str) -> None: ...
    def wait_idle(self, timeout: float | None = None) -> bool: ...
    def stop(self) -> None: ...


__all__ = ["CompactionReport", "Compactor"]


def _keys(res: FueledMergeRes) -> list[str]:
    return [p.key for p in res.output.parts if p.key is not None]


log = logging.getLogger(__name__)


@dataclass
class CompactionReport:
    """What a compaction pass did.

    Attributes:
        applied: merges swapped into the trace.
        not_applied: merges whose result no longer matched (stale requests).
        failed: merges that raised (logged; the request stays outstanding).
        rows_in, rows_out: updates read and written (rows).
        bytes_written: encoded bytes of the outputs.
        results: the :class:`ApplyMergeResult` of each merge tried.
    """

    applied: int = 0
    not_applied: int = 0
    failed: int = 0
    rows_in: int = 0
    rows_out: int = 0
    bytes_written: int = 0
    results: list[ApplyMergeResult] = field(default_factory=list)

    def add(self, other: CompactionReport) -> None:
        self.applied += other.applied
        self.not_applied += other.not_applied
        self.failed += other.failed
        self.rows_in += other.rows_in
        self.rows_out += other.rows_out
        self.bytes_written += other.bytes_written
        self.results.extend(other.results)


class Compactor:
    """Answers merge requests for the shards of one client (its
    :class:`~persist.context.PersistContext` ``ctx``).

    Thread-safe.  It runs no thread of its own: :meth:`start`, :meth:`notify`,
    :meth:`wait_idle` and :meth:`stop` pass on to the background worker attached to it
    (:class:`persist.maintenance.Maintenance`), if any.
    """

    def __init__(self, ctx: PersistContext) -> None:
        self.ctx = ctx
        self._worker: BackgroundWorker | None = None
        self._totals_lock = threading.Lock()  # a leaf lock
        self._writers: dict[str, tuple[str, int]] = {}  # shard id -> (writer id, last hb ms)
        self._writers_lock = threading.Lock()
        self.totals = CompactionReport()

    # ------------------------------------------------------------------ lease
    def writer_id(self, machine: ShardMachine) -> str:
        """The id under which this compactor is registered as a writer of the shard
        (registering it, or renewing its lease past a quarter of its duration).  If its
        earlier registration ran out, a new id is registered: outputs written under the
        old one are never applied (GC may have deleted them).

        Raises:
            ConsensusError: the stash failed.
        """
        sid = machine.shard_id
        lease_ms = int(self.ctx.config.writer_lease_seconds * 1000)
        now = machine.now_ms()
        with self._writers_lock:
            cur = self._writers.get(sid)
        if cur is not None and now - cur[1] <= lease_ms // 4:
            return cur[0]
        wid = cur[0] if cur is not None else new_writer_id()
        renew = cur is not None
        # The old id's lease may have run out: an id is never reused, so a new one is
        # drawn to register instead.
        got = machine.register_compactor(wid, new_writer_id(), renew, now, lease_ms)
        with self._writers_lock:
            self._writers[sid] = (got, now)
        return got

    def expire_writers(self) -> None:
        """Unregister this compactor from every shard it wrote to (best effort; called
        by ``PersistClient.close``).  Outputs it had not applied become garbage."""
        with self._writers_lock:
            items, self._writers = list(self._writers.items()), {}
        for sid, (wid, _ms) in items:
            try:
                self.ctx.machine(sid).expire_writer(wid)
            except PersistError as e:
                log.info("could not expire compactor writer %s of shard %s: %s", wid, sid, e)

    # ---------------------------------------------------------------- merging
    def compute(self, machine: ShardMachine, req: FueledMergeReq) -> tuple[FueledMergeRes, int]:
        """Compute (and write the parts of) the answer to a merge request, without
        applying it.  Returns the result and the number of rows read.

        The inputs are consolidated at the since of the committed state version this
        works from (the later of it and the request's,
        :func:`persist.spine_merge.merge_output_desc`), which the output's description
        carries: a request made long before the shard's since moved on still yields one
        time per key and value when every reader's since is past the inputs' times.  A
        stale version in hand only advances less.

        Raises:
            CorruptPart, BlobError: reading or writing failed (outputs already written
                are left to GC).
        """
        ctx, cfg = self.ctx, self.ctx.config
        st = machine.state()
        inputs: list[HollowBatch] = [i.batch for i in req.inputs]
        history = st.schemas()
        newest = history.newest
        if any(p.schema_id > newest for b in inputs for p in b.parts):
            st = machine.refresh()  # a version registered since this process last looked
            history, newest = st.schemas(), st.schemas().newest
        ks, vs = st.key_schema, st.value_schema
        # Consolidated at the since of the committed version in hand (never a cache of
        # a reader's hold): at most the since at apply time and every readable as_of.
        desc = merge_output_desc(req, st.since)
        # Conformed to the newest schema version *before* consolidating: rows that
        # differ only in a dropped column become one.
        table = read_batches(
            ctx.blob,
            inputs,
            updates_schema(ks, vs),
            max_workers=cfg.read_workers,
            schemas=(history, newest),
        )
        rows_in = table.num_rows
        table, order = consolidate_order(table, ks.names, vs.names, since=desc.since.as_option())
        rows_out = table.num_rows if order is None else len(order)
        inline_max = cfg.inline_max_bytes if st.inline_bytes() < cfg.inline_total_max_bytes else 0
        wid = self.writer_id(machine)  # registered before any output is uploaded
        stem = part_name_prefix(wid, machine.now_ms())  # flat keys, see persist.keys
        parts = write_parts(
            ctx.blob,
            table,
            f"{machine.shard_id}/c",
            target_part_bytes=cfg.target_part_bytes,
            inline_max_bytes=inline_max,
            max_workers=cfg.write_workers,
            order=order,
            name_prefix=stem,
            key_names=ks.names,
            schema=history.updates_schema(newest),
        )
        if newest:
            parts = [replace(p, schema_id=newest) for p in parts]
        return FueledMergeRes(HollowBatch(desc, tuple(parts), rows_out)), rows_in

    def apply(self, machine: ShardMachine, results: list[FueledMergeRes]) -> list[ApplyMergeResult]:
        """Swap computed results into the shard's trace in one compare-and-set (retried
        on seqno races); outputs that were not applied are deleted.

        Raises:
            ConsensusError: the commit failed (outputs are deleted unless the outcome is
                indeterminate).
        """
        if not results:
            return []
        try:
            rs = machine.apply_merge_results(results)
        except PersistError as e:
            # An earlier attempt of this apply may have committed (its outcome was
            # indeterminate, then learned by re-reading): only outputs the latest
            # known state neither references nor retired may go.
            if not e.is_indeterminate():
                self.release_outputs(machine, results)
            raise
        self.release_outputs(
            machine, [r for r, a in zip(results, rs, strict=True) if not a.applied()]
        )
        return rs

    def release_outputs(self, machine: ShardMachine, results: list[FueledMergeRes]) -> None:
        """Delete the blob outputs of results the latest known state neither references
        nor retired (they were not applied)."""
        keys = [k for r in results for k in _keys(r)]
        if not keys:
            return
        st = machine.state()
        protected = st.referenced_blob_keys()
        if any(k not in protected for k in keys):
            try:
                protected |= set(machine.consensus.retired(machine.shard_id))
            except PersistError as e:  # cannot tell: leave them to GC
                log.warning("not deleting unused compaction outputs: %s", e)
                return
        self._delete_outputs(keys, protected)

    def _delete_outputs(self, keys: list[str], protected: set[str]) -> None:
        for k in keys:
            if k in protected:
                continue
            try:
                self.ctx.blob.delete(k)
            except PersistError as e:  # garbage for GC
                log.warning("could not delete unused compaction output %s: %s", k, e)

    def merge(self, machine: ShardMachine, req: FueledMergeReq) -> CompactionReport:
        """Answer one merge request and apply the result (see the module docstring).

        Raises:
            CorruptPart, BlobError, ConsensusError: reading, writing or committing failed
                (nothing was applied).
        """
        return self.run_reqs(machine, [req], raise_errors=True)

    def run_reqs(
        self,
        machine: ShardMachine,
        reqs: list[FueledMergeReq],
        *,
        piggyback_seconds: float = 0.0,
        raise_errors: bool = False,
    ) -> CompactionReport:
        """Answer the given requests: compute every result, then (after offering them for
        ``piggyback_seconds`` to a writer's next append, which applies them in its own
        version) apply what is left in one compare-and-set.  Failures are logged and
        counted (or raised with ``raise_errors``)."""
        report = CompactionReport()
        results: list[FueledMergeRes] = []
        for req in reqs:
            try:
                res, rows_in = self.compute(machine, req)
            except PersistError as e:
                if raise_errors:
                    raise
                report.failed += 1
                log.warning(
                    "merge of %s in shard %s failed: %s",
                    req.desc,
                    machine.shard_id,
                    e,
                    extra={"shard": machine.shard_id},
                )
                continue
            results.append(res)
            report.rows_in += rows_in
            report.rows_out += res.output.len
            report.bytes_written += sum(p.encoded_size_bytes for p in res.output.parts)
        if results and piggyback_seconds > 0:
            machine.offer_merge_results(results)
            deadline = time.monotonic() + piggyback_seconds
            while machine.offered_count() and time.monotonic() < deadline:
                time.sleep(0.002)
            left = machine.take_merge_results()
            report.applied += len(results) - len(left)  # taken by a writer's append
            results = left
        try:
            rs = self.apply(machine, results)
        except PersistError as e:
            if raise_errors:
                raise
            report.failed += len(results)
            log.warning(
                "applying merges in shard %s failed: %s",
                machine.shard_id,
                e,
                extra={"shard": machine.shard_id},
            )
            rs = []
        report.results.extend(rs)
        report.applied += sum(1 for r in rs if r.applied())
        report.not_applied += sum(1 for r in rs if not r.applied())
        with self._totals_lock:
            self.totals.add(report)
        persist_metrics.observe_compaction(report)
        return report

    def compact_once(
        self, shard: str, *, fresh: bool = True, heuristic: bool = False
    ) -> CompactionReport:
        """Answer every outstanding merge request of a shard (a name, or ``id:<shard
        id>``: see :meth:`PersistContext.shard_id`), from a fresh
        read of its state (or this process's latest known version if not ``fresh``);
        with ``heuristic`` (the background thread) only those worth a physical merge
        (:func:`persist.spine.worth_compacting`)."""
        m = self.ctx.machine(self.ctx.shard_id(shard))
        st = m.refresh() if fresh else m.state()  # fresh: the head, read now (caught up)
        if heuristic:
            reqs = st.trace.worth_compacting_reqs()
        else:
            reqs = st.trace.all_fueled_merge_reqs()
        piggyback = self.ctx.config.piggyback_seconds if not fresh else 0.0
        return self.run_reqs(m, reqs, piggyback_seconds=piggyback)

    # ------------------------------------------------------------- background
    def attach(self, worker: BackgroundWorker | None) -> None:
        """Set the background worker (:class:`persist.maintenance.Maintenance`) that the
        thread-facing methods below pass on to; ``None`` for none."""
        self._worker = worker

    def start(self) -> None:
        """Start the background worker's thread (idempotent; nothing without one)."""
        if self._worker is not None:
            self._worker.start()

    def notify(self, shard_id: str) -> None:
        """Ask the background worker to compact ``shard_id`` soon."""
        if self._worker is not None:
            self._worker.notify(shard_id)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the background worker has nothing pending (``timeout`` seconds,
        ``None`` for no limit).  Returns False on timeout; True without a worker."""
        return True if self._worker is None else self._worker.wait_idle(timeout)

    def stop(self) -> None:
        """Stop the background worker's thread (pending work is dropped) and wait for
        it."""
        if self._worker is not None:
            self._worker.stop()
