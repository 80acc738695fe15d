"""Parts: updates as Arrow tables, their consolidation, and their Parquet encoding in blobs.

A shard's updates are Arrow tables with the shard's key columns, value columns, ``_time``
(int64) and ``_diff`` (int64) (DESIGN section 5). This module holds the pure functions
that build such tables (:func:`updates_schema`, :func:`to_updates_table`), consolidate
them (:func:`consolidate`, differential dataflow's ``consolidate_updates``), encode one
part as Parquet, or a small inline part as an Arrow IPC stream, with a SHA-256 checksum
(:func:`encode_part`, :func:`encode_inline_part`, :func:`decode_part`,
:func:`make_part_ref`), and write/read a run of parts through a
:class:`~persist.blob.Blob` (:func:`split_for_parts`, :func:`write_parts`,
:func:`read_parts`), after the persist-client batch builder (seed ``004``: parts of a
target size, inline writes).

Invariants kept here:

* an updates table has exactly the columns of :func:`updates_schema`, in its order and
  types; ``_time`` and ``_diff`` are non-null int64; column names never start with ``_``
  (reserved for persist) and keys and values share no name;
* :func:`consolidate` returns updates sorted by (key columns, value columns, ``_time``)
  with nulls last in every column (floats: NaN after numbers, before null), one row per
  distinct (key, value, time) whose ``_diff`` is the sum of that group's diffs (never
  zero), and every ``_time`` at least ``since``; equal means equal values, nulls equal to
  nulls, NaN equal to NaN, ``-0.0`` equal to ``0.0``. It is vectorised (pyarrow compute
  and numpy; no per-row Python);
* the parts :func:`write_parts` returns, read in order, are exactly the input table,
  column types included (``date64`` and ``time32[s]``, which Parquet stores otherwise,
  are restored on decode); a run's parts are row slices of one sorted table, so they
  stay sorted;
* :func:`write_parts` returns (or raises) only after every upload it started has ended,
  so a failed write's clean-up never races one of its own uploads;
* :func:`decode_part` never returns data whose SHA-256 differs from the
  :class:`~persist.types.PartRef`'s checksum: it raises
  :class:`~persist.errors.CorruptPart` naming the part's key instead; :func:`read_parts`
  either decodes verified bytes or, for an inline part whose very ``bytes`` object this
  process encoded or already verified, returns the table cached for it
  (:data:`INLINE_CACHE`), which is what decoding those bytes gives.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import math
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from persist.blob import Blob, validate_key
from persist.errors import BlobError, CorruptPart, InvalidUsage
from persist.pool import run_all, submit_io
from persist.types import PartRef

__all__ = [
    "DIFF",
    "TIME",
    "consolidate",
    "consolidate_order",
    "decode_part",
    "encode_inline_part",
    "encode_part",
    "make_part_ref",
    "read_parts",
    "split_for_parts",
    "to_updates_table",
    "updates_schema",
    "write_parts",
]

TIME = "_time"
DIFF = "_diff"
_MIB = 1024 * 1024
#: Default target size of one part, in bytes of in-memory Arrow data.
DEFAULT_TARGET_PART_BYTES = 64 * _MIB
#: A table at least twice this size (in-memory bytes) is split into ``max_workers`` parts
#: so that they encode in parallel (pyarrow releases the GIL while encoding).
MIN_PARALLEL_PART_BYTES = 8 * _MIB
#: Parts at least this large (encoded bytes) are decoded by Arrow's thread pool.
_THREADED_DECODE_MIN_BYTES = 1 * _MIB
#: Parts of at most this many rows are encoded without dictionaries.
_DICTIONARY_MIN_ROWS = 64
#: Rows sampled (strided) to choose the dictionary-encoded columns of a part.
_DICTIONARY_SAMPLE_ROWS = 8192
#: A column is dictionary-encoded when its sample has fewer distinct values than this
#: fraction of the sample's rows.
_DICTIONARY_MAX_DISTINCT = 0.3
#: Tables up to this many in-memory bytes are encoded whole first (as one part if it fits).
_INLINE_PROBE_BYTES = 256 * 1024
#: Tables of at most this many rows are encoded as Arrow IPC first, to test for inlining.
_INLINE_PROBE_ROWS = 256


# ------------------------------------------------------------------------- schemas


def _is_supported_type(t: pa.DataType) -> bool:
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
            if not _is_supported_type(f.type):
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


def _is_safe_widening(src: pa.DataType, dst: pa.DataType) -> bool:
    """True when every ``src`` value is exactly representable as a ``dst`` value."""
    if src == dst:
        return True
    if pa.types.is_null(src):
        return True
    if pa.types.is_dictionary(src):
        return _is_safe_widening(src.value_type, dst)
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
        if not _is_safe_widening(col.type, field.type):
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


# -------------------------------------------------------------------- consolidation


def _compare_pairs(
    prev: pa.ChunkedArray | pa.Array, cur: pa.ChunkedArray | pa.Array, check_order: bool
) -> tuple[Any, Any]:
    """Element-wise ``(prev == cur, cur sorts before prev)`` as null-free booleans
    (the second ``None`` unless ``check_order``), in Arrow's sort order: nulls last and
    equal to each other; NaN after numbers, before null, equal to NaN."""
    eq = pc.equal(prev, cur)
    lt = pc.less(cur, prev) if check_order else None
    has_nulls = prev.null_count > 0 or cur.null_count > 0
    if has_nulls:
        eq = pc.fill_null(eq, False)
        lt = pc.fill_null(lt, False) if lt is not None else None
    if pa.types.is_floating(prev.type):
        pn = pc.is_nan(prev)
        cn = pc.is_nan(cur)
        if has_nulls:
            pn = pc.fill_null(pn, False)
            cn = pc.fill_null(cn, False)
        eq = pc.or_(eq, pc.and_(pn, cn))
        if lt is not None:
            nan_first = pc.and_(pn, pc.invert(cn))
            if has_nulls:
                nan_first = pc.and_(nan_first, pc.is_valid(cur))
            lt = pc.or_(lt, nan_first)
    if has_nulls:
        p_null = pc.is_null(prev)
        c_null = pc.is_null(cur)
        eq = pc.or_(eq, pc.and_(p_null, c_null))
        if lt is not None:
            lt = pc.or_(lt, pc.and_(p_null, pc.invert(c_null)))
    return eq, lt


def _bools(a: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return np.asarray(a.to_numpy(zero_copy_only=False), dtype=bool)


#: ``_adjacent`` switches to comparing only undecided row pairs below n / this.
_SPARSE_FACTOR = 16


def _adjacent(
    table: pa.Table, names: Sequence[str], check_order: bool
) -> tuple[bool, np.ndarray | None]:
    """Compare every row with its predecessor on ``names`` (lexicographically).

    Returns ``(in_order, same)``: ``in_order`` is False if some row sorts strictly
    before its predecessor (only computed when ``check_order``; then the scan stops at
    the first such column); ``same`` is a numpy bool array, ``same[i]`` meaning row
    ``i + 1`` equals row ``i`` on all ``names``, or ``None`` when no row does. Nulls sort
    last and equal each other; NaN sorts after numbers, before null, and equals NaN.

    Columns are compared whole while many row pairs are still undecided (equal on the
    columns so far), then only the undecided pairs are gathered and compared.
    """
    n = table.num_rows
    undecided: pa.ChunkedArray | pa.Array | None = None
    idx: np.ndarray | None = None  # positions of undecided pairs, once few
    for name in names:
        col = table.column(name)
        if idx is None:
            eq, lt = _compare_pairs(col.slice(0, n - 1), col.slice(1), check_order)
            if lt is not None:
                bad = lt if undecided is None else pc.and_(undecided, lt)
                if pc.any(bad).as_py():
                    return False, None
            undecided = eq if undecided is None else pc.and_(undecided, eq)
            count = pc.sum(undecided).as_py() or 0
            if count == 0:
                return True, None
            if count * _SPARSE_FACTOR < n:
                idx = np.flatnonzero(_bools(undecided))
        else:
            prev = col.take(pa.array(idx))
            cur = col.take(pa.array(idx + 1))
            eq, lt = _compare_pairs(prev, cur, check_order)
            if lt is not None and pc.any(lt).as_py():
                return False, None
            idx = idx[_bools(eq)]
            if len(idx) == 0:
                return True, None
    if idx is not None:
        same = np.zeros(n - 1, dtype=bool)
        same[idx] = True
        return True, same
    if undecided is None:  # no columns at all: every row equals its predecessor
        return True, np.ones(n - 1, dtype=bool)
    return True, _bools(undecided)


# Sorting by order-preserving integer codes.
#
# Arrow's multi-column sort breaks ties column by column; with many columns and
# low-cardinality leading columns (strings especially) it costs several times a sort of
# one integer array. So the leading sort columns are mapped to unsigned integer codes
# that preserve their order *and* their equality (nulls last, NaN after numbers,
# NaN == NaN, -0.0 == 0.0): integers and temporal values minus their minimum, integral
# floats likewise, other floats by the IEEE-754 order-preserving bit trick, strings,
# binary, decimal and bool by their rank among the distinct values; codes spanning far
# more values than there are rows are replaced by their dense rank. As many leading
# columns as fit are packed into one uint64 word (most significant first), the rows are
# sorted by that word with numpy, and only the rows tied on it are sorted by Arrow on
# (tie run, remaining columns). Codes are computed in the calling thread (threads were
# measured slower on a busy two-core machine, since part of the work holds the GIL), a
# string/binary/decimal column is ranked only if its codes surely fit the bits left (a
# dictionary encoding is wasted on a column that then does not fit), and the numpy sort
# is a timsort when the word is nearly sorted already.

#: Tables with fewer rows are sorted by Arrow's multi-column sort_indices directly.
_CODES_MIN_ROWS = 20_000
_U64_MAX = 2**64 - 1
#: Bits packed into the first sort word (tests lower it to exercise tie resolution).
_WORD_BITS = 64


def _offset_codes(values: np.ndarray, valid: np.ndarray | None) -> tuple[np.ndarray, int] | None:
    """Codes ``value - min`` of an int64 or uint64 array; nulls (``~valid``) get the code
    just above the largest value. Returns ``(codes, size)`` with codes in ``[0, size)``,
    or ``None`` when they do not fit in uint64."""
    vv = values if valid is None else values[valid]
    if len(vv) == 0:
        return np.zeros(len(values), dtype=np.uint64), 1
    mn, mx = int(vv.min()), int(vv.max())
    top = mx - mn
    size = top + 1 + (0 if valid is None else 1)
    if size - 1 > _U64_MAX:
        return None
    codes = values.view(np.uint64) - np.uint64(mn % 2**64)
    if valid is not None:
        codes[~valid] = np.uint64(top + 1)
    return codes, size


def _valid_mask(arr: pa.Array) -> np.ndarray | None:
    if arr.null_count == 0:
        return None
    return np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)


def _dense(codes: np.ndarray, size: int, n: int) -> tuple[np.ndarray, int]:
    """Replace sparse codes by their dense rank when that saves bits (range >> rows)."""
    if (size - 1).bit_length() <= n.bit_length() + 2:
        return codes, size
    d = pc.dictionary_encode(pa.array(codes, pa.uint64()))
    k = len(d.dictionary)
    order = np.asarray(pc.sort_indices(d.dictionary).to_numpy(), dtype=np.int64)
    rank = np.empty(k, dtype=np.uint64)
    rank[order] = np.arange(k, dtype=np.uint64)
    return rank[np.asarray(d.indices.to_numpy(), dtype=np.int64)], k


def _rank_codes(arr: pa.Array) -> tuple[np.ndarray, int]:
    """Codes = dense rank of each value among the distinct values (sorted); null last.

    Used for types whose equality is by value bytes (strings, binary, decimal, bool):
    the dictionary holds each distinct value once, so ranks are dense.
    """
    d = pc.dictionary_encode(arr)
    dictionary = d.dictionary
    k = len(dictionary)
    order = np.asarray(pc.sort_indices(dictionary).to_numpy(), dtype=np.int64)
    rank = np.empty(k + 1, dtype=np.uint64)
    rank[order] = np.arange(k, dtype=np.uint64)
    rank[k] = k  # null
    indices = np.asarray(pc.fill_null(d.indices, k).to_numpy(), dtype=np.int64)
    return rank[indices], k + (1 if d.indices.null_count else 0)


_NAN_KEY = np.uint64(0xFFF0000000000001)  # just above the key of +inf


def _float_codes(arr: pa.Array) -> tuple[np.ndarray, int]:
    """Codes of a float column: numbers < NaN < null; NaN == NaN; -0.0 == 0.0."""
    valid = _valid_mask(arr)
    f = np.asarray(pc.fill_null(arr, 0).to_numpy(), dtype=np.float64)
    nan = np.isnan(f)  # null rows were filled with 0, so nan rows are valid
    any_nan = bool(nan.any())
    num = ~nan if valid is None else (~nan & valid)
    nums = f[num]
    if np.all(np.abs(nums) <= 2.0**53) and np.array_equal(np.floor(nums), nums):
        # Integral values: code them as integers (-0.0 and 0.0 both become 0).
        if len(nums):
            imin, imax = int(nums.min()), int(nums.max())
        else:
            imin = imax = 0
        top = imax - imin
        ints = np.where(num, f, 0.0).astype(np.int64)  # exact: |value| <= 2**53
        codes = (ints - np.int64(imin)).view(np.uint64)
        size = top + 1
        if any_nan:
            codes[nan] = np.uint64(size)
            size += 1
        if valid is not None:
            codes[~valid] = np.uint64(size)
            size += 1
        return codes, size
    # General floats: IEEE-754 bits made order-preserving; NaN just above +inf.
    bits = (f + 0.0).view(np.int64)  # + 0.0 turns -0.0 into 0.0
    key = np.where(bits < 0, ~bits, bits | np.int64(-(2**63))).view(np.uint64)
    key[nan] = _NAN_KEY
    res = _offset_codes(key, valid)
    assert res is not None  # keys span less than 2**64 - 2**52
    return _dense(res[0], res[1], len(f))


def _column_codes(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, int]:
    """Order- and equality-preserving uint64 codes of one column and their range size."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    t = arr.type
    if pa.types.is_floating(t):
        return _float_codes(arr)
    as_int: pa.DataType | None = None
    if pa.types.is_integer(t):
        as_int = pa.uint64() if pa.types.is_unsigned_integer(t) else pa.int64()
    elif pa.types.is_temporal(t):
        as_int = pa.int32() if t.bit_width == 32 else pa.int64()
    if as_int is not None:
        valid = _valid_mask(arr)
        filled = arr if valid is None else pc.fill_null(arr, pa.scalar(0, t))
        if filled.type == as_int:
            ints = filled
        elif pa.types.is_integer(t):
            ints = filled.cast(as_int)
        else:
            ints = filled.view(as_int)  # temporal: same layout as int32/int64
        values = np.asarray(ints.to_numpy())
        if values.dtype != np.uint64:
            values = values.astype(np.int64, copy=False)
        res = _offset_codes(values, valid)
        if res is not None:
            return _dense(res[0], res[1], len(arr))
    return _rank_codes(arr)


