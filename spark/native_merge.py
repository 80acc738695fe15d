"""The driver's side of a native read: the direct parts' rows of the tail's keys, read
decoding only the Parquet row groups that can hold one, and a bounded cache of the row
groups decoded.

A native read (:mod:`spark.native_plan`) merges the small consolidated tail with the rows
of the direct parts that share a key with it; Spark reads every other direct row as
stored. Direct parts are sorted by key (each is a part of a consolidated run), so the
part's key samples (:func:`persist.merge.key_samples`, taken at
:func:`persist.merge.sample_positions`, first and last row included) bound the keys of
each of its row groups: a row group ``[s, e)`` holds keys between the sample at the last
sampled position ``<= s`` and the one at the first sampled position ``>= e - 1``.
:func:`touched_rows` decodes only the row groups whose bound holds a tail key (compared by
consolidation's order, :func:`persist.merge.key_ranks`: nulls and NaN as consolidation
matches them), through :func:`persist.fetch.read_row_groups`, which verifies the part's
checksum and reads it whole on anything unexpected. This is the row-group pruning of
Parquet readers (``pyarrow.dataset``'s ``split_by_row_group``) with persist's key samples
for statistics, as :mod:`persist.rows_read` does for row-level changes.

The cache (:data:`ROW_GROUP_CACHE`): a part's bytes never change under its blob key
(persist writes each key once and a ref carries the bytes' SHA-256, checked when they are
decoded), so the decoded row groups of a part, keyed by the blob store, the key, the
checksum and the row groups kept, are the same in every later read that lists that part
on whatever state version: reading the same direct parts again (a dashboard re-reading a
table between compactions) decodes nothing. Which parts a read uses is decided on the
state version it lists, never by the cache. After Materialize's persist-client, whose
``internal/cache.rs`` keeps fetched blobs in memory for the same reason, bounded in bytes.

Invariants: :func:`touched_rows` returns exactly the rows of the given parts whose key is
one of the tail's keys (conformed to the read view); the cache holds at most
``max_bytes`` of Arrow data (by ``Table.nbytes``) and answers only for the same (store,
key, checksum, row group).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["ROW_GROUP_CACHE", "RowGroupCache", "touched_rows"]

_MIB = 1024 * 1024
#: Row-group layouts remembered at most (then forgotten all at once).
MAX_LAYOUTS = 100_000


class RowGroupCache:
    """An LRU of decoded row groups of blob parts, bounded by their Arrow buffer bytes.

    Args:
        max_bytes: the bound (bytes); a table larger than it is not kept; ``0`` keeps
            nothing.

    Attributes:
        hits, misses: :meth:`get` calls answered and not answered since the last
            :meth:`clear`.

    Thread-safe: one lock guards the map; decoding happens outside it.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._tables: OrderedDict[tuple[Any, ...], pa.Table] = OrderedDict()
        self._bytes = 0
        self._layouts: dict[tuple[Any, ...], list[tuple[int, int]]] = {}
        self.hits = 0
        self.misses = 0

    def layout(self, part: tuple[Any, ...]) -> list[tuple[int, int]] | None:
        """The row groups (``[start, end)`` row ranges) of ``part`` (``(store, key,
        checksum)``) when known."""
        with self._lock:
            return self._layouts.get(part)

    def set_layout(self, part: tuple[Any, ...], groups: list[tuple[int, int]]) -> None:
        """Remember ``part``'s row groups (a few bytes each; forgotten all at once past
        :data:`MAX_LAYOUTS` parts)."""
        with self._lock:
            if len(self._layouts) >= MAX_LAYOUTS:
                self._layouts.clear()
            self._layouts[part] = list(groups)

    def get(self, key: tuple[Any, ...]) -> pa.Table | None:
        """The table cached under ``key`` (now the most recently used), or ``None``."""
        with self._lock:
            table = self._tables.get(key)
            if table is None:
                self.misses += 1
                return None
            self._tables.move_to_end(key)
            self.hits += 1
            return table

    def put(self, key: tuple[Any, ...], table: pa.Table) -> None:
        """Keep ``table`` under ``key``, evicting the least recently used beyond
        :attr:`max_bytes`."""
        size = table.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._tables.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._tables[key] = table
            self._bytes += size
            while self._bytes > self.max_bytes:
                _k, gone = self._tables.popitem(last=False)
                self._bytes -= gone.nbytes

    def clear(self) -> None:
        """Forget every table (and reset the hit and miss counts)."""
        with self._lock:
            self._tables.clear()
            self._layouts.clear()
            self._bytes = 0
            self.hits = self.misses = 0

    @property
    def nbytes(self) -> int:
        """The Arrow buffer bytes held."""
        with self._lock:
            return self._bytes


#: The process's cache of decoded direct-part row groups (256 MiB).
ROW_GROUP_CACHE = RowGroupCache(256 * _MIB)


