"""Spark writes evolve a shard's schema with ``mergeSchema``.

``df.write.format("persist").option("mergeSchema", "true")`` adds the DataFrame's extra
columns as nullable value columns and widens value columns it holds in a wider type, as
Delta Lake does; without it, extra columns are a clear error that commits nothing; a read
returns the newest schema, the rows written before the evolution conformed to it.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from persist import PersistClient
from stash import Stash

pytestmark = pytest.mark.spark


def _opts(store: Any) -> dict[str, str]:
    return {"stash": store.stash_url, "blob": store.blob_uri}


def _write(df: Any, store: Any, shard: str, **options: Any) -> None:
    w = df.write.format("persist").options(**_opts(store)).mode("append")
    for k, v in options.items():
        w = w.option(k, v)
    w.save(shard)


def _state(store: Any, shard: str) -> Any:
    with Stash.open(store.stash_url, fenced=False) as s:
        client = PersistClient(s, store.blob_uri, compaction="off")
        try:
            return client.inspect(shard)
        finally:
            client.close()


def test_merge_schema_round_trip(spark: Any, spark_store: Any) -> None:
    v1 = spark.createDataFrame([(1, 10), (2, 20)], "id long, qty int")
    _write(v1, spark_store, "orders", key_columns="id")
    before = _state(spark_store, "orders")
    assert before.value_schema.names == ["qty"]

    # Extra columns without mergeSchema: a clear error, nothing committed.
    v2 = spark.createDataFrame([(3, 30, "red")], "id long, qty int, color string")
    with pytest.raises(Exception, match=r"has columns \['color'\].*mergeSchema"):
        _write(v2, spark_store, "orders")
    after = _state(spark_store, "orders")
    assert after.seqno == before.seqno and len(after.schema_history) == 1

    # With mergeSchema: color is added (nullable) and qty widened to bigint.
    v3 = spark.createDataFrame([(3, 2**40, "red")], "id long, qty long, color string")
    _write(v3, spark_store, "orders", mergeSchema="true")
    st = _state(spark_store, "orders")
    assert [s.names for s in st.schema_history] == [["qty"], ["qty", "color"]]
    assert st.value_schema.field("qty").type == pa.int64()
    assert st.value_schema.field("color").nullable
    parts = {p.schema_id for b in st.batches() for p in b.parts}
    assert parts == {0, 1}

    # A read returns the newest schema; rows written before read color as null.
    df = spark.read.format("persist").options(**_opts(spark_store)).load("orders")
    assert [(f.name, f.dataType.simpleString()) for f in df.schema.fields] == [
        ("id", "bigint"),
        ("qty", "bigint"),
        ("color", "string"),
        ("_diff", "bigint"),
    ]
    assert sorted(tuple(r) for r in df.collect()) == [
        (1, 10, None, 1),
        (2, 20, None, 1),
        (3, 2**40, "red", 1),
    ]
    raw = (
        spark.read.format("persist")
        .options(**_opts(spark_store))
        .option("consolidate", "none")
        .load("orders")
    )
    assert sorted(r["id"] for r in raw.collect()) == [1, 2, 3]

    # A DataFrame of the newest schema writes without the option; mergeSchema with
    # nothing new registers nothing.
    v4 = spark.createDataFrame([(4, 40, None)], "id long, qty long, color string")
    _write(v4, spark_store, "orders", mergeSchema="true")
    assert len(_state(spark_store, "orders").schema_history) == 2
    _write(v4.selectExpr("id + 1 as id", "qty", "color"), spark_store, "orders")
    again = spark.read.format("persist").options(**_opts(spark_store)).load("orders")
    assert sorted(r["id"] for r in again.collect()) == [1, 2, 3, 4, 5]


def test_merge_schema_refuses_an_incompatible_type(spark: Any, spark_store: Any) -> None:
    v1 = spark.createDataFrame([(1, 10)], "id long, qty int")
    _write(v1, spark_store, "typed", key_columns="id")
    before = _state(spark_store, "typed")
    bad = spark.createDataFrame([(2, "ten")], "id long, qty string")
    with pytest.raises(Exception, match=r"qty"):
        _write(bad, spark_store, "typed", mergeSchema="true")
    after = _state(spark_store, "typed")
    assert after.seqno == before.seqno and len(after.schema_history) == 1


def test_spark_compaction_job_rewrites_under_the_newest_schema(
    spark: Any, spark_store: Any
) -> None:
    """The Spark compaction job conforms every input part to the newest schema version
    before consolidating (rows differing only in a dropped column become one) and its
    outputs record that version; no readable time changes."""
    from spark.jobs.compact import compact_shard

    keys = pa.schema([("k", pa.int64())])
    v0 = pa.schema([("v", pa.int32()), ("gone", pa.string())])
    v1 = pa.schema([("v", pa.int64()), ("extra", pa.string())])
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        client = PersistClient(s, spark_store.blob_uri, compaction="off", inline_max_bytes=0)
        try:
            w0, _ = client.open("evolved", keys, v0)
            for t in range(6):  # each key twice, differing only in the column v1 drops
                rows = [
                    (((k,), (k, f"{g}{t}")), t, 1) for k in range(t * 5, t * 5 + 5) for g in "gh"
                ]
                w0.compare_and_append(rows, t, t + 1)
            w1, read = client.open("evolved", keys, v1, drop=["gone"])
            for t in range(6, 12):
                rows = [(((k,), (k, "e")), t, 1) for k in range(t * 5 - 30, t * 5 - 25)]
                w1.compare_and_append(rows, t, t + 1)
            read.downgrade_since(11)
            want = read.snapshot(11).to_pylist()
            w0.expire()
            w1.expire()
            read.expire()
            before = client.inspect("evolved")
        finally:
            client.close()
    assert before.trace.all_fueled_merge_reqs()
    report = compact_shard(
        spark,
        spark_store.stash_url,
        spark_store.blob_uri,
        "evolved",
        min_spark_bytes=0,
        bytes_per_task=4096,
    )
    assert report.failed == 0, report.errors
    assert report.applied >= 1
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        client = PersistClient(s, spark_store.blob_uri, compaction="off")
        try:
            after = client.inspect("evolved")
            _, read = client.open("evolved", keys, v1)
            got = read.snapshot(11).to_pylist()
        finally:
            client.close()
    assert got == want
    rows = [(r["k"], r["v"], r["extra"], r["_diff"]) for r in got]
    assert len(rows) == 60 and set(rows) == {(k, k, None, 2) for k in range(30)} | {
        (k, k, "e", 1) for k in range(30)
    }
    merged = [p for b in after.batches() for p in b.parts if p.key and "/c/" in p.key]
    assert merged and all(p.schema_id == 1 for p in merged)


def _history(store: Any, shard: str) -> list[list[str]]:
    with Stash.open(store.stash_url, fenced=False) as s:
        client = PersistClient(s, store.blob_uri, compaction="off")
        try:
            return [v.names for v in client.inspect(shard).schema_history]
        finally:
            client.close()


def test_refused_merge_schema_write_does_not_evolve_the_shard(spark: Any, spark_store: Any) -> None:
    """A ``mergeSchema`` write refused at planning (here ``time`` before the shard's
    upper: "persist only appends at or after its upper") has already registered the
    evolved value schema: ``PersistWriter.__init__`` opens the writer (which evolves the
    schema by compare-and-set) before its checks.  The write fails, yet the shard now has
    a ``color`` column."""
    opts = {"stash": spark_store.stash_url, "blob": spark_store.blob_uri}
    v1 = spark.createDataFrame([(1, 10)], "id long, qty int")
    v1.write.format("persist").options(**opts).option("key_columns", "id").option("time", "5").mode(
        "append"
    ).save("ms_refused")
    assert _history(spark_store, "ms_refused") == [["qty"]]
    v2 = spark.createDataFrame([(2, 20, "red")], "id long, qty int, color string")
    with pytest.raises(Exception, match="before shard"):
        v2.write.format("persist").options(**opts).option("mergeSchema", "true").option(
            "time", "0"
        ).mode("append").save("ms_refused")
    assert _history(spark_store, "ms_refused") == [["qty"]]
