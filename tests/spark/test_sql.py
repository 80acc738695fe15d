"""The ``persist`` source from Spark SQL: what PySpark 4.3's Python data
sources support and what they do not.

Works: ``CREATE TEMPORARY VIEW v USING persist OPTIONS (stash, blob, shard)``, ``SELECT``,
``INSERT INTO v``, time travel by a view with ``as_of`` (an unfiltered query of a view reuses the scan of
the last query planned, so it may not see later writes until the view is made again:
``test_view_read_time.py`` pins exactly when). Accepted but
unusable: ``CREATE TABLE t USING persist OPTIONS (...)``: Spark reads and writes such a
table with none of its options, and the source says so. Refused by Spark: ``VERSION AS
OF`` / ``TIMESTAMP AS OF`` on a Python source, and ``INSERT OVERWRITE`` (refused by the
source: a shard is append-only).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.spark


def _options(store: Any, **extra: str) -> str:
    opts = {"stash": store.stash_url, "blob": store.blob_uri, "shard": "flights", **extra}
    for v in opts.values():
        assert "'" not in v  # the values are this test's own paths
    return ", ".join(f"{k} '{v}'" for k, v in opts.items())


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


def test_temporary_view_select_insert_and_time_travel(spark: Any, spark_store: Any) -> None:
    _write(spark, spark_store, [(1, "AA"), (2, "UA")])  # time 0
    spark.sql(
        f"CREATE OR REPLACE TEMPORARY VIEW flights USING persist OPTIONS ({_options(spark_store)})"
    )
    assert sorted(tuple(r) for r in spark.sql("SELECT * FROM flights").collect()) == [
        (1, "AA", 1),
        (2, "UA", 1),
    ]
    spark.sql("INSERT INTO flights VALUES (3, 'DL', 1)")  # time 1
    spark.sql("INSERT INTO flights SELECT 1 AS id, 'AA' AS carrier, -1 AS _diff")  # time 2
    # An unfiltered query reuses the last planned scan (test_view_read_time.py): made
    # again, it reads the latest time.
    spark.sql(
        f"CREATE OR REPLACE TEMPORARY VIEW flights USING persist OPTIONS ({_options(spark_store)})"
    )
    now = spark.sql("SELECT id, carrier, _diff FROM flights ORDER BY id").collect()
    assert [tuple(r) for r in now] == [(2, "UA", 1), (3, "DL", 1)]
    assert spark.sql("SELECT count(*) FROM flights WHERE id = 3").first()[0] == 1
    spark.sql(
        "CREATE OR REPLACE TEMPORARY VIEW flights_at_0 USING persist "
        f"OPTIONS ({_options(spark_store, as_of='0')})"
    )
    then = spark.sql("SELECT id FROM flights_at_0 ORDER BY id").collect()
    assert [r[0] for r in then] == [1, 2]
    with pytest.raises(Exception, match="TIME_TRAVEL"):
        spark.sql("SELECT * FROM flights_at_0 VERSION AS OF 0").collect()
    with pytest.raises(Exception, match="append"):
        spark.sql("INSERT OVERWRITE flights SELECT 9 AS id, 'x' AS carrier, 1 AS _diff").collect()
    spark.catalog.dropTempView("flights")
    spark.catalog.dropTempView("flights_at_0")


@pytest.fixture
def no_warehouse_left() -> Iterator[None]:
    """Remove the (empty) ``spark-warehouse`` directory a CREATE TABLE makes in the
    JVM's working directory, if the test made it."""
    warehouse = Path("spark-warehouse").resolve()
    existed = warehouse.exists()
    yield
    if not existed and warehouse.is_dir() and not any(warehouse.iterdir()):
        warehouse.rmdir()


def test_create_table_is_accepted_but_spark_drops_its_options(
    spark: Any, spark_store: Any, no_warehouse_left: None
) -> None:
    """CREATE TABLE ... USING persist succeeds (the source takes the catalog's
    ``option.``-prefixed options), but Spark gives the source none of the table's options
    when reading or inserting: the error says so and names the working form."""
    _write(spark, spark_store, [(1, "AA")])
    spark.sql("DROP TABLE IF EXISTS flights_tbl")
    spark.sql(f"CREATE TABLE flights_tbl USING persist OPTIONS ({_options(spark_store)})")
    try:
        assert spark.table("flights_tbl").columns == ["id", "carrier", "_diff"]
        with pytest.raises(Exception, match="CREATE TEMPORARY VIEW"):
            spark.sql("SELECT * FROM flights_tbl").collect()
        with pytest.raises(Exception, match="CREATE TEMPORARY VIEW"):
            spark.sql("INSERT INTO flights_tbl VALUES (2, 'UA', 1)").collect()
    finally:
        spark.sql("DROP TABLE IF EXISTS flights_tbl")
