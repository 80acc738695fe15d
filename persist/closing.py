"""A close gate: calls enter it until it is closed, and closing waits for the calls in
flight, so nothing that entered commits after ``close()`` returns.

Invariants: once :meth:`CloseGate.close` has returned, every call that entered has
left and no call enters again (each is refused by the ``refuse`` function given,
before it does anything); a thread closing the gate from inside a call of its own does
not wait for itself.  (A ``threading.Condition`` over the count of calls in flight per
thread, as a read-write lock's writer waits for its readers.)
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Concatenate, ParamSpec, Protocol, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class CloseGate:
    """Admits calls until closed (see the module docstring).

    Args:
        refuse: called with a call's verb when the gate is closed; it raises the
            caller's error (``InvalidUsage`` naming the object and the verb).
    """

    def __init__(self, refuse: Callable[[str], None]) -> None:
        self._refuse = refuse
        self._cond = threading.Condition(threading.Lock())
        self._in: dict[int, int] = {}  # thread ident -> calls of it in flight
        self.closed = False

    def check(self, verb: str) -> None:
        """Raise the ``refuse`` error if the gate is closed."""
        if self.closed:
            self._refuse(verb)

    @contextlib.contextmanager
    def entered(self, verb: str) -> Iterator[None]:
        """Run the ``with`` body as a call in flight: refused (``refuse(verb)``) if the
        gate is closed; :meth:`close` waits for it to leave."""
        me = threading.get_ident()
        with self._cond:
            if self.closed:
                self._refuse(verb)
            self._in[me] = self._in.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                n = self._in.pop(me) - 1
                if n:
                    self._in[me] = n
                self._cond.notify_all()

    def close(self) -> None:
        """Refuse every later call and wait for the calls in flight (other threads')
        to leave.  Idempotent."""
        me = threading.get_ident()
        with self._cond:
            self.closed = True
            self._cond.wait_for(lambda: not (self._in.keys() - {me}))


class _Gated(Protocol):
    _gate: CloseGate


G = TypeVar("G", bound=_Gated)


def gated(verb: str) -> Callable[[Callable[Concatenate[G, P], R]], Callable[Concatenate[G, P], R]]:
    """Decorate a method of an object with a ``_gate`` (:class:`CloseGate`): the call
    runs inside ``self._gate.entered(verb)``."""

    def wrap(fn: Callable[Concatenate[G, P], R]) -> Callable[Concatenate[G, P], R]:
        @functools.wraps(fn)
        def run(self: G, /, *args: P.args, **kwargs: P.kwargs) -> R:
            with self._gate.entered(verb):
                return fn(self, *args, **kwargs)

        return run

    return wrap


__all__ = ["CloseGate", "gated"]
