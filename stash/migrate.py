"""Running the alembic migrations of the stash schema from code and the CLI.

Invariants kept here: the only way the schema is created or changed is an alembic
revision from ``migrations/versions``; :func:`current_revision` reads the version a
database is at without changing it; a SQLite database file is created readable and
writable by its owner only (``0600``, so are the ``-wal`` and ``-shm`` files SQLite
derives from it) in directories created ``0700``, whoever creates it: :meth:`Stash.open
<stash.base.Stash.open>`, :func:`upgrade` (``stash migrate``) or a plain ``alembic
upgrade`` (``migrations/env.py``), all through :func:`create_sqlite_file`; one alembic
command runs at a time in a process (:data:`ALEMBIC_LOCK`: alembic keeps the context of
a running migration in process-global module proxies, ``alembic.context`` and
``alembic.op``, so two at once in threads corrupt each other, or crash the interpreter);
on Postgres a migration holds a transaction-level advisory lock
(:func:`lock_migrations`, taken by ``migrations/env.py``), so migrations of one database
from several processes run one after the other, and each one after the first finds the
schema at the revision asked for and does nothing.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

import migrations
from stash.placement import install, placement

MIGRATIONS_DIR = Path(migrations.__file__).resolve().parent

log = logging.getLogger(__name__)

#: Held while an alembic command runs in this process (see the module docstring).
ALEMBIC_LOCK = threading.RLock()

#: The key of the Postgres advisory lock a migration holds (an arbitrary constant: the
#: eight bytes of "stashmig" as a big-endian signed integer).
MIGRATION_LOCK_KEY = int.from_bytes(b"stashmig", "big", signed=True)


def lock_migrations(connection: sa.Connection) -> None:
    """Take the migration lock of the database behind ``connection`` for the rest of
    its transaction: on Postgres ``pg_advisory_xact_lock`` (waits for a migration running
    in another session; released at COMMIT or ROLLBACK); elsewhere nothing (a SQLite
    migration holds the database's write lock)."""
    if connection.dialect.name == "postgresql":
        connection.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})


def create_sqlite_file(database: str | None) -> Path | None:
    """Create the SQLite database file ``database`` empty and owner-only if it is missing.

    Missing parent directories are created with mode ``0o700`` and the file with
    ``0o600`` (SQLite gives its ``-wal`` and ``-shm`` files the database file's mode), so
    that SQLite never creates it with its default ``0o644``.  An existing file is left as
    it is (its owner chose its mode), with a warning logged when others can read it.

    Args:
        database: the ``database`` part of a ``sqlite:///`` URL (a path; ``~`` expanded).
            ``None``, ``""``, ``":memory:"`` and ``file:`` URIs are not files this creates.

    Returns:
        The path of the file, or ``None`` when ``database`` names no plain file.

    Raises:
        OSError: a directory or the file cannot be created (the caller names the URL).
    """
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    path = Path(database).expanduser()
    if os.path.lexists(path):
        mode = os.stat(path).st_mode & 0o777
        if mode & 0o077:
            log.warning(
                "stash database %s is readable by others (mode %s); SQLite gives its -wal "
                "and -shm files (which hold committed rows) the same mode: chmod 600 it",
                path,
                oct(mode),
            )
        return path
    missing: list[Path] = []
    d = path.parent.absolute()
    while not d.is_dir():
        missing.append(d)
        if d.parent == d:
            break
        d = d.parent
    for m in reversed(missing):
        try:
            os.mkdir(m, 0o700)
        except FileExistsError:
            pass
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.close(fd)
    return path


def alembic_config(connection: sa.Connection | None = None) -> Config:
    """An alembic ``Config`` for ``migrations/`` (optionally bound to a connection; the
    stash's schema and version table come from its engine's URL,
    :mod:`stash.placement`)."""
    cfg = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    """The head revision of ``migrations/versions``."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def known_revisions() -> frozenset[str]:
    """Every revision of ``migrations/versions`` (the head included)."""
    script = ScriptDirectory.from_config(alembic_config())
    return frozenset(r.revision for r in script.walk_revisions())


def current_revision(connection: sa.Connection) -> str | None:
    """The revision a database is at, or ``None`` if alembic never ran on it (read from
    the stash's version table, :mod:`stash.placement`)."""
    where = placement(connection.engine.url)
    opts = {"version_table": where.version_table, "version_table_schema": where.schema}
    return MigrationContext.configure(connection, opts=opts).get_current_revision()


def migration_engine(url: sa.URL | str) -> sa.Engine:
    """An engine for migrating the stash at ``url`` (a Postgres one searches the
    stash's schema; see :mod:`stash.placement`).

    Raises:
        StashError: a bad schema parameter.
    """
    u = sa.make_url(url)
    if u.get_backend_name() == "postgresql" and u.drivername == "postgresql":
        u = u.set(drivername="postgresql+psycopg")
    engine = sa.create_engine(u, poolclass=sa.pool.NullPool)
    if u.get_backend_name() == "postgresql":
        install(engine)
    else:
        placement(u)  # refuses the Postgres-only parameters
    return engine


def upgrade(engine: sa.Engine, revision: str = "head") -> None:
    """Bring the database behind ``engine`` to ``revision`` (default the head).

    A SQLite database file that does not exist yet is created owner-only first
    (:func:`create_sqlite_file`).

    Raises:
        OSError: the SQLite file or its directory cannot be created.
    """
    if engine.dialect.name == "sqlite":
        create_sqlite_file(engine.url.database)
    with engine.begin() as conn:
        upgrade_connection(conn, revision)


def upgrade_connection(connection: sa.Connection, revision: str = "head") -> None:
    """Bring the database to ``revision`` in the transaction open on ``connection``
    (committed by the caller), one alembic command at a time in this process
    (:data:`ALEMBIC_LOCK`) and, on Postgres, under the migration lock
    (:func:`lock_migrations`, taken before alembic reads the version)."""
    with ALEMBIC_LOCK:
        command.upgrade(alembic_config(connection), revision)


def downgrade(engine: sa.Engine, revision: str) -> None:
    """Take the database behind ``engine`` down to ``revision`` (``"base"`` = empty)."""
    with engine.begin() as conn, ALEMBIC_LOCK:
        command.downgrade(alembic_config(conn), revision)