def _is_rank_coded(t: pa.DataType) -> bool:
    """Whether :func:`_column_codes` codes this type by rank (dictionary encoding):
    strings, binaries and decimals (bool is cheap and narrow)."""
    return not (
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_temporal(t)
        or pa.types.is_boolean(t)
    )


def _bits(size: int) -> int:
    return (size - 1).bit_length()


def _first_word(columns: Sequence[pa.ChunkedArray | pa.Array]) -> tuple[np.ndarray | None, int]:
    """Pack the codes of the leading columns into one uint64 word (most significant
    first), as many columns as fit in 64 bits. Returns the word (``None`` if every
    packed column is constant) and the number of columns it covers.

    Codes are computed in column order, at most one column beyond the last that fits.
    """
    word: np.ndarray | None = None
    used = 0
    covered = 0

    def add(codes: np.ndarray, size: int) -> bool:
        """Pack one column's codes; False when they do not fit any more."""
        nonlocal word, used, covered
        bits = _bits(size)
        if used + bits > _WORD_BITS:
            return False
        covered += 1
        if bits == 0:
            return True
        if word is None:
            word = codes  # a fresh array of this call (never a view of the input)
        else:
            word <<= np.uint64(bits)
            word |= codes
        used += bits
        return True

    n = len(columns[0]) if columns else 0
    for col in columns:
        if _is_rank_coded(col.type) and used + n.bit_length() > _WORD_BITS:
            # Ranking (dictionary-encoding) a column costs a hash of every value and
            # may not fit the bits left: stop here; rows tied on the word are sorted
            # by Arrow on the remaining columns (cheap when ties are few).
            break
        if not add(*_column_codes(col)):
            break
    return word, covered


