"""The ``persist`` source reads what ``ReadHandle.snapshot`` has, for every column type:
a closed shard's default read, nanosecond times (floored to microseconds), the Spark
type each Arrow type reads as (the README's table), and ``INSERT INTO`` a view made with
read options (a time-travel view is read-only).

Shards are written straight through persist; one shard holds many column types so that
one Spark read checks them all.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist import PersistClient
from stash import Antichain, Stash

pytestmark = pytest.mark.spark

KEYS = pa.schema([("k", pa.int64())])
MODES = ("full", "partition", "none")


def _read(spark: Any, store: Any, shard: str, **options: Any) -> Any:
    r = spark.read.format("persist").option("stash", store.stash_url)
    r = r.option("blob", store.blob_uri)
    for k, v in options.items():
        r = r.option(k, str(v))
    return r.load(shard)


def _client(store: Any, s: Stash, **kw: Any) -> PersistClient:
    return PersistClient(s, store.blob_uri, **kw)


def _updates(keys: list[int], values: dict[str, pa.Array], times: list[int]) -> pa.Table:
    n = len(keys)
    cols = {"k": pa.array(keys, pa.int64()), **values}
    cols["_time"] = pa.array(times, pa.int64())
    cols["_diff"] = pa.array([1] * n, pa.int64())
    return pa.table(cols)


# ------------------------------------------------------------ a closed shard
def test_default_read_of_a_closed_shard_has_the_rows(spark: Any, spark_store: Any) -> None:
    """Upper ``{}`` (closed by ``compare_and_append(..., new_upper=Antichain())``): the
    default read is the snapshot at the latest time with data, in every mode, through
    inline and blob parts."""
    values = pa.schema([("v", pa.string())])
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        for shard, inline in (("closed_inline", 1 << 20), ("closed_blob", 0)):
            client = _client(spark_store, s, inline_max_bytes=inline)
            write, read = client.open(shard, KEYS, values)
            v = pa.array(["a", "b", "c"])
            write.compare_and_append(_updates([1, 2, 3], {"v": v}, [0, 1, 2]), 0, 3)
            retract = _updates([2], {"v": pa.array(["b"])}, [5])
            retract = retract.set_column(3, "_diff", pa.array([-1], pa.int64()))
            write.compare_and_append(retract, 3, Antichain())
            assert client.inspect(shard).upper.is_empty()
            want = sorted((r["k"], r["v"], r["_diff"]) for r in read.snapshot(5).to_pylist())
            assert want == [(1, "a", 1), (3, "c", 1)]
            client.close()
    for shard in ("closed_inline", "closed_blob"):
        for mode in MODES:
            df = _read(spark, spark_store, shard, consolidate=mode, time_column="t")
            rows = [(r["k"], r["v"], r["_diff"]) for r in df.collect()]
            totals: dict[tuple[int, str], int] = {}
            for k, v, d in rows:
                totals[(k, v)] = totals.get((k, v), 0) + d
            got = sorted((k, v, d) for (k, v), d in totals.items() if d)
            assert got == want, (shard, mode)
        full = _read(spark, spark_store, shard, time_column="t").collect()
        assert {r["t"] for r in full} == {5}  # the latest time with data
        expanded = _read(spark, spark_store, shard, expand="true").collect()
        assert sorted(tuple(r) for r in expanded) == [(1, "a"), (3, "c")]


def test_a_stream_of_a_closed_shard_starts_with_its_rows(spark: Any, spark_store: Any) -> None:
    """The streaming read's first micro-batch is the snapshot at the same default time."""
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        client = _client(spark_store, s)
        write, _read_handle = client.open("closed_stream", KEYS, pa.schema([("v", pa.string())]))
        write.compare_and_append(_updates([1, 2], {"v": pa.array(["a", "b"])}, [0, 3]), 0, 4)
        write.compare_and_append(_updates([], {"v": pa.array([], pa.string())}, []), 4, Antichain())
        client.close()
    stream = (
        spark.readStream.format("persist")
        .option("stash", spark_store.stash_url)
        .option("blob", spark_store.blob_uri)
        .option("time_column", "t")
        .load("closed_stream")
    )
    q = stream.writeStream.format("memory").queryName("closed_stream_test").start()
    try:
        q.processAllAvailable()
        got = sorted(tuple(r) for r in spark.table("closed_stream_test").collect())
    finally:
        q.stop()
    assert got == [(1, "a", 3, 1), (2, "b", 3, 1)]


