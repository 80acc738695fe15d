"""Part statistics: per-column min, max and null count of a part, kept in its
:class:`~persist.types.PartRef`, and pruning parts against a filter with them.

A part's statistics are a tuple of ``(column, min, max, nulls)``, one per column that has
them, in a JSON-safe encoding that decodes to exactly the Arrow value it was made from
(:func:`encode_value` / :func:`decode_value`):

* integers, booleans: as JSON numbers / booleans;
* dates, times, timestamps, durations: their integer storage value (days, or units of
  the type; the type, with its unit and time zone, comes from the shard's schema);
* decimals: their exact decimal string;
* strings: as is; binary: base64; both only when at most :data:`MAX_STAT_BYTES` long
  (a longer min or max is not recorded: a truncated bound would need rounding);
* floats: never recorded (NaN and signed zeros order differently in Arrow, Spark and
  Parquet; a part with a float filter is simply read).

Invariants kept here:

* a part is pruned (:func:`prune_mask`) only when Arrow proves, from the part's
  statistics alone, that the filter is false or null on every row the part can hold
  (every row satisfies one of the part's :func:`guarantees`), and only with a filter
  whose simplification agrees with its evaluation and that calls no function that
  may fail on a value, e.g. a checked cast (:func:`persist.exprs.prunable`);
  a part without statistics (written before they existed, inline, or with columns
  whose statistics were not recorded) is never pruned for that column;
* ``nulls`` counts the nulls of the column; a column whose values are all null has
  ``min`` and ``max`` ``None``;
* ``min`` and ``max`` are those of ``pyarrow.compute.min_max`` (found among packed
  integers for short strings of one width, the same values: :func:`_packed_min_max`);
* ``_time`` statistics are the times as stored: a reader advances them to the batch's
  floor (``max(t, lower, since)``) before comparing (:func:`min_time`).

Sources: Parquet column-chunk statistics, as pyarrow's datasets prune row groups with
them (``SimplifyWithGuarantee``), and Materialize persist's part statistics used to push
filters down (``persist-client``'s ``stats`` module), whose idea (not code) this follows.
"""

from __future__ import annotations

import base64
import decimal
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs

from persist.exprs import prunable

#: Strings and binary values longer than this (bytes) are not recorded as min or max.
MAX_STAT_BYTES = 64

#: A string or binary column of at least this many values, none null, all of one length
#: of at most :data:`_PACKED_MAX_WIDTH` bytes (codes: airports, currencies, countries) has
#: its min and max found among integers (:func:`_packed_min_max`).
_PACKED_MIN_ROWS = 256
_PACKED_MAX_WIDTH = 8

#: One column's statistics: ``(column, min, max, nulls)`` (JSON-safe encodings).
ColumnStats = tuple[str, Any, Any, int]


def _int_storage(t: pa.DataType) -> pa.DataType | None:
    """The integer type a temporal type is stored as (same bit width), or ``None``."""
    if pa.types.is_date(t) or pa.types.is_time(t) or pa.types.is_timestamp(t):
        return pa.int32() if t.bit_width == 32 else pa.int64()
    if pa.types.is_duration(t):
        return pa.int64()
    return None


