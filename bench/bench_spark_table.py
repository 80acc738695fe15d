"""The ``table`` section of :mod:`bench.bench_spark`: reads of flights through
``PersistTable.to_df`` against ``spark.read.parquet`` of the same rows, the floor of a
Python data source and ``format("persist")``, in one run.

Shards (flights with an ``id`` key, the row number):

* ``fresh``: written through Spark's ``df.write.format("persist")`` from the DataFrame
  in 4 partitions (round robin: every task's run spans the whole key range) and read
  right away, as a pipeline reads what it just wrote: 4 runs of inserts only at one
  time, overlapping;

the others by one append at time 0 through the persist client: one sorted, consolidated
run of blob parts, what compaction leaves:

* ``compacted``: that run alone;
* ``tail``: then 1% of the rows (3,368 random ids) upserted in 4 appends (each a
  retraction of the old row and the new row, ``arr_delay`` + 1): an uncompacted tail with
  retractions whose keys are spread over every part;
* ``tail-clustered``: the same with 1% consecutive ids (recent rows corrected), whose keys
  fall in a few parts.

Each contender runs the same query: a read-and-aggregate (``groupBy("carrier")`` with the
count and the sums of ``dep_delay`` and ``arr_delay``, weighted by ``_diff`` for the
persist reads), collected to the driver; Parquet reads the snapshot's rows written by
``df.write.parquet``. ``to_df`` runs twice per round: as a table read again (its planning
client kept, the direct parts' decoded row groups cached, :mod:`spark.native_merge`, and
the unchanged shard's plan and DataFrame reused, :class:`spark.table.PersistTable`), and
cold, as a first read (cache cleared, a new client, a new plan). Contenders are interleaved; medians
and the (min, max) spread of the per-round ratios are reported, with the machine's load
average before and after.

Invariant: every contender's result equals ``spark.read.parquet``'s (checked once,
untimed); a mismatch fails the section.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from bench.common import BenchResults, Goal, Table, fmt_num, interleave, median, ratio_record

NATIVE = "PersistTable.to_df"
COLD = "PersistTable.to_df, cold"
PARQUET = "spark.read.parquet"
FLOOR = "python floor"
SOURCE = 'format("persist")'

#: (shard, what it holds, goal of to_df against spark.read.parquet)
SHARDS = (
    ("fresh", "freshly written by Spark's writer (4 tasks, overlapping keys)", 1.1),
    ("compacted", "after compaction (one consolidated run)", 1.1),
    ("tail", "with a 1% uncompacted tail of upserts (random keys)", 1.3),
    ("tail-clustered", "with a 1% uncompacted tail of upserts (consecutive keys)", 1.3),
)


def _load(s: Any, shard: str) -> int:
    """Write the shard (see the module docstring); return its upper."""
    import pyarrow.compute as pc

    from persist import PersistClient
    from stash import Stash

    table = s.table
    ids = pa.array(np.arange(table.num_rows, dtype=np.int64))
    if shard == "fresh":
        with_ids = pa.Table.from_arrays([ids, *table.columns], names=["id", *table.column_names])
        df = s.spark.createDataFrame(with_ids).repartition(4)
        (
            df.write.format("persist")
            .option("stash", s.stash_url)
            .option("blob", s.blob_uri)
            .option("key_columns", "id")
            .mode("append")
            .save(shard)
        )
        from spark.table import PersistTable

        with PersistTable(s.spark, shard, s.stash_url, s.blob_uri).client() as c:
            return int(c.inspect(shard).upper.as_option())
    keys = pa.schema([("id", pa.int64())])
    values = table.schema
    rows = pa.Table.from_arrays(
        [
            ids,
            *table.columns,
            pa.array(np.zeros(len(ids), np.int64)),
            pa.array(np.ones(len(ids), np.int64)),
        ],
        names=["id", *table.column_names, "_time", "_diff"],
    )
    with Stash.open(s.stash_url, fenced=False) as st:
        c = PersistClient(st, s.blob_uri, compaction="off")
        try:
            w = c.open_writer(shard, keys, values)
            w.append(rows, 0, 1)
            n = table.num_rows // 100
            if shard != "compacted":
                rng = np.random.default_rng(7)
                picked = (
                    rng.choice(table.num_rows, n, replace=False)
                    if shard == "tail"
                    else np.arange(table.num_rows - n, table.num_rows)
                )
                for chunk in np.array_split(np.sort(picked), 4):
                    sel = rows.take(pa.array(chunk)).drop_columns(["_time", "_diff"])
                    i = sel.schema.get_field_index("arr_delay")
                    sel = sel.set_column(i, "arr_delay", pc.add(sel.column(i), 1.0))
                    w.upsert(sel)
            upper = int(c.inspect(shard).upper.as_option())
            w.expire()
        finally:
            c.close()
    return upper


def _floor_inputs(s: Any, t: Any, snap: Any) -> tuple[list[list[str]], Any]:
    """The shard's part files in ``defaultParallelism`` groups, and the snapshot's
    schema (the floor reads every part as it is: right for the compacted shard only)."""
    with t.client() as c:
        batches = c.inspect(t.shard).batches()
    root = s.blob_uri.removeprefix("file://")
    files = [f"{root}/{p.key}" for b in batches for p in b.parts if p.key]
    n = max(1, min(len(files), s.default_partitions))
    return [files[i::n] for i in range(n)], snap.schema


def _agg(df: Any, weighted: bool) -> list[tuple[Any, ...]]:
    from pyspark.sql import functions as F

    d = F.col("_diff") if weighted else F.lit(1)
    rows = (
        df.groupBy("carrier")
        .agg(
            F.sum(d).alias("n"),
            F.sum(F.col("dep_delay") * d).alias("dep"),
            F.sum(F.col("arr_delay") * d).alias("arr"),
        )
        .collect()
    )
    return sorted((r["carrier"], int(r["n"]), r["dep"], r["arr"]) for r in rows)


def _against_parquet(
    res: BenchResults,
    sm: dict[str, list[float]],
    what: str,
    subject: str,
    label: str,
    limit: float | None = None,
) -> Any:
    """Record ``subject``'s slowdown against ``spark.read.parquet`` (with a goal of at most
    ``limit``, if given) and return the record."""
    return res.add(
        ratio_record(
            "Spark reads through PersistTable",
            f"read-and-aggregate of flights {what}: {label} vs spark.read.parquet",
            subject=subject,
            subject_samples=sm[subject],
            reference=PARQUET,
            reference_samples=sm[PARQUET],
            measure="slowdown",
            goal=None if limit is None else Goal("<=", limit),
        )
    )


def _spread_of(rec: Any) -> str:
    """A ratio with its (min-max) spread."""
    lo, hi = rec.spread or (0.0, 0.0)
    return f"{fmt_num(rec.value)} ({fmt_num(lo)}-{fmt_num(hi)})"


def run_table_section(res: BenchResults, s: Any, root: Path, rounds: int) -> None:
    """The ``table`` section (see the module docstring)."""
    from spark.table import PersistTable

    load_before = os.getloadavg()
    out_rows: list[list[Any]] = []
    for shard, what, goal in SHARDS:
        upper = _load(s, shard)
        t = PersistTable.for_name(s.spark, shard, stash=s.stash_url, blob=s.blob_uri)
        pq_path = str(root / "parquet" / f"table_{shard}")
        snap = t.to_df(as_of=upper - 1, path="python")
        snap.drop("_diff").write.mode("overwrite").parquet(pq_path)
        groups, schema = _floor_inputs(s, t, snap)

        def native(r: int, t: Any = t, upper: int = upper) -> list[Any]:
            return _agg(t.to_df(as_of=upper - 1, path="native"), True)

        def cold(r: int, t: Any = t, upper: int = upper) -> list[Any]:
            # A first read: no decoded row group cached, a new planning client.
            from spark.native_merge import ROW_GROUP_CACHE

            ROW_GROUP_CACHE.clear()
            t.close()
            return _agg(t.to_df(as_of=upper - 1, path="native"), True)

        def source(r: int, t: Any = t, upper: int = upper) -> list[Any]:
            return _agg(t.to_df(as_of=upper - 1, path="python"), True)

        def parquet(r: int, p: str = pq_path) -> list[Any]:
            return _agg(s.spark.read.parquet(p), False)

        def floor(r: int, g: Any = groups, sc: Any = schema) -> list[Any]:
            df = (
                s.spark.read.format("floor")
                .schema(sc)
                .option("files", ";".join(",".join(x) for x in g))
            )
            return _agg(df.load(), True)

        want = parquet(0)
        for name, fn in ((NATIVE, native), (COLD, cold), (SOURCE, source)):
            got = fn(0)
            if [r[:2] for r in got] != [r[:2] for r in want] or not all(
                abs(a[2] - b[2]) < 1e-6 * max(1, abs(b[2]))
                and abs(a[3] - b[3]) < 1e-6 * max(1, abs(b[3]))
                for a, b in zip(got, want, strict=True)
            ):
                raise RuntimeError(f"{name} on shard {shard} differs from spark.read.parquet")

        def timed(fn: Any) -> Any:
            def go(rnd: int) -> float:
                t0 = time.perf_counter()
                fn(rnd)
                return time.perf_counter() - t0

            return go

        contenders = {
            NATIVE: timed(native),
            COLD: timed(cold),
            PARQUET: timed(parquet),
            SOURCE: timed(source),
        }
        if shard == "compacted":
            contenders[FLOOR] = timed(floor)
        sm = interleave(contenders, rounds, warmup=1, log=res.log)
        rec = _against_parquet(res, sm, what, NATIVE, "to_df", goal)
        cold_rec = _against_parquet(res, sm, what, COLD, "to_df cold (first read)")
        src = _against_parquet(res, sm, what, SOURCE, "format(persist)")

        out_rows.append(
            [
                what,
                fmt_num(median(sm[PARQUET])),
                fmt_num(median(sm[NATIVE])),
                _spread_of(rec),
                _spread_of(cold_rec),
                fmt_num(median(sm[SOURCE])),
                fmt_num(src.value),
                fmt_num(median(sm[FLOOR])) if FLOOR in sm else "",
                f"<= {goal}: {rec.verdict}",
            ]
        )
    load_after = os.getloadavg()
    res.params["table_load_avg"] = [round(load_before[0], 2), round(load_after[0], 2)]
    res.tables.append(
        Table(
            section="Spark reads through PersistTable",
            name="spark-table",
            title=(
                f"read-and-aggregate of flights ({s.rows:,} rows), seconds, medians of {rounds} "
                f"rounds; ratio spread (min-max); 1-min load average {load_before[0]:.1f} "
                f"before, {load_after[0]:.1f} after"
            ),
            columns=[
                "shard",
                "spark.read.parquet s",
                "to_df s",
                "to_df ratio",
                "first to_df ratio",
                "format(persist) s",
                "ratio",
                "python floor s",
                "goal",
            ],
            rows=out_rows,
        )
    )
