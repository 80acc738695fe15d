"""Pytest plugin: under pytest-xdist, the longest test files start first, one set per worker.

Loaded from ``tests/conftest.py`` (``pytest_plugins``). pytest-xdist's ``worksteal``
scheduler (``xdist/scheduler/worksteal.py``) hands the collection out in contiguous slices,
the first ``n // W`` items to the first worker and so on, and an idle worker later steals
the *tail* of another worker's queue. A test that takes minutes and sits late in a slice
therefore runs last while the other core idles. This plugin reorders the collection, in
every worker the same way (xdist requires identical collections), so that:

* test files known to be long (``durations.json`` beside this module: seconds per test
  node id, setup + call + teardown, from a ``--durations`` report) are dealt to the
  slices by longest-processing-time-first (Graham's LPT list scheduling), each slice
  starting with its long files, longest first;
* the other files follow in collection order, filling each slice to the size xdist
  gives it; work stealing then evens out the short tail;
* the files with a test that needs the worker's SparkSession (the ``spark`` fixture, or a
  Markdown example that calls ``build_session``) all start the first slice, longest
  first (those with the fixture before the Markdown files, so that the session is the
  fixture's), ahead of its other long files: one JVM for the run instead of one per worker
  (its start and JIT warm-up cost tens of CPU-seconds), and the LPT dealing of the other
  long files to the other slices makes up their weight. Work stealing takes the tail of
  a slice, its short files, so the Spark tests stay on the first worker unless it is
  far behind.

Files are moved whole, so module-scoped fixtures are still set up once per file (a file
may straddle two slices only among the short ones). Without xdist (``-n 0``) the order is
left as collected.

Refresh the durations after a test suite's times change::

    python -m pytest ... --durations=150 > run.log
    python -m tests.support.schedule run.log > tests/support/durations.json
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
#: A file whose known tests sum to at least this many seconds starts its slice.
LONG_FILE_SECONDS = 8.0
#: Seconds assumed for a test absent from ``durations.json``.
DEFAULT_TEST_SECONDS = 0.3

_REPORT_LINE = re.compile(r"^\s*([0-9.]+)s\s+(setup|call|teardown)\s+(\S.*?)\s*$")


def durations_from_report(text: str, min_seconds: float = 1.0) -> dict[str, float]:
    """Seconds per test node id (setup + call + teardown) from pytest's ``--durations``
    report text; ids below ``min_seconds`` are left out."""
    total: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        m = _REPORT_LINE.match(line)
        if m:
            total[m.group(3)] += float(m.group(1))
    return {k: round(v, 1) for k, v in sorted(total.items()) if v >= min_seconds}


def _load_durations() -> dict[str, float]:
    try:
        data = json.loads(DURATIONS.read_text())
    except FileNotFoundError:
        return {}
    return {str(k): float(v) for k, v in data.items()}


def slice_sizes(n: int, workers: int) -> list[int]:
    """The slice sizes worksteal's first distribution gives ``workers`` idle workers."""
    sizes = []
    left = n
    for i in range(workers):
        size = left // (workers - i)
        sizes.append(size)
        left -= size
    return sizes


def needs_spark_session(item: pytest.Item) -> bool:
    """True when ``item`` uses the worker's SparkSession: the ``spark`` fixture
    (tests/support/spark_fixtures.py), or a Markdown example (pytest-markdown-docs) whose
    code calls ``build_session`` (which reuses that session)."""
    if "spark" in getattr(item, "fixturenames", ()):
        return True
    code = getattr(item, "code", None)
    return isinstance(code, str) and "build_session" in code


def arrange(
    items: list[pytest.Item],
    workers: int,
    seconds: dict[str, float],
    spark: Callable[[pytest.Item], bool] = needs_spark_session,
) -> list[pytest.Item]:
    """Return ``items`` reordered into ``workers`` contiguous slices: the files with a
    test for which ``spark`` is true first in the first slice, then the long files."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def weight(group: list[pytest.Item]) -> float:
        return sum(seconds.get(i.nodeid, DEFAULT_TEST_SECONDS) for i in group)

    sizes = slice_sizes(len(items), workers)
    slices: list[list[pytest.Item]] = [[] for _ in range(workers)]
    load = [0.0] * workers
    moved: set[str] = set()
    # Files whose tests take the ``spark`` fixture first, so that the session is the
    # fixture's (its JVM options) rather than one a Markdown example's build_session starts.
    spark_files = sorted(
        (f for f, g in files.items() if any(spark(i) for i in g)),
        key=lambda f: (
            not any("spark" in getattr(i, "fixturenames", ()) for i in files[f]),
            -weight(files[f]),
        ),
    )
    if sum(len(files[f]) for f in spark_files) <= sizes[0]:
        for f in spark_files:
            slices[0].extend(files[f])
            load[0] += weight(files[f])
            moved.add(f)
    long_files = sorted(
        (f for f, g in files.items() if f not in moved and weight(g) >= LONG_FILE_SECONDS),
        key=lambda f: -weight(files[f]),
    )
    for f in long_files:
        fits = [w for w in range(workers) if len(slices[w]) + len(files[f]) <= sizes[w]]
        if not fits:
            continue  # too many tests to move whole; it stays with the short files
        w = min(fits, key=lambda w: load[w])
        slices[w].extend(files[f])
        load[w] += weight(files[f])
        moved.add(f)
    rest = [i for f, g in files.items() if f not in moved for i in g]
    out: list[pytest.Item] = []
    for w in range(workers):
        take = sizes[w] - len(slices[w])
        out.extend(slices[w] + rest[:take])
        rest = rest[take:]
    out.extend(rest)
    return out


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 2 or not items:
        return
    items[:] = arrange(items, workers, _load_durations())


if __name__ == "__main__":
    text = Path(sys.argv[1]).read_text()
    print(json.dumps(durations_from_report(text), indent=0, sort_keys=True))
