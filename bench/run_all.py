"""Run every benchmark, collect their JSON results in ``var/bench-results/``, and write
the report (``docs/benchmarks.md``, ``docs/img/bench-*.png``). ``make bench`` runs this.

Benches, in order (each in its own Python process, so memory, threads and the Spark JVM
of one cannot disturb the next):

1. ``bench.bench_stash_append --backend all --json PATH``: 1-entry stash appends against
   raw ``sqlite3`` and raw psycopg;
2. ``bench.bench_stash_typed --backend all --json PATH``: typed ``peek_one`` of 10,000
   dataclass entries and a one-key ``upsert_key`` against SQLAlchemy Core doing the same
   on the same database;
3. ``bench.bench_commit --backend all --json PATH``: persist's one-row
   ``compare_and_append`` against a raw ``sqlite3``/psycopg commit of one row, at several
   shard lengths, and 8 processes against 1 on Postgres;
3b. ``bench.bench_growth``: the CPU of a one-row append on a shard of 3,000 uncompacted
   batches against a fresh shard;
4. ``bench.bench_persist``: persist against ``pyarrow.parquet``, delta-rs, pyiceberg and
   DuckDB;
5. ``bench.bench_spark``: the Spark ``persist`` source against Spark's Parquet;
6. ``bench.bench_pipeline_parquet``: the flights pipeline on persist against the same
   pipeline on plain Parquet;
7. ``bench.bench_txn``: 2-shard transactions against separate ``compare_and_append``
   calls;
8. ``bench.bench_rows``: row-level upsert, delete and update on TPC-H ``lineitem``
   against delta-rs and pyiceberg;
9. ``bench.bench_table``: ``Table.to_duckdb`` + an aggregate against DuckDB's
   ``read_parquet``, ``Table.to_arrow`` against ``pq.read_table``, and a readonly read of
   a 1,000-batch table against a read-write one.

Invariants kept here:

* results of earlier runs are deleted before anything runs, so the report holds only
  numbers of this run;
* a bench that is missing, crashes, times out or writes no results still appears in the
  report, with what happened (exit status and the last lines it printed);
* benches run one after another, never concurrently (they measure the same 2 cores).

Run: ``python -m bench.run_all [--quick] [--only NAME ...]``; ``--quick`` is a smoke run
(about 5 minutes on 2 cores) with smaller data and fewer rounds.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import click

from bench.common import RESULTS_SCHEMA, ROOT, describe_machine, results_dir
from bench.report import load_results, summary_lines, write_report

__all__ = ["BENCHES", "BenchSpec", "main", "run_bench"]


@dataclass(frozen=True)
class BenchSpec:
    """One bench: its short name (results file stem), module, extra arguments, and time
    limits (seconds) for a full and a quick run."""

    name: str
    module: str
    args: tuple[str, ...]
    timeout_full: float
    timeout_quick: float
    title: str


BENCHES: tuple[BenchSpec, ...] = (
    BenchSpec(
        "stash",
        "bench.bench_stash_append",
        ("--backend", "all"),
        900,
        240,
        "Stash: 1-entry appends against raw sqlite3 and psycopg",
    ),
    BenchSpec(
        "typed",
        "bench.bench_stash_typed",
        ("--backend", "all"),
        600,
        180,
        "Stash: typed peek_one and upsert_key against SQLAlchemy Core",
    ),
    BenchSpec(
        "commit",
        "bench.bench_commit",
        ("--backend", "all"),
        1500,
        600,
        "Persist one-row compare_and_append against the commit it must do",
    ),
    BenchSpec(
        "growth",
        "bench.bench_growth",
        (),
        900,
        300,
        "One-row commits as the state grows (compaction off)",
    ),
    BenchSpec(
        "persist",
        "bench.bench_persist",
        (),
        1500,
        360,
        "Persist against pyarrow.parquet, delta-rs, pyiceberg and DuckDB",
    ),
    BenchSpec(
        "spark",
        "bench.bench_spark",
        (),
        900,
        300,
        "Spark: the persist data source against Spark's Parquet",
    ),
    BenchSpec(
        "pipeline",
        "bench.bench_pipeline_parquet",
        (),
        1800,
        600,
        "Pipeline: make demo's steps against the same pipeline on plain Parquet",
    ),
    BenchSpec(
        "txn",
        "bench.bench_txn",
        (),
        600,
        180,
        "Transactions across shards against separate appends",
    ),
    BenchSpec(
        "rows",
        "bench.bench_rows",
        (),
        2400,
        600,
        "Row-level changes against delta-rs and pyiceberg",
    ),
    BenchSpec(
        "table",
        "bench.bench_table",
        (),
        900,
        240,
        "persist.Table reads against pyarrow.parquet and DuckDB",
    ),
)


def _stub(spec: BenchSpec, error: str, tail: str, quick: bool) -> dict[str, object]:
    return {
        "schema": RESULTS_SCHEMA,
        "bench": spec.name,
        "title": spec.title,
        "quick": quick,
        "machine": describe_machine(),
        "params": {},
        "records": [],
        "curves": [],
        "tables": [],
        "notes": [],
        "errors": [{"section": "the whole bench", "error": error, "traceback": tail}],
        "profiles": {},
    }


def _accepts(module: str, flag: str) -> bool:
    """Whether ``python -m module --help`` mentions ``flag``."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", module, "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return flag in out.stdout or flag in out.stderr


