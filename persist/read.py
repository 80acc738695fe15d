"""Reading a shard: snapshots as of a time, listens to new updates, leased since holds.

A :class:`ReadHandle` is a leased reader of one shard (the persist-client ``ReadHandle``):
it holds the shard's since back at its own since hold until it downgrades it or its lease
expires (no heartbeat within the lease duration), so that data it may still read is never
compacted past what it needs.  Reads go through :func:`read_batch`, which is also the
entry point for other readers of hollow batches (compactor, Spark).

Invariants kept here:

* a hollow batch's updates are read with their times advanced to the batch's ``lower``
  and ``since`` (``t -> max(t, lower, since)``); for ordinary batches this changes
  nothing, for a batch whose timestamps were rewritten it applies the rewrite (see
  :mod:`persist.batch`);
* ``snapshot(as_of)`` is the shard's contents at ``as_of``: every update with time
  ``<= as_of``, consolidated, one row per distinct (key, value) with ``_time = as_of`` and
  its summed ``_diff``, rows summing to zero absent; it needs ``since <= as_of < upper``
  (``SinceViolation`` / ``InvalidUsage``), or waits for the upper with ``wait=True``;
* reads conform every part to the reader's view *before* consolidating
  (one step, :func:`persist.parts.read_parts` with ``conform``): a part written
  under another schema version comes back with the reader's columns (added ones null,
  widened ones cast, dropped ones gone), so rows differing only in a dropped column are
  one row;
* ``snapshot_stream(as_of)`` / :func:`stream_snapshot` yield exactly the rows of
  ``snapshot(as_of)``, in the same order, range of keys after range of keys, holding
  only the parts (and, for a bounded range, the Parquet row groups) overlapping the
  current range; parts without key samples are read whole;
  ``snapshot(as_of, filter=f, columns=c)`` is exactly ``snapshot(as_of).filter(f)
  .select(c)`` (or raises ``InvalidUsage`` naming ``f`` where that raises): a part is
  skipped only when its statistics prove it holds no update at or before ``as_of`` or
  no row a key/value filter keeps (:func:`prune_batches`), updates are filtered before
  consolidation only as :mod:`persist.filters` allows;
* a reader holds a *seqno* in the state (its lease's seqno hold): never later than the
  oldest version a read of this handle is using (a ``snapshot`` in progress, the last
  ``snapshot_batches``), so GC keeps every part those versions reference; a snapshot
  that meets a missing part re-reads the state and retries before it reports it;
* a :class:`Listen` emits every update with time ``> as_of`` exactly once, in time
  order of the batches' uppers, each ``updates`` event followed by the ``progress``
  frontier it completes, the first progress as soon as the upper passes ``as_of``; its
  own lease holds the since at most at the last progress minus one, so compaction never
  moves an update it has yet to emit into the range it already emitted; it emits only
  what it read from a state holding its lease, and once the lease is lost it fails for
  good (``LeaseExpired`` on every call, nothing more emitted);
* listens, and read handles during ``snapshot(wait=True)`` / ``snapshot_batches(wait=
  True)``, renew their lease in the background (:class:`persist.lease.LeaseKeeper`); a
  read by a handle whose lease is gone raises ``LeaseExpired``, never a bare
  ``SinceViolation``;
* every public entry point taking a time or frontier checks it is an i64 time (or an
  Antichain) before it takes a lease, raising ``InvalidUsage`` naming the argument.

Sources: Materialize's persist-client ``ReadHandle``, ``Listen`` and ``LeasedReaderState`` (
``src/persist-client/src/batch.rs``) and the first engine's listeners (``src/persist/src/indexed/``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import threading
import time
import uuid
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from persist.blob import Blob
from persist.errors import (
    CorruptPart,
    DiffOverflow,
    InvalidUsage,
    PersistError,
    SinceViolation,
)
from persist.filters import (
    FILTER_ERRORS,
    apply_filter,
    check_columns,
    check_filter,
    filter_columns,
    update_filter,
)
from persist.handle import ShardHandle
from persist.lease import DEFAULT_KEEPER, LeaseKeeper
from persist.machine import ShardMachine
from persist.parts import TIME, consolidate, read_parts
from persist.pool import run_all
from persist.state import LeaseExpired, ShardState
from persist.stats import ColumnStats, min_time, prune_mask
from persist.types import HollowBatch, PartRef
from persist.updates import SchemaHistory
from stash import Antichain

if TYPE_CHECKING:
    from persist.client import PersistClient

__all__ = [
    "Listen",
    "ListenEvent",
    "ReadHandle",
    "apply_filter",
    "check_columns",
    "check_filter",
    "prune_batches",
    "read_batch",
    "read_batches",
    "slice_batch",
    "snapshot_table",
    "stream_snapshot",
]

log = logging.getLogger(__name__)

#: How many times a snapshot re-reads the state after meeting a missing part.
_MISSING_RETRIES = 2


def _elem(a: Antichain) -> int | None:
    return a.as_option()


def _layout(batches: Sequence[HollowBatch]) -> tuple[list[PartRef], list[int], list[int]]:
    """The parts of ``batches`` in order, each part's time floor (its batch's lower and
    since; ``-2**63`` if none) and each part's row count."""
    refs: list[PartRef] = []
    floors: list[int] = []
    rows: list[int] = []
    for b in batches:
        floor = max(
            (e for e in (_elem(b.desc.lower), _elem(b.desc.since)) if e is not None),
            default=None,
        )
        for p in b.parts:
            refs.append(p)
            floors.append(-(2**63) if floor is None else floor)
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


