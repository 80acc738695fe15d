"""Key identity: when two rows of a shard have the same key, as consolidation defines it.

Consolidation (:mod:`persist.consolidation`) treats two values as equal when they are
equal values, with nulls equal to nulls, every NaN equal to every NaN, ``-0.0`` equal to
``0.0``, and temporal values equal exactly when their stored integers (their ticks in
the column's unit: nanoseconds for ``timestamp[ns]``, ``time64[ns]``,
``duration[ns]``) are equal.  Every path that compares keys (the handle's and the
transaction's row changes, the Spark table and stream sink) must use that same
equality, or a change replaces one row in one path and keeps two live in another.
This module is the one definition.  Nothing else compares keys: not Arrow's kernels on
the raw columns (``is_in``, a hash join and ``group_by`` tell ``-0.0`` from ``0.0``, a
join matches no null, ``min_max`` has no ``duration`` kernel) and not Python objects
(``to_pylist`` truncates ``time64[ns]`` and ``duration[ns]`` to microseconds).

The invariant :func:`identity_columns` keeps: for two rows ``a`` and ``b`` (of one table
or of two tables encoded with the same ``null_flags``), their identity columns are equal
under *plain* Arrow equality (``pc.equal``, ``is_in``, a hash join, ``group_by``,
``sort_indices`` placing them next to each other) exactly when consolidation would take
the two keys for one.  Identity columns never hold a null or a float:

* integers, booleans, strings, binaries, fixed-size binaries and decimals are their own
  identity (Arrow compares them by value);
* temporal types (dates, times, timestamps, durations) become their stored integers
  (``int32`` or ``int64``, a zero-copy view): exact at every unit, for every kernel;
* floats become ``uint64`` codes of their IEEE-754 bits with ``-0.0`` made ``0.0`` and
  every NaN one NaN, ordered as the numbers are (NaN after ``+inf``), as
  :func:`persist.consolidation._float_codes` orders them;
* a null becomes the column's zero (``0``, ``""``, ``False``...) plus ``True`` in a
  companion null-flag column, present when ``null_flags`` asks for it (by default: when
  the column holds a null).  Two tables compared with each other must be encoded with
  the same flags: :func:`aligned` does that.

The output columns are named ``"\\x00key:<i>"`` and ``"\\x00null:<i>"`` (``i`` the key
column's position), and the helpers here never put them in one table with the caller's
columns, so no shard column name can collide with them.

Built on it: :func:`duplicate_key` (two rows with one key), :func:`isin` (rows of one
table whose key is one of another's: the semi-join), :func:`key_bounds` and
:func:`key_filter` (a pruning filter keeping at least the rows with given keys, for
every key type; no range where Arrow has no ordering kernel).
"""

from __future__ import annotations

import decimal
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = [
    "ROW",
    "aligned",
    "duplicate_key",
    "identity_columns",
    "identity_name",
    "isin",
    "key_bounds",
    "key_filter",
    "null_flags",
    "show_key",
    "view_int",
]

#: The row-position column the helpers add to identity tables (a control character:
#: never produced by :func:`identity_columns`).
ROW = "\x00row"

_NAN_CODE = np.uint64(0xFFF8000000000000)  # above the code of +inf (0xFFF0000000000000)
_SIGN = np.int64(-(2**63))


def identity_name(i: int) -> str:
    """The name of the identity column of the ``i``-th key column."""
    return f"\x00key:{i}"


def _null_name(i: int) -> str:
    return f"\x00null:{i}"


def _float_identity(arr: pa.Array) -> pa.Array:
    """``uint64`` codes of a float array: order-preserving, ``-0.0`` = ``0.0``, one NaN;
    null rows get code 0 (the caller flags them)."""
    f = np.asarray(pc.fill_null(arr, 0).to_numpy(zero_copy_only=False), dtype=np.float64)
    nan = np.isnan(f)
    bits = (f + 0.0).view(np.int64)  # + 0.0 turns -0.0 into 0.0
    codes = np.where(bits < 0, ~bits, bits | _SIGN).view(np.uint64)
    codes[nan] = _NAN_CODE
    if arr.null_count:
        codes[np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)] = 0
    return pa.array(codes, pa.uint64())


def _zero(t: pa.DataType) -> pa.Scalar:
    """The value a null takes in an identity column of type ``t``."""
    if pa.types.is_boolean(t):
        return pa.scalar(False, t)
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pa.scalar("", t)
    if pa.types.is_fixed_size_binary(t):
        return pa.scalar(b"\x00" * t.byte_width, t)
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return pa.scalar(b"", t)
    if pa.types.is_decimal(t):
        return pa.scalar(decimal.Decimal(0), t)
    return pa.scalar(0, t)


def _identity(col: pa.ChunkedArray | pa.Array) -> pa.Array | pa.ChunkedArray:
    """One column's identity values (nulls kept as nulls; see :func:`identity_columns`)."""
    t = col.type
    if pa.types.is_dictionary(t):
        col = col.cast(t.value_type)
        t = t.value_type
    if pa.types.is_floating(t):
        arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        codes = _float_identity(arr.cast(pa.float64()))
        if arr.null_count:
            codes = pc.if_else(arr.is_null(), pa.scalar(None, pa.uint64()), codes)
        return codes
    if pa.types.is_temporal(t):
        return view_int(col)
    return col


