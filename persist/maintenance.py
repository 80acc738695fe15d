"""The background worker of one client: :class:`Maintenance`, the follow-up work that
handles hand on after they change a shard.

A handle calls the hooks of its :class:`~persist.context.PersistContext`
(:class:`~persist.context.MaintenanceHooks`), which this class implements:

* :meth:`Maintenance.after_append`: an append committed with merge requests worth a
  physical merge; with compaction ``"inline"`` they are answered at once (a failure is
  logged, never raised: compaction never fails an append), with ``"background"`` the
  shard is queued for the worker thread, with ``"off"`` nothing happens;
* :meth:`Maintenance.since_moved`: a reader downgraded its since or went away, so
  more may be merged: with ``"background"`` the shard is queued;
* :meth:`Maintenance.release_outputs`: compaction outputs an append was offered and did
  not apply are deleted unless the state references or retired them;
* :meth:`Maintenance.rollup_due`: a version committed whose diffs passed the rollup
  bound (:meth:`persist.consensus.Consensus.rollup_due`): a rollup is written as its
  own compare-and-set (:meth:`persist.machine.ShardMachine.write_rollup`), never inside
  the command's version: with compaction ``"background"`` by the worker thread, with
  ``"inline"`` at once after the command (a failure is logged, never raised), with
  ``"off"`` not at all (the next command's version becomes the rollup once the diffs
  pass twice the bound, :meth:`persist.consensus.Consensus.plan`).

The worker thread writes the rollups asked for, then answers the queued shards'
outstanding merge requests
(:meth:`persist.compactor.Compactor.compact_once` with the compaction heuristic) and
runs GC (:func:`persist.gc.collect_garbage`) on a shard it compacted at most every
``gc_interval_seconds``.

Invariants kept here: the worker thread never dies of an error (it is logged); after
:meth:`Maintenance.stop` no queued work runs; :meth:`Maintenance.wait_idle` returns
True only when nothing is queued or running.  The worker's condition is a leaf lock.

Source of the idea: Materialize's persist-client ``src/persist-client/src/internal/
maintenance.rs`` (commands hand back ``RoutineMaintenance``: GC and compaction requests
the handle starts in the background).
"""

from __future__ import annotations

import logging
import threading
import time

from persist.compactor import Compactor
from persist.context import SHARD_ID_REF, PersistContext
from persist.errors import PersistError
from persist.gc import collect_garbage
from persist.machine import ShardMachine
from persist.spine import FueledMergeReq, FueledMergeRes

__all__ = ["Maintenance"]

log = logging.getLogger(__name__)


class Maintenance:
    """The background worker of one client (see the module docstring).  It attaches
    itself to ``ctx`` (as its hooks) and to ``compactor`` (as its worker).

    Thread-safe.  :meth:`start` runs a daemon thread that compacts every shard it is
    :meth:`notify`-ed about (and runs GC on it at most every ``gc_interval_seconds``).
    """

    def __init__(self, ctx: PersistContext, compactor: Compactor) -> None:
        self.ctx = ctx
        self.compactor = compactor
        self._cv = threading.Condition()
        self._pending: set[str] = set()
        self._rollups: dict[str, ShardMachine] = {}  # shard id -> machine
        self._busy = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._last_gc: dict[str, float] = {}
        ctx.maintenance = self
        compactor.attach(self)

    # ------------------------------------------------------------------ hooks
    def after_append(self, machine: ShardMachine, reqs: list[FueledMergeReq]) -> None:
        """Called by a writer after a successful append that produced merge requests."""
        mode = self.ctx.config.compaction
        if mode == "inline":
            try:
                self.compactor.run_reqs(machine, reqs)
            except PersistError as e:
                log.warning("inline compaction of shard %s failed: %s", machine.shard_id, e)
        elif mode == "background":
            self.notify(machine.shard_id)

    def since_moved(self, shard_id: str) -> None:
        """Called when a shard's since may have moved."""
        if self.ctx.config.compaction == "background":
            self.notify(shard_id)

    def rollup_due(self, machine: ShardMachine) -> None:
        """Called (holding the machine's lock) after a version whose diffs passed the
        rollup bound committed (see the module docstring)."""
        mode = self.ctx.config.compaction
        if mode == "inline":
            self._write_rollup(machine)
        elif mode == "background":
            with self._cv:
                self._rollups[machine.shard_id] = machine
                self._cv.notify_all()

    @staticmethod
    def _write_rollup(machine: ShardMachine) -> None:
        try:
            machine.write_rollup()
        except PersistError as e:  # the hard cap of Consensus.plan bounds the head
            log.warning("rollup of shard %s failed: %s", machine.shard_id, e)

    def release_outputs(self, machine: ShardMachine, results: list[FueledMergeRes]) -> None:
        """:meth:`persist.compactor.Compactor.release_outputs`."""
        self.compactor.release_outputs(machine, results)

    # ----------------------------------------------------------------- thread
    def start(self) -> None:
        """Start the background thread (idempotent)."""
        with self._cv:
            if self._thread is not None:
                return
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="persist-compactor", daemon=True)
            self._thread.start()

    def notify(self, shard_id: str) -> None:
        """Ask the background thread to compact ``shard_id`` soon."""
        with self._cv:
            self._pending.add(shard_id)
            self._cv.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the background thread has nothing pending (``timeout`` seconds,
        ``None`` for no limit).  Returns False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._pending or self._rollups or self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cv.wait(remaining)
        return True

    def stop(self) -> None:
        """Stop the background thread (pending work is dropped) and wait for it."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
            t = self._thread
            self._thread = None
        if t is not None and t is not threading.current_thread():
            t.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._rollups and not self._stop:
                    self._cv.wait()
                if self._stop:
                    self._pending.clear()
                    self._rollups.clear()
                    self._busy = False
                    self._cv.notify_all()
                    return
                shards = sorted(self._pending)
                self._pending.clear()
                rollups = [m for _sid, m in sorted(self._rollups.items())]
                self._rollups.clear()
                self._busy = True
            for m in rollups:
                try:
                    self._write_rollup(m)
                except Exception as e:  # never let the thread die
                    log.warning("rollup of shard %s failed: %s", m.shard_id, e)
            for sid in shards:
                try:
                    self.compactor.compact_once(SHARD_ID_REF + sid, fresh=False, heuristic=True)
                    self._maybe_gc(sid)
                except Exception as e:  # never let the thread die
                    log.warning("background compaction of shard %s failed: %s", sid, e)
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def _maybe_gc(self, shard_id: str) -> None:
        cfg = self.ctx.config
        interval = cfg.gc_interval_seconds
        if interval is None:
            return
        now = time.monotonic()
        last = self._last_gc.get(shard_id)
        if last is not None and now - last < interval:
            return
        self._last_gc[shard_id] = now
        collect_garbage(self.ctx, SHARD_ID_REF + shard_id, grace_seconds=cfg.gc_grace_seconds)
