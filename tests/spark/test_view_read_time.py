"""When a temporary view (or a DataFrame) of the ``persist`` source sees new writes, on
the PySpark this project runs (4.3).

PySpark 4 keeps the scan a query of a Python data source planned (the reader and its
read time) on the view's relation and reuses it for a later query that pushes no filter;
a query with a ``WHERE`` clause is planned afresh (Spark offers the source its filters),
and the scan it makes is then the one later unfiltered queries reuse. So an unfiltered
query reads at the time of the last query that was planned, not at the latest time:
neither "fixed by the first query" nor "always the latest" holds. Making the view again
(``CREATE OR REPLACE TEMPORARY VIEW``), or a new ``spark.read...load()``, reads the
latest time. These tests pin that behaviour so the user guide's account of it can be
trusted; if a PySpark upgrade changes it, they fail and the guide must change too.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.spark


def _write(spark: Any, store: Any, rows: list[tuple[int, str]]) -> None:
    (
        spark.createDataFrame(rows, "id long, carrier string")
        .write.format("persist")
        .option("stash", store.stash_url)
        .option("blob", store.blob_uri)
        .option("key_columns", "id")
        .mode("append")
        .save("flights")
    )


def _ids(spark: Any, query: str) -> list[int]:
    return sorted(r[0] for r in spark.sql(query).collect())


def test_view_reads_at_the_time_of_its_last_planned_query(spark: Any, spark_store: Any) -> None:
    _write(spark, spark_store, [(1, "AA"), (2, "UA")])  # time 0
    spark.sql(
        "CREATE OR REPLACE TEMPORARY VIEW view_time USING persist OPTIONS "
        f"(stash '{spark_store.stash_url}', blob '{spark_store.blob_uri}', shard 'flights')"
    )
    everything = "SELECT id FROM view_time"
    assert _ids(spark, everything) == [1, 2]

    spark.sql("INSERT INTO view_time VALUES (3, 'DL', 1)")  # time 1, through the view
    assert _ids(spark, everything) == [1, 2]  # the first query's scan is reused
    assert _ids(spark, "SELECT id FROM view_time WHERE id > 0") == [1, 2, 3]  # planned anew
    assert _ids(spark, everything) == [1, 2, 3]  # and reused from then on

    _write(spark, spark_store, [(4, "B6")])  # time 2, from outside the view
    assert _ids(spark, everything) == [1, 2, 3]
    assert _ids(spark, "SELECT id FROM view_time WHERE id > 0") == [1, 2, 3, 4]

    _write(spark, spark_store, [(5, "WN")])  # time 3
    spark.sql(
        "CREATE OR REPLACE TEMPORARY VIEW view_time USING persist OPTIONS "
        f"(stash '{spark_store.stash_url}', blob '{spark_store.blob_uri}', shard 'flights')"
    )
    assert _ids(spark, everything) == [1, 2, 3, 4, 5]  # made again: the latest time
    spark.catalog.dropTempView("view_time")


def test_dataframe_reuses_its_first_scan_until_a_filtered_query(
    spark: Any, spark_store: Any
) -> None:
    _write(spark, spark_store, [(1, "AA")])
    df = (
        spark.read.format("persist")
        .option("stash", spark_store.stash_url)
        .option("blob", spark_store.blob_uri)
        .load("flights")
    )
    assert df.count() == 1
    _write(spark, spark_store, [(2, "UA")])
    assert df.count() == 1
    assert sorted(r.id for r in df.where("id > 0").collect()) == [1, 2]
    fresh = (
        spark.read.format("persist")
        .option("stash", spark_store.stash_url)
        .option("blob", spark_store.blob_uri)
        .load("flights")
    )
    assert fresh.count() == 2
