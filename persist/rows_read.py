"""The read of a row-level change: the live rows a filter keeps, decoding only the
Parquet row groups that can hold one.

A row-level change (:mod:`persist.rows`) reads the consolidated live rows that its
filter keeps, usually a narrow key range of a big shard.  :func:`persist.fetch.
snapshot_table` already skips the parts whose statistics exclude the filter, but decodes
every kept part whole; a part holds about :data:`persist.encoding.ROW_GROUPS_PER_PART`
row groups, so a one-row update decoded a whole part (tens of MiB) to find one row.
:func:`read_live_rows` also skips, within each kept part, the row groups whose range of
the first key column shows the filter false for all their rows.  Parts store no Parquet
statistics but ``_time``'s; the range comes from the part's key samples (a part is
sorted by key, so its first key column does not decrease), and the filter is judged
under it by :func:`persist.stats.prune_mask`, as parts are.  This is the row-group
pruning of Parquet readers (``pyarrow.dataset``'s ``split_by_row_group(filter)``; Apache
Parquet's ``ColumnMetaData.statistics``) with persist's samples for statistics, as
:func:`persist.fetch.stream_snapshot` uses them for key ranges.

Why it is exact: the row filter is applied to the *updates* before they are
consolidated (:func:`persist.filters.check_filter`: all updates of one (key, value) row
agree on every column the filter reads, so it keeps all of them or none); a skipped row
group holds only updates that filter drops.  So consolidating the updates of the kept
row groups gives the same rows as consolidating all of them and filtering.

The pruning is used only where it is plainly sound, else the read is
:func:`snapshot_table`'s: the filter reads key and value columns only (a row filter),
none of them floating-point (the updates filter keeps zeros and NaNs) or of a type
Parquet stores coerced (e.g. ``date64``), and the first key column is of such a plain
type too; every part was written under the schema version read (no conforming).  A
part that is inline, has no key samples or one row group, or whose footer cannot be
used, is read whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist.blob import Blob
from persist.consolidation import consolidate
from persist.fetch import (
    _advance_and_filter,
    _layout,
    prune_batches,
    read_row_groups,
    snapshot_table,
)
from persist.filters import apply_filter, check_filter, filter_columns
from persist.stats import ColumnStats, encode_value, prune_mask
from persist.types import HollowBatch, PartRef
from persist.updates import SchemaHistory

__all__ = ["read_live_rows", "row_groups_prunable"]


def _plain_type(t: pa.DataType) -> bool:
    """Types that Parquet stores as they are and whose values sort as Arrow compares
    them, without NaN or ``-0.0``: integers, decimals, strings, binaries, booleans and
    32-bit dates."""
    return bool(
        pa.types.is_integer(t)
        or pa.types.is_decimal(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_boolean(t)
        or pa.types.is_date32(t)
    )


def row_groups_prunable(
    filter: pc.Expression | None,
    schema: pa.Schema,
    key_names: Sequence[str],
    value_names: Sequence[str],
) -> bool:
    """Whether ``filter`` may prune row groups by their statistics: a row filter (key and
    value columns only, see :func:`persist.filters.check_filter`) that reads at least
    one column and only columns of plain types (see the module docstring).

    Raises:
        InvalidUsage: a bad ``filter`` (as :func:`check_filter`).
    """
    filt, row_filter = check_filter(filter, schema, key_names, value_names)
    if filt is None or not row_filter:
        return False
    cols = filter_columns(filt, schema, [*key_names, *value_names])
    return (
        bool(cols)
        and bool(key_names)
        and _plain_type(schema.field(key_names[0]).type)
        and all(_plain_type(schema.field(c).type) for c in cols)
    )


def _group_stats(
    ref: PartRef, key_schema: pa.Schema, groups: Sequence[tuple[int, int]]
) -> list[tuple[tuple[ColumnStats, ...] | None, int]]:
    """For each row group ``[start, end)`` of a part, statistics of its first key column
    (``None``: unknown) and its row count, from the part's key samples.

    The part is sorted by key (ascending, nulls last), so its first key column does not
    decrease: a row group's values lie between the samples taken at the last sampled
    position ``<= start`` and the first ``>= end - 1``; when both are non-null, the
    group has no null in it either (nulls come last)."""
    from persist.merge import decode_keys, sample_positions

    assert ref.key_samples is not None
    positions = sample_positions(ref.rows)
    if len(positions) != len(ref.key_samples):
        raise ValueError("samples do not match the part's rows")
    first = decode_keys(ref.key_samples, key_schema).column(0)
    name = key_schema.names[0]
    out: list[tuple[tuple[ColumnStats, ...] | None, int]] = []
    for start, end in groups:
        i_lo = int(np.searchsorted(positions, start, side="right")) - 1
        i_hi = int(np.searchsorted(positions, end - 1, side="left"))
        lo, hi = first[i_lo], first[min(i_hi, len(positions) - 1)]
        enc = (encode_value(lo), encode_value(hi)) if lo.is_valid and hi.is_valid else None
        ok = enc is not None and enc[0] is not None and enc[1] is not None
        out.append((((name, enc[0], enc[1], 0),) if ok and enc else None, end - start))
    return out


def _pruned_part(
    blob: Blob, ref: PartRef, schema: pa.Schema, key_schema: pa.Schema, filter: pc.Expression
) -> pa.Table:
    """The updates of one part, verified, but for the row groups whose first key column
    (bounded by the part's key samples, :func:`_group_stats`) shows ``filter`` false
    for all their rows (:func:`persist.stats.prune_mask`); read through
    :func:`persist.fetch.read_row_groups`, which reads the part whole when anything is
    unexpected.

    Raises:
        CorruptPart: the part is missing or corrupt (naming its key).
        BlobError: the fetch failed.
    """

    def matching(groups: list[tuple[int, int]]) -> list[int]:
        mask = prune_mask(_group_stats(ref, key_schema, groups), schema, filter)
        return [g for g, m in enumerate(mask) if m]

    return read_row_groups(blob, ref, schema, matching)


def read_live_rows(
    blob: Blob,
    batches: Sequence[HollowBatch],
    schema: pa.Schema,
    key_names: Sequence[str],
    value_names: Sequence[str],
    as_of: int,
    *,
    schemas: tuple[SchemaHistory, int],
    filter: pc.Expression | None,
    max_workers: int = 4,
) -> pa.Table:
    """The consolidated rows of ``batches`` as of ``as_of`` that ``filter`` keeps:
    exactly ``snapshot_table(..., filter=filter)`` (same columns, one row per (key,
    value) with its summed ``_diff``, ``_time = as_of``), reading, of the parts whose
    statistics can hold a kept row, only the row groups that can (module docstring).

    Args:
        blob: the shard's blob store.
        batches: the batches of the state read.
        schema: the updates schema of the read version's view.
        key_names, value_names: the view's key and value columns.
        as_of: the read time (int).
        schemas: ``(history, read version)``, as for :func:`snapshot_table`.
        filter: a boolean ``pyarrow.compute`` expression, or ``None`` (all rows).
        max_workers: fetch threads.

    Raises:
        InvalidUsage: a bad ``filter``.
        CorruptPart: a part is missing or corrupt (naming its blob key).
        BlobError: a fetch failed.
    """
    history, dst = schemas
    parts = [p for b in batches for p in b.parts]
    if (
        not row_groups_prunable(filter, schema, key_names, value_names)
        or dst != history.newest
        or any(p.schema_id != dst for p in parts)
    ):
        return snapshot_table(
            blob,
            batches,
            schema,
            key_names,
            value_names,
            as_of,
            max_workers=max_workers,
            schemas=schemas,
            filter=filter,
        )
    assert filter is not None
    kept = prune_batches(batches, schema, as_of, filter, schemas)
    refs, floors, _rows = _layout(kept)
    from persist.pool import run_all

    key_schema = pa.schema([schema.field(k) for k in key_names])
    tasks = [lambda ref=ref: _pruned_part(blob, ref, schema, key_schema, filter) for ref in refs]
    remote = sum(1 for r in refs if r.inline is None)
    got, error = run_all(tasks, max(1, min(max_workers, remote)))
    if error is not None:
        raise error
    tables = [t for t in got if t is not None]
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    upper = as_of + 1 if as_of < 2**63 - 1 else None
    table = _advance_and_filter(table, floors, [t.num_rows for t in tables], None, upper)
    table = apply_filter(table, filter)  # no float column read: the exact filter
    table = consolidate(table, list(key_names), list(value_names), since=as_of)
    return apply_filter(table, filter)
