"""Fixtures shared by the persist tests: a writable SQLite stash in the test's own
directory, and two clients on it (two processes' caches of the same shards).

Each is made afresh for every test and closed after it (the clients before the stash)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from persist import MemoryBlob, PersistClient
from stash import Stash


@pytest.fixture
def sqlite_stash(tmp_path: Path) -> Iterator[Stash]:
    """A writable, unfenced SQLite stash at ``tmp_path / "s.db"``."""
    stash = Stash.open(f"sqlite:///{tmp_path}/s.db", mode="writable", fenced=False)
    try:
        yield stash
    finally:
        stash.close()


@pytest.fixture
def two_clients(sqlite_stash: Stash) -> Iterator[tuple[PersistClient, PersistClient]]:
    """Two clients with compaction off over ``sqlite_stash`` and one ``MemoryBlob``: each
    has its own shard machines and cached versions, as two processes would."""
    blob = MemoryBlob()
    a = PersistClient(sqlite_stash, blob, compaction="off")
    b = PersistClient(sqlite_stash, blob, compaction="off")
    try:
        yield a, b
    finally:
        a.close()
        b.close()
