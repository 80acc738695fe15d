"""Which parts of a snapshot a Parquet engine (Spark's reader, DuckDB's ``read_parquet``)
may read as they are, and which persist must read and merge (:func:`split_parts`,
:func:`mark_touched`): the one rule both :mod:`spark.native_plan` and
:mod:`persist.duckdb_read` plan with.

A snapshot at ``as_of`` is every update with a time ``<= as_of``, consolidated: one row
per distinct (key, value) with its summed diff. Most of a compacted shard is one sorted,
consolidated run whose updates all carry one time (a compaction's output, or one big
append): each (key, value) appears once in it, so its Parquet parts are rows of the
snapshot already, unless another run holds updates of the same (key, value). The parts
split into

* **direct** parts: the blob parts of *clean* runs (every part's ``_time`` statistics
  show one single time, the same for the whole run, not after ``as_of``; the conform step
  keeps runs sorted and consolidated; key samples recorded), the largest such run first
  and then every other clean run whose key interval (first to last key, by its parts' key
  samples) is disjoint from those taken, or that holds only inserts (``_diff``
  statistics 1 to 1) as every overlapping taken run does. Runs of inserts only need no
  merge with each other: each of their rows is a live row with count 1, whatever the
  others hold. The one difference from a consolidated snapshot: a (key, value) that
  several such runs each insert reads as one row per run, ``_diff`` 1 each (the same
  updates, not summed); every other (key, value) is once;
* the **tail**: every other part (inline parts, runs with several times, such as the
  appends since the last compaction, retractions included, and clean runs overlapping a
  taken one), read and consolidated by persist (:func:`persist.fetch.snapshot_table`);
* among the direct parts, the **touched** ones (:func:`mark_touched`): those whose key
  interval holds some key of the tail (by consolidation's order,
  :func:`persist.merge.key_ranks`). Only their rows of those keys can combine with tail
  rows; every other direct row is a snapshot row as stored.

Invariant: untouched direct parts + (touched direct parts and tail, consolidated
together) is, as a multiset of rows each repeated by its ``_diff``, exactly the
consolidated snapshot at ``as_of``. Pure: no I/O, no Spark, no DuckDB; every decision is
taken on the batches given (one state version).

After Materialize's persist-client, whose ``internal/state.rs`` keeps each batch's runs
sorted and consolidated and whose ``fetch.rs`` reads a part as is when nothing needs
merging with it; and delta-spark's ``DeltaTable``, whose reads are Spark's Parquet scans
of the files its log names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["DIFF", "TIME", "DirectPart", "PartSplit", "mark_touched", "split_parts"]

TIME = "_time"
DIFF = "_diff"


@dataclass
class DirectPart:
    """A blob part read as it is: its blob key, the schema version it was written with,
    its encoded size, whether its key interval holds a tail key, and its
    :class:`~persist.types.PartRef` (``ref``)."""

    key: str
    schema_id: int
    size: int
    touched: bool = False
    ref: Any = None


@dataclass
class PartSplit:
    """What :func:`split_parts` returns.

    Attributes:
        direct: the direct parts, in batch and run order.
        intervals: each direct part's key interval (its first and last encoded key
            sample), index for index with ``direct``.
        tail: per batch, the batch and the (ascending) indexes of its tail parts.
        parts, bytes: how many parts, and encoded bytes, all of the batches hold.
    """

    direct: list[DirectPart]
    intervals: list[tuple[Any, Any]]
    tail: list[tuple[Any, list[int]]]
    parts: int
    bytes: int


def _run_time(parts: Sequence[Any], floor: int) -> int | None:
    """The one time every update of a run of blob ``parts`` has once advanced to
    ``floor``, by the parts' ``_time`` statistics as stored (all equal); ``None``
    when they do not prove a single stored time."""
    times = set()
    for p in parts:
        if p.key is None or p.stats is None:
            return None
        t = [(lo, hi) for name, lo, hi, _n in p.stats if name == TIME]
        if not t or t[0][0] is None or t[0][0] != t[0][1]:
            return None
        times.add(int(t[0][0]))
    if len(times) != 1:
        return None
    return max(times.pop(), floor)


def _inserts_only(parts: Sequence[Any]) -> bool:
    """Whether every update of a run of blob ``parts`` has ``_diff`` 1, by the parts'
    ``_diff`` statistics."""
    for p in parts:
        if p.stats is None:
            return False
        d = [(lo, hi) for name, lo, hi, _n in p.stats if name == DIFF]
        if not d or d[0][0] != 1 or d[0][1] != 1:
            return False
    return True


def _bounds(parts: Sequence[Any]) -> tuple[Any, Any] | None:
    """The first and last encoded key of a run's parts (their key samples include each
    part's first and last row), or ``None`` when a part has none."""
    if any(not p.key_samples for p in parts):
        return None
    return parts[0].key_samples[0], parts[-1].key_samples[-1]