# ------------------------------------------------------ nanosecond temporal types
NS_VALUES = [1_000_000_001, -1, -1_999, 999, None]  # nanoseconds (sub-microsecond parts)
NS_FLOORED_US = [1_000_000, -1, -2, 0, None]  # floored to the microsecond


def test_nanosecond_times_read_floored_to_microseconds(spark: Any, spark_store: Any) -> None:
    """``timestamp("ns")`` (naive and zoned), ``time64("ns")`` and ``duration("ns")``
    with sub-microsecond parts read floored to the microsecond, in every mode (a task
    used to fail with ``ArrowInvalid: Casting from timestamp[ns] to timestamp[us] would
    lose data``)."""
    types = {
        "ts": pa.timestamp("ns"),
        "tsz": pa.timestamp("ns", "Europe/Paris"),
        "dur": pa.duration("ns"),
    }
    values = pa.schema([(n, t) for n, t in types.items()] + [("tod", pa.time64("ns"))])
    ints = pa.array(NS_VALUES, pa.int64())
    cols = {n: ints.cast(t) for n, t in types.items()}
    tod = [3_000_000_001, 1, 999, 86_399_999_999_999, None]
    cols["tod"] = pa.array(tod, pa.int64()).cast(pa.time64("ns"))
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        client = _client(spark_store, s)
        write, _read_handle = client.open("ns", KEYS, values)
        write.compare_and_append(_updates([1, 2, 3, 4, 5], cols, [0] * 5), 0, 1)
        client.close()
    epoch = dt.datetime(1970, 1, 1)
    want_ts = [None if u is None else epoch + dt.timedelta(microseconds=u) for u in NS_FLOORED_US]
    want_dur = [None if u is None else dt.timedelta(microseconds=u) for u in NS_FLOORED_US]
    want_tod = [dt.time(0, 0, 3), dt.time(0), dt.time(0), dt.time(23, 59, 59, 999999), None]
    for mode in MODES:
        df = _read(spark, spark_store, "ns", consolidate=mode)
        assert df.schema["ts"].dataType.simpleString() == "timestamp_ntz"
        assert df.schema["tsz"].dataType.simpleString() == "timestamp"
        rows = sorted(df.collect(), key=lambda r: r["k"])
        assert [r["ts"] for r in rows] == want_ts, mode
        # a zoned timestamp is the same instant (the session time zone is UTC)
        assert [r["tsz"] for r in rows] == want_ts, mode
        assert [r["dur"] for r in rows] == want_dur, mode
        assert [r["tod"] for r in rows] == want_tod, mode


