"""Alembic: upgrade, downgrade, upgrade on SQLite and Postgres; autogenerate finds no
difference from the metadata; a database behind head refuses to open with the command
to run; the stash_entries view is readable with plain SQL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from stash import MigrationRequired, Stash
from stash.migrate import current_revision, downgrade, head_revision, upgrade
from stash.schema import SCHEMA_HEAD, metadata


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/m.db"
    return str(request.getfixturevalue("postgres_url"))


def _include(
    obj: object, name: str | None, type_: str, reflected: bool, compare_to: object
) -> bool:
    return not (type_ == "table" and name in ("alembic_version", "stash_entries"))


def test_schema_head_constant_matches_alembic() -> None:
    assert head_revision() == SCHEMA_HEAD


def test_upgrade_downgrade_upgrade_and_no_autogenerate_diff(db_url: str) -> None:
    engine = sa.create_engine(db_url)
    try:
        upgrade(engine)
        downgrade(engine, "base")
        with engine.connect() as conn:
            assert current_revision(conn) is None
            assert set(sa.inspect(conn).get_table_names()) <= {"alembic_version"}
        upgrade(engine)
        with engine.connect() as conn:
            assert current_revision(conn) == SCHEMA_HEAD
            ctx = MigrationContext.configure(
                conn, opts={"include_object": _include, "compare_type": True}
            )
            diff = compare_metadata(ctx, metadata)
            assert diff == []
    finally:
        engine.dispose()


def test_database_behind_head_refuses_to_open(db_url: str) -> None:
    engine = sa.create_engine(db_url)
    engine.dispose()
    if db_url.startswith("sqlite"):
        # The embedded default upgrades itself when writable, but not when readonly.
        sa.create_engine(db_url).connect().close()
        with pytest.raises(MigrationRequired) as e:
            Stash.open(db_url, mode="readonly")
        assert "none (empty database)" in str(e.value) and "stash migrate" in str(e.value)
        Stash.open(db_url).close()
        Stash.open(db_url, mode="readonly").close()
    else:
        with pytest.raises(MigrationRequired) as e:
            Stash.open(db_url)
        msg = str(e.value)
        assert "stash migrate" in msg and "none (empty database)" in msg
        assert "***" in msg or "@" not in msg


def test_alembic_command_line_and_plain_sql_view(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/cli.db"
    root = Path(__file__).resolve().parents[2]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "alembic",
            "-c",
            str(root / "migrations/alembic.ini"),
            "-x",
            f"url={url}",
            "upgrade",
            "head",
        ],
        check=True,
        cwd=tmp_path,
        capture_output=True,
    )
    with Stash.open(url) as s:
        c = s.collection("orders")
        b = c.make_batch(s)
        c.append_to_batch(b, {"id": 1}, {"qty": 2}, 1)
        s.append([b])
    import sqlite3

    rows = (
        sqlite3.connect(f"{tmp_path}/cli.db")
        .execute("SELECT collection, json_extract(value, '$.qty'), time, diff FROM stash_entries")
        .fetchall()
    )
    assert rows == [("orders", 2, 0, 1)]


def test_postgres_data_is_jsonb(postgres_url: str) -> None:
    engine = sa.create_engine(postgres_url)
    upgrade(engine)
    with Stash.open(postgres_url) as s:
        c = s.collection("orders")
        b = c.make_batch(s)
        c.append_to_batch(b, {"id": 1}, {"qty": 2, "name": "x"}, 1)
        s.append([b])
    with engine.connect() as conn:
        row = conn.exec_driver_sql(
            "SELECT collection, value->>'name', (value->>'qty')::int FROM stash_entries"
        ).one()
    engine.dispose()
    assert tuple(row) == ("orders", "x", 2)
