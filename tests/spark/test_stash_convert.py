"""The ``stash`` source's user-schema conversion (:mod:`spark.stash_convert`): a JSON value
reads into a column only when the column's type holds it exactly; anything else raises
naming the column.

Two properties over every Spark type the ``schema`` option reads (scalars, and arrays,
maps and structs of them): any JSON value either raises :class:`StashSourceError` naming
the column or converts to a value that gives the original back (an independent
round-trip per type); and values drawn from a type's own domain always convert. Plus the
defects found by review (numbers into binary, a date's first 10 characters, ``"5"`` into
bigint, ``"nan"`` into double, ``true`` into timestamp), and a few real Spark reads
(names matched ignoring case, as Spark does).
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import math
import os
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    CharType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    NullType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
    TimeType,
    VarcharType,
)

from spark.stash_convert import StashSourceError, check_readable, convert

LONG = os.environ.get("STASH_RELIABILITY") == "long"
EXAMPLES = 2000 if LONG else 150  # no Spark here: each example is microseconds

SCALARS: list[DataType] = [
    StringType(),
    CharType(3),
    VarcharType(4),
    ByteType(),
    ShortType(),
    IntegerType(),
    LongType(),
    FloatType(),
    DoubleType(),
    DecimalType(10, 2),
    DecimalType(38, 0),
    DecimalType(5, 5),
    BooleanType(),
    DateType(),
    TimestampType(),
    TimestampNTZType(),
    TimeType(),
    BinaryType(),
    NullType(),
]
INT_BITS = {ByteType: 8, ShortType: 16, IntegerType: 32, LongType: 64}

spark_types = st.recursive(
    st.sampled_from(SCALARS),
    lambda inner: st.one_of(
        inner.map(lambda t: ArrayType(t)),
        inner.map(lambda t: MapType(StringType(), t)),
        st.lists(inner, min_size=1, max_size=3).map(
            lambda ts: StructType([StructField(f"F{i}", t) for i, t in enumerate(ts)])
        ),
    ),
    max_leaves=4,
)

_text = st.one_of(
    st.text(max_size=8),
    st.sampled_from(
        [
            "5",
            "nan",
            "NaN",
            "1e3",
            "true",
            "2024-02-29",
            "2024-02-29junk",
            "2024-02-29T12:00:00",
            "2024-02-29T12:00:00.1234567",
            "2024-02-29T12:00:00+02:00",
            "12:30:00",
            "12:30:00.123456",
            "abc",
        ]
    ),
)
_scalar_json = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 127, 128, 2**31, 2**63 - 1, 2**63, 2**53 + 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.5, 0.1, 1e-7, 1e20, 3.5e38, 1.25]),
    _text,
    st.binary(max_size=6),
)
json_values = st.recursive(
    _scalar_json,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["F0", "f0", "F1", "f2", "x"]), inner, max_size=3),
    ),
    max_leaves=6,
)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _exact(v: Any) -> decimal.Decimal:
    return decimal.Decimal(repr(v)) if isinstance(v, float) else decimal.Decimal(v)


def _instant(ts: dt.datetime) -> dt.datetime:
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=dt.UTC)


def gives_back(value: Any, out: Any, t: DataType) -> bool:
    """Whether ``out`` (what the column holds) is exactly the JSON ``value`` read as
    ``t``: an independent oracle of every rule in the module's table."""
    if value is None:
        return out is None
    if isinstance(t, CharType | VarcharType):
        return isinstance(value, str) and out == value and len(value) <= t.length
    if isinstance(t, StringType):
        if isinstance(value, str):
            return out == value
        if isinstance(value, bytes):
            return base64.b64decode(out) == value
        return bool(json.loads(out) == value)
    for cls, bits in INT_BITS.items():
        if isinstance(t, cls):
            return (
                _is_number(value)
                and type(out) is int
                and out == value
                and -(2 ** (bits - 1)) <= out < 2 ** (bits - 1)
            )
    if isinstance(t, FloatType | DoubleType):
        if not (_is_number(value) and isinstance(out, float)):
            return False
        if isinstance(t, FloatType) and math.isfinite(out):
            if struct.unpack("f", struct.pack("f", out))[0] != out:
                return False
        if math.isnan(out):
            return isinstance(value, float) and math.isnan(value)
        return out == value and math.copysign(1, out) == math.copysign(1, value)
    if isinstance(t, DecimalType):
        if not (_is_number(value) and isinstance(out, decimal.Decimal)):
            return False
        sign, digits, exp = out.as_tuple()
        return bool(out == _exact(value) and exp == -t.scale and len(digits) <= t.precision)
    if isinstance(t, BooleanType):
        return isinstance(value, bool) and out is value
    if isinstance(t, DateType):
        return (
            isinstance(value, str) and type(out) is dt.date and dt.date.fromisoformat(value) == out
        )
    if isinstance(t, TimestampType | TimestampNTZType):
        if not isinstance(out, dt.datetime) or (out.tzinfo is None) != isinstance(
            t, TimestampNTZType
        ):
            return False
        if _is_number(value):
            want = dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(
                microseconds=int(_exact(value) * 10**6)
            )
            return _exact(value) * 10**6 % 1 == 0 and _instant(out) == want
        return isinstance(value, str) and _instant(out) == _instant(
            dt.datetime.fromisoformat(value)
        )
    if isinstance(t, TimeType):
        return isinstance(value, str) and dt.time.fromisoformat(value) == out
    if isinstance(t, BinaryType):
        if isinstance(value, str):
            return out == value.encode("utf-8")
        return isinstance(value, bytes) and out == value
    if isinstance(t, NullType):
        return False
    if isinstance(t, ArrayType):
        return (
            isinstance(value, list)
            and len(out) == len(value)
            and all(gives_back(v, o, t.elementType) for v, o in zip(value, out, strict=True))
        )
    if isinstance(t, MapType):
        return (
            isinstance(value, dict)
            and list(out) == list(value)
            and all(gives_back(value[k], out[k], t.valueType) for k in value)
        )
    if isinstance(t, StructType):
        if not isinstance(value, dict):
            return False
        for f, o in zip(t.fields, out, strict=True):
            exact = [k for k in value if k == f.name]
            folded = [k for k in value if k.lower() == f.name.lower()]
            keys = exact or (folded if len(folded) == 1 else [])
            if not gives_back(value[keys[0]] if keys else None, o, f.dataType):
                return False
        return True
    raise AssertionError(t)


