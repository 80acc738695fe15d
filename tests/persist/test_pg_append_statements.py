"""What a persist append sends to Postgres: a one-row ``compare_and_append`` is ONE
statement (the conditional INSERTs of the shard's state entry and its history record,
``stash.pg_statements.pg_log_insert_sql``), sent in one pipeline with the ``BEGIN``,
and the ``COMMIT``, on the connection the stash handle holds for its writes; no lock
statement, no read.  Pins the client's round trips (each costs a network round trip
and client CPU: psycopg's wait) against regressions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from persist import PersistClient
from stash import Stash
from tests.support.dbutil import migrate_to_head


@pytest.mark.parametrize("fenced", [False, True])
def test_one_row_append_is_one_statement_and_commit(
    postgres_url: str, tmp_path: Path, fenced: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    migrate_to_head(postgres_url)
    seen: list[str] = []
    execute, commit = psycopg.Cursor.execute, psycopg.Connection.commit

    def spy_execute(self: psycopg.Cursor[Any], query: Any, *a: Any, **k: Any) -> Any:
        pipelined = self.connection._pipeline is not None
        seen.append(("pipelined " if pipelined else "") + str(query))
        return execute(self, query, *a, **k)

    def spy_commit(self: psycopg.Connection[Any]) -> None:
        seen.append("COMMIT")
        commit(self)

    with Stash.open(postgres_url, fenced=fenced) as s:
        client = PersistClient(s, f"file://{tmp_path}/blob", compaction="off")
        w, _ = client.open("t", pa.schema([("k", pa.string())]), pa.schema([]))
        monkeypatch.setattr(psycopg.Cursor, "execute", spy_execute)
        monkeypatch.setattr(psycopg.Connection, "commit", spy_commit)
        for u in range(6):
            seen.clear()
            row = {"k": [str(u)], "_time": pa.array([u], pa.int64()), "_diff": [1]}
            w.compare_and_append(pa.table(row), u, u + 1)
            assert len(seen) == 2 and seen[1] == "COMMIT", seen
            assert seen[0].startswith("pipelined WITH ") and seen[0].count("INSERT INTO logs") == 2
        monkeypatch.undo()
        assert w.upper.as_option() == 6
