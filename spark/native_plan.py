"""Planning a native read of a persist shard: which parts Spark's own Parquet reader may
read as they are, and the rest of the snapshot, read by persist on the driver.

A snapshot at ``as_of`` is every update with a time ``<= as_of``, consolidated: one row
per distinct (key, value) with its summed diff. Most of a compacted shard is one sorted,
consolidated run whose updates all carry one time (a compaction's output, or one big
append): each (key, value) appears once in it, so its Parquet parts are rows of the
snapshot already, unless another run holds updates of the same (key, value). This
module splits a snapshot's parts into

* **direct** parts: the blob parts of *clean* runs (every part's ``_time`` statistics
  show one single time, the same for the whole run, not after ``as_of``; the conform step
  keeps runs sorted and consolidated; key samples recorded), the largest such run first
  and then every other clean run whose key interval (first to last key, by its parts' key
  samples) is disjoint from those taken, or that holds only inserts (``_diff``
  statistics 1 to 1) as every overlapping taken run does. Runs of inserts only need no
  merge with each other: each of their rows is a live row with count 1, whatever the
  others hold (a fresh Spark write, one run per task, overlapping key ranges, reads all
  direct). The one difference from a consolidated snapshot: a (key, value) that several
  such runs each insert reads as one row per run, ``_diff`` 1 each (the same updates,
  not summed); every other (key, value) is once;
* the **tail**: every other part (inline parts, runs with several times, such as the
  appends since the last compaction, retractions included, and clean runs overlapping a
  taken one), read and consolidated here by persist (:func:`persist.fetch.snapshot_table`);
* among the direct parts, the **touched** ones: those whose key interval holds some key
  of the tail (by consolidation's order, :func:`persist.merge.key_ranks`). Only their
  rows of those keys can combine with tail rows; every other direct row is a snapshot row
  as stored.

After Materialize's persist-client, whose ``internal/state.rs`` keeps each batch's runs
sorted and consolidated and whose ``fetch.rs`` reads a part as is when nothing needs
merging with it; and delta-spark's ``DeltaTable``, whose reads are Spark's Parquet scans of
the files its log names.

Invariant: direct parts + tail, combined as :mod:`spark.native_read` does, is exactly
``ReadHandle.snapshot(as_of)`` (summed per (key, value), for rows that runs of inserts
only repeat); every decision is taken on one state version (the one
``snapshot_batches`` listed), never on a cache.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

log = logging.getLogger(__name__)

TIME = "_time"
DIFF = "_diff"

#: The tail is read on the driver; ``path="auto"`` takes the Python path instead when the
#: tail holds more than this share of the snapshot's encoded bytes (and more than
#: :data:`TAIL_MIN_BYTES`).
TAIL_MAX_SHARE = 0.25
#: Tails up to this many encoded bytes are always read on the driver.
TAIL_MIN_BYTES = 16 * 1024 * 1024
#: Touched direct parts up to this many encoded bytes are merged with the tail on the
#: driver (one Spark scan remains); beyond it Spark merges them (a second scan).
DRIVER_MERGE_MAX_BYTES = 256 * 1024 * 1024


def native_type(t: pa.DataType) -> bool:
    """Whether Spark's Parquet reader reads a column of Arrow type ``t`` (as persist
    encodes it, :func:`persist.encoding.encode_part`) as the same values the Python path
    gives, and Spark can join and group on it: signed integers, floats, booleans, strings,
    binary, ``date32``, timestamps of second to microsecond units, decimals up to 38
    digits. Not unsigned integers, nanosecond timestamps, durations, times, dictionaries
    or nested types (those take the Python path)."""
    return bool(
        (pa.types.is_integer(t) and pa.types.is_signed_integer(t))
        or pa.types.is_float32(t)
        or pa.types.is_float64(t)
        or pa.types.is_boolean(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_date32(t)
        or (pa.types.is_timestamp(t) and t.unit in ("s", "ms", "us"))
        or (pa.types.is_decimal(t) and t.precision <= 38)
    )


@dataclass
class DirectPart:
    """A blob part Spark reads as it is: its blob key, the schema version it was written
    with, its encoded size and whether its key interval holds a tail key."""

    key: str
    schema_id: int
    size: int
    touched: bool = False
    ref: Any = None


@dataclass
class NativePlan:
    """The plan of one snapshot read (see the module docstring).

    Attributes:
        as_of: the read time (``None``: the shard has no readable time: empty).
        direct: the direct parts.
        tail: the tail's consolidated snapshot (updates schema of the read view:
            key, value, ``_time``, ``_diff`` columns), or ``None`` when empty.
        history: ``(SchemaHistory, read schema id)`` of the read.
        parts, tail_parts: how many parts the snapshot and its tail have.
        tail_bytes, total_bytes: encoded bytes of the tail's and all parts.
        declined: why an ``auto`` plan leaves the read to the Python path, or ``None``.
        merged: when the driver merged the touched parts with the tail
            (:func:`merge_on_driver`), the snapshot's rows of every tail key (the tail
            and the touched parts' rows of those keys, consolidated: no ``_diff`` is 0);
            Spark then reads the direct parts without the rows of ``tail_keys`` and adds
            these; ``None``: Spark merges.
        tail_keys: the tail's distinct keys (key columns), when the driver merged.
        identity: everything the plan was made from: the read time, the schema history
            and the listed batches (frozen dataclasses naming each part by blob key or
            inline bytes, checksum and statistics). Two reads with equal identities
            read the same rows, whatever versions of the state they listed (a lease
            or GC bookkeeping version changes no batch).
    """

    as_of: int | None
    direct: list[DirectPart] = field(default_factory=list)
    tail: pa.Table | None = None
    history: Any = None
    parts: int = 0
    tail_parts: int = 0
    tail_bytes: int = 0
    total_bytes: int = 0
    declined: str | None = None
    merged: pa.Table | None = None
    tail_keys: pa.Table | None = None
    identity: Hashable = None

    def summary(self) -> str:
        touched = sum(1 for p in self.direct if p.touched)
        rows = 0 if self.tail is None else self.tail.num_rows
        return (
            f"{len(self.direct)} of {self.parts} parts read by Spark's Parquet reader "
            f"({touched} merged with the tail), tail of {self.tail_parts} parts "
            f"({self.tail_bytes} of {self.total_bytes} bytes, {rows} rows) read by persist"
        )


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


def plan_snapshot(
    client: Any,
    shard: str,
    key_schema: pa.Schema,
    value_schema: pa.Schema,
    as_of: int | None,
    *,
    auto: bool = False,
    reuse: NativePlan | None = None,
) -> NativePlan:
    """Plan the snapshot of ``shard`` at ``as_of`` (default: as
    :func:`spark.persist_planning.resolve_as_of`) for a native read, on one state version
    listed by a reader of ``client`` (a :class:`persist.PersistClient`). The reader reads
    the tail while it holds the parts, then is detached
    (:meth:`persist.ReadHandle.detach`): GC deletes none of the listed parts for one
    reader lease (the client's ``reader_lease_seconds``), the time Spark has to read them.
    With ``auto``, a plan no better than the Python path (no direct part, or a tail of
    more than :data:`TAIL_MAX_SHARE` of the bytes and :data:`TAIL_MIN_BYTES`) is
    declined before the tail is read: its ``declined`` says why. When ``reuse``, an
    earlier plan, has the identity of this read (:attr:`NativePlan.identity`, computed
    on the state version just listed), it is returned as it is, after the reader is
    detached as for a new plan: its tail is not read or merged again (as delta-spark's
    ``DeltaLog.update`` returns the cached ``Snapshot`` of an unchanged table version).

    Raises:
        spark.persist_common.PersistSourceError: ``as_of`` before the since or not
            before the upper.
        persist.errors.CorruptPart: a tail part is missing or corrupt.
    """
    from persist.fetch import prune_batches, slice_batch, snapshot_table
    from spark.persist_planning import resolve_as_of

    with client.open_reader(shard, key_schema, value_schema) as read:
        state = client.inspect(shard)
        t = resolve_as_of(state, as_of, shard, client.blob)
        if t is None:
            read.expire()
            return NativePlan(as_of=None, history=read.read_schemas())
        history = read.read_schemas()
        view = history[0].view_schema(history[1])
        batches = prune_batches(read.snapshot_batches(t), view, t, None, history)
        identity = (t, history, tuple(batches), auto)
        if reuse is not None and reuse.identity == identity:
            read.detach()
            return reuse
        plan = _split(batches, key_schema, history, t)
        tail_batches = []
        for b, idx in plan.pop("tail"):
            tail_batches.append(slice_batch(b, idx))
        out = NativePlan(
            as_of=t,
            history=history,
            parts=plan["parts"],
            tail_parts=sum(len(b.parts) for b in tail_batches),
            tail_bytes=sum(p.encoded_size_bytes for b in tail_batches for p in b.parts),
            total_bytes=plan["bytes"],
            identity=identity,
        )
        out.direct = plan["direct"]
        if auto and out.tail_parts:
            if not out.direct:
                out.declined = "no part can be read as it is (no compacted run)"
            elif out.tail_bytes > max(TAIL_MIN_BYTES, TAIL_MAX_SHARE * out.total_bytes):
                out.declined = f"the uncompacted tail is large ({out.summary()})"
        if tail_batches and out.declined is None:
            table = snapshot_table(
                client.blob,
                tail_batches,
                view,
                key_schema.names,
                history[0].versions[history[1]].names,
                t,
                schemas=history,
            )
            out.tail = table if table.num_rows else None
        read.detach()
    if out.declined is None and out.tail is not None and out.direct:
        _mark_touched(out, plan["intervals"], key_schema)
        touched = sum(p.size for p in out.direct if p.touched)
        if touched <= DRIVER_MERGE_MAX_BYTES:
            merge_on_driver(out, client.blob, key_schema, repr(client.raw_blob))
    return out


def merge_on_driver(plan: NativePlan, blob: Any, key_schema: pa.Schema, blob_id: str) -> None:
    """Merge the touched direct parts' rows of tail keys with the tail, on the driver:
    read those rows (:func:`spark.native_merge.touched_rows`: only the row groups that can
    hold a tail key are decoded, and decoded row groups are cached by the part's blob key
    and checksum; ``blob_id`` names the store), consolidate them with the tail at
    ``as_of`` and set ``plan.merged`` and ``plan.tail_keys`` (keys match by
    consolidation's order, :func:`persist.merge.key_ranks`: nulls and NaN as
    consolidation matches them).

    Raises:
        persist.errors.CorruptPart: a touched part is missing or corrupt.
    """
    from persist.consolidation import consolidate
    from persist.merge import key_ranks
    from spark.native_merge import touched_rows

    assert plan.tail is not None and plan.as_of is not None
    hist, dst = plan.history
    names = key_schema.names
    tail = plan.tail
    ranks = key_ranks(tail.select(names), names)
    _, first = np.unique(ranks, return_index=True)
    plan.tail_keys = tail.select(names).take(pa.array(first))
    refs = [p.ref for p in plan.direct if p.touched]
    rows = touched_rows(blob, blob_id, refs, plan.history, key_schema, plan.tail_keys)
    rows = pa.Table.from_arrays(
        [rows.column(f.name).cast(f.type) for f in tail.schema], schema=tail.schema
    )
    values = hist.versions[dst].names
    plan.merged = consolidate(pa.concat_tables([rows, tail]), names, values, since=plan.as_of)


def _split(
    batches: Sequence[Any], key_schema: pa.Schema, history: Any, as_of: int
) -> dict[str, Any]:
    """The direct parts (with each one's key interval) and the tail (per batch, the
    indexes of its tail parts) of ``batches``."""
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
    if clean:
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
    return {
        "direct": direct,
        "intervals": intervals,
        "tail": [(batches[bi], sorted(idx)) for bi, idx in tail.items()],
        "parts": nparts,
        "bytes": total,
    }


def _mark_touched(
    plan: NativePlan, intervals: list[tuple[Any, Any]], key_schema: pa.Schema
) -> None:
    """Mark the direct parts whose key interval holds a key of the tail."""
    assert plan.tail is not None
    tail_keys = plan.tail.select(key_schema.names)
    ranks = _ranks([k for iv in intervals for k in iv], key_schema, tail_keys)
    n = 2 * len(intervals)
    tail_ranks = np.sort(ranks[n:])
    for j, part in enumerate(plan.direct):
        lo, hi = ranks[2 * j], ranks[2 * j + 1]
        at = np.searchsorted(tail_ranks, lo, side="left")
        part.touched = bool(at < len(tail_ranks) and tail_ranks[at] <= hi)