def _codes_order(table: pa.Table, cols: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Row order sorting ``table`` by ``cols``, and the ``same`` mask of the sorted rows
    (``same[i]``: sorted row ``i + 1`` equals sorted row ``i`` on every column).

    Sorts by the first packed word with numpy; rows tied on it are sorted by Arrow on
    (tie run, remaining raw columns), which is cheap when ties are few.
    """
    n = table.num_rows
    word, covered = _first_word([table.column(c) for c in cols])
    rest = list(cols[covered:])
    if word is None:
        order = np.arange(n, dtype=np.int64)
        tie = np.ones(n - 1, dtype=bool)
    else:
        # Timsort (numpy's stable kind) is several times faster on nearly sorted words
        # (data appended in time order) and about half as fast on random ones.
        descents = int(np.count_nonzero(word[1:] < word[:-1]))
        order = np.argsort(word, kind="stable" if descents * 4 < n else "quicksort")
        first = word[order]
        tie = first[1:] == first[:-1]
    if not tie.any():
        return order, tie
    if not rest:
        return order, tie
    # Rows in a run of equal first words: sort them by (run, remaining columns).
    in_run = np.zeros(n, dtype=bool)
    in_run[1:] |= tie
    in_run[:-1] |= tie
    pos = np.flatnonzero(in_run)
    run_id = np.cumsum(np.concatenate(([True], ~tie)))[pos]
    rows = order[pos]
    sub = table.select(rest).take(pa.array(rows))
    run_name = "\x00run"
    sub = pa.Table.from_arrays(
        [pa.array(run_id, pa.int64()), *sub.columns], names=[run_name, *rest]
    )
    sub_order = pc.sort_indices(sub, sort_keys=[(c, "ascending") for c in [run_name, *rest]])
    sub_sorted = sub.take(sub_order)
    order[pos] = rows[np.asarray(sub_order.to_numpy(), dtype=np.int64)]
    _, sub_same = _adjacent(sub_sorted, rest, check_order=False)
    same = np.zeros(n - 1, dtype=bool)
    if sub_same is not None:
        p = pos[:-1]
        pair = (pos[1:] == p + 1) & tie[np.minimum(p, n - 2)]
        same[p[pair]] = sub_same[pair]
    return order, same


def _scratch_pool() -> pa.MemoryPool:
    """The Arrow memory pool for the big short-lived buffers of gathering and encoding
    parts: the system allocator's (``pyarrow.system_memory_pool()``).

    pyarrow's default on Linux is mimalloc. Measured in one process, the three pools
    alternating (median ms of a whole write, first round dropped):

    ==============================  ========  ========  ======
    write                           mimalloc  jemalloc  system
    ==============================  ========  ========  ======
    flights, back to back               84.5      72.4    71.7
    flights, after 1.5 s idle          170.0     106.5    94.4
    lineitem SF1, back to back          1577      1685    1433
    lineitem SF1, after 1.5 s idle      1584      1962    1404
    ==============================  ========  ========  ======

    The pools that keep freed memory for reuse lost it to the kernel while idle and then
    paid more to fault it back in than fresh pages cost (kernel page zeroing was the top
    entry of a ``perf`` profile of the write). The user's default pool is left as it is.
    """
    return pa.system_memory_pool()


def _take(table: pa.Table, order: np.ndarray) -> pa.Table:
    """``table.take(order)`` (one gather; threads gathering halves were measured slower
    on a busy two-core machine, and the write path gathers part by part in its encoding
    threads instead, see :func:`write_parts`), in :func:`_scratch_pool`."""
    return pc.take(table, pa.array(order, pa.int64()), memory_pool=_scratch_pool())


def _sum_groups(diffs: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Sums of ``diffs`` over groups beginning at ``starts``, as int64.

    Raises:
        InvalidUsage: a sum does not fit in int64.
    """
    sums = np.add.reduceat(diffs, starts)
    sizes = np.diff(np.append(starts, len(diffs)))
    max_abs = max(abs(int(diffs.min())), abs(int(diffs.max())))
    if max_abs * int(sizes.max()) >= 2**63:
        # Possible wrap-around: compare with float sums (a wrap is off by ~2**64,
        # float rounding by far less than 2**62).
        fsums = np.add.reduceat(diffs.astype(np.float64), starts)
        bad = np.abs(fsums - sums.astype(np.float64)) > 2.0**62
        if bad.any():
            raise InvalidUsage(
                f"the diffs of {int(bad.sum())} update(s) sum beyond the int64 range"
            )
    return np.asarray(sums, dtype=np.int64)


def consolidate(
    table: pa.Table,
    key_names: Sequence[str],
    value_names: Sequence[str],
    since: int | None = None,
) -> pa.Table:
    """Consolidate updates (differential dataflow's ``consolidate_updates``).

    Advances every ``_time`` below ``since`` to ``since``, sums ``_diff`` over equal
    (key, value, time) (nulls equal nulls, NaN equals NaN), drops rows whose sum is zero,
    and sorts by the key columns, the value columns and ``_time`` (ascending, nulls last).

    Vectorised, no per-row Python: an input already sorted (a run read back) is
    recognised by comparing each row with its predecessor, column after column, and is
    not sorted again; otherwise small tables use Arrow's multi-column ``sort_indices``
    and large ones (at least 20,000 rows) a numpy sort of packed order-preserving
    integer codes (see the comment above ``_CODES_MIN_ROWS``).
    Groups of equal rows are adjacent after sorting and are summed with
    ``numpy.add.reduceat`` (no hashing).

    Args:
        table: updates with the named columns plus ``_time`` and ``_diff`` (int64,
            non-null); other columns are carried along (one representative per group).
        key_names, value_names: the key and value column names, in sort order.
        since: the compaction frontier's element, or ``None`` to keep times.

    Returns:
        A table with the input's schema (possibly the input itself).

    Raises:
        InvalidUsage: a named column is missing or of a type :func:`updates_schema`
            rejects, ``_time``/``_diff`` are not non-null int64, or a diff sum
            overflows int64.
    """
    table, order = consolidate_order(table, key_names, value_names, since)
    return table if order is None else _take(table, order)


def consolidate_order(
    table: pa.Table,
    key_names: Sequence[str],
    value_names: Sequence[str],
    since: int | None = None,
) -> tuple[pa.Table, np.ndarray | None]:
    """:func:`consolidate` without the final gather: returns ``(base, order)`` where the
    consolidated updates are ``base`` if ``order`` is ``None``, else
    ``base.take(order)`` (``order`` an int64 numpy array of row positions). Writers pass
    ``order`` on to :func:`write_parts`, which gathers each part in its own encoding
    thread instead of materialising the whole sorted table first.

    Raises: as :func:`consolidate`.
    """
    cols = [*key_names, *value_names, TIME]
    for c in [*cols, DIFF]:
        if table.schema.get_field_index(c) < 0:
            raise InvalidUsage(f"consolidate: the table has no column {c!r}")
    for c in (TIME, DIFF):
        col = table.column(c)
        if col.type != pa.int64() or col.null_count:
            raise InvalidUsage(f"column {c!r} must be non-null int64, got {col.type}")
    for c in cols:
        if not _is_supported_type(table.schema.field(c).type):
            raise InvalidUsage(
                f"consolidate: column {c!r} has unsupported type {table.schema.field(c).type}"
            )
    n = table.num_rows
    if n == 0:
        return table, None
    if n == 1:  # one row (a one-row append): sorted, one group
        if table.column(DIFF)[0].as_py() == 0:
            return table.slice(0, 0), None
        if since is not None and table.column(TIME)[0].as_py() < since:
            i = table.schema.get_field_index(TIME)
            table = table.set_column(i, table.schema.field(i), pa.array([since], pa.int64()))
        return table, None
    if since is not None:
        times = table.column(TIME)
        if pc.min(times).as_py() < since:
            i = table.schema.get_field_index(TIME)
            advanced = pc.max_element_wise(times, pa.scalar(since, pa.int64()))
            table = table.set_column(i, table.schema.field(i), advanced)
    order: np.ndarray | None = None
    if n > 1:
        in_order, same = _adjacent(table, cols, check_order=True)
        if not in_order:
            if n >= _CODES_MIN_ROWS:
                order, same = _codes_order(table, cols)
            else:
                arrow_order = pc.sort_indices(table, sort_keys=[(c, "ascending") for c in cols])
                table = table.take(arrow_order)
                _, same = _adjacent(table, cols, check_order=False)
    else:
        same = None
    diff_index = table.schema.get_field_index(DIFF)
    if same is None or not same.any():
        zero = pc.equal(table.column(DIFF), 0)
        if pc.any(zero).as_py():
            if order is None:
                table = table.filter(pc.invert(zero))
            else:
                order = order[~_bools(zero)[order]]
        return table, order
    starts = np.flatnonzero(np.concatenate(([True], ~same)))
    diffs = np.asarray(table.column(DIFF).to_numpy(), dtype=np.int64)
    if order is not None:
        diffs = diffs[order]
    sums = _sum_groups(diffs, starts)
    keep = sums != 0
    rows = starts[keep] if order is None else order[starts[keep]]
    out = table.take(pa.array(rows, pa.int64()))
    return out.set_column(
        diff_index, table.schema.field(diff_index), pa.array(sums[keep], pa.int64())
    ), None


# -------------------------------------------------------------------------- parts


def _dictionary_columns(table: pa.Table) -> list[str]:
    """The columns worth dictionary-encoding: those with few distinct values (under
    ``_DICTIONARY_MAX_DISTINCT`` of a strided sample of ``_DICTIONARY_SAMPLE_ROWS`` rows).
    A column of mostly distinct values would fill a dictionary page and fall back to
    plain encoding, the dictionary work wasted (~15% of encoding lineitem)."""
    n = table.num_rows
    if n <= _DICTIONARY_MIN_ROWS:
        return []
    step = max(1, n // _DICTIONARY_SAMPLE_ROWS)
    sample = table.take(pa.array(np.arange(0, n, step, dtype=np.int64))) if step > 1 else table
    limit = _DICTIONARY_MAX_DISTINCT * sample.num_rows
    return [
        name
        for name, col in zip(sample.column_names, sample.columns, strict=True)
        if pc.count_distinct(col, mode="all").as_py() < limit
    ]


def _is_integer_physical(t: pa.DataType) -> bool:
    """Whether Parquet stores ``t`` as INT32/INT64 (with :func:`encode_part`'s settings):
    integers, dates, times, timestamps, durations and decimals of precision <= 18."""
    return bool(
        pa.types.is_integer(t)
        or pa.types.is_temporal(t)
        or (pa.types.is_decimal(t) and t.precision <= 18)
    )


#: Codec of the columns that are not delta-encoded (Parquet's LZ4_RAW).
_CODEC = "lz4"


def _encoding_plan(table: pa.Table) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """How :func:`encode_part` encodes each column: ``(dictionary columns,
    column_encoding, compression)``.

    * few distinct values (:func:`_dictionary_columns`): dictionary, LZ4;
    * other integer-like columns (:func:`_is_integer_physical`): ``DELTA_BINARY_PACKED``,
      uncompressed. Deltas of sorted or clustered integers pack into a few bits; on
      lineitem parts this was smaller than LZ4 over plain values and 2-3x faster to
      encode (e.g. ``l_partkey``: 0.84 MB in 2.1 ms against 1.5 MB in 4.2 ms), and it
      decodes as fast;
    * the rest (floats, strings, binary, bool, wide decimals): plain, LZ4.
    """
    dictionary = _dictionary_columns(table)
    in_dict = set(dictionary)
    encoding: dict[str, str] = {}
    compression: dict[str, str] = {}
    for f in table.schema:
        if f.name not in in_dict and _is_integer_physical(f.type):
            encoding[f.name] = "DELTA_BINARY_PACKED"
            compression[f.name] = "none"
        else:
            compression[f.name] = _CODEC
    return dictionary, encoding, compression


def encode_part(table: pa.Table) -> bytes:
    """Encode one part as Parquet bytes.

    Settings chosen for speed and size (:func:`_encoding_plan`): dictionaries for the
    columns with few distinct values, ``DELTA_BINARY_PACKED`` for the other integer-like
    columns, LZ4 (``LZ4_RAW``) for everything but delta-encoded columns; statistics
    only for ``_time`` (min/max time of the part); decimals of precision up to 18 stored
    as integers; the Arrow schema stored so that types such as ``large_string`` or time
    zones round-trip.

    Raises:
        InvalidUsage: pyarrow cannot encode the table.
    """
    sink = pa.BufferOutputStream()
    stats: bool | list[str] = [TIME] if TIME in table.column_names else False
    dictionary, encoding, compression = _encoding_plan(table)
    try:
        pq.write_table(
            table,
            sink,
            # LZ4 (Parquet's LZ4_RAW): as fast to write as snappy and as small, and
            # its parts decode ~30% faster (lineitem) than snappy's.
            compression=compression,
            use_dictionary=dictionary,
            column_encoding=encoding or None,
            write_statistics=stats,
            store_schema=True,
            # Decimals of precision <= 18 as INT32/INT64 (as delta-rs and pyiceberg write
            # them): they decode ~1.7x faster than fixed-length byte arrays.
            store_decimal_as_integer=True,
            memory_pool=_scratch_pool(),
        )
    except (pa.ArrowException, ValueError, TypeError) as e:
        raise InvalidUsage(f"cannot encode part as Parquet: {e}") from None
    return bytes(sink.getvalue())


_PARQUET_MAGIC = b"PAR1"
_IPC_STREAM_MAGIC = b"\xff\xff\xff\xff"


def encode_inline_part(table: pa.Table) -> bytes:
    """Encode a small part to be kept inline in the shard state, as an Arrow IPC stream.

    A one-row flights part encodes in about 20 us and decodes in about 30 us this way,
    against about 400 us and 320 us as Parquet (whose writer and reader set-up dominates
    for a few rows); the bytes are also smaller. :func:`decode_part` tells the two
    formats apart by their magic bytes. Blob parts are always Parquet.

    Raises:
        InvalidUsage: pyarrow cannot encode the table.
    """
    sink = pa.BufferOutputStream()
    try:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    except (pa.ArrowException, ValueError, TypeError) as e:
        raise InvalidUsage(f"cannot encode inline part as Arrow IPC: {e}") from None
    return bytes(sink.getvalue())


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_part_ref(key: str | None, data: bytes, rows: int, inline: bool = False) -> PartRef:
    """A :class:`PartRef` for the Parquet ``data`` of ``rows`` updates.

    Args:
        key: the blob key the data is (to be) stored at; ignored when ``inline``.
        data: the encoded part.
        rows: number of updates in it.
        inline: keep the bytes in the reference itself (shard state) instead of a blob.

    Raises:
        InvalidUsage: neither a key nor ``inline``; an invalid key.
    """
    if inline:
        return PartRef(
            key=None,
            rows=rows,
            encoded_size_bytes=len(data),
            checksum=_sha256(data),
            inline=bytes(data),
        )
    if key is None:
        raise InvalidUsage("a part that is not inline needs a blob key")
    validate_key(key)
    return PartRef(key=key, rows=rows, encoded_size_bytes=len(data), checksum=_sha256(data))


def _part_name(ref: PartRef) -> str:
    return ref.key if ref.key is not None else "<inline>"


class _InlineCache:
    """Decoded inline parts, by the identity of their bytes (an LRU bounded in Arrow
    bytes), so that a part this process encoded or verified is not parsed again, e.g. by
    the compactor merging the one-row batches its writer just appended.

    An entry holds the very ``bytes`` object of a :class:`PartRef`'s ``inline`` and the
    table those bytes decode to; it answers only a ref carrying that same object. The
    table was either encoded into those bytes (whose SHA-256 the ref was made with) or
    decoded from them after their checksum was verified, so a hit returns exactly what
    decoding the verified bytes would; a ref read anew from consensus (other bytes
    objects) is verified and decoded. Thread-safe.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, tuple[bytes, pa.Table, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, ref: PartRef) -> pa.Table | None:
        data = ref.inline
        if data is None:
            return None
        with self._lock:
            entry = self._entries.get(id(data))
            if entry is None or entry[0] is not data:
                return None
            self._entries.move_to_end(id(data))
            return entry[1]

    def put(self, ref: PartRef, table: pa.Table) -> None:
        data = ref.inline
        if data is None or self.max_bytes <= 0:
            return
        size = table.get_total_buffer_size() + len(data)
        if size > 4 * len(data) + 4096 or size > self.max_bytes // 4:
            # Buffers much bigger than the encoding (an Arrow IPC encoding holds the
            # table's bytes; a Parquet one holds them compressed): most likely a slice
            # of a larger table, and caching it would pin the parent's buffers (copying
            # it costs about what decoding does); or too big.
            return
        table = table.replace_schema_metadata(None)
        with self._lock:
            old = self._entries.pop(id(data), None)
            if old is not None:
                self._bytes -= old[2]
            self._entries[id(data)] = (data, table, size)
            self._bytes += size
            while self._bytes > self.max_bytes and self._entries:
                _, (_, _, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0


#: The process-wide cache of decoded inline parts (64 MiB of Arrow data at most).
INLINE_CACHE = _InlineCache(64 * _MIB)


def _restore_coerced_types(table: pa.Table, pf: pq.ParquetFile) -> pa.Table:
    """Give back the Arrow types that Parquet cannot hold and Arrow's reader does not
    restore from the stored Arrow schema: ``date64`` (written as a 32-bit date) and
    ``time32[s]`` (written in milliseconds). Both casts are exact."""
    if not any(pa.types.is_date32(t) or pa.types.is_time32(t) for t in table.schema.types):
        return table
    raw = (pf.metadata.metadata or {}).get(b"ARROW:schema")
    if raw is None:
        return table
    stored = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(raw)))
    for i, f in enumerate(table.schema):
        j = stored.get_field_index(f.name)
        if j < 0:
            continue
        want = stored.field(j).type
        if want != f.type and (pa.types.is_date64(want) or pa.types.is_time32(want)):
            table = table.set_column(i, f.with_type(want), table.column(i).cast(want))
    return table


def decode_part(data: bytes, ref: PartRef, columns: Sequence[str] | None = None) -> pa.Table:
    """Verify ``data`` against ``ref`` (size, SHA-256, row count) and parse it.

    Args:
        data: the part's bytes (from the blob store or ``ref.inline``).
        ref: the part's reference.
        columns: read only these columns (``None``: all).

    Raises:
        CorruptPart: naming ``ref.key`` (or ``"<inline>"``) when the size or checksum
            differs, the bytes are not valid Parquet (or, inline, Arrow IPC), the row
            count differs, or a requested column is missing.
    """
    name = _part_name(ref)
    if len(data) != ref.encoded_size_bytes:
        raise CorruptPart(
            name, f"size is {len(data)} bytes, the reference says {ref.encoded_size_bytes}"
        )
    digest = _sha256(data)
    if digest != ref.checksum:
        raise CorruptPart(name, f"SHA-256 {digest} does not match the reference {ref.checksum}")
    if ref.inline is not None and data[:4] == _IPC_STREAM_MAGIC:
        try:
            table = pa.ipc.open_stream(pa.BufferReader(data)).read_all()
            if columns is not None:
                table = table.select(list(columns))
        except KeyError:
            missing = [c for c in columns or () if c not in table.column_names]
            raise CorruptPart(name, f"has no column(s) {missing}") from None
        except (pa.ArrowException, OSError, ValueError, IndexError) as e:
            raise CorruptPart(name, f"not readable as Arrow IPC: {str(e)[:300]}") from None
    else:
        try:
            pf = pq.ParquetFile(pa.BufferReader(data))
            table = pf.read(
                columns=list(columns) if columns is not None else None,
                # Arrow's column-parallel decoding only pays off on big parts; on small
                # ones its task dispatch costs more than the decoding. (Decoding each of
                # several parts in one of our threads instead was faster on repeated
                # reads, but with mimalloc, Arrow's default allocator, reads right after
                # a write then took up to 5x as long, in pool threads whose memory had
                # been freed by other threads.)
                use_threads=len(data) >= _THREADED_DECODE_MIN_BYTES,
            )
            table = _restore_coerced_types(table, pf)
        except (pa.ArrowException, OSError, ValueError, KeyError, IndexError) as e:
            raise CorruptPart(name, f"not readable as Parquet: {str(e)[:300]}") from None
    if table.num_rows != ref.rows:
        raise CorruptPart(name, f"has {table.num_rows} rows, the reference says {ref.rows}")
    if columns is not None and table.num_columns != len(columns):
        missing = [c for c in columns if c not in table.column_names]
        raise CorruptPart(name, f"has no column(s) {missing}")
    return table.replace_schema_metadata(None)


def split_for_parts(
    table: pa.Table, target_part_bytes: int, min_parts: int = 1, multiple_of: int = 1
) -> list[pa.Table]:
    """Row-slice ``table`` into parts of about ``target_part_bytes`` each.

    The size of a row is estimated as ``table.nbytes / num_rows`` (in-memory Arrow
    bytes, an upper bound of the encoded size for typical data); slices are zero-copy and
    their row counts differ by at most one. An empty table gives ``[]``.

    Args:
        table: the rows (in run order).
        target_part_bytes: wanted in-memory bytes per part (> 0).
        min_parts: split into at least this many parts (capped at the row count).
        multiple_of: when there is more than one part, round their number up to a
            multiple of this (the threads that encode them: all finish together instead
            of one encoding the last part alone).

    Raises:
        InvalidUsage: ``target_part_bytes``, ``min_parts`` or ``multiple_of`` is not
            positive.
    """
    if target_part_bytes <= 0:
        raise InvalidUsage(f"target_part_bytes must be > 0, got {target_part_bytes}")
    if min_parts <= 0:
        raise InvalidUsage(f"min_parts must be > 0, got {min_parts}")
    if multiple_of <= 0:
        raise InvalidUsage(f"multiple_of must be > 0, got {multiple_of}")
    n = table.num_rows
    if n == 0:
        return []
    per_row = table.nbytes / n
    rows_per = max(1, int(target_part_bytes // per_row)) if per_row > 0 else n
    count = max(min_parts, math.ceil(n / rows_per))
    if count > 1:
        count = math.ceil(count / multiple_of) * multiple_of
    count = min(count, n)
    base, extra = divmod(n, count)  # the first ``extra`` slices hold one row more
    pieces = []
    start = 0
    for i in range(count):
        rows = base + (1 if i < extra else 0)
        pieces.append(table.slice(start, rows))
        start += rows
    return pieces


class _UploadFailed(Exception):
    """Raised by an encoding task of :func:`write_parts` once an upload has failed."""


def write_parts(
    blob: Blob,
    table: pa.Table,
    key_prefix: str,
    target_part_bytes: int = DEFAULT_TARGET_PART_BYTES,
    inline_max_bytes: int = 4096,
    max_workers: int = 2,
    order: np.ndarray | None = None,
    name_prefix: str = "",
    before_upload: Callable[[], None] | None = None,
) -> list[PartRef]:
    """Encode ``table`` as Parquet parts and upload them; return their refs in order.

    ``before_upload``, if given, is called once before the first blob upload (never for
    a table kept inline); a writer registers itself there, so that GC knows the owner
    of every key it lists (:mod:`persist.keys`).  An error it raises is raised as is,
    with nothing uploaded.

    The table is written as given (consolidate it first for a sorted run), or, with
    ``order`` (an int64 numpy array of row positions, e.g. from
    :func:`consolidate_order`), as ``table.take(order)``: each part is then gathered
    by the thread that encodes it, so the whole reordered table never exists at once
    and gathering overlaps encoding. If its Arrow IPC encoding
    (:func:`encode_inline_part`) is at most ``inline_max_bytes`` it becomes one inline
    part (no blob call; seed ``004``'s inline writes). Otherwise it is split by
    :func:`split_for_parts` (at least ``max_workers`` parts when it holds at least
    ``2 * MIN_PARALLEL_PART_BYTES``, and a multiple of ``max_workers`` when several)
    and the parts are encoded by ``max_workers`` threads, each at key
    ``f"{key_prefix}/{name_prefix}{uuid}.parquet"``, and uploaded by the shared upload
    pool (:func:`persist.pool.submit_io`) while the next parts encode; at most
    ``2 * max_workers`` encoded parts wait for their upload at once. It returns after
    every upload ended. An empty table gives ``[]``.

    If an encoding or an upload fails, no further part is encoded, the keys already
    attempted are deleted best-effort once every upload has ended (an orphan left by a
    failing delete is garbage to GC; no reference to it exists) and the error is raised.

    Raises:
        InvalidKey: ``key_prefix`` does not make valid keys.
        InvalidUsage: bad sizes, or the table cannot be encoded.
        BlobError: an upload failed (its outcome is indeterminate for that key).
    """
    validate_key(f"{key_prefix}/{name_prefix}x.parquet")
    if inline_max_bytes < 0:
        raise InvalidUsage(f"inline_max_bytes must be >= 0, got {inline_max_bytes}")
    if max_workers < 1:
        raise InvalidUsage(f"max_workers must be >= 1, got {max_workers}")
    if order is not None and len(order) != table.num_rows:
        # A row subset or permutation: materialise the (rare) subset case.
        table, order = _take(table, order), None
    n = table.num_rows
    if n == 0:
        return []
    if order is not None and n <= _INLINE_PROBE_ROWS:
        table, order = _take(table, order), None  # a few rows: nothing to overlap
    if order is None and inline_max_bytes > 0 and n <= _INLINE_PROBE_ROWS:
        # Perhaps small enough to be kept inline: try (an IPC encoding of a few rows costs
        # tens of microseconds, less than measuring the table's ``nbytes``).
        small = encode_inline_part(table)
        if len(small) <= inline_max_bytes:
            ref = make_part_ref(None, small, n, inline=True)
            INLINE_CACHE.put(ref, table)
            return [ref]
    nbytes = table.nbytes
    min_parts = 1
    if max_workers > 1 and nbytes >= 2 * MIN_PARALLEL_PART_BYTES:
        min_parts = min(max_workers, nbytes // MIN_PARALLEL_PART_BYTES)
    if order is not None and (min_parts == 1 or nbytes <= _INLINE_PROBE_BYTES):
        table, order = _take(table, order), None  # one part: nothing to overlap
    pieces = split_for_parts(table, target_part_bytes, min_parts=min_parts, multiple_of=max_workers)
    whole: bytes | None = None
    if order is None and (len(pieces) == 1 or nbytes <= _INLINE_PROBE_BYTES):
        whole = encode_part(table)
        if len(pieces) > 1 and len(whole) <= target_part_bytes:
            pieces = [table]  # the whole encoding fits one part: reuse it
    keys = [f"{key_prefix}/{name_prefix}{uuid.uuid4().hex}.parquet" for _ in pieces]
    if before_upload is not None:
        before_upload()
    # Row offsets of the pieces (slices of the table, or of ``order``).
    starts = [0]
    for p in pieces[:-1]:
        starts.append(starts[-1] + p.num_rows)

    # Encoded parts wait for the upload pool; at most this many at once (memory bound).
    in_flight = threading.BoundedSemaphore(2 * max_workers)
    uploads: list[Future[None]] = []
    upload_failed = threading.Event()

    def done(upload: Future[None]) -> None:
        if upload.exception() is not None:
            upload_failed.set()
        in_flight.release()

    def encode(i: int) -> PartRef:
        if upload_failed.is_set():
            raise _UploadFailed
        piece = pieces[i]
        if order is not None:
            piece = _take(table, order[starts[i] : starts[i] + piece.num_rows])
        data = whole if whole is not None and len(pieces) == 1 else encode_part(piece)
        ref = make_part_ref(keys[i], data, piece.num_rows)
        in_flight.acquire()
        try:
            upload = submit_io(blob.set, keys[i], data)
        except BaseException:
            in_flight.release()
            raise
        upload.add_done_callback(done)
        uploads.append(upload)
        return ref

    tasks: list[Callable[[], PartRef]] = [partial(encode, i) for i in range(len(pieces))]
    results, error = run_all(tasks, max_workers)
    if isinstance(error, _UploadFailed):
        error = None  # the failed upload's own error is found below
    for upload in uploads:  # every upload has ended before anything is cleaned up
        failure = upload.exception()
        if failure is not None and error is None:
            error = failure
    if error is not None:
        for key in keys:
            try:
                blob.delete(key)
            except (BlobError, OSError):
                pass
        raise error
    return [r for r in results if r is not None]


def read_parts(
    blob: Blob,
    parts: Iterable[PartRef],
    columns: Sequence[str] | None = None,
    max_workers: int = 2,
    schema: pa.Schema | None = None,
) -> pa.Table:
    """Fetch, verify and decode ``parts`` (``max_workers`` threads); concatenate in order.

    Args:
        blob: the store holding the non-inline parts.
        parts: the refs, in run order.
        columns: read only these columns (``None``: all).
        max_workers: fetch/decode threads.
        schema: the expected schema (restricted to ``columns``); required to return an
            empty table when ``parts`` is empty; when given, every part's schema must
            equal it (else ``CorruptPart``).

    Raises:
        CorruptPart: a part is missing from the blob store, fails its checksum, is not
            Parquet, or does not match ``schema``; the message names its key.
        BlobError: a fetch failed.
        InvalidUsage: no parts and no ``schema``.
    """
    refs = list(parts)
    if schema is not None and columns is not None:
        schema = pa.schema([schema.field(c) for c in columns])
    if not refs:
        if schema is None:
            raise InvalidUsage("read_parts of no parts needs a schema for the empty result")
        return schema.empty_table()

    def fetch(ref: PartRef) -> pa.Table:
        cached = INLINE_CACHE.get(ref)
        if cached is not None:
            try:
                table = cached if columns is None else cached.select(list(columns))
            except KeyError:
                missing = [c for c in columns or () if c not in cached.column_names]
                raise CorruptPart(_part_name(ref), f"has no column(s) {missing}") from None
            if schema is not None and not table.schema.equals(schema):
                have = ", ".join(f"{f.name}: {f.type}" for f in table.schema)
                want = ", ".join(f"{f.name}: {f.type}" for f in schema)
                raise CorruptPart(_part_name(ref), f"schema ({have}) does not match ({want})")
            return table
        if ref.inline is not None:
            data = ref.inline
        else:
            assert ref.key is not None
            got = blob.get(ref.key)
            if got is None:
                raise CorruptPart(ref.key, "the part is missing from the blob store", missing=True)
            data = got
        table = decode_part(data, ref, columns)
        if columns is None:
            INLINE_CACHE.put(ref, table)  # verified: its checksum matched
        if schema is not None and not table.schema.equals(schema):
            have = ", ".join(f"{f.name}: {f.type}" for f in table.schema)
            want = ", ".join(f"{f.name}: {f.type}" for f in schema)
            raise CorruptPart(_part_name(ref), f"schema ({have}) does not match ({want})")
        return table

    tasks: list[Callable[[], pa.Table]] = [partial(fetch, r) for r in refs]
    results, error = run_all(tasks, max_workers)
    if error is not None:
        raise error
    tables = [t for t in results if t is not None]
    if len(tables) == 1:
        return tables[0]
    try:
        return pa.concat_tables(tables)
    except pa.ArrowInvalid as e:
        raise CorruptPart(
            ",".join(_part_name(r) for r in refs[:3]), f"parts have different schemas: {e}"
        ) from None
