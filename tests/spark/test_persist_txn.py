"""Spark: ``spark.persist_txn`` commits writes of several DataFrames to several
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
        assert txn.upsert_entries("catalog", {"orders": {"rows": 40}, "lines": {"rows": 25}}) == 2
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
        txn.upsert_entries("catalog", {"big": 1})
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
    """``PersistTxn.upsert_entries`` called twice for one collection (e.g. planes of two
    DataFrames) commits both (before the fix: two batches with the same lower, and
    TxnUpperMismatch at every try).  ``upsert_entries`` does not use Spark, so no session is
    needed to show it."""
    from spark.persist_txn import PersistTxn

    url = f"sqlite:///{tmp_path}/s.db"
    t = PersistTxn(None, url, "memory://")
    try:
        t.upsert_entries("planes", {"N1": {"seats": 2}})
        t.upsert_entries("planes", {"N2": {"seats": 4}})
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
        t.upsert_entries("planes", {"N1": {"seats": 1}})
        t.commit()
    finally:
        t.close()
    t = PersistTxn(None, url, "memory://")
    try:
        t.upsert_entries("planes", {"N1": {"seats": 2}})
        t.upsert_entries("planes", {"N1": {"seats": 3}, "N2": {"seats": 4}})
        t.commit()
        coll = t.stash.collection("planes", key="str", value="json")
        assert t.stash.peek_one(coll) == {"N1": {"seats": 3}, "N2": {"seats": 4}}
        assert sorted(d for _, _, d in t.stash.iter(coll)) == [1, 1]
    finally:
        t.close()


def test_upsert_means_a_row_upsert_and_the_entry_shape_is_deprecated(tmp_path: Path) -> None:
    """``PersistTxn.upsert(shard, rows)`` upserts rows into a shard, as on
    ``persist.Txn``; the old ``upsert(collection, {key: value})`` shape still sets
    catalog entries but warns, naming ``upsert_entries``; any other shape is refused,
    naming both, and adds nothing."""
    import pyarrow as pa

    from persist import InvalidUsage
    from spark.persist_txn import PersistTxn

    url = f"sqlite:///{tmp_path}/s.db"
    key = pa.schema([pa.field("tailnum", pa.string(), False)])
    val = pa.schema([pa.field("seats", pa.int64())])
    # One blob store for both transactions (a named memory store): a shard records its
    # store, and another one is refused even while every part is inline.
    blob = f"memory://planes-{tmp_path.name}"
    t = PersistTxn(None, url, blob)
    try:
        t.client.open("planes", key, val)
        rows = pa.table({"tailnum": ["N1", "N2"], "seats": [2, 4]})
        assert t.upsert("planes", rows) == 2
        with pytest.warns(DeprecationWarning, match="upsert_entries"):
            assert t.upsert("catalog", {"N1": {"seats": 2}}) == 1
        with pytest.raises(InvalidUsage, match="upsert_entries"):
            t.upsert("planes", [("N1", 3)])
        with pytest.raises(InvalidUsage, match=r"upsert\(shard, rows\)"):
            t.upsert_entries("catalog", rows)  # type: ignore[arg-type]
        with pytest.raises(InvalidUsage, match="uniqueness"):
            t.upsert("planes", rows, uniqueness=lambda a, b: False)
        ts = t.commit()
    finally:
        t.close()
    t = PersistTxn(None, url, blob)
    try:  # a second upsert of N1 replaces its row: one row per key
        assert t.upsert("planes", pa.table({"tailnum": ["N1"], "seats": [3]}).to_batches()[0]) == 1
        t.commit()
        snap = t.client.snapshot_many({"planes": ts + 1})["planes"]
        got = {(r["tailnum"], r["seats"], r["_diff"]) for r in snap.to_pylist()}
        assert got == {("N1", 3, 1), ("N2", 4, 1)}
        cat = t.stash.collection("catalog", key="str", value="json")
        assert t.stash.peek_one(cat) == {"N1": {"seats": 2}}
    finally:
        t.close()


def test_upsert_takes_a_spark_dataframe(spark: Any, spark_store: Any) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc

    url, blob = spark_store.stash_url, spark_store.blob_uri
    key = pa.schema([pa.field("id", pa.int64(), False)])
    val = pa.schema([pa.field("name", pa.string())])
    with persist_txn(spark, url, blob) as txn:
        txn.client.open("people", key, val)
        txn.upsert("people", spark.createDataFrame([(1, "a"), (2, "b")], "id long, name string"))
    with persist_txn(spark, url, blob) as txn:
        txn.upsert("people", spark.createDataFrame([(2, "B")], "id long, name string"))
        txn.delete("people", pc.field("id") == 1)
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, blob, compaction="off")
        try:
            assert _rows(c, "people", 1) == Counter({(2, "B", 1, 1): 1})
        finally:
            c.close()


def _rows(c: PersistClient, shard: str, as_of: int) -> Counter[tuple[Any, ...]]:
    t = c.snapshot_many({shard: as_of})[shard]
    cols = [t.column(n).to_pylist() for n in t.column_names]
    return Counter(zip(*cols, strict=True))


@pytest.mark.parametrize("seed", [0, 1])
def test_prepare_write_by_chunk_equals_one_write_per_chunk(
    spark: Any, spark_store: Any, seed: int
) -> None:
    """The fast path (one Spark job for every chunk, then one transaction per chunk)
    gives the shard, time by time, what one ``txn.write`` per chunk gives."""
    import random

    from spark.persist_txn import prepare_write

    url, blob = spark_store.stash_url, spark_store.blob_uri
    rng = random.Random(seed)
    rows = []
    for i in range(rng.randint(200, 600)):
        month = rng.randint(1, 4)
        day = (month - 1) * 10 + rng.randint(0, 9)
        rows.append((i, month, day, rng.choice([None, "a", "bb", "ccc"]), rng.random()))
    schema = "id long, month int, t long, s string, x double"
    df = spark.createDataFrame(rows, schema).repartition(3)
    months = sorted({r[1] for r in rows})
    ts_fast, ts_ref = [], []
    with prepare_write(
        spark, url, blob, df, "fast", chunk_column="month", key_columns=["id"], time_column="t"
    ) as prepared:
        assert sorted(prepared.chunks) == months
        for m in months:
            with persist_txn(spark, url, blob) as txn:
                n = txn.write_prepared(prepared, m)
                assert n == sum(1 for r in rows if r[1] == m)
                txn.upsert_entries("catalog", {f"m{m}": n})
                ts_fast.append(txn.commit())
    for m in months:
        part = spark.createDataFrame([r for r in rows if r[1] == m], schema).repartition(3)
        with persist_txn(spark, url, blob) as txn:
            txn.write(part, "ref", key_columns=["id"], time_column="t")
            ts_ref.append(txn.commit())
    assert ts_fast == ts_ref
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, blob, compaction="off")
        try:
            assert c.inspect("fast").upper == c.inspect("ref").upper
            for t in sorted({r[2] for r in rows}):
                assert _rows(c, "fast", t) == _rows(c, "ref", t)
            cat = s.collection("catalog", key="str", value="json")
            assert set(s.peek_one(cat)) == {f"m{m}" for m in months}
        finally:
            c.close()


def test_prepare_write_deletes_the_chunks_no_transaction_took(spark: Any, spark_store: Any) -> None:
    from spark.persist_common import PersistSourceError
    from spark.persist_txn import prepare_write

    url, blob = spark_store.stash_url, spark_store.blob_uri
    root = spark_store.root / "blob"
    df = spark.createDataFrame(
        [(i, i % 3, "x" * 300) for i in range(3000)], "id long, c long, payload string"
    ).repartition(2)
    with pytest.raises(PersistSourceError, match="chunk column 'nope'"):
        prepare_write(spark, url, blob, df, "s", chunk_column="nope", key_columns=["id"])
    before = _parts(root)
    with prepare_write(spark, url, blob, df, "s", chunk_column="c", key_columns=["id"]) as p:
        assert _parts(root) - before  # parts were uploaded for the three chunks
        with persist_txn(spark, url, blob) as txn:
            assert txn.write_prepared(p, 0) == 1000
            ts = txn.commit()
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, blob, compaction="off")
        try:
            referenced = c.inspect("s").referenced_blob_keys()
            snap = c.snapshot_many({"s": ts})["s"]
            assert sorted(snap.column("id").to_pylist()) == list(range(0, 3000, 3))
        finally:
            c.close()
    left = _parts(root) - before
    assert len(left) == len(referenced)  # only the taken chunk's parts remain


def test_a_prepared_write_keeps_the_executors_leases_while_chunks_wait(tmp_path: Path) -> None:
    """The untaken chunks of a PreparedWrite stay committable however long they wait:
    the driver renews the executors' writer leases while it holds them (no Spark job is
    needed: the executors' bytes are made here with a writer of their own)."""
    import pyarrow as pa

    from persist import collect_garbage
    from persist.lease import LeaseKeeper
    from spark.persist_common import ShardTarget
    from spark.persist_txn import PreparedWrite

    now = [1_700_000_000.0]

    def clock() -> float:
        return now[0]

    url, blob = f"sqlite:///{tmp_path}/s.db", f"file://{tmp_path}/blob"
    ks, vs = pa.schema([("k", pa.int64())]), pa.schema([("v", pa.string())])
    stash = Stash.open(url, fenced=False)
    executor = PersistClient(
        stash, blob, compaction="off", inline_max_bytes=0, writer_lease_seconds=600, clock=clock
    )
    task = executor.open_writer("load", ks, vs)
    data = task.batch([(((1,), ("a",)), 0, 1)], 0, 1).into_transmittable()
    executor.close()
    prepared = PreparedWrite(ShardTarget(url, blob, "load"), ks, vs, {7: ([data], 1)})
    keeper = LeaseKeeper(clock=clock, thread=False)
    driver_stash = Stash.open(url, fenced=False)
    driver = PersistClient(driver_stash, blob, compaction="off", clock=clock)
    prepared.keep_leases(driver, driver_stash, keeper)
    other = PersistClient(stash, blob, compaction="off", clock=clock, reader_lease_seconds=36_000)
    _w, r = other.open("load", ks, vs)
    for step in range(72):  # two hours, GC (grace 600 s) every hour
        now[0] += 100
        keeper.run_due()
        if step % 36 == 35:
            collect_garbage(other, "load", grace_seconds=600)
    payloads, rows = prepared.take(7)
    w = other.open_writer("load", ks, vs)
    w.compare_and_append_batch([w.batch_from_transmittable(p) for p in payloads], 0, 1)
    assert rows == 1 and r.snapshot(0)["k"].to_pylist() == [1]
    assert keeper.registered() == 1  # the chunks' hold (the decoded batch was appended)
    now[0] += 3600  # past the next beat (a quarter of the shortest lease concerned)
    keeper.run_due()
    assert keeper.registered() == 0  # no chunk left untaken: the renewal ended
    prepared.discard()
    other.close()
    stash.close()
