"""Where a Postgres stash keeps its tables: a schema of its own and the name of its
alembic version table, so the stash lives beside an application's own tables (and the
application's own ``alembic_version``).

Both come from the stash URL's query: ``postgresql+psycopg://.../db?stash_schema=catalog
&stash_version_table=stash_alembic_version``.  Invariants kept here:

* the parameters are the stash's, never the driver's: :func:`install` takes them out of
  every connection's parameters (``do_connect``) and sets the connection's
  ``search_path`` to the schema instead, so every statement of the stash (and of its
  migrations, trigger and view) names the schema's tables without qualifying them;
* a schema and a version table name are validated identifiers (letters, digits and
  ``_``, not starting with a digit, at most 63 characters): they are data, never SQL;
* the migrations create the schema if missing and keep their version in
  ``<schema>.<version table>`` (:func:`placement` of the connection's engine URL, read by
  ``migrations/env.py`` and :mod:`stash.migrate`), so ``stash migrate URL`` and
  ``Stash.open(URL)`` agree on where the stash is;
* SQLite takes neither parameter (its file is the stash's own).

Source of the idea: alembic's ``version_table`` / ``version_table_schema`` options and
Postgres' ``search_path``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL

from stash.errors import StashError

__all__ = ["SCHEMA_PARAM", "VERSION_TABLE_PARAM", "Placement", "install", "placement"]

SCHEMA_PARAM = "stash_schema"
VERSION_TABLE_PARAM = "stash_version_table"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


@dataclass(frozen=True)
class Placement:
    """``schema`` (``None``: the database's default, ``public``) and ``version_table``."""

    schema: str | None = None
    version_table: str = "alembic_version"


def _param(url: URL, name: str) -> str | None:
    value = url.query.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not _IDENT.fullmatch(value):
        raise StashError(
            f"{name}={value!r} in the stash URL must be an identifier: letters, digits "
            "and _, not starting with a digit, at most 63 characters"
        )
    return value


def placement(url: URL) -> Placement:
    """The :class:`Placement` a stash URL asks for.

    Raises:
        StashError: a parameter is not an identifier, or is given for SQLite.
    """
    schema, table = _param(url, SCHEMA_PARAM), _param(url, VERSION_TABLE_PARAM)
    if (schema or table) and url.get_backend_name() != "postgresql":
        raise StashError(
            f"{SCHEMA_PARAM} and {VERSION_TABLE_PARAM} are Postgres options; a SQLite "
            "stash is a file of its own"
        )
    return Placement(schema, table or "alembic_version")


def install(engine: sa.Engine) -> Placement:
    """Make every new connection of ``engine`` (a Postgres engine made from a stash URL)
    drop the stash's URL parameters and search the stash's schema; return the
    placement."""
    where = placement(engine.url)

    @sa.event.listens_for(engine, "do_connect")
    def _connect(dialect: Any, rec: Any, cargs: Any, cparams: dict[str, Any]) -> None:
        cparams.pop(SCHEMA_PARAM, None)
        cparams.pop(VERSION_TABLE_PARAM, None)
        if where.schema is not None:
            options = str(cparams.get("options", "")).strip()
            cparams["options"] = f"{options} -c search_path={where.schema}".strip()

    return where


def driver_url(url: URL) -> URL:
    """``url`` without the stash's parameters (for a driver connection of its own)."""
    return url.difference_update_query([SCHEMA_PARAM, VERSION_TABLE_PARAM])