def _ranks(keys: Sequence[Any], key_schema: pa.Schema, extra: pa.Table | None = None) -> np.ndarray:
    """Consolidation-order ranks of encoded ``keys`` followed by the rows of ``extra``
    (a table of key columns)."""
    from persist.merge import decode_keys, key_ranks

    table = decode_keys(list(keys), key_schema)
    if extra is not None and extra.num_rows:
        cols = [extra.column(f.name).cast(f.type) for f in table.schema]
        table = pa.concat_tables([table, pa.Table.from_arrays(cols, schema=table.schema)])
    return key_ranks(table, key_schema.names)


def split_parts(
    batches: Sequence[Any], key_schema: pa.Schema, history: Any, as_of: int
) -> PartSplit:
    """The direct parts (with each one's key interval) and the tail of ``batches`` (the
    batches of one state version, pruned to ``as_of``) for a read at ``as_of`` of the
    schema version ``history`` (``(SchemaHistory, read schema id)``); see the module
    docstring."""
    hist, dst = history
    runs: list[tuple[int, list[int], int | None, tuple[Any, Any] | None, int]] = []
    inserts: set[int] = set()  # clean runs of inserts only
    total = 0
    nparts = 0
    for bi, b in enumerate(batches):
        floor = max(
            (e for e in (b.desc.lower.as_option(), b.desc.since.as_option()) if e is not None),
            default=-(2**63),
        )
        start = 0
        for run in b.run_parts():
            idx = list(range(start, start + len(run)))
            start += len(run)
            nparts += len(run)
            size = sum(p.encoded_size_bytes for p in run)
            total += size
            time = _run_time(run, floor)
            ok = (
                time is not None
                and time <= as_of
                and all(hist.plan(p.schema_id, dst).keeps_runs for p in run)
            )
            if ok and _inserts_only(run):
                inserts.add(len(runs))
            runs.append((bi, idx, time if ok else None, _bounds(run) if ok else None, size))
    # Largest clean runs first; a run joins only if its key interval is disjoint from
    # every taken one's, or both runs hold inserts only.
    clean = [i for i, r in enumerate(runs) if r[2] is not None and r[3] is not None]
    clean.sort(key=lambda i: -runs[i][4])
    taken: list[int] = []
    if len(clean) == 1:  # nothing to compare: no keys to decode
        taken = clean
    elif clean:
        ranks = _ranks([k for i in clean for k in runs[i][3] or ()], key_schema)
        spans = {i: (ranks[2 * j], ranks[2 * j + 1]) for j, i in enumerate(clean)}
        for i in clean:
            lo, hi = spans[i]
            if all(
                hi < spans[j][0] or lo > spans[j][1] or (i in inserts and j in inserts)
                for j in taken
            ):
                taken.append(i)
    direct: list[DirectPart] = []
    intervals: list[tuple[Any, Any]] = []
    tail: dict[int, list[int]] = {}
    chosen = set(taken)
    for i, (bi, idx, _t, _b, _s) in enumerate(runs):
        b = batches[bi]
        if i in chosen:
            for j in idx:
                p = b.parts[j]
                direct.append(DirectPart(p.key, p.schema_id, p.encoded_size_bytes, ref=p))
                intervals.append((p.key_samples[0], p.key_samples[-1]))
        else:
            tail.setdefault(bi, []).extend(idx)
    return PartSplit(
        direct=direct,
        intervals=intervals,
        tail=[(batches[bi], sorted(idx)) for bi, idx in tail.items()],
        parts=nparts,
        bytes=total,
    )


def mark_touched(
    direct: Sequence[DirectPart],
    intervals: Sequence[tuple[Any, Any]],
    key_schema: pa.Schema,
    tail_keys: pa.Table,
) -> None:
    """Mark the ``direct`` parts whose key interval (``intervals``, index for index)
    holds a key of ``tail_keys`` (a table of the key columns)."""
    if not direct:
        return
    ranks = _ranks([k for iv in intervals for k in iv], key_schema, tail_keys)
    n = 2 * len(intervals)
    tail_ranks = np.sort(ranks[n:])
    for j, part in enumerate(direct):
        lo, hi = ranks[2 * j], ranks[2 * j + 1]
        at = np.searchsorted(tail_ranks, lo, side="left")
        part.touched = bool(at < len(tail_ranks) and tail_ranks[at] <= hi)
