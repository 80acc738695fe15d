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


def test_spark_persist_txn_two_upserts_to_one_collection_commit(tmp_path: Path) -> None:
    """``PersistTxn.upsert`` called twice for one collection (e.g. planes of two
    DataFrames) commits both (before the fix: two batches with the same lower, and
    TxnUpperMismatch at every try).  ``upsert`` does not use Spark, so no session is
    needed to show it."""
    from spark.persist_txn import PersistTxn

    url = f"sqlite:///{tmp_path}/s.db"
    t = PersistTxn(None, url, "memory://")
    try:
        t.upsert("planes", {"N1": {"seats": 2}})
        t.upsert("planes", {"N2": {"seats": 4}})
        t.commit()
        coll = t.stash.collection("planes", key="str", value="json")
        assert t.stash.peek_one(coll) == {"N1": {"seats": 2}, "N2": {"seats": 4}}
    finally:
        t.close()


def test_spark_persist_txn_upserts_of_one_key_twice_keep_the_last_value(tmp_path: Path) -> None:
    """Two upserts of one existing key in one transaction: the key ends with the second
    value (each upsert retracting the stored value on its own would retract it twice)."""
    from spark.persist_txn import PersistTxn

    url = f"sqlite:///{tmp_path}/s.db"
    t = PersistTxn(None, url, "memory://")
    try:
        t.upsert("planes", {"N1": {"seats": 1}})
        t.commit()
    finally:
        t.close()
    t = PersistTxn(None, url, "memory://")
    try:
        t.upsert("planes", {"N1": {"seats": 2}})
        t.upsert("planes", {"N1": {"seats": 3}, "N2": {"seats": 4}})
        t.commit()
        coll = t.stash.collection("planes", key="str", value="json")
        assert t.stash.peek_one(coll) == {"N1": {"seats": 3}, "N2": {"seats": 4}}
        assert sorted(d for _, _, d in t.stash.iter(coll)) == [1, 1]
    finally:
        t.close()