@settings(max_examples=EXAMPLES, deadline=None)
@given(t=spark_types, value=json_values)
def test_any_json_value_fits_exactly_or_raises_naming_the_column(t: DataType, value: Any) -> None:
    try:
        out = convert(value, t, "Col")
    except StashSourceError as e:
        assert str(e).startswith("column 'Col"), e
        assert "does not fit" in str(e) or "cannot read" in str(e), e
        return
    assert gives_back(value, out, t), (t.simpleString(), value, out)


def _domain(t: DataType) -> st.SearchStrategy[Any]:
    """Values a column of ``t`` holds (as JSON would store them)."""
    if isinstance(t, CharType | VarcharType):
        return st.text(max_size=t.length)
    if isinstance(t, StringType):
        return st.one_of(st.text(), st.integers(), st.lists(st.integers(), max_size=2))
    for cls, bits in INT_BITS.items():
        if isinstance(t, cls):
            return st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    if isinstance(t, FloatType):
        return st.floats(width=32)
    if isinstance(t, DoubleType):
        return st.one_of(st.floats(), st.integers(-(2**53), 2**53))
    if isinstance(t, DecimalType):
        digits = t.precision - t.scale
        ints = st.integers(-(10**digits) + 1, 10**digits - 1)
        return st.one_of(
            ints,
            st.decimals(
                min_value=-(10**digits) + 1,
                max_value=10**digits - 1,
                places=t.scale,
                allow_nan=False,
            ).map(lambda d: float(d) if repr(float(d)) == str(d) else int(d.to_integral_value())),
        ).filter(lambda v: len(_exact(v).normalize().as_tuple().digits) <= 15 or isinstance(v, int))
    if isinstance(t, BooleanType):
        return st.booleans()
    if isinstance(t, DateType):
        return st.dates().map(dt.date.isoformat)
    if isinstance(t, TimestampType | TimestampNTZType):
        return st.one_of(
            st.datetimes(timezones=st.sampled_from([None, dt.UTC])).map(dt.datetime.isoformat),
            st.integers(-(10**10), 10**10),
        )
    if isinstance(t, TimeType):
        return st.times().map(dt.time.isoformat)
    if isinstance(t, BinaryType):
        return st.one_of(st.binary(), st.text())
    if isinstance(t, NullType):
        return st.none()
    if isinstance(t, ArrayType):
        return st.lists(_domain(t.elementType), max_size=3)
    if isinstance(t, MapType):
        return st.dictionaries(st.text(max_size=3), _domain(t.valueType), max_size=3)
    if isinstance(t, StructType):
        return st.fixed_dictionaries({f.name: _domain(f.dataType) for f in t.fields})
    raise AssertionError(t)