# --------------------------------------------------- how each Arrow type reads back
def test_each_arrow_type_reads_back_as_the_readme_says(spark: Any, spark_store: Any) -> None:
    """The README's table: the Spark type each Arrow column type reads as, and its
    values (unsigned integers widen exactly; time32/date64/decimal256 convert)."""
    d = decimal.Decimal
    cases: dict[str, tuple[pa.DataType, list[Any], str, list[Any]]] = {
        "i8": (pa.int8(), [-128, 127], "tinyint", [-128, 127]),
        "i16": (pa.int16(), [-(2**15), 2**15 - 1], "smallint", [-(2**15), 2**15 - 1]),
        "i32": (pa.int32(), [-(2**31), 2**31 - 1], "int", [-(2**31), 2**31 - 1]),
        "i64": (pa.int64(), [-(2**63), 2**63 - 1], "bigint", [-(2**63), 2**63 - 1]),
        "u8": (pa.uint8(), [0, 255], "smallint", [0, 255]),
        "u16": (pa.uint16(), [0, 65535], "int", [0, 65535]),
        "u32": (pa.uint32(), [0, 2**32 - 1], "bigint", [0, 2**32 - 1]),
        "u64": (pa.uint64(), [0, 2**64 - 1], "decimal(20,0)", [d(0), d(2**64 - 1)]),
        "f32": (pa.float32(), [1.5, -0.0], "float", [1.5, -0.0]),
        "f64": (pa.float64(), [float("inf"), 2.5], "double", [float("inf"), 2.5]),
        "b": (pa.bool_(), [True, False], "boolean", [True, False]),
        "s": (pa.string(), ["a\x00", "\U0001f600"], "string", ["a\x00", "\U0001f600"]),
        "ls": (pa.large_string(), ["x", ""], "string", ["x", ""]),
        "bin": (pa.binary(), [b"\x00", b""], "binary", [b"\x00", b""]),
        "lbin": (pa.large_binary(), [b"\xff", b"a"], "binary", [b"\xff", b"a"]),
        "fsb": (pa.binary(2), [b"\x00\x01", None], "binary", None),
        "d32": (pa.date32(), [dt.date(1, 1, 1), dt.date(9999, 12, 31)], "date", None),
        "d64": (pa.date64(), [dt.date(1969, 12, 31), dt.date(2020, 2, 29)], "date", None),
        "t32s": (pa.time32("s"), [dt.time(1, 2, 3), dt.time(0)], "time(6)", None),
        "t32ms": (pa.time32("ms"), [dt.time(1, 2, 3, 4000), dt.time(0)], "time(6)", None),
        "t64us": (pa.time64("us"), [dt.time(1, 2, 3, 4), dt.time(0)], "time(6)", None),
        "tss": (pa.timestamp("s"), [dt.datetime(1960, 1, 1), None], "timestamp_ntz", None),
        "tsus": (
            pa.timestamp("us"),
            [dt.datetime(1, 1, 1, 0, 0, 0, 1), None],
            "timestamp_ntz",
            None,
        ),
        "tsms": (
            pa.timestamp("ms", "UTC"),
            [dt.datetime(2020, 1, 1, tzinfo=dt.UTC), None],
            "timestamp",
            [dt.datetime(2020, 1, 1), None],  # the instant, in the session's zone (UTC)
        ),
        "durs": (pa.duration("s"), [dt.timedelta(days=-1), None], "interval day to second", None),
        "dec": (pa.decimal128(10, 2), [d("-1.23"), None], "decimal(10,2)", None),
        "dec256": (pa.decimal256(38, 3), [d("1." + "0" * 2 + "1"), None], "decimal(38,3)", None),
    }
    values = pa.schema([(n, t) for n, (t, _v, _s, _w) in cases.items()])
    cols = {n: pa.array(v, t) for n, (t, v, _s, _w) in cases.items()}
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        client = _client(spark_store, s, inline_max_bytes=0)  # through a Parquet part
        write, _read_handle = client.open("types", KEYS, values)
        write.compare_and_append(_updates([1, 2], cols, [0, 0]), 0, 1)
        client.close()
    df = _read(spark, spark_store, "types")
    rows = sorted(df.collect(), key=lambda r: r["k"])
    for name, (_t, written, spark_type, want) in cases.items():
        assert df.schema[name].dataType.simpleString() == spark_type, name
        got = [r[name] for r in rows]
        expected = written if want is None else want
        assert got == expected, name
    import math

    assert math.copysign(1, rows[1]["f32"]) == -1  # -0.0 stays -0.0


def test_decimal_wider_than_spark_raises_naming_the_column(spark: Any, spark_store: Any) -> None:
    values = pa.schema([("big", pa.decimal256(40, 0))])
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        client = _client(spark_store, s)
        write, _read_handle = client.open("wide", KEYS, values)
        big = pa.array([decimal.Decimal(10**39)], pa.decimal256(40, 0))
        write.compare_and_append(_updates([1], {"big": big}, [0]), 0, 1)
        client.close()
    with pytest.raises(Exception, match=r"column 'big' of shard wide is decimal256\(40, 0\)"):
        _read(spark, spark_store, "wide").collect()


# --------------------------------------------------------- INSERT INTO a view
def _view_options(store: Any, **extra: str) -> str:
    opts = {"stash": store.stash_url, "blob": store.blob_uri, "shard": "flights", **extra}
    return ", ".join(f"{k} '{v}'" for k, v in opts.items())


