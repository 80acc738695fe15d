"""Filter pushdown of the ``persist`` Spark source: which Spark filters the
reader takes, that planning skips the parts whose statistics exclude them (bytes
counted, parts never fetched), and that every read mode still returns exactly what
Spark's own filtering of the unfiltered read gives, also when one DataFrame serves a
filtered query and then an unfiltered one (on PySpark 4, which would reuse the filtered
query's plan, the reader takes no filter: ``spark_reuses_pushed_plans``).

The planning tests run the reader in this process as Spark's planning worker and tasks
would (plan, pickle, read each partition), with the reuse switch off, so that the
pruning they check is the one a PySpark that plans each query afresh gets.
"""

from __future__ import annotations

import datetime as dt
import decimal
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql.datasource import (
    DataSourceReader,
    EqualTo,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    IsNotNull,
    IsNull,
    LessThan,
    LessThanOrEqual,
    Not,
    StringStartsWith,
)

import spark.persist_reader as persist_reader
from persist import PersistClient
from persist.blob import open_blob
from spark.persist_planning import filter_expression, pushed_filter
from spark.persist_reader import spark_reuses_pushed_plans
from spark.persist_source import PersistDataSource
from stash import Antichain, Stash

pytestmark = pytest.mark.spark

KEYS = pa.schema([("k", pa.int64())])
VALUES = pa.schema(
    [
        ("v", pa.string()),
        ("f", pa.float64()),
        ("d", pa.date32()),
        ("m", pa.decimal128(9, 2)),
        ("ts", pa.timestamp("us", "UTC")),
    ]
)
COLUMNS = pa.schema([*KEYS, *VALUES])
N = 400


def _rows(n: int = N, start: int = 0) -> pa.Table:
    ks = list(range(start, start + n))
    return pa.table(
        {
            "k": pa.array(ks, pa.int64()),
            "v": [None if k % 7 == 0 else f"v{k % 13}" for k in ks],
            "f": [float(k % 5) for k in ks],
            "d": [dt.date(2024, 1, 1) + dt.timedelta(days=k % 30) for k in ks],
            "m": pa.array([decimal.Decimal(k) / 4 for k in ks], pa.decimal128(9, 2)),
            "ts": pa.array([k * 1_000_000 for k in ks], pa.timestamp("us", "UTC")),
        }
    )


def _write_shard(stash_url: str, blob_uri: str, shard: str) -> None:
    """Three appends in small parts (compaction off: several batches and runs), the
    third retracting some rows of the first."""
    stash = Stash.open(stash_url)
    client = PersistClient(
        stash, open_blob(blob_uri), compaction="off", inline_max_bytes=0, target_part_bytes=1500
    )
    try:
        w, r = client.open(shard, KEYS, VALUES)
        first = _rows()
        for t, (table, diff) in enumerate(
            [(first, 1), (_rows(200, start=N), 1), (first.slice(0, 50), -1)]
        ):
            n = table.num_rows
            table = table.append_column("_time", pa.array([t] * n, pa.int64()))
            table = table.append_column("_diff", pa.array([diff] * n, pa.int64()))
            w.compare_and_append(table, Antichain.from_elem(t), Antichain.from_elem(t + 1))
        r.expire()
        w.expire()
    finally:
        client.close()
        stash.close()


# ------------------------------------------------------------- filter conversion


def test_pushed_filter_takes_exact_filters_on_key_and_value_columns() -> None:
    assert pushed_filter(EqualTo(("k",), 5), COLUMNS) == ("eq", "k", (5,))
    assert pushed_filter(EqualTo(("K",), 5), COLUMNS) == ("eq", "k", (5,))  # Spark ignores case
    assert pushed_filter(GreaterThan(("v",), "a"), COLUMNS) == ("gt", "v", ("a",))
    assert pushed_filter(GreaterThanOrEqual(("d",), dt.date(2024, 1, 3)), COLUMNS) == (
        "ge",
        "d",
        (dt.date(2024, 1, 3),),
    )
    assert pushed_filter(LessThan(("m",), decimal.Decimal("1.5")), COLUMNS) == (
        "lt",
        "m",
        (decimal.Decimal("1.50"),),
    )
    assert pushed_filter(LessThanOrEqual(("k",), 9), COLUMNS) == ("le", "k", (9,))
    assert pushed_filter(In(("k",), (1, None, 3)), COLUMNS) == ("in", "k", (1, 3))
    assert pushed_filter(IsNull(("v",)), COLUMNS) == ("null", "v", ())
    assert pushed_filter(IsNotNull(("v",)), COLUMNS) == ("notnull", "v", ())