@settings(max_examples=EXAMPLES, deadline=None)
@given(data=st.data(), t=spark_types)
def test_every_value_of_a_types_domain_converts(data: Any, t: DataType) -> None:
    value = data.draw(_domain(t))
    out = convert(value, t, "c")
    assert gives_back(value, out, t), (t.simpleString(), value, out)


@pytest.mark.parametrize(
    ("value", "dtype"),
    [
        (3, BinaryType()),
        (True, BinaryType()),
        ([1, 2], BinaryType()),
        ("2024-01-01junk", DateType()),
        ("2024-01-01T10:00:00", DateType()),
        (20240101, DateType()),
        ("5", LongType()),
        (True, LongType()),
        ("nan", DoubleType()),
        ("1.5", DoubleType()),
        (2**53 + 1, DoubleType()),
        (0.1, FloatType()),
        (True, TimestampType()),
        ("5", TimestampNTZType()),
        (0.0000001, TimestampType()),
        ("2024-01-01T00:00:00.1234567", TimestampType()),
        ("1.5", DecimalType(10, 2)),
        (1.005, DecimalType(10, 2)),
        (float("nan"), DecimalType(10, 2)),
        (1, BooleanType()),
        ("true", BooleanType()),
        ("abcd", CharType(3)),
        (1, NullType()),
        ({"a": 1}, ArrayType(LongType())),
        ([1], StructType([StructField("a", LongType())])),
    ],
)
def test_values_that_do_not_fit_raise_naming_the_column(value: Any, dtype: DataType) -> None:
    with pytest.raises(StashSourceError, match=r"^column 'qty': value .* does not fit"):
        convert(value, dtype, "qty")


def test_values_inside_nested_types_are_named_by_path() -> None:
    t = StructType([StructField("items", ArrayType(LongType()))])
    with pytest.raises(StashSourceError, match=r"column 'order\.items\[1\]': value '2'"):
        convert({"items": [1, "2"]}, t, "order")
    assert convert({"ITEMS": [1, 2]}, t, "order") == ([1, 2],)  # fields ignoring case


def test_types_without_a_json_form_are_refused_naming_the_column() -> None:
    from pyspark.sql.types import DayTimeIntervalType, VariantType

    for t in (DayTimeIntervalType(), VariantType(), ArrayType(DayTimeIntervalType())):
        with pytest.raises(StashSourceError, match=r"column 'c.*cannot read JSON values"):
            check_readable(t, "c")


# --------------------------------------------------------------- real Spark reads
def _collection(url: str) -> None:
    from stash import Antichain, Stash

    with Stash.open(url, fenced=False) as s:
        c = s.collection("stock")
        s.update_many(
            c,
            [
                (({"key": "a"}, {"Qty": 5, "day": "2024-02-29", "blob": "x"}), 0, 1),
                (({"key": "b"}, {"Qty": 7, "day": "2024-03-01", "blob": "yz"}), 0, 1),
            ],
        )
        bad = s.collection("bad")
        s.update_many(bad, [(({"key": "a"}, {"qty": "5", "day": "2024-02-29junk"}), 0, 1)])
        s.seal(c, Antichain.from_elem(1))
        s.seal(bad, Antichain.from_elem(1))


@pytest.mark.spark
def test_user_schema_names_match_ignoring_case_and_bad_values_raise(
    spark: Any, spark_store: Any
) -> None:
    url = spark_store.stash_url
    _collection(url)
    df = (
        spark.read.format("stash")
        .option("url", url)
        .schema("KEY string, qty bigint, DAY date, Blob binary")
    )
    rows = sorted(tuple(r) for r in df.load("stock").collect())
    assert rows == [
        ("a", 5, dt.date(2024, 2, 29), bytearray(b"x")),
        ("b", 7, dt.date(2024, 3, 1), bytearray(b"yz")),
    ]
    for ddl, column in (("key string, qty bigint", "qty"), ("key string, day date", "day")):
        bad = spark.read.format("stash").option("url", url).schema(ddl).load("bad")
        with pytest.raises(Exception, match=rf"column '{column}': value .* does not fit"):
            bad.collect()
