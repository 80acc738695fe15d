"""A table as a DuckDB relation (:func:`to_duckdb`): DuckDB reads the Parquet parts that
need no merge itself, persist merges the rest.

A snapshot at ``as_of`` is every update at or before ``as_of``, consolidated.  When
all of it is one *clean* run (one batch, one sorted and consolidated run whose parts'
``_time`` statistics show a single time at or before ``as_of``, e.g. a table after
``optimize()`` or one big append), each (key, value) appears once in its Parquet parts,
with its multiplicity in ``_diff``: the parts are the snapshot's rows as stored, so
DuckDB scans them itself (``read_parquet``) and repeats each row by its ``_diff``.  It
does so only for parts in a local directory (:class:`~persist.blob.FileBlob`), written
under the newest schema version, whose columns DuckDB gives back in the very Arrow types
persist does (:data:`DIRECT_TYPES`).  Everything else (inline parts, several runs,
several times, an object store) is read and consolidated by persist
(:meth:`Table.to_arrow <persist.table.Table.to_arrow>`) and handed to DuckDB as Arrow.

Invariant: the relation's rows are exactly ``to_arrow(as_of)``'s (as a multiset, in the
same column names and types); a negative multiplicity is refused as ``to_arrow``
refuses it; every decision is taken on one state version.

Sources: pyiceberg's ``Table.to_duckdb`` and delta-rs's ``DeltaTable.to_pyarrow_dataset``
(DuckDB scanning the table's Parquet files), and the native read plan of this project's
Spark source (``spark/native_plan.py``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pyarrow as pa

from persist.blob import Blob, FileBlob, RetryingBlob
from persist.errors import InvalidUsage
from persist.state import ShardState
from persist.stats import max_time, min_time
from persist.types import HollowBatch

if TYPE_CHECKING:
    import duckdb

__all__ = ["DIRECT_TYPES", "direct_paths", "quote"]


def _direct_type(t: pa.DataType) -> bool:
    """Types DuckDB's Parquet scan returns to Arrow as the very type persist reads."""
    return bool(
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_boolean(t)
        or t == pa.string()
        or t == pa.date32()
    )


#: What :func:`direct_paths` allows, for the docs: integers, floats, booleans, ``string``
#: and ``date32`` columns.
DIRECT_TYPES = "integers, floats, booleans, string, date32"


def quote(name: str) -> str:
    """A SQL identifier for the column ``name`` (double quotes, doubled inside)."""
    return '"' + name.replace('"', '""') + '"'


def _file_root(blob: Blob) -> str | None:
    inner = blob.inner if isinstance(blob, RetryingBlob) else blob
    return str(inner.root) if isinstance(inner, FileBlob) else None


def direct_paths(st: ShardState, blob: Blob, as_of: int) -> list[str] | None:
    """The local paths of the Parquet parts DuckDB may scan as the whole snapshot of
    ``st`` at ``as_of`` (see the module docstring), or ``None`` when persist must merge.
    """
    root = _file_root(blob)
    schema = [*st.key_schema, *st.value_schema]
    if root is None or not all(_direct_type(f.type) for f in schema):
        return None
    batches: list[HollowBatch] = [
        b for b in st.batches() if b.len > 0 and b.desc.lower.less_equal(as_of)
    ]
    if len(batches) != 1 or batches[0].runs:
        return None
    b = batches[0]
    floor = max(b.desc.lower.as_option() or 0, b.desc.since.as_option() or 0)
    newest = st.schemas().newest
    times: set[int] = set()
    paths: list[str] = []
    for p in b.parts:
        lo, hi = min_time(p.stats, floor), max_time(p.stats, floor)
        if p.key is None or p.schema_id != newest or lo is None or hi is None or lo != hi:
            return None
        times.add(lo)
        path = os.path.join(root, *p.key.split("/"))
        if os.path.realpath(path) != path:  # a symbolic link: FileBlob never follows one
            return None
        paths.append(path)
    if len(times) > 1 or (times and max(times) > as_of):
        return None
    return paths


def scan_parts(
    con: duckdb.DuckDBPyConnection, paths: Sequence[str], names: Sequence[str], what: str
) -> duckdb.DuckDBPyRelation:
    """The relation of ``paths``' rows, each repeated by its ``_diff``, with the columns
    ``names``.

    Raises:
        InvalidUsage: a negative multiplicity (as :func:`persist.relation.expand_rows`).
    """
    rel = con.read_parquet(list(paths))
    counts = rel.query(
        "parts", "SELECT count(*) FILTER (WHERE _diff < 0), coalesce(max(_diff), 1) FROM parts"
    )
    assert counts is not None
    negative, top = (int(x) for x in counts.fetchall()[0])
    if negative:
        raise InvalidUsage(
            f"shard {what!r} has {negative} row(s) with a negative multiplicity at this "
            "time (more retractions than insertions): it is not a relation"
        )
    cols = ", ".join(quote(n) for n in names)
    if top == 1:
        return rel.project(cols)
    # The column names are quoted identifiers (:func:`quote`), never SQL text.
    out = rel.query("parts", f"SELECT {cols} FROM parts, range(parts._diff)")  # noqa: S608
    assert out is not None
    return out
