"""A fault injector for tests: :class:`UnreliableBlob`, after the ``UnreliableBlob`` of
Materialize's first persist engine (``src/persist/src/indexed/``).

Invariants kept here:

* keys are validated before any fault is decided, so :class:`~persist.errors.InvalidKey`
  stays deterministic;
* an injected failure of ``set`` or ``delete`` may come after the inner call did its
  work (a lost acknowledgement): a failed call is indeterminate, as on a real store;
* faults come from a private, seedable ``random.Random``: one seed, one sequence of
  faults for one sequence of calls.
"""

from __future__ import annotations

import random
import threading
import time

from persist.blob.base import Blob, BlobMetrics, Closable, validate_key, validate_prefix
from persist.errors import BlobError

__all__ = ["UnreliableBlob"]


class UnreliableBlob(Closable):
    """A :class:`Blob` wrapper that injects faults, after Materialize's ``UnreliableBlob``.

    While faults are on, each call (``get``, ``set``, ``delete``, ``list_keys``) first
    sleeps a random ``0..slow_seconds`` and then fails with :class:`BlobError` with
    probability ``fail_probability``. A failing ``set`` (or ``delete``) is, with
    probability ``after_write_probability``, a call that *did* its work on the inner store
    and then raised (a put whose acknowledgement was lost): callers must treat a failed
    ``set`` as indeterminate. :meth:`make_unavailable` makes every call fail (as the
    Materialize's ``UnreliableHandle::make_unavailable``); :meth:`faults` turns injection on/off.
    Keys are validated before any fault, so :class:`InvalidKey` stays deterministic.

    Args:
        inner: the store that does the real work.
        fail_probability: chance in ``[0, 1]`` that a call fails.
        seed: seed of the private ``random.Random`` (reproducible faults).
        slow_seconds: upper bound of the random delay per call, in seconds.
        after_write_probability: chance in ``[0, 1]`` that an injected ``set``/``delete``
            failure happens after the inner call succeeded.

    Attributes:
        faults_injected: number of injected failures so far.

    Raises:
        ValueError: a probability outside ``[0, 1]`` or a negative ``slow_seconds``.
    """

    def __init__(
        self,
        inner: Blob,
        fail_probability: float = 0.1,
        seed: int | None = None,
        slow_seconds: float = 0.0,
        after_write_probability: float = 0.5,
    ) -> None:
        for name, p in (
            ("fail_probability", fail_probability),
            ("after_write_probability", after_write_probability),
        ):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {p}")
        if slow_seconds < 0:
            raise ValueError(f"slow_seconds must be >= 0, got {slow_seconds}")
        self.inner = inner
        self.fail_probability = fail_probability
        self.slow_seconds = slow_seconds
        self.after_write_probability = after_write_probability
        self.faults_injected = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._on = True
        self._unavailable = False

    def __repr__(self) -> str:
        return f"UnreliableBlob({self.inner!r}, fail_probability={self.fail_probability})"

    @property
    def metrics(self) -> BlobMetrics:
        """The inner store's counters (what really reached storage)."""
        return self.inner.metrics

    def faults(self, on: bool) -> None:
        """Turn fault injection (failures and delays) on or off."""
        with self._lock:
            self._on = on

    def make_unavailable(self) -> None:
        """Make every call fail until :meth:`make_available` (even with faults off)."""
        with self._lock:
            self._unavailable = True

    def make_available(self) -> None:
        """Undo :meth:`make_unavailable`."""
        with self._lock:
            self._unavailable = False

    def _decide(self) -> tuple[bool, bool, float]:
        """(fail?, after the write?, delay in seconds) for one call."""
        with self._lock:
            if self._unavailable:
                fail, after, delay = True, False, 0.0
            elif not self._on:
                return False, False, 0.0
            else:
                delay = self._rng.uniform(0, self.slow_seconds) if self.slow_seconds else 0.0
                fail = self._rng.random() < self.fail_probability
                after = fail and self._rng.random() < self.after_write_probability
            if fail:
                self.faults_injected += 1
            return fail, after, delay

    def _fault(self, op: str, key: str, after: bool) -> BlobError:
        when = " after the write" if after else ""
        return BlobError(f"unavailable: injected fault{when} in blob {op} {key!r}")

    def get(self, key: str) -> bytes | None:
        """Like the inner ``get``, but may sleep and raise BlobError."""
        validate_key(key)
        self._check_open()
        fail, _, delay = self._decide()
        if delay:
            time.sleep(delay)
        if fail:
            raise self._fault("get", key, False)
        return self.inner.get(key)

    def set(self, key: str, value: bytes) -> None:
        """Like the inner ``set``; may raise BlobError before or after writing."""
        validate_key(key)
        self._check_open()
        fail, after, delay = self._decide()
        if delay:
            time.sleep(delay)
        if fail and not after:
            raise self._fault("set", key, False)
        self.inner.set(key, value)
        if fail:
            raise self._fault("set", key, True)

    def delete(self, key: str) -> None:
        """Like the inner ``delete``; may raise BlobError before or after deleting."""
        validate_key(key)
        self._check_open()
        fail, after, delay = self._decide()
        if delay:
            time.sleep(delay)
        if fail and not after:
            raise self._fault("delete", key, False)
        self.inner.delete(key)
        if fail:
            raise self._fault("delete", key, True)

    def list_keys(self, prefix: str = "") -> list[tuple[str, int]]:
        """Like the inner ``list_keys``, but may sleep and raise BlobError."""
        validate_prefix(prefix)
        self._check_open()
        fail, _, delay = self._decide()
        if delay:
            time.sleep(delay)
        if fail:
            raise self._fault("list_keys", prefix, False)
        return self.inner.list_keys(prefix)

    def close(self) -> None:
        """Close this wrapper and the inner store."""
        super().close()
        self.inner.close()
