"""Tests of the real-PostgreSQL test infrastructure: tests/support/pgserver.py and pg_fixtures.py.

They start real servers from the machine's binaries and check what later Postgres tests rely
on: password login, fresh databases, durability across fast and crash (immediate) restarts on
the same port, pg_terminate_backend of other sessions, no password in reprs, the watchdog that
stops a server whose owner was SIGKILLed, and the fixtures' skip-or-fail rule.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa

from tests.support.pgserver import PostgresServer, find_postgres_bin_dir

pytest_plugins = ["tests.support.pg_fixtures"]

pytestmark = pytest.mark.postgres

_seen_databases: list[str] = []


def test_server_accepts_password_login_only(postgres_server: PostgresServer) -> None:
    with postgres_server.connect() as conn:
        row = conn.execute("SELECT current_user, inet_server_port()").fetchone()
    assert row == (postgres_server.user, postgres_server.port)
    wrong = psycopg.conninfo.make_conninfo(
        postgres_server.conninfo(), password=postgres_server.password + "x"
    )
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(wrong)
    no_password = psycopg.conninfo.make_conninfo(postgres_server.conninfo(), password="")
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(no_password)


def test_server_settings_are_durable_and_local(postgres_server: PostgresServer) -> None:
    with postgres_server.connect() as conn:
        settings = dict(
            conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name = ANY(%s)",
                (["fsync", "synchronous_commit", "full_page_writes", "listen_addresses"],),
            ).fetchall()
        )
        data_dir = conn.execute("SHOW data_directory").fetchone()
    assert settings == {
        "fsync": "on",
        "synchronous_commit": "on",
        "full_page_writes": "on",
        "listen_addresses": "127.0.0.1",
    }
    assert data_dir is not None and Path(data_dir[0]) == postgres_server.data_dir
    if os.geteuid() == 0:
        # The server cannot run as root: its files belong to the unprivileged account.
        assert postgres_server.data_dir.stat().st_uid != 0


def test_create_database_gives_a_working_sqlalchemy_url(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database("created_here")
    try:
        assert url == (
            f"postgresql+psycopg://{postgres_server.user}:{postgres_server.password}"
            f"@127.0.0.1:{postgres_server.port}/created_here"
        )
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        with engine.begin() as conn:
            assert conn.execute(sa.text("SELECT current_database()")).scalar() == "created_here"
        engine.dispose()
        with pytest.raises(psycopg.errors.DuplicateDatabase):
            postgres_server.create_database("created_here")
    finally:
        postgres_server.drop_database("created_here")
    with postgres_server.connect() as conn:
        gone = conn.execute("SELECT 1 FROM pg_database WHERE datname = 'created_here'").fetchone()
    assert gone is None


@pytest.mark.parametrize(
    "bad", ["", "1abc", "a-b", "a b", 'x"; DROP DATABASE postgres; --', "a" * 64]
)
def test_create_database_rejects_bad_names(postgres_server: PostgresServer, bad: str) -> None:
    with pytest.raises(ValueError, match="invalid database name"):
        postgres_server.create_database(bad)


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_restart_keeps_committed_data_and_port(
    postgres_server: PostgresServer, postgres_url: str, mode: str
) -> None:
    dbname = postgres_url.rsplit("/", 1)[1]
    port = postgres_server.port
    with postgres_server.connect(dbname) as conn:
        conn.execute("CREATE TABLE t (x int)")
        conn.execute("INSERT INTO t VALUES (1), (2)")
    uncommitted = postgres_server.connect(dbname, autocommit=False)
    uncommitted.execute("INSERT INTO t VALUES (99)")  # never committed

    postgres_server.restart(mode)  # type: ignore[arg-type]

    assert postgres_server.is_running()
    assert postgres_server.port == port
    with pytest.raises(psycopg.OperationalError):
        uncommitted.execute("SELECT 1")  # its server process is gone
    uncommitted.close()
    with postgres_server.connect(dbname) as conn:
        rows = conn.execute("SELECT x FROM t ORDER BY x").fetchall()
    assert rows == [(1,), (2,)]


def test_stop_and_start_are_idempotent(postgres_server: PostgresServer) -> None:
    postgres_server.stop("fast")
    assert not postgres_server.is_running()
    postgres_server.stop("fast")  # no-op
    with pytest.raises(psycopg.OperationalError):
        postgres_server.connect()
    postgres_server.start()
    postgres_server.start()  # no-op
    with postgres_server.connect() as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    with pytest.raises(ValueError, match="unknown stop mode"):
        postgres_server.stop("kill")  # type: ignore[arg-type]


def test_terminate_backends_kills_other_sessions_only(
    postgres_server: PostgresServer, postgres_url: str
) -> None:
    dbname = postgres_url.rsplit("/", 1)[1]
    victims = [postgres_server.connect(dbname) for _ in range(2)]
    bystander = postgres_server.connect("postgres")
    try:
        assert postgres_server.terminate_backends(dbname) == 2
        for victim in victims:
            with pytest.raises(psycopg.OperationalError):
                victim.execute("SELECT 1")
        assert bystander.execute("SELECT 1").fetchone() == (1,)
        with postgres_server.connect(dbname) as conn:  # the database still takes connections
            assert conn.execute("SELECT 1").fetchone() == (1,)
        assert postgres_server.terminate_backends(dbname) == 0
    finally:
        for conn in [*victims, bystander]:
            conn.close()


def test_repr_and_safe_url_hide_the_password(postgres_server: PostgresServer) -> None:
    password = postgres_server.password
    assert len(password) >= 16
    for text in (repr(postgres_server), str(postgres_server), postgres_server.safe_url("db")):
        assert password not in text
    assert "***" in repr(postgres_server)
    assert password in postgres_server.url("db")
    assert password not in repr(sa.engine.make_url(postgres_server.url("db")))


def test_postgres_url_gives_a_fresh_empty_database_each_time(
    postgres_server: PostgresServer, postgres_url: str
) -> None:
    dbname = postgres_url.rsplit("/", 1)[1]
    assert dbname not in _seen_databases
    _seen_databases.append(dbname)
    with postgres_server.connect(dbname) as conn:
        tables = conn.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'"
        ).fetchone()
        conn.execute("CREATE TABLE leftover (x int)")
    assert tables == (0,)


test_postgres_url_gives_a_fresh_empty_database_again = (
    test_postgres_url_gives_a_fresh_empty_database_each_time
)


def test_private_server_cleanup_removes_everything() -> None:
    server = PostgresServer()
    base_dir, port = server.base_dir, server.port
    with server.connect() as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    server.cleanup()
    server.cleanup()  # idempotent
    assert not base_dir.exists()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(f"host=127.0.0.1 port={port} user=x password=y connect_timeout=2")
    with pytest.raises(RuntimeError, match="cleaned up"):
        server.start()


def test_watchdog_stops_the_server_of_a_killed_owner() -> None:
    """SIGKILL the process that owns a server: the watchdog stops it and removes its files."""
    root = Path(__file__).resolve().parent.parent
    child_code = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(root)!r})
        from tests.support.pgserver import PostgresServer
        server = PostgresServer()
        print(server.base_dir, server.port, flush=True)
        time.sleep(600)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", child_code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline().split()
        assert len(line) == 2, "child did not start a server"
        base_dir, port = Path(line[0]), int(line[1])
        assert (base_dir / "data" / "postmaster.pid").exists()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    deadline = time.monotonic() + 60
    while base_dir.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not base_dir.exists(), "watchdog did not remove the orphaned server's directory"
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(f"host=127.0.0.1 port={port} user=x password=y connect_timeout=2")


def test_find_postgres_bin_dir_finds_all_binaries() -> None:
    found = find_postgres_bin_dir()
    assert found is not None
    for name in ("initdb", "pg_ctl", "postgres"):
        assert os.access(found / name, os.X_OK)


def test_unavailable_fails_under_ci_and_skips_otherwise(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # already loaded as a plugin; imported here so pytest can rewrite it
    from tests.support import pg_fixtures

    failing = tmp_path / "ensure_postgres.sh"
    failing.write_text("echo 'cannot install here' >&2; exit 1\n")
    monkeypatch.setattr(pg_fixtures, "find_postgres_bin_dir", lambda: None)
    monkeypatch.setattr(pg_fixtures, "ENSURE_SCRIPT", failing)

    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="required under CI.*cannot install here"):
        pg_fixtures.require_postgres_server()

    for value in ("", "0", "false"):
        monkeypatch.setenv("CI", value)
        with pytest.raises(pytest.skip.Exception, match="unavailable.*exited 1"):
            pg_fixtures.require_postgres_server()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception):
        pg_fixtures.require_postgres_server()
