"""Background lease renewal: one daemon thread heartbeats every registered lease.

Persist-client keeps a reader's lease alive with a background heartbeat task; here a
:class:`LeaseKeeper` runs registered *beats* (callables that renew one lease) every
``interval`` seconds of its clock.  Listens register while open, and a
:class:`~persist.read.ReadHandle` registers for the duration of a ``snapshot(wait=True)``
or ``snapshot_batches`` call, so that a long wait or read never loses its lease.

Invariants kept here:

* a beat runs at most once per ``interval`` (of the keeper's clock) and never after
  :meth:`LeaseKeeper.unregister` returned (beats run under a per-entry lock);
* a beat returning ``False`` is unregistered (its lease is gone for good); a beat that
  raises is logged and tried again at the next interval (a transient failure);
* the thread is a daemon started on the first registration; a keeper made with
  ``thread=False`` runs beats only when told (:meth:`LeaseKeeper.run_due`), which with
  an injected clock lets tests pass lease intervals without sleeping.

Source of the idea: persist-client's reader heartbeat task (Materialize's
``src/persist-client/src/read.rs``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["DEFAULT_KEEPER", "LeaseKeeper"]

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    name: str
    interval: float
    beat: Callable[[], bool]
    due: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    live: bool = True


class LeaseKeeper:
    """Runs lease heartbeats in the background (see the module docstring).

    Args:
        clock: seconds, monotonic (``time.monotonic``); injectable for tests.
        thread: run beats in a daemon thread (``False``: only via :meth:`run_due`).

    Thread-safe.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, thread: bool = True):
        self.clock = clock
        self._use_thread = thread
        self._cv = threading.Condition()
        self._entries: dict[int, _Entry] = {}
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None

    def register(self, name: str, interval: float, beat: Callable[[], bool]) -> int:
        """Run ``beat`` every ``interval`` seconds (first after one interval) until it
        returns ``False`` or :meth:`unregister` is called.  Returns the registration id.

        Raises:
            ValueError: ``interval`` is not positive.
        """
        if not interval > 0:
            raise ValueError(f"heartbeat interval must be > 0 seconds, got {interval}")
        with self._cv:
            ident = next(self._ids)
            self._entries[ident] = _Entry(name, interval, beat, self.clock() + interval)
            if self._use_thread and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(
                    target=self._loop, name="persist-lease-keeper", daemon=True
                )
                self._thread.start()
            self._cv.notify_all()
        return ident

    def unregister(self, ident: int) -> None:
        """Stop the beat ``ident`` (idempotent); once this returns it never runs again."""
        with self._cv:
            e = self._entries.pop(ident, None)
        if e is not None:
            with e.lock:  # wait for a running beat to finish
                e.live = False

    def registered(self) -> int:
        """How many beats are registered."""
        with self._cv:
            return len(self._entries)

    def run_due(self) -> int:
        """Run every beat that is due now; returns how many ran."""
        now = self.clock()
        with self._cv:
            due = [(i, e) for i, e in self._entries.items() if e.due <= now]
        ran = 0
        for ident, e in due:
            with e.lock:
                if not e.live:
                    continue
                e.due = now + e.interval
                ran += 1
                try:
                    keep = e.beat()
                except Exception as exc:  # transient: tried again next interval
                    log.warning("lease heartbeat %s failed: %s", e.name, exc)
                    keep = True
                if not keep:
                    e.live = False
            if not keep:
                with self._cv:
                    self._entries.pop(ident, None)
        return ran

    def _loop(self) -> None:  # pragma: no cover - timing dependent
        while True:
            with self._cv:
                while not self._entries:
                    self._cv.wait()
                wait = min(e.due for e in self._entries.values()) - self.clock()
                if wait > 0:
                    self._cv.wait(min(wait, 60.0))
                    continue
            self.run_due()


#: The keeper used by read handles and listens unless one is injected.
DEFAULT_KEEPER = LeaseKeeper()
