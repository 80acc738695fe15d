"""``persist.Table`` reads against the engines a user would read the same data with, on
the same data, in one run.

Sections (``--only`` picks some), each run ``rounds`` times after one warm-up round,
contestants in an order rotated every round (:func:`bench.common.interleave`):

* ``duckdb``: ``Table.to_duckdb()`` plus an aggregate (``count(*)``, ``sum`` of an int
  and a float column, ``count(DISTINCT)`` of a string column) on a compacted table
  (one append, then ``Table.optimize()``), against DuckDB's ``read_parquet`` of one
  Parquet file holding the same rows (``pyarrow.parquet.write_table`` defaults), the
  same aggregate; each on a connection opened before the timing starts (opening one
  costs tens of milliseconds, as much as the query).  Goal: at most 1.2 times as
  long.
* ``arrow``: ``Table.to_arrow()`` of that table against ``pq.read_table`` of that file.
  Goal: at most 1.2 times as long.
* ``readonly``: a read of a table of 1,000 uncompacted batches (1,000 appends, compaction
  off) through a client over ``Stash.open(url, mode="readonly")`` against the same read
  through a writable client; each contestant times the user's flow: open the stash and
  the client, ``client.table(name).to_arrow()``, close.  Goal: at most 1.2 times as long.

Invariants kept here: both contestants of a section read the same rows (checked once per
section: the same count and aggregate); only the reads are timed; the ratio is taken
round by round, reported as the median with its spread (min-max), with the machine's
load average.

Run: ``python -m bench.bench_table [--quick] [--json PATH] [--only SECTION ...]``.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import click
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench.common import BenchResults, Goal, Table, interleave, median, ratio_record, work_dir

__all__ = ["SECTIONS", "main", "run"]

SECTIONS = ("duckdb", "arrow", "readonly")
GOAL = Goal("<=", 1.2)
AGG = 'count(*) AS n, sum("qty") AS q, sum("price") AS p, count(DISTINCT "tag") AS t'


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def rows(n: int, start: int = 0, seed: int = 7) -> pa.Table:
    """``n`` rows keyed by ``id`` from ``start``: an int, a float and a string column."""
    rng = np.random.default_rng(seed + start)
    return pa.table(
        {
            "id": pa.array(np.arange(start, start + n, dtype=np.int64)),
            "qty": pa.array(rng.integers(0, 100, n, dtype=np.int32)),
            "price": pa.array(rng.random(n) * 1000),
            "tag": pa.array([f"tag{i % 997}" for i in range(start, start + n)]),
        }
    )


def _record(res: BenchResults, section: str, what: str, samples: dict[str, list[float]]) -> None:
    (subject, reference) = list(samples)
    rec = res.add(
        ratio_record(
            section,
            what,
            subject=subject,
            subject_samples=samples[subject],
            reference=reference,
            reference_samples=samples[reference],
            measure="slowdown",
            goal=GOAL,
            note=f"load average {_load()}",
        )
    )
    sp = rec.spread or (0.0, 0.0)
    res.tables[0].rows.append(
        [
            what,
            f"{median(samples[subject]):.4f} s",
            f"{median(samples[reference]):.4f} s",
            f"{rec.value:.3f}x",
            str(GOAL),
            f"{sp[0]:.3f}-{sp[1]:.3f}",
            rec.verdict,
            _load(),
        ]
    )


def run(quick: bool, only: tuple[str, ...] = (), json_path: str | None = None) -> Path:
    """Build the tables, run the selected sections, save the results JSON; return its
    path."""
    import duckdb

    from persist import FileBlob, PersistClient
    from stash import Stash

    n = 300_000 if quick else 3_000_000
    batches = 1_000
    rounds = 5 if quick else 9
    res = BenchResults(
        "table",
        "persist.Table reads against pyarrow.parquet and DuckDB",
        quick=quick,
        params={"rows": n, "batches": batches, "rounds": rounds},
    )
    res.tables.append(
        Table(
            "table",
            f"Table reads (median seconds of {rounds} rounds)",
            ["read", "persist", "reference", "ratio", "goal", "spread", "verdict", "load"],
        )
    )
    root = work_dir("table")
    try:
        url = f"sqlite:///{root}/stash.db"
        data = rows(n)
        plain = str(root / "plain.parquet")
        pq.write_table(data, plain)
        with Stash.open(url) as s:
            c = PersistClient(s, FileBlob(str(root / "blob")), compaction="off")
            try:
                t = c.create_table("big", data.schema, key=["id"])
                t.append(data)
                t.optimize()
                if not only or {"duckdb", "arrow"} & set(only):
                    want = duckdb.connect().read_parquet(plain).aggregate(AGG).fetchall()
                    got = t.to_duckdb().aggregate(AGG).fetchall()
                    assert got == want, (got, want)
                    res.log(f"to_duckdb plan: {t.to_duckdb().explain()}")
                if not only or "duckdb" in only:
                    with res.section("duckdb"):

                        def ours(_r: int) -> float:
                            con = duckdb.connect()
                            return _timed(lambda: t.to_duckdb(con).aggregate(AGG).fetchall())

                        def theirs(_r: int) -> float:
                            con = duckdb.connect()
                            return _timed(lambda: con.read_parquet(plain).aggregate(AGG).fetchall())

                        samples = interleave(
                            {"to_duckdb": ours, "read_parquet": theirs}, rounds, log=res.log
                        )
                        _record(res, "duckdb", f"to_duckdb + aggregate, {n:,} rows", samples)
                if not only or "arrow" in only:
                    with res.section("arrow"):
                        samples = interleave(
                            {
                                "to_arrow": lambda _r: _timed(t.to_arrow),
                                "pq.read_table": lambda _r: _timed(lambda: pq.read_table(plain)),
                            },
                            rounds,
                            log=res.log,
                        )
                        _record(res, "arrow", f"to_arrow, {n:,} rows", samples)
                if not only or "readonly" in only:
                    with res.section("readonly"):
                        small = c.create_table("many", data.schema, key=["id"])
                        per = 100
                        t0 = time.perf_counter()
                        for i in range(batches):
                            small.append(rows(per, i * per))
                        res.log(f"{batches} appends in {time.perf_counter() - t0:.1f} s")

                        def read(mode: str) -> Callable[[int], float]:
                            def go() -> None:
                                with Stash.open(url, mode=mode) as s2:
                                    c2 = PersistClient(s2, FileBlob(str(root / "blob")))
                                    try:
                                        got = c2.table("many").to_arrow()
                                    finally:
                                        c2.close()
                                assert got.num_rows == batches * per

                            return lambda _r: _timed(go)

                        samples = interleave(
                            {"readonly": read("readonly"), "read-write": read("writable")},
                            rounds,
                            log=res.log,
                        )
                        _record(res, "readonly", f"{batches}-batch table read", samples)
            finally:
                c.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return res.save(json_path)


@click.command()
@click.option("--quick", is_flag=True, help="300,000 rows and 5 rounds.")
@click.option("--only", multiple=True, type=click.Choice(SECTIONS), help="Sections to run.")
@click.option(
    "--json", "json_path", default=None, help="Results file (default var/bench-results/table.json)."
)
def main(quick: bool, only: tuple[str, ...], json_path: str | None) -> None:
    """persist.Table reads against pyarrow.parquet and DuckDB."""
    path = run(quick, only, json_path)
    click.echo(f"table bench results: {path}")


if __name__ == "__main__":
    main()
