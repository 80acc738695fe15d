"""The ``persist`` Spark source: round trips, failures, races and streaming on real stores.

Every test runs against a SQLite stash and a local blob directory (``spark_store``) and
the session's one ``local[2]`` SparkSession.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist import PersistClient, collect_garbage
from spark import activate
from stash import Stash

pytestmark = pytest.mark.spark

SCHEMA = "id long, name string, score double, ok boolean, born date, at timestamp, amt decimal(10,2), t long"


def _opts(store: Any) -> dict[str, str]:
    return {"stash": store.stash_url, "blob": store.blob_uri}


def _read(spark: Any, store: Any, shard: str, **options: Any) -> Any:
    r = spark.read.format("persist").options(**_opts(store))
    for k, v in options.items():
        r = r.option(k, v)
    return r.load(shard)


def _write(df: Any, store: Any, shard: str, **options: Any) -> None:
    w = df.write.format("persist").options(**_opts(store)).mode("append")
    for k, v in options.items():
        w = w.option(k, v)
    w.save(shard)


def _naive(x: Any) -> Any:
    return x.replace(tzinfo=None) if isinstance(x, dt.datetime) else x


def _bag(rows: Any) -> Counter[tuple[Any, ...]]:
    return Counter(tuple(r) for r in rows)


def _blob_keys(store: Any) -> set[str]:
    """The store's blob keys, but its identity marker (no part of a shard)."""
    from persist.store_identity import MARKER_KEY

    root = Path(store.blob_uri[len("file://") :])
    keys = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    return {k for k in keys if not k.startswith(MARKER_KEY + "/")}


def _state(store: Any, shard: str) -> Any:
    with Stash.open(store.stash_url, fenced=False) as s:
        client = PersistClient(s, store.blob_uri, compaction="off")
        try:
            return client.inspect(shard)
        finally:
            client.close()


UTC = dt.UTC
ROWS = [
    (
        1,
        "ä-ß ✓",
        1.5,
        True,
        dt.date(2013, 1, 1),
        dt.datetime(2013, 1, 1, 5, tzinfo=UTC),
        Decimal("1.25"),
        0,
    ),
    (2, None, None, None, None, None, None, 0),
    (
        3,
        "",
        -0.5,
        False,
        dt.date(2013, 1, 2),
        dt.datetime(2013, 1, 2, 6, tzinfo=UTC),
        Decimal("0.00"),
        1,
    ),
    (
        3,
        "",
        -0.5,
        False,
        dt.date(2013, 1, 2),
        dt.datetime(2013, 1, 2, 6, tzinfo=UTC),
        Decimal("0.00"),
        1,
    ),
    (
        4,
        "d",
        4.0,
        True,
        dt.date(2013, 1, 3),
        dt.datetime(2013, 1, 3, 7, tzinfo=UTC),
        Decimal("-9.99"),
        2,
    ),
]