@pytest.mark.parametrize(
    "f",
    [
        EqualTo(("f",), 1.0),  # floats: Spark's NaN ordering differs from Arrow's
        EqualTo(("ts",), dt.datetime(2024, 1, 1)),  # timestamps: literal zone unclear
        EqualTo(("_diff",), 1),  # not a key or value column
        EqualTo(("nope",), 1),
        EqualTo(("a", "b"), 1),  # nested
        EqualTo(("k",), 2.5),  # not exactly an int64
        EqualTo(("k",), True),
        EqualTo(("k",), 2**70),
        EqualTo(("d",), dt.datetime(2024, 1, 1, 12)),
        EqualTo(("k",), None),
        EqualTo(("m",), decimal.Decimal("0.125")),  # more digits than the column
        Not(EqualTo(("k",), 1)),
        StringStartsWith(("v",), "v1"),
    ],
)
def test_pushed_filter_returns_the_rest_to_spark(f: Any) -> None:
    assert pushed_filter(f, COLUMNS) is None


def test_filter_expression_matches_spark_null_semantics() -> None:
    table = pa.table({"k": pa.array([1, None, 3], pa.int64())})
    cols = pa.schema([("k", pa.int64())])
    keep = table.filter(filter_expression([("in", "k", (1,))], cols))
    assert keep.column("k").to_pylist() == [1]  # a null k is not "in" anything
    keep = table.filter(filter_expression([("in", "k", ())], cols))
    assert keep.num_rows == 0  # k IN (NULL): never true
    keep = table.filter(filter_expression([("notnull", "k", ()), ("gt", "k", (1,))], cols))
    assert keep.column("k").to_pylist() == [3]


# ------------------------------------------------------------ planning pruning


@pytest.fixture
def plans_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader as it runs on a PySpark that plans each query's pushed filters anew."""
    monkeypatch.setattr(persist_reader, "spark_reuses_pushed_plans", lambda: False)


def _planned(
    stash_url: str, blob_uri: str, shard: str, filters: list[Any]
) -> tuple[Any, list[Any], list[Any]]:
    """Plan a pushdown read as Spark's planning worker would: (reader, the filters it
    returned to Spark, its partitions)."""
    source = PersistDataSource(
        {"stash": stash_url, "blob": blob_uri, "shard": shard, "pushdown": "true"}
    )
    reader = source.reader(source.schema())
    rest = list(reader.pushFilters(filters))
    return reader, rest, list(reader.partitions())


def _planned_bytes(
    stash_url: str, blob_uri: str, shard: str, filters: list[Any]
) -> tuple[int, list[Any]]:
    _, rest, partitions = _planned(stash_url, blob_uri, shard, filters)
    planned = sum(p.encoded_size_bytes for part in partitions for b in part.parts for p in b.parts)
    return planned, rest


@pytest.mark.usefixtures("plans_afresh")
def test_key_filter_plans_a_small_share_of_the_bytes(spark_store: Any) -> None:
    """A filter on 1% of the keys plans (hence fetches) at most 10% of the shard's
    bytes; filters the reader cannot apply come back to Spark."""
    _write_shard(spark_store.stash_url, spark_store.blob_uri, "p")
    total, rest = _planned_bytes(spark_store.stash_url, spark_store.blob_uri, "p", [])
    assert rest == []
    f_rest = Not(EqualTo(("k",), 1))
    some, rest = _planned_bytes(
        spark_store.stash_url,
        spark_store.blob_uri,
        "p",
        [GreaterThanOrEqual(("k",), 100), LessThan(("k",), 106), f_rest],
    )
    assert rest == [f_rest]
    assert 0 < some <= 0.10 * total, (some, total)


# --------------------------------------------------------------- Spark reads

QUERIES = [
    "k = 17",
    "k IN (3, 250, 420, 9999)",
    "k >= 390 AND k < 410",
    "k > 590",
    "v IS NULL",
    "v IS NOT NULL AND k <= 30",
    "v = 'v3' AND d >= DATE'2024-01-20'",
    "m < 2.5",
    "f = 1.0 AND k < 40",  # f goes back to Spark, k is pushed
    "ts > TIMESTAMP'1970-01-01 00:09:50+00:00'",  # back to Spark
    "NOT (k = 5) AND k < 10",
]


def _read(spark: Any, store: Any, **options: str) -> Any:
    """A fresh DataFrame of shard ``p`` (with ``pushdown=true`` unless told otherwise):
    PySpark reuses a DataFrame's planned reader, see PersistPushdownReader."""
    options = {"pushdown": "true", **options}
    r = spark.read.format("persist").option("stash", store.stash_url).option("blob", store.blob_uri)
    for k, v in options.items():
        r = r.option(k, v)
    return r.load("p")


def _collected(df: Any) -> list[tuple[Any, ...]]:
    return sorted((tuple(r) for r in df.collect()), key=repr)


