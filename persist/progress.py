"""Progress of long table operations (:class:`Progress`): nothing for the first
seconds, then a progress bar (tqdm) on a terminal, or ``logging`` lines otherwise, in
rows and bytes.

A :class:`~persist.table.Table` operation runs its phases (``converting``,
``writing``, ``committing``, ``reading``, ...) inside one :class:`Progress`; a daemon
thread wakes every :attr:`Progress.interval` seconds and, once the operation has run
:attr:`Progress.after` seconds, shows where it is: the phase, the rows and bytes it is
working on, the elapsed time.  Short operations show nothing.

Invariants kept here: reporting never fails or slows the operation (its errors are
logged, the thread is a daemon that stops with the operation); a bar is only drawn on a
terminal (``sys.stderr.isatty()``); logging goes to ``persist.progress`` at INFO.

Source of the idea: delta-rs and Spark report long writes' progress (Spark's console
progress bar); tqdm's own delayed bars (``delay=``).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from types import TracebackType
from typing import Any

from rich.filesize import decimal

__all__ = ["Progress"]

log = logging.getLogger(__name__)


class Progress:
    """One long operation's progress (a context manager).

    Args:
        what: the operation, for the messages (e.g. ``"upsert into table 'orders'"``).
        rows, nbytes: its size in rows and bytes (``None``: unknown).
        after: seconds before anything is shown (2 by default).
        interval: seconds between two reports.
        tty: draw a bar (default: whether stderr is a terminal).
    """

    def __init__(
        self,
        what: str,
        rows: int | None = None,
        nbytes: int | None = None,
        *,
        after: float = 2.0,
        interval: float = 1.0,
        tty: bool | None = None,
    ) -> None:
        self.what, self.rows, self.nbytes = what, rows, nbytes
        self.after, self.interval = after, interval
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.phase = "starting"
        self.done_rows = 0
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._bar: Any = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> Progress:
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="persist-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        with self._lock:
            shown = self._bar is not None or self._shown
            if self._bar is not None:
                if exc_type is None and self.rows is not None:
                    self._bar.update(max(0, self.rows - self._bar.n))
                self._bar.close()
                self._bar = None
        if shown and not self.tty:
            outcome = "failed" if exc_type is not None else "done"
            log.info("%s: %s in %.1f s", self.what, outcome, time.monotonic() - self._start)

    _shown = False

    def set_phase(self, phase: str, done_rows: int | None = None) -> None:
        """Enter ``phase`` (``done_rows``: rows finished so far, if known)."""
        with self._lock:
            self.phase = phase
            if done_rows is not None:
                self.done_rows = done_rows

    def _size(self) -> str:
        parts = []
        if self.rows is not None:
            parts.append(f"{self.rows:,} rows")
        if self.nbytes is not None:
            parts.append(decimal(self.nbytes))
        return ", ".join(parts) or "size unknown"

    def _run(self) -> None:
        try:
            if self._stop.wait(self.after):
                return
            while True:
                self._report()
                if self._stop.wait(self.interval):
                    return
        except Exception as e:  # noqa: BLE001 - reporting must never fail the operation
            log.debug("progress reporting of %s failed: %s", self.what, e)

    def _report(self) -> None:
        with self._lock:
            elapsed = time.monotonic() - self._start
            if self.tty:
                if self._bar is None:
                    from tqdm import tqdm

                    self._bar = tqdm(
                        total=self.rows, desc=self.what, unit="row", unit_scale=True, leave=False
                    )
                self._bar.update(max(0, self.done_rows - self._bar.n))
                self._bar.set_postfix_str(f"{self.phase}; {self._size()}")
            else:
                self._shown = True
                log.info("%s: %s (%s) for %.1f s", self.what, self.phase, self._size(), elapsed)
