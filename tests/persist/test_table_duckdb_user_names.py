"""``Table.to_duckdb(con)`` works on a connection that already holds tables and views of
any name: the relation's own query named its scan ``parts``, so a user's table
``parts`` in the connection was bound instead (a Binder Error, or that table's rows had
it a ``_diff`` column).  The connection's objects are left as they were."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from persist import PersistClient
from stash import Stash


@pytest.mark.parametrize("copies", [1, 2])
@pytest.mark.parametrize("name", ["parts", "t"])
def test_to_duckdb_on_a_connection_with_a_table_of_the_same_name(
    tmp_path: Path, copies: int, name: str
) -> None:
    c = PersistClient(
        Stash.open(f"sqlite:///{tmp_path}/s.db"), f"file://{tmp_path}/blob", compaction="off"
    )
    t = c.create_table("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]), key=["k"])
    t.append(pa.table({"k": list(range(3000)) * copies, "v": [1] * (3000 * copies)}))
    con = duckdb.connect()
    con.execute(f'CREATE TABLE "{name}" AS SELECT 42 AS answer, -5 AS _diff')
    rel = t.to_duckdb(con)
    assert "parquet" in rel.explain().lower()
    assert rel.aggregate("count(*), sum(v)").fetchall() == [(3000 * copies, 3000 * copies)]
    assert con.table(name).fetchall() == [(42, -5)]
    c.close()
