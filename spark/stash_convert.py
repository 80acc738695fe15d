"""JSON values of a stash collection converted to the Spark type of their column.

The ``stash`` source reads a decoded JSON key or value (``None``, ``bool``, ``int``,
``float``, ``str``, ``bytes`` from the ``bytes`` codec, ``list``, ``dict``) into the
column type a user schema gives. A value converts only when the column's type holds it
exactly; anything else raises :class:`StashSourceError` naming the column (with the path
inside an array, map or struct), the value and the type:

==========================  ====================================================
Spark type                  accepted values
==========================  ====================================================
``string``                  a string as it is; any other value as its JSON text
                            (``bytes`` as base64; with ``as_json`` strings too)
``char(n)``/``varchar(n)``  a string of at most ``n`` characters
``tinyint`` .. ``bigint``   an integer (or a whole float) in the type's range
``float``, ``double``       an integer or float the type holds exactly (NaN, ±inf,
                            -0.0 included)
``decimal(p,s)``            an integer or finite float whose decimal digits (its
                            JSON text) fit ``p`` and ``s``
``boolean``                 ``true``/``false`` only
``date``                    an ISO 8601 date string (``"2024-02-29"``)
``timestamp``/``_ntz``      an ISO 8601 date-time string (at most microseconds; a
                            zone-less one is UTC for ``timestamp``, a zoned one is
                            its UTC wall clock for ``timestamp_ntz``), or epoch
                            seconds (integer, or a float of whole microseconds)
``time``                    an ISO 8601 time-of-day string, at most microseconds
``binary``                  ``bytes`` as they are, a string as its UTF-8 bytes
``array<t>``                a list, each element converted to ``t``
``map<k,v>``                an object, keys converted to ``k``, values to ``v``
``struct<...>``             an object: each field by name (as Spark resolves names,
                            ignoring case when no field matches exactly); missing
                            fields are null, others ignored
``void``                    only null
==========================  ====================================================

So ``"5"`` does not read into ``bigint``, nor ``"nan"`` into ``double``, ``true`` into
``timestamp``, ``3`` into ``binary`` or ``"2024-01-01junk"`` into ``date``. Other types
(intervals, variant, geometry) are refused when the read is planned
(:func:`check_readable`). Null is null in every type. No value is coerced from another
JSON kind (a string is never parsed as a number, nor a number read as a boolean), and
none is rounded.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import math
import re
import struct
from typing import Any

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


class StashSourceError(ValueError):
    """A stash collection cannot be read as asked (missing option or collection, bad
    schema, a value that does not fit its column, a negative multiplicity)."""


_INT_BITS: tuple[tuple[type[DataType], int], ...] = (
    (ByteType, 8),
    (ShortType, 16),
    (IntegerType, 32),
    (LongType, 64),
)

_SCALARS = (
    StringType,
    CharType,
    VarcharType,
    BooleanType,
    FloatType,
    DoubleType,
    DecimalType,
    DateType,
    TimestampType,
    TimestampNTZType,
    TimeType,
    BinaryType,
    NullType,
    *(cls for cls, _ in _INT_BITS),
)

#: More than six digits after the seconds' decimal point: finer than Spark's microseconds.
_SUB_MICROS = re.compile(r"[.,]\d{7,}")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_FLOAT32_MAX = 3.4028234663852886e38


def _int_bits(dtype: DataType) -> int | None:
    for cls, bits in _INT_BITS:
        if isinstance(dtype, cls):
            return bits
    return None


def check_readable(dtype: DataType, column: str) -> None:
    """Raise :class:`StashSourceError` naming ``column`` if the source cannot read a
    column of ``dtype`` (see the module docstring for the types it can)."""
    if isinstance(dtype, ArrayType):
        check_readable(dtype.elementType, f"{column}[]")
    elif isinstance(dtype, MapType):
        check_readable(dtype.keyType, f"{column}.key")
        check_readable(dtype.valueType, f"{column}.value")
    elif isinstance(dtype, StructType):
        for f in dtype.fields:
            check_readable(f.dataType, f"{column}.{f.name}")
    elif not isinstance(dtype, _SCALARS):
        raise StashSourceError(
            f"column {column!r}: the stash source cannot read JSON values into "
            f"{dtype.simpleString()}; use a string column (JSON text) and convert it in Spark"
        )


def find_field(fields: list[StructField] | list[str], name: str) -> int | None:
    """The index of the field (or name) ``name`` resolves to as Spark resolves column
    names: the one named exactly so, else the only one equal ignoring case; ``None``
    when there is none (or several equal ignoring case, none exactly)."""
    names = [f if isinstance(f, str) else f.name for f in fields]
    if name in names:
        return names.index(name)
    matches = [i for i, n in enumerate(names) if n.lower() == name.lower()]
    return matches[0] if len(matches) == 1 else None


def _fail(reason: str) -> Any:
    raise ValueError(reason)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _to_int(value: Any, bits: int) -> int:
    if not _is_number(value) or (isinstance(value, float) and not value.is_integer()):
        _fail("not an integer")
    n = int(value)
    if not -(2 ** (bits - 1)) <= n < 2 ** (bits - 1):
        _fail(f"out of the {bits}-bit range")
    return n


def _to_float(value: Any, single: bool) -> float:
    if not _is_number(value):
        _fail("not a number")
    try:
        f = float(value)
    except OverflowError:
        _fail("too large for a floating-point number")
    if single and math.isfinite(f):
        if abs(f) > _FLOAT32_MAX:
            _fail("out of the 32-bit float range")
        narrowed = struct.unpack("f", struct.pack("f", f))[0]
        if narrowed != f:
            _fail("not exactly a 32-bit float")
    if isinstance(value, int) and (not math.isfinite(f) or int(f) != value):
        _fail("not exactly representable as a floating-point number")
    return f


def _to_decimal(value: Any, dtype: DecimalType) -> decimal.Decimal:
    """``value`` at ``dtype``'s scale, exactly (a float by its JSON text, ``repr``)."""
    if not _is_number(value):
        _fail("not a number")
    d = decimal.Decimal(repr(value)) if isinstance(value, float) else decimal.Decimal(value)
    if not d.is_finite():
        _fail("not a finite number")
    sign, digits, exp = d.as_tuple()
    assert isinstance(exp, int)
    while exp < 0 and len(digits) > 1 and digits[-1] == 0:  # 1.50 is 1.5
        digits, exp = digits[:-1], exp + 1
    if digits == (0,):
        digits, exp = (), 0
    places = max(-exp, 0)
    if places > dtype.scale:
        _fail(f"has more than {dtype.scale} decimal places")
    if len(digits) + exp > dtype.precision - dtype.scale:
        _fail(f"needs more than decimal({dtype.precision},{dtype.scale}) holds")
    scaled = (
        digits + (0,) * (exp + dtype.scale) if exp >= 0 else digits + (0,) * (dtype.scale - places)
    )
    return decimal.Decimal((sign, scaled or (0,), -dtype.scale))


