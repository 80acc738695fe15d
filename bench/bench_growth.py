"""The cost of a one-row commit as the shard's state grows (compaction off).

With compaction off every one-row ``compare_and_append`` adds a hollow batch that stays
in the state, so the state grows linearly.  A commit writes one diff row whatever the
state's size; its CPU must not follow the state's size either (Materialize's persist
clones a state whose batches are shared and encodes only the diff,
``internal/apply.rs``, ``internal/state_diff.rs``).

One figure per variant, measured side by side in interleaved rounds (order rotated every
round, after a warm-up round): the CPU (``time.process_time``, every thread of the
process) per one-row append on a shard holding :data:`BIG` uncompacted batches, against
the same on a fresh shard (a new one every round, so that it holds one batch to a few
dozen).  Goal: <= 1.5x.  Variants:

* **inline parts**: ``inline_total_max_bytes`` raised so that both shards keep writing
  their one-row parts inline in the state (the same write path on both sides: the
  ratio is the state's growth alone);
* **default settings**: past 1 MiB of inline parts (about 1,000 one-row batches) a shard
  writes its parts to the blob store, so the big shard pays a blob write per append that
  the fresh one does not (reported, no goal).

Run: ``python -m bench.bench_growth [--quick] [--big N] [--json PATH]`` (default results
``var/bench-results/growth.json``).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import pyarrow as pa

from bench.bench_commit import PREPARED_ROWS, PersistOneRow, _Prepared, _rows
from bench.common import ROOT, BenchResults, Goal, fmt_num, interleave, ratio_record

__all__ = ["main", "run"]

GOAL_GROWTH = Goal("<=", 1.5)
#: Uncompacted batches of the big shard.
BIG = 3_000


class _Shard:
    """A shard appended one row at a time with compaction off."""

    def __init__(self, root: Path, tag: str, inline_total: int | None) -> None:
        from persist import PersistClient
        from stash import Stash

        self.dir = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir=root))
        p = PersistOneRow.__new__(PersistOneRow)
        p.stash = Stash.open(f"sqlite:///{self.dir}/stash.db", mode="writable", fenced=False)
        opts: dict[str, Any] = (
            {} if inline_total is None else {"inline_total_max_bytes": inline_total}
        )
        p.client = PersistClient(p.stash, f"file://{self.dir}/blob", compaction="off", **opts)
        rows = _rows()
        p.write, p.read = p.client.open(tag, rows.schema, pa.schema([]))
        p.rows = rows
        p.upper = p.write.upper.as_option() or 0
        p.count = 0
        p.prepared = _Prepared(rows, p.upper, PREPARED_ROWS, p.write.schema)
        self.p = p

    def fill(self, n: int) -> None:
        while self.p.count < n:
            self.p.append(0)

    def batches(self) -> int:
        return self.p.write._machine.state().trace.num_hollow_batches()

    def close(self) -> None:
        self.p.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _cpu_per_append(shard: Callable[[int], _Shard], appends: int) -> Callable[[int], float]:
    def fn(r: int) -> float:
        s = shard(r)
        s.p.prepare()
        t0 = time.process_time()
        for i in range(appends):
            s.p.append(i)
        return (time.process_time() - t0) / appends

    return fn


def _variant(
    res: BenchResults,
    root: Path,
    name: str,
    inline_total: int | None,
    big_n: int,
    appends: int,
    rounds: int,
    goal: Goal | None,
) -> None:
    section = "one-row commits as the state grows"
    big = _Shard(root, "big", inline_total)
    t0 = time.perf_counter()
    big.fill(big_n)
    res.log(f"  {name}: filled {big.batches():,} batches in {time.perf_counter() - t0:.1f} s")
    fresh: list[_Shard] = []

    def small(_r: int) -> _Shard:
        while fresh:
            fresh.pop().close()
        s = _Shard(root, "small", inline_total)
        s.fill(1)
        fresh.append(s)
        return s

    try:
        samples = interleave(
            {
                "big": _cpu_per_append(lambda _r: big, appends),
                "small": _cpu_per_append(small, appends),
            },
            rounds,
            warmup=1,
            log=res.log,
        )
        res.add(
            ratio_record(
                section,
                f"{name}: CPU per one-row append at {big_n:,} batches vs one",
                subject=f"shard of {big_n:,} uncompacted batches",
                subject_samples=samples["big"],
                reference="fresh shard",
                reference_samples=samples["small"],
                measure="slowdown",
                unit="s",
                goal=goal,
            )
        )
    finally:
        big.close()
        for s in fresh:
            s.close()


def run(quick: bool, json_path: str | None, big_n: int = BIG) -> Path:
    """Run the bench; return the path of the results JSON."""
    appends, rounds = (40, 5) if quick else (100, 7)
    res = BenchResults(
        "growth",
        "One-row commits as the state grows (compaction off)",
        quick=quick,
        params={"big": big_n, "appends_per_round": appends, "rounds": rounds},
    )
    (ROOT / "var").mkdir(exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="growth-bench-", dir=ROOT / "var"))
    try:
        with res.section("one-row commits as the state grows"):
            _variant(res, root, "inline parts", 1 << 30, big_n, appends, rounds, GOAL_GROWTH)
            _variant(res, root, "default settings", None, big_n, appends, rounds, None)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out: list[Any] = []
    for r in res.records:
        verdict = "" if r.goal is None else f"  goal {r.goal}: {r.verdict}"
        sp = r.spread
        spread = "" if sp is None else f" ({fmt_num(sp[0])} to {fmt_num(sp[1])})"
        click.echo(f"{r.name}: {fmt_num(r.value)}{r.unit}{spread}{verdict}")
        out.append(r)
    return res.save(json_path)


@click.command()
@click.option("--quick", is_flag=True, help="Fewer appends and rounds.")
@click.option("--big", "big_n", default=BIG, show_default=True, help="Batches of the big shard.")
@click.option(
    "--json",
    "json_path",
    default=None,
    help="Results file (default var/bench-results/growth.json).",
)
def main(quick: bool, big_n: int, json_path: str | None) -> None:
    """CPU per one-row append on a shard of many uncompacted batches against a fresh one."""
    path = run(quick, json_path, big_n)
    click.echo(f"growth bench results: {path}")


if __name__ == "__main__":
    main()
