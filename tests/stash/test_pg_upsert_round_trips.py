"""A one-key ``upsert_key`` / ``insert_without_overwrite`` on Postgres waits for the
server three times, as a SQLAlchemy Core upsert does (``BEGIN`` + upsert + ``COMMIT``):
its reads (the lock by name, the key's sealed values, the retention setting) go out in
one pipeline with the ``BEGIN``, then the write, then ``COMMIT``
(``PgTxn.prefetch_key``).  The reads answered from the pipeline must be what separate
statements would have read: fencing, JSON ``null`` values, multiplicities, retention."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from stash import FenceError, Stash, StashError, TypedCollection
from tests.support.dbutil import migrate_to_head


@pytest.fixture
def url(postgres_url: str) -> str:
    migrate_to_head(postgres_url)
    return postgres_url


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Each statement that made the client wait for the server (outside a pipeline),
    and each COMMIT."""
    seen: list[str] = []
    execute, commit = psycopg.Cursor.execute, psycopg.Connection.commit

    def spy_execute(self: Any, query: Any, *a: Any, **k: Any) -> Any:
        if self.connection._pipeline is None:
            seen.append(str(query)[:40])
        return execute(self, query, *a, **k)

    def spy_commit(self: Any) -> None:
        seen.append("COMMIT")
        commit(self)

    monkeypatch.setattr(psycopg.Cursor, "execute", spy_execute)
    monkeypatch.setattr(psycopg.Connection, "commit", spy_commit)
    yield seen


@pytest.mark.parametrize("fenced", [False, True])
def test_a_one_key_upsert_waits_for_the_server_three_times(
    url: str, waits: list[str], fenced: bool
) -> None:
    with Stash.open(url, fenced=fenced) as s:
        tc: TypedCollection[int, Any] = TypedCollection("items", "int", "json")
        tc.upsert(s, [(i, {"n": i}) for i in range(10)])
        for i in range(3):
            waits.clear()
            tc.upsert_key(s, 5, {"n": 100 + i})
            # One pipeline (BEGIN and the reads), the write, COMMIT.
            assert len(waits) == 2 and waits[-1] == "COMMIT", waits
        assert tc.peek_one(s)[5] == {"n": 102}


def test_read_ahead_answers_agree_with_the_plain_reads(url: str) -> None:
    with Stash.open(url, fenced=False) as s:
        tc: TypedCollection[str, Any] = TypedCollection("vals", "str", "json")
        c = tc.get(s)
        tc.upsert_key(s, "a", None)  # a stored JSON null is a value
        assert tc.insert_without_overwrite(s, "a", 1) is None
        tc.upsert_key(s, "a", None)  # unchanged: writes nothing
        upper = s.upper(c)
        tc.upsert_key(s, "a", None)
        assert s.upper(c) == upper
        tc.upsert_key(s, "a", 2)
        assert tc.peek_one(s) == {"a": 2}
        # The retention setting is read ahead too.
        s.set_retention(c, keep_times=None)
        tc.upsert_key(s, "b", 3)
        since = s.since(c)
        tc.upsert_key(s, "b", 4)
        assert s.since(c) == since  # held back
        # A key holding two values is refused, as by the plain read.
        batch = c.make_batch(s)
        c.append_to_batch(batch, "z", 1, 1)
        c.append_to_batch(batch, "z", 2, 1)
        s.append([batch])
        with pytest.raises(StashError, match="multiple values unexpected"):
            tc.upsert_key(s, "z", 3)


def test_a_fenced_out_upsert_fails_and_writes_nothing(url: str) -> None:
    old = Stash.open(url)
    tc: TypedCollection[str, int] = TypedCollection("f", "str", "int")
    tc.upsert_key(old, "a", 1)
    with Stash.open(url) as new:
        with pytest.raises(FenceError):
            tc.upsert_key(old, "a", 2)
        assert tc.peek_one(new) == {"a": 1}
    old.close()
