"""Fetching a shard's data: reading hollow batches from the blob store and building
snapshots from them, with no handle, lease or state machine involved.

It holds :func:`read_batch` / :func:`read_batches` (a batch's parts, times advanced),
:func:`snapshot_table` (a consolidated snapshot as one table), :func:`stream_snapshot`
(the same rows range of keys by range of keys), and the pruning helpers
(:func:`prune_batches`, :func:`slice_batch`).  Used by :mod:`persist.read`,
:mod:`persist.write`, :mod:`persist.compactor` and the Spark sources.

Invariants kept here:

* a hollow batch's updates are read with their times advanced to the batch's ``lower``
  and ``since`` (``t -> max(t, lower, since)``); for ordinary batches this changes
  nothing, for a batch whose timestamps were rewritten it applies the rewrite (see
  :mod:`persist.batch`);
* every part is conformed to the reader's view *before* consolidating
  (:func:`persist.parts.read_parts` with ``conform``), so rows differing only in a
  dropped column are one row;
* :func:`stream_snapshot` yields exactly the rows of :func:`snapshot_table`, in the same
  order, holding only the parts (and, for a bounded range, the Parquet row groups)
  overlapping the current range; parts without key samples are read whole;
* a part is pruned only when its statistics prove it holds no update at or before the
  ``as_of`` or no row a key/value filter keeps (:func:`prune_batches`).

Sources: Materialize's persist-client ``src/persist-client/src/fetch.rs`` (fetching a
batch's parts apart from the handles that lease them).
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from persist.blob import Blob
from persist.errors import CorruptPart, InvalidUsage
from persist.filters import (
    FILTER_ERRORS,
    apply_filter,
    check_columns,
    check_filter,
    filter_columns,
    update_filter,
)
from persist.parts import TIME, consolidate, read_parts
from persist.pool import run_all
from persist.stats import ColumnStats, min_time, prune_mask
from persist.types import HollowBatch, PartRef
from persist.updates import SchemaHistory
from stash import Antichain

__all__ = [
    "prune_batches",
    "read_batch",
    "read_batches",
    "slice_batch",
    "snapshot_table",
    "stream_snapshot",
]

log = logging.getLogger(__name__)


def _index_time(x: int, what: str) -> int:
    """``x`` as an int time (any integer type, e.g. numpy's), checked to be an i64.

    Raises:
        InvalidUsage: naming ``what``.
    """
    try:
        t = operator.index(x)
    except TypeError:
        raise InvalidUsage(f"{what} must be an int time, got {type(x).__name__}") from None
    if not -(2**63) <= t < 2**63:
        raise InvalidUsage(f"{what} {t} is outside the i64 range of times")
    return t


def _elem(a: Antichain) -> int | None:
    return a.as_option()


#: The floor of a part whose batch has neither a lower nor a since.
_MIN_TIME = -(2**63)


def _layout(batches: Sequence[HollowBatch]) -> tuple[list[PartRef], list[int], list[int]]:
    """The parts of ``batches`` in order, each part's time floor (its batch's lower and
    since; ``-2**63`` if none) and each part's row count."""
    refs: list[PartRef] = []
    floors: list[int] = []
    rows: list[int] = []
    for b in batches:
        lower, since = b.desc.lower.as_option(), b.desc.since.as_option()
        if lower is None:
            floor = _MIN_TIME if since is None else since
        else:
            floor = lower if since is None or since < lower else since
        for p in b.parts:
            refs.append(p)
            floors.append(floor)
            rows.append(p.rows)
    return refs, floors, rows


def _read_refs(
    blob: Blob,
    refs: Sequence[PartRef],
    schema: pa.Schema,
    max_workers: int,
    schemas: tuple[SchemaHistory, int] | None = None,
    columns: Sequence[str] | None = None,
) -> pa.Table:
    # Threads only pay off for blob fetches; inline parts decode faster in this thread.
    remote = sum(1 for r in refs if r.inline is None)
    workers = max(1, min(max_workers, remote))
    if schemas is not None:
        # The conform step: each part as the view of the read version.
        history, dst = schemas
        schema = history.view_schema(dst)
    return read_parts(
        blob, refs, columns=columns, schema=schema, max_workers=workers, conform=schemas
    )


