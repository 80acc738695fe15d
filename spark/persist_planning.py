"""Read planning for the ``persist`` Spark source: which parts each input partition reads.

Invariants kept here: partitions carry only picklable metadata (part references, never
data); a sliced batch keeps its runs, so a task never mixes the parts of several runs into
one consolidated run; a consolidated (``full``) read puts every part that could cancel
another in the same partition.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import (
    InputPartition,
)

from spark.persist_common import PersistSourceError

log = logging.getLogger(__name__)


def plan_parts(batches: Sequence[Any], limit: int, full: bool) -> list[list[Any]]:
    """Split hollow batches into input partitions: lists of hollow batches, each holding
    a slice of one original batch's parts with its description (so that readers advance
    times exactly as :func:`persist.read.read_batches` does) and its runs (so that a slice
    holding parts of several runs is never taken for one consolidated run).

    One partition per part, except that consecutive small parts share a partition up to
    ``limit`` encoded bytes; ``full`` puts everything in one partition (then every update
    that could cancel another is read by the same task).
    """
    pieces: list[tuple[int, int]] = [
        (bi, pi) for bi, b in enumerate(batches) for pi in range(len(b.parts))
    ]
    if not pieces:
        return []
    if full:
        return [[b for b in batches if b.parts]]
    groups: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    size = 0
    for bi, pi in pieces:
        nbytes = batches[bi].parts[pi].encoded_size_bytes
        if current and size + nbytes > limit:
            groups.append(current)
            current, size = [], 0
        current.append((bi, pi))
        size += nbytes
    groups.append(current)
    out: list[list[Any]] = []
    for group in groups:
        by_batch: dict[int, list[int]] = {}
        for bi, pi in group:
            by_batch.setdefault(bi, []).append(pi)
        out.append([slice_batch(batches[bi], idx) for bi, idx in by_batch.items()])
    return out


def slice_batch(batch: Any, indexes: Sequence[int]) -> Any:
    """The hollow batch holding the parts of ``batch`` at ``indexes`` (ascending): same
    description, ``len`` the sliced parts' rows, and ``runs`` marking where the slice
    moves to another of ``batch``'s runs."""
    from persist.types import HollowBatch

    starts = [0, *batch.runs]
    run_of = [0] * len(batch.parts)
    for r, (a, b) in enumerate(zip(starts, [*batch.runs, len(batch.parts)], strict=True)):
        for i in range(a, b):
            run_of[i] = r
    parts = tuple(batch.parts[i] for i in indexes)
    runs = tuple(j for j in range(1, len(indexes)) if run_of[indexes[j]] != run_of[indexes[j - 1]])
    return HollowBatch(batch.desc, parts, sum(p.rows for p in parts), runs)


@dataclass
class PartsPartition(InputPartition):
    """An input partition: the parts one task reads, and the read time."""

    parts: list[Any]
    as_of: int

    def __init__(self, parts: list[Any], as_of: int) -> None:
        self.parts = parts
        self.as_of = as_of


def resolve_as_of(read: Any, as_of: int | None, shard: str) -> int | None:
    """``as_of`` checked against the shard's since and upper (default ``upper - 1``);
    ``None`` when the shard has no complete time yet (upper ``{0}``).

    Raises:
        PersistSourceError: ``as_of`` is before the since or not before the upper.
    """
    since = read.shard_since().as_option()
    upper = read.fetch_recent_upper().as_option()
    latest = None if upper == 0 else (upper - 1 if upper is not None else None)
    if as_of is None:
        return latest
    if since is not None and as_of < since:
        raise PersistSourceError(
            f"as_of {as_of} is before shard {shard}'s since {{{since}}}: those times are compacted"
        )
    if upper is not None and as_of >= upper:
        raise PersistSourceError(
            f"as_of {as_of} is not before shard {shard}'s upper {{{upper}}}: not yet complete"
        )
    return as_of
