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

from stash import Antichain, Memory, Stash, StashError
from tests.stash.conftest import ALL_BACKENDS, open_backend
from tests.stash.conftest_helpers import tick
from tests.support.dbutil import backend_url, migrate_to_head

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


def test_savepoint_handle_is_refused_by_the_real_stash(
    two_stores: Callable[..., Stash],
) -> None:
    """A savepoint handle's copy of the stash has an identity of its own: a batch made
    for a collection that exists only in the savepoint is refused by the real stash, even
    when the real stash later made a collection of the same id and codecs (it was
    appended into that collection)."""
    main = two_stores(0, fenced=False)
    sp = two_stores(0, mode="savepoint")
    a = sp.collection("a")  # exists only in the savepoint
    b = main.collection("b")  # made on the real stash afterwards: same id and codecs
    assert (a.id, a.codec_names) == (b.id, b.codec_names)
    assert a.stash_id != b.stash_id
    batch = a.make_batch(sp)
    a.append_to_batch(batch, "k", "v", 1)
    with pytest.raises(StashError, match="refused, nothing committed") as e:
        main.append([batch])
    assert f"stash id {a.stash_id}" in str(e.value) and "(a savepoint)" in str(e.value)
    for write in (
        lambda: main.update(a, ("k", "v"), 0, 1),
        lambda: main.seal(a, A(5)),
        lambda: main.consolidate(a),
    ):
        with pytest.raises(StashError, match="refused, nothing committed"):
            write()
    assert main.upper(b) == A(0) and main.iter(b) == []
    sp.append([batch])  # the savepoint's own handle writes the savepoint
    assert sp.peek_one(a) == {"k": "v"}


def test_real_handles_write_through_a_savepoint_by_id_and_name(
    two_stores: Callable[..., Stash],
) -> None:
    """A savepoint takes the real stash's handles of the collections it copied; a real
    handle whose id names another collection in the savepoint is refused."""
    main = two_stores(0, fenced=False)
    c = main.collection("c")
    tick(main, c, [("k", 1, 1)])
    sp = two_stores(0, mode="savepoint")
    tick(sp, c, [("j", 2, 1)])
    sp.update(c, ("u", 3), 2, 1)
    sp.seal(c, A(3))
    sp.compact(c, A(2))
    assert sp.peek_one(sp.collection("c")) == {"k": 1, "j": 2, "u": 3}
    late = main.collection("late")  # after the savepoint opened
    mine = sp.collection("savepoint-only")
    assert late.id == mine.id
    with pytest.raises(StashError, match="refused, nothing committed.*savepoint-only"):
        sp.update(late, ("x", 1), 0, 1)
    with pytest.raises(StashError, match="refused, nothing committed"):
        tick(sp, late, [("x", 1, 1)])
    assert sp.upper(mine) == A(0) and sp.iter(mine) == []
    assert main.peek_one(c) == {"k": 1}


def test_every_write_refuses_another_stash_handle(two_stores: Callable[..., Stash]) -> None:
    """``update``, ``update_many``, ``seal``, ``compact``, ``consolidate`` and their
    batch forms check a handle's identity as ``append`` does (they wrote into this
    stash's collection of the same id)."""
    a, b = two_stores(0), two_stores(1)
    ca = a.collection("orders", key="str", value="int")
    cb = b.collection("orders", key="str", value="int")
    tick(a, ca, [("kept", 1, 1)])
    writes: list[Callable[[], None]] = [
        lambda: a.update(cb, ("stray", 7), 1, 1),
        lambda: a.update_many(cb, [(("stray", 7), 1, 1)]),
        lambda: a.seal(cb, A(5)),
        lambda: a.compact(cb, A(1)),
        lambda: a.consolidate(cb),
        lambda: a.seal_batch([(ca, A(4)), (cb, A(5))]),
        lambda: a.compact_batch([(ca, A(1)), (cb, A(1))]),
    ]
    for write in writes:
        with pytest.raises(StashError, match="refused, nothing committed") as e:
            write()
        assert f"stash id {cb.stash_id}" in str(e.value) and b.redacted_url in str(e.value)
    assert (a.since(ca), a.upper(ca)) == (A(0), A(1))
    assert a.iter(ca) == [(("kept", 1), 0, 1)]