def test_round_trip_with_nulls_strings_and_retractions(spark: Any, spark_store: Any) -> None:
    df = spark.createDataFrame(ROWS, SCHEMA).repartition(2)
    _write(df, spark_store, "rt", key_columns="id", time_column="t")
    st = _state(spark_store, "rt")
    assert st.upper.as_option() == 3  # largest time + 1
    assert st.key_schema.names == ["id"]
    assert st.value_schema.names == ["name", "score", "ok", "born", "at", "amt"]

    # Spark returns timestamps as naive datetimes in the session time zone (UTC).
    data = [tuple(_naive(x) for x in r[:-1]) for r in ROWS]
    back = _read(spark, spark_store, "rt", expand="true")
    assert back.columns == ["id", "name", "score", "ok", "born", "at", "amt"]
    assert _bag(back.collect()) == _bag(data)

    # As of time 0 only the first two rows exist; as of 1 the duplicated row has diff 2.
    assert _bag(_read(spark, spark_store, "rt", as_of=0, expand="true").collect()) == _bag(data[:2])
    at1 = {r["id"]: r["_diff"] for r in _read(spark, spark_store, "rt", as_of=1).collect()}
    assert at1 == {1: 1, 2: 1, 3: 2}

    # Retract one copy of row 3 and the row with nulls at a later time (fixed time 5).
    retract = spark.createDataFrame(
        [(*ROWS[2][:-1], -1), (*ROWS[1][:-1], -1)], SCHEMA.replace(" t long", " d long")
    )
    _write(retract, spark_store, "rt", key_columns="id", time="5", diff_column="d")
    assert _state(spark_store, "rt").upper.as_option() == 6
    after = _read(spark, spark_store, "rt", expand="true").collect()
    assert _bag(after) == _bag([data[0], data[2], data[4]])
    # Time travel still sees the retracted rows before time 5.
    assert _bag(_read(spark, spark_store, "rt", as_of=4, expand="true").collect()) == _bag(data)

    # One partition per part (consolidate=partition): the diff-column form summed per
    # row is the same snapshot.
    from spark.persist_source import consolidated

    many = _read(spark, spark_store, "rt", consolidate="partition", partition_bytes="1")
    assert many.rdd.getNumPartitions() == len(_state(spark_store, "rt").batches()[0].parts) + len(
        [p for b in _state(spark_store, "rt").batches()[1:] for p in b.parts]
    )
    summed = {tuple(r[:-1]): r[-1] for r in consolidated(many).collect()}
    assert summed == {data[0]: 1, data[2]: 1, data[4]: 1}


def test_time_at_the_upper_and_errors(spark: Any, spark_store: Any) -> None:
    df = spark.createDataFrame([(1, "a"), (2, "b")], "k long, v string")
    _write(df, spark_store, "auto", key_columns="k")  # no time: lands at the upper (0)
    _write(df.limit(1), spark_store, "auto", key_columns="k")  # then at 1
    rows = _read(spark, spark_store, "auto", time_column="ts").collect()
    assert sorted(tuple(r) for r in rows) == [(1, "a", 1, 2), (2, "b", 1, 1)]
    assert _state(spark_store, "auto").upper.as_option() == 2

    with pytest.raises(Exception, match="append-only"):
        df.write.format("persist").options(**_opts(spark_store)).mode("overwrite").save("auto")
    with pytest.raises(Exception, match="before shard auto's upper"):
        _write(df, spark_store, "auto", key_columns="k", time="0")
    with pytest.raises(Exception, match="not before shard auto's upper"):
        _read(spark, spark_store, "auto", as_of="7").collect()
    with pytest.raises(Exception, match="does not exist"):
        _read(spark, spark_store, "nope").collect()
    with pytest.raises(Exception, match="column 'v' has type int64, shard auto stores string"):
        _write(
            spark.createDataFrame([(1, 2)], "k long, v long"), spark_store, "auto", key_columns="k"
        )


def test_failed_task_leaves_nothing_visible_and_gc_leaves_no_orphan(
    spark: Any, spark_store: Any, tmp_path: Path
) -> None:
    from pyspark.sql import functions as F

    base = spark.createDataFrame([(i, f"v{i}") for i in range(10)], "k long, v string")
    _write(base, spark_store, "fail", key_columns="k", time="0")
    before = _state(spark_store, "fail")
    marker = str(tmp_path / "first-task-done")

    @F.udf("long")
    def explode_in_second_partition(k: int) -> int:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if ctx is not None and ctx.partitionId() == 1 and k is not None:
            deadline = time.monotonic() + 30  # let the other task upload its batch first
            while not Path(marker).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            raise RuntimeError("injected task failure")
        if k == 99_999:  # the last row of the first partition
            Path(marker).touch()
        return k

    big = spark.range(0, 200_000, numPartitions=2).selectExpr("id as k", "cast(id as string) as v")
    failing = big.withColumn("k", explode_in_second_partition("k"))
    with pytest.raises(Exception, match="injected task failure"):
        _write(failing, spark_store, "fail", key_columns="k", time="1")

    after = _state(spark_store, "fail")
    assert after.upper == before.upper
    assert _read(spark, spark_store, "fail", expand="true").count() == 10
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        # The successful task's writer handed its batch off (to a driver commit that
        # never came): it is kept for the hand-off lease, 24 hours, and a live writer's
        # parts are never collected. GC as of after that lease.
        client = PersistClient(
            s, spark_store.blob_uri, compaction="off", clock=lambda: time.time() + 25 * 3600
        )
        try:
            collect_garbage(client, "fail", grace_seconds=0)
            referenced = client.inspect("fail").referenced_blob_keys()
        finally:
            client.close()
    assert _blob_keys(spark_store) == referenced