def _advance_and_filter(
    table: pa.Table, floors: list[int], rows: list[int], lower: int | None, upper: int | None
) -> pa.Table:
    """Advance each row's time to its part's floor, then keep ``lower <= t < upper``."""
    if table.num_rows == 0:
        return table
    ti = table.schema.get_field_index(TIME)
    times = table.column(TIME)
    mm = pc.min_max(times)
    t_min, t_max = int(mm["min"].as_py()), int(mm["max"].as_py())
    if t_min < max(floors):
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
    ``[lower, upper)``).

    A row group ``[s, e)`` lies below ``lower`` when a sample at a position ``>= e - 1``
    has a key below ``lower`` (the part is sorted), and at or above ``upper`` when a sample
    at a position ``<= s`` has a key at or above it. Anything unexpected (an inline part,
    no samples, one row group, a bad checksum or footer) reads the part whole through
    :func:`persist.parts.read_parts`, which reports corruption.

    Raises:
        CorruptPart: the part is missing or corrupt (naming its key).
        BlobError: the fetch failed.
    """
    from persist.decoding import _restore_coerced_types
    from persist.encoding import _sha256
    from persist.merge import decode_keys, key_ranks, sample_positions

    whole = (lower is None and upper is None) or ref.inline is not None or not ref.key_samples
    if whole:
        return read_parts(blob, [ref], schema=schema, max_workers=1)
    assert ref.key is not None and ref.key_samples is not None
    data = blob.get(ref.key)
    if data is None:
        raise CorruptPart(ref.key, "the part is missing from the blob store", missing=True)
    positions = sample_positions(ref.rows)
    try:
        if len(data) != ref.encoded_size_bytes or _sha256(data) != ref.checksum:
            raise ValueError("not verified")
        pf = pq.ParquetFile(pa.BufferReader(data))
        meta = pf.metadata
        groups = meta.num_row_groups
        if meta.num_rows != ref.rows or groups <= 1 or len(positions) != len(ref.key_samples):
            raise ValueError("not prunable")
        ends = np.cumsum([meta.row_group(i).num_rows for i in range(groups)])
        starts = ends - np.asarray([meta.row_group(i).num_rows for i in range(groups)])
        samples = decode_keys(ref.key_samples, key_schema)
        bounds = [b for b in (lower, upper) if b is not None]
        ranks = key_ranks(pa.concat_tables([samples, *bounds]), key_schema.names)
        m = samples.num_rows
        below = ranks[:m] < ranks[m] if lower is not None else np.zeros(m, dtype=bool)
        above = ranks[:m] >= ranks[-1] if upper is not None else np.zeros(m, dtype=bool)
        keep = [
            g
            for g in range(groups)
            if not (below & (positions >= ends[g] - 1)).any()
            and not (above & (positions <= starts[g])).any()
        ]
        if len(keep) == groups:
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
    samples = [part_key_samples(p, keys) for _, p in flat]
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


def _as_time(x: int | Antichain, what: str) -> int:
    if isinstance(x, Antichain):
        t = x.as_option()
        if t is None:
            raise InvalidUsage(f"{what} must be a time, not the empty antichain")
        return t
    if isinstance(x, bool) or not isinstance(x, int):
        raise InvalidUsage(f"{what} must be an int time or an Antichain, got {type(x).__name__}")
    if not -(2**63) <= x < 2**63:
        raise InvalidUsage(f"{what} {x} is outside the i64 range of times")
    return x


def _as_frontier(x: int | Antichain, what: str) -> Antichain:
    if isinstance(x, Antichain):
        return x
    if isinstance(x, bool) or not isinstance(x, int):
        raise InvalidUsage(f"{what} must be an Antichain or an int, got {type(x).__name__}")
    if not -(2**63) <= x < 2**63:
        raise InvalidUsage(f"{what} {x} is outside the i64 range of times")
    return Antichain.from_elem(x)


@dataclass(frozen=True)
class ListenEvent:
    """One event of a :class:`Listen`.

    Attributes:
        kind: ``"updates"`` or ``"progress"``.
        updates: for ``"updates"``: a table of the shard's updates schema, consolidated
            per (key, value, time), times in ``[previous progress, progress)``.
        progress: for ``"progress"``: the new frontier; every update before it was
            emitted.
    """

    kind: Literal["updates", "progress"]
    updates: pa.Table | None = None
    progress: Antichain | None = None


class ReadHandle(ShardHandle):
    """A leased reader of one shard.  Made by :meth:`persist.client.PersistClient.open`.

    Attributes:
        shard_id: the shard's id.  name: its registered name.
        reader_id: this reader's id in the shard state.
        key_schema, value_schema: the shard's schemas.
    """

    role = "reader"

    def __init__(
        self,
        client: PersistClient,
        machine: ShardMachine,
        name: str,
        reader_id: str,
        key_schema: pa.Schema,
        value_schema: pa.Schema,
        lease_seconds: float,
    ) -> None:
        super().__init__(client, machine, name, reader_id, key_schema, value_schema, lease_seconds)
        self.reader_id = reader_id
        self._last_heartbeat_ms = machine.now_ms()
        # Seqno holds (persist.gc): the seqnos of the versions this handle may still be
        # reading; its hold in the state never passes the oldest.
        self._seqno_leases: dict[int, int] = {}  # lease token -> seqno
        self._seqno_lock = threading.Lock()
        self._next_lease = 0
        self._batches_lease: int | None = None  # held for the last snapshot_batches
        self._held_beat: int | None = None  # keeper registration while that hold lives

    def read_schemas(self) -> tuple[SchemaHistory, int]:
        """``(the shard's schema history, this reader's schema id)``, for
        :func:`read_batches` / :func:`snapshot_table` of batches this handle listed:
        their parts are conformed to this reader's view.  The history is
        the latest this process knows, which holds every version a listed part names."""
        return self._machine.state().schemas(), self.schema_id

    # ------------------------------------------------------------ seqno holds
    def _lease_seqno(self) -> int:
        """Lease the seqno of the latest version this process knows (before reading a
        newer-or-equal one): until released, the reader's seqno hold stays at or before
        it.  Returns the lease token."""
        seqno = self._machine.state().seqno  # taken under the machine lock: see heartbeat
        with self._seqno_lock:
            self._next_lease += 1
            self._seqno_leases[self._next_lease] = seqno
            return self._next_lease

    def _release_seqno(self, token: int | None) -> None:
        if token is not None:
            with self._seqno_lock:
                self._seqno_leases.pop(token, None)

    def _seqno_hold(self) -> int | None:
        """The oldest leased seqno (``None``: no read in progress)."""
        with self._seqno_lock:
            return min(self._seqno_leases.values(), default=None)

    #: Renews leases in the background (inject a ``LeaseKeeper(thread=False)`` with a
    #: fake clock in tests).
    lease_keeper: LeaseKeeper = DEFAULT_KEEPER
    #: Interval of the background heartbeat in seconds (``None``: a quarter lease).
    heartbeat_seconds: float | None = None

    # ---------------------------------------------------------------- frontiers
    @property
    def since(self) -> Antichain:
        """This reader's since hold (the shard's since is at most this)."""
        self._check()
        st = self._machine.state()
        r = st.readers.get(self.reader_id)
        if r is None:
            st = self._machine.fetch()
        return st.reader(self.reader_id).since

    def shard_since(self) -> Antichain:
        """The shard's since, freshly read."""
        return self._machine.fetch().since

    # -------------------------------------------------------------------- leases
    def downgrade_since(self, since: Antichain | int) -> None:
        """Advance this reader's since hold to ``since``: it promises not to read before
        it; the shard's since follows the meet of the live readers' holds.  Also renews
        the lease.

        A ``since`` earlier than the current hold is a no-op (the hold stays; the lease
        is still renewed), as in Materialize's persist.

        Raises:
            InvalidUsage: ``since`` is not a time/frontier in the i64 range; the reader
                expired (:class:`~persist.state.LeaseExpired`).
        """
        self._check()
        frontier = _as_frontier(since, "since")
        now = self._machine.now_ms()
        self._machine.downgrade_since(self.reader_id, frontier, now, self._seqno_hold)
        self._last_heartbeat_ms = now
        self._client._notify_compactor(self.shard_id)

    def heartbeat(self) -> None:
        """Renew the lease now.

        Raises:
            LeaseExpired: the lease already ran out and another process dropped it.
        """
        self._check()
        now = self._machine.now_ms()
        # A read leasing its seqno after this runs reads this version or a newer one.
        self._machine.heartbeat_reader(self.reader_id, now, self._seqno_hold)
        self._last_heartbeat_ms = now

    def _maybe_heartbeat(self) -> None:
        if self._machine.now_ms() - self._last_heartbeat_ms > self._lease_ms // 4:
            self.heartbeat()

    def detach(self) -> None:
        """Hand the parts of the last :meth:`snapshot_batches` to readers elsewhere
        (e.g. Spark executors reading what a driver planned): this reader stops holding
        the since back, keeps its seqno hold until its lease runs out (the client's
        ``reader_lease_seconds`` from now), so GC deletes none of those parts meanwhile,
        and becomes unusable here (closing the client does not expire it).

        Raises:
            LeaseExpired: the reader's lease already ran out.
        """
        self._check()
        now = self._machine.now_ms()
        hold = self._seqno_hold()
        self._machine.detach_reader(self.reader_id, now, hold)
        self._expired = True
        self._stop_keeping_alive()  # the hold now lasts one lease, as documented
        self._client._handles.discard(self)
        self._client._notify_compactor(self.shard_id)

    def expire(self) -> None:
        """Release the lease (the since hold goes away).  The handle is unusable after.
        Idempotent."""
        if self._expired:
            return
        self._expired = True
        self._stop_keeping_alive()
        self._release_seqno(self._batches_lease)
        self._batches_lease = None
        self._machine.expire_reader(self.reader_id)
        self._client._notify_compactor(self.shard_id)

    # --------------------------------------------------------------------- reads
    @contextlib.contextmanager
    def _kept_alive(self) -> Iterator[None]:
        """Renew this reader's lease in the background (every
        :attr:`heartbeat_seconds`, default a quarter lease) for the duration."""

        def beat() -> bool:
            try:
                self.heartbeat()
            except LeaseExpired:
                return False  # the wait notices it in the state it reads
            return True

        interval = self.heartbeat_seconds or self._lease_ms / 4000
        keeper = self.lease_keeper
        ident = keeper.register(f"reader {self.reader_id}", max(interval, 0.001), beat)
        try:
            yield
        finally:
            keeper.unregister(ident)

    def _lease_lost(self, st: ShardState) -> LeaseExpired | None:
        """A :class:`LeaseExpired` if this reader is no longer in ``st``.

        Raises:
            InvalidUsage: the shard was finalized (dropped).
        """
        st.check_not_finalized()
        if self.reader_id in st.readers:
            return None
        e = LeaseExpired(self.shard_id, self.reader_id)
        e.args = (
            f"{e.args[0]}; the since hold it kept is gone, so what it was waiting to read "
            "may have been compacted",
        )
        return e

    def _state_for(self, as_of: int, wait: bool, timeout: float | None) -> ShardState:
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not 0 <= timeout < 1e9
        ):
            raise InvalidUsage(
                f"timeout must be None or a finite number of seconds >= 0, got {timeout!r}"
            )
        st = self._machine.recent()
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while True:
            lost = self._lease_lost(st)
            if lost is not None:
                raise lost
            if not st.since.less_equal(as_of):
                raise SinceViolation(as_of, st.since)
            if not st.upper.less_equal(as_of):
                return st
            if not wait:
                raise InvalidUsage(
                    f"snapshot as_of {as_of} of shard {self.name!r} is not before its upper "
                    f"{st.upper}: the data is not yet definite (use wait=True to wait)"
                )
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"shard {self.name!r}: upper {st.upper} did not pass as_of {as_of} "
                    f"within {timeout} s"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
            st = self._machine.recent()

    def snapshot_batches(
        self, as_of: int | Antichain, *, wait: bool = False, timeout: float | None = None
    ) -> list[HollowBatch]:
        """The hollow batches holding the shard's updates up to ``as_of`` (for callers
        that read parts themselves, e.g. Spark; read them with :func:`read_batches`
        using ``upper=as_of + 1``, then consolidate with ``since=as_of``).  While it
        waits (``wait=True``) the lease is renewed in the background.

        The reader holds the version they come from (its seqno hold, recorded in the
        state at its next heartbeat, stays at or before it) until its next
        ``snapshot_batches`` call or :meth:`expire`, and its lease is renewed in the
        background meanwhile, so GC deletes none of their parts however long the caller
        takes to read them.

        Raises: as :meth:`snapshot`.
        """
        self._check()
        t = _as_time(as_of, "as_of")
        token = self._lease_seqno()
        try:
            batches = self._batches_for(t, wait, timeout)
        except BaseException:
            self._release_seqno(token)
            raise
        old, self._batches_lease = self._batches_lease, token
        self._release_seqno(old)
        self._keep_alive_while_held()
        return batches

    def snapshot_stream(
        self,
        as_of: int | Antichain,
        *,
        wait: bool = False,
        timeout: float | None = None,
        max_chunk_rows: int = 64 * 1024,
    ) -> Iterator[pa.RecordBatch]:
        """The shard's contents as of ``as_of`` (what :meth:`snapshot` returns: one row
        per distinct (key, value) with ``_time = as_of`` and its summed ``_diff``, in key
        and value order), streamed as record batches of at most ``max_chunk_rows`` rows
        with bounded memory: a k-way merge of the sorted runs by key range
        (:func:`stream_snapshot`) holding about one part per run at a time.

        The version read is held (its seqno hold) until the iterator ends or is closed,
        and the lease is renewed in the background meanwhile.

        Raises: as :meth:`snapshot` (when the iteration starts); ``InvalidUsage`` if
            ``max_chunk_rows < 1``.
        """
        self._check()
        t = _as_time(as_of, "as_of")
        if (
            isinstance(max_chunk_rows, bool)
            or not isinstance(max_chunk_rows, int)
            or max_chunk_rows < 1
        ):
            raise InvalidUsage(f"max_chunk_rows must be an int >= 1, got {max_chunk_rows!r}")

        def gen() -> Iterator[pa.RecordBatch]:
            token = self._lease_seqno()
            try:
                with self._kept_alive():
                    batches = self._batches_for(t, wait, timeout)
                    for table in stream_snapshot(
                        self._client.blob,
                        batches,
                        self.schema,
                        self.key_schema.names,
                        self.value_schema.names,
                        t,
                        key_schema=self.key_schema,
                        max_workers=self._client.read_workers,
                        schemas=self.read_schemas(),
                    ):
                        yield from table.to_batches(max_chunksize=max_chunk_rows)
            except DiffOverflow as e:
                raise e.in_shard(f"{self.name!r} ({self.shard_id})") from e
            finally:
                self._release_seqno(token)

        return gen()

    def _keep_alive_while_held(self) -> None:
        """While the result of :meth:`snapshot_batches` is held (until :meth:`expire` or
        :meth:`detach`), renew the lease in the background, as persist-client's reader
        heartbeat task does, so the seqno hold outlives any read however long.  The keeper
        holds the handle weakly: a handle dropped without ``expire`` stops renewing, and
        its lease runs out like a crashed reader's."""
        if self._held_beat is not None:
            return
        ref = weakref.ref(self)

        def beat() -> bool:
            h = ref()
            if h is None or h._expired:
                return False
            try:
                h.heartbeat()
            except LeaseExpired:
                return False
            return True

        interval = self.heartbeat_seconds or self._lease_ms / 4000
        self._held_beat = self.lease_keeper.register(
            f"reader {self.reader_id} (held batches)", max(interval, 0.001), beat
        )

    def _stop_keeping_alive(self) -> None:
        ident, self._held_beat = self._held_beat, None
        if ident is not None:
            self.lease_keeper.unregister(ident)

    def _batches_for(self, t: int, wait: bool, timeout: float | None) -> list[HollowBatch]:
        self._maybe_heartbeat()
        if not wait:
            return self._batches_at(self._state_for(t, False, timeout), t)
        with self._kept_alive():
            return self._batches_at(self._state_for(t, True, timeout), t)

    @staticmethod
    def _batches_at(st: ShardState, t: int) -> list[HollowBatch]:
        return [b for b in st.batches() if b.len > 0 and b.desc.lower.less_equal(t)]

    def snapshot(
        self,
        as_of: int | Antichain,
        *,
        wait: bool = False,
        timeout: float | None = None,
        filter: pc.Expression | None = None,
        columns: Sequence[str] | None = None,
    ) -> pa.Table:
        """The shard's contents as of ``as_of``: one row per distinct (key, value) with
        ``_time = as_of`` and its summed ``_diff`` (never zero), sorted by key and value.

        With ``filter`` and ``columns`` the result is exactly
        ``snapshot(as_of).filter(filter).select(columns)``, read without fetching the
        parts whose statistics show they hold no row the filter keeps (when it reads
        only key and value columns) and, for data already consolidated, without decoding
        the other columns (see :func:`snapshot_table`).

        Args:
            as_of: a time (int) or ``{t}``.
            wait: if ``as_of`` is not yet before the upper, wait until it is (renewing
                the lease in the background meanwhile).
            timeout: with ``wait``, give up after this many seconds (``TimeoutError``).
            filter: a boolean ``pyarrow.compute`` expression over the key, value,
                ``_time`` and ``_diff`` columns, e.g. ``pc.field("id") < 10``.
            columns: the columns to return, in order (``None``: all).

        Raises:
            SinceViolation: ``as_of`` is before the shard's since.
            LeaseExpired: this reader's lease was lost (it was dropped from the shard
                state), e.g. while waiting.
            InvalidUsage: ``as_of`` is at or beyond the upper (without ``wait``); a
                bad ``filter`` or ``columns`` (checked before anything is read); a
                filter Arrow cannot evaluate on the snapshot's rows (where
                ``snapshot(as_of).filter(filter)`` raises).
            CorruptPart: a part is missing or corrupt (naming its blob key).
            DiffOverflow: the diffs of a row sum beyond int64 (naming the shard and
                the row).
            BlobError, ConsensusError: storage failed.
        """
        self._check()
        t = _as_time(as_of, "as_of")
        check_filter(filter, self.schema, self.key_schema.names, self.value_schema.names)
        check_columns(columns, self.schema)
        for attempt in range(_MISSING_RETRIES + 1):
            token = self._lease_seqno()  # GC keeps what this version references
            try:
                batches = self._batches_for(t, wait, timeout)
                return snapshot_table(
                    self._client.blob,
                    batches,
                    self.schema,
                    self.key_schema.names,
                    self.value_schema.names,
                    t,
                    max_workers=self._client.read_workers,
                    schemas=self.read_schemas(),
                    filter=filter,
                    columns=columns,
                )
            except DiffOverflow as e:
                raise e.in_shard(f"{self.name!r} ({self.shard_id})") from e
            except CorruptPart as e:
                # A part of an old version may be gone (e.g. the lease had lapsed): a
                # newer version may not reference it; report corruption only if the
                # latest version still does.
                if not e.missing or attempt == _MISSING_RETRIES:
                    raise
                log.info("snapshot of shard %s met a missing part, re-reading: %s", self.name, e)
                self._machine.fetch()
            finally:
                self._release_seqno(token)
        raise AssertionError("unreachable")  # pragma: no cover

    def listen(
        self,
        as_of: int | Antichain,
        *,
        poll_min_seconds: float = 0.001,
        poll_max_seconds: float = 0.25,
        hold_interval_seconds: float = 1.0,
        heartbeat_seconds: float | None = None,
    ) -> Listen:
        """An iterator of :class:`ListenEvent`\\ s: the updates with times ``> as_of`` as
        they commit, each batch of updates followed by the new upper (``progress``); the
        first progress comes as soon as the upper passes ``as_of``.  Polls consensus
        with exponential backoff between ``poll_min_seconds`` and ``poll_max_seconds``.
        Stops after the progress ``{}`` (the shard was closed).  The listen holds its
        own lease, renewed in the background every ``heartbeat_seconds`` (default a
        quarter of the lease) by :attr:`lease_keeper`, whose since hold follows the
        emitted progress (moved at most every ``hold_interval_seconds``, each move
        being a state change); close it (or use it as a context manager).

        Raises:
            InvalidUsage: ``as_of`` is not a time, or is the largest i64 time (no time
                is after it); checked before any lease is taken.
            SinceViolation: ``as_of`` is before the shard's since.
        """
        self._check()
        t = _as_time(as_of, "as_of")
        if t >= 2**63 - 1:
            raise InvalidUsage(
                f"listen as_of {t} is the largest i64 time: a listen emits updates after "
                "as_of, and no time is after it"
            )
        if heartbeat_seconds is not None and not heartbeat_seconds > 0:
            raise InvalidUsage(f"heartbeat_seconds must be > 0, got {heartbeat_seconds}")
        listen = Listen(
            self,
            t,
            poll_min_seconds,
            poll_max_seconds,
            hold_interval_seconds,
            heartbeat_seconds,
        )
        self._client._handles.add(listen)
        return listen

    def __enter__(self) -> ReadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.expire()
        except PersistError as e:  # pragma: no cover - best effort on exit
            log.warning("could not expire reader %s: %s", self.reader_id, e)