def _groups_with_keys(ref: Any, key_schema: pa.Schema, tail_keys: pa.Table) -> Any:
    """A chooser for :func:`persist.fetch.read_row_groups`: the row groups of ``ref``
    whose key bound (by its key samples, see the module docstring) holds a key of
    ``tail_keys``."""
    from persist.merge import decode_keys, key_ranks, sample_positions

    def choose(groups: list[tuple[int, int]]) -> list[int]:
        positions = sample_positions(ref.rows)
        if len(positions) != len(ref.key_samples):
            raise ValueError("samples do not match the part's rows")
        samples = decode_keys(list(ref.key_samples), key_schema)
        cols = [tail_keys.column(f.name).cast(f.type) for f in samples.schema]
        both = pa.concat_tables([samples, pa.Table.from_arrays(cols, schema=samples.schema)])
        ranks = key_ranks(both, key_schema.names)
        n = len(positions)
        wanted = np.sort(ranks[n:])
        keep = []
        for g, (start, end) in enumerate(groups):
            i_lo = int(np.searchsorted(positions, start, side="right")) - 1
            i_hi = min(int(np.searchsorted(positions, end - 1, side="left")), n - 1)
            lo, hi = ranks[i_lo], ranks[i_hi]
            at = int(np.searchsorted(wanted, lo, side="left"))
            if at < len(wanted) and wanted[at] <= hi:
                keep.append(g)
        return keep

    return choose


def _read_part(
    blob: Any,
    blob_id: str,
    ref: Any,
    history: Any,
    key_schema: pa.Schema,
    tail_keys: pa.Table,
    cache: RowGroupCache,
) -> pa.Table:
    """The row groups of ``ref`` that may hold a tail key, conformed to the read view.
    Decoded row groups are cached one by one (before conforming) with the part's row
    group layout; a read whose chosen groups are all cached decodes nothing."""
    from persist.fetch import read_row_groups

    hist, dst = history
    plan = hist.plan(ref.schema_id, dst)
    base = (blob_id, ref.key, ref.checksum)
    choose = _groups_with_keys(ref, key_schema, tail_keys)
    layout = cache.layout(base)
    if layout is not None:
        got = [cache.get((*base, g)) for g in choose(layout)]
        if all(t is not None for t in got):
            table = pa.concat_tables(got) if got else plan.source.empty_table()
            return plan.apply(table, None)
    seen: dict[str, list[Any]] = {}

    def remember(groups: list[tuple[int, int]]) -> list[int]:
        keep = choose(groups)
        seen["layout"], seen["keep"] = groups, keep
        return keep

    table = read_row_groups(blob, ref, plan.source, remember)
    if "layout" in seen:
        groups, keep = seen["layout"], seen["keep"]
        whole = table.num_rows == ref.rows
        read = range(len(groups)) if whole else keep
        pieces: dict[int, pa.Table] = {}
        offset = 0
        for g in read:
            n = groups[g][1] - groups[g][0]
            pieces[g] = table.slice(offset, n)
            cache.put((*base, g), pieces[g])
            offset += n
        cache.set_layout(base, groups)
        if whole and len(keep) < len(groups):
            kept = [pieces[g] for g in keep]
            table = pa.concat_tables(kept) if kept else plan.source.empty_table()
    return plan.apply(table, None)


def touched_rows(
    blob: Any,
    blob_id: str,
    refs: Sequence[Any],
    history: Any,
    key_schema: pa.Schema,
    tail_keys: pa.Table,
    *,
    cache: RowGroupCache | None = None,
    max_workers: int = 4,
) -> pa.Table:
    """The rows of the blob parts ``refs`` whose key is a key of ``tail_keys`` (a table
    of the key columns), as the read view's updates (``history = (SchemaHistory, read
    id)``), decoding only the row groups that may hold one (see the module docstring).

    Args:
        blob: the blob store; ``blob_id`` names it in cache keys (its URI).
        refs: sorted blob parts (each with key samples).
        cache: the decoded row-group cache (default :data:`ROW_GROUP_CACHE`).
        max_workers: parts read at once.

    Raises:
        persist.errors.CorruptPart: a part is missing or corrupt (naming its key).
        persist.errors.BlobError: a fetch failed.
    """
    from persist.merge import key_ranks
    from persist.pool import run_all

    hist, dst = history
    view = hist.view_schema(dst)
    if not refs or tail_keys.num_rows == 0:
        return view.empty_table()
    store = ROW_GROUP_CACHE if cache is None else cache
    tasks = [
        (lambda r=r: _read_part(blob, blob_id, r, history, key_schema, tail_keys, store))
        for r in refs
    ]
    results, error = run_all(tasks, max_workers)
    if error is not None:
        raise error
    rows = pa.concat_tables([t for t in results if t is not None])
    names = key_schema.names
    keys = pa.Table.from_arrays(
        [tail_keys.column(k).cast(rows.schema.field(k).type) for k in names], names=names
    )
    ranks = key_ranks(pa.concat_tables([rows.select(names), keys]), names)
    n = rows.num_rows
    return rows.filter(pa.array(np.isin(ranks[:n], ranks[n:])))
