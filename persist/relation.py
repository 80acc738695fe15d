"""Consolidated snapshots as relations: one row per unit of multiplicity
(:func:`expand_rows`), what :meth:`persist.table.Table.to_arrow` and ``persist sql``
both show.

Invariants kept here: a row with ``_diff`` n appears exactly n times, in the
snapshot's order; a negative multiplicity (more retractions than insertions) is
refused, naming the shard and the count, never dropped or shown once.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persist.errors import InvalidUsage

__all__ = ["check_multiplicities", "expand_rows", "expanded_count"]


def check_multiplicities(table: pa.Table, shard: str) -> None:
    """Raise unless every ``_diff`` of ``table`` is positive.

    Raises:
        InvalidUsage: a negative multiplicity, naming the shard and the count.
    """
    negative = pc.sum(pc.less(table.column("_diff"), 0)).as_py() or 0
    if negative:
        raise InvalidUsage(
            f"shard {shard!r} has {negative} row(s) with a negative multiplicity at this "
            "time (more retractions than insertions): it is not a relation"
        )


def expanded_count(table: pa.Table) -> int:
    """How many rows ``table`` stands for: the sum of its ``_diff`` (exact, as 38-digit
    decimals, where int64 would wrap)."""
    if not len(table):
        return 0
    return int(pc.sum(table.column("_diff").cast(pa.decimal128(38, 0))).as_py())


def expand_rows(table: pa.Table, shard: str) -> pa.Table:
    """``table`` (a consolidated snapshot, with ``_diff`` and maybe ``_time``) as one
    row per unit of multiplicity, without ``_time``/``_diff``.

    Raises:
        InvalidUsage: a negative multiplicity (see :func:`check_multiplicities`).
    """
    check_multiplicities(table, shard)
    diffs = table.column("_diff")
    data = table.drop_columns([c for c in ("_time", "_diff") if c in table.column_names])
    if pc.all(pc.equal(diffs, 1)).as_py() in (True, None):
        return data
    counts = diffs.to_numpy()
    return data.take(pa.array(np.repeat(np.arange(len(counts)), counts)))
