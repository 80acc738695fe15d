"""Planning a native read of a persist shard: which parts Spark's own Parquet reader may
read as they are, and the rest of the snapshot, read by persist on the driver.

The split itself (direct parts, tail, touched parts) is
:mod:`persist.direct_plan`'s, the same rule ``Table.to_duckdb`` reads with
(:mod:`persist.duckdb_read`); this module reads the tail, decides between Spark and the
Python path (``auto``) and merges touched rows on the driver.

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
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from persist.direct_plan import DIFF, TIME, DirectPart, mark_touched, split_parts

__all__ = [
    "DIFF",
    "TIME",
    "DirectPart",
    "NativePlan",
    "merge_on_driver",
    "native_type",
    "plan_snapshot",
]

log = logging.getLogger(__name__)


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
    from spark.persist_common import open_read
    from spark.persist_planning import resolve_as_of

    with open_read(client, shard, key_schema, value_schema) as read:
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
        plan = split_parts(batches, key_schema, history, t)
        tail_batches = [slice_batch(b, idx) for b, idx in plan.tail]
        out = NativePlan(
            as_of=t,
            history=history,
            parts=plan.parts,
            tail_parts=sum(len(b.parts) for b in tail_batches),
            tail_bytes=sum(p.encoded_size_bytes for b in tail_batches for p in b.parts),
            total_bytes=plan.bytes,
            identity=identity,
        )
        out.direct = plan.direct
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
        mark_touched(out.direct, plan.intervals, key_schema, out.tail.select(key_schema.names))
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
