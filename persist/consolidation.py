"""Consolidation of updates tables (differential dataflow's ``consolidate_updates``).

:func:`consolidate` sorts updates by (key columns, value columns, ``_time``) and sums the
diffs of equal rows; :func:`consolidate_order` gives the sorting permutation alone, for
callers that gather later (the part writer).

Invariants kept here:

* :func:`consolidate` returns updates sorted by (key columns, value columns, ``_time``)
  with nulls last in every column (floats: NaN after numbers, before null), one row per
  distinct (key, value, time) whose ``_diff`` is the sum of that group's diffs (never
  zero), and every ``_time`` at least ``since``; equal means equal values, nulls equal to
  nulls, NaN equal to NaN, ``-0.0`` equal to ``0.0``; values order as Arrow sorts them,
  decimals of every width by value (``decimal32``/``decimal64`` as ``decimal128``:
  :func:`_sort_type`);
* it is vectorised (pyarrow compute and numpy; no per-row Python), except for tables
  of at most ``_SMALL_ROWS`` rows, which are sorted and grouped in Python with the same
  order, equality and stable tie order as the Arrow path (a differential test,
  tests/persist/test_consolidate_small.py, checks they agree).
"""

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist.errors import DiffOverflow, InvalidUsage
from persist.updates import DIFF, TIME, is_supported_type

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
# is a timsort unless the word looks random at both fine and coarse grain
# (:func:`_sort_kind`).

#: A table whose chunks hold fewer rows than this on average is combined into one
#: chunk before it is consolidated (see :func:`consolidate_order`).
_COMBINE_ROWS_PER_CHUNK = 1024