def run_bench(spec: BenchSpec, quick: bool, out: Path) -> Path:
    """Run one bench in a subprocess writing its JSON to ``out``; on any failure write a
    stub results file carrying the error instead.  Returns ``out``."""
    module_file = ROOT / (spec.module.replace(".", "/") + ".py")
    if not module_file.exists():
        out.write_text(
            json.dumps(
                _stub(spec, f"{module_file.relative_to(ROOT)} is not present", "", quick),
                indent=1,
            )
        )
        return out
    cmd = [sys.executable, "-m", spec.module, *spec.args, "--json", str(out)]
    if quick:
        if _accepts(spec.module, "--quick"):
            cmd.append("--quick")
    timeout = spec.timeout_quick if quick else spec.timeout_full
    print(f"\n=== {spec.name}: {' '.join(cmd[1:])} (time limit {timeout:.0f} s)", file=sys.stderr)
    tail: collections.deque[str] = collections.deque(maxlen=60)
    t0 = time.monotonic()
    out.unlink(missing_ok=True)
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        proc.kill()

    watchdog = threading.Timer(timeout, kill)
    watchdog.start()
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            sys.stderr.write(line)
            tail.append(line.rstrip("\n"))
        proc.wait()
    finally:
        watchdog.cancel()
    secs = time.monotonic() - t0
    error = None
    if timed_out.is_set():
        error = f"timed out after {secs:.0f} s (limit {timeout:.0f} s)"
    elif proc.returncode != 0:
        error = f"exited with status {proc.returncode} after {secs:.0f} s"
    elif not out.exists():
        error = f"exited normally after {secs:.0f} s but wrote no results to {out}"
    if error is not None:
        text = "\n".join(tail)
        if out.exists():  # partial results: keep them, add the error
            try:
                data = json.loads(out.read_text())
                data.setdefault("errors", []).append(
                    {"section": "the whole bench", "error": error, "traceback": text}
                )
                out.write_text(json.dumps(data, indent=1, default=str))
                return out
            except ValueError:
                pass
        out.write_text(json.dumps(_stub(spec, error, text, quick), indent=1, default=str))
    return out


@click.command()
@click.option("--quick", is_flag=True, help="Smoke run: smaller data, fewer rounds (~5 min).")
@click.option(
    "--only",
    multiple=True,
    type=click.Choice([b.name for b in BENCHES]),
    help="Run only these benches (repeatable); the report then covers only them.",
)
def main(quick: bool, only: tuple[str, ...]) -> None:
    """Run the benchmarks and write docs/benchmarks.md with its plots."""
    rdir = results_dir()
    for old in rdir.glob("*.json"):
        old.unlink()
    t0 = time.monotonic()
    paths: list[Path] = []
    for spec in BENCHES:
        if only and spec.name not in only:
            continue
        paths.append(run_bench(spec, quick, rdir / f"{spec.name}.json"))
    report = write_report(paths)
    click.echo(f"\nbenchmarks done in {time.monotonic() - t0:.0f} s; report: {report}")
    for line in summary_lines(load_results(paths)):
        click.echo(line)


if __name__ == "__main__":
    main()
