"""Alembic environment of the stash schema.

Targets :data:`stash.schema.metadata`.  The database URL comes from, in order: a
connection handed over by :mod:`stash.migrate` (``config.attributes["connection"]``),
``-x url=...``, the ``STASH_URL`` environment variable, or ``sqlalchemy.url`` in the ini.
A SQLite database this creates is owner-only (``0600`` in ``0700`` directories), as
when :meth:`stash.Stash.open` or ``stash migrate`` create it.  On Postgres a migration
holds the advisory lock of :func:`stash.migrate.lock_migrations` until it commits.  A
Postgres stash URL's ``stash_schema`` / ``stash_version_table`` (``stash/placement.py``)
place the tables and the version table; the schema is created if missing.
"""

from __future__ import annotations

import os

import sqlalchemy as sa
from alembic import context

from stash.migrate import create_sqlite_file, lock_migrations, migration_engine
from stash.placement import placement
from stash.schema import VIEWS, exists_on, metadata

config = context.config


def _url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url") or os.environ.get("STASH_URL")
    url = url or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("no database URL: pass -x url=URL or set STASH_URL")
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


def _include_object(
    obj: object, name: str | None, type_: str, reflected: bool, compare_to: object
) -> bool:
    # The views are managed by the revisions themselves.
    return not (type_ == "table" and name in VIEWS)


def _run(connection: sa.Connection) -> None:
    dialect = connection.dialect.name

    def include(obj: object, name: str | None, type_: str, reflected: bool, to: object) -> bool:
        # Indexes of another dialect (ddl_if) are not part of this database's schema.
        return _include_object(obj, name, type_, reflected, to) and exists_on(obj, dialect)

    where = placement(connection.engine.url)
    if where.schema is not None:  # the stash's own schema (stash.placement)
        # In the migration's transaction (Postgres DDL is transactional).
        connection.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{where.schema}"')
    context.configure(
        connection=connection,
        target_metadata=metadata,
        include_object=include,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        version_table=where.version_table,
        version_table_schema=where.schema,
    )
    with context.begin_transaction():
        # Migrations of one database from several processes run one after the other;
        # the later ones read the version only once the earlier committed.
        lock_migrations(connection)
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = sa.engine.make_url(_url())
    if url.get_backend_name() == "sqlite":
        create_sqlite_file(url.database)
    engine = migration_engine(url)
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
