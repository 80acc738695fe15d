"""A table as a DuckDB relation (:func:`to_relation`): DuckDB reads the Parquet parts
that need no merge itself, persist merges only the rest, and the relation is the
``UNION ALL`` of the two.

Which parts need no merge is :mod:`persist.direct_plan`'s rule, the one Spark's native
read plans with (:mod:`spark.native_plan`): the parts of clean runs (one time at or
before ``as_of``, sorted and consolidated; runs of inserts only may overlap) whose key
interval holds no key of the tail.  Their rows are snapshot rows as stored, each with its
multiplicity in ``_diff``, so DuckDB scans them (``read_parquet``, the paths given as a
list of file names with their glob characters escaped, :func:`literal_path`, never as
patterns) and repeats each row by its ``_diff``.
Persist reads the tail (every other part: inline parts, runs of several times, runs
overlapping a taken one) together with the direct parts whose interval holds a tail key,
consolidates them at ``as_of`` (:func:`persist.fetch.snapshot_table`) and hands the rows
to DuckDB as Arrow.

DuckDB reads a part only when it is in a local directory
(:class:`~persist.blob.FileBlob`), is no symbolic link, was written under the newest
schema version, and the table's columns are all of types DuckDB gives back as the very
Arrow types persist reads (:data:`DIRECT_TYPES`); other parts go through the Arrow side.
Parts in an object store (S3) always do: DuckDB would need its ``httpfs`` extension and
the store's credentials, which persist does not hand to it.

Invariants: the relation's rows are exactly ``to_arrow(as_of)``'s (as a multiset, in
the same column names and types); a negative multiplicity is refused as ``to_arrow``
refuses it; every decision is taken on one state version; a part that GC removed
while the relation is built makes the build start again on the newer version at the
same ``as_of`` (as :func:`persist.version_read.read_version`).  The relation is lazy:
DuckDB reads the scanned parts when a query on it runs, so a part GC deletes after the
build (a newer version stopped referencing it and the grace period passed) fails that
query naming the file: build the relation again.

Sources: pyiceberg's ``Table.to_duckdb`` and delta-rs's ``DeltaTable.to_pyarrow_dataset``
(DuckDB scanning the table's Parquet files); Materialize's persist-client ``fetch.rs``
(a part read as is when nothing needs merging with it).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pyarrow as pa

from persist.blob import Blob, FileBlob, RetryingBlob
from persist.consolidation import consolidate
from persist.context import PersistContext
from persist.direct_plan import DIFF, DirectPart, mark_touched, split_parts
from persist.errors import CorruptPart, InvalidUsage
from persist.fetch import prune_batches, slice_batch, snapshot_table
from persist.machine import ShardMachine
from persist.parts import updates_schema
from persist.relation import expand_rows
from persist.state import ShardState
from persist.version_read import check_readable, on_newest_version, read_at, version_batches

if TYPE_CHECKING:
    import duckdb

__all__ = ["DIRECT_TYPES", "quote", "to_relation"]

log = logging.getLogger(__name__)


def _direct_type(t: pa.DataType) -> bool:
    """Types DuckDB's Parquet scan returns to Arrow as the very type persist reads."""
    return bool(
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_boolean(t)
        or t == pa.string()
        or t == pa.date32()
    )


#: Column types with which DuckDB scans parts itself, for the docs: integers, floats,
#: booleans, ``string`` and ``date32`` columns.
DIRECT_TYPES = "integers, floats, booleans, string, date32"


def quote(name: str) -> str:
    """A SQL identifier for the column ``name`` (double quotes, doubled inside)."""
    return '"' + name.replace('"', '""') + '"'


def _file_root(blob: Blob) -> str | None:
    inner = blob.inner if isinstance(blob, RetryingBlob) else blob
    return str(inner.root) if isinstance(inner, FileBlob) else None


def _local_path(root: str, key: str) -> str | None:
    """The file of blob ``key`` under ``root`` as DuckDB is to be given it
    (:func:`literal_path`), or ``None`` for a symbolic link (:class:`~persist.blob.FileBlob`
    never follows one) or a name DuckDB cannot be given literally (persist reads it)."""
    path = os.path.join(root, *key.split("/"))
    return literal_path(path) if os.path.realpath(path) == path else None


def literal_path(path: str) -> str | None:
    """``path`` as a DuckDB file name that globs to exactly that path, or ``None`` when
    there is none.  DuckDB's ``read_parquet`` expands ``*``, ``?`` and ``[...]`` in every
    name it is given (a list too), so each is written as a one-character class (``[*]``,
    ``[?]``, ``[[]``); braces are literal to it.  A name holding no glob character is
    taken as is, backslashes included; one holding both has no spelling (in a pattern
    DuckDB reads a backslash as a separator or an escape), so ``None``.  Like
    :func:`spark.names.literal_path` for Hadoop's globs."""
    if not any(ch in path for ch in "*?["):
        return path
    if "\\" in path:
        return None
    return "".join(f"[{ch}]" if ch in "*?[" else ch for ch in path)


def _diff_range(part: DirectPart) -> tuple[int, int] | None:
    """The least and greatest ``_diff`` of a part, by its statistics."""
    for name, lo, hi, _n in part.ref.stats or ():
        if name == DIFF and lo is not None and hi is not None:
            return int(lo), int(hi)
    return None


