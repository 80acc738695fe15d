"""The statements of a fenced SQLite write: the fence is checked by the write's first
read of a collection's frontiers (one statement reads both), or inside a log write's
conditional INSERT, not by a statement of its own; a fenced-out handle still gets
FenceError before any other error, and commits nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from stash import AppendBatch, AppendLowerMismatch, Stash
from stash import logs as L
from stash.antichain import Antichain
from stash.errors import FenceError
from stash.sql import SqlStash

A = Antichain.from_elem


def _batch(c: object, t: int) -> AppendBatch:
    b = AppendBatch(c, A(t), A(t + 1), A(t), t)  # type: ignore[arg-type]
    c.append_to_batch(b, t, t, 1)  # type: ignore[attr-defined]
    return b


def _traced(s: Stash) -> list[str]:
    assert isinstance(s, SqlStash) and s._held is not None
    seen: list[str] = []
    s._held.driver_connection.set_trace_callback(lambda q: seen.append(q.split()[0]))
    return seen


def test_fenced_append_and_log_write_statements(tmp_path: Path) -> None:
    """Fails on the old code: a fence SELECT of its own before each write (8 statements
    for the append, 4 for the log write); then (also failing on the old code) the
    one-entry append of a fresh key took the key's rows out (DELETE ... RETURNING, none)
    before inserting its row: 7 statements."""
    with Stash.open(f"sqlite:///{tmp_path}/s.db", fenced=True) as s:
        c = s.collection("c", key="int", value="int")
        s.append([_batch(c, 0)])
        L.write(s, [L.LogEntry("l", None, 0, "a")])
        seen = _traced(s)
        s.append([_batch(c, 1)])
        # frontiers + fence, upper, since, the row (on the condition that its key has
        # no stored row: nothing to consolidate it with)
        assert seen == ["BEGIN", "SELECT", "UPDATE", "UPDATE", "INSERT", "COMMIT"]
        seen.clear()
        L.write(s, [L.LogEntry("l", 0, 1, "b")])
        assert seen == ["BEGIN", "INSERT", "COMMIT"]
        assert s.peek(c) == [(0, 0, 1), (1, 1, 1)]


def test_a_fenced_out_handle_gets_the_fence_error_first(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    with Stash.open(url, fenced=True) as old:
        c = old.collection("c", key="int", value="int")
        old.append([_batch(c, 0)])
        L.write(old, [L.LogEntry("l", None, 0, "a")])
        with pytest.raises(AppendLowerMismatch):
            old.append([_batch(c, 5)])  # not fenced out: the stale lower is the error
        with pytest.raises(L.LogRaceLost):
            L.write(old, [L.LogEntry("l", None, 0, "again")])
        with Stash.open(url, fenced=True) as new:
            for write in (
                lambda: old.append([_batch(c, 1)]),
                lambda: old.append([_batch(c, 5)]),  # stale lower too
                lambda: L.write(old, [L.LogEntry("l", 0, 1, "b")]),
                lambda: L.write(old, [L.LogEntry("l", None, 0, "b")]),  # stale head too
                lambda: old.append([_batch(c, 1), L.LogEntry("l", 0, 1, "b")]),
                lambda: old.collection("made-by-a-fenced-out-handle"),
            ):
                with pytest.raises(FenceError):
                    write()
            assert new.upper(c) == A(1)
            assert [r.data for r in L.scan(new, "l")] == ["a"]
            assert list(new.collections()) == ["c"]


def test_an_entry_of_a_stored_key_is_consolidated_with_its_rows(tmp_path: Path) -> None:
    """A one-entry append to a key with stored rows: the conditional INSERT writes
    nothing, the key's rows are taken out and written back consolidated with it."""
    with Stash.open(f"sqlite:///{tmp_path}/s.db", fenced=True) as s:
        c = s.collection("c", key="int", value="int")
        s.append([_batch(c, 0)])
        seen = _traced(s)
        b = AppendBatch(c, A(1), A(2), A(1), 1)
        c.append_to_batch(b, 0, 0, -1)  # retracts the row of key 0 written at time 0
        s.append([b])
        assert seen == ["BEGIN", "SELECT", "UPDATE", "UPDATE", "INSERT", "DELETE", "COMMIT"]
        assert s.peek(c) == []
        b = AppendBatch(c, A(2), A(3), A(2), 2)
        c.append_to_batch(b, 0, 7, 2)
        s.append([b])
        b = AppendBatch(c, A(3), A(4), A(3), 3)
        c.append_to_batch(b, 0, 7, 1)
        s.append([b])  # the rows of key 0 at time 2 and 3, both at since 3: one row
        assert s._run(False, lambda tx: tx.rows(c.id)) == [("0", "7", 3, 3)]  # type: ignore[attr-defined]
