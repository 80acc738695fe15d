"""The xdist ordering plugin (tests/support/schedule.py): long files start the slices,
files stay whole, and the collection is a permutation of the one given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.support.schedule import (
    arrange,
    durations_from_report,
    needs_spark_session,
    slice_sizes,
)


@dataclass(frozen=True)
class _Item:
    nodeid: str


def _items(spec: dict[str, int]) -> list[Any]:
    return [_Item(f"{f}::t{i}") for f, n in spec.items() for i in range(n)]


def test_slice_sizes_are_worksteals_first_distribution() -> None:
    assert slice_sizes(7, 2) == [3, 4]
    assert slice_sizes(10, 3) == [3, 3, 4]
    assert sum(slice_sizes(1990, 2)) == 1990


def test_long_files_start_each_slice_and_files_stay_whole() -> None:
    items = _items({"a.py": 6, "long1.py": 1, "b.py": 6, "long2.py": 2, "long3.py": 1})
    seconds = {"long1.py::t0": 160.0, "long2.py::t0": 40.0, "long2.py::t1": 30.0}
    seconds["long3.py::t0"] = 50.0
    out = arrange(items, 2, seconds)
    assert sorted(i.nodeid for i in out) == sorted(i.nodeid for i in items)
    first, second = out[:8], out[8:]
    assert first[0].nodeid == "long1.py::t0"  # longest first, on its own slice
    assert [i.nodeid for i in second[:3]] == ["long2.py::t0", "long2.py::t1", "long3.py::t0"]
    # the short files keep their order and are not interleaved with long ones
    shorts = [i.nodeid for i in out if i.nodeid.startswith(("a.py", "b.py"))]
    assert shorts == [i.nodeid for i in items if i.nodeid.startswith(("a.py", "b.py"))]


def test_durations_from_report_sums_phases() -> None:
    text = """
============================= slowest 3 durations ==============================
21.02s setup    tests/spark/test_compact_job.py::test_merges
18.00s call     tests/spark/test_compact_job.py::test_merges
80.10s call     README.md::[CodeFence#3][line:94]
0.20s teardown  tests/x.py::t
"""
    parsed = durations_from_report(text)  # report text in, per-test totals out
    assert parsed == {
        "README.md::[CodeFence#3][line:94]": 80.1,
        "tests/spark/test_compact_job.py::test_merges": 39.0,
    }


@dataclass(frozen=True)
class _SparkItem:
    nodeid: str
    fixturenames: tuple[str, ...] = ()
    code: str | None = None


def test_every_file_needing_the_spark_session_starts_the_first_slice() -> None:
    """One JVM for the run: the files with a test using the ``spark`` fixture or a
    Markdown example calling ``build_session`` all start the first slice (longest
    first, short ones too), and the other long files go where the load is least."""
    items: list[Any] = [
        _SparkItem("a.py::t0"),
        _SparkItem("s1.py::t0", ("tmp_path", "spark")),
        _SparkItem("s1.py::t1"),  # same file: moved with it
        _SparkItem("a.py::t1"),
        _SparkItem("long.py::t0"),
        _SparkItem("s2.py::t0", ("spark",)),
        _SparkItem("doc.md::[CodeFence#1]", code="s = build_session('local[2]')"),
        _SparkItem("doc.md::[CodeFence#2]", code="print(1)"),
        _SparkItem("b.py::t0", ("tmp_path",)),
        _SparkItem("b.py::t1"),
        _SparkItem("b.py::t2"),
        _SparkItem("b.py::t3"),
    ]
    seconds = {"s1.py::t0": 30.0, "s2.py::t0": 50.0, "long.py::t0": 40.0}
    seconds["doc.md::[CodeFence#1]"] = 90.0  # after the fixture's files all the same
    out = [i.nodeid for i in arrange(items, 2, seconds)]
    assert sorted(out) == sorted(i.nodeid for i in items)
    first, second = out[:6], out[6:]
    assert first[:5] == [
        "s2.py::t0",
        "s1.py::t0",
        "s1.py::t1",
        "doc.md::[CodeFence#1]",
        "doc.md::[CodeFence#2]",
    ]
    assert second[0] == "long.py::t0"
    assert not needs_spark_session(items[0]) and needs_spark_session(items[6])
