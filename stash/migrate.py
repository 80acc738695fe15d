"""Running the alembic migrations of the stash schema from code and the CLI.

Invariants kept here: the only way the schema is created or changed is an alembic
revision from ``migrations/versions``; :func:`current_revision` reads the version a
database is at without changing it.
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

import migrations

MIGRATIONS_DIR = Path(migrations.__file__).resolve().parent


def alembic_config(connection: sa.Connection | None = None) -> Config:
    """An alembic ``Config`` for ``migrations/`` (optionally bound to a connection)."""
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


def current_revision(connection: sa.Connection) -> str | None:
    """The revision a database is at, or ``None`` if alembic never ran on it."""
    return MigrationContext.configure(connection).get_current_revision()


def upgrade(engine: sa.Engine, revision: str = "head") -> None:
    """Bring the database behind ``engine`` to ``revision`` (default the head)."""
    with engine.begin() as conn:
        command.upgrade(alembic_config(conn), revision)


def downgrade(engine: sa.Engine, revision: str) -> None:
    """Take the database behind ``engine`` down to ``revision`` (``"base"`` = empty)."""
    with engine.begin() as conn:
        command.downgrade(alembic_config(conn), revision)
