"""Alembic: upgrade, downgrade, upgrade on SQLite and Postgres; autogenerate finds no
difference from the metadata; a database behind head refuses to open with the command
to run; the stash_entries view is readable with plain SQL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from stash import MigrationRequired, Stash
from stash.migrate import current_revision, downgrade, head_revision, upgrade
from stash.schema import SCHEMA_HEAD, exists_on, metadata


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/m.db"
    return str(request.getfixturevalue("postgres_url"))


def _include(
    obj: object, name: str | None, type_: str, reflected: bool, compare_to: object
) -> bool:
    return not (type_ == "table" and name in ("alembic_version", "stash_entries", "stash_logs"))


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

            def include(obj: object, name: str | None, type_: str, r: bool, to: object) -> bool:
                return _include(obj, name, type_, r, to) and exists_on(obj, conn.dialect.name)

            ctx = MigrationContext.configure(
                conn, opts={"include_object": include, "compare_type": True}
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


def _server_has_lz4(conn: sa.Connection) -> bool:
    """Whether the Postgres server was built with LZ4 (migration 0010 uses it then)."""
    return bool(
        conn.exec_driver_sql(
            "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'"
        ).scalar()
    )


def test_postgres_log_entries_are_lz4_compressed(postgres_url: str) -> None:
    """A long log entry (a rollup: JSON of base64 and hex that pglz gives up on) is
    stored LZ4-compressed and reads back unchanged, as does one written before the
    migration; the downgrade sets the column back to the default compression.  Failed
    on the old code (stored uncompressed, ``pg_column_compression`` NULL)."""
    import base64
    import json
    import random

    from stash import logs
    from stash.logs import LogEntry

    engine = sa.create_engine(postgres_url)
    try:
        with engine.connect() as conn:
            lz4 = _server_has_lz4(conn)
        if not lz4:  # a server built without LZ4: the migration changes nothing
            upgrade(engine)
            with engine.connect() as conn:
                att = conn.exec_driver_sql(
                    "SELECT attcompression FROM pg_attribute"
                    " WHERE attrelid = 'logs'::regclass AND attname = 'data'"
                ).scalar()
            assert att in ("", "\\x00", None)
            return
        rng = random.Random(7)

        def rollup(n: int) -> str:
            return json.dumps(
                {
                    f"trace/hollow_batches/{i}-{i + 1}": {
                        "desc": {"lower": [i], "since": [0], "upper": [i + 1]},
                        "inline": base64.b64encode(rng.randbytes(500)).decode(),
                        "sha256": rng.randbytes(32).hex(),
                    }
                    for i in range(n)
                },
                sort_keys=True,
            )

        old, new = rollup(60), rollup(61)
        upgrade(engine, "0009")  # an entry written before the migration reads after it
        with engine.begin() as conn:
            conn.execute(
                sa.text("INSERT INTO logs VALUES ('persist.shard.old', 0, true, :d)"), {"d": old}
            )
        upgrade(engine)
        with Stash.open(postgres_url, fenced=False) as s:
            logs.write(s, [LogEntry("persist.shard.new", None, 0, new, True)])
            assert logs.head(s, "persist.shard.old")[0].data == old
            assert logs.head(s, "persist.shard.new")[0].data == new
        with engine.connect() as conn:
            got = {
                name: (method, smaller)
                for name, method, smaller in conn.exec_driver_sql(
                    "SELECT name, pg_column_compression(data), "
                    "pg_column_size(data) < octet_length(data) FROM logs"
                ).all()
            }
        assert got["persist.shard.new"] == ("lz4", True)
        assert got["persist.shard.old"][0] != "lz4"
        downgrade(engine, "0009")
        with engine.connect() as conn:
            att = conn.exec_driver_sql(
                "SELECT attcompression FROM pg_attribute"
                " WHERE attrelid = 'logs'::regclass AND attname = 'data'"
            ).scalar()
            data = conn.exec_driver_sql(
                "SELECT data FROM logs WHERE name = 'persist.shard.new'"
            ).scalar()
        assert att in ("", "\\x00", None) and data == new
    finally:
        engine.dispose()


def test_upgrade_from_0001_keeps_rows_gives_an_identity_and_takes_long_keys(
    db_url: str,
) -> None:
    """A stash written at revision 0001: upgraded, its rows are found by key again
    (Postgres rebuilt the key index as an index of key hashes), it has a stash identity
    its handles carry, and it takes keys of any length; a downgrade to 0001 and an
    upgrade back keep the rows."""
    engine = sa.create_engine(db_url)
    try:
        upgrade(engine, "0001")
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO collections (name, key_codec, value_codec) VALUES ('c', 'json', 'json')"
            )
            cid = conn.exec_driver_sql("SELECT collection_id FROM collections").scalar_one()
            conn.execute(sa.text("INSERT INTO sinces VALUES (:c, 0)"), {"c": cid})
            conn.execute(sa.text("INSERT INTO uppers VALUES (:c, 1)"), {"c": cid})
            conn.execute(
                sa.text("INSERT INTO data VALUES (:c, :k, :v, 0, 1)"),
                {"c": cid, "k": '"old"', "v": "1"},
            )
        upgrade(engine)
        with engine.connect() as conn:
            sid = conn.exec_driver_sql("SELECT stash_id FROM fence").scalar_one()
        assert len(sid) == 32
        long_key = os.urandom(25_000).hex()  # incompressible: 50 KB in an index entry
        with Stash.open(db_url) as s:
            c = s.collection("c")
            assert c.stash_id == sid
            b = c.make_batch(s)
            c.append_to_batch(b, "old", 1, -1)
            c.append_to_batch(b, "old", 2, 1)
            c.append_to_batch(b, long_key, 3, 1)
            s.append([b])
            assert s.peek_key_one(c, "old") == 2 and s.peek_key_one(c, long_key) == 3
            b = c.make_batch(s)
            c.append_to_batch(b, long_key, 3, -1)
            s.append([b])
            assert s.peek_one(c) == {"old": 2}
        downgrade(engine, "0001")
        upgrade(engine)
        with Stash.open(db_url) as s:
            assert s.peek_one(s.collection("c")) == {"old": 2}
    finally:
        engine.dispose()


def test_lz4_migration_alters_only_the_stash_logs_in_its_schema(postgres_url: str) -> None:
    """A stash in a schema of its own (``stash_schema``) beside an application table
    also named ``logs``: the LZ4 migration and its downgrade change the stash's
    ``logs.data`` only, never the application's column."""
    engine = sa.create_engine(postgres_url)
    try:
        with engine.begin() as conn:
            lz4 = _server_has_lz4(conn)
            conn.exec_driver_sql("CREATE TABLE public.logs (data text)")
        url = postgres_url + "?stash_schema=catalog&stash_version_table=stash_alembic_version"
        from stash.migrate import migration_engine

        stash_engine = migration_engine(url)

        def compression() -> dict[str, str]:
            with engine.connect() as conn:
                rows = conn.exec_driver_sql(
                    "SELECT n.nspname, a.attcompression FROM pg_attribute a"
                    " JOIN pg_class c ON c.oid = a.attrelid"
                    " JOIN pg_namespace n ON n.oid = c.relnamespace"
                    " WHERE c.relname = 'logs' AND a.attname = 'data'"
                ).all()
            return {ns: str(att or "") for ns, att in rows}

        try:
            upgrade(stash_engine)  # a server without LZ4: nothing changes
            assert compression() == {"catalog": "l" if lz4 else "", "public": ""}
            downgrade(stash_engine, "0009")
            assert compression() == {"catalog": "", "public": ""}
        finally:
            stash_engine.dispose()
    finally:
        engine.dispose()
