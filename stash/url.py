"""Opening a stash from a URL: scheme dispatch, URL validation, password hiding.

Invariants kept here: a malformed or unknown URL fails with a :class:`StashError` naming
the rule; no message or repr ever shows a password (:func:`safe_url`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import URL

from stash.errors import StashError

if TYPE_CHECKING:
    from stash.base import Mode, Stash


def parse_url(url: str) -> URL:
    """Parse a stash URL with SQLAlchemy's URL grammar.

    Raises:
        StashError: not a str, or not a URL of the form ``scheme://...``.
    """
    if not isinstance(url, str) or "://" not in url:
        raise StashError(
            f"malformed stash URL {safe_url(url)!r}: expected memory://, "
            "sqlite:///path or postgresql+psycopg://user@host/db"
        )
    try:
        return sa.engine.make_url(url)
    except Exception:
        raise StashError(f"malformed stash URL {safe_url(url)!r}") from None


def safe_url(url: object) -> str:
    """The URL as text with any password replaced by ``***``."""
    if isinstance(url, URL):
        return url.render_as_string(hide_password=True)
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:
        # Hide anything between "//user:" and "@" even if the URL does not parse.
        head, sep, rest = url.partition("://")
        if sep and "@" in rest:
            cred, _, host = rest.rpartition("@")
            user = cred.split(":", 1)[0]
            return f"{head}://{user}:***@{host}"
        return url


def open_url(url: str, *, mode: Mode, fenced: bool, **options: Any) -> Stash:
    """Open the stash behind ``url`` (see :meth:`stash.base.Stash.open`)."""
    u = parse_url(url)
    backend = u.get_backend_name()
    if backend == "memory":
        from stash.memory import MemoryStash

        name = (u.host or "") + (("/" + u.database) if u.database else "")
        return MemoryStash(name, mode=mode, fenced=fenced)
    if backend == "sqlite":
        from stash.sql import SqlStash

        if not u.database or u.database == ":memory:":
            raise StashError(
                "sqlite stash URL needs a file path (sqlite:///path/to/stash.db); "
                "use memory:// for an in-memory stash"
            )
        return SqlStash(u, mode=mode, fenced=fenced, **options)
    if backend == "postgresql":
        from stash.sql import SqlStash

        if u.get_driver_name() not in ("psycopg", "psycopg2", "") and u.drivername != "postgresql":
            raise StashError(
                f"unsupported postgres driver in {safe_url(u)!r}; use postgresql+psycopg"
            )
        return SqlStash(u.set(drivername="postgresql+psycopg"), mode=mode, fenced=fenced, **options)
    raise StashError(
        f"unknown stash URL scheme {u.drivername!r} in {safe_url(u)!r}: expected memory, "
        "sqlite or postgresql+psycopg"
    )
