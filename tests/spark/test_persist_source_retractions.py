"""Protects: Spark reads of shards with retractions equal a model, query after query.

Real Spark reads of persist shards with retractions: consolidated reads with pushed
value filters and several key ranges equal a Counter model; and a DataFrame loaded with
pushdown=true queried twice."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pyarrow as pa
import pytest

from tests.support.source_harness import build, model

pytestmark = [pytest.mark.spark, pytest.mark.adversarial]

KEYS = pa.schema([("k", pa.string())])
VALUES = pa.schema([("v", pa.int64())])

# Insertions in one append, retractions (some in other parts/runs, one summing to 2) later.
APPENDS = [
    [
        [(("a",), (1,), 0, 1), (("b",), (2,), 0, 1), (("c",), (1,), 1, 1), ((None,), (1,), 0, 1)],
        [(("d",), (2,), 0, 1), (("e",), (1,), 0, 2), (("a",), (2,), 1, 1)],
    ],
    [
        [(("a",), (1,), 0, -1), (("c",), (1,), 0, -1), ((None,), (1,), 1, -1)],
        [(("e",), (1,), 0, -1), (("d",), (2,), 2, -1), (("b",), (2,), 0, 1)],
    ],
]


def _load(spark: Any, store: Any, **opts: str) -> Any:
    r = spark.read.format("persist").option("stash", store.stash_url).option("blob", store.blob_uri)
    for k, v in opts.items():
        r = r.option(k, v)
    return r.load("t")


def test_filtered_key_range_read_equals_the_model(spark: Any, spark_store: Any) -> None:
    upper = build(
        spark_store.stash_url,
        spark_store.blob_uri,
        "t",
        KEYS,
        VALUES,
        APPENDS,
        compact_after=1,
        target_part_bytes=60,
    )
    exp = model(APPENDS, upper - 1)
    df = _load(spark, spark_store, pushdown="true", partitions="3").filter("v = 1")
    got = Counter({(r["k"], r["v"]): r["_diff"] for r in df.collect()})
    assert got == Counter({r: d for r, d in exp.items() if r[1] == 1})
    assert len(df.collect()) == len(got)
    part = _load(spark, spark_store, consolidate="partition", partition_bytes="1").filter("v > 0")
    summed: Counter = Counter()
    for r in part.collect():
        summed[(r["k"], r["v"])] += r["_diff"]
    assert Counter({r: d for r, d in summed.items() if d}) == exp


def test_pushdown_dataframe_queried_twice(spark: Any, spark_store: Any) -> None:
    """The source implements pushFilters; each query of a DataFrame must
    see the shard's rows that pass *its* filters. PersistPushdownReader's docstring
    admits that Spark reuses the reader a filtered query planned (pushed filters
    included) for a later query of the same DataFrame: the second query then returns
    the first query's rows."""
    upper = build(spark_store.stash_url, spark_store.blob_uri, "t", KEYS, VALUES, APPENDS)
    exp = model(APPENDS, upper - 1)
    df = _load(spark, spark_store, pushdown="true")
    assert df.filter("v = 1").count() == sum(1 for r in exp if r[1] == 1)
    # Expected: every row of the snapshot; a cached reader with v = 1 pushed gives fewer.
    assert df.count() == len(exp)
    assert df.filter("v = 2").count() == sum(1 for r in exp if r[1] == 2)