def slice_batch(batch: HollowBatch, indexes: Sequence[int]) -> HollowBatch:
    """The hollow batch holding the parts of ``batch`` at ``indexes`` (ascending): same
    description, ``len`` the kept parts' rows, and ``runs`` marking where the kept parts
    move to another of ``batch``'s runs (so kept parts of two runs are never taken for
    one run)."""
    if len(indexes) == len(batch.parts):
        return batch
    run_of: list[int] = []
    for r, run in enumerate(batch.run_parts()):
        run_of.extend([r] * len(run))
    parts = tuple(batch.parts[i] for i in indexes)
    runs = tuple(j for j in range(1, len(indexes)) if run_of[indexes[j]] != run_of[indexes[j - 1]])
    return HollowBatch(batch.desc, parts, sum(p.rows for p in parts), runs)


def prune_batches(
    batches: Sequence[HollowBatch],
    schema: pa.Schema,
    as_of: int | None,
    filter: pc.Expression | None = None,
    schemas: tuple[SchemaHistory, int] | None = None,
) -> list[HollowBatch]:
    """``batches`` without the parts that cannot contribute to a read at ``as_of``
    (times advanced to their batch's floor all later than ``as_of``) or hold no row
    that the *row* filter ``filter`` (see :func:`check_filter`) keeps, as their
    statistics (:mod:`persist.stats`) show. A part without statistics is kept. With
    ``schemas`` (the shard's history and the read version), a part's statistics count
    only for the columns it really holds under the read version's view (a column the
    view reads as null for that part, e.g. one dropped and added again, has none).
    Batches left without parts are dropped.

    Raises:
        pyarrow.ArrowInvalid: ``filter`` references a column not in ``schema``.
    """
    refs, floors, _rows = _layout(batches)
    keep = [True] * len(refs)
    if as_of is not None:
        for i, (ref, floor) in enumerate(zip(refs, floors, strict=True)):
            t = min_time(ref.stats, floor)
            if t is not None and t > as_of:
                keep[i] = False
    if filter is not None:
        candidates = [i for i, k in enumerate(keep) if k and refs[i].stats is not None]
        mask = prune_mask(
            [(_view_stats(refs[i], schemas), refs[i].rows) for i in candidates], schema, filter
        )
        for i, ok in zip(candidates, mask, strict=True):
            keep[i] = ok
    out: list[HollowBatch] = []
    i = 0
    for b in batches:
        kept = [j for j in range(len(b.parts)) if keep[i + j]]
        i += len(b.parts)
        if kept:
            out.append(slice_batch(b, kept))
    return out


def _view_stats(
    ref: PartRef, schemas: tuple[SchemaHistory, int] | None
) -> Sequence[ColumnStats] | None:
    """``ref``'s statistics restricted to the columns the read version's view takes from
    the part itself (by :class:`persist.updates.ConformPlan`); others are unknown."""
    if schemas is None or ref.stats is None:
        return ref.stats
    history, dst = schemas
    plan = history.plan(ref.schema_id, dst)
    kept = {t for t, src in zip(plan.target.names, plan.sources, strict=True) if src == t}
    return tuple(c for c in ref.stats if c[0] in kept)


def _single_time_run(batches: Sequence[HollowBatch]) -> bool:
    """Whether ``batches`` hold one run whose parts' statistics show a single ``_time``
    (as stored, all equal): such data is already consolidated."""
    live = [b for b in batches if b.parts]
    if len(live) != 1 or live[0].runs:
        return False
    times = set()
    for p in live[0].parts:
        t = [(lo, hi) for name, lo, hi, _n in p.stats or () if name == TIME]
        if not t or t[0][0] != t[0][1]:
            return False
        times.add(t[0][0])
    return len(times) == 1


#: Tables of at most this many rows are advanced by :func:`_advance_and_filter` in Python.
_FEW_ROWS = 32


