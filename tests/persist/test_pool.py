"""Tests of persist.pool: ``run_all`` keeps each call's concurrency bound, results in
order, the first error by task index, nothing running after a call returns, nesting and
sharing without deadlock, and a parallel pool in a forked child; an ``in_background``
task runs once, in the pool or in the caller when no pool thread took it."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable

import pytest

from persist.pool import POOL_THREADS, in_background, run_all, submit_io


def _tracking(n: int, sleep: float = 0.002) -> tuple[list[Callable[[], int]], Callable[[], int]]:
    """``n`` tasks returning their index that record the highest number running at once."""
    lock = threading.Lock()
    state = {"running": 0, "peak": 0}

    def make(i: int) -> Callable[[], int]:
        def task() -> int:
            with lock:
                state["running"] += 1
                state["peak"] = max(state["peak"], state["running"])
            time.sleep(sleep)
            with lock:
                state["running"] -= 1
            return i

        return task

    return [make(i) for i in range(n)], lambda: state["peak"]


@pytest.mark.parametrize("workers", [1, 2, 3, POOL_THREADS + 2])
def test_results_in_order_and_concurrency_bounded(workers: int) -> None:
    tasks, peak = _tracking(24)
    results, error = run_all(tasks, workers)
    assert error is None
    assert results == list(range(24))
    assert 1 <= peak() <= workers
    if workers > 1:
        assert peak() > 1  # the pool was used


def test_first_error_by_index_and_later_tasks_skipped() -> None:
    started: list[int] = []
    lock = threading.Lock()

    def make(i: int) -> Callable[[], int]:
        def task() -> int:
            with lock:
                started.append(i)
            if i in (3, 5):
                time.sleep(0.01 if i == 3 else 0)
                raise ValueError(f"task {i}")
            time.sleep(0.001)
            return i

        return task

    results, error = run_all([make(i) for i in range(200)], 2)
    assert isinstance(error, ValueError) and str(error) in ("task 3", "task 5")
    assert results[:3] == [0, 1, 2]
    assert len(started) < 200  # tasks after the failure were skipped
    assert all(r is None for r in results[max(started) + 1 :])


def test_nothing_runs_after_return() -> None:
    """Every started task has finished when run_all returns, even after an error (the
    writer deletes the keys of a failed upload right after)."""
    done: list[int] = []

    def make(i: int) -> Callable[[], None]:
        def task() -> None:
            if i == 0:
                raise RuntimeError("first fails at once")
            time.sleep(0.05)
            done.append(i)

        return task

    for _ in range(5):
        done.clear()
        _, error = run_all([make(i) for i in range(6)], 3)
        assert isinstance(error, RuntimeError)
        after = list(done)
        time.sleep(0.1)
        assert done == after


def test_nested_calls_do_not_deadlock() -> None:
    """Tasks that call run_all themselves, more of them than the pool has threads."""

    def outer(i: int) -> Callable[[], int]:
        def task() -> int:
            inner, _ = _tracking(4, sleep=0.001)
            results, error = run_all(inner, 4)
            assert error is None
            return sum(r for r in results if r is not None) + i

        return task

    box: dict[str, object] = {}

    def go() -> None:
        box["out"] = run_all([outer(i) for i in range(3 * POOL_THREADS)], POOL_THREADS)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "nested run_all calls deadlocked"
    results, error = box["out"]  # type: ignore[misc]
    assert error is None
    assert results == [6 + i for i in range(3 * POOL_THREADS)]


def test_concurrent_callers_share_the_pool() -> None:
    """More callers than pool threads, each with its own bound: all finish."""
    outs: list[list[int | None]] = []
    lock = threading.Lock()

    def caller() -> None:
        tasks, peak = _tracking(10, sleep=0.003)
        results, error = run_all(tasks, 3)
        assert error is None and peak() <= 3
        with lock:
            outs.append(results)

    threads = [threading.Thread(target=caller) for _ in range(2 * POOL_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(outs) == 2 * POOL_THREADS
    assert all(r == list(range(10)) for r in outs)


def _child(q: multiprocessing.Queue[object]) -> None:
    tasks, peak = _tracking(16, sleep=0.005)
    results, error = run_all(tasks, 2)
    uploaded = submit_io(lambda: "uploaded").result(timeout=10)
    q.put((results, error, peak(), uploaded))


def test_pool_works_in_a_forked_child() -> None:
    """The parent's pool threads do not exist in a forked child (Spark's Python workers
    are forked): the child makes a pool of its own and still runs tasks side by side."""
    run_all([lambda: 1, lambda: 2], 2)  # the parent's pools exist
    submit_io(lambda: None).result()
    ctx = multiprocessing.get_context("fork")
    q: multiprocessing.Queue[object] = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    p.join(timeout=60)
    if p.is_alive():
        p.kill()
        pytest.fail("run_all hung in a forked child")
    assert p.exitcode == 0
    results, error, peak, uploaded = q.get(timeout=5)  # type: ignore[misc]
    assert error is None and results == list(range(16))
    assert peak == 2 and uploaded == "uploaded"


def test_background_task_runs_in_the_pool_and_gives_its_result() -> None:
    started = threading.Event()
    release = threading.Event()

    def task() -> str:
        started.set()
        release.wait(10)
        return threading.current_thread().name

    job = in_background(task)
    assert started.wait(10), "the background task never started"
    release.set()
    assert job.result() != threading.current_thread().name  # a pool thread ran it


def test_background_task_error_is_raised_by_result() -> None:
    def task() -> int:
        raise ValueError("boom")

    job = in_background(task)
    with pytest.raises(ValueError, match="boom"):
        job.result()


def test_background_task_queued_behind_a_busy_pool_runs_in_the_caller() -> None:
    """Every pool thread blocked: the caller takes the task back and runs it itself
    (waiting for the pool would deadlock if the pool waited for the caller)."""
    release = threading.Event()
    blockers = [in_background(lambda: release.wait(30)) for _ in range(POOL_THREADS)]
    try:
        ran_in: list[str] = []
        job = in_background(lambda: ran_in.append(threading.current_thread().name) or 7)
        assert job.result() == 7
        assert ran_in == [threading.current_thread().name]
    finally:
        release.set()
        for b in blockers:
            b.result()


def test_background_wait_cancels_a_queued_task_and_joins_a_running_one() -> None:
    release = threading.Event()
    blockers = [in_background(lambda: release.wait(30)) for _ in range(POOL_THREADS)]
    ran: list[int] = []
    queued = in_background(lambda: ran.append(1))
    queued.wait()  # never started: cancelled, never runs
    release.set()
    for b in blockers:
        b.wait()
    time.sleep(0.05)
    assert ran == []
    done = threading.Event()

    def slow() -> None:
        time.sleep(0.05)
        done.set()
        raise ValueError("ignored by wait")

    running = in_background(slow)
    time.sleep(0.01)
    running.wait()
    assert done.is_set()