def test_two_racing_writes_both_land_once(spark: Any, spark_store: Any, tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    _write(
        spark.createDataFrame([(0, "seed")], "k long, v string"),
        spark_store,
        "race",
        key_columns="k",
    )
    gate = tmp_path / "gate"

    @F.udf("long")
    def wait_for_gate(k: int) -> int:
        deadline = time.monotonic() + 60
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return k

    # One task (one of the two cores) blocks; the racing write runs on the other.
    slow = (
        spark.createDataFrame([(1, "slow"), (2, "slow")], "k long, v string")
        .coalesce(1)
        .withColumn("k", wait_for_gate("k"))
    )
    errors: list[BaseException] = []

    def run_slow() -> None:
        activate(spark)  # Python data sources resolve through the thread's active session
        try:
            _write(slow, spark_store, "race", key_columns="k")
        except BaseException as e:  # reported below
            errors.append(e)

    th = threading.Thread(target=run_slow)
    th.start()
    # The slow write has planned (lower = upper 1) and its tasks are blocked: race it.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if spark.sparkContext.statusTracker().getActiveJobsIds():
            break
        time.sleep(0.05)
    _write(
        spark.createDataFrame([(3, "fast")], "k long, v string"),
        spark_store,
        "race",
        key_columns="k",
    )
    gate.touch()
    th.join(120)
    assert not th.is_alive() and not errors, [str(e)[:3000] for e in errors]

    rows = _read(spark, spark_store, "race", time_column="ts").collect()
    got = sorted((r["k"], r["v"], r["_diff"]) for r in rows)
    assert got == [(0, "seed", 1), (1, "slow", 1), (2, "slow", 1), (3, "fast", 1)]
    st = _state(spark_store, "race")
    assert st.upper.as_option() == 3  # seed at 0, fast at 1, slow retried at 2
    # Each append committed its batch once: parts on disk are exactly those referenced.
    assert _blob_keys(spark_store) == st.referenced_blob_keys()
    by_time = {
        r["k"]: r["ts"]
        for r in _read(spark, spark_store, "race", as_of=1, time_column="ts").collect()
    }
    assert by_time == {0: 1, 3: 1}


def test_streaming_read_sees_appends_after_start(spark: Any, spark_store: Any) -> None:
    _write(
        spark.createDataFrame([(1, "a")], "k long, v string"),
        spark_store,
        "stream",
        key_columns="k",
    )
    stream = (
        spark.readStream.format("persist")
        .options(**_opts(spark_store))
        .option("time_column", "ts")
        .load("stream")
    )
    q = stream.writeStream.format("memory").queryName("persist_stream_test").start()
    try:
        q.processAllAvailable()
        assert [tuple(r) for r in spark.table("persist_stream_test").collect()] == [(1, "a", 0, 1)]
        # Appends after the stream started, through persist directly and through Spark.
        with Stash.open(spark_store.stash_url, fenced=False) as s:
            client = PersistClient(s, spark_store.blob_uri, compaction="off")
            try:
                w = client.open_writer(
                    "stream", pa.schema([("k", pa.int64())]), pa.schema([("v", pa.string())])
                )
                w.compare_and_append([(((2,), ("b",)), 1, 1), (((1,), ("a",)), 1, -1)], 1, 2)
                w.expire()
            finally:
                client.close()
        _write(
            spark.createDataFrame([(3, "c")], "k long, v string"),
            spark_store,
            "stream",
            key_columns="k",
        )
        q.processAllAvailable()
        got = sorted(tuple(r) for r in spark.table("persist_stream_test").collect())
        assert got == [(1, "a", 0, 1), (1, "a", 1, -1), (2, "b", 1, 1), (3, "c", 2, 1)]
    finally:
        q.stop()