def _advance_and_filter(
    table: pa.Table, floors: list[int], rows: list[int], lower: int | None, upper: int | None
) -> pa.Table:
    """Advance each row's time to its part's floor, then keep ``lower <= t < upper``."""
    if table.num_rows == 0:
        return table
    ti = table.schema.get_field_index(TIME)
    times = table.column(TIME)
    if table.num_rows <= _FEW_ROWS:
        # A few rows (a merge of one-row parts): the same in Python, without the
        # pyarrow and numpy calls that cost microseconds each however small the input.
        t_py = times.to_pylist()
        t_min, t_max = min(t_py), max(t_py)
        if t_min < max(floors) and sum(rows) == len(t_py):
            row_floors = [f for f, n in zip(floors, rows, strict=True) for _ in range(n)]
            if any(t < f for t, f in zip(t_py, row_floors, strict=True)):
                t_py = [max(t, f) for t, f in zip(t_py, row_floors, strict=True)]
                times = pa.chunked_array([pa.array(t_py, pa.int64())])
                table = table.set_column(ti, table.schema.field(ti), times)
                t_min, t_max = min(t_py), max(t_py)
    else:
        mm = pc.min_max(times)
        t_min, t_max = int(mm["min"].as_py()), int(mm["max"].as_py())
    if table.num_rows > _FEW_ROWS and t_min < max(floors):
        # Some time may lie below its batch's floor: advance them (row-aligned floors).
        floor_arr = np.repeat(np.asarray(floors, dtype=np.int64), np.asarray(rows, dtype=np.int64))
        if len(floor_arr) == table.num_rows:
            t_np = np.asarray(times.to_numpy(), dtype=np.int64)
            if (t_np < floor_arr).any():
                t_np = np.maximum(t_np, floor_arr)
                times = pa.chunked_array([pa.array(t_np, pa.int64())])
                table = table.set_column(ti, table.schema.field(ti), times)
                t_min, t_max = int(t_np.min()), int(t_np.max())
    # Filter only when some time may lie outside [lower, upper): a filter copies the
    # whole table.
    mask = None
    if lower is not None and t_min < lower:
        mask = pc.greater_equal(times, pa.scalar(lower, pa.int64()))
    if upper is not None and t_max >= upper:
        m2 = pc.less(times, pa.scalar(upper, pa.int64()))
        mask = m2 if mask is None else pc.and_(mask, m2)
    if mask is not None:
        table = table.filter(mask)
    return table


def read_batches(
    blob: Blob,
    batches: Sequence[HollowBatch],
    schema: pa.Schema,
    *,
    lower: int | None = None,
    upper: int | None = None,
    max_workers: int = 4,
    schemas: tuple[SchemaHistory, int] | None = None,
    filter: pc.Expression | None = None,
) -> pa.Table:
    """Read hollow batches into one updates table (not consolidated).

    Every time is advanced to its batch's ``lower`` and ``since`` (``t -> max(t, lower,
    since)``; see the module docstring); then, if given, only rows with ``lower <= t``
    and ``t < upper`` are kept, and only those on which ``filter`` (an Arrow boolean
    expression over the updates' columns) is true.

    Args:
        blob: the store of the non-inline parts.
        batches: the hollow batches (any order).
        schema: the shard's updates schema (:func:`persist.updates.updates_schema`).
        lower, upper: optional time bounds (``upper`` exclusive).
        max_workers: fetch/decode threads.
        schemas: ``(the shard's SchemaHistory, the read schema id)``: every part is
            conformed from the schema version it was written with to the view of the
            read version (:meth:`persist.updates.SchemaHistory.conform`), and
            ``schema`` is ignored for that view; ``None``: every part must have
            ``schema`` (a shard of one version).
        filter: keep only the rows it is true on (``None``: all).

    Raises:
        InvalidUsage: ``lower`` or ``upper`` is not an i64 time.
        CorruptPart: a part is missing or corrupt (naming its blob key).
        BlobError: a fetch failed.
        SchemaMismatch: a value does not fit an older reader's type.
    """
    if lower is not None:
        lower = _index_time(lower, "lower")
    if upper is not None:
        upper = _index_time(upper, "upper")
    refs, floors, rows = _layout(batches)
    table = _read_refs(blob, refs, schema, max_workers, schemas)
    table = _advance_and_filter(table, floors, rows, lower, upper)
    if filter is not None:
        table = table.filter(filter)
    return table


