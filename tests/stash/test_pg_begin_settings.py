"""Each Postgres transaction of a stash starts with its kind's settings, however the
kinds alternate on one connection (a pooled one, which both kinds take turns on;``stash.postgres.PgOps.begin`` sets psycopg's
``isolation_level`` and ``read_only`` only when they change): a write is READ COMMITTED
and read-write, a read a REPEATABLE READ read-only snapshot."""

from __future__ import annotations

from typing import Any

import pytest

from stash import Stash
from tests.support.dbutil import migrate_to_head

_SETTINGS = (
    "SELECT current_setting('transaction_isolation'), current_setting('transaction_read_only')"
)


def _settings(tx: Any) -> tuple[str, str]:
    row = tx._exec(_SETTINGS).fetchone()
    return str(row[0]), str(row[1])


@pytest.mark.parametrize("fenced", [False, True])
def test_reads_and_writes_alternating_keep_their_settings(postgres_url: str, fenced: bool) -> None:
    migrate_to_head(postgres_url)
    with Stash.open(postgres_url, fenced=fenced, pool_size=1) as s:
        s._hold = False  # writes too on the pool's one connection: both kinds alternate on it
        seen = []
        for kind in ["write", "write", "read", "read", "write", "read", "write"]:
            run = s._write if kind == "write" else s._read
            seen.append((kind, run(_settings, codecs=())))
        want = {"write": ("read committed", "off"), "read": ("repeatable read", "on")}
        assert seen == [(kind, want[kind]) for kind, _ in seen]
