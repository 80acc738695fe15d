"""A DataFrame read from the ``persist`` source writes back to the shard it came from as
is (README), also for the columns whose Spark type is not their shard's Arrow type
(``spark.arrow_spark.spark_read_type``: unsigned integers widen, ``date64`` reads as a
date, millisecond timestamps as microseconds, ``decimal256`` as ``decimal128``,
``fixed_size_binary`` as ``binary``): the writer takes each such column back and casts
it with pyarrow's safe cast, and a value that does not convert exactly fails the write,
naming the column, with nothing committed."""

from __future__ import annotations

import datetime as dt
import decimal
from typing import Any

import pyarrow as pa
import pytest

from persist import PersistClient
from spark.persist_common import arrow_to_spark, spark_to_arrow
from spark.persist_writer import _widens
from stash import Stash

READ_BACK_TYPES = [
    pa.uint8(),
    pa.uint32(),
    pa.uint64(),
    pa.date64(),
    pa.timestamp("ms", "UTC"),
    pa.decimal256(20, 2),
    pa.binary(3),
]


@pytest.mark.parametrize("t", READ_BACK_TYPES, ids=str)
def test_a_column_read_through_spark_writes_back_to_its_shard(t: pa.DataType) -> None:
    read_as = spark_to_arrow(arrow_to_spark(pa.schema([("c", t)]))).field("c").type
    assert read_as != t
    assert _widens(read_as, t), f"{t} reads as {read_as}, which the writer refuses for {t}"


def test_a_type_no_column_reads_as_is_still_refused() -> None:
    assert not _widens(pa.int32(), pa.uint8())  # uint8 reads as int16
    assert not _widens(pa.int64(), pa.uint64())  # uint64 reads as decimal128(20, 0)
    assert not _widens(pa.binary(), pa.decimal256(20, 2))


@pytest.mark.spark
def test_a_read_dataframe_writes_back_exactly_and_a_value_that_does_not_fit_fails(
    spark: Any, spark_store: Any
) -> None:
    """One Spark round trip: read a shard holding every read-back type, write the
    DataFrame back (every row now twice), and write a value out of a column's range."""
    values = pa.schema([(f"c{i}", t) for i, t in enumerate(READ_BACK_TYPES)])
    row = [
        255,
        2**32 - 1,
        2**64 - 1,
        dt.date(2026, 11, 26),
        dt.datetime(2026, 11, 26, 12, 0, 0, 123000, tzinfo=dt.UTC),
        decimal.Decimal("123456789012345678.91"),
        b"abc",
    ]
    table = pa.table(
        {
            "k": pa.array([1], pa.int64()),
            **{f.name: pa.array([v], f.type) for f, v in zip(values, row, strict=True)},
            "_time": pa.array([0], pa.int64()),
            "_diff": pa.array([1], pa.int64()),
        }
    )
    opts = {"stash": spark_store.stash_url, "blob": spark_store.blob_uri}
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        client = PersistClient(s, spark_store.blob_uri)
        write, read = client.open("typed", pa.schema([("k", pa.int64())]), values)
        write.compare_and_append(table, 0, 1)
        client.close()
    df = spark.read.format("persist").options(**opts).load("typed")
    df.write.format("persist").options(**opts).mode("append").save("typed")
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        client = PersistClient(s, spark_store.blob_uri)
        _, read = client.open("typed", pa.schema([("k", pa.int64())]), values)
        upper = client.inspect("typed").upper
        got = read.snapshot(upper.as_option() - 1)
        assert [got.schema.field(f.name).type for f in values] == READ_BACK_TYPES
        want = {"k": 1, **{f"c{i}": v for i, v in enumerate(row)}, "_time": 1, "_diff": 2}
        assert got.to_pylist() == [want]
        client.close()
    too_big = df.selectExpr("k", "CAST(256 AS SMALLINT) AS c0", *[f"c{i}" for i in range(1, 7)])
    with pytest.raises(Exception, match="column 'c0'.*does not convert exactly"):
        too_big.write.format("persist").options(**opts).mode("append").save("typed")
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        client = PersistClient(s, spark_store.blob_uri)
        assert client.inspect("typed").upper == upper
        client.close()
