"""Prometheus metrics of persist, in ``prometheus_client``'s default
registry (an application's existing exporter picks them up), and :func:`serve`, the
``/metrics`` endpoint behind the ``--metrics-port`` option of the CLIs and Spark jobs.

Families (base units; ``_seconds``, ``_bytes``, ``_total`` suffixes):

* ``persist_compare_and_append_duration_seconds`` (histogram): wall time of
  ``compare_and_append`` / ``compare_and_append_batch`` as the caller sees it;
* ``persist_upper_mismatches_total``: appends refused with ``UpperMismatch``;
* ``persist_blob_written_bytes_total``, ``persist_blob_written_parts_total``: parts
  uploaded (every blob value is a part: metadata lives in consensus);
* ``persist_blob_fetched_bytes_total``, ``persist_blob_fetched_parts_total``: parts read;
* ``persist_inline_bytes`` (gauge, label ``shard``): bytes of inline parts the shard's
  latest known state carries;
* ``persist_shard_batches`` (gauge, label ``shard``): hollow batches in the shard's
  Spine (what compaction keeps logarithmic in the number of appends);
* ``persist_compaction_merges_total`` (label ``result``: ``applied``, ``not_applied``,
  ``failed``), ``persist_compaction_written_bytes_total``: merges and their outputs;
* ``persist_gc_deleted_parts_total``: parts GC deleted (retired and abandoned);
* ``persist_lease_expiries_total`` (label ``kind``: ``reader`` or ``writer``): leases
  that ran out and were dropped in a committed state version.

Invariants: recording never raises into the operation it observes; the only per-shard
label is the shard's name (two gauges), so the number of series is bounded by the shards
this process touched; no label carries a URL or a credential.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from persist.tracked import changed_keys

__all__ = [
    "APPEND_SECONDS",
    "BLOB_FETCHED_BYTES",
    "BLOB_FETCHED_PARTS",
    "BLOB_WRITTEN_BYTES",
    "BLOB_WRITTEN_PARTS",
    "COMPACTION_MERGES",
    "COMPACTION_WRITTEN_BYTES",
    "GC_DELETED_PARTS",
    "INLINE_BYTES",
    "LEASE_EXPIRIES",
    "SHARD_BATCHES",
    "UPPER_MISMATCHES",
    "fetched",
    "observe_commit",
    "observe_compaction",
    "observe_gc",
    "serve",
    "timed_append",
    "written",
]

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])

APPEND_SECONDS = Histogram(
    "persist_compare_and_append_duration_seconds",
    "Wall time of compare_and_append calls (uploads, commit and retries included).",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
UPPER_MISMATCHES = Counter(
    "persist_upper_mismatches_total", "compare_and_append calls refused with UpperMismatch."
)
BLOB_WRITTEN_BYTES = Counter("persist_blob_written_bytes_total", "Bytes of parts uploaded.")
BLOB_WRITTEN_PARTS = Counter("persist_blob_written_parts_total", "Parts uploaded.")
BLOB_FETCHED_BYTES = Counter("persist_blob_fetched_bytes_total", "Bytes of parts fetched.")
BLOB_FETCHED_PARTS = Counter("persist_blob_fetched_parts_total", "Parts fetched.")
INLINE_BYTES = Gauge(
    "persist_inline_bytes", "Bytes of inline parts in the shard's latest known state.", ["shard"]
)
SHARD_BATCHES = Gauge(
    "persist_shard_batches", "Hollow batches in the shard's Spine (latest known state).", ["shard"]
)
COMPACTION_MERGES = Counter(
    "persist_compaction_merges_total", "Compaction merges by outcome.", ["result"]
)
COMPACTION_WRITTEN_BYTES = Counter(
    "persist_compaction_written_bytes_total", "Encoded bytes of compaction outputs."
)
GC_DELETED_PARTS = Counter("persist_gc_deleted_parts_total", "Parts deleted by GC.")
LEASE_EXPIRIES = Counter(
    "persist_lease_expiries_total",
    "Leases that ran out and were dropped in a committed state version.",
    ["kind"],
)


def _safe(fn: Callable[..., None]) -> Callable[..., None]:
    """Recording must never fail the observed operation: log and swallow."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception:  # pragma: no cover - defensive
            log.debug("recording metric %s failed", fn.__name__, exc_info=True)

    return wrapper


