"""Prometheus metrics of stash transactions, in ``prometheus_client``'s
default registry so that an application's existing exporter picks them up.

Families (every one labelled by ``backend``: ``sqlite``, ``postgresql``, ``memory``):

* ``stash_txn_duration_seconds`` (histogram; label ``kind``: ``read`` or ``write``): wall
  time of a whole transaction as its caller sees it, retries included;
* ``stash_txn_retries_total``: transaction attempts run again after a transient failure
  (a busy database, a serialization failure, a lost connection);
* ``stash_txn_conflicts_total``: transactions refused because another writer moved a
  collection's upper first (``AppendLowerMismatch``, the optimistic-concurrency
  conflict the caller sees);
* ``stash_fence_errors_total``: transactions refused because a newer fenced handle took
  over (``FenceError``).

Invariants: recording never raises into the transaction it observes and never changes its
outcome; names follow the Prometheus conventions (base units, ``_seconds``, ``_total``);
label values are a small closed set (no collection names, no URLs, so no credentials).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

from prometheus_client import Counter, Histogram

from stash.errors import AppendLowerMismatch, FenceError

__all__ = [
    "TXN_CONFLICTS",
    "TXN_FENCE_ERRORS",
    "TXN_RETRIES",
    "TXN_SECONDS",
    "backend_of",
    "observe_txn",
    "record_retry",
]

R = TypeVar("R")

TXN_SECONDS = Histogram(
    "stash_txn_duration_seconds",
    "Wall time of stash transactions, retries included.",
    ["backend", "kind"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
TXN_RETRIES = Counter(
    "stash_txn_retries_total",
    "Stash transaction attempts run again after a transient failure.",
    ["backend"],
)
TXN_CONFLICTS = Counter(
    "stash_txn_conflicts_total",
    "Stash transactions refused because another writer moved an upper first.",
    ["backend"],
)
TXN_FENCE_ERRORS = Counter(
    "stash_fence_errors_total",
    "Stash transactions refused because a newer fenced handle took over.",
    ["backend"],
)


def backend_of(stash: Any) -> str:
    """The ``backend`` label of a stash handle: the SQL dialect name (``sqlite``,
    ``postgresql``) of SQL stashes, the inner store's of a ``Memory(inner)`` cache,
    ``memory`` otherwise."""
    name = getattr(stash, "backend", None)
    if isinstance(name, str):
        return name
    inner = getattr(stash, "inner", None)  # Memory(inner): the store underneath
    return backend_of(inner) if inner is not None and inner is not stash else "memory"


def record_retry(backend: str) -> None:
    """Count one transaction attempt run again on ``backend``."""
    TXN_RETRIES.labels(backend).inc()


def observe_txn(stash: Any, write: bool, run: Callable[[], R]) -> R:
    """Run ``run()`` (one whole transaction of ``stash``) and record its duration and,
    if it raised, whether it was a conflict or a fence error; re-raises what it raised."""
    t0 = time.perf_counter()
    try:
        return run()
    except AppendLowerMismatch:
        TXN_CONFLICTS.labels(backend_of(stash)).inc()
        raise
    except FenceError:
        TXN_FENCE_ERRORS.labels(backend_of(stash)).inc()
        raise
    finally:
        _txn_seconds(backend_of(stash), write).observe(time.perf_counter() - t0)


@functools.lru_cache(maxsize=64)
def _txn_seconds(backend: str, write: bool) -> Any:
    """The ``TXN_SECONDS`` child of ``backend`` and the kind (its label lookup, with
    its lock and checks, done once: label values are a small closed set)."""
    return TXN_SECONDS.labels(backend, "write" if write else "read")