def to_relation(
    ctx: PersistContext,
    machine: ShardMachine,
    st: ShardState,
    as_of: int,
    con: duckdb.DuckDBPyConnection,
) -> duckdb.DuckDBPyRelation:
    """The live rows of the version ``st`` at ``as_of`` (as :meth:`Table.to_arrow
    <persist.table.Table.to_arrow>`) as a relation of ``con`` (see the module
    docstring).

    Raises:
        SinceViolation: ``as_of`` before the since.  InvalidUsage: ``as_of`` at or
            beyond the upper; a negative multiplicity.
        CorruptPart, BlobError, ConsensusError: storage failed.
    """
    import duckdb

    def gone(e: BaseException) -> bool:
        if isinstance(e, CorruptPart):
            return e.missing
        return isinstance(e, duckdb.IOException) and _gone(e)

    def relation(s: ShardState) -> duckdb.DuckDBPyRelation:
        check_readable(s, as_of, s.name)
        return _relation(ctx, s, as_of, con)

    return on_newest_version(machine, st, relation, gone)


def _gone(e: Exception) -> bool:
    return "No files found" in str(e) or "No such file" in str(e)


def _relation(
    ctx: PersistContext,
    st: ShardState,
    as_of: int,
    con: duckdb.DuckDBPyConnection,
) -> duckdb.DuckDBPyRelation:
    names = [*st.key_schema.names, *st.value_schema.names]
    root = _file_root(ctx.raw_blob)
    if root is None or not all(_direct_type(f.type) for f in [*st.key_schema, *st.value_schema]):
        return _arrow(con, read_at(ctx, st, as_of, columns=[*names, DIFF]), st)
    schema = updates_schema(st.key_schema, st.value_schema)
    keys, values = st.key_schema.names, st.value_schema.names
    history = (st.schemas(), st.schemas().newest)
    batches = prune_batches(version_batches(st, as_of), schema, as_of, None, history)
    split = split_parts(batches, st.key_schema, history, as_of)
    paths = {
        id(p): path
        for p in split.direct
        if p.schema_id == history[1] and (path := _local_path(root, p.key)) is not None
    }
    if not paths:
        return _arrow(con, read_at(ctx, st, as_of, columns=[*names, DIFF]), st)

    def read(slices: Sequence[tuple[object, list[int]]]) -> pa.Table:
        return snapshot_table(
            ctx.blob,
            [slice_batch(b, idx) for b, idx in slices],  # type: ignore[arg-type]
            schema,
            keys,
            values,
            as_of,
            max_workers=ctx.config.read_workers,
            schemas=history,
        )

    rest: pa.Table | None = None
    if split.tail:
        rest = read(split.tail)
        mark_touched(split.direct, split.intervals, st.key_schema, rest.select(keys))
    # Direct parts DuckDB does not read (touched by a tail key, an older schema
    # version, a link) join the tail: merged by persist.
    where = {id(p): (bi, j) for bi, b in enumerate(batches) for j, p in enumerate(b.parts)}
    merged: dict[int, list[int]] = {}
    scan: list[DirectPart] = []
    for p in split.direct:
        if p.touched or id(p) not in paths:
            bi, j = where[id(p.ref)]
            merged.setdefault(bi, []).append(j)
        else:
            scan.append(p)
    if merged:
        more = read([(batches[bi], sorted(idx)) for bi, idx in merged.items()])
        both = more if rest is None else pa.concat_tables([rest, more])
        rest = consolidate(both, keys, values, since=as_of)
    if rest is None:
        rest = schema.empty_table()
    rest = rest.select([*names, DIFF])
    if not scan:
        return _arrow(con, rest, st)
    out = _scan(con, [paths[id(p)] for p in scan], scan, names, st.name)
    if rest.num_rows:
        out = out.union(_arrow(con, rest, st))
    return out


def _arrow(
    con: duckdb.DuckDBPyConnection, snapshot: pa.Table, st: ShardState
) -> duckdb.DuckDBPyRelation:
    """``snapshot`` (consolidated, with ``_diff``) expanded by multiplicity, as Arrow
    handed to ``con``."""
    return con.from_arrow(expand_rows(snapshot, st.name))


def _scan(
    con: duckdb.DuckDBPyConnection,
    paths: Sequence[str],
    parts: Sequence[DirectPart],
    names: Sequence[str],
    what: str,
) -> duckdb.DuckDBPyRelation:
    """The relation of ``paths``' rows (local Parquet files, as :func:`literal_path`
    spells them),
    each repeated by its ``_diff``, with the columns ``names``; the parts' ``_diff``
    statistics decide whether rows repeat and refuse a negative multiplicity before
    anything is read (the rows are counted only when a part has no such statistics).

    Raises:
        InvalidUsage: a negative multiplicity (as :func:`persist.relation.expand_rows`).
    """
    rel = con.read_parquet(list(paths))
    ranges = [_diff_range(p) for p in parts]
    if all(r is not None for r in ranges):
        low = min(r[0] for r in ranges if r is not None)
        top = max(r[1] for r in ranges if r is not None)
        negative = int(low < 0)
    else:
        counts = rel.aggregate("count(*) FILTER (WHERE _diff < 0), coalesce(max(_diff), 1)")
        negative, top = (int(x) for x in counts.fetchall()[0])
    if negative:
        raise InvalidUsage(
            f"shard {what!r} has row(s) with a negative multiplicity at this time (more "
            "retractions than insertions): it is not a relation"
        )
    cols = ", ".join(quote(n) for n in names)
    if top == 1:
        return rel.project(cols)
    # The column names are quoted identifiers (:func:`quote`), never SQL text.  The
    # scan's name is one of its own: a name the connection already has (a user's table
    # "parts") would be bound instead.
    view = f"__persist_parts_{uuid.uuid4().hex}"
    out = rel.query(view, f"SELECT {cols} FROM {view}, range({view}._diff)")  # noqa: S608
    assert out is not None
    return out
