"""The persist source checks its options, matches columns by name, keeps timestamps as they
were written, and explains save modes and key uniqueness."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

from persist import PersistClient
from stash import Stash

pytestmark = pytest.mark.spark

REPO = Path(__file__).resolve().parents[2]


def _opts(store: Any) -> dict[str, str]:
    return {"stash": store.stash_url, "blob": store.blob_uri}


def _read(spark: Any, store: Any, shard: str, **options: Any) -> Any:
    r = spark.read.format("persist").options(**_opts(store))
    for k, v in options.items():
        r = r.option(k, v)
    return r.load(shard)


def _write(df: Any, store: Any, shard: str, mode: str = "append", **options: Any) -> None:
    w = df.write.format("persist").options(**_opts(store)).mode(mode)
    for k, v in options.items():
        w = w.option(k, v)
    w.save(shard)


def _state(store: Any, shard: str) -> Any:
    with Stash.open(store.stash_url, fenced=False) as s:
        client = PersistClient(s, store.blob_uri, compaction="off")
        try:
            return client.inspect(shard)
        finally:
            client.close()


def _exists(store: Any, shard: str) -> bool:
    from spark.persist_common import ShardTarget, registered_schemas

    return registered_schemas(ShardTarget(store.stash_url, store.blob_uri, shard)) is not None


def _blob_files(store: Any) -> set[str]:
    root = Path(store.blob_uri[len("file://") :])
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


# ------------------------------------------------------------------- options
def test_unknown_options_and_bad_booleans_raise_with_a_suggestion(
    spark: Any, spark_store: Any
) -> None:
    df = spark.createDataFrame([(1, "a", -1)], "id long, name string, d long")
    with pytest.raises(
        Exception, match=r"unknown option.*'diff_colum'.*did you mean 'diff_column'"
    ):
        _write(df, spark_store, "typo", key_columns="id", diff_colum="d")
    with pytest.raises(Exception, match=r"'key_column'.*did you mean 'key_columns'"):
        _write(df, spark_store, "typo", key_column="id")
    with pytest.raises(Exception, match=r"unique_keys.*must be true or false"):
        _write(df, spark_store, "typo", key_columns="id", unique_keys="ture")
    assert not _exists(spark_store, "typo")  # nothing was created, nothing committed

    ok = spark.createDataFrame([(1, "a")], "id long, name string")
    _write(ok, spark_store, "typo", key_columns="id")
    with pytest.raises(Exception, match=r"'asof'.*did you mean 'as_of'"):
        _read(spark, spark_store, "typo", asof="0").collect()
    with pytest.raises(Exception, match=r"expand.*must be true or false.*'ture'"):
        _read(spark, spark_store, "typo", expand="ture").collect()
    with pytest.raises(Exception, match=r"'key_columns'"):  # a write option on a read
        _read(spark, spark_store, "typo", key_columns="id").collect()
    with pytest.raises(Exception, match=r"'diff_colum'.*did you mean 'diff_column'"):
        (
            spark.readStream.format("persist")
            .options(**_opts(spark_store))
            .option("diff_colum", "d")
            .load("typo")
            .writeStream.format("memory")
            .queryName("typo_stream")
            .start()
        )
    assert _state(spark_store, "typo").upper.as_option() == 1


def test_save_modes_other_than_append_say_why(spark: Any, spark_store: Any) -> None:
    df = spark.createDataFrame([(1, "a")], "id long, name string")
    with pytest.raises(Exception, match=r"only writes with mode\('append'\).*append-only"):
        _write(df, spark_store, "modes", mode="overwrite", key_columns="id")
    assert not _exists(spark_store, "modes")


def test_unique_keys_refuses_a_key_inserted_twice_across_tasks(
    spark: Any, spark_store: Any
) -> None:
    base = spark.createDataFrame([(1, "a"), (2, "b")], "id long, name string")
    _write(base, spark_store, "uk", key_columns="id", unique_keys="true")
    before = _state(spark_store, "uk")
    files = _blob_files(spark_store)
    # Two tasks each insert key 3: refused, nothing committed, their parts deleted.
    dupes = spark.createDataFrame([(3, "x"), (3, "y")], "id long, name string").repartition(2)
    with pytest.raises(Exception, match=r"unique_keys=true.*more than once.*'id': 3"):
        _write(dupes, spark_store, "uk", unique_keys="true")
    assert _state(spark_store, "uk").upper == before.upper
    assert _blob_files(spark_store) == files
    # Without the option, key_columns are not unique: both rows are stored.
    _write(dupes, spark_store, "uk")
    assert sorted(tuple(r) for r in _read(spark, spark_store, "uk").collect()) == [
        (1, "a", 1),
        (2, "b", 1),
        (3, "x", 1),
        (3, "y", 1),
    ]
    # An update (retract the old value, insert the new one) inserts each key once.
    upd = spark.createDataFrame(
        [(1, "a", -1), (1, "A", 1), (2, "b", -1)], "id long, name string, d long"
    )
    _write(upd, spark_store, "uk", diff_column="d", unique_keys="true")
    got = sorted(tuple(r) for r in _read(spark, spark_store, "uk").collect())
    assert got == [(1, "A", 1), (3, "x", 1), (3, "y", 1)]


# ---------------------------------------------------------------- timestamps
def test_timestamp_ntz_and_instants_survive_another_session_time_zone(
    spark: Any, spark_store: Any
) -> None:
    old = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    try:
        df = spark.sql(
            "SELECT * FROM VALUES "
            "(1L, timestamp_ntz'2024-01-01 00:00:00', timestamp_micros(1704067200000000)), "
            "(2L, timestamp_ntz'0001-01-01 00:00:00', timestamp_micros(0)) AS t(id, n, at)"
        )
        _write(df, spark_store, "ts", key_columns="id")
        back = _read(spark, spark_store, "ts", expand="true")
        assert dict(back.dtypes) == {"id": "bigint", "n": "timestamp_ntz", "at": "timestamp"}
        rows = sorted(back.selectExpr("id", "n", "unix_micros(at) AS us").collect())
        assert [tuple(r) for r in rows] == [
            (1, dt.datetime(2024, 1, 1, 0, 0), 1704067200000000),
            (2, dt.datetime(1, 1, 1, 0, 0), 0),
        ]
        # The same wall-clock text in the NTZ column, the same instant in the other.
        text = back.selectExpr("id", "cast(n AS string) AS n").orderBy("id").collect()
        assert [r["n"] for r in text] == ["2024-01-01 00:00:00", "0001-01-01 00:00:00"]
    finally:
        spark.conf.set("spark.sql.session.timeZone", old)


# ------------------------------------------------------------ columns by name
def test_columns_are_matched_by_name_and_widened(spark: Any, spark_store: Any) -> None:
    first = spark.createDataFrame([(1, "a", 1.5, 7)], "id long, name string, x double, n int")
    _write(first, spark_store, "byname", key_columns="id")
    # Other order, narrower types (int -> long, float -> double, byte -> int): accepted.
    other = spark.createDataFrame([(2.5, 4, "b", 2)], "x float, n tinyint, name string, id int")
    _write(other, spark_store, "byname")
    rows = sorted(tuple(r) for r in _read(spark, spark_store, "byname").collect())
    assert rows == [(1, "a", 1.5, 7, 1), (2, "b", 2.5, 4, 1)]
    st = _state(spark_store, "byname")
    assert st.key_schema.names == ["id"] and st.value_schema.names == ["name", "x", "n"]
    # Narrowing is refused, naming the column and the rule; so is an unknown column.
    wide = spark.createDataFrame([(3, "c", 1.0, 2**40)], "id long, name string, x double, n long")
    with pytest.raises(Exception, match=r"column 'n' has type int64.*stores int32.*widening"):
        _write(wide, spark_store, "byname")
    extra = spark.createDataFrame(
        [(3, "c", 1.0, 1, 0)], "id long, name string, x double, n int, z int"
    )
    with pytest.raises(Exception, match=r"has columns \['z'\] that shard byname does not"):
        _write(extra, spark_store, "byname")
    with pytest.raises(Exception, match=r"key_columns \['name'\] differs"):
        _write(first, spark_store, "byname", key_columns="name")
    assert _state(spark_store, "byname").upper == st.upper


def test_nullable_columns_write_into_non_nullable_ones_without_nulls(
    spark: Any, spark_store: Any
) -> None:
    import pyarrow as pa

    keys = pa.schema([pa.field("id", pa.int64(), nullable=False)])
    values = pa.schema([pa.field("name", pa.large_string(), nullable=False)])
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        client = PersistClient(s, spark_store.blob_uri, compaction="off")
        try:
            client.open_writer("strict", keys, values).expire()
        finally:
            client.close()
    # Spark's columns are nullable and its strings are not large: both are accepted.
    _write(spark.createDataFrame([("a", 1)], "name string, id long"), spark_store, "strict")
    assert [tuple(r) for r in _read(spark, spark_store, "strict").collect()] == [(1, "a", 1)]
    with pytest.raises(Exception, match=r"column 'name' has 1 nulls but is not nullable"):
        _write(spark.createDataFrame([(None, 2)], "name string, id long"), spark_store, "strict")
    assert _state(spark_store, "strict").upper.as_option() == 1


def test_a_read_writes_back_without_options(spark: Any, spark_store: Any) -> None:
    from pyspark.sql import functions as F

    df = spark.createDataFrame([(1, "a"), (2, "b"), (2, "b")], "id long, name string")
    _write(df, spark_store, "src", key_columns="id")
    snap = _read(spark, spark_store, "src")
    assert snap.columns == ["id", "name", "_diff"]
    # Into a new shard: _diff is the diff column, not a key.
    _write(snap, spark_store, "copy")
    assert _state(spark_store, "copy").key_schema.names == ["id", "name"]
    assert sorted(tuple(r) for r in _read(spark, spark_store, "copy").collect()) == [
        (1, "a", 1),
        (2, "b", 2),
    ]
    # Back into the same shard, negated: everything is retracted.
    _write(snap.withColumn("_diff", -F.col("_diff")), spark_store, "src")
    assert _read(spark, spark_store, "src").count() == 0


# -------------------------------------------------------------------- the guide
def _guide_text() -> str:
    """The Spark guide (its option tables are generated by scripts/gen_docs.py)."""
    return (REPO / "docs" / "guide" / "spark.md").read_text()


def test_the_spark_guide_documents_every_option_of_both_sources() -> None:
    from spark.persist_common import READ_OPTIONS, WRITE_OPTIONS
    from spark.persist_writer import SAVE_MODES
    from spark.stash_source import OPTIONS

    section = _guide_text()
    for name in (*READ_OPTIONS, *WRITE_OPTIONS, *OPTIONS):
        assert f"`{name}`" in section, f"option {name!r} is not documented in docs/guide/spark.md"
    assert "`_diff`" in section and "multiplicity" in section
    assert "unique_keys" in section and "not unique" in section
    assert 'mode("append")' in section and SAVE_MODES


def test_a_time_column_named_like_a_column_in_another_case_is_refused(
    spark: Any, spark_store: Any
) -> None:
    """``time_column=ID`` on a shard with a column ``id`` made ``id`` ambiguous in Spark
    (names are resolved ignoring case); it is refused like ``time_column=id``."""
    _write(
        spark.createDataFrame([(1, "a")], "id long, v string"),
        spark_store,
        "tcase",
        key_columns="id",
    )
    with pytest.raises(Exception, match="already a key or value column"):
        _read(spark, spark_store, "tcase", time_column="ID").collect()
    assert [tuple(r) for r in _read(spark, spark_store, "tcase").select("id", "v").collect()] == [
        (1, "a")
    ]
