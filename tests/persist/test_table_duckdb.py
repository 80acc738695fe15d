"""``Table.to_duckdb`` (``persist/duckdb_read.py``): the relation's rows are exactly
``to_arrow``'s, whether DuckDB scans the Parquet parts itself or persist merges them
(a differential property test over appends with duplicates, upserts, deletes, full
compactions and since moves)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist import FileBlob, InvalidUsage, PersistClient, SinceViolation, Table
from stash import Stash

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
    assert "ARROW" in _plan(rel).upper()  # two batches: merged by persist
    _same(rel, t)
    ks, vs = pa.schema([SCHEMA.field("id")]), pa.schema(list(SCHEMA)[1:])
    r = client.open_reader("d", ks, vs)
    r.downgrade_since(1)
    r.expire()
    t.optimize()
    rel = t.to_duckdb()
    assert "PARQUET" in _plan(rel).upper()
    _same(rel, t)
    con = duckdb.connect()
    agg = t.to_duckdb(con).aggregate("sum(id) AS s").to_arrow_table()
    assert agg.column("s").to_pylist() == [8]
    with pytest.raises(SinceViolation, match=r"since \{1\}"):
        t.to_duckdb(as_of=0)  # as to_arrow


def test_negative_multiplicity_refused_like_to_arrow(client: PersistClient) -> None:
    t = client.create_table("neg", SCHEMA, key=["id"])
    w = client.open_writer("neg", pa.schema([SCHEMA.field("id")]), pa.schema(list(SCHEMA)[1:]))
    w.compare_and_append([(((1,), ("a", 1.0)), 0, -1)], 0, 1)
    with pytest.raises(InvalidUsage, match="negative multiplicity"):
        t.to_arrow()
    with pytest.raises(InvalidUsage, match="negative multiplicity"):
        t.to_duckdb()


_ids = st.integers(0, 4)
_row = st.tuples(_ids, st.sampled_from(["a", "b", None]), st.sampled_from([0.5, -0.0, None]))
_op = st.one_of(
    st.tuples(st.just("append"), st.lists(_row, min_size=1, max_size=4)),
    st.tuples(st.just("upsert"), st.dictionaries(_ids, _row, max_size=3)),
    st.tuples(st.just("delete"), _ids),
    st.tuples(st.just("optimize")),
    st.tuples(st.just("since")),
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(_op, max_size=7))
def test_to_duckdb_equals_to_arrow(tmp_path: Path, ops: list[tuple[Any, ...]]) -> None:
    root = tmp_path / f"b{abs(hash(repr(ops)))}"
    with Stash.open("memory://", fenced=False) as s:
        c = PersistClient(s, FileBlob(str(root)), compaction="off", inline_max_bytes=0)
        try:
            t = c.create_table("p", SCHEMA, key=["id"])
            for op in ops:
                if op[0] == "append":
                    t.append(pa.table(list(zip(*op[1], strict=True)), schema=SCHEMA))
                elif op[0] == "upsert":
                    rows = [(i, r[1], r[2]) for i, r in sorted(op[1].items())]
                    cols = list(zip(*rows, strict=True)) if rows else [[], [], []]
                    t.upsert(pa.table(cols, schema=SCHEMA))
                elif op[0] == "delete":
                    t.delete(pc.field("id") == op[1])
                elif op[0] == "optimize":
                    t.optimize()
                else:
                    upper = c.inspect("p").upper.as_option() or 0
                    ks, vs = pa.schema([SCHEMA.field("id")]), pa.schema(list(SCHEMA)[1:])
                    r = c.open_reader("p", ks, vs)
                    r.downgrade_since(max(upper - 1, 0))
                    r.expire()
                _same(t.to_duckdb(), t)
        finally:
            c.close()
