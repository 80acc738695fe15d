"""How each Arrow column type of a persist shard reads back through Spark.

Spark has fewer types than Arrow, so the ``persist`` source reads some columns in a
wider or coarser Spark type (:func:`spark_read_type`) and converts each column's values to
it in the task (:func:`to_spark_column`):

* unsigned integers read as the next wider signed type: ``uint8`` -> ``smallint``,
  ``uint16`` -> ``int``, ``uint32`` -> ``bigint``, ``uint64`` -> ``decimal(20,0)``
  (every value exact);
* ``float16`` -> ``float``; ``date64`` -> ``date``; ``decimal256(p, s)`` with
  ``p <= 38`` -> ``decimal(p,s)`` (Spark's decimals hold at most 38 digits: a wider one
  raises, naming the column);
* ``time32``/``time64`` -> ``time(6)``; ``timestamp`` of any unit -> ``timestamp``
  (zoned) or ``timestamp_ntz`` (naive); ``duration`` -> ``interval day to second``:
  Spark keeps microseconds, so a nanosecond part is **truncated** to the microsecond at
  or before it (floor, as ``java.time``'s ``truncatedTo`` does:
  ``1969-12-31 23:59:59.999999999`` reads as ``...59.999999``). Two rows that differ
  only below the microsecond then read as equal values (each with its own diff).
  Spark itself has no such conversion to follow: PySpark 4.3's Parquet reader refuses
  ``TIMESTAMP(NANOS)`` (``PARQUET_TYPE_ILLEGAL``, or a ``bigint`` with
  ``spark.sql.legacy.parquet.nanosAsLong``) and ``createDataFrame`` of nanosecond pandas
  data refuses a lossy cast unless ``spark.sql.execution.pandas.convertToArrowArraySafely``
  is off (then Arrow truncates toward zero);
* ``large_string``/``large_binary`` -> ``string``/``binary``.

Invariants: every value of a column converts (no value is refused at read time: the
read type of each column is fixed at planning, from the shard's schema); only temporal
sub-microsecond parts are ever dropped, nothing else is rounded.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

#: Spark's widest decimal (``DecimalType.MAX_PRECISION``).
SPARK_MAX_DECIMAL_PRECISION = 38

_UNSIGNED_READ_TYPES: dict[pa.DataType, pa.DataType] = {
    pa.uint8(): pa.int16(),
    pa.uint16(): pa.int32(),
    pa.uint32(): pa.int64(),
    pa.uint64(): pa.decimal128(20, 0),
}

_UNITS_PER_SECOND = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}


class UnreadableColumn(ValueError):
    """A column's Arrow type has no Spark type that holds every value."""


def spark_read_type(field: pa.Field, where: str = "") -> pa.DataType:
    """The Arrow type whose Spark type (PySpark's ``from_arrow_type``) a column of
    ``field``'s type reads as (the module docstring lists them); ``where`` names the
    shard in errors.

    Raises:
        UnreadableColumn: a ``decimal256`` wider than Spark's 38 digits (names the column).
    """
    t = field.type
    if t in _UNSIGNED_READ_TYPES:
        return _UNSIGNED_READ_TYPES[t]
    if pa.types.is_float16(t):
        return pa.float32()
    if pa.types.is_date64(t):
        return pa.date32()
    if pa.types.is_time(t):
        return pa.time64("us")
    if pa.types.is_timestamp(t) and t.unit == "ns":
        return pa.timestamp("us", t.tz)
    if pa.types.is_duration(t) and t.unit == "ns":
        return pa.duration("us")
    if pa.types.is_decimal(t) and t.bit_width == 256:
        if t.precision > SPARK_MAX_DECIMAL_PRECISION:
            raise UnreadableColumn(
                f"column {field.name!r}{where} is {t}: Spark's decimal holds at most "
                f"{SPARK_MAX_DECIMAL_PRECISION} digits, so the source cannot read it"
            )
        return pa.decimal128(t.precision, t.scale)
    return t


def spark_read_schema(schema: pa.Schema, where: str = "") -> pa.Schema:
    """``schema`` with each field's type replaced by :func:`spark_read_type`.

    Raises:
        UnreadableColumn: as :func:`spark_read_type`.
    """
    return pa.schema([f.with_type(spark_read_type(f, where)) for f in schema])


def _floor_units(col: Any, source_unit: str, target_unit: str) -> Any:
    """The int64 counts of ``source_unit`` in ``col`` floored to whole ``target_unit``s
    and expressed in them (nulls kept)."""
    factor = _UNITS_PER_SECOND[source_unit] // _UNITS_PER_SECOND[target_unit]
    ints = col.cast(pa.int64())
    q = pc.divide(ints, factor)  # integer division truncates toward zero
    below = pc.and_(pc.less(ints, 0), pc.not_equal(pc.multiply(q, factor), ints))
    return pc.subtract(q, pc.cast(below, pa.int64()))


def to_spark_column(col: Any, target: pa.DataType) -> Any:
    """``col`` (an Arrow array or chunked array) converted to ``target``, the Arrow type
    Spark expects for its column: a plain cast, except that a timestamp, time or
    duration finer than ``target``'s unit is floored to it (see the module docstring).

    Raises:
        pyarrow.ArrowInvalid: a value does not fit ``target`` (cannot happen for the
            types :func:`spark_read_type` gives).
    """
    t = col.type
    if t == target:
        return col
    temporal = (
        (pa.types.is_timestamp(t) and pa.types.is_timestamp(target))
        or (pa.types.is_time(t) and pa.types.is_time(target))
        or (pa.types.is_duration(t) and pa.types.is_duration(target))
    )
    if temporal and _UNITS_PER_SECOND[t.unit] > _UNITS_PER_SECOND[target.unit]:
        return _floor_units(col, t.unit, target.unit).cast(target)
    return col.cast(target)
