"""Protects: a shard freshly written by Spark's ``format("persist")`` writer reads through
Spark's Parquet reader alone.

The writer's tasks each write one run at one time, inserts only, over overlapping key
ranges. Such runs need no merge with each other (:mod:`spark.native_plan`): every part
is direct and nothing is read on the driver. The read equals ``ReadHandle.snapshot``, and
so does it after an upsert (a tail) and ``PersistTable.compact()``, which merges the
write's runs into one (a new plan)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.spark.test_persist_table import collected, snapshot

pytestmark = pytest.mark.spark


def test_a_fresh_four_task_write_reads_every_part_directly(spark: Any, spark_store: Any) -> None:
    from spark import PersistTable
    from spark.native_plan import plan_snapshot

    n = 4000
    df = spark.createDataFrame(
        [(i, f"name-{i:05d}-" + "x" * 40) for i in range(n)], "id long, name string"
    ).repartition(4)  # round robin: every task's keys span the whole range
    (
        df.write.format("persist")
        .option("stash", spark_store.stash_url)
        .option("blob", spark_store.blob_uri)
        .option("key_columns", "id")
        .mode("append")
        .save("fresh")
    )
    table = PersistTable.for_name(
        spark, "fresh", stash=spark_store.stash_url, blob=spark_store.blob_uri
    )
    with table.client() as c:
        st = c.inspect("fresh")
        upper = st.upper.as_option()
        plan = plan_snapshot(c, "fresh", st.key_schema, st.value_schema, None)
    assert plan.tail is None and plan.tail_parts == 0, plan.summary()
    assert len(plan.direct) == plan.parts >= 4, plan.summary()
    want = snapshot(spark_store, upper - 1, shard="fresh")
    assert sum(want.values()) == n
    assert collected(table.to_df(path="native")) == want

    table.upsert(spark.createDataFrame([(7, "seven")], "id long, name string"))
    first = table.to_df(path="native")
    assert collected(first) == snapshot(spark_store, upper, shard="fresh")
    with table.client() as c:
        st = c.inspect("fresh")
        before = plan_snapshot(c, "fresh", st.key_schema, st.value_schema, None)
    report = table.compact()
    assert report.applied >= 1 and report.failed == 0, report
    with table.client() as c:
        st = c.inspect("fresh")
        after = plan_snapshot(c, "fresh", st.key_schema, st.value_schema, None)
        # The write's four runs are one now (the spine asked for no merge of them).
        assert all(not b.runs for b in st.batches() if b.len), st.batches()
    assert after.identity != before.identity
    assert collected(table.to_df(path="native")) == snapshot(spark_store, upper, shard="fresh")