def _iso_text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        _fail(f"not an ISO 8601 {what} string")
    if _SUB_MICROS.search(value):
        _fail("finer than microseconds")
    return str(value)


def _to_timestamp(value: Any, zoned: bool) -> dt.datetime:
    if _is_number(value):
        us = decimal.Decimal(repr(value) if isinstance(value, float) else value) * 10**6
        if not us.is_finite() or us != us.to_integral_value():
            _fail("epoch seconds finer than microseconds")
        ts = _EPOCH + dt.timedelta(microseconds=int(us))
    else:
        ts = dt.datetime.fromisoformat(_iso_text(value, "date-time"))
    if zoned and ts.tzinfo is None:
        ts = ts.replace(tzinfo=dt.UTC)
    if not zoned and ts.tzinfo is not None:
        ts = ts.astimezone(dt.UTC).replace(tzinfo=None)
    return ts


def _to_string(value: Any, dtype: DataType, as_json: bool) -> str:
    if isinstance(dtype, CharType | VarcharType):
        if not isinstance(value, str):
            _fail("not a string")
        if len(value) > dtype.length:
            _fail(f"longer than {dtype.length} characters")
        return value
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, str) and not as_json:
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _convert(value: Any, dtype: DataType, column: str, as_json: bool) -> Any:
    if value is None:
        return None
    try:
        if isinstance(dtype, StringType | CharType | VarcharType):
            return _to_string(value, dtype, as_json)
        bits = _int_bits(dtype)
        if bits is not None:
            return _to_int(value, bits)
        if isinstance(dtype, DoubleType | FloatType):
            return _to_float(value, isinstance(dtype, FloatType))
        if isinstance(dtype, BooleanType):
            return value if isinstance(value, bool) else _fail("not a boolean")
        if isinstance(dtype, DecimalType):
            return _to_decimal(value, dtype)
        if isinstance(dtype, TimestampType | TimestampNTZType):
            return _to_timestamp(value, isinstance(dtype, TimestampType))
        if isinstance(dtype, DateType):
            return dt.date.fromisoformat(_iso_text(value, "date"))
        if isinstance(dtype, TimeType):
            t = dt.time.fromisoformat(_iso_text(value, "time"))
            return t if t.tzinfo is None else _fail("a time of day with a zone")
        if isinstance(dtype, BinaryType):
            if isinstance(value, str):
                return value.encode("utf-8")
            if isinstance(value, bytes | bytearray):
                return bytes(value)
            return _fail("not bytes or a string")
        if isinstance(dtype, NullType):
            return _fail("not null (a void column holds only nulls)")
    except (TypeError, ValueError, decimal.InvalidOperation, OverflowError) as e:
        raise StashSourceError(
            f"column {column!r}: value {value!r:.200} does not fit {dtype.simpleString()}: {e}"
        ) from None
    return _convert_nested(value, dtype, column)