class Listen:
    """A listen over a shard from ``as_of`` (see :meth:`ReadHandle.listen`).

    Its lease is kept alive by the handle's :class:`~persist.lease.LeaseKeeper` while it
    is open.  Once the lease is lost (the reader was dropped from the shard state, or
    the since passed what it has yet to emit), the listen fails for good: every later
    call raises :class:`~persist.state.LeaseExpired` and it emits nothing more.
    Thread-safe (one lock per listen).
    """

    def __init__(
        self,
        handle: ReadHandle,
        as_of: int,
        poll_min: float,
        poll_max: float,
        hold_interval: float = 1.0,
        heartbeat_seconds: float | None = None,
    ) -> None:
        self._h = handle
        self._machine = handle._machine
        self.as_of = as_of
        self._frontier = as_of + 1  # every time < frontier was emitted (or is <= as_of)
        self._emitted = False  # whether a progress was emitted
        self._poll_min = poll_min
        self._poll_max = poll_max
        self._hold_interval_ms = int(hold_interval * 1000)
        self._pending: list[ListenEvent] = []
        self._done = False
        self._closed = False
        self._failed: PersistError | None = None
        self._lock = threading.RLock()
        # A step is reading the batches of a version: the background heartbeat must not
        # move the seqno hold past it meanwhile (GC would delete what it reads).
        self._reading = False
        self.reader_id = "l" + uuid.uuid4().hex
        self._lease_ms = handle._lease_ms
        now = self._machine.now_ms()
        hold = Antichain.from_elem(as_of)
        self._machine.register_listen(self.reader_id, as_of, now, self._lease_ms)
        self._last_hold_ms = now
        self._hold = hold
        interval = heartbeat_seconds if heartbeat_seconds is not None else self._lease_ms / 4000
        self._keeper = handle.lease_keeper
        # A weak reference: a listen dropped without close() stops renewing its lease
        # (it then expires like any crashed reader) instead of living on in the keeper.
        beat = weakref.WeakMethod(self._beat)
        self._beat_id: int | None = self._keeper.register(
            f"listen {self.reader_id}",
            max(interval, 0.001),
            lambda: (m := beat()) is not None and m(),
        )

    @property
    def frontier(self) -> Antichain:
        """Every update before this frontier has been emitted."""
        return Antichain.from_elem(self._frontier) if not self._done else Antichain()

    def __iter__(self) -> Iterator[ListenEvent]:
        return self

    def __next__(self) -> ListenEvent:
        delay = self._poll_min
        while True:
            with self._lock:
                if self._failed is not None:
                    raise self._failed
                if self._pending:
                    return self._pending.pop(0)
                if self._done or self._closed:
                    raise StopIteration
                if self._step():
                    continue
            time.sleep(delay)
            delay = min(delay * 2, self._poll_max)

    def poll(self) -> list[ListenEvent]:
        """The events available now, without waiting (possibly none).

        Raises:
            LeaseExpired: the listen's lease was lost (now or earlier): it emits nothing
                more.
            ConsensusError, BlobError, CorruptPart: storage failed (nothing was
                consumed; the next poll tries again).
        """
        with self._lock:
            if self._failed is not None:
                raise self._failed
            if not self._done and not self._closed:
                self._step()
            out, self._pending = self._pending, []
            return out

    def _fail(self, e: PersistError) -> PersistError:
        """Fail for good with ``e``: drop queued events, stop the heartbeat, release."""
        self._failed = e
        self._pending = []
        self.close()
        return e

    def _lost(self, st: ShardState) -> PersistError | None:
        """Why the listen cannot read ``st``: not registered (lease expired) or the
        since passed the time it has yet to emit."""
        try:
            st.check_not_finalized()
        except InvalidUsage as e:
            return e
        if self.reader_id not in st.readers:
            return LeaseExpired(self._machine.shard_id, self.reader_id, "listen")
        if not st.since.less_equal(self._frontier - 1):
            return LeaseExpired(self._machine.shard_id, self.reader_id, "listen")
        return None

    def _step(self) -> bool:
        """Check consensus once; queue events if the upper moved past what was emitted
        (the first progress as soon as it passes ``as_of``).  Returns whether it queued
        any.  Nothing is queued unless the listen still held its lease in the state it
        read and kept it while renewing.  While it runs, the background heartbeat keeps
        the seqno hold where it is (at or before the version read)."""
        self._reading = True  # before the state is read: see _beat
        try:
            return self._step_reading()
        except DiffOverflow as e:
            raise e.in_shard(self._machine.shard_id) from e
        finally:
            self._reading = False

    def _step_reading(self) -> bool:
        st = self._machine.recent()
        lost = self._lost(st)
        if lost is not None:
            raise self._fail(lost)
        upper = st.upper
        u = upper.as_option()
        if u is not None and (u <= self.as_of or (self._emitted and u <= self._frontier)):
            self._renew(st)
            return False
        f = self._frontier
        events: list[ListenEvent] = []
        batches = [
            b
            for b in st.batches()
            if b.len > 0
            and not b.desc.upper.less_equal(f)
            and (u is None or b.desc.lower.less_than(u))
        ]
        if batches and (u is None or f < u):
            table = read_batches(
                self._h._client.blob,
                batches,
                self._h.schema,
                lower=f,
                upper=u,
                max_workers=self._h._client.read_workers,
                schemas=(st.schemas(), self._h.schema_id),
            )
            table = consolidate(table, self._h.key_schema.names, self._h.value_schema.names)
            if table.num_rows:
                events.append(ListenEvent("updates", updates=table))
        events.append(ListenEvent("progress", progress=upper))
        if u is not None:
            old = self._frontier
            self._frontier = max(u, f)
            try:
                self._renew(st, advanced=True)
            except BaseException:
                self._frontier = old  # nothing emitted: the next step reads it again
                raise
        self._pending.extend(events)
        self._emitted = True
        if u is None:
            self._done = True
            self.close()
        return True

    def _renew(self, st: ShardState, advanced: bool = False) -> None:
        """Move the listen's hold up to the emitted frontier minus one (at most every
        hold interval) and renew the lease (at least every quarter lease).

        Raises:
            LeaseExpired: the lease was lost (the listen fails for good).
        """
        now = self._machine.now_ms()
        if now - self._last_hold_ms < min(self._hold_interval_ms, self._lease_ms // 4):
            return
        if not advanced and now - self._last_hold_ms < self._lease_ms // 4:
            return
        target = Antichain.from_elem(self._frontier - 1)
        try:
            self._machine.downgrade_since(self.reader_id, target, now)
        except LeaseExpired as e:
            raise self._fail(e) from None
        self._last_hold_ms = now
        self._hold = target
        self._h._client._notify_compactor(self._machine.shard_id)

    def _beat(self) -> bool:
        """The background heartbeat: renew the lease.  Returns ``False`` (stop) once the
        listen is closed or its lease is lost."""
        if self._closed or self._failed is not None:
            return False
        now = self._machine.now_ms()
        try:
            # The hold is read under the machine's lock, as the step's read of the state
            # is: a step that began before reads a version no older than this hold, and
            # one reading now keeps the hold unchanged (seqno 0: never moved backwards,
            # not forwards).
            self._machine.heartbeat_reader(
                self.reader_id, now, lambda: 0 if self._reading else None
            )
        except LeaseExpired as e:
            self._failed = e
            return False
        return True

    def close(self) -> None:
        """Release the listen's lease and stop its heartbeat.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        beat, self._beat_id = self._beat_id, None
        if beat is not None:
            self._keeper.unregister(beat)
        try:
            self._machine.expire_reader(self.reader_id)
        except PersistError as e:
            log.warning("could not release listen lease %s: %s", self.reader_id, e)

    def expire(self) -> None:
        """Same as :meth:`close`."""
        self.close()

    def __enter__(self) -> Listen:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
