"""The rows of :meth:`spark.table.PersistTable.history`: one per state version the stash
still holds, each compared with the version before it (after delta-spark's
``DeltaTable.history``, which lists a Delta log's commits, newest first, at most
``limit`` of them).

Invariant: every figure and every operation comes from two consecutive committed state
versions, never from a cache or a guess: the operation from which of the version's
consensus entries (:meth:`persist.state.ShardState.to_entries`) differ from the previous
version's, a version's added batches from the parts (blob keys, inline ids) the previous
version did not hold. A version is *lease-only* when nothing but reader and writer
entries and its seqno changed: it moves no data, frontier or schema.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

OPERATIONS = (
    "create",
    "rollup",
    "append",
    "compaction",
    "schema",
    "since",
    "finalize",
    "gc",
    "other",
    "lease",
)
"""Values of the history's ``operation`` column (see :func:`operation`)."""

HIDDEN_BY_DEFAULT = frozenset({"lease", "gc"})
"""Operations :meth:`~spark.table.PersistTable.history` shows only with ``leases=True``:
they change no data, frontier or schema."""

_LEASE_PREFIXES = ("reader/", "writer/")


def history_schema() -> Any:
    """The Spark schema of the history DataFrame."""
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    return StructType(
        [
            StructField("seqno", LongType(), False),
            StructField("operation", StringType(), False),
            StructField("lower", LongType(), True),
            StructField("upper", LongType(), True),
            StructField("rows_added", LongType(), False),
            StructField("bytes_added", LongType(), False),
            StructField("since", LongType(), True),
            StructField("writers", StringType(), True),
        ]
    )


def _batch_id(b: Any) -> tuple[Any, ...]:
    return (str(b.desc), tuple(p.part_id or p.checksum for p in b.parts))


def changed_entries(before: Mapping[str, Any], after: Mapping[str, Any]) -> set[str]:
    """The consensus entry paths whose JSON values differ between two versions' entries
    (present in one only counts), ``meta`` given as ``meta.<field>`` per changed field."""
    out = {k for k in set(before) | set(after) if k != "meta" and before.get(k) != after.get(k)}
    m0, m1 = before.get("meta") or {}, after.get("meta") or {}
    out |= {f"meta.{k}" for k in set(m0) | set(m1) if m0.get(k) != m1.get(k)}
    return out


def operation(prev: Any, st: Any, changed: set[str]) -> str:
    """The operation of version ``st`` (a :class:`persist.state.ShardState`) after
    ``prev`` (``None``: the oldest retained version), ``changed`` being
    :func:`changed_entries` of their entries: ``create`` (the shard's first version),
    ``rollup`` (the oldest retained one after GC truncated older ones), ``finalize``,
    ``append`` (the upper advanced), ``compaction`` (batches replaced at the same upper),
    ``schema`` (a value schema version registered), ``since`` (the shard's since
    advanced), ``lease`` (only reader/writer entries changed: heartbeats, registrations,
    expiries, reader holds that leave the shard's since), ``gc`` (only the retired blob
    counter changed: GC forgot deleted blobs), else ``other``."""
    if prev is None:
        return "create" if st.seqno == 0 or not st.batches() else "rollup"
    rest = changed - {"meta.seqno"}
    if st.tombstone and not prev.tombstone:
        return "finalize"
    if st.upper != prev.upper:
        return "append"
    if any(k.startswith("trace/hollow_batches/") for k in rest):
        return "compaction"
    if "schemas" in rest or "shard" in rest:
        return "schema"
    if st.since != prev.since:
        return "since"
    if all(k.startswith(_LEASE_PREFIXES) for k in rest):
        return "lease"
    if rest == {"meta.retired_upper"}:
        return "gc"
    return "other"


def history_rows(client: Any, shard: str, *, leases: bool = False) -> list[tuple[Any, ...]]:
    """The history rows (see :func:`history_schema`) of ``shard``, newest first; without
    ``leases``, none of the versions whose operation is in :data:`HIDDEN_BY_DEFAULT`.

    Raises:
        persist.InvalidUsage: unknown shard.
        persist.ConsensusError: the stash failed.
    """
    from persist.state import ShardState

    sid = client.shard_id(shard)
    versions = client.consensus.versions(sid)
    out: list[tuple[Any, ...]] = []
    prev: Any = None
    prev_entries: Mapping[str, Any] = {}
    for v in versions:
        st = ShardState.from_entries(v.data)
        op = operation(prev, st, changed_entries(prev_entries, v.data))
        if leases or op not in HIDDEN_BY_DEFAULT:
            out.append(_row(prev, st, op))
        prev, prev_entries = st, v.data
    out.reverse()
    return out


def _row(prev: Any, st: Any, op: str) -> tuple[Any, ...]:
    batches = [b for b in st.batches() if b.parts]
    before = set() if prev is None else {_batch_id(b) for b in prev.batches() if b.parts}
    added = [b for b in batches if _batch_id(b) not in before]
    rows = sum(b.len for b in added)
    nbytes = sum(p.encoded_size_bytes for b in added for p in b.parts)
    lower = upper = None
    if op == "append":
        lower, upper = prev.upper.as_option(), st.upper.as_option()
    elif op == "rollup" and added:
        lows = [b.desc.lower.as_option() for b in added]
        ups = [b.desc.upper.as_option() for b in added]
        lower = min((x for x in lows if x is not None), default=None)
        upper = None if any(u is None for u in ups) else max(u for u in ups if u is not None)
    changed = sorted(
        w for w, state in st.writers.items() if prev is None or prev.writers.get(w) != state
    )
    return (
        int(st.seqno),
        op,
        lower,
        upper,
        int(rows),
        int(nbytes),
        st.since.as_option(),
        ",".join(changed) or None,
    )