def snapshot_table(
    blob: Blob,
    batches: Sequence[HollowBatch],
    schema: pa.Schema,
    key_names: Sequence[str],
    value_names: Sequence[str],
    as_of: int,
    *,
    max_workers: int = 4,
    schemas: tuple[SchemaHistory, int] | None = None,
    filter: pc.Expression | None = None,
    columns: Sequence[str] | None = None,
) -> pa.Table:
    """The updates of ``batches`` as of ``as_of``, consolidated: times ``> as_of`` dropped,
    the rest advanced to ``as_of``, one row per distinct (key, value) with its summed
    ``_diff`` (never zero), sorted by key and value (what :meth:`ReadHandle.snapshot`
    returns); with ``filter``, only its rows on which the filter is true; with
    ``columns``, only those columns (in that order): always exactly
    ``snapshot_table(...).filter(filter).select(columns)``.

    Parts that cannot contribute are not fetched (:func:`prune_batches`): those whose
    times all lie after ``as_of``, and, for a row filter (:func:`check_filter`), those
    whose statistics show no row can pass it. A row filter is applied to the updates
    before they are consolidated (keeping, too, those with a zero or NaN in a float
    column it reads), and every filter to the consolidated rows (see
    :func:`check_filter`).

    When the data is one run whose parts hold a single time (e.g. a shard written by one
    append, or compacted up to its since) it is already consolidated (every writer of a
    run consolidates it), so it is returned as read, its ``_time`` set to ``as_of``,
    without sorting it again; then, when the parts' statistics show it before reading,
    only ``columns`` and the filter's columns are decoded. Otherwise it is read with
    :func:`read_batches` and consolidated (:func:`persist.consolidation.consolidate`),
    which needs every key and value column: (key, value) is a row's identity. With ``schemas`` (see
    :func:`read_batches`) each part is conformed to the read version's view *before*
    consolidation, so rows that differ only in a column the view does not have are one
    row; the single-run shortcut is taken only when conforming keeps the run sorted and
    consolidated (:attr:`persist.updates.ConformPlan.keeps_runs`), and statistics prune
    only by the columns a part really holds under the view.  ``value_names`` must then be
    the view's value columns.

    Raises:
        InvalidUsage: ``as_of`` is not an i64 time; a bad ``filter`` or ``columns``; a
            filter Arrow cannot evaluate on the snapshot's rows.
        CorruptPart: a part is missing or corrupt (naming its blob key).
        BlobError: a fetch failed.
    """
    as_of = _index_time(as_of, "as_of")
    if schemas is not None:
        schema = schemas[0].view_schema(schemas[1])
    if schemas is not None and schemas[1] != schemas[0].newest:
        return _older_snapshot(
            blob, batches, schemas, key_names, value_names, as_of, max_workers, filter, columns
        )
    filt, row_filter = check_filter(filter, schema, key_names, value_names)
    cols = check_columns(columns, schema)
    batches = prune_batches(batches, schema, as_of, filt if row_filter else None, schemas)
    keeps_runs = schemas is None or all(_keeps_runs(schemas, p) for b in batches for p in b.parts)
    read_cols: list[str] | None = None
    if cols is not None and keeps_runs and _single_time_run(batches):
        wanted = {*cols, TIME, *(filter_columns(filt, schema) if filt is not None else ())}
        read_cols = [n for n in schema.names if n in wanted]
    refs, floors, rows = _layout(batches)
    table = _read_refs(blob, refs, schema, max_workers, schemas, read_cols)
    pre = update_filter(filt, schema) if filt is not None and row_filter else None
    table = _snapshot_of(
        table, batches, floors, rows, key_names, value_names, as_of, read_cols, pre, keeps_runs
    )
    if filt is not None:
        table = apply_filter(table, filt)  # exact (again, for a row filter: a no-op)
    return table if cols is None else table.select(cols)


def _older_snapshot(
    blob: Blob,
    batches: Sequence[HollowBatch],
    schemas: tuple[SchemaHistory, int],
    key_names: Sequence[str],
    value_names: Sequence[str],
    as_of: int,
    max_workers: int,
    filter: pc.Expression | None,
    columns: Sequence[str] | None,
) -> pa.Table:
    """The snapshot of a reader of an older schema version: the snapshot under the
    newest version's view, then conformed to the reader's (columns it lacks dropped,
    narrowed types cast back) and consolidated again (rows that differ only in a column
    the reader does not have are one row for it).  Conforming after consolidation means
    a value the reader's narrower type cannot hold raises only when it is in the
    snapshot, whether or not compaction has merged it with later updates."""
    history, dst = schemas
    newest = history.newest
    view = history.view_schema(dst)
    filt, _row = check_filter(filter, view, key_names, value_names)
    cols = check_columns(columns, view)
    table = snapshot_table(
        blob,
        batches,
        history.view_schema(newest),
        key_names,
        history.versions[newest].names,
        as_of,
        max_workers=max_workers,
        schemas=(history, newest),
    )
    table = history.plan(newest, dst).apply(table)
    table = consolidate(table, list(key_names), list(value_names), since=as_of)
    if filt is not None:
        table = apply_filter(table, filt)
    return table if cols is None else table.select(cols)