def has_stats_type(t: pa.DataType) -> bool:
    """Whether columns of type ``t`` get statistics (all supported types but floats)."""
    return bool(
        pa.types.is_integer(t)
        or pa.types.is_boolean(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_decimal(t)
        or _int_storage(t) is not None
    )


def encode_value(value: pa.Scalar) -> Any:
    """The JSON-safe encoding of a non-null scalar (see the module docstring), or
    ``None`` when it is not recorded (a float, or a string/binary too long).

    Raises:
        ValueError: ``value`` is null.
    """
    if not value.is_valid:
        raise ValueError("a null scalar has no statistics encoding")
    t = value.type
    storage = _int_storage(t)
    if storage is not None:
        return int(pa.array([value], t).view(storage)[0].as_py())
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        return value.as_py()
    if pa.types.is_decimal(t):
        return str(value.as_py())
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        try:
            s = value.as_py()
        except UnicodeDecodeError:
            # Not UTF-8 (parts written before writers refused such strings): no
            # statistics, which only means no pruning.
            return None
        # No statistics for a NUL character: the stash's JSON (as Postgres JSONB)
        # cannot hold one, and unknown statistics only mean no pruning.
        return s if len(s.encode("utf-8")) <= MAX_STAT_BYTES and "\x00" not in s else None
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        b = value.as_py()
        return base64.b64encode(b).decode("ascii") if len(b) <= MAX_STAT_BYTES else None
    return None


def decode_value(encoded: Any, t: pa.DataType) -> pa.Scalar:
    """The scalar of type ``t`` that :func:`encode_value` encoded as ``encoded``.

    Raises:
        ValueError: ``encoded`` is not a valid encoding for ``t``.
    """
    try:
        storage = _int_storage(t)
        if storage is not None:
            if isinstance(encoded, bool) or not isinstance(encoded, int):
                raise TypeError(f"expected an int, got {type(encoded).__name__}")
            return pa.array([encoded], storage).view(t)[0]
        if pa.types.is_decimal(t):
            return pa.scalar(decimal.Decimal(str(encoded)), t)
        if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
            return pa.scalar(base64.b64decode(str(encoded), validate=True), t)
        if pa.types.is_integer(t) and (isinstance(encoded, bool) or not isinstance(encoded, int)):
            raise TypeError(f"expected an int, got {type(encoded).__name__}")
        if pa.types.is_boolean(t) and not isinstance(encoded, bool):
            raise TypeError(f"expected a bool, got {type(encoded).__name__}")
        if (pa.types.is_string(t) or pa.types.is_large_string(t)) and not isinstance(encoded, str):
            raise TypeError(f"expected a str, got {type(encoded).__name__}")
        return pa.scalar(encoded, t)
    except (TypeError, ValueError, ArithmeticError, pa.ArrowException) as e:
        raise ValueError(f"statistic {encoded!r:.80} is not a valid {t} value: {e}") from None


def _packed_min_max(column: pa.ChunkedArray | pa.Array) -> tuple[pa.Scalar, pa.Scalar] | None:
    """The least and greatest values of a string or binary ``column`` (one chunk) of at
    least :data:`_PACKED_MIN_ROWS` values, none null, all ``w <= _PACKED_MAX_WIDTH``
    bytes long; ``None`` when it is not such a column.

    Byte strings of one length order as the big-endian integers of their bytes, which is
    the order ``pyarrow.compute.min_max`` compares them in (bytewise, unsigned): the
    values are packed into ``uint64`` keys, compared by numpy in one pass, about eight
    times faster than Arrow's comparisons of strings (a flights part's airport codes:
    0.6 ms against 5 ms)."""
    if isinstance(column, pa.ChunkedArray):
        if column.num_chunks != 1:
            return None
        column = column.chunk(0)
    n = len(column)
    t = column.type
    if (
        n < _PACKED_MIN_ROWS
        or column.null_count
        or not (pa.types.is_string(t) or pa.types.is_binary(t))
    ):
        return None
    _, offsets, data = column.buffers()
    if offsets is None or data is None:
        return None
    ends = np.frombuffer(offsets, np.int32, count=n + 1, offset=4 * column.offset)
    first = int(ends[0])
    width = (int(ends[-1]) - first) // n
    if not 1 <= width <= _PACKED_MAX_WIDTH:
        return None
    lengths = np.diff(ends)
    if int(lengths.min()) != width or int(lengths.max()) != width:
        return None
    values = np.frombuffer(data, np.uint8, count=n * width, offset=first).reshape(n, width)
    keys = values[:, 0].astype(np.uint64)
    for j in range(1, width):
        keys <<= np.uint64(8)
        keys |= values[:, j]
    return column[int(keys.argmin())], column[int(keys.argmax())]


def column_stats(name: str, column: pa.ChunkedArray | pa.Array) -> ColumnStats | None:
    """The statistics of one column, or ``None`` when its type has none or its min or
    max is not recorded (too long)."""
    if not has_stats_type(column.type):
        return None
    nulls = int(column.null_count)
    if nulls == len(column):
        return (name, None, None, nulls)
    storage = _int_storage(column.type)
    try:
        if storage is not None:
            # Temporal values order as their integer storage (Arrow has no min_max
            # kernel for durations).
            if isinstance(column, pa.ChunkedArray):
                view: pa.ChunkedArray | pa.Array = pa.chunked_array(
                    [c.view(storage) for c in column.chunks], storage
                )
            else:
                view = column.view(storage)
            mm = pc.min_max(view)
            return (name, int(mm["min"].as_py()), int(mm["max"].as_py()), nulls)
        packed = _packed_min_max(column)
        if packed is None:
            mm = pc.min_max(column)
            packed = mm["min"], mm["max"]
    except pa.ArrowNotImplementedError:
        return None
    lo, hi = encode_value(packed[0]), encode_value(packed[1])
    if lo is None or hi is None:
        return None
    return (name, lo, hi, nulls)


def table_stats(table: pa.Table) -> tuple[ColumnStats, ...]:
    """The statistics of every column of a part's table (but the columns
    :func:`column_stats` skips), sorted by column name: the order their JSON form
    (:func:`stats_to_json`, an object whose keys canonical JSON sorts) reads back in,
    so a part's reference in the state of the process that wrote it equals the one
    every other process decodes. ``_diff``'s tell a part of inserts only (``1`` to
    ``1``), whose rows need no merge with another such part's
    (:mod:`spark.native_plan`)."""
    out = []
    for name, col in zip(table.column_names, table.columns, strict=True):
        s = column_stats(name, col)
        if s is not None:
            out.append(s)
    out.sort(key=lambda s: s[0])
    return tuple(out)


def stats_to_json(stats: Sequence[ColumnStats]) -> dict[str, list[Any]]:
    """The compact JSON form: ``{column: [min, max, nulls]}``."""
    return {name: [lo, hi, nulls] for name, lo, hi, nulls in stats}


def stats_from_json(d: Any) -> tuple[ColumnStats, ...]:
    """Parse :func:`stats_to_json`'s form.

    Raises:
        ValueError: malformed statistics.
    """
    if not isinstance(d, dict):
        raise ValueError(f"part statistics must be an object, got {type(d).__name__}")
    out = []
    for name, v in d.items():
        if not isinstance(v, list) or len(v) != 3 or isinstance(v[2], bool):
            raise ValueError(
                f"statistics of column {name!r} must be [min, max, nulls], got {v!r:.80}"
            )
        out.append((str(name), v[0], v[1], int(v[2])))
    return tuple(out)


def min_time(stats: Sequence[ColumnStats] | None, floor: int) -> int | None:
    """The smallest time a part holds once advanced to ``floor`` (its batch's lower and
    since), or ``None`` when unknown (no ``_time`` statistics)."""
    for name, lo, _hi, _nulls in stats or ():
        if name == "_time" and isinstance(lo, int) and not isinstance(lo, bool):
            return max(lo, floor)
    return None


def max_time(stats: Sequence[ColumnStats] | None, floor: int) -> int | None:
    """The greatest time a part holds once advanced to ``floor`` (its batch's lower and
    since), or ``None`` when unknown (no ``_time`` statistics)."""
    for name, _lo, hi, _nulls in stats or ():
        if name == "_time" and isinstance(hi, int) and not isinstance(hi, bool):
            return max(hi, floor)
    return None


#: A part's columns holding both nulls and values split it into alternatives (each row
#: is null, or within [min, max]); the guarantees of at most this many such columns are
#: combined, the others are left out (unknown).
MAX_NULLABLE_ALTERNATIVES = 3


def guarantees(
    stats: Sequence[ColumnStats] | None, rows: int, schema: pa.Schema
) -> list[pc.Expression]:
    """What a part's statistics guarantee of each of its rows, as Arrow expressions:
    every row satisfies at least one of them (``[true]`` when nothing is known).

    A column without nulls gives ``min <= c <= max``, one of only nulls ``c is null``,
    and one holding both splits the part into two alternatives (Arrow cannot simplify
    under ``(min <= c <= max) or c is null``); only the first
    :data:`MAX_NULLABLE_ALTERNATIVES` such columns are split. Columns absent from
    ``schema``, or whose recorded values do not decode to its type, are left out.
    """
    alternatives: list[pc.Expression | None] = [None]
    split = 0
    for name, lo, hi, nulls in stats or ():
        if name == "_time" or schema.get_field_index(name) < 0:
            continue  # _time as stored is not _time as read (see min_time)
        t = schema.field(name).type
        f = pc.field(name)
        if lo is None or hi is None:
            if nulls != rows:
                continue
            options = [f.is_null()]
        else:
            try:
                in_range = (f >= decode_value(lo, t)) & (f <= decode_value(hi, t))
            except ValueError:
                continue
            options = [in_range]
            if nulls:
                if split >= MAX_NULLABLE_ALTERNATIVES:
                    continue
                split += 1
                options.append(f.is_null())
        alternatives = [o if a is None else a & o for a in alternatives for o in options]
    return [pc.scalar(True) if a is None else a for a in alternatives]


def prune_mask(
    parts: Sequence[tuple[Sequence[ColumnStats] | None, int]],
    schema: pa.Schema,
    filter: pc.Expression,
) -> list[bool]:
    """For each part (its statistics and row count), whether it may hold a row on which
    ``filter`` is true: ``False`` only when, for each of the part's :func:`guarantees`,
    Arrow's simplification of ``filter`` under it is ``false`` or ``null`` (the way
    pyarrow datasets skip Parquet row groups).

    Args:
        parts: ``(stats, rows)`` of each part (``stats`` ``None``: unknown).
        schema: the columns ``filter`` may reference, with their types.
        filter: a boolean Arrow expression over ``schema``'s columns.

    Pruning is conservative: a filter whose simplification Arrow may disagree with its
    evaluation (an ``is_in`` of values of another type than the column's, see
    :func:`persist.exprs.prunable`), that calls a function that may fail on a value (a
    checked cast or arithmetic: the skipped part may hold the row it fails on), or
    that Arrow cannot simplify under the bounds, prunes nothing.

    Raises:
        pyarrow.ArrowInvalid: ``filter`` references a column not in ``schema``.
    """
    if not parts:
        return []
    if not prunable(filter, schema):
        schema.empty_table().filter(filter)  # raises if the filter does not apply
        return [True] * len(parts)
    owners: list[int] = []
    exprs: list[pc.Expression] = []
    for i, (stats, rows) in enumerate(parts):
        for g in guarantees(stats, rows, schema):
            owners.append(i)
            exprs.append(g)
    paths = [f"/persist-part/{j}" for j in range(len(exprs))]
    dataset = ds.FileSystemDataset.from_paths(
        paths,
        schema=schema,
        format=ds.ParquetFileFormat(),
        filesystem=pafs.LocalFileSystem(),  # never opened: only the guarantees are used
        partitions=exprs,
    )
    try:
        kept = {frag.path for frag in dataset.get_fragments(filter=filter)}
    except pa.ArrowException:
        schema.empty_table().filter(filter)  # raises if the filter does not apply
        # It applies, but Arrow cannot simplify it under some guarantee (no common
        # type of a literal and a bound): prune nothing.
        return [True] * len(parts)
    out = [False] * len(parts)
    for owner, path in zip(owners, paths, strict=True):
        if path in kept:
            out[owner] = True
    return out
