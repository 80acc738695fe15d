"""A Postgres log write of several logs is one conditional INSERT statement per
``stash.postgres.LOG_INSERT_CHUNK`` entries (``stash.pg_statements.pg_log_insert_sql``):
written in several statements, every entry lands, a lost race in a later statement
still names its log and commits nothing, and a fenced-out handle still gets FenceError.
(A concurrent writer of the same seqno: tests/stash/test_logs.py.)"""

from __future__ import annotations

import psycopg
import pytest

import stash.postgres as pg
from stash import logs as L
from stash.errors import FenceError, LogRaceLost
from stash.pg_statements import pg_log_insert_sql
from tests.stash.conftest import OpenStash


def _e(name: str, expected: int | None, data: str) -> L.LogEntry:
    return L.LogEntry(name, expected, 0 if expected is None else expected + 1, data, False)


@pytest.mark.parametrize("backend", ["postgres"])
@pytest.mark.parametrize("fenced", [False, True])
def test_write_of_more_entries_than_a_statement_takes(
    open_stash: OpenStash, fenced: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pg, "LOG_INSERT_CHUNK", 2)
    s = open_stash(fenced=fenced)
    names = [f"l{i}" for i in range(5)]
    statements: list[str] = []
    execute = psycopg.Cursor.execute

    def spy(self: psycopg.Cursor[object], query: object, *a: object, **k: object) -> object:
        if "INTO logs" in str(query):
            statements.append(str(query))
        return execute(self, query, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(psycopg.Cursor, "execute", spy)
    L.write(s, [_e(n, None, f"{n}-0") for n in names])
    assert len(statements) == 3  # 2 + 2 + 1 entries
    stale = [_e(n, 0 if n != "l3" else None, f"{n}-1") for n in names]  # l3: in the 2nd
    with pytest.raises(LogRaceLost) as ei:
        L.write(s, stale)
    assert ei.value.collection == "l3"
    assert [[r.data for r in L.scan(s, n)] for n in names] == [[f"{n}-0"] for n in names]
    L.write(s, [_e(n, 0, f"{n}-1") for n in names])
    assert [[r.data for r in L.scan(s, n)] for n in names] == [[f"{n}-0", f"{n}-1"] for n in names]
    if fenced:
        open_stash(fenced=True)  # takes the epoch
        with pytest.raises(FenceError):
            L.write(s, [_e(n, 1, "late") for n in names])
        r = open_stash(mode="readonly")
        assert [len(L.scan(r, n)) for n in names] == [2] * 5


def test_statement_shape() -> None:
    """One column per entry; the fence is read once, FOR SHARE; the statement is built
    once per (count, fenced)."""
    one = pg_log_insert_sql(1, False)
    assert one.startswith("WITH i0 AS (INSERT INTO logs") and one.endswith(
        "SELECT (SELECT x FROM i0)"
    )
    two = pg_log_insert_sql(2, True)
    assert two.count("FOR SHARE") == 1 and two.count("INSERT INTO logs") == 2
    assert "ON CONFLICT" not in two  # a speculative insertion writes more WAL
    assert two.endswith("SELECT (SELECT x FROM i0), (SELECT x FROM i1)")
    assert pg_log_insert_sql(2, True) is two
    with pytest.raises(ValueError, match="at least one entry"):
        pg_log_insert_sql(0, False)
