"""Casts of values into a column's type: exact, within one kind of values, or refused.

One definition for every path that puts a value a user gave (an update's ``set``, a
merge's clause values, whether computed by Arrow, DuckDB or Spark) into a shard's
column: :func:`set_scalar` for a Python or Arrow scalar, :func:`cast_column` for an array.

Invariants kept here:

* a value is cast only within its kind (:func:`kind`: numbers, decimals, booleans,
  strings, binaries, and each temporal kind), numbers and decimals into each other:
  never a string parsed into a number or a date;
* a cast is Arrow's safe cast: no float truncated into an integer, no overflow, no finer
  time truncated to a coarser unit; a finite float never becomes an infinity;
* a null never lands in a non-nullable column;
* every refusal is :class:`~persist.errors.InvalidUsage` naming the column, its type and
  the rule, and the value (printed exactly, by Arrow).
"""

from __future__ import annotations

import math
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from persist.errors import InvalidUsage

__all__ = ["cast_column", "cast_scalar", "kind", "python_scalar", "set_scalar", "shown"]


def python_scalar(v: Any, field: pa.Field, column: str) -> pa.Scalar:
    """A Python value as a scalar of ``field``'s type, exactly or refused: Arrow's
    conversion (``pyarrow.scalar(v, type)``) refuses a value of another kind, and the
    value converted by its own type and cast safely (``Scalar.cast(safe=True)``)
    must agree: no float truncated into an integer, no finer time truncated to a
    coarser unit, no finite float overflowed into ``float32``'s infinity."""
    t = field.type
    try:
        out = pa.scalar(v, t)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        raise InvalidUsage(f"update: set value {v!r} for column {column!r} ({t}): {e}") from None
    except (OverflowError, TypeError, ValueError) as e:
        raise InvalidUsage(
            f"update: set value {v!r} for column {column!r} ({t}) does not fit: {e}"
        ) from None
    try:
        own = pa.scalar(v)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
        return out  # e.g. an int beyond int64 for uint64: the conversion checked its range
    if own.type == t or (pa.types.is_integer(own.type) and pa.types.is_decimal(t)):
        return out  # the conversion of an int to a decimal is exact or refused
    return cast_scalar(own, field, column)


def kind(t: pa.DataType) -> str:
    for kind, test in (
        ("number", lambda t: pa.types.is_integer(t) or pa.types.is_floating(t)),
        ("decimal", pa.types.is_decimal),
        ("bool", pa.types.is_boolean),
        ("string", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)),
        ("binary", lambda t: pa.types.is_binary(t) or pa.types.is_large_binary(t)),
        ("timestamp", pa.types.is_timestamp),
        ("date", pa.types.is_date),
        ("time", pa.types.is_time),
        ("duration", pa.types.is_duration),
    ):
        if test(t):
            return kind
    return str(t)


def shown(v: pa.Scalar) -> str:
    """An Arrow scalar for a message (Arrow's string cast: exact, and never an
    ``OverflowError`` from a value Python cannot hold)."""
    try:
        return str(pc.cast(pa.array([v]), pa.string())[0].as_py())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return f"<{v.type} scalar>"


def cast_scalar(v: pa.Scalar, field: pa.Field, column: str) -> pa.Scalar:
    """An Arrow scalar as one of ``field``'s type, by a safe cast within its kind
    (numbers, decimals, strings, binaries, each temporal kind: never a string parsed
    into a number), refusing a finite float that overflows into an infinity."""
    t = field.type
    kinds = {kind(v.type), kind(t)}
    if len(kinds) > 1 and kinds != {"number", "decimal"}:
        raise InvalidUsage(
            f"update: set value {shown(v)} of type {v.type} does not fit column {column!r} ({t})"
        )
    try:
        out = v.cast(t, safe=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        raise InvalidUsage(
            f"update: set value {shown(v)} for column {column!r} ({t}): {e}"
        ) from None
    if (
        pa.types.is_floating(t)
        and out.is_valid
        and math.isinf(out.as_py())
        and not (pa.types.is_floating(v.type) and math.isinf(v.as_py()))
    ):
        raise InvalidUsage(f"update: set value {shown(v)} overflows column {column!r} ({t})")
    return out


def set_scalar(v: Any, field: pa.Field, column: str) -> pa.Scalar:
    """A ``set`` value (a Python value, an Arrow scalar or ``None``) as a scalar of
    ``field``'s type, converted exactly (see :func:`python_scalar`).

    Raises:
        InvalidUsage: the value is of another kind (e.g. a string for an integer
            column), loses information (``1.9`` into ``int64``, microseconds into a
            ``duration[s]``), is out of range (``2**70`` into ``int64``), or is null
            for a non-nullable column; naming the column.
    """
    if isinstance(v, pa.Scalar):
        out = cast_scalar(v, field, column)
    elif v is None:
        out = pa.scalar(None, field.type)
    else:
        out = python_scalar(v, field, column)
    if not out.is_valid and not field.nullable:
        raise InvalidUsage(f"update: set gives nulls to the non-nullable column {column!r}")
    return out


def cast_column(arr: pa.Array | pa.ChunkedArray, field: pa.Field, what: str) -> pa.ChunkedArray:
    """``arr`` cast to ``field``'s type under this module's rules (within a kind,
    Arrow's safe cast, no finite float made infinite, no null in a non-nullable
    column).

    Args:
        what: the values' description for messages (``"merge: the value of 'n' in
            when_matched_update (clause 1 of its kind)"``).

    Raises:
        InvalidUsage: the values do not fit (naming the column, the types and the rule).
    """
    t = field.type
    have = arr.type
    kinds = {kind(have), kind(t)}
    if not pa.types.is_null(have) and len(kinds) > 1 and kinds != {"number", "decimal"}:
        raise InvalidUsage(
            f"{what} gives {have} values to column {field.name!r} ({t}); a value is cast "
            "only within its kind (numbers, text, each temporal kind); nothing was committed"
        )
    try:
        out = pc.cast(arr, t, safe=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        raise InvalidUsage(
            f"{what} does not fit column {field.name!r} ({t}): {e}; nothing was committed"
        ) from None
    if pa.types.is_floating(t) and len(out):
        made_inf = pc.and_(pc.is_inf(out), pc.invert(_is_inf(arr)))
        if pc.any(pc.fill_null(made_inf, False)).as_py():
            raise InvalidUsage(
                f"{what} overflows column {field.name!r} ({t}); nothing was committed"
            )
    if not field.nullable and out.null_count:
        raise InvalidUsage(
            f"{what} gives nulls to the non-nullable column {field.name!r}; nothing was committed"
        )
    return out if isinstance(out, pa.ChunkedArray) else pa.chunked_array([out])


def _is_inf(arr: pa.Array | pa.ChunkedArray) -> Any:
    """Per value, whether it is an infinite float (``False`` for other types)."""
    if pa.types.is_floating(arr.type):
        return pc.fill_null(pc.is_inf(arr), False)
    return pa.repeat(pa.scalar(False), len(arr))
