"""A Postgres stash in a schema of its own, with its own alembic version table, beside
an application's tables and its own ``alembic_version`` (``stash/placement.py``)."""

from __future__ import annotations

import json

import psycopg
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from stash import Stash, StashError, TypedCollection, logs
from stash.cli import main
from stash.feed import Change


def _conninfo(url: str) -> str:
    return sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def test_the_stash_lives_in_its_schema_beside_the_application(postgres_url: str) -> None:
    with psycopg.connect(_conninfo(postgres_url), autocommit=True) as conn:
        # The application's own tables, of the same names the stash uses, and its
        # alembic version.
        conn.execute("CREATE TABLE data (id int)")
        conn.execute("INSERT INTO data VALUES (1)")
        conn.execute("CREATE TABLE alembic_version (version_num varchar(32) PRIMARY KEY)")
        conn.execute("INSERT INTO alembic_version VALUES ('app0042')")
    url = postgres_url + "?stash_schema=catalog&stash_version_table=stash_alembic_version"
    res = CliRunner().invoke(main, ["migrate", url])
    assert res.exit_code == 0, res.output
    with Stash.open(url, fenced=False) as s:
        tc: TypedCollection[str, int] = TypedCollection("tables", "str", "int")
        c = tc.get(s)
        s.set_retention(c, keep_times=None)
        tc.upsert_key(s, "orders", 1)
        start = s.upper(c).as_option() - 1  # type: ignore[operator]
        tc.upsert_key(s, "users", 2)
        assert tc.peek_one(s) == {"orders": 1, "users": 2}
        assert s.peek_range(c, prefix="o").entries == [("orders", 1)]
        feed = [e for e in s.subscribe([c], start, idle_timeout=0.2) if isinstance(e, Change)]
        assert {e.key for e in feed} == {"orders", "users"}
        logs.write(s, [logs.LogEntry("orders.log", None, 0, "v0", True)])
        logs.write(s, [logs.LogEntry("orders.log", 0, 1, "d1")])
        assert [r.data for r in logs.head(s, "orders.log")] == ["v0", "d1"]
    with psycopg.connect(_conninfo(postgres_url), autocommit=True) as conn:
        assert conn.execute("SELECT id FROM public.data").fetchall() == [(1,)]
        assert conn.execute("SELECT version_num FROM public.alembic_version").fetchall() == [
            ("app0042",)
        ]
        head = conn.execute("SELECT version_num FROM catalog.stash_alembic_version").fetchall()
        assert head and head[0][0] >= "0005"
        n = conn.execute("SELECT count(*) FROM catalog.stash_entries").fetchone()
        assert n is not None and n[0] >= 2
        assert conn.execute(
            "SELECT log, seqno FROM catalog.stash_logs ORDER BY seqno"
        ).fetchall() == [
            ("orders.log", 0),
            ("orders.log", 1),
        ]
        assert conn.execute("SELECT to_regclass('public.collections')").fetchone() == (None,)
        assert conn.execute("SELECT to_regclass('public.logs')").fetchone() == (None,)
    res = CliRunner().invoke(main, ["collections", url, "--json"])
    assert res.exit_code == 0, res.output
    assert [json.loads(x)["name"] for x in res.output.splitlines()] == ["tables"]
    # Without the parameters the stash is not found where the application lives.
    with pytest.raises(StashError, match="schema revision"):
        Stash.open(postgres_url, mode="readonly")


def test_schema_parameters_are_identifiers_and_postgres_only(tmp_path: object) -> None:
    with pytest.raises(StashError, match=r"stash_schema='a;b' in the stash URL must be an"):
        Stash.open("postgresql+psycopg://u:p@127.0.0.1:1/db?stash_schema=a;b")
    with pytest.raises(StashError, match="are Postgres options"):
        Stash.open(f"sqlite:///{tmp_path}/s.db?stash_schema=catalog")