def _snapshot_of(
    table: pa.Table,
    batches: Sequence[HollowBatch],
    floors: list[int],
    rows: list[int],
    key_names: Sequence[str],
    value_names: Sequence[str],
    as_of: int,
    projected: list[str] | None,
    row_filter: pc.Expression | None = None,
    keeps_runs: bool = True,
) -> pa.Table:
    """The consolidated snapshot at ``as_of`` of ``table``, the parts of ``batches`` read
    in order (only the ``projected`` columns, when the data is one single-time run);
    ``row_filter`` (see :func:`check_filter`) is applied before consolidating. Without
    ``keeps_runs`` (conforming may have made rows of one run collide) it always
    consolidates."""
    live = [b for b in batches if b.parts]
    if len(live) == 1 and not live[0].runs and table.num_rows and keeps_runs:
        ti = table.schema.get_field_index(TIME)
        mm = pc.min_max(table.column(ti))
        lo, hi = int(mm["min"].as_py()), int(mm["max"].as_py())
        if lo == hi:
            if max(lo, floors[0]) > as_of:
                return table.slice(0, 0)
            times = pa.array(np.full(table.num_rows, as_of, dtype=np.int64))
            return table.set_column(ti, table.schema.field(ti), times)
    if projected is not None and table.num_rows:
        raise AssertionError("a projected read of data that is not one single-time run")
    table = _advance_and_filter(table, floors, rows, None, as_of + 1 if as_of < 2**63 - 1 else None)
    if row_filter is not None:
        try:
            table = table.filter(row_filter)
        except FILTER_ERRORS:
            # Arrow fails on these updates: consolidate them all, so that the caller's
            # filter of the snapshot raises (or not) exactly as on the snapshot itself.
            pass
    return consolidate(table, list(key_names), list(value_names), since=as_of)


def _keeps_runs(schemas: tuple[SchemaHistory, int], ref: PartRef) -> bool:
    history, dst = schemas
    return history.plan(ref.schema_id, dst).keeps_runs


def _runs_of(batches: Sequence[HollowBatch]) -> list[tuple[int, list[PartRef]]]:
    """The sorted runs of ``batches``: each run's time floor (see :func:`_layout`) and
    its parts in order."""
    out: list[tuple[int, list[PartRef]]] = []
    for b in batches:
        floor = max(
            (e for e in (_elem(b.desc.lower), _elem(b.desc.since)) if e is not None),
            default=-(2**63),
        )
        for run in b.run_parts():
            out.append((floor, list(run)))
    return out


def read_row_groups(
    blob: Blob,
    ref: PartRef,
    schema: pa.Schema,
    choose: Callable[[list[tuple[int, int]]], list[int]],
) -> pa.Table:
    """The rows of one blob part, verified, restricted to the Parquet row groups
    ``choose`` keeps: it gets every row group as its row range ``[start, end)`` and
    returns the indexes of the groups that may hold wanted rows, in order.

    Anything unexpected (an inline part, no key samples, one row group, a bad size,
    checksum, footer or schema, ``choose`` raising ``ValueError``, ``KeyError`` or
    ``IndexError``, or keeping every group) reads the part whole through
    :func:`persist.parts.read_parts`, which reports corruption.

    Raises:
        CorruptPart: the part is missing or corrupt (naming its key).
        BlobError: the fetch failed.
    """
    from persist.decoding import _restore_coerced_types
    from persist.encoding import _sha256

    if ref.inline is not None or ref.key is None or not ref.key_samples:
        return read_parts(blob, [ref], schema=schema, max_workers=1)
    data = blob.get(ref.key)
    if data is None:
        raise CorruptPart(ref.key, "the part is missing from the blob store", missing=True)
    try:
        if len(data) != ref.encoded_size_bytes or _sha256(data) != ref.checksum:
            raise ValueError("not verified")
        pf = pq.ParquetFile(pa.BufferReader(data))
        meta = pf.metadata
        if meta.num_rows != ref.rows or meta.num_row_groups <= 1:
            raise ValueError("not prunable")
        sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        ends = np.cumsum(sizes)
        keep = choose([(int(e - n), int(e)) for n, e in zip(sizes, ends, strict=True)])
        if len(keep) == len(sizes):
            raise ValueError("nothing to skip")
        if not keep:
            return schema.empty_table()
        table = pf.read_row_groups(keep, use_threads=False)
        table = _restore_coerced_types(table, pf).replace_schema_metadata(None)
        if not table.schema.equals(schema):
            raise ValueError("schema differs")
        return table
    except (pa.ArrowException, OSError, ValueError, KeyError, IndexError, InvalidUsage):
        return read_parts(blob, [ref], schema=schema, max_workers=1)