def timed_append(fn: F) -> F:
    """Decorator of the append paths: time each call and count ``UpperMismatch``."""
    from persist.errors import UpperMismatch

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except UpperMismatch:
            UPPER_MISMATCHES.inc()
            raise
        finally:
            APPEND_SECONDS.observe(time.perf_counter() - t0)

    return wrapper  # type: ignore[return-value]


@_safe
def written(value: bytes) -> None:
    """Count one part of ``len(value)`` bytes uploaded."""
    BLOB_WRITTEN_PARTS.inc()
    BLOB_WRITTEN_BYTES.inc(len(value))


def fetched(value: bytes | None) -> bytes | None:
    """Count one part fetched (a miss counts nothing); returns ``value``."""
    if value is not None:
        BLOB_FETCHED_PARTS.inc()
        BLOB_FETCHED_BYTES.inc(len(value))
    return value


@_safe
def observe_commit(old: Any, new: Any, now_ms: int) -> None:
    """A state version ``new`` replaced ``old`` (both :class:`~persist.state.ShardState`)
    at ``now_ms``: count the leases that ran out and were dropped, and set the shard's
    batch and inline-bytes gauges.  From the version's diff: only the leases the
    command changed are looked at (:func:`persist.tracked.changed_keys`)."""
    shard = str(getattr(new, "name", "") or new.shard_id)
    for kind, before, after in (
        ("reader", old.readers, new.readers),
        ("writer", old.writers, new.writers),
    ):
        n = 0
        for hid in changed_keys(before, after):
            h = before.get(hid)
            if h is not None and hid not in after and h.expired(now_ms):
                n += 1
        if n:
            LEASE_EXPIRIES.labels(kind).inc(n)
    batches, inline = _shard_gauges(shard)
    batches.set(new.trace.num_hollow_batches())
    inline.set(new.inline_bytes())


@functools.lru_cache(maxsize=4096)
def _shard_gauges(shard: str) -> tuple[Any, Any]:
    """The ``SHARD_BATCHES`` and ``INLINE_BYTES`` children of ``shard`` (their label
    lookups, with their locks and checks, done once per shard, not once per commit)."""
    return SHARD_BATCHES.labels(shard), INLINE_BYTES.labels(shard)


@_safe
def observe_compaction(report: Any) -> None:
    """Count a :class:`~persist.compactor.CompactionReport`'s merges and output bytes."""
    COMPACTION_MERGES.labels("applied").inc(report.applied)
    COMPACTION_MERGES.labels("not_applied").inc(report.not_applied)
    COMPACTION_MERGES.labels("failed").inc(report.failed)
    COMPACTION_WRITTEN_BYTES.inc(report.bytes_written)


@_safe
def observe_gc(report: Any) -> None:
    """Count the parts a :class:`~persist.gc.GcReport` says GC deleted."""
    GC_DELETED_PARTS.inc(len(report.deleted_retired) + len(report.deleted_abandoned))


def serve(port: int | None, addr: str = "0.0.0.0") -> Any:
    """Serve the default registry's ``/metrics`` on ``addr:port`` from a daemon thread
    (``prometheus_client.start_http_server``); ``None`` serves nothing. The stash's and
    persist's families are registered by importing this module. Returns the HTTP server
    (``shutdown()`` stops it) or ``None``.

    Raises:
        OSError: the port cannot be bound (named in the message).
    """
    if port is None:
        return None
    import stash.metrics  # noqa: F401 - registers the stash_* families

    try:
        server, _thread = start_http_server(port, addr=addr)
    except OSError as e:
        raise OSError(e.errno, f"cannot serve /metrics on {addr}:{port}: {e.strerror}") from e
    log.info("serving /metrics on %s:%d", addr, port)
    return server
