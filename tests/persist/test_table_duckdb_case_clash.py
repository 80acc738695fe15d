"""``Table.to_duckdb`` of a table with two columns whose names differ only in case
(``"A"`` and ``"a"``: distinct to persist and Arrow) is refused, naming both columns,
instead of a relation with other columns or values: DuckDB's identifiers are
case-insensitive, so it renamed the second column (``a_1``) when handed Arrow, and
reading its parts projected ``"a"`` to ``"A"``, so the relation held ``A``'s values
twice, under ``A`` and ``A`` (silently wrong rows).  Other tables are unaffected."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from persist import FileBlob, InvalidUsage, MemoryBlob, PersistClient, Table
from stash import Stash


@pytest.fixture(params=["file", "memory"])
def client(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[PersistClient]:
    blob = FileBlob(tmp_path / "blob") if request.param == "file" else MemoryBlob()
    s = Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False)
    c = PersistClient(s, blob, compaction="off", inline_max_bytes=0)
    yield c
    c.close()
    s.close()


@pytest.mark.parametrize("rows", [0, 2])
def test_names_differing_only_in_case_are_refused(client: PersistClient, rows: int) -> None:
    schema = pa.schema([("k", pa.int64()), ("A", pa.int64()), ("a", pa.int64())])
    t = client.create_table("t", schema, key=["k"])
    if rows:
        t.append(pa.table({"k": [1, 2], "A": [10, 20], "a": [11, 21]}))
    with pytest.raises(InvalidUsage, match=r"'A' and 'a'.*case"):
        t.to_duckdb(duckdb.connect())
    # The table itself reads as it is.
    assert t.to_arrow().column_names == ["k", "A", "a"]


def test_distinct_names_still_read(client: PersistClient) -> None:
    schema = pa.schema([("k", pa.int64()), ("A", pa.int64()), ("b", pa.int64())])
    t = client.create_table("t", schema, key=["k"])
    t.append(pa.table({"k": [1], "A": [10], "b": [11]}))
    rel = t.to_duckdb(duckdb.connect())
    assert rel.columns == ["k", "A", "b"] and rel.fetchall() == [(1, 10, 11)]


def _merge_table(client: PersistClient) -> tuple[Table, pa.Table]:
    schema = pa.schema([("k", pa.int64()), ("A", pa.int64()), ("a", pa.int64())])
    t = client.create_table("m", schema, key=["k"])
    rows = pa.table({"k": [1, 2], "A": [100, 20], "a": [111, 21]})
    t.append(rows)
    return t, rows


def test_a_merge_condition_over_names_differing_in_case_is_refused(client: PersistClient) -> None:
    """A MERGE's conditions and values are DuckDB SQL: ``target.a = 100`` bound to
    ``A`` and deleted the row whose ``a`` is 111.  Refused, committing nothing."""
    t, rows = _merge_table(client)
    source = pa.table({"k": [1, 2], "A": [0, 0], "a": [0, 0]})
    with pytest.raises(InvalidUsage, match=r"'A' and 'a'.*case"):
        t.merge(source).when_matched_delete("target.a = 100").execute()
    with pytest.raises(InvalidUsage, match=r"'A' and 'a'.*case"):
        t.merge(source).when_matched_update({"a": "source.a + 1"}).execute()
    assert t.to_arrow().sort_by("k").equals(rows)


def test_a_merge_of_plain_references_over_names_differing_in_case_still_works(
    client: PersistClient,
) -> None:
    """Plain column references are taken from the Arrow rows, not DuckDB: unchanged."""
    t, _ = _merge_table(client)
    t.merge(pa.table({"k": [2, 3], "A": [200, 300], "a": [222, 333]})).when_matched_update(
        {"a": "source.a"}
    ).when_not_matched_insert_all().execute()
    assert t.to_arrow().sort_by("k").to_pylist() == [
        {"k": 1, "A": 100, "a": 111},
        {"k": 2, "A": 20, "a": 222},
        {"k": 3, "A": 300, "a": 333},
    ]