def test_insert_into_a_time_travel_view_is_refused(spark: Any, spark_store: Any) -> None:
    """A view with ``as_of`` is read-only (the error names the option and says why);
    ``INSERT INTO`` a view made with read-shaping options (``consolidate``, ``expand``,
    ``partitions``, ``partition_bytes``, ``pushdown``) appends at the shard's upper."""
    (
        spark.createDataFrame([(1, "AA")], "id long, carrier string")
        .write.format("persist")
        .option("stash", spark_store.stash_url)
        .option("blob", spark_store.blob_uri)
        .option("key_columns", "id")
        .mode("append")
        .save("flights")
    )
    opts = _view_options(spark_store, as_of="0")
    spark.sql(f"CREATE OR REPLACE TEMPORARY VIEW day0 USING persist OPTIONS ({opts})")
    assert [tuple(r) for r in spark.sql("SELECT * FROM day0").collect()] == [(1, "AA", 1)]
    with pytest.raises(Exception, match=r"option as_of='0'.*read-only"):
        spark.sql("INSERT INTO day0 VALUES (2, 'UA', 1)")
    read_options = [
        {"consolidate": "partition"},
        {"consolidate": "none"},
        {"partitions": "3", "partition_bytes": "1", "pushdown": "true"},
    ]
    for i, extra in enumerate(read_options, start=2):
        opts = _view_options(spark_store, **extra)
        spark.sql(f"CREATE OR REPLACE TEMPORARY VIEW v USING persist OPTIONS ({opts})")
        spark.sql(f"INSERT INTO v VALUES ({i}, 'UA', 1)")  # noqa: S608
    opts = _view_options(spark_store, expand="true")
    spark.sql(f"CREATE OR REPLACE TEMPORARY VIEW ex USING persist OPTIONS ({opts})")
    spark.sql("INSERT INTO ex VALUES (9, 'DL')")
    spark.sql(
        f"CREATE OR REPLACE TEMPORARY VIEW now USING persist OPTIONS ({_view_options(spark_store)})"
    )
    got = sorted(tuple(r) for r in spark.sql("SELECT * FROM now").collect())
    assert got == [(1, "AA", 1), (2, "UA", 1), (3, "UA", 1), (4, "UA", 1), (9, "DL", 1)]
    # the time-travel view still reads time 0
    assert [tuple(r) for r in spark.sql("SELECT * FROM day0").collect()] == [(1, "AA", 1)]


def test_a_duration_beyond_sparks_range_raises_naming_column_and_shard(
    spark: Any, spark_store: Any
) -> None:
    """Spark's ``interval day to second`` is int64 microseconds: a ``duration("s")`` of
    2**62 seconds has no Spark value."""
    values = pa.schema([("wait", pa.duration("s"))])
    with Stash.open(spark_store.stash_url, fenced=False) as s:
        client = _client(spark_store, s)
        write, _read_handle = client.open("long_wait", KEYS, values)
        far = pa.array([2**62, 5], pa.int64()).cast(pa.duration("s"))
        write.compare_and_append(_updates([1, 2], {"wait": far}, [0, 0]), 0, 1)
        client.close()
    with pytest.raises(Exception, match=r"column 'wait' of shard long_wait: a duration\[s\]"):
        _read(spark, spark_store, "long_wait").collect()


# ------------------------------------------------------------- differential
from tests.persist.arrow_strategies import COLUMN_TYPES, NAN, shard_schemas, update_tables  # noqa: E402

#: The column types every value of which Spark holds: not decimal256 wider than 38
#: digits (refused naming the column) nor durations in seconds or milliseconds, whose
#: extremes overflow Spark's microseconds (raised naming the column, tested above).
SPARK_TYPES = tuple(
    t
    for t in COLUMN_TYPES
    if not (pa.types.is_decimal(t) and t.precision > 38)
    and not (pa.types.is_duration(t) and t.unit in ("s", "ms"))
)
LONG = os.environ.get("STASH_RELIABILITY") == "long"


def _spark_value(v: Any) -> Any:
    """A value as the model compares it: what Spark's ``collect`` gives, with NaN as
    :data:`NAN`, zeros unsigned, ``bytearray`` as ``bytes`` and instants as naive UTC."""
    if isinstance(v, float):
        return NAN if math.isnan(v) else (0.0 if v == 0.0 else v)
    if isinstance(v, bytearray):
        return bytes(v)
    if isinstance(v, dt.datetime) and v.tzinfo is not None:
        return v.astimezone(dt.UTC).replace(tzinfo=None)
    return v


def _expected(table: pa.Table, columns: pa.Schema) -> Counter[tuple[Any, ...]]:
    """``ReadHandle.snapshot``'s rows as Spark reads them: each column converted to its
    Spark type (:func:`spark.arrow_spark.to_spark_column`), diffs summed per row."""
    from spark.arrow_spark import spark_read_type, to_spark_column

    cols = [
        [
            _spark_value(v)
            for v in to_spark_column(table.column(f.name), spark_read_type(f)).to_pylist()
        ]
        for f in columns
    ]
    out: Counter[tuple[Any, ...]] = Counter()
    for row, d in zip(zip(*cols, strict=True), table.column("_diff").to_pylist(), strict=True):
        out[row] += d
    return Counter({r: d for r, d in out.items() if d})


