"""Updates tables: the Arrow schema of a shard's updates and conforming input to it.

A shard's updates are Arrow tables with the shard's key columns, value columns, ``_time``
(int64) and ``_diff`` (int64) (DESIGN section 5). :func:`updates_schema` builds that schema
from the key and value schemas; :func:`to_updates_table` turns rows or an Arrow table into
it, widening types where that is lossless.

Invariants kept here:

* an updates table has exactly the columns of :func:`updates_schema`, in its order and
  types; ``_time`` and ``_diff`` are non-null int64; column names never start with ``_``
  (reserved for persist) and keys and values share no name;
* a column is conformed only by a safe widening (:func:`is_safe_widening`); anything else
  raises :class:`~persist.errors.InvalidUsage` naming the column.
"""

import functools
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from persist.errors import InvalidUsage

TIME = "_time"
DIFF = "_diff"


# ------------------------------------------------------------------------- schemas


def is_supported_type(t: pa.DataType) -> bool:
    """Types that Arrow can sort, compare and round-trip through Parquet."""
    return bool(
        pa.types.is_integer(t)
        or pa.types.is_float32(t)
        or pa.types.is_float64(t)
        or pa.types.is_boolean(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_date(t)
        or pa.types.is_time(t)
        or pa.types.is_timestamp(t)
        or pa.types.is_duration(t)
        or pa.types.is_decimal(t)
    )


def updates_schema(key_schema: pa.Schema, value_schema: pa.Schema) -> pa.Schema:
    """The Arrow schema of a shard's updates: key columns, value columns, ``_time``,
    ``_diff`` (both non-null int64). Schema-level metadata is dropped.

    Column types must be sortable scalars: integers, float32/64, bool, (large) string,
    (large/fixed-size) binary, date, time, timestamp, duration, decimal.

    Raises:
        InvalidUsage: a name is empty, starts with ``_`` (reserved for persist, e.g.
            ``_time``/``_diff``), repeats within a schema or is shared by keys and values,
            or a column type is unsupported (nested, dictionary, view, float16, null).
    """
    if not isinstance(key_schema, pa.Schema) or not isinstance(value_schema, pa.Schema):
        raise InvalidUsage(
            "key_schema and value_schema must be pyarrow.Schema, got "
            f"{type(key_schema).__name__} and {type(value_schema).__name__}"
        )
    return _updates_schema(key_schema, value_schema)


@functools.lru_cache(maxsize=256)
def _updates_schema(key_schema: pa.Schema, value_schema: pa.Schema) -> pa.Schema:
    """:func:`updates_schema` after the type check (cached: writers call it per append)."""
    seen: dict[str, str] = {}
    for role, schema in (("key", key_schema), ("value", value_schema)):
        for f in schema:
            if f.name == "":
                raise InvalidUsage(f"{role} schema has a column with an empty name")
            if f.name.startswith("_"):
                raise InvalidUsage(
                    f"{role} column {f.name!r}: names starting with '_' are reserved for "
                    f"persist ({TIME!r}, {DIFF!r})"
                )
            if f.name in seen:
                where = (
                    f"twice in the {role} schema"
                    if seen[f.name] == role
                    else "in both the key and the value schema"
                )
                raise InvalidUsage(f"column {f.name!r} appears {where}")
            seen[f.name] = role
            if not is_supported_type(f.type):
                raise InvalidUsage(
                    f"{role} column {f.name!r} has unsupported type {f.type}: use a "
                    "sortable scalar type (integer, float32/64, bool, string, binary, "
                    "date, time, timestamp, duration, decimal)"
                )
    return pa.schema(
        [
            *key_schema,
            *value_schema,
            pa.field(TIME, pa.int64(), nullable=False),
            pa.field(DIFF, pa.int64(), nullable=False),
        ]
    )


# ------------------------------------------------------------------ updates tables


def is_safe_widening(src: pa.DataType, dst: pa.DataType) -> bool:
    """True when every ``src`` value is exactly representable as a ``dst`` value."""
    if src == dst:
        return True
    if pa.types.is_null(src):
        return True
    if pa.types.is_dictionary(src):
        return is_safe_widening(src.value_type, dst)
    if pa.types.is_integer(src) and pa.types.is_integer(dst):
        sb, db = src.bit_width, dst.bit_width
        if pa.types.is_signed_integer(src):
            return bool(pa.types.is_signed_integer(dst) and db >= sb)
        return bool(db >= sb if pa.types.is_unsigned_integer(dst) else db > sb)
    if pa.types.is_floating(src) and pa.types.is_floating(dst):
        return bool(dst.bit_width >= src.bit_width)
    if pa.types.is_integer(src) and pa.types.is_floating(dst):
        mantissa = {16: 11, 32: 24, 64: 53}[dst.bit_width]
        bits = src.bit_width - (1 if pa.types.is_signed_integer(src) else 0)
        return bool(bits <= mantissa)
    if pa.types.is_string(src) and pa.types.is_large_string(dst):
        return True
    if pa.types.is_binary(src) and pa.types.is_large_binary(dst):
        return True
    return False


def _conform_column(
    name: str, col: pa.ChunkedArray | pa.Array, field: pa.Field
) -> pa.ChunkedArray | pa.Array:
    if col.type != field.type:
        if not is_safe_widening(col.type, field.type):
            raise InvalidUsage(
                f"column {name!r} has type {col.type}, the schema says {field.type} "
                "(only safe widenings are cast)"
            )
        try:
            col = col.cast(field.type, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise InvalidUsage(
                f"column {name!r} of type {col.type} cannot be cast to {field.type}: {e}"
            ) from None
    if not field.nullable and col.null_count:
        raise InvalidUsage(f"column {name!r} has {col.null_count} nulls but is not nullable")
    return col


def _from_rows(rows: Sequence[Any], schema: pa.Schema, nkeys: int) -> pa.Table:
    nvals = len(schema) - 2 - nkeys
    keys: list[Any] = []
    vals: list[Any] = []
    times: list[Any] = []
    diffs: list[Any] = []
    for i, row in enumerate(rows):
        try:
            (k, v), t, d = row
        except (TypeError, ValueError):
            raise InvalidUsage(
                f"update {i} is not ((key_tuple, value_tuple), time, diff): {row!r:.200}"
            ) from None
        if not isinstance(k, (tuple, list)) or len(k) != nkeys:
            raise InvalidUsage(f"update {i}: key {k!r:.200} is not a tuple of {nkeys} values")
        if not isinstance(v, (tuple, list)) or len(v) != nvals:
            raise InvalidUsage(f"update {i}: value {v!r:.200} is not a tuple of {nvals} values")
        if isinstance(t, bool) or not isinstance(t, int):
            raise InvalidUsage(f"update {i}: time {t!r:.100} is not an int")
        if isinstance(d, bool) or not isinstance(d, int):
            raise InvalidUsage(f"update {i}: diff {d!r:.100} is not an int")
        keys.append(k)
        vals.append(v)
        times.append(t)
        diffs.append(d)
    columns: list[list[Any]] = [list(c) for c in zip(*keys, strict=True)] if keys else []
    if not columns:
        columns = [[] for _ in range(nkeys)]
    vcols: list[list[Any]] = [list(c) for c in zip(*vals, strict=True)] if vals else []
    if not vcols:
        vcols = [[] for _ in range(nvals)]
    arrays: list[pa.Array] = []
    for f, data in zip(schema, [*columns, *vcols, times, diffs], strict=True):
        try:
            arr = pa.array(data, type=f.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as e:
            raise InvalidUsage(
                f"column {f.name!r}: values do not fit type {f.type}: {str(e)[:200]}"
            ) from None
        if not f.nullable and arr.null_count:
            raise InvalidUsage(f"column {f.name!r} has {arr.null_count} nulls but is not nullable")
        arrays.append(arr)
    return pa.Table.from_arrays(arrays, schema=schema)


def to_updates_table(
    updates: pa.Table | pa.RecordBatch | Sequence[Any],
    key_schema: pa.Schema,
    value_schema: pa.Schema,
) -> pa.Table:
    """Normalise updates to a table with exactly :func:`updates_schema`'s columns.

    Args:
        updates: a ``pyarrow.Table`` or ``RecordBatch`` with the key columns, the value
            columns, ``_time`` and ``_diff`` (any order; matched by name; types equal or
            safely widened, e.g. int32 -> int64, string -> large_string, dictionary ->
            its value type), or a sequence of ``((key_tuple, value_tuple), time, diff)``.
        key_schema, value_schema: the shard's schemas.

    Returns:
        A table with the schema's columns in order (chunks as given).

    Raises:
        InvalidUsage: bad schemas; a column missing, extra, of another type (naming the
            column and both types), or null where it may not be (``_time``, ``_diff``
            and non-nullable fields); a malformed update row.
    """
    schema = updates_schema(key_schema, value_schema)
    if isinstance(updates, pa.RecordBatch):
        updates = pa.Table.from_batches([updates])
    if isinstance(updates, pa.Table):
        names = updates.column_names
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise InvalidUsage(f"updates have duplicate columns {dup}")
        missing = [f.name for f in schema if f.name not in names]
        extra = [n for n in names if schema.get_field_index(n) < 0]
        if missing or extra:
            raise InvalidUsage(
                f"updates columns do not match the shard schema: missing {missing}, "
                f"unexpected {extra}"
            )
        cols = [_conform_column(f.name, updates.column(f.name), f) for f in schema]
        return pa.Table.from_arrays(cols, schema=schema)
    if isinstance(updates, (str, bytes)) or not isinstance(updates, Sequence):
        raise InvalidUsage(
            "updates must be a pyarrow Table/RecordBatch or a list of "
            f"((key, value), time, diff), not {type(updates).__name__}"
        )
    return _from_rows(updates, schema, len(key_schema))