def view_int(col: pa.ChunkedArray | pa.Array) -> pa.Array | pa.ChunkedArray:
    """A temporal column's stored integers (``int32`` or ``int64``; zero-copy)."""
    as_int = pa.int32() if col.type.bit_width == 32 else pa.int64()
    if isinstance(col, pa.ChunkedArray):
        return pa.chunked_array([c.view(as_int) for c in col.chunks], as_int)
    return col.view(as_int)


def null_flags(tables: Sequence[pa.Table], key_names: Sequence[str]) -> list[bool]:
    """Per key column, whether any of ``tables`` holds a null in it: the ``null_flags``
    that make the identity columns of ``tables`` comparable with each other."""
    return [any(t.column(k).null_count > 0 for t in tables) for k in key_names]


def identity_columns(
    table: pa.Table, key_names: Sequence[str], *, null_flags: Sequence[bool] | None = None
) -> pa.Table:
    """The identity columns of ``table``'s ``key_names`` (module docstring): a table of
    ``table.num_rows`` rows, for key column ``i`` a column :func:`identity_name` ``(i)``
    and, where ``null_flags[i]``, a boolean null-flag column after it; no nulls, no
    floats.  Plain Arrow equality on them is key identity as consolidation defines it.

    Args:
        table: any table holding the ``key_names`` columns (of the types a shard takes;
            a dictionary column is decoded).
        key_names: the key columns, in order (any column names: e.g. key and value
            columns for a whole row's identity).
        null_flags: per key column, whether to add its null flag; ``None``: where the
            column holds a null (two tables compared must use the same flags: see
            :func:`aligned`).

    Raises:
        ValueError: ``null_flags`` has not one entry per key column, or a column
            holding a null is given no flag.
    """
    flags = (
        [table.column(k).null_count > 0 for k in key_names]
        if null_flags is None
        else list(null_flags)
    )
    if len(flags) != len(key_names):
        raise ValueError("identity_columns: null_flags needs one entry per key column")
    arrays: list[pa.Array | pa.ChunkedArray] = []
    names: list[str] = []
    for i, (k, flag) in enumerate(zip(key_names, flags, strict=True)):
        col = table.column(k)
        ident = _identity(col)
        if ident.null_count:
            if not flag:
                raise ValueError(f"identity_columns: column {k!r} holds nulls but has no flag")
            ident = pc.fill_null(ident, _zero(ident.type))
        arrays.append(ident)
        names.append(identity_name(i))
        if flag:
            arrays.append(col.is_null())
            names.append(_null_name(i))
    return pa.Table.from_arrays(arrays, names=names)


def _common(types: Sequence[pa.DataType]) -> pa.DataType | None:
    """The type to compare identity columns of ``types`` in, or ``None`` when they are
    one type already."""
    if all(t == types[0] for t in types):
        return None
    if all(pa.types.is_string(t) or pa.types.is_large_string(t) for t in types):
        return pa.large_string()
    if all(pa.types.is_binary(t) or pa.types.is_large_binary(t) for t in types):
        return pa.large_binary()
    raise ValueError(f"key columns of different types cannot be compared: {list(types)}")


def aligned(tables: Sequence[pa.Table], key_names: Sequence[str]) -> list[pa.Table]:
    """The identity columns of each of ``tables`` (same ``key_names``), encoded to be
    compared with each other: the same null flags (:func:`null_flags`), and string or
    binary columns of different widths (``string``/``large_string``) made one type.

    Raises:
        ValueError: a key column has types that cannot be compared (e.g. int and
            string).
    """
    flags = null_flags(tables, key_names)
    ids = [identity_columns(t, key_names, null_flags=flags) for t in tables]
    if len(ids) < 2 or not ids[0].num_columns:
        return ids
    for name in ids[0].column_names:
        common = _common([t.schema.field(name).type for t in ids])
        if common is not None:
            ids = [
                t.set_column(t.schema.get_field_index(name), name, t.column(name).cast(common))
                for t in ids
            ]
    return ids


def _with_row(ident: pa.Table) -> pa.Table:
    return ident.append_column(ROW, pa.array(np.arange(ident.num_rows), pa.int64()))


def duplicate_key(table: pa.Table, key_names: Sequence[str]) -> int | None:
    """The position of a row of ``table`` whose key another row has too (the first row
    of the first such key, in row order), or ``None`` when every key is distinct (by
    key identity)."""
    if table.num_rows < 2:
        return None
    if not key_names:
        return 0
    ident = _with_row(identity_columns(table, key_names))
    keys = [n for n in ident.column_names if n != ROW]
    g = ident.group_by(keys, use_threads=False).aggregate([(ROW, "count"), (ROW, "min")])
    dup = g.filter(pc.field(f"{ROW}_count") > 1)
    if not dup.num_rows:
        return None
    return int(pc.min(dup.column(f"{ROW}_min")).as_py())


