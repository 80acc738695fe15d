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

``stash_txn_duration_seconds`` is observed by every stash transaction, so it is a
:class:`Histogram` of this module (the exposition of ``prometheus_client.Histogram``, at a
fraction of its cost per observation); the counters are ``prometheus_client``'s.

Invariants: recording never raises into the transaction it observes and never changes its
outcome; names follow the Prometheus conventions (base units, ``_seconds``, ``_total``);
label values are a small closed set (no collection names, no URLs, so no credentials).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

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


class _HistogramChild:
    """One label set's buckets (not cumulative: ``counts[i]`` observations fell in bucket
    ``i``, the last being ``+Inf``), sum and creation time."""

    __slots__ = ("_bounds", "_counts", "_created", "_lock", "_sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self._counts = [0] * len(bounds)
        self._sum = 0.0
        self._created = time.time()
        self._lock = threading.Lock()

    def observe(self, amount: float) -> None:
        """Count ``amount`` in the first bucket whose bound is at least it."""
        i = bisect_left(self._bounds, amount)  # the last bound is +Inf
        with self._lock:
            self._counts[i] += 1
            self._sum += amount

    def snapshot(self) -> tuple[list[int], float, float]:
        with self._lock:
            return list(self._counts), self._sum, self._created


class Histogram(Collector):
    """A labelled histogram exposed exactly as ``prometheus_client.Histogram`` exposes one
    (``_bucket`` with cumulative ``le`` counts, ``_count``, ``_sum`` and, unless
    prometheus_client's ``_created`` series are disabled, ``_created``), whose
    ``labels(...).observe(x)`` is one bisection and one lock: prometheus_client's takes a
    lock for the sum and another for the bucket, about 2 µs, on every stash transaction.
    Like the stash's other families it lives in one process's registry (no
    ``PROMETHEUS_MULTIPROC_DIR`` aggregation).

    Args:
        name, documentation, labelnames, buckets: as ``prometheus_client.Histogram``
            (``buckets`` sorted; ``+Inf`` is added).
        registry: where it is registered (``None``: nowhere).
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError("histogram buckets must be sorted")
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self._name, self._doc = name, documentation
        self._labelnames = tuple(labelnames)
        self._bounds = tuple(bounds)
        go_string: Callable[[float], str] = floatToGoString  # prometheus_client's le text
        self._le = tuple(go_string(b) for b in bounds)
        self._children: dict[tuple[str, ...], _HistogramChild] = {}
        self._lock = threading.Lock()
        if registry is not None:
            registry.register(self)

    def labels(self, *values: object) -> _HistogramChild:
        """The child of the label values ``values`` (one per label name)."""
        if len(values) != len(self._labelnames):
            raise ValueError(f"{self._name}: expected labels {list(self._labelnames)}")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            with self._lock:
                child = self._children.setdefault(key, _HistogramChild(self._bounds))
        return child

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._doc, labels=self._labelnames)
        with self._lock:
            children = list(self._children.items())
        for key, child in children:
            counts, total, created = child.snapshot()
            cumulative, buckets = 0, []
            for le, n in zip(self._le, counts, strict=True):
                cumulative += n
                buckets.append((le, float(cumulative)))
            family.add_metric(list(key), buckets, total)
            if getattr(prometheus_metrics, "_use_created", True):
                family.add_sample(
                    self._name + "_created", dict(zip(self._labelnames, key, strict=True)), created
                )
        yield family


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
