"""Backends the stash contract suite runs on: each test gets an ``open_stash`` factory
that opens (and reopens) handles on one fresh store of the parametrised backend."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from stash import Memory, Stash
from tests.support.dbutil import backend_url

BACKENDS = ["memory", "memory-over-sqlite", "sqlite", "postgres"]
#: Every backend, and ``Memory(inner)`` over each (for tests of what every handle must do,
#: e.g. be shared between threads; the cache is on only over a fenced writable handle).
ALL_BACKENDS = [
    "memory",
    "sqlite",
    "postgres",
    "memory-over-memory",
    "memory-over-sqlite",
    "memory-over-postgres",
]

OpenStash = Callable[..., Stash]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def stash_url(request: pytest.FixtureRequest, backend: str, tmp_path: Any) -> str:
    return backend_url(request, backend.removeprefix("memory-over-"), tmp_path)


def open_backend(backend: str, url: str, **kw: Any) -> Stash:
    """Open ``url``; wrap it in ``Memory`` for the ``memory-over-*`` backends."""
    s = Stash.open(url, **kw)
    if backend.startswith("memory-over-"):
        s = Memory(s)
    return s


@pytest.fixture(params=ALL_BACKENDS)
def any_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def open_any(
    request: pytest.FixtureRequest, any_backend: str, tmp_path: Any
) -> Iterator[OpenStash]:
    """Like ``open_stash``, over :data:`ALL_BACKENDS`; handles are fenced unless told."""
    url = backend_url(request, any_backend.removeprefix("memory-over-"), tmp_path)
    opened: list[Stash] = []

    def _open(**kw: Any) -> Stash:
        s = open_backend(any_backend, url, **kw)
        opened.append(s)
        return s

    yield _open
    for s in opened:
        s.close()


@pytest.fixture
def open_stash(backend: str, stash_url: str) -> Iterator[OpenStash]:
    """``open_stash(**kw)`` opens a handle on this test's store; all are closed after."""
    opened: list[Stash] = []

    def _open(**kw: Any) -> Stash:
        kw.setdefault("fenced", False)
        s = open_backend(backend, stash_url, **kw)
        opened.append(s)
        return s

    yield _open
    for s in opened:
        s.close()


@pytest.fixture
def stash(open_stash: OpenStash) -> Stash:
    return open_stash()
