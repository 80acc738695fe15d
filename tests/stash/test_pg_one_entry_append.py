"""A one-entry append on Postgres sends its collection id, row and consolidated key as
scalars, not arrays (``stash.pg_statements``: ``_LOCK_ONE``, ``_FLUSH_ONE_SQL``), and
leaves the same rows as the array statements: a retraction consolidates its key away, a
new value of a stored key is kept beside it, a sum beyond i64 is refused."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from stash import AppendBatch, Stash, StashError
from stash.antichain import Antichain
from tests.support.dbutil import migrate_to_head

A = Antichain.from_elem


@pytest.fixture
def url(postgres_url: str) -> str:
    migrate_to_head(postgres_url)
    return postgres_url


def _append(s: Stash, c: Any, t: int, entries: list[tuple[Any, Any, int]], since: int) -> None:
    b = AppendBatch(c, A(t), A(t + 1), A(since), t)
    for k, v, d in entries:
        c.append_to_batch(b, k, v, d)
    s.append([b])


@pytest.mark.parametrize("fenced", [False, True])
def test_one_entry_append_sends_no_array(
    url: str, fenced: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails on the old code (the lock's ids and the row's columns went as arrays)."""
    with Stash.open(url, fenced=fenced) as s:
        c = s.collection("c", key="str", value="int")
        _append(s, c, 0, [("a", 1, 1)], 0)
        lists: list[str] = []
        execute = psycopg.Cursor.execute

        def spy(self: Any, query: Any, params: Any = None, *a: Any, **k: Any) -> Any:
            if isinstance(params, dict):
                lists.extend(n for n, v in params.items() if isinstance(v, list))
            return execute(self, query, params, *a, **k)

        monkeypatch.setattr(psycopg.Cursor, "execute", spy)
        _append(s, c, 1, [("b", 2, 1)], 1)
        _append(s, c, 2, [("a", 1, -1)], 2)  # a retraction: consolidated away
        _append(s, c, 3, [("b", 3, 1)], 2)  # a second value of a stored key: kept
        assert lists == []
        _append(s, c, 4, [("c", 1, 1), ("d", 1, 1)], 2)  # two rows: the array statement
        assert lists
        monkeypatch.undo()
        assert s.peek(c) == [("b", 2, 1), ("b", 3, 1), ("c", 1, 1), ("d", 1, 1)]
        i64 = 2**63 - 1
        _append(s, c, 5, [("big", 0, i64)], 5)
        with pytest.raises(StashError, match="diff sums must fit in i64"):
            _append(s, c, 6, [("big", 0, 1)], 6)
        assert ("big", 0, i64) in s.peek(c)
