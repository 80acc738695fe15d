"""The process-wide pools of worker threads that encode, decode, upload and fetch parts.

Creating a thread pool for every read or write cost about 1 ms of a 24 ms flights
snapshot (threads started and joined each time), so :func:`run_all` hands its tasks to
one pool that lives as long as the process. pyarrow's Parquet codecs, ``hashlib`` and
file I/O release the GIL, so these threads run in parallel. A second pool takes blob
uploads (:func:`submit_io`), so that a writer encodes the next part while the last one
is written and fsynced (or sent over the network) instead of waiting for it.

Invariants kept here:

* one :func:`run_all` call never runs more than ``max_workers`` of its tasks at once,
  whatever the pool's size, and the calling thread is one of those workers (a call
  makes progress even while the pool is busy with other calls);
* :func:`run_all` returns only after every task it started has finished: no task of a
  call runs on after it returned (callers clean up after a failure safely);
* results come back in task order; after a task fails, tasks not yet started are
  skipped, and the error of the failed task with the lowest index is returned;
* a call never waits for a pool thread to *start*: the calling thread claims tasks too,
  and helpers still queued when no task is left are cancelled. So calls nested in tasks,
  a pool busy with other calls, or a pool whose threads are gone cannot deadlock it;
* a child made by ``os.fork`` (Spark's Python workers are forked) starts pools of its
  own (the parent's threads do not exist in the child), so it works in parallel too;
* tasks of the upload pool never wait for either pool, so they always finish;
* a :class:`Background` task (:func:`in_background`) runs at most once: in a thread of
  the shared pool, or, if none has started it when its result is wanted, in the thread
  that wants it (so waiting for it never deadlocks either).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

__all__ = ["IO_THREADS", "POOL_THREADS", "Background", "in_background", "run_all", "submit_io"]

_T = TypeVar("_T")

#: Threads of the shared pool (several concurrent calls, e.g. a writer and the
#: background compactor, each get up to their ``max_workers``).
POOL_THREADS = 8
#: Threads of the upload pool.
IO_THREADS = 4

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_io_pool: ThreadPoolExecutor | None = None


def _reset_after_fork() -> None:
    global _lock, _pool, _io_pool
    _lock = threading.Lock()
    _pool = _io_pool = None


os.register_at_fork(after_in_child=_reset_after_fork)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=POOL_THREADS, thread_name_prefix="persist")
        return _pool


def submit_io(fn: Callable[..., _T], *args: Any) -> Future[_T]:
    """Run ``fn(*args)`` in the upload pool (``IO_THREADS`` threads shared by the
    process); ``fn`` must not wait for either pool. Returns its future."""
    global _io_pool
    with _lock:
        if _io_pool is None:
            _io_pool = ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="persist-io")
        pool = _io_pool
    return pool.submit(fn, *args)


class Background(Generic[_T]):
    """A task handed to the shared pool (:func:`in_background`), to overlap with the
    caller's own work: e.g. the fingerprint of an append (``xxhash`` releases the GIL)
    while its parts are sorted and encoded."""

    def __init__(self, fn: Callable[[], _T]) -> None:
        self._fn = fn
        self._future: Future[_T] = _executor().submit(fn)

    def result(self) -> _T:
        """The task's result (or its exception, raised), waiting for it if a pool thread
        runs it; a task no pool thread has started yet is taken back and run here."""
        if self._future.cancel():
            return self._fn()
        return self._future.result()

    def wait(self) -> None:
        """:meth:`result`, its outcome ignored: the task has ended when this returns (a
        caller cleaning up after its own failure need not wait for a task still queued:
        it is cancelled)."""
        if self._future.cancel():
            return
        try:
            self._future.result()
        except Exception:  # the caller's own error is the one it raises
            pass


def in_background(fn: Callable[[], _T]) -> Background[_T]:
    """Start ``fn()`` in the shared pool; its :meth:`Background.result` gives its
    result."""
    return Background(fn)


def run_all(
    tasks: Sequence[Callable[[], _T]], max_workers: int
) -> tuple[list[_T | None], BaseException | None]:
    """Run ``tasks`` with at most ``max_workers`` at a time (the calling thread plus
    ``max_workers - 1`` threads of the shared pool).

    Returns:
        ``(results, error)``: each task's result in task order (``None`` for tasks that
        failed or were skipped) and the first error (lowest task index), or ``None``.
        Only ``Exception``s are caught; others propagate after every started task ends.
    """
    n = len(tasks)
    results: list[_T | None] = [None] * n
    if max_workers <= 1 or n <= 1:
        for i, task in enumerate(tasks):
            try:
                results[i] = task()
            except Exception as e:
                return results, e
        return results, None
    errors: list[tuple[int, BaseException]] = []
    claim = threading.Lock()
    next_index = [0]
    failed = threading.Event()

    def runner() -> None:
        while not failed.is_set():
            with claim:
                i = next_index[0]
                next_index[0] += 1
            if i >= n:
                return
            try:
                results[i] = tasks[i]()
            except Exception as e:
                errors.append((i, e))
                failed.set()
                return

    ex = _executor()
    helpers: list[Future[None]] = [ex.submit(runner) for _ in range(min(max_workers, n) - 1)]
    try:
        runner()
    except BaseException:
        failed.set()
        raise
    finally:
        for f in helpers:
            # A helper still queued behind other calls' tasks has nothing left to claim.
            if not f.cancel():
                f.result()
    if errors:
        return results, min(errors, key=lambda e: e[0])[1]
    return results, None
