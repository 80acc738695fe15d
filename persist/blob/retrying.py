"""A blob store wrapper that retries transient failures: :class:`RetryingBlob`.

Invariants kept here:

* only :class:`~persist.errors.BlobError` is retried, never its subclass
  :class:`~persist.errors.InvalidKey` (a bad key stays bad) nor anything else;
* a retry is always safe because every blob call persist makes is idempotent (a ``set``
  writes immutable bytes under a fresh key; ``delete`` of a missing key is fine);
* the first attempt runs without building a retry loop (the common, successful case
  costs one call); the last error is re-raised unchanged.

The backoff is tenacity's ``wait_exponential_jitter`` (5 ms doubling, at most 250 ms).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from persist import metrics as persist_metrics
from persist.blob.base import Blob, BlobMetrics
from persist.errors import BlobError, InvalidKey

__all__ = ["RetryingBlob"]

_T = TypeVar("_T")


class RetryingBlob:
    """A :class:`~persist.blob.Blob` wrapper retrying transient :class:`BlobError` s
    (not :class:`InvalidKey`) with exponential backoff, ``attempts`` tries per call.

    Every blob call persist makes is idempotent (a ``set`` writes immutable bytes under a
    fresh key; ``delete`` of a missing key is fine), so a retry is always safe.
    """

    def __init__(self, inner: Blob, attempts: int = 3) -> None:
        self.inner = inner
        self.attempts = max(1, attempts)

    def __repr__(self) -> str:
        return f"RetryingBlob({self.inner!r}, attempts={self.attempts})"

    @property
    def metrics(self) -> BlobMetrics:
        """The inner store's counters."""
        return self.inner.metrics

    @staticmethod
    def _retryable(e: BaseException) -> bool:
        return isinstance(e, BlobError) and not isinstance(e, InvalidKey)

    def _retry(self, fn: Callable[[], _T]) -> _T:
        try:
            return fn()  # the common case, without building a retry loop
        except BlobError as e:
            if self.attempts == 1 or not self._retryable(e):
                raise
        r = Retrying(
            stop=stop_after_attempt(self.attempts - 1),
            wait=wait_exponential_jitter(multiplier=0.005, max=0.25, jitter=0.005),
            retry=retry_if_exception(self._retryable),
            reraise=True,
        )
        return r(fn)

    def get(self, key: str) -> bytes | None:
        return persist_metrics.fetched(self._retry(lambda: self.inner.get(key)))

    def set(self, key: str, value: bytes) -> None:
        self._retry(lambda: self.inner.set(key, value))
        persist_metrics.written(value)

    def delete(self, key: str) -> None:
        self._retry(lambda: self.inner.delete(key))

    def list_keys(self, prefix: str = "") -> list[tuple[str, int]]:
        return self._retry(lambda: self.inner.list_keys(prefix))

    def close(self) -> None:
        self.inner.close()
