"""Protects: a fenced-out stash handle can neither write nor read.

Once a second handle opens the stash with fenced=True, every call of the
first (writes of every kind, and reads) fails with an unrecoverable FenceError and
commits nothing -- on SQLite, Postgres and memory://, and through Memory(inner)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from stash import Antichain, Memory, Stash, StashError, TypedCollection
from stash.errors import FenceError
from tests.support.dbutil import backend_url

pytestmark = pytest.mark.adversarial

_n = itertools.count()


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    return backend_url(request, request.param, tmp_path)


def _snapshot(s: Stash) -> Any:
    out = {}
    for name, c in sorted(s.collections().items()):
        out[name] = (s.since(c), s.upper(c), s.iter(c))
    return out


def _seed(s: Stash) -> None:
    a = s.collection("a")
    s.update_many(a, [(("k1", "v1"), 0, 1), (("k2", "v2"), 1, 1)])
    s.seal(a, Antichain.from_elem(3))
    b = s.collection("b")
    s.seal(b, Antichain.from_elem(1))


WRITES: dict[str, Callable[[Stash], Any]] = {
    "update": lambda s: s.update(s.collection("a"), ("k9", "v9"), 5, 1),
    "update_many": lambda s: s.update_many(s.collection("a"), [(("k9", "v9"), 5, 1)]),
    "update_many_empty": lambda s: s.update_many(s.collection("a"), []),
    "seal": lambda s: s.seal(s.collection("a"), Antichain.from_elem(7)),
    "seal_batch": lambda s: s.seal_batch(
        [(s.collection("a"), Antichain.from_elem(7)), (s.collection("b"), Antichain.from_elem(7))]
    ),
    "compact": lambda s: s.compact(s.collection("a"), Antichain.from_elem(2)),
    "compact_batch": lambda s: s.compact_batch([(s.collection("a"), Antichain.from_elem(2))]),
    "consolidate": lambda s: s.consolidate(s.collection("a")),
    "consolidate_batch": lambda s: s.consolidate_batch([s.collection("a"), s.collection("b")]),
    "append": lambda s: _append(s),
    "create_collection": lambda s: s.collection("brand-new"),
    "typed_upsert": lambda s: TypedCollection("a").upsert(s, [("k1", "zz")]),
    "typed_upsert_key": lambda s: TypedCollection("a").upsert_key(s, "k3", "v3"),
    "typed_insert_without_overwrite": lambda s: TypedCollection("a").insert_without_overwrite(
        s, "k4", "v4"
    ),
    "typed_migrate": lambda s: TypedCollection("a").migrate(s, "json", "json", lambda k, v: (k, v)),
    "confirm_leadership": lambda s: s.confirm_leadership(),
}


def _append(s: Stash) -> None:
    a = s.collection("a")
    batch = a.make_batch(s)
    a.append_to_batch(batch, "k5", "v5", 1)
    s.append([batch])


@pytest.mark.parametrize("op", sorted(WRITES))
@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "Memory"])
def test_fenced_leader_cannot_write(url: str, op: str, wrap: bool) -> None:
    old = Stash.open(url, fenced=True)
    if wrap:
        old = Memory(old)
    try:
        _seed(old)
        _snapshot(old)  # warm any cache
        new = Stash.open(url, fenced=True)
        try:
            before = _snapshot(new)
            with pytest.raises(StashError) as ei:
                WRITES[op](old)
            assert isinstance(ei.value, FenceError) and ei.value.is_unrecoverable(), repr(ei.value)
            assert _snapshot(new) == before
        finally:
            new.close()
    finally:
        old.close()


READS: dict[str, Callable[[Stash], Any]] = {
    "peek_one": lambda s: s.peek_one(s.collection("a")),
    "iter": lambda s: s.iter(s.collection("a")),
    "upper": lambda s: s.upper(s.collection("a")),
    "typed_table": lambda s: TypedCollection("a").table(s),
}


@pytest.mark.parametrize("op", sorted(READS))
@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "Memory"])
def test_fenced_leader_every_later_call_fails(url: str, op: str, wrap: bool) -> None:
    """The stash's fencing rule: 'every later transaction of an older handle fails with
    an unrecoverable StashError'."""
    old = Stash.open(url, fenced=True)
    if wrap:
        old = Memory(old)
    try:
        _seed(old)
        READS[op](old)  # warm any cache
        new = Stash.open(url, fenced=True)
        try:
            with pytest.raises(FenceError):
                READS[op](old)
        finally:
            new.close()
    finally:
        old.close()


def test_table_transaction_commit_by_fenced_leader(url: str) -> None:
    """A leader builds a TableTransaction, is fenced, then commits its pending(): refused,
    nothing committed."""
    old = Stash.open(url, fenced=True)
    try:
        _seed(old)
        t = TypedCollection("a")
        tt = t.table(old, lambda x, y: x == y)
        tt.insert("k7", "v7")
        tt.delete(lambda k, v: k == "k1")
        c = t.get(old)
        batch = c.make_batch(old)
        new = Stash.open(url, fenced=True)
        try:
            before = _snapshot(new)
            for k, v, d in tt.pending():
                c.append_to_batch(batch, k, v, d)
            with pytest.raises(FenceError):
                old.append([batch])
            assert _snapshot(new) == before
        finally:
            new.close()
    finally:
        old.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_fenced_leader_append_of_no_batches_is_refused(
    backend: str, request: pytest.FixtureRequest, tmp_path: Any
) -> None:
    """``append([])`` through a fenced-out leader returns as if it succeeded: it never
    opens a transaction, so the fence is not checked (the fencing rule: every later
    transaction of an older handle fails with an unrecoverable StashError; ``confirm_leadership``
    does fail on the same handle)."""
    url = backend_url(request, backend, tmp_path)
    old = Stash.open(url, fenced=True)
    try:
        _seed(old)
        new = Stash.open(url, fenced=True)
        try:
            with pytest.raises(FenceError):
                old.confirm_leadership()
            with pytest.raises(FenceError):
                old.append([])
        finally:
            new.close()
    finally:
        old.close()