def _part_in_range(
    blob: Blob,
    ref: PartRef,
    schema: pa.Schema,
    key_schema: pa.Schema,
    lower: pa.Table | None,
    upper: pa.Table | None,
) -> pa.Table:
    """The rows of one part, verified, except for whole Parquet row groups that its key
    samples show to lie entirely below ``lower`` or at or above ``upper`` (the rows
    returned are a contiguous slice of the part, holding every row with a key in
    ``[lower, upper)``); read through :func:`read_row_groups`.

    A row group ``[s, e)`` lies below ``lower`` when a sample at a position ``>= e - 1``
    has a key below ``lower`` (the part is sorted), and at or above ``upper`` when a sample
    at a position ``<= s`` has a key at or above it.

    Raises:
        CorruptPart: the part is missing or corrupt (naming its key).
        BlobError: the fetch failed.
    """
    from persist.merge import decode_keys, key_ranks, sample_positions

    if lower is None and upper is None:
        return read_parts(blob, [ref], schema=schema, max_workers=1)

    def in_range(groups: list[tuple[int, int]]) -> list[int]:
        assert ref.key_samples is not None
        positions = sample_positions(ref.rows)
        if len(positions) != len(ref.key_samples):
            raise ValueError("samples do not match the part's rows")
        samples = decode_keys(ref.key_samples, key_schema)
        bounds = [b for b in (lower, upper) if b is not None]
        ranks = key_ranks(pa.concat_tables([samples, *bounds]), key_schema.names)
        m = samples.num_rows
        below = ranks[:m] < ranks[m] if lower is not None else np.zeros(m, dtype=bool)
        above = ranks[:m] >= ranks[-1] if upper is not None else np.zeros(m, dtype=bool)
        return [
            g
            for g, (start, end) in enumerate(groups)
            if not (below & (positions >= end - 1)).any()
            and not (above & (positions <= start)).any()
        ]

    return read_row_groups(blob, ref, schema, in_range)


#: A snapshot stream cuts each part into about this many key ranges (the part samples'
#: resolution, :data:`persist.merge.SAMPLE_INTERVALS`).
_RANGES_PER_PART = 8


