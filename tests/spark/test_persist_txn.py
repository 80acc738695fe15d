"""Issue 14, Spark: ``spark.persist_txn`` commits writes of several DataFrames to several
shards, plus catalog rows, as one transaction; an exception in the block commits
nothing and deletes the parts the executors uploaded."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from persist import PersistClient
from spark.persist_txn import persist_txn
from stash import Stash

pytestmark = pytest.mark.spark


def _parts(root: Path) -> set[str]:
    return {str(p) for p in root.rglob("*.parquet")}


def test_persist_txn_commits_shards_and_catalog_together(spark: Any, spark_store: Any) -> None:
    url, blob = spark_store.stash_url, spark_store.blob_uri
    orders = spark.createDataFrame(
        [(i, f"o{i}", i % 3) for i in range(40)], "id long, name string, day long"
    )
    lines = spark.createDataFrame(
        [(i, i * 10) for i in range(25)], "id long, qty long"
    ).repartition(3)
    with persist_txn(spark, url, blob) as txn:
        assert txn.write(orders, "orders", key_columns=["id"], time_column="day") == 40
        assert txn.write(lines, "lines", key_columns=["id"]) == 25
        assert txn.upsert("catalog", {"orders": {"rows": 40}, "lines": {"rows": 25}}) == 2
        with Stash.open(url, fenced=False) as s:  # nothing visible before the commit
            c = PersistClient(s, blob, compaction="off")
            assert c.inspect("orders").upper.as_option() == 0
            c.close()
    assert txn.txn.committed_ts == 2  # the largest day written
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, blob, compaction="off")
        try:
            snap = c.snapshot_many({"orders": 2, "lines": 2})
            assert Counter(snap["orders"].column("name").to_pylist()) == Counter(
                f"o{i}" for i in range(40)
            )
            assert sorted(snap["lines"].column("qty").to_pylist()) == [i * 10 for i in range(25)]
            day0 = c.snapshot_many({"orders": 0})["orders"]
            assert sorted(day0.column("id").to_pylist()) == [i for i in range(40) if i % 3 == 0]
            assert c.inspect("lines").upper.as_option() == 3
            cat = s.collection("catalog", key="str", value="json")
            assert s.peek_one(cat) == {"orders": {"rows": 40}, "lines": {"rows": 25}}
        finally:
            c.close()


def test_persist_txn_exception_commits_nothing_and_deletes_parts(
    spark: Any, spark_store: Any
) -> None:
    url, blob = spark_store.stash_url, spark_store.blob_uri
    big = spark.createDataFrame(
        [(i, "x" * 200) for i in range(3000)], "id long, payload string"
    ).repartition(2)
    root = spark_store.root / "blob"
    before = _parts(root)
    with pytest.raises(RuntimeError, match="boom"), persist_txn(spark, url, blob) as txn:
        txn.write(big, "big", key_columns=["id"])
        assert _parts(root) - before  # the executors uploaded parts
        txn.upsert("catalog", {"big": 1})
        raise RuntimeError("boom")
    assert _parts(root) == before
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, blob, compaction="off")
        assert c.inspect("big").upper.as_option() == 0
        c.close()
        assert (
            "catalog" not in s.collections()
            or s.iter(s.collection("catalog", key="str", value="json")) == []
        )