def test_pushed_filters_give_what_spark_filtering_gives(spark: Any, spark_store: Any) -> None:
    """For each query and read mode: the pushed read equals Spark filtering the
    unfiltered read collected in memory (with partial diffs summed per row for the raw
    modes), and with consolidate=full equals ReadHandle.snapshot filtered by pyarrow."""
    _write_shard(spark_store.stash_url, spark_store.blob_uri, "p")
    assert spark.conf.get("spark.sql.python.filterPushdown.enabled") == "true"
    for mode, queries in (("full", QUERIES), ("none", QUERIES[2:5])):
        everything = _read(spark, spark_store, consolidate=mode, pushdown="false").toPandas()
        base = spark.createDataFrame(everything, schema=_read(spark, spark_store).schema)
        assert len(everything) >= N
        base.createOrReplaceTempView("base_rows")
        for q in queries:
            got = _collected(_read(spark, spark_store, consolidate=mode).where(q))
            want = _collected(spark.table("base_rows").where(q))
            assert got == want, (mode, q)
            assert mode == "none" or len(got) < N


def _read_in_process(reader: Any, partitions: list[Any]) -> list[tuple[Any, ...]]:
    """Every row a planned read yields, each partition read by a pickled copy of the
    reader (as Spark ships them to tasks)."""
    import pickle

    rows: list[tuple[Any, ...]] = []
    for part in partitions:
        task = pickle.loads(pickle.dumps(reader))
        for batch in task.read(pickle.loads(pickle.dumps(part))):
            rows += zip(*(c.to_pylist() for c in batch.columns), strict=True)
    return sorted(rows, key=repr)


@pytest.mark.usefixtures("plans_afresh")
def test_pruned_parts_are_never_fetched(spark_store: Any) -> None:
    """Deleting the blob parts whose statistics exclude a key filter does not disturb a
    pushed read of it (they are never fetched), while the unfiltered read needs them."""
    _write_shard(spark_store.stash_url, spark_store.blob_uri, "p")
    stash = Stash.open(spark_store.stash_url)
    blob = open_blob(spark_store.blob_uri)
    client = PersistClient(stash, blob, compaction="off")
    try:
        r = client.open_reader("p", KEYS, VALUES)
        batches = r.snapshot_batches(2)
        deleted = 0
        for b in batches:
            for p in b.parts:
                lo, hi = next((lo, hi) for n, lo, hi, _ in p.stats if n == "k")
                if p.key is not None and hi < 300:
                    blob.delete(p.key)
                    deleted += 1
        r.expire()
    finally:
        client.close()
        stash.close()
    assert deleted > 0
    url, uri = spark_store.stash_url, spark_store.blob_uri
    reader, rest, partitions = _planned(
        url, uri, "p", [GreaterThanOrEqual(("k",), 300), LessThan(("k",), 310)]
    )
    assert rest == []
    assert [row[0] for row in _read_in_process(reader, partitions)] == list(range(300, 310))
    reader, _, partitions = _planned(url, uri, "p", [])
    with pytest.raises(Exception, match="missing"):
        _read_in_process(reader, partitions)


def test_a_dataframe_queried_with_a_filter_then_without_gives_every_row(
    spark: Any, spark_store: Any
) -> None:
    """With pushdown=true, one DataFrame queried with a pushable filter, then with none,
    then with another filter gives each query its own rows (found by an adversarial
    review: PySpark 4 answered the unfiltered query with the filtered query's plan)."""
    _write_shard(spark_store.stash_url, spark_store.blob_uri, "p")
    df = _read(spark, spark_store)
    assert df.where("k = 117").count() == 1
    assert df.count() == N + 200 - 50
    assert df.where("k >= 390 AND k < 410").count() == 20
    assert df.count() == N + 200 - 50
    if spark_reuses_pushed_plans():  # the reader took nothing: Spark filtered
        plan = df.where("k = 117")._jdf.queryExecution().executedPlan().toString()
        assert any("Filter (" in line and "= 117)" in line for line in plan.splitlines()), plan


def test_default_reader_takes_no_filters_so_a_reused_dataframe_stays_whole(
    spark: Any, spark_store: Any
) -> None:
    """Without pushdown=true the reader takes no filters: a DataFrame queried with a
    filter and then without one gives every row the second time."""
    _write_shard(spark_store.stash_url, spark_store.blob_uri, "p")
    source = PersistDataSource(
        {"stash": spark_store.stash_url, "blob": spark_store.blob_uri, "shard": "p"}
    )
    assert not hasattr(type(source.reader(source.schema())), "pushFilters") or (
        type(source.reader(source.schema())).pushFilters is DataSourceReader.pushFilters
    )
    df = _read(spark, spark_store, pushdown="false")
    assert df.where("k = 117").count() == 1
    assert df.count() == N + 200 - 50
