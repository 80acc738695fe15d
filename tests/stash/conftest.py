"""Backends the stash contract suite runs on: each test gets an ``open_stash`` factory
that opens (and reopens) handles on one fresh store of the parametrised backend."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from dbutil import backend_url

from stash import Memory, Stash

BACKENDS = ["memory", "memory-over-sqlite", "sqlite", "postgres"]

OpenStash = Callable[..., Stash]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def stash_url(request: pytest.FixtureRequest, backend: str, tmp_path: Any) -> str:
    return backend_url(request, backend, tmp_path)


@pytest.fixture
def open_stash(backend: str, stash_url: str) -> Iterator[OpenStash]:
    """``open_stash(**kw)`` opens a handle on this test's store; all are closed after."""
    opened: list[Stash] = []

    def _open(**kw: Any) -> Stash:
        kw.setdefault("fenced", False)
        s = Stash.open(stash_url, **kw)
        if backend == "memory-over-sqlite":
            s = Memory(s)
        opened.append(s)
        return s

    yield _open
    for s in opened:
        s.close()


@pytest.fixture
def stash(open_stash: OpenStash) -> Stash:
    return open_stash()