#: Tables with fewer rows are sorted by Arrow's multi-column sort_indices directly.
_CODES_MIN_ROWS = 20_000
#: Tables of at most this many rows are sorted and grouped in Python
#: (:func:`_small_order`) when every sort column's type has a Python order equal to
#: consolidation's: a merge of a few one-row parts (the compactor's most frequent
#: merge) paid about 0.45 ms for the dozens of Arrow compute calls of :func:`_adjacent`
#: and ``sort_indices`` over 21 columns of 8 rows, each costing microseconds however
#: small its input. Converting only the columns that break ties, the Python path also
#: wins on the next merges up (eight runs of 21 columns, median us, Python vs Arrow:
#: 64 rows 255 vs 611, 128 rows 292 vs 531, 256 rows 410 vs 542; 512 rows 656 vs 604;
#: when every row ties on all key columns, 128 rows 472 vs 1091). Tests set it to 0 to
#: take the Arrow path.
_SMALL_ROWS = 128
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
    """``arr``'s validity as a numpy bool array (``None``: no null), unpacked from its
    bitmap by numpy (a tenth of the time of ``is_valid().to_numpy()``)."""
    if arr.null_count == 0:
        return None
    bitmap = arr.buffers()[0]
    assert bitmap is not None  # an array with nulls has a validity bitmap
    off, n = arr.offset, len(arr)
    first = off // 8
    raw = np.frombuffer(bitmap, np.uint8, count=(off + n + 7) // 8 - first, offset=first)
    bits = np.unpackbits(raw, bitorder="little")[off % 8 : off % 8 + n]
    return bits.view(np.bool_)


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
    """Codes of a float column: numbers < NaN < null; NaN == NaN; -0.0 == 0.0.

    Read from the values buffer as it lies (what is under a null slot never reaches a
    code); integral values within +-2**53 are coded as integers ``value - min``."""
    valid = _valid_mask(arr)
    n = len(arr)
    data = arr.buffers()[1]
    assert data is not None
    width = arr.type.byte_width
    raw = np.frombuffer(data, np.dtype(f"f{width}"), count=n, offset=arr.offset * width)
    f = raw.astype(np.float64) if width != 8 else raw
    nan = np.isnan(f)  # also under null slots: masked by ``valid`` below
    num = ~nan if valid is None else (~nan & valid)
    every = bool(num.all())
    if every:
        g = f
    elif num.any():
        g = np.where(num, f, f[int(np.argmax(num))])  # the rest filled with a number
    else:
        g = np.zeros(n, dtype=np.float64)  # no number at all
    lo, hi = (float(g.min()), float(g.max())) if n else (0.0, 0.0)
    if -(2.0**53) <= lo and hi <= 2.0**53:
        ints = g.astype(np.int64)  # exact for integral values: |value| <= 2**53
        if np.array_equal(ints, g):
            # Integral values: code them as integers (-0.0 and 0.0 both become 0).
            imin = int(lo)
            top = int(hi) - imin
            codes = (ints - np.int64(imin)).view(np.uint64)
            size = top + 1
            nan_rows = nan if valid is None else (nan & valid)
            if nan_rows.any():
                codes[nan_rows] = np.uint64(size)
                size += 1
            if valid is not None:
                codes[~valid] = np.uint64(size)
                size += 1
            return codes, size
    # General floats: IEEE-754 bits made order-preserving; NaN just above +inf.
    f = np.where(valid, f, 0.0) if valid is not None else f
    bits = (f + 0.0).view(np.int64)  # + 0.0 turns -0.0 into 0.0
    key = np.where(bits < 0, ~bits, bits | np.int64(-(2**63))).view(np.uint64)
    key[nan if valid is None else (nan & valid)] = _NAN_KEY
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
    if _is_narrow_decimal(t):
        arr = arr.cast(_sort_type(t))  # no dictionary kernel for decimal32/decimal64
    return _rank_codes(arr)


def _is_narrow_decimal(t: pa.DataType) -> bool:
    """Whether ``t`` is ``decimal32`` or ``decimal64`` (pyarrow >= 18)."""
    return pa.types.is_decimal(t) and not (pa.types.is_decimal128(t) or pa.types.is_decimal256(t))


def _sort_type(t: pa.DataType) -> pa.DataType:
    """The type ``t``'s values are sorted as: ``decimal32``/``decimal64`` as the
    ``decimal128`` of their precision and scale (Arrow has no sort kernel for them, and
    its multi-column sort orders them by their bytes, not by value: ``0.50`` before
    ``-1.00``, while its comparisons, Python and Spark order them by value); any other
    type as itself."""
    return pa.decimal128(t.precision, t.scale) if _is_narrow_decimal(t) else t


def _sort_view(table: pa.Table, cols: Sequence[str]) -> pa.Table:
    """``table`` with its columns ``cols`` of a narrow decimal type cast to
    :func:`_sort_type` (``table`` itself when there is none), for Arrow's
    ``sort_indices``: every path then orders rows by value."""
    out = table
    for c in cols:
        t = table.schema.field(c).type
        if _is_narrow_decimal(t):
            i = out.schema.get_field_index(c)
            out = out.set_column(i, pa.field(c, _sort_type(t)), out.column(i).cast(_sort_type(t)))
    return out


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


#: Stride of the coarse sample :func:`_sort_kind` checks for order.
_COARSE_STRIDE = 64


def _sort_kind(word: np.ndarray) -> Literal["stable", "quicksort"]:
    """The numpy sort kind for ``word``: ``"stable"`` (timsort) unless the word is
    disordered both between neighbours and at a stride of :data:`_COARSE_STRIDE` rows
    (at least a quarter of the pairs descending in each), then ``"quicksort"``.

    Timsort sorts short stretches by insertion and then merges them, galloping over
    stretches that do not overlap: on words sorted except within small neighbourhoods
    (TPC-H lineitem by order key then part key: each order's few lines are shuffled,
    37% of neighbour pairs descend, none at a stride of 64) it took 0.07 s on 6M rows
    where numpy's quicksort took 0.44 to 0.51 s. On random words the two are within
    20% of each other (numpy 2.4, 6M rows: 0.77 against 0.82 s; 300k rows: 24
    against 19 ms), so quicksort is kept only there.
    """
    n = len(word)
    descents = int(np.count_nonzero(word[1:] < word[:-1]))
    if descents * 4 < n:
        return "stable"
    coarse = word[::_COARSE_STRIDE]
    coarse_descents = int(np.count_nonzero(coarse[1:] < coarse[:-1]))
    return "stable" if coarse_descents * 4 < len(coarse) else "quicksort"


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
        order = np.argsort(word, kind=_sort_kind(word))
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
    sub_order = pc.sort_indices(
        _sort_view(sub, rest), sort_keys=[(c, "ascending") for c in [run_name, *rest]]
    )
    sub_sorted = sub.take(sub_order)
    order[pos] = rows[np.asarray(sub_order.to_numpy(), dtype=np.int64)]
    _, sub_same = _adjacent(sub_sorted, rest, check_order=False)
    same = np.zeros(n - 1, dtype=bool)
    if sub_same is not None:
        p = pos[:-1]
        pair = (pos[1:] == p + 1) & tie[np.minimum(p, n - 2)]
        same[p[pair]] = sub_same[pair]
    return order, same


def _row_values(table: pa.Table, at: int) -> dict[str, object]:
    """Row ``at`` of ``table`` as Python values, to show in an error: a value Python
    cannot hold (a duration, date or timestamp beyond ``datetime``'s range) is shown as
    Arrow prints it, with its type (``"duration[s] 4611686018427387904"``), rather than
    raising ``OverflowError`` in place of the error being reported."""
    row: dict[str, object] = {}
    for name, col in zip(table.column_names, table.columns, strict=True):
        cell = col.slice(at, 1)
        try:
            row[name] = cell.to_pylist()[0]
        except (OverflowError, ValueError):
            text = cell.to_string(skip_new_lines=True).strip().strip("[]").strip()
            row[name] = f"{col.type} {text}"
    return row


def _py_values(col: pa.ChunkedArray) -> list[Any] | None:
    """The values of a sort column as Python objects that compare, through
    :func:`_small_keys`, in consolidation's order and equality: numbers, decimals,
    booleans, strings (Python orders by code point, which is UTF-8's byte order, Arrow's)
    and binary as themselves, temporal values as their integer storage: every type a shard
    holds (:func:`persist.updates.is_supported_type`); ``None`` for any other type (then
    the Arrow path sorts).  Decimals of every width order by value, as the Arrow paths
    sort them (:func:`_sort_type`)."""
    t = col.type
    if not is_supported_type(t):
        return None
    if pa.types.is_temporal(t):
        view = pa.int32() if t.bit_width == 32 else pa.int64()
        return col.combine_chunks().view(view).to_pylist()  # type: ignore[no-any-return]
    return col.to_pylist()  # type: ignore[no-any-return]


def _small_keys(values: list[Any], floating: bool, nulls: bool) -> list[Any]:
    """Sort keys of one column's Python values in consolidation's order: numbers (and
    other values) first, then NaN, then null; NaN equal to NaN (``-0.0`` already equals
    ``0.0`` in Python). Values are their own keys when neither occurs."""
    if not floating and not nulls:
        return values
    return [
        (2, 0) if x is None else (1, 0) if x != x else (0, x)  # x != x: NaN
        for x in values
    ]


def _small_order(table: pa.Table, cols: Sequence[str]) -> tuple[list[int] | None, np.ndarray]:
    """For a table of a few rows whose sort columns all have a Python order
    (:func:`_py_values`): the stable order sorting it by ``cols`` (``None`` when it is
    already sorted) and the ``same`` mask of the sorted rows (``same[i]``: sorted row
    ``i + 1`` equals sorted row ``i`` on every column), exactly what the Arrow path
    (``sort_indices``, which is stable, then :func:`_adjacent`) gives.

    Column by column, as a lexicographic sort breaks ties: the rows are sorted (stably)
    by the first column, then each run of rows tied so far by the next one, and a column
    is converted to Python values only while some rows are still tied. A merge of
    one-row parts is usually told apart by its first few key columns (each at its own
    time at worst), so the other columns are never converted: converting them cost most
    of such a merge's consolidation (about 12 us per column).

    Raises:
        LookupError: a column needed to break a tie has a type with no Python order, or
            is a string column holding bytes that are not UTF-8 (Arrow does not check
            them; it orders them by their bytes): the caller sorts with Arrow.
    """
    n = table.num_rows
    perm = list(range(n))
    ties = [(0, n)] if n > 1 else []  # runs [start, end) of ``perm`` tied so far
    for c in cols:
        if not ties:
            break
        col = table.column(c)
        try:
            values = _py_values(col)
        except UnicodeDecodeError:
            raise LookupError(c) from None
        if values is None:
            raise LookupError(c)
        key = _small_keys(values, pa.types.is_floating(col.type), col.null_count > 0)
        at = key.__getitem__
        still = []
        for start, end in ties:
            run = sorted(perm[start:end], key=at)  # stable: ties keep their order
            perm[start:end] = run
            first, prev = start, key[run[0]]
            for j in range(1, end - start):
                k = key[run[j]]
                if k != prev:
                    if start + j - first > 1:
                        still.append((first, start + j))
                    first, prev = start + j, k
            if end - first > 1:
                still.append((first, end))
        ties = still
    same = np.zeros(max(n - 1, 0), dtype=bool)
    for start, end in ties:
        same[start : end - 1] = True
    return (None if perm == list(range(n)) else perm), same


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


class _GroupOverflow(Exception):
    """The sum of group ``index`` does not fit in int64."""

    def __init__(self, index: int) -> None:
        self.index = index


def _sum_groups(diffs: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Sums of ``diffs`` over groups beginning at ``starts``, as int64.

    Raises:
        _GroupOverflow: a sum does not fit in int64 (the first such group).
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
            raise _GroupOverflow(int(np.flatnonzero(bad)[0]))
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
    integer codes (see the comment above ``_CODES_MIN_ROWS``). Tables of a few rows
    (``_SMALL_ROWS``: a merge of one-row parts or of a few small runs) are sorted in
    Python instead, with the same result (:func:`_small_order`).
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
            rejects, or ``_time``/``_diff`` are not non-null int64.
        DiffOverflow: the diffs of a row (key, value, time) sum beyond int64 (its
            ``row`` names it).
    """
    table, order = consolidate_order(table, key_names, value_names, since)
    return table if order is None else _take(table, order)


#: The last schemas :func:`_schema_problems` judged, with their columns and verdicts.
_PROBLEMS: list[tuple[pa.Schema, tuple[str, ...], tuple[str | None, str | None]]] = []
_PROBLEMS_KEPT = 16


def _schema_problems(schema: pa.Schema, cols: tuple[str, ...]) -> tuple[str | None, str | None]:
    """What :func:`consolidate_order` refuses in ``schema`` alone (its column
    ``cols``, then ``_diff``): the first column missing, and the first of ``cols`` of
    an unsupported type, as error messages (``None``: nothing).  The verdicts of the
    last few schemas are kept (a writer consolidates tables of one schema over and
    over), found by ``==`` (names, types and nullability; hashing a schema costs more
    than judging it)."""
    global _PROBLEMS
    for seen, seen_cols, verdict in _PROBLEMS:
        if seen_cols == cols and seen == schema:
            return verdict
    missing = unsupported = None
    for c in [*cols, DIFF]:
        if schema.get_field_index(c) < 0:
            missing = f"consolidate: the table has no column {c!r}"
            break
    else:
        for c in cols:
            if not is_supported_type(schema.field(c).type):
                unsupported = (
                    f"consolidate: column {c!r} has unsupported type {schema.field(c).type}"
                )
                break
    verdict = (missing, unsupported)
    # A new list, never one mutated in place (readers in other threads iterate it).
    _PROBLEMS = [(schema, cols, verdict), *_PROBLEMS[: _PROBLEMS_KEPT - 1]]
    return verdict


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
    missing, unsupported = _schema_problems(table.schema, tuple(cols))
    if missing is not None:
        raise InvalidUsage(missing)
    for c in (TIME, DIFF):
        col = table.column(c)
        if col.type != pa.int64() or col.null_count:
            raise InvalidUsage(f"column {c!r} must be non-null int64, got {col.type}")
    if unsupported is not None:
        raise InvalidUsage(unsupported)
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
    chunks = table.column(TIME).num_chunks
    if chunks > 1 and n <= _COMBINE_ROWS_PER_CHUNK * chunks:
        # Many small chunks (a merge of small parts: one chunk per part): every compute
        # call below pays per chunk, so one contiguous copy costs less (16 one-row
        # parts: 0.74 -> 0.45 ms).
        table = table.combine_chunks()
    if since is not None:
        times = table.column(TIME)
        # A few rows: their minimum in Python (a compute call costs microseconds).
        t_min = min(times.to_pylist()) if n <= _SMALL_ROWS else pc.min(times).as_py()
        if t_min < since:
            i = table.schema.get_field_index(TIME)
            advanced = pc.max_element_wise(times, pa.scalar(since, pa.int64()))
            table = table.set_column(i, table.schema.field(i), advanced)
    order: np.ndarray | None = None
    same: np.ndarray | None = None
    small: tuple[list[int] | None, np.ndarray] | None = None
    if n <= _SMALL_ROWS:
        try:
            small = _small_order(table, cols)
        except LookupError:
            small = None
    if small is not None:
        perm, same = small
        if perm is not None:  # what the Arrow path's stable sort_indices gives
            table = table.take(pa.array(perm, pa.int64()))
    elif n > 1:
        in_order, same = _adjacent(table, cols, check_order=True)
        if not in_order:
            if n >= _CODES_MIN_ROWS:
                order, same = _codes_order(table, cols)
            else:
                arrow_order = pc.sort_indices(
                    _sort_view(table, cols), sort_keys=[(c, "ascending") for c in cols]
                )
                table = table.take(arrow_order)
                _, same = _adjacent(table, cols, check_order=False)
    diff_index = table.schema.get_field_index(DIFF)
    if small is not None and not small[1].any():  # a few rows, none equal to another
        if 0 in table.column(DIFF).to_pylist():
            table = table.filter(pc.not_equal(table.column(DIFF), 0))
        return table, None
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
    try:
        sums = _sum_groups(diffs, starts)
    except _GroupOverflow as e:
        at = int(starts[e.index]) if order is None else int(order[starts[e.index]])
        raise DiffOverflow(_row_values(table.select(cols), at)) from None
    keep = sums != 0
    rows = starts[keep] if order is None else order[starts[keep]]
    out = table.take(pa.array(rows, pa.int64()))
    return out.set_column(
        diff_index, table.schema.field(diff_index), pa.array(sums[keep], pa.int64())
    ), None
