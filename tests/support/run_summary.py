"""Pytest plugin: the run's closing note states its wall time, CPU time and the machine's load.

Loaded from ``tests/conftest.py`` (``pytest_plugins``). Just before pytest's own last line
(``N passed in S s``) it prints one line such as::

    run: wall 412 s, CPU 690 s in 3 pytest processes (2 xdist workers), 2 cores,
    load average (1, 5, 15 min) at start 0.21 0.80 1.10, at end 2.05 1.96 1.52

so that a duration read from a log can be judged against how busy the machine was.

- Wall time is measured from ``pytest_configure`` of the controlling process.
- CPU time is user + system time of the pytest processes and of the children they waited
  for (``resource.getrusage`` ``RUSAGE_SELF`` + ``RUSAGE_CHILDREN``). Under pytest-xdist each
  worker reports its own figure to the controller through ``workeroutput`` when it ends
  (pytest-xdist's documented channel for worker -> controller data). Processes nobody waits
  for are not counted: the PostgreSQL servers (started by ``pg_ctl``, which detaches) and
  the JVMs behind Spark sessions.
- Load average is ``os.getloadavg()`` (Linux ``/proc/loadavg``): the number of runnable
  processes averaged over 1, 5 and 15 minutes, on the whole machine, not only this run.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any

import pytest

__all__ = ["cpu_seconds"]

_START = pytest.StashKey[tuple[float, tuple[float, float, float]]]()
_WORKER_CPU = pytest.StashKey[list[float]]()
_OUTPUT_KEY = "run_summary_cpu_seconds"


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of the children it has waited for."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workeroutput")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_START] = (time.monotonic(), os.getloadavg())
    config.stash[_WORKER_CPU] = []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if _is_worker(config):
        workeroutput: dict[str, Any] = config.workeroutput  # type: ignore[attr-defined]
        workeroutput[_OUTPUT_KEY] = cpu_seconds()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """pytest-xdist hook on the controller: a worker ended; keep its CPU figure."""
    output = getattr(node, "workeroutput", None) or {}
    if _OUTPUT_KEY in output:
        node.config.stash[_WORKER_CPU].append(float(output[_OUTPUT_KEY]))


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if _is_worker(config) or _START not in config.stash:
        return
    started, load_start = config.stash[_START]
    workers = config.stash[_WORKER_CPU]
    wall = time.monotonic() - started
    cpu = cpu_seconds() + sum(workers)
    processes = f"{1 + len(workers)} pytest processes ({len(workers)} xdist workers)"
    if not workers:
        processes = "1 pytest process"
    load_end = os.getloadavg()

    def fmt(load: tuple[float, float, float]) -> str:
        return " ".join(f"{x:.2f}" for x in load)

    terminalreporter.write_line(
        f"run: wall {wall:.0f} s, CPU {cpu:.0f} s in {processes}, {os.cpu_count()} cores, "
        f"load average (1, 5, 15 min) at start {fmt(load_start)}, at end {fmt(load_end)}"
    )
