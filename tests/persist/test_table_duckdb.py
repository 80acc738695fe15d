"""``Table.to_duckdb`` (``persist/duckdb_read.py``): the relation's rows are exactly
``to_arrow``'s, whether DuckDB scans the Parquet parts itself or persist merges them
(a differential property test over appends with duplicates, upserts, deletes, full
compactions and since moves)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist import FileBlob, InvalidUsage, MemoryBlob, PersistClient, SinceViolation, Table
from stash import Stash

LONG = os.environ.get("STASH_RELIABILITY") == "long"
SCHEMA = pa.schema(
    [pa.field("id", pa.int64(), False), ("name", pa.string()), ('we"ird', pa.float64())]
)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[PersistClient]:
    s = Stash.open(f"sqlite:///{tmp_path}/s.db", fenced=False)
    c = PersistClient(s, FileBlob(str(tmp_path / "blob")), compaction="off", inline_max_bytes=0)
    try:
        yield c
    finally:
        c.close()
        s.close()


def _sorted(t: pa.Table) -> list[tuple[Any, ...]]:
    return sorted((tuple(r.values()) for r in t.to_pylist()), key=repr)


def _same(rel: Any, t: Table, as_of: Any = None) -> None:
    got = rel.to_arrow_table()
    want = t.to_arrow(as_of)
    assert got.column_names == want.column_names
    assert [f.type for f in got.schema] == [f.type for f in want.schema]
    assert _sorted(got) == _sorted(want)


def _plan(rel: Any) -> str:
    return str(rel.explain())


def test_duckdb_scans_a_compacted_table_itself(client: PersistClient) -> None:
    t = client.create_table("d", SCHEMA, key=["id"])
    rows = pa.table({"id": [1, 2, 2], "name": ["a", "b", "b"], 'we"ird': [1.0, None, None]})
    t.append(rows)
    rel = t.to_duckdb()
    assert "PARQUET" in _plan(rel).upper()  # one run at one time: scanned by DuckDB
    _same(rel, t)
    t.append(pa.table({"id": [3], "name": ["c"], 'we"ird': [3.0]}))
    rel = t.to_duckdb()
    plan = _plan(rel).upper()
    assert "PARQUET" in plan and "ARROW" not in plan  # two runs of inserts: no merge
    _same(rel, t)
    t.upsert(pa.table({"id": [1], "name": ["z"], 'we"ird': [None]}, schema=SCHEMA))
    rel = t.to_duckdb()
    plan = _plan(rel).upper()
    assert "PARQUET" in plan and "ARROW" in plan  # id 3's part scanned, id 1's merged
    _same(rel, t)
    ks, vs = pa.schema([SCHEMA.field("id")]), pa.schema(list(SCHEMA)[1:])
    r = client.open_reader("d", ks, vs)
    r.downgrade_since(2)
    r.expire()
    t.optimize()
    rel = t.to_duckdb()
    assert "PARQUET" in _plan(rel).upper()
    _same(rel, t)
    con = duckdb.connect()
    agg = t.to_duckdb(con).aggregate("sum(id) AS s").to_arrow_table()
    assert agg.column("s").to_pylist() == [8]
    with pytest.raises(SinceViolation, match=r"since \{2\}"):
        t.to_duckdb(as_of=0)  # as to_arrow


def test_negative_multiplicity_refused_like_to_arrow(client: PersistClient) -> None:
    t = client.create_table("neg", SCHEMA, key=["id"])
    w = client.open_writer("neg", pa.schema([SCHEMA.field("id")]), pa.schema(list(SCHEMA)[1:]))
    w.compare_and_append([(((1,), ("a", 1.0)), 0, -1)], 0, 1)
    with pytest.raises(InvalidUsage, match="negative multiplicity"):
        t.to_arrow()
    with pytest.raises(InvalidUsage, match="negative multiplicity"):
        t.to_duckdb()


_ids = st.integers(0, 30)
_row = st.tuples(_ids, st.sampled_from(["a", "b", None]), st.sampled_from([0.5, -0.0, None]))
_op = st.one_of(
    st.tuples(st.just("append"), st.lists(_row, min_size=1, max_size=8)),
    st.tuples(st.just("bulk"), st.integers(0, 20)),
    st.tuples(st.just("upsert"), st.dictionaries(_ids, _row, max_size=3)),
    st.tuples(st.just("delete"), _ids),
    st.tuples(st.just("optimize")),
    st.tuples(st.just("compact")),
    st.tuples(st.just("since")),
)


def _apply(c: PersistClient, t: Table, op: tuple[Any, ...]) -> None:
    if op[0] == "append":
        t.append(pa.table(list(zip(*op[1], strict=True)), schema=SCHEMA))
    elif op[0] == "bulk":  # distinct keys, inserts only: a run DuckDB may scan
        ids = list(range(op[1], op[1] + 12))
        t.append(pa.table([ids, ["b"] * 12, [0.5] * 12], schema=SCHEMA))
    elif op[0] == "upsert":
        rows = [(i, r[1], r[2]) for i, r in sorted(op[1].items())]
        cols = list(zip(*rows, strict=True)) if rows else [[], [], []]
        t.upsert(pa.table(cols, schema=SCHEMA))
    elif op[0] == "delete":
        t.delete(pc.field("id") == op[1])
    elif op[0] == "optimize":
        t.optimize()
    elif op[0] == "compact":
        c.compactor.compact_once(t.name)
    else:
        upper = c.inspect(t.name).upper.as_option() or 0
        ks, vs = pa.schema([SCHEMA.field("id")]), pa.schema(list(SCHEMA)[1:])
        r = c.open_reader(t.name, ks, vs)
        r.downgrade_since(max(upper - 2, 0))
        r.expire()


@pytest.mark.sized
@settings(
    max_examples=200 if LONG else 20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ops=st.lists(_op, max_size=24 if LONG else 8),
    store=st.sampled_from(["file", "file-inline", "memory"]),
    data=st.data(),
)
def test_to_duckdb_equals_to_arrow(
    tmp_path: Path, ops: list[tuple[Any, ...]], store: str, data: st.DataObject
) -> None:
    """Over random histories (appends with duplicates, bulk appends, upserts, deletes, full
    and ordinary compactions, since moves) and a random ``as_of``, ``to_duckdb`` has
    exactly ``to_arrow``'s rows, on a memory store (all Arrow) and on a file store whose
    directory name holds glob characters (DuckDB scanning parts, with and without
    inline parts merged by persist)."""
    root = tmp_path / f"b[{abs(hash(repr((ops, store))))}]*?"
    blob = MemoryBlob() if store == "memory" else FileBlob(str(root))
    inline = 4096 if store == "file-inline" else 0
    with Stash.open("memory://", fenced=False) as s:
        # One row per part: runs of many parts, most of them untouched by the tail.
        c = PersistClient(s, blob, compaction="off", inline_max_bytes=inline, target_part_bytes=1)
        try:
            t = c.create_table("p", SCHEMA, key=["id"])
            for op in ops:
                _apply(c, t, op)
                _same(t.to_duckdb(), t)
            since = t.details()["since"] or 0
            upper = t.details()["upper"] or 0
            if upper > since:
                as_of = data.draw(st.integers(since, upper - 1), label="as_of")
                _same(t.to_duckdb(as_of=as_of), t, as_of)
        finally:
            c.close()


def test_part_paths_are_names_not_patterns(tmp_path: Path) -> None:
    """DuckDB reads each part by its literal path: a store directory ``b[ab]`` next to a
    copy of it named ``ba`` (which the pattern ``b[ab]`` would match too) gives every row
    once."""
    import shutil

    root = tmp_path / "b[ab]"
    with Stash.open("memory://", fenced=False) as s:
        c = PersistClient(s, FileBlob(str(root)), compaction="off", inline_max_bytes=0)
        try:
            t = c.create_table("g", SCHEMA, key=["id"])
            t.append(pa.table({"id": [1, 2], "name": ["a", "b"], 'we"ird': [1.0, 2.0]}))
            shutil.copytree(root, tmp_path / "ba")
            rel = t.to_duckdb()
            assert "PARQUET" in _plan(rel).upper()
            _same(rel, t)
            assert rel.aggregate("count(*) AS n").fetchall() == [(2,)]
        finally:
            c.close()


def test_a_read_of_a_version_whose_parts_gc_deleted_reads_the_newest(
    client: PersistClient, tmp_path: Path
) -> None:
    """A read without a lease holds an older version; once compaction replaced its parts
    and GC deleted them, the read starts again on the newest version at the same time
    (for DuckDB's scan and for persist's own read alike)."""
    from persist.duckdb_read import to_relation
    from persist.gc import collect_garbage
    from persist.version_read import read_version

    t = client.create_table("g", SCHEMA, key=["id"])
    t.append(pa.table({"id": [1, 2], "name": ["a", "b"], 'we"ird': [1.0, 2.0]}))
    t.append(pa.table({"id": [3], "name": ["c"], 'we"ird': [3.0]}))
    old = t._state()
    as_of = old.upper.as_option() - 1
    old_files = {p.key for b in old.batches() for p in b.parts if p.key}
    t.optimize()
    collect_garbage(client, "g", grace_seconds=0)
    on_disk = {str(p.relative_to(tmp_path / "blob")) for p in (tmp_path / "blob").rglob("*")}
    assert old_files and not old_files & on_disk  # the old version's parts are gone
    _same(to_relation(t._ctx, t._machine, old, as_of, duckdb.connect()), t)
    got = read_version(t._ctx, t._machine, old, as_of).drop_columns(["_time", "_diff"])
    assert _sorted(got) == _sorted(t.to_arrow())
