"""The persist source's reads equal ``ReadHandle.snapshot``: the default read is the
consolidated snapshot, the raw modes sum to it, on any partitioning.

The differential test writes random shards straight through persist (several batches
per append, as several Spark tasks do; tiny parts, so runs span parts and batches span
runs; retractions; a since moved by a reader and inline compaction), then compares
every read mode and several ``partition_bytes`` with the snapshot at a random ``as_of``.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist import PersistClient
from stash import Stash
from tests.reliability.campaign import runs

pytestmark = pytest.mark.spark

KEYS = pa.schema([("k", pa.int64())])
VALUES = pa.schema([("v", pa.string())])


def _opts(stash_url: str, blob_uri: str) -> dict[str, str]:
    return {"stash": stash_url, "blob": blob_uri}


def _read(spark: Any, stash_url: str, blob_uri: str, shard: str, **options: Any) -> Any:
    r = spark.read.format("persist").options(**_opts(stash_url, blob_uri))
    for k, v in options.items():
        r = r.option(k, str(v))
    return r.load(shard)


def test_default_read_of_a_four_task_write_is_consolidated(spark: Any, spark_store: Any) -> None:
    """The case that was read unconsolidated: one row per task, a key inserted and
    retracted by two tasks."""
    rows = [(1, "a", 1), (1, "a", -1), (2, "b", 1), (2, "b", 1)]
    df = spark.createDataFrame(rows, "id long, name string, d long").repartition(4)
    assert df.rdd.getNumPartitions() == 4
    (
        df.write.format("persist")
        .options(**_opts(spark_store.stash_url, spark_store.blob_uri))
        .option("key_columns", "id")
        .option("diff_column", "d")
        .mode("append")
        .save("four")
    )
    back = _read(spark, spark_store.stash_url, spark_store.blob_uri, "four")
    assert sorted(tuple(r) for r in back.collect()) == [(2, "b", 2)]
    assert back.filter("id = 1").count() == 0
    assert back.count() == 1
    expanded = _read(spark, spark_store.stash_url, spark_store.blob_uri, "four", expand="true")
    assert sorted(tuple(r) for r in expanded.collect()) == [(2, "b"), (2, "b")]
    # Raw updates are still there when asked for explicitly; they sum to the snapshot.
    raw = _read(
        spark, spark_store.stash_url, spark_store.blob_uri, "four", consolidate="none"
    ).collect()
    assert sorted(tuple(r) for r in raw) == sorted(rows)


def test_empty_shard_reads_as_an_empty_dataframe(spark: Any, spark_store: Any) -> None:
    empty = spark.createDataFrame([], "id long, name string")
    (
        empty.write.format("persist")
        .options(**_opts(spark_store.stash_url, spark_store.blob_uri))
        .option("key_columns", "id")
        .mode("append")
        .save("empty")
    )
    for options in ({}, {"expand": "true"}, {"consolidate": "none"}):
        df = _read(spark, spark_store.stash_url, spark_store.blob_uri, "empty", **options)
        assert df.collect() == []
        assert df.count() == 0
    assert _read(spark, spark_store.stash_url, spark_store.blob_uri, "empty").columns == [
        "id",
        "name",
        "_diff",
    ]


# ---------------------------------------------------------------- differential
UPDATE = st.tuples(
    st.integers(0, 4),  # key
    st.sampled_from(["a", "b"]),  # value
    st.integers(0, 2),  # time offset within the append
    st.sampled_from([-2, -1, 1, 1, 2]),  # diff
)
APPEND = st.tuples(
    st.booleans(),  # every update of the append at one time (as a Spark write at the upper)
    st.lists(st.lists(UPDATE, min_size=0, max_size=6), min_size=1, max_size=4),  # tasks
)


@st.composite
def shards(draw: Any) -> dict[str, Any]:
    appends = draw(st.lists(APPEND, min_size=1, max_size=4))
    since_after = draw(st.integers(0, len(appends)))  # move the since after this append
    return {
        "appends": appends,
        "since_after": since_after,
        "since_frac": draw(st.floats(0, 1)),
        "as_of_frac": draw(st.floats(0, 1)),
        "target_part_bytes": draw(st.sampled_from([1, 1 << 20])),
    }


def _build(stash_url: str, blob_uri: str, spec: dict[str, Any]) -> tuple[int, dict[Any, int]]:
    """Write the shard ``d``; return ``(as_of, snapshot as {(k, v): diff})``."""
    with Stash.open(stash_url, fenced=False) as s:
        client = PersistClient(
            s,
            blob_uri,
            compaction="inline",
            inline_max_bytes=0,
            target_part_bytes=spec["target_part_bytes"],
        )
        try:
            write, read = client.open("d", KEYS, VALUES)
            upper = 0
            for i, (one_time, append) in enumerate(spec["appends"]):
                if i == spec["since_after"] and upper > 0:
                    since = int(spec["since_frac"] * (upper - 1))
                    if read.since.less_than(since):
                        read.downgrade_since(since)
                batches = []
                for task in append:
                    builder = write.builder(upper)
                    for k, v, dt, d in task:  # one add per update: a run each (tiny parts)
                        builder.add([(((k,), (v,)), upper + (0 if one_time else dt), d)])
                    batches.append(builder.finish(upper + 3))
                write.compare_and_append_batch(batches, upper, upper + 3)
                upper += 3
            since = read.shard_since().as_option() or 0
            as_of = since + int(spec["as_of_frac"] * (upper - 1 - since))
            snap = read.snapshot(as_of).to_pylist()
            write.expire()
            read.expire()
        finally:
            client.close()
    return as_of, {(r["k"], r["v"]): r["_diff"] for r in snap}


def _sums(rows: Any) -> dict[Any, int]:
    out: Counter[Any] = Counter()
    for r in rows:
        out[(r["k"], r["v"])] += r["_diff"]
    return {k: d for k, d in out.items() if d != 0}


@pytest.mark.sized
@settings(
    max_examples=runs(5, 30),  # about 10 Spark reads each
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(spec=shards())
def test_every_read_mode_equals_the_snapshot(
    spark: Any, tmp_path_factory: Any, spec: dict[str, Any]
) -> None:
    root = Path(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp()))
    (root / "blob").mkdir()
    stash_url, blob_uri = f"sqlite:///{root / 'stash.db'}", (root / "blob").as_uri()
    as_of, snap = _build(stash_url, blob_uri, spec)

    def read(**options: Any) -> list[Any]:
        return _read(spark, stash_url, blob_uri, "d", as_of=as_of, **options).collect()

    def read_with_partition(**options: Any) -> list[Any]:
        from pyspark.sql import functions as F

        df = _read(spark, stash_url, blob_uri, "d", as_of=as_of, **options)
        return df.withColumn("pid", F.spark_partition_id()).collect()

    # Default (consolidated): exactly the snapshot, each row once, never a zero diff.
    full = read(time_column="ts")
    assert len({(r["k"], r["v"]) for r in full}) == len(full)
    assert {(r["k"], r["v"]): r["_diff"] for r in full} == snap
    assert all(r["ts"] == as_of and r["_diff"] != 0 for r in full)
    for pb in (1, 2000, None):
        sized = {} if pb is None else {"partition_bytes": pb}
        rows = read(**sized)
        assert len(rows) == len(snap) and _sums(rows) == snap
        # Consolidated within each partition only: the sums are the snapshot.
        part = read_with_partition(consolidate="partition", **sized)
        assert all(r["_diff"] != 0 for r in part)
        assert len({(r["pid"], r["k"], r["v"]) for r in part}) == len(part)
        assert _sums(part) == snap
        # Raw updates, with their times.
        raw = read(consolidate="none", time_column="ts", **sized)
        assert all(r["ts"] <= as_of for r in raw)
        assert _sums(raw) == snap
    # expand: each row repeated by its multiplicity, or a clear error for negative ones.
    if all(d > 0 for d in snap.values()):
        bag = Counter((r["k"], r["v"]) for r in read(expand="true"))
        assert bag == Counter({row: d for row, d in snap.items()})
    else:
        with pytest.raises(Exception, match="negative multiplicity"):
            read(expand="true")
