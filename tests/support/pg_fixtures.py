"""Pytest fixtures giving tests a real PostgreSQL server (load with `pytest_plugins`).

Fixtures:
- `postgres_server` (session): one throwaway `pgserver.PostgresServer` per test session
  (per xdist worker), started on first use and cleaned up at the end of the session.
- `postgres_url` (function): a fresh, empty database per test; returns its SQLAlchemy URL
  string `postgresql+psycopg://user:password@127.0.0.1:port/dbname`.

Invariants:
- Never a silent skip: when no server can be had (binaries missing even after
  `scripts/ensure_postgres.sh`, or the server does not start), the fixture fails the test
  if the environment variable `CI` is set (to anything but "", "0", "false", "no"), and
  otherwise skips it with the reason. Other errors propagate as test errors.
- Every test leaves the shared server running: if a test stopped it (a restart or crash
  test), `postgres_url`'s teardown starts it again, then drops the test's database with
  `WITH (FORCE)` so leftover connections cannot keep it alive.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import NoReturn

import pytest

from tests.support.pgserver import PostgresServer, PostgresUnavailable, find_postgres_bin_dir

__all__ = ["in_ci", "postgres_server", "postgres_url", "require_postgres_server"]

ENSURE_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ensure_postgres.sh"

_db_counter = count(1)


def in_ci() -> bool:
    """True when the environment variable CI is set to a truthy value."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _unavailable(reason: str) -> NoReturn:
    """Fail under CI, skip otherwise; never returns."""
    if in_ci():
        pytest.fail(f"PostgreSQL is required under CI but unavailable: {reason}", pytrace=False)
    pytest.skip(f"PostgreSQL unavailable (not CI, so skipped): {reason}")


def _ensure_binaries() -> str | None:
    """Find the server binaries, running scripts/ensure_postgres.sh once if they are missing.

    Returns None when found, else the reason they could not be had.
    """
    if find_postgres_bin_dir() is not None:
        return None
    if not ENSURE_SCRIPT.exists():
        return f"binaries initdb, pg_ctl, postgres not found and {ENSURE_SCRIPT} is missing"
    try:
        proc = subprocess.run(
            ["bash", str(ENSURE_SCRIPT)],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"binaries not found and {ENSURE_SCRIPT.name} could not run: {exc}"
    if proc.returncode != 0 or find_postgres_bin_dir() is None:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-10:])
        return f"binaries not found; {ENSURE_SCRIPT.name} exited {proc.returncode}: {tail}"
    return None


def require_postgres_server() -> PostgresServer:
    """Start a server, installing binaries if needed; on failure fail (CI) or skip.

    For tests that need a private server (e.g. crash tests that must not disturb the
    session's server); the caller must `cleanup()` it.
    """
    reason = _ensure_binaries()
    if reason is not None:
        _unavailable(reason)
    try:
        return PostgresServer()
    except PostgresUnavailable as exc:
        _unavailable(str(exc))


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One throwaway PostgreSQL server for the whole test session (see module docstring)."""
    server = require_postgres_server()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer, request: pytest.FixtureRequest) -> Iterator[str]:
    """A new empty database on the session server; yields its SQLAlchemy URL (str)."""
    if not postgres_server.is_running():
        postgres_server.start()
    slug = re.sub(r"[^a-z0-9_]+", "_", request.node.name.lower()).strip("_")[:40]
    name = f"t{next(_db_counter)}_{slug}".rstrip("_")
    url = postgres_server.create_database(name)
    try:
        yield url
    finally:
        if not postgres_server.is_running():
            postgres_server.start()
        postgres_server.drop_database(name, force=True)
