"""The consolidated Spark read cut by key range: several input partitions, no
shuffle, each distinct row once, equal to ``ReadHandle.snapshot``.

A few random shards (composite keys with nulls, NaN and strings; several appends of
several runs; tiny parts so that runs span parts and one key spans part boundaries; inline
compaction from some append on) read with several ``partitions`` counts.
"""

from __future__ import annotations

import math
import random
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist import PersistClient
from stash import Stash

pytestmark = pytest.mark.spark

KEYS = pa.schema([("s", pa.string()), ("f", pa.float64())])
VALUES = pa.schema([("v", pa.int64())])

UPDATE = st.tuples(
    st.one_of(st.none(), st.sampled_from(["", "a", "b", "é"])),
    st.one_of(st.none(), st.sampled_from([math.nan, -0.0, 1.5, -2.0])),
    st.integers(0, 2),  # value
    st.integers(0, 2),  # time offset
    st.sampled_from([-1, 1, 1, 2]),
)


@st.composite
def shards(draw: Any) -> dict[str, Any]:
    return {
        "appends": draw(
            st.lists(
                st.lists(st.lists(UPDATE, min_size=1, max_size=10), min_size=1, max_size=3),
                min_size=1,
                max_size=3,
            )
        ),
        "compact_after": draw(st.integers(0, 3)),
        "as_of_frac": draw(st.floats(0, 1)),
    }


def _build(stash_url: str, blob_uri: str, spec: dict[str, Any]) -> tuple[int, list[Any]]:
    with Stash.open(stash_url, fenced=False) as s:
        client = PersistClient(
            s, blob_uri, compaction="off", inline_max_bytes=0, target_part_bytes=150
        )
        try:
            write, read = client.open("kr", KEYS, VALUES)
            upper = 0
            for i, runs in enumerate(spec["appends"]):
                if i == spec["compact_after"]:
                    client.compaction = "inline"
                builder = write.builder(upper)
                for run in runs:
                    updates = [((s_, f), (v,)) for s_, f, v, _, _ in run]
                    rows = [(kv, upper + t, d) for kv, (*_, t, d) in zip(updates, run, strict=True)]
                    rows += [((("dup", 1.0), (v,)), upper, 1) for v in range(4)]
                    builder.add(rows)
                write.compare_and_append_batch([builder.finish(upper + 3)], upper, upper + 3)
                upper += 3
            as_of = int(spec["as_of_frac"] * (upper - 1))
            snap = read.snapshot(as_of).to_pylist()
            write.expire()
            read.expire()
        finally:
            client.close()
    return as_of, [_norm((r["s"], r["f"], r["v"], r["_diff"])) for r in snap]


def _norm(row: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple("NaN" if isinstance(x, float) and math.isnan(x) else x for x in row)


@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(spec=shards())
def test_key_range_read_equals_the_snapshot(
    spark: Any, tmp_path_factory: Any, spec: dict[str, Any]
) -> None:
    from pyspark.sql import functions as F

    root = Path(tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp()))
    (root / "blob").mkdir()
    stash_url, blob_uri = f"sqlite:///{root / 'stash.db'}", (root / "blob").as_uri()
    as_of, snap = _build(stash_url, blob_uri, spec)
    for partitions in (1, 3, 8):
        df = (
            spark.read.format("persist")
            .option("stash", stash_url)
            .option("blob", blob_uri)
            .option("as_of", str(as_of))
            .option("partitions", str(partitions))
            .load("kr")
        )
        assert 1 <= df.rdd.getNumPartitions() <= partitions
        rows = df.withColumn("pid", F.spark_partition_id()).collect()
        got = [_norm((r["s"], r["f"], r["v"], r["_diff"])) for r in rows]
        # Each task returns a key range in key order and the partitions follow the
        # ranges: the DataFrame is the snapshot, in order, each row once.
        assert got == snap, partitions
        pids = [r["pid"] for r in rows]
        assert pids == sorted(pids)


def test_key_range_read_splits_a_compacted_shard(spark: Any, spark_store: Any) -> None:
    """A shard of one compacted run of many parts reads in the partitions asked for
    (it used to be one task), with the same rows as the snapshot."""
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        client = PersistClient(
            s, spark_store.blob_uri, inline_max_bytes=0, target_part_bytes=20_000
        )
        try:
            write, read = client.open("one", pa.schema([("k", pa.int64())]), VALUES)
            n = 5000
            values = [random.Random(i).getrandbits(48) for i in range(n)]  # incompressible
            table = pa.table(
                {
                    "k": pa.array(range(n), pa.int64()),
                    "v": pa.array(values, pa.int64()),
                    "_time": pa.array([0] * n, pa.int64()),
                    "_diff": pa.array([1] * n, pa.int64()),
                }
            )
            write.compare_and_append(table, 0, 1)
            parts = sum(len(b.parts) for b in read.snapshot_batches(0))
            assert parts >= 4
            write.expire()
            read.expire()
        finally:
            client.close()
    df = (
        spark.read.format("persist")
        .option("stash", spark_store.stash_url)
        .option("blob", spark_store.blob_uri)
        .option("partitions", "4")
        .load("one")
    )
    assert df.rdd.getNumPartitions() == 4
    got = sorted((r["k"], r["v"], r["_diff"]) for r in df.collect())
    assert got == [(i, values[i], 1) for i in range(n)]
    with pytest.raises(Exception, match="partitions must be a positive"):
        (
            spark.read.format("persist")
            .option("stash", spark_store.stash_url)
            .option("blob", spark_store.blob_uri)
            .option("partitions", "0")
            .load("one")
            .collect()
        )
