"""``PersistTable.merge`` (:mod:`spark.merge`): the same merges as ``WriteHandle.merge``
give the same shard and the same metrics (hypothesis over the clause lists of
``tests/persist/test_merge_into.py``, whose SQL is both DuckDB's and Spark's), Column
conditions, bad input refused with nothing committed, and stored nanoseconds kept
exact although Spark evaluates in microseconds."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings

from persist import InvalidUsage, PersistClient
from spark import PersistTable
from stash import Stash
from tests.persist.test_merge_into import (
    KEY,
    VAL,
    build,
    clauses_st,
    live,
    model,
    rows,
    table_st,
)
from tests.reliability.campaign import runs

pytestmark = pytest.mark.spark


@pytest.fixture()
def stores(spark_store: Any) -> Iterator[tuple[Any, PersistClient]]:
    s = Stash.open(spark_store.stash_url, fenced=False)
    c = PersistClient(s, spark_store.blob_uri, compaction="off")
    try:
        yield spark_store, c
    finally:
        c.close()
        s.close()


@pytest.mark.sized
@given(target=table_st, source=table_st, clauses=clauses_st())
@settings(
    max_examples=runs(4, 40),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_spark_merges_equal_the_handle_and_the_model(
    spark: Any, stores: tuple[Any, PersistClient], target: Any, source: Any, clauses: Any
) -> None:
    store, client = stores
    name = f"s{uuid.uuid4().hex[:8]}"
    w_spark, r_spark = client.open(name, KEY, VAL)
    w_model, r_model = client.open(name + "m", KEY, VAL)
    for w in (w_spark, w_model):
        w.upsert(rows(target))
    table = PersistTable.for_name(spark, name, stash=store.stash_url, blob=store.blob_uri)
    src_df = spark.createDataFrame(rows(source))
    got = build(table.merge(src_df), clauses).execute()
    want = build(w_model.merge(rows(source)), clauses).execute()
    expected, (ins, upd, dele, same) = model(target, source, clauses)
    assert (got.num_target_rows_inserted, got.num_target_rows_updated) == (ins, upd)
    assert (got.num_target_rows_deleted, got.num_target_rows_unchanged) == (dele, same)
    assert got == want
    rows_spark = live(r_spark, got.time) if got.time >= 0 else {}
    assert rows_spark == (live(r_model, want.time) if want.time >= 0 else {})
    assert rows_spark == {k: (v, 1) for k, v in expected.items()}
    table.close()


def test_column_conditions_and_bad_input(spark: Any, stores: tuple[Any, PersistClient]) -> None:
    from pyspark.sql import functions as F

    store, client = stores
    w, r = client.open("t", KEY, VAL)
    w.upsert(rows({1: ("a", 1, None), 2: ("b", 2, None)}))
    table = PersistTable.for_name(spark, "t", stash=store.stash_url, blob=store.blob_uri)
    src = spark.createDataFrame(rows({1: ("x", 5, True), 3: ("c", 3, None)}))
    m = (
        table.merge(src, source_alias="s", target_alias="t")
        .when_matched_update(set={"n": F.col("t.n") + F.col("s.n")}, condition=F.col("s.flag"))
        .when_not_matched_insert_all()
        .execute()
    )
    assert (m.num_target_rows_updated, m.num_target_rows_inserted) == (1, 1)
    assert live(r, m.time)[1] == (("a", 6, None), 1)
    upper = w.fetch_recent_upper()
    for bad, match in [
        (lambda b: b.when_matched_update(set={"n": "t.nope"}), "nope"),
        (lambda b: b.when_not_matched_by_source_delete(condition="s.n > 1"), "t columns only"),
        (lambda b: b.when_matched_update(set={"n": "'abc'"}), "within its kind"),
    ]:
        with pytest.raises(InvalidUsage, match=match):
            bad(table.merge(src, source_alias="s", target_alias="t")).execute()
    assert w.fetch_recent_upper() == upper
    table.close()


def test_nanoseconds_stay_exact(spark: Any, stores: tuple[Any, PersistClient]) -> None:
    store, client = stores
    ks = pa.schema([pa.field("id", pa.int64(), False)])
    vs = pa.schema([("ts", pa.timestamp("ns")), ("n", pa.int64())])
    w, r = client.open("ns", ks, vs)
    w.upsert(
        pa.table(
            {
                "id": [1, 2],
                "ts": pa.array([1_000_000_001, 2_000_000_002], pa.timestamp("ns")),
                "n": [1, 2],
            }
        )
    )
    table = PersistTable.for_name(spark, "ns", stash=store.stash_url, blob=store.blob_uri)
    src = spark.createDataFrame(pa.table({"id": [1, 2], "n": [10, 2]}))
    m = (
        table.merge(src)
        .when_matched_update(set={"n": "source.n"}, condition="source.n <> target.n")
        .execute()
    )
    assert (m.num_target_rows_updated, m.num_target_rows_unchanged) == (1, 0)
    got = r.snapshot(m.time).sort_by("id")
    assert got.column("ts").cast(pa.int64()).to_pylist() == [1_000_000_001, 2_000_000_002]
    assert got.column("n").to_pylist() == [10, 2]
    assert got.column("_diff").to_pylist() == [1, 1]
    table.close()