def _collected(df: Any, names: list[str]) -> Counter[tuple[Any, ...]]:
    out: Counter[tuple[Any, ...]] = Counter()
    for r in df.collect():
        out[tuple(_spark_value(r[n]) for n in names)] += r["_diff"]
    return Counter({r: d for r, d in out.items() if d})


@st.composite
def _shards(draw: Any) -> dict[str, Any]:
    ks, vs = draw(shard_schemas(SPARK_TYPES, max_keys=2, max_values=2))
    appends = []
    for i in range(draw(st.integers(1, 3))):
        table = draw(update_tables(ks, vs, times=(2 * i, 2 * i + 1), max_rows=8))
        appends.append((table, draw(st.booleans())))  # (updates, through inline parts)
    return {"ks": ks, "vs": vs, "appends": appends, "as_of": draw(st.integers(0, 10**6))}


@settings(
    max_examples=40 if LONG else 4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(spec=_shards(), data=st.data())
def test_spark_reads_equal_the_snapshot_for_every_type(spark: Any, spec: Any, data: Any) -> None:
    """The persist source in every ``consolidate`` mode, and a filtered read, equal
    ``ReadHandle.snapshot`` (as Spark holds its values) on shards of every column type
    Spark reads, written through inline and blob parts, read by a fresh client."""
    from pyspark.sql import functions as F

    ks, vs = spec["ks"], spec["vs"]
    columns = pa.schema([*ks, *vs])
    with tempfile.TemporaryDirectory() as d:
        url, blob = f"sqlite:///{d}/stash.db", Path(d, "blob").as_uri()
        with Stash.open(url, fenced=False) as s:
            clients = [PersistClient(s, blob, inline_max_bytes=n) for n in (0, 1 << 20)]
            writers = [c.open_writer("d", ks, vs) for c in clients]
            for i, (table, inline) in enumerate(spec["appends"]):
                writers[inline].compare_and_append(table, 2 * i, 2 * i + 2)
            upper = 2 * len(spec["appends"])
            for c in clients:
                c.close()
        as_of = spec["as_of"] % upper
        with Stash.open(url, fenced=False) as s:  # a fresh client: state from the stash
            client = PersistClient(s, blob)
            read = client.open_reader("d", ks, vs)
            want = _expected(read.snapshot(as_of), columns)
            client.close()
        opts = {"stash": url, "blob": blob, "as_of": str(as_of)}
        reads = [
            spark.read.format("persist").options(**opts, consolidate=mode).load("d")
            for mode in MODES
        ]
        wants = [want] * len(MODES)
        # A filter on a drawn column, applied by Spark, against the snapshot's rows filtered in Python
        # with Spark's equality (NaN equals NaN, -0.0 equals 0.0).
        # Not on timestamp or time columns: PySpark turns a naive datetime literal into
        # an instant with the Python process's local zone, and has no time literal.
        usable = [
            i
            for i, f in enumerate(columns)
            if not (pa.types.is_timestamp(f.type) or pa.types.is_time(f.type))
        ]
        if usable:
            j = data.draw(st.sampled_from(usable))
            value = data.draw(st.sampled_from([None, *sorted({r[j] for r in want}, key=repr)]))
            df = reads[0]  # pushdown=true reads the same (PySpark 4 takes no filter)
            col = F.col(columns.names[j])
            if value is None:
                reads.append(df.where(col.isNull()))
            else:
                reads.append(df.where(col == F.lit(math.nan if value == NAN else value)))
            wants.append(Counter({r: n for r, n in want.items() if r[j] == value}))
        # One Spark job for all the reads (a Spark job is what costs time here).
        union = reads[0].withColumn("_read", F.lit(0))
        for i, df in enumerate(reads[1:], start=1):
            union = union.unionByName(df.withColumn("_read", F.lit(i)))
        rows = union.collect()
        for i, expected in enumerate(wants):
            got: Counter[tuple[Any, ...]] = Counter()
            for r in rows:
                if r["_read"] == i:
                    got[tuple(_spark_value(r[n]) for n in columns.names)] += r["_diff"]
            got = Counter({k: n for k, n in got.items() if n})
            assert got == expected, (["full", "partition", "none", "filter"][i], got, expected)