def stream_snapshot(
    blob: Blob,
    batches: Sequence[HollowBatch],
    schema: pa.Schema,
    key_names: Sequence[str],
    value_names: Sequence[str],
    as_of: int,
    *,
    key_schema: pa.Schema,
    lower: pa.Table | None = None,
    upper: pa.Table | None = None,
    max_workers: int = 4,
    schemas: tuple[SchemaHistory, int] | None = None,
) -> Iterator[pa.Table]:
    """The snapshot of ``batches`` at ``as_of`` (what :func:`snapshot_table` returns),
    as consolidated tables in key order, one per key range, holding about one part per
    run in memory at a time.

    The key space is cut into ranges from the parts' key samples
    (:func:`persist.merge.plan_ranges`, about :data:`_RANGES_PER_PART` ranges per part
    of the run with the most parts); each range is the k-way merge
    (:func:`persist.merge.merge_slices`) of the slices of the parts overlapping it; a part
    is fetched when its first range comes and dropped after its last. With ``lower`` /
    ``upper`` (one-row tables of the key columns) only keys in ``[lower, upper)`` are
    returned (a Spark task's key range). When some part has no key samples (written
    before they were recorded), the whole snapshot is read at once instead. With
    ``schemas`` (as :func:`snapshot_table`), each part is conformed from the schema version
    it was written with to the reader's view before it is cut and merged (key columns never
    change between versions, so the key samples stay valid), and re-consolidated when
    conforming can make its rows collide (a dropped column).

    Every row of the snapshot comes out exactly once: all updates of one key fall in one
    range. Empty ranges yield nothing.

    Raises:
        InvalidUsage: ``as_of`` is not an i64 time.
        CorruptPart: a part is missing or corrupt (naming its blob key).
        BlobError: a fetch failed.
    """
    from persist.merge import (
        cut_positions,
        merge_slices,
        part_key_samples,
        plan_ranges,
        slice_range,
    )

    as_of = _index_time(as_of, "as_of")

    def whole() -> Iterator[pa.Table]:
        """The range read from the whole snapshot (built at once), for the cases the
        k-way merge cannot serve."""
        table = snapshot_table(
            blob,
            batches,
            schema,
            key_names,
            value_names,
            as_of,
            max_workers=max_workers,
            schemas=schemas,
        )
        table = slice_range(table, list(key_names), lower, upper)
        if table.num_rows:
            yield table

    if schemas is not None and schemas[1] != schemas[0].newest:
        # An older reader's view is conformed after consolidation (see snapshot_table):
        # read whole, then keep the range.
        yield from whole()
        return
    runs = [(floor, parts) for floor, parts in _runs_of(batches) if parts]
    flat: list[tuple[int, PartRef]] = [(floor, p) for floor, parts in runs for p in parts]
    if not flat:
        return
    keys = list(key_names)
    parts_schema = schema if schemas is None else schemas[0]  # reads schema-less parts
    samples = [part_key_samples(p, keys, parts_schema) for _, p in flat]
    if any(not smp for smp in samples):  # unknown (or, never written, empty)
        yield from whole()
        return
    ranges = _RANGES_PER_PART * max(len(parts) for _, parts in runs)
    plan = plan_ranges(
        [smp for smp in samples if smp],
        [p.encoded_size_bytes for _, p in flat],
        key_schema,
        ranges,
    )
    last_use: dict[int, int] = {}
    for i, ps in enumerate(plan.parts):
        for p in ps:
            last_use[p] = i
    upper_t = as_of + 1 if as_of < 2**63 - 1 else None
    loaded: dict[int, tuple[pa.Table, np.ndarray]] = {}
    ncuts = plan.cuts.num_rows

    def load(p: int) -> tuple[pa.Table, np.ndarray]:
        floor, ref = flat[p]
        if schemas is None:
            table = _part_in_range(blob, ref, schema, key_schema, lower, upper)
        else:
            history, dst = schemas
            history.check_id(ref.schema_id, f"part {ref.key or '<inline>'}")
            conform = history.plan(ref.schema_id, dst)
            raw = _part_in_range(blob, ref, conform.source, key_schema, lower, upper)
            table = conform.apply(raw)
            if not conform.keeps_runs:  # rows differing only in a dropped column now collide
                table = consolidate(table, keys, list(value_names))
        table = _advance_and_filter(table, [floor], [table.num_rows], None, upper_t)
        # One pass places the task's bounds and the plan's cuts in the sorted part.
        bounds = [b for b in (lower, upper) if b is not None]
        pos = cut_positions(table, keys, pa.concat_tables([*bounds, plan.cuts]))
        start = int(pos[0]) if lower is not None else 0
        stop = int(pos[len(bounds) - 1]) if upper is not None else table.num_rows
        stop = max(start, stop)
        pos = np.clip(pos[len(bounds) :] - start, 0, stop - start)
        return table.slice(start, stop - start), pos

    for i, ps in enumerate(plan.parts):
        missing = [p for p in ps if p not in loaded]
        if missing:
            tasks = [functools.partial(load, p) for p in missing]
            remote = sum(1 for p in missing if flat[p][1].inline is None)
            got, error = run_all(tasks, max(1, min(max_workers, remote)))
            if error is not None:
                raise error
            for p, res in zip(missing, got, strict=True):
                assert res is not None
                loaded[p] = res
        slices = []
        for p in ps:
            table, pos = loaded[p]
            start = int(pos[i - 1]) if i > 0 else 0
            stop = int(pos[i]) if i < ncuts else table.num_rows
            if stop > start:
                slices.append(table.slice(start, stop - start))
        for p in ps:
            if last_use[p] == i:
                del loaded[p]
        out = merge_slices(slices, keys, value_names, as_of, schema)
        del slices
        if out.num_rows:
            yield out


def read_batch(
    blob: Blob,
    batch: HollowBatch,
    schema: pa.Schema,
    *,
    lower: int | None = None,
    upper: int | None = None,
    max_workers: int = 4,
    schemas: tuple[SchemaHistory, int] | None = None,
) -> pa.Table:
    """:func:`read_batches` of one batch."""
    return read_batches(
        blob, [batch], schema, lower=lower, upper=upper, max_workers=max_workers, schemas=schemas
    )
