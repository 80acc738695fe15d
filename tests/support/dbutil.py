"""Helpers shared by tests that need a stash URL of a given backend."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import sqlalchemy as sa

from stash.migrate import upgrade

_counter = itertools.count()


def migrate_to_head(url: str) -> None:
    """Run the alembic migrations on a database (what `stash migrate URL` does)."""
    engine = sa.create_engine(url)
    try:
        upgrade(engine)
    finally:
        engine.dispose()


def backend_url(request: pytest.FixtureRequest, backend: str, tmp_path: Any) -> str:
    """A fresh store's URL: memory (named), SQLite (a file in tmp_path) or Postgres (a
    fresh migrated database from the ``postgres_url`` fixture)."""
    if backend == "memory":
        return f"memory://store{next(_counter)}"
    if backend in ("sqlite", "memory-over-sqlite"):
        return f"sqlite:///{tmp_path}/stash{next(_counter)}.db"
    if backend == "postgres":
        url = str(request.getfixturevalue("postgres_url"))
        migrate_to_head(url)
        return url
    raise AssertionError(backend)
