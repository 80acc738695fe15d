"""A stash records its identity at creation; collection handles carry it and ``append``
refuses a batch whose handle another stash made, even when both stashes have a
collection of that id, name and codecs (the batch would land in some other collection
of this stash).  Runs on every backend, ``Memory(inner)`` over each included."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import ALL_BACKENDS, open_backend
from conftest_helpers import tick
from dbutil import backend_url, migrate_to_head

from stash import Antichain, Memory, Stash, StashError

A = Antichain.from_elem
_n = itertools.count()


@pytest.fixture(params=ALL_BACKENDS)
def two_stores(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Callable[[int], Stash]]:
    """``open_store(i)`` opens a fenced handle on store ``i`` (0 or 1): two distinct
    stores of the parametrised backend."""
    backend: str = request.param
    base = backend.removeprefix("memory-over-")
    urls = [backend_url(request, base, tmp_path)]
    dropped: list[str] = []
    if base == "postgres":
        server = request.getfixturevalue("postgres_server")
        name = f"ident{next(_n)}"
        urls.append(server.create_database(name))
        migrate_to_head(urls[1])
        dropped.append(name)
    else:
        urls.append(backend_url(request, base, tmp_path))
    opened: list[Stash] = []

    def open_store(i: int, **kw: Any) -> Stash:
        s = open_backend(backend, urls[i], **kw)
        opened.append(s)
        return s

    yield open_store
    for s in opened:
        s.close()
    for name in dropped:
        request.getfixturevalue("postgres_server").drop_database(name, force=True)


def test_batch_of_another_stash_is_refused_naming_both(
    two_stores: Callable[..., Stash],
) -> None:
    a, b = two_stores(0), two_stores(1)
    ca = a.collection("orders", key="str", value="int")
    cb = b.collection("orders", key="str", value="int")
    # The same id, name and codecs in both stashes: only the identity tells them apart.
    assert (ca.id, ca.name, ca.codec_names) == (cb.id, cb.name, cb.codec_names)
    tick(a, ca, [("kept", 1, 1)])
    foreign = cb.make_batch(b)  # lower {0}: a's upper is {1}, b's is {0}
    foreign = type(foreign)(cb, A(1), A(2), A(1), 1)
    cb.append_to_batch(foreign, "stray", 7, 1)
    with pytest.raises(StashError) as e:
        a.append([foreign])
    msg = str(e.value)
    assert ca.stash_id and cb.stash_id and ca.stash_id != cb.stash_id
    assert "refused, nothing committed" in msg
    assert f"stash id {ca.stash_id}" in msg and f"stash id {cb.stash_id}" in msg
    assert a.redacted_url in msg and b.redacted_url in msg
    password = re.search(r"://[^:/@]+:([^@]+)@", a.redacted_url)
    assert password is None or password.group(1) == "***"
    # A mix of a good batch and the foreign one commits nothing either.
    good = ca.make_batch(a)
    ca.append_to_batch(good, "also-not", 2, 1)
    with pytest.raises(StashError, match="refused, nothing committed"):
        a.append([good, foreign])
    assert a.upper(ca) == A(1)
    assert a.peek_one(ca) == {"kept": 1}
    assert b.upper(cb) == A(0) and b.iter(cb) == []


def test_handles_of_one_stash_are_interchangeable_across_handles(
    two_stores: Callable[..., Stash],
) -> None:
    """Handles made by any handle of one stash (another open, a ``Memory`` cache over
    it, a reopen, ``collections()``) carry the same identity and append anywhere in it."""
    first = two_stores(0, fenced=False)
    c1 = first.collection("c")
    later = two_stores(0, fenced=False)
    cached = Memory(later)
    assert cached.collections()["c"].stash_id == c1.stash_id
    assert later.collection("c").stash_id == c1.stash_id
    tick(later, c1, [("k", 1, 1)])
    tick(cached, c1, [("j", 2, 1)])
    assert first.peek_one(c1) == {"k": 1, "j": 2}


def test_handle_without_identity_is_refused(two_stores: Callable[..., Stash]) -> None:
    s = two_stores(0)
    c = s.collection("c")
    bare = type(c)(c.id, c.name, c.key_codec, c.value_codec)
    batch = bare.make_batch(s)
    bare.append_to_batch(batch, "k", 1, 1)
    with pytest.raises(StashError, match="carries no stash identity"):
        s.append([batch])
    assert s.upper(c) == A(0)
