"""Protects: ``PersistTable.to_df`` gives ``ReadHandle.snapshot`` on both read paths.

A differential test of the native path (Spark's Parquet reader over the parts that need
no consolidation, the tail merged exactly) and the Python path (``format("persist")``)
against ``ReadHandle.snapshot``, on a shard with a compacted run, runs with retractions,
inline and blob parts, three schema versions (a column added, a type widened) and a
since downgrade; ``history``, ``compact`` and ``gc``; bad input."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from persist import PersistClient
from spark.persist_common import PersistSourceError
from stash import Stash

pytestmark = pytest.mark.spark

KEYS = pa.schema([("k", pa.int64())])
V0 = pa.schema([("v", pa.string()), ("w", pa.int32())])
V1 = pa.schema([("v", pa.string()), ("w", pa.int32()), ("x", pa.float64())])
V2 = pa.schema([("v", pa.string()), ("w", pa.int64()), ("x", pa.float64())])
N = 300


def _rows(keys: list[int], tag: str, schema: pa.Schema) -> pa.Table:
    cols: dict[str, Any] = {"k": pa.array(keys, pa.int64())}
    cols["v"] = pa.array([None if k % 11 == 0 else f"{tag}{k}" for k in keys], pa.string())
    cols["w"] = pa.array([k % 7 for k in keys], schema.field("w").type)
    if "x" in schema.names:
        cols["x"] = pa.array([k / 4 for k in keys], pa.float64())
    return pa.table(cols, schema=pa.schema(list(KEYS) + list(schema)))


def build(store: Any, shard: str = "t") -> int:
    """A shard whose snapshot needs every kind of read: one big single-time run of blob
    parts (the bulk load at time 0), then, with the since held at 3, upserts and deletes
    (retractions of bulk rows) at times 1..3 that compaction merges into single-time runs
    overlapping the bulk, inline parts, a value column added at 4 and a type widened at
    5, and an uncompacted tail. Returns the upper."""
    with Stash.open(store.stash_url, fenced=False) as s:
        bulk = PersistClient(
            s, store.blob_uri, compaction="off", inline_max_bytes=0, target_part_bytes=1500
        )
        small = PersistClient(s, store.blob_uri, compaction="off", target_part_bytes=1500)
        try:
            w, r = bulk.open(shard, KEYS, V0)
            bulk_rows = _rows(list(range(N)), "v", V0)
            bulk_rows = bulk_rows.append_column("_time", pa.array([0] * N, pa.int64()))
            w.append(bulk_rows.append_column("_diff", pa.array([1] * N, pa.int64())), 0, 1)
            r.downgrade_since(3)
            w.upsert(_rows([1, 51, 299, 400], "a", V0))
            w.delete(pc.field("k") == 7)
            w2, r2 = small.open(shard, KEYS, V0)
            w2.upsert(_rows([2, 52, 401], "b", V0))  # inline parts
            bulk.compactor.compact_once(shard)
            w1, r1 = small.open(shard, KEYS, V1)
            w1.upsert(_rows([3, 53, 402], "c", V1))
            w1.delete(pc.field("k") == 60)
            wb, rb = bulk.open(shard, KEYS, V2)
            wb.upsert(_rows([4, 54, 251, 403], "d", V2))
            wb.delete(pc.field("k") == 1)
            for h in (w, r, w2, r2, w1, r1, wb, rb):
                h.expire()
            return int(bulk.inspect(shard).upper.as_option())
        finally:
            small.close()
            bulk.close()


def snapshot(store: Any, as_of: int, shard: str = "t") -> Counter:
    with Stash.open(store.stash_url, fenced=False) as s:
        c = PersistClient(s, store.blob_uri, compaction="off")
        try:
            st = c.inspect(shard)
            r = c.open_reader(shard, st.key_schema, st.value_schema)
            try:
                t = r.snapshot(as_of)
            finally:
                r.expire()
        finally:
            c.close()
    names = [n for n in t.column_names if n not in ("_time", "_diff")]
    return Counter({tuple(row[n] for n in names): row["_diff"] for row in t.to_pylist()})


def collected(df: Any) -> Counter:
    rows = df.collect()
    names = [n for n in df.columns if n != "_diff"]
    got = Counter({tuple(r[n] for n in names): r["_diff"] for r in rows})
    assert len(rows) == len(got), "a (key, value) appears twice"
    return got


@pytest.fixture
def table(spark: Any, spark_store: Any) -> Any:
    from spark import PersistTable

    build(spark_store)
    return PersistTable.for_name(spark, "t", stash=spark_store.stash_url, blob=spark_store.blob_uri)


def test_both_paths_equal_the_snapshot(table: Any, spark_store: Any) -> None:
    from spark.native_plan import plan_snapshot

    with table.client() as c:
        st = c.inspect("t")
        upper = st.upper.as_option()
        plan = plan_snapshot(c, "t", st.key_schema, st.value_schema, None)
    # The bulk run is read by Spark, some of it merged with the tail.
    assert plan.direct and any(p.touched for p in plan.direct)
    assert any(not p.touched for p in plan.direct) and plan.tail is not None
    for as_of in (3, 5, upper - 1):  # the since; a retraction and a widened schema; last
        want = snapshot(spark_store, as_of)
        for path in ("native", "python"):
            assert collected(table.to_df(as_of=as_of, path=path)) == want, (path, as_of)
    assert collected(table.to_df()) == snapshot(spark_store, upper - 1)


def test_spark_merges_touched_parts_beyond_the_driver_limit(
    table: Any, spark_store: Any, monkeypatch: Any
) -> None:
    import spark.native_plan as native_plan

    monkeypatch.setattr(native_plan, "DRIVER_MERGE_MAX_BYTES", 0)
    with table.client() as c:
        st = c.inspect("t")
        plan = native_plan.plan_snapshot(c, "t", st.key_schema, st.value_schema, 5)
    assert plan.merged is None and any(p.touched for p in plan.direct)
    assert collected(table.to_df(as_of=5, path="native")) == snapshot(spark_store, 5)


def test_native_merges_a_tail_of_null_keys_exactly(spark: Any, spark_store: Any) -> None:
    """Key columns with nulls: a tail retracting and re-adding rows of null keys (and a
    key whose rows it all retracts) is merged null-safely, as consolidation matches
    nulls, on both paths and in the driver merge and Spark merge."""
    import spark.native_plan as native_plan
    from spark import PersistTable

    keys = pa.schema([("k", pa.int64()), ("j", pa.string())])
    values = pa.schema([("v", pa.int64())])
    ks = [None if i % 5 == 0 else i for i in range(200)]
    js = [None if i % 3 == 0 else f"j{i % 4}" for i in range(200)]

    def upd(rows: list[tuple[Any, Any, int]], time: int, diff: int) -> pa.Table:
        return pa.table(
            {
                "k": pa.array([r[0] for r in rows], pa.int64()),
                "j": pa.array([r[1] for r in rows], pa.string()),
                "v": pa.array([r[2] for r in rows], pa.int64()),
                "_time": pa.array([time] * len(rows), pa.int64()),
                "_diff": pa.array([diff] * len(rows), pa.int64()),
            }
        )

    bulk = sorted({(k, j) for k, j in zip(ks, js, strict=True)}, key=str)
    rows = [(k, j, 1) for k, j in bulk]
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        c = PersistClient(
            s, spark_store.blob_uri, compaction="off", inline_max_bytes=0, target_part_bytes=400
        )
        try:
            w = c.open_writer("nk", keys, values)
            w.append(upd(rows, 0, 1), 0, 1)
            nulls = [r for r in rows if r[0] is None or r[1] is None][:6]
            w.append(upd(nulls, 1, -1), 1, 2)  # retract rows of null keys
            w.append(upd([(k, j, 2) for k, j, _v in nulls[:4]], 2, 1), 2, 3)  # re-add two
            w.append(upd([rows[-1]], 3, -1), 3, 4)  # a non-null key wholly retracted
            w.expire()
        finally:
            c.close()
    t = PersistTable.for_name(spark, "nk", stash=spark_store.stash_url, blob=spark_store.blob_uri)
    want = snapshot(spark_store, 3, shard="nk")
    with t.client() as c:
        plan = native_plan.plan_snapshot(c, "nk", keys, values, 3)
    assert plan.merged is not None and plan.tail_keys is not None
    assert any(col.null_count for col in plan.tail_keys.columns)
    for path in ("native", "python"):
        assert collected(t.to_df(as_of=3, path=path)) == want, path
    limit = native_plan.DRIVER_MERGE_MAX_BYTES
    native_plan.DRIVER_MERGE_MAX_BYTES = 0
    try:
        assert collected(t.to_df(as_of=3, path="native")) == want
    finally:
        native_plan.DRIVER_MERGE_MAX_BYTES = limit


def test_the_kept_planning_client_sees_other_processes_commits(
    table: Any, spark_store: Any
) -> None:
    """The client a table keeps between reads caches a state version; another process
    appends, compacts and downgrades the since under it: the next read plans on the
    committed state, not on the cache."""
    import os
    import subprocess
    import sys
    import textwrap

    first = collected(table.to_df(path="native"))
    code = textwrap.dedent(
        f"""
        import pyarrow as pa
        from persist import PersistClient
        from stash import Stash
        with Stash.open({spark_store.stash_url!r}, fenced=False) as s:
            c = PersistClient(s, {spark_store.blob_uri!r}, compaction="off")
            st = c.inspect("t")
            w, r = c.open("t", st.key_schema, st.value_schema)
            w.upsert(pa.table({{"k": [5, 999], "v": ["other", "new"], "w": [1, 2],
                                "x": [0.5, 1.5]}}, schema=pa.schema(list(st.key_schema)
                                + list(st.value_schema))))
            r.downgrade_since(w.fetch_recent_upper().as_option() - 1)
            c.compactor.compact_once("t")
            w.expire(); r.expire(); c.close()
        """
    )
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    with table.client() as c:
        upper = c.inspect("t").upper.as_option()
    got = collected(table.to_df(path="native"))
    assert got == snapshot(spark_store, upper - 1) != first
    assert got[(999, "new", 2, 1.5)] == 1
    table.close()  # a closed table opens a new client on its next read
    assert collected(table.to_df(path="native")) == got
    with table as t:
        assert collected(t.to_df(path="native")) == got


def test_an_unchanged_shard_reuses_its_plan_and_every_change_makes_a_new_one(
    table: Any, spark_store: Any
) -> None:
    """A read whose plan has the last one's identity (read time, schemas, listed
    batches) returns the last DataFrame: lease-only versions change none of them.  New
    data, a compaction, a schema version or another ``as_of`` make a new plan, decided
    on the state version just read; the reused plan still registers a reader, so GC
    spares its parts while Spark reads them."""
    first = table.to_df(path="native")
    assert table.to_df(path="native") is first
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        c = PersistClient(s, spark_store.blob_uri, compaction="off")
        try:
            st = c.inspect("t")
            upper = int(st.upper.as_option())
            c.open_reader("t", st.key_schema, st.value_schema).expire()  # lease versions
            readers = set(c.inspect("t").readers)
            assert table.to_df(path="native") is first
            assert set(c.inspect("t").readers) - readers, "the reused plan registered no reader"
            assert collected(first) == snapshot(spark_store, upper - 1)
            older = table.to_df(as_of=upper - 2, path="native")
            assert older is not first
            assert collected(older) == snapshot(spark_store, upper - 2)
            assert table.to_df(path="native") is not older  # the last plan is the older one

            w, r = c.open("t", st.key_schema, st.value_schema)
            w.upsert(
                pa.table(
                    {"k": [5, 999], "v": ["x", "y"], "w": [1, 2], "x": [0.5, 1.5]},
                    schema=pa.schema(list(st.key_schema) + list(st.value_schema)),
                )
            )
            appended = table.to_df(path="native")
            assert collected(appended) == snapshot(spark_store, upper) != collected(first)

            r.downgrade_since(upper)
            c.compactor.compact_once("t")
            compacted = table.to_df(path="native")
            assert compacted is not appended
            assert collected(compacted) == collected(appended)

            v3 = pa.schema([*st.value_schema, ("y", pa.string())])
            w3 = c.open_writer("t", st.key_schema, v3)  # a schema version, no data
            evolved = table.to_df(path="native")
            assert "y" in evolved.columns and "y" not in compacted.columns
            for h in (w, r, w3):
                h.expire()
        finally:
            c.close()


def test_threads_share_a_table_while_one_closes_it(table: Any, spark_store: Any) -> None:
    """Threads read one table natively while another closes its planning client again
    and again: every read gives the snapshot, none fails on a client closed under it."""
    from concurrent.futures import ThreadPoolExecutor

    want = snapshot(spark_store, 5)
    stop = False

    def closer() -> int:
        n = 0
        while not stop:
            table.close()
            n += 1
        return n

    def read(_i: int) -> Counter:
        return collected(table.to_df(as_of=5, path="native"))

    with ThreadPoolExecutor(4) as pool:
        closing = pool.submit(closer)
        try:
            got = list(pool.map(read, range(6)))
        finally:
            stop = True
        assert closing.result() > 0
    assert all(g == want for g in got)


def test_columns_and_filters_reach_both_paths(table: Any, spark_store: Any) -> None:
    want: Counter = Counter()
    for (k, _v, w, _x), d in snapshot(spark_store, 5).items():
        if k < 100 and w != 3:
            want[(k, w)] += d
    for path in ("native", "python"):
        df = table.to_df(as_of=5, columns=["k", "w"], path=path).where("k < 100 AND w != 3")
        assert df.columns == ["k", "w", "_diff"]
        rows = Counter()
        for r in df.collect():
            rows[(r["k"], r["w"])] += r["_diff"]
        assert rows == want, path


def test_native_plan_is_pushed_to_parquet(table: Any) -> None:
    plan = table.to_df(path="native").where("k = 5")._jdf.queryExecution().executedPlan().toString()
    assert "FileScan parquet" in plan and "PushedFilters" in plan and "EqualTo(k,5)" in plan


def test_since_downgrade_and_bad_as_of(table: Any, spark_store: Any) -> None:
    with table.client() as c:
        st = c.inspect("t")
        r = c.open_reader("t", st.key_schema, st.value_schema)
        r.downgrade_since(6)
        try:
            for path in ("native", "python"):
                with pytest.raises(PersistSourceError, match="before shard t's since"):
                    table.to_df(as_of=5, path=path)
            c.compactor.compact_once("t")
            want = snapshot(spark_store, 6)
            for path in ("native", "python"):
                assert collected(table.to_df(as_of=6, path=path)) == want
        finally:
            r.expire()
    with pytest.raises(PersistSourceError, match="not before shard t's upper"):
        table.to_df(as_of=99)


def test_python_path_dataframe_stays_usable_for_a_lease(table: Any, spark_store: Any) -> None:
    """A DataFrame taken on the Python path, then another reader moves the since past
    its time and compaction runs: it still collects its rows (the data source plans
    again on each action; before the fix it raised a since violation)."""
    want = snapshot(spark_store, 3)
    df = table.to_df(as_of=3, path="python")
    with table.client() as c:
        st = c.inspect("t")
        r = c.open_reader("t", st.key_schema, st.value_schema)
        try:
            r.downgrade_since(st.upper.as_option() - 1)
            c.compactor.compact_once("t")
            assert collected(df) == want
        finally:
            r.expire()


def test_history_compact_and_gc(table: Any, spark_store: Any) -> None:
    hist = table.versions().collect()
    assert [r["seqno"] for r in hist] == sorted((r["seqno"] for r in hist), reverse=True)
    appends = [r for r in hist if r["operation"] == "append"]
    assert appends and all(r["upper"] == r["lower"] + 1 for r in appends)
    assert all(r["rows_added"] > 0 and r["bytes_added"] > 0 for r in appends)
    before = snapshot(spark_store, 5)
    report = table.compact()
    assert report.failed == 0
    g = table.gc(grace_seconds=0)
    assert g.failed == [] or not g.failed
    assert collected(table.to_df(as_of=5, path="native")) == before


def test_bad_input_raises_naming_the_rule(spark: Any, spark_store: Any, table: Any) -> None:
    from spark import PersistTable

    with pytest.raises(PersistSourceError, match="shard nope does not exist"):
        PersistTable.for_name(spark, "nope", stash=spark_store.stash_url, blob=spark_store.blob_uri)
    with pytest.raises(PersistSourceError, match="exists with key schema"):
        PersistTable.create(
            spark, "t", KEYS, V1, stash=spark_store.stash_url, blob=spark_store.blob_uri
        )
    with pytest.raises(PersistSourceError, match="must be a pyarrow.Schema"):
        PersistTable.create(
            spark, "u", "k int", V0, stash=spark_store.stash_url, blob=spark_store.blob_uri
        )
    with pytest.raises(PersistSourceError, match="path must be one of"):
        table.to_df(path="fast")
    with pytest.raises(PersistSourceError, match="not key or value columns"):
        table.to_df(columns=["k", "nope"])
    with pytest.raises(PersistSourceError, match="as_of must be an int"):
        table.to_df(as_of="3")
    mem = PersistTable(spark, "t", spark_store.stash_url, "memory://x")
    with pytest.raises(PersistSourceError, match="cannot be read natively.*memory"):
        mem.to_df(path="native")


def test_create_then_write_then_read(spark: Any, spark_store: Any) -> None:
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from spark import PersistTable

    keys = StructType([StructField("id", LongType())])
    values = StructType([StructField("name", StringType())])
    t = PersistTable.create(
        spark, "people", keys, values, stash=spark_store.stash_url, blob=spark_store.blob_uri
    )
    assert (
        PersistTable.create(
            spark, "people", keys, values, stash=spark_store.stash_url, blob=spark_store.blob_uri
        ).shard
        == "people"
    )
    assert t.to_df().collect() == []
    with t.client() as c:
        w = c.open_writer("people", *t.schemas())
        w.append([(((1,), ("ann",)), 0, 1), (((2,), ("bob",)), 0, 1)], 0, 1)
        w.expire()
    assert collected(t.to_df(path="native")) == Counter({(1, "ann"): 1, (2, "bob"): 1})


def test_auto_path_logs_why(spark: Any, spark_store: Any, caplog: Any) -> None:
    from spark import PersistTable

    with Stash.open(spark_store.stash_url, fenced=False) as s:
        c = PersistClient(s, spark_store.blob_uri, compaction="off")
        try:
            w, r = c.open("u", KEYS, pa.schema([("d", pa.duration("s"))]))
            w.append([(((1,), (5,)), 0, 1)], 0, 1)
            w.expire()
            r.expire()
        finally:
            c.close()
    t = PersistTable.for_name(spark, "u", stash=spark_store.stash_url, blob=spark_store.blob_uri)
    with caplog.at_level(logging.INFO, logger="spark.table"):
        assert len(t.to_df().collect()) == 1
    reason = f"column 'd' is {pa.duration('s')}"  # the Arrow type the log line names
    assert reason in caplog.text


def test_row_changes_delegate(table: Any, spark: Any) -> None:
    df = spark.createDataFrame([(5, "z", 1, 0.5)], "k long, v string, w long, x double")
    table.upsert(df)
    got = {r["k"]: r["v"] for r in table.to_df().collect()}
    assert got[5] == "z"
    table.update("k = 5", {"v": "upper(v)"})
    assert {r["k"]: r["v"] for r in table.to_df().collect()}[5] == "Z"
    table.delete("k = 5")
    assert 5 not in {r["k"] for r in table.to_df().collect()}


def test_s3_blob_takes_the_python_path_without_hadoop_aws(spark: Any) -> None:
    """Hadoop's core-default.xml defines fs.s3a.* options in every session: they alone do
    not make s3a:// readable. Without hadoop-aws on the class path (PySpark ships none)
    an S3 blob is not read natively, and the reason says so."""
    from spark.native_read import _s3a_unreadable

    why = _s3a_unreadable(spark)
    assert why is not None and "hadoop-aws" in why and "class path" in why


def test_native_spark_read_agrees_with_to_duckdb(table: Any, spark: Any, spark_store: Any) -> None:
    """The native Spark path and ``Table.to_duckdb`` plan with one rule
    (``persist/direct_plan.py``) and read the same rows: on the shard of three schema
    versions (its old-version parts go through Arrow in DuckDB) at the since, at a
    retraction under a widened schema and at the latest time; and on a one-schema shard
    whose bulk run DuckDB scans while persist merges the upserted and deleted keys."""
    import duckdb

    from spark import PersistTable

    with table.client() as c:
        upper = c.inspect("t").upper.as_option()
        t = c.table("t")
        for as_of in (3, 5, upper - 1):
            rows = t.to_duckdb(as_of=as_of).fetchall()
            assert Counter(rows) == collected(table.to_df(as_of=as_of, path="native")), as_of
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        c = PersistClient(
            s, spark_store.blob_uri, compaction="off", inline_max_bytes=0, target_part_bytes=1500
        )
        try:
            m = c.create_table("m", pa.schema([*KEYS, *V0]), key=["k"])
            m.append(_rows(list(range(N)), "v", V0))
            m.upsert(_rows([5, 150, 400], "u", V0))
            m.delete(pc.field("k") == 299)
            plan = str(m.to_duckdb(duckdb.connect()).explain()).upper()
            assert "PARQUET" in plan and "ARROW" in plan  # a mixed read
            rows = Counter(m.to_duckdb().fetchall())
        finally:
            c.close()
    pt = PersistTable.for_name(spark, "m", stash=spark_store.stash_url, blob=spark_store.blob_uri)
    with pt:
        assert rows == collected(pt.to_df(path="native"))


def test_readonly_reads_write_nothing(spark: Any, spark_store: Any) -> None:
    """``PersistTable.for_name(..., readonly=True)``: both read paths and ``history``
    over a readonly stash give the snapshot and leave the shard's seqno where it was (no
    reader lease, no state version)."""
    from spark import PersistTable

    upper = build(spark_store)
    want, want5 = snapshot(spark_store, upper - 1), snapshot(spark_store, 5)

    def seqno() -> int:
        with Stash.open(spark_store.stash_url, mode="readonly") as s:
            c = PersistClient(s, spark_store.blob_uri, compaction="off")
            try:
                return int(c.inspect("t").seqno)
            finally:
                c.close()

    before = seqno()
    with PersistTable.for_name(
        spark, "t", stash=spark_store.stash_url, blob=spark_store.blob_uri, readonly=True
    ) as ro:
        assert collected(ro.to_df(path="native")) == want
        assert collected(ro.to_df(path="python")) == want
        assert collected(ro.to_df(as_of=5, path="native")) == want5
        assert ro.history().count() > 0
    assert seqno() == before


def test_operating_calls_delegate_to_persist_table(spark: Any, spark_store: Any) -> None:
    """``details``, ``optimize``, ``restore``, ``set_retention`` and ``vacuum`` of
    ``spark.PersistTable`` are ``persist.Table``'s: the same details, the same rows after
    them, and history names each operation; on a readonly table a write is refused
    before anything is committed."""
    import datetime as dt

    from spark import PersistTable

    schema = pa.schema([*KEYS, *V0])
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        c = PersistClient(s, spark_store.blob_uri, compaction="off")
        try:
            t = c.create_table("ops", schema, key=["k"])
            t.append(_rows([1, 2, 3], "a", V0))
            t.upsert(_rows([2], "b", V0))
            first = t.to_arrow(as_of=0)
        finally:
            c.close()
    url, blob = spark_store.stash_url, spark_store.blob_uri
    with PersistTable.for_name(spark, "ops", stash=url, blob=blob) as pt:
        with Stash.open(url, fenced=False) as s:
            c = PersistClient(s, blob, compaction="off")
            try:
                assert pt.details() == c.table("ops").details()
            finally:
                c.close()
        assert pt.optimize().batches_after == 1
        changes = pt.restore(0)
        assert (changes.inserted, changes.retracted) == (1, 1)
        pt.set_retention(dt.timedelta(days=7))
        assert pt.vacuum().since is not None
        ops = [r["operation"] for r in pt.history().collect()]
        assert ops[0] == "retention"
        assert [o for o in ops if o != "retention"][:2] == ["restore", "optimize"]
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, blob, compaction="off")
        try:
            assert c.table("ops").to_arrow() == first
            seqno = c.inspect("ops").seqno
        finally:
            c.close()
    ro = PersistTable.for_name(spark, "ops", stash=url, blob=blob, readonly=True)
    assert ro.details()["upper"] is not None
    with pytest.raises(Exception, match="readonly"):
        ro.restore(1)  # 2 -> "b" again: a change, refused
    with Stash.open(url, mode="readonly") as s:
        c = PersistClient(s, blob, compaction="off")
        try:
            assert c.inspect("ops").seqno == seqno
        finally:
            c.close()
