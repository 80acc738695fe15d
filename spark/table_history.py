"""The rows of :meth:`spark.table.PersistTable.history`: one per state version the stash
still holds, each compared with the version before it (after delta-spark's
``DeltaTable.history``, which lists a Delta log's commits).

Invariant: every figure comes from two consecutive committed state versions, never from
a cache: a version's added batches are those whose parts (blob keys, inline ids) the
previous version did not hold.
"""

from __future__ import annotations

from typing import Any


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


def history_rows(client: Any, shard: str) -> list[tuple[Any, ...]]:
    """The history rows (see :func:`history_schema`) of ``shard``, newest first.

    Raises:
        persist.InvalidUsage: unknown shard.
        persist.ConsensusError: the stash failed.
    """
    from persist.state import ShardState

    sid = client.shard_id(shard)
    versions = client.consensus.versions(sid)
    out: list[tuple[Any, ...]] = []
    prev: Any = None
    for v in versions:
        st = ShardState.from_entries(v.data)
        batches = [b for b in st.batches() if b.parts]
        before = set() if prev is None else {_batch_id(b) for b in prev.batches() if b.parts}
        added = [b for b in batches if _batch_id(b) not in before]
        rows = sum(b.len for b in added)
        nbytes = sum(p.encoded_size_bytes for b in added for p in b.parts)
        lower = upper = None
        if prev is None:
            op = "create" if st.seqno == 0 or not batches else "rollup"
        elif st.upper != prev.upper:
            op = "append"
            lower, upper = prev.upper.as_option(), st.upper.as_option()
        elif added:
            op = "compaction"
        elif st.since != prev.since:
            op = "since"
        else:
            op = "lease"
        if added and lower is None and op in ("rollup",):
            lows = [b.desc.lower.as_option() for b in added]
            ups = [b.desc.upper.as_option() for b in added]
            lower = min((x for x in lows if x is not None), default=None)
            upper = None if any(u is None for u in ups) else max(u for u in ups if u is not None)
        changed = sorted(
            w for w, state in st.writers.items() if prev is None or prev.writers.get(w) != state
        )
        out.append(
            (
                int(st.seqno),
                op,
                lower,
                upper,
                int(rows),
                int(nbytes),
                st.since.as_option(),
                ",".join(changed) or None,
            )
        )
        prev = st
    out.reverse()
    return out
