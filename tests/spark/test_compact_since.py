"""Compaction after a since downgrade, on both merge paths: the merges' outputs are
consolidated at the since of the committed state read (not the since their requests were
made at), the Spark merge and persist's compactor write the same updates, and
``PersistTable.to_df(path="auto")`` then reads the compacted run natively."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest

from persist import HollowBatch, PersistClient, read_batches
from persist.parts import updates_schema
from persist.types import Description
from spark.jobs.compact import compact_shard
from stash import Antichain, Stash

pytestmark = pytest.mark.spark

KEYS = pa.schema([("k", pa.int64())])
VALUES = pa.schema([("v", pa.string())])
N = 200  # keys
UPPER = 10  # times 0..9, appended two at a time
SINCE = UPPER - 1


def _load(store: Any, shard: str) -> None:
    """Keys ``0..N-1`` inserted at time 0; at each later time ``t`` a fifth of them
    change value (old value retracted); appended in batches of two times each, then the
    since is downgraded to the last time."""
    with Stash.open(store.stash_url, fenced=False) as s:
        c = PersistClient(s, store.blob_uri, compaction="off", inline_max_bytes=0)
        try:
            w, r = c.open(shard, KEYS, VALUES)
            value = {k: "v0" for k in range(N)}
            for lo in range(0, UPPER, 2):
                rows = []
                for t in (lo, lo + 1):
                    for k in range(N):
                        if t == 0:
                            rows.append((((k,), ("v0",)), 0, 1))
                        elif k % 5 == t % 5:
                            rows.append((((k,), (value[k],)), t, -1))
                            value[k] = f"v{t}"
                            rows.append((((k,), (value[k],)), t, 1))
                w.compare_and_append(rows, lo, lo + 2)
            assert c.inspect(shard).trace.all_fueled_merge_reqs()  # made at since 0
            r.downgrade_since(SINCE)
            w.expire()
            r.expire()
        finally:
            c.close()


def _outputs(store: Any, shard: str) -> list[tuple[Description, Counter]]:
    """Each compacted batch (since ``SINCE``) of the shard: its description and its
    updates as stored (no time advanced on the way)."""
    with Stash.open(store.stash_url, fenced=False) as s:
        c = PersistClient(s, store.blob_uri, compaction="off")
        try:
            out = []
            for b in c.inspect(shard).trace.batches():
                if b.desc.since != Antichain.from_elem(SINCE):
                    continue
                raw = HollowBatch(Description(b.desc.lower, b.desc.upper), b.parts, b.len, b.runs)
                rows = read_batches(c.blob, [raw], updates_schema(KEYS, VALUES)).to_pylist()
                out.append(
                    (b.desc, Counter((r["k"], r["v"], r["_time"], r["_diff"]) for r in rows))
                )
            return out
        finally:
            c.close()


def _snapshot(store: Any, shard: str, as_of: int) -> Counter:
    with Stash.open(store.stash_url, fenced=False) as s:
        c = PersistClient(s, store.blob_uri, compaction="off")
        try:
            with c.open_reader(shard, KEYS, VALUES) as r:
                rows = r.snapshot(as_of).to_pylist()
        finally:
            c.close()
    return Counter({(row["k"], row["v"]): row["_diff"] for row in rows})


def test_both_merge_paths_consolidate_at_the_downgraded_since(spark: Any, spark_store: Any) -> None:
    """The same since-downgraded shard compacted on the driver (persist's compactor) and
    with Spark: the same output descriptions (since 9) and the same stored updates, each
    at the single time 9, one row per key."""
    for shard, min_bytes in (("local", 1 << 40), ("spark", 0)):
        _load(spark_store, shard)
        report = compact_shard(
            spark, spark_store.stash_url, spark_store.blob_uri, shard, min_spark_bytes=min_bytes
        )
        assert report.failed == 0 and report.not_applied == 0, report.errors
        assert report.applied >= 1
    assert report.spark_merges >= 1
    local, spark_out = _outputs(spark_store, "local"), _outputs(spark_store, "spark")
    assert local and [d for d, _ in local] == [d for d, _ in spark_out]
    assert [u for _, u in local] == [u for _, u in spark_out]
    for _, updates in local:
        assert {t for _k, _v, t, _d in updates} == {SINCE}
        assert set(updates.values()) == {1}  # each (k, v, t, d) once
        keys = Counter(k for k, _v, _t, _d in updates)
        assert set(keys.values()) == {1}, "a key holds more than one row"
    assert _snapshot(spark_store, "local", SINCE) == _snapshot(spark_store, "spark", SINCE)


def test_to_df_reads_a_since_downgraded_compaction_natively(
    spark: Any, spark_store: Any, caplog: Any
) -> None:
    """After ``spark.jobs.compact`` (through Spark) on a since-downgraded shard,
    ``to_df(path="auto")`` plans natively: nothing declined, the compacted run's parts
    all read by Spark's Parquet reader, no fallback logged, and it equals the snapshot."""
    from spark import PersistTable
    from spark.native_plan import plan_snapshot

    _load(spark_store, "n")
    report = compact_shard(
        spark, spark_store.stash_url, spark_store.blob_uri, "n", min_spark_bytes=0
    )
    assert report.failed == 0 and report.applied >= 1, report.errors
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        c = PersistClient(s, spark_store.blob_uri, compaction="off")
        try:
            st = c.inspect("n")
            run_keys = {
                p.key
                for b in st.trace.batches()
                if b.desc.since == Antichain.from_elem(SINCE)
                for p in b.parts
            }
            plan = plan_snapshot(c, "n", st.key_schema, st.value_schema, None, auto=True)
        finally:
            c.close()
    assert run_keys
    assert plan.declined is None
    assert run_keys <= {p.key for p in plan.direct}
    table = PersistTable.for_name(
        spark, "n", stash=spark_store.stash_url, blob=spark_store.blob_uri
    )
    with caplog.at_level(logging.INFO, logger="spark.table"):
        rows = table.to_df(path="auto").collect()
    assert "reads through the persist data source" not in caplog.text
    got = Counter({(r["k"], r["v"]): r["_diff"] for r in rows})
    assert len(got) == len(rows)
    assert got == _snapshot(spark_store, "n", SINCE)