def isin(left: pa.Table, right: pa.Table, key_names: Sequence[str]) -> pa.ChunkedArray:
    """Per row of ``left``, whether its key (the ``key_names`` columns, which may also
    be a whole row's key and value columns) is one of ``right``'s keys, by key
    identity: a boolean array of ``left.num_rows`` entries, never null (a hash
    semi-join on the identity columns)."""
    n = left.num_rows
    if n == 0 or right.num_rows == 0:
        return pa.chunked_array([pa.array(np.zeros(n, dtype=bool), pa.bool_())])
    if not key_names:
        return pa.chunked_array([pa.array(np.ones(n, dtype=bool), pa.bool_())])
    lid, rid = aligned([left, right], key_names)
    keys = lid.column_names
    hit = _with_row(lid).join(rid, keys=keys, join_type="left semi", use_threads=False)
    mask = np.zeros(n, dtype=bool)
    mask[np.asarray(hit.column(ROW).to_numpy(), dtype=np.int64)] = True
    return pa.chunked_array([pa.array(mask, pa.bool_())])


def _float_values(col: pa.ChunkedArray) -> pa.Array:
    """The distinct non-NaN values of a float column, with ``-0.0`` and ``0.0`` both
    present when either is (a filter's ``is_in`` tells them apart)."""
    values = pc.unique(pc.drop_null(col))
    values = values.filter(pc.invert(pc.is_nan(values)))
    if len(values) and pc.any(pc.equal(values, pa.scalar(0.0, values.type))).as_py():
        values = pc.unique(pa.concat_arrays([values, pa.array([0.0, -0.0], values.type)]))
    return values


def key_bounds(col: pa.ChunkedArray | pa.Array) -> tuple[pa.Scalar, pa.Scalar] | None:
    """The least and greatest non-null value of a key column, as scalars of its type,
    usable in a filter that part statistics can prune by; ``None`` when the column has
    no non-null value, is floating-point (NaN lies in no range and the statistics hold
    no float column) or has no ordering kernel.  Temporal columns (``duration``
    included, which has no ``min_max`` kernel) are bounded through their stored
    integers, exactly."""
    t = col.type
    if pa.types.is_floating(t) or pa.types.is_dictionary(t) or len(col) == col.null_count:
        return None
    try:
        if pa.types.is_temporal(t):
            ints = view_int(col)
            mm = pc.min_max(ints)
            lo, hi = (pa.scalar(mm[f].as_py(), ints.type).cast(t) for f in ("min", "max"))
        else:
            mm = pc.min_max(col)
            lo, hi = mm["min"], mm["max"]
        empty = pa.array([], t)
        pc.greater_equal(empty, lo)  # a comparison kernel exists for the type
    except (pa.ArrowNotImplementedError, pa.ArrowTypeError, pa.ArrowInvalid):
        return None
    return lo, hi


def key_filter(rows: pa.Table, key_names: Sequence[str]) -> pc.Expression | None:
    """A filter keeping at least the rows whose key is one of ``rows``' keys (by key
    identity), for the statistics pruning of a read: per key column its
    :func:`key_bounds` range where there is one (part statistics prune by ranges: Arrow
    does not simplify ``is_in`` under a range) and an ``isin`` of its values, anded
    over the key columns; a float column's ``isin`` holds both zeros when it holds
    one, and ``is_nan`` is ored in when it holds a NaN; ``is_null`` is ored in when it
    holds a null.  The caller keeps the exact rows with :func:`isin`.  ``None`` when
    ``rows`` is empty."""
    if rows.num_rows == 0:
        return None
    out: pc.Expression | None = None
    for k in key_names:
        col = rows.column(k)
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        field = pc.field(k)
        if pa.types.is_floating(col.type):
            values = _float_values(col)
            e: pc.Expression | None = field.isin(values) if len(values) else None
            if pc.any(pc.is_nan(pc.drop_null(col))).as_py():
                e = field.is_nan() if e is None else e | field.is_nan()
        else:
            values = pc.unique(pc.drop_null(col))
            e = field.isin(values) if len(values) else None
            bounds = key_bounds(col)
            if bounds is not None and e is not None:
                e = (field >= bounds[0]) & (field <= bounds[1]) & e
        if col.null_count:
            e = field.is_null() if e is None else e | field.is_null()
        assert e is not None  # rows is not empty
        out = e if out is None else out & e
    return out


def show_key(rows: pa.Table, key_names: Sequence[str], at: int) -> list[Any]:
    """The key of row ``at`` for a message: temporal values as Arrow prints them (exact,
    never through Python objects, which truncate nanoseconds and overflow), with their
    stored integer and type when Arrow cannot print them."""
    out: list[Any] = []
    for k in key_names:
        col = rows.column(k).slice(at, 1)
        if pa.types.is_temporal(col.type) and col.null_count == 0:
            try:
                out.append(pc.cast(col, pa.string())[0].as_py())
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                out.append(f"{view_int(col)[0].as_py()} ({col.type})")
        else:
            out.append(col[0].as_py())
    return out
