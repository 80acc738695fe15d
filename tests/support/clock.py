"""One settable clock for tests that inject ``clock=`` (leases, grace periods, token
windows): ``clock()`` returns :attr:`now`, float seconds since the epoch, which only the
test moves (set it, or :meth:`advance` it), so no test depends on the wall clock."""

from __future__ import annotations


class Clock:
    """A callable clock that stands still until moved.

    ``Clock(now=1_700_000_000.0)``; ``clock()`` -> ``now`` (float seconds);
    ``clock.now = x`` or ``clock.advance(seconds)`` moves it (backwards too, for tests of
    a clock that steps back).  ``t`` is another name for ``now``."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = float(now)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move the clock by ``seconds`` and return the new reading."""
        self.now += seconds
        return self.now

    @property
    def t(self) -> float:
        return self.now

    @t.setter
    def t(self, value: float) -> None:
        self.now = value