def _convert_nested(value: Any, dtype: DataType, column: str) -> Any:
    def wrong(kind: str) -> StashSourceError:
        return StashSourceError(
            f"column {column!r}: value {value!r:.200} does not fit "
            f"{dtype.simpleString()}: not {kind}"
        )

    if isinstance(dtype, ArrayType):
        if not isinstance(value, list):
            raise wrong("an array")
        return [
            _convert(x, dtype.elementType, f"{column}[{i}]", False) for i, x in enumerate(value)
        ]
    if isinstance(dtype, MapType):
        if not isinstance(value, dict):
            raise wrong("an object")
        out = {}
        for k, v in value.items():
            key = _convert(k, dtype.keyType, f"{column}.key", False)
            out[key] = _convert(v, dtype.valueType, f"{column}[{k}]", False)
        return out
    if isinstance(dtype, StructType):
        if not isinstance(value, dict):
            raise wrong("an object")
        names = list(value)
        row = []
        for f in dtype.fields:
            i = find_field(names, f.name)
            x = None if i is None else value[names[i]]
            row.append(_convert(x, f.dataType, f"{column}.{f.name}", False))
        return tuple(row)
    check_readable(dtype, column)
    raise AssertionError(f"unhandled type {dtype!r}")  # pragma: no cover


def convert(value: Any, dtype: DataType, column: str, as_json: bool = False) -> Any:
    """``value`` (a decoded JSON value) as what Spark expects for ``dtype`` (the module
    docstring's table); with ``as_json`` (a string column of mixed or nested values)
    every value, strings included, becomes its JSON text, so ``1`` and ``"1"`` stay
    apart. Returns ``None`` for ``None``; a struct as a tuple in its fields' order.

    Raises:
        StashSourceError: the value does not fit (names the column, with the path inside
            nested types, the value and the type), or the type is not readable.
    """
    return _convert(value, dtype, column, as_json)
