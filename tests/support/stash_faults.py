"""Stash wrappers that inject faults at commit, shared by the persist tests of unknown
commit outcomes (the idempotency tests, the indeterminate-commit campaign, the lifecycle
model and the transaction interrupt tests).

``AckLostStash(inner)``: an ``append`` that is *hit* commits on ``inner`` and then raises
:class:`stash.IndeterminateError` (the acknowledgement was lost); after it, the next
``reads_to_fail`` reads (``iter``/``upper``, and the reads of :mod:`stash.logs`) fail with a plain :class:`stash.StashError`
(the server stays unreachable).  An append is hit when :meth:`arm` was called before it
(once), or at random with probability ``p`` (seeded).  Everything else is delegated.

``InterruptAfterCommit(inner, exc)``: the next ``append`` after ``armed = True`` commits on
``inner`` and then raises ``exc`` (KeyboardInterrupt, or an error the stash did not wrap):
an exception that is none of the stash's answers, after the commit landed.
"""

from __future__ import annotations

import random
from typing import Any

from stash import IndeterminateError, Stash, StashError


class AckLostStash:
    """See the module docstring.  ``lost_acks`` counts the hit appends."""

    def __init__(self, inner: Stash, seed: int = 0) -> None:
        self.inner = inner
        self.rng = random.Random(seed)
        self.p = 0.0  # probability that an append is hit
        self.max_reads = 0  # reads failing after a random hit: uniform in [0, max_reads]
        self.armed = False
        self.armed_reads = 0
        self.reads_to_fail = 0
        self.lost_acks = 0

    def arm(self, reads: int = 0) -> None:
        """Hit the next append; then fail the ``reads`` reads after it."""
        self.armed = True
        self.armed_reads = reads

    def append(self, batches: Any) -> None:
        self.inner.append(batches)
        if self.armed:
            self.armed = False
            reads = self.armed_reads
        elif self.p and self.rng.random() < self.p:
            reads = self.rng.randrange(self.max_reads + 1)
        else:
            return
        self.lost_acks += 1
        self.reads_to_fail = reads
        raise IndeterminateError("injected: connection lost during COMMIT")

    def _fail_read(self, what: str) -> None:
        if self.reads_to_fail > 0:
            self.reads_to_fail -= 1
            raise StashError(f"injected: {what} failed (server unreachable)")

    def iter(self, c: Any) -> Any:
        self._fail_read("iter")
        return self.inner.iter(c)

    def upper(self, c: Any) -> Any:
        self._fail_read("upper")
        return self.inner.upper(c)

    def _read(self, fn: Any, *, codecs: Any) -> Any:
        """Every other read of the stash (a shard's log: :mod:`stash.logs`)."""
        self._fail_read("read")
        return self.inner._read(fn, codecs=codecs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class InterruptAfterCommit:
    """A stash whose next armed ``append`` commits and then raises ``exc``."""

    def __init__(self, inner: Stash, exc: type[BaseException]) -> None:
        self.inner = inner
        self.exc = exc
        self.armed = False

    def append(self, batches: Any) -> None:
        self.inner.append(batches)
        if self.armed:
            self.armed = False
            raise self.exc("interrupted after the stash committed")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
