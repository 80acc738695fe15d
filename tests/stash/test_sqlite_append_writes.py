"""A SQLite append merges its rows with the stored rows of their keys before writing
anything: a retraction and the row it cancels are never written only to be deleted
(issue 18: an update of a 4 KB persist state entry wrote its 4 KB retraction to the WAL
and freed it again in the same transaction)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from stash import Antichain, AppendBatch, Stash

A = Antichain.from_elem


def _row_changes(s: Stash, fn: Any) -> int:
    """Rows inserted, updated or deleted by ``fn()`` on the stash's connections
    (``sqlite3.Connection.total_changes``)."""
    seen: dict[int, sqlite3.Connection] = {}

    def checkout(dbapi_conn: sqlite3.Connection, *_: Any) -> None:
        seen.setdefault(id(dbapi_conn), dbapi_conn)

    engine = s.engine  # type: ignore[attr-defined]
    sa.event.listen(engine, "checkout", checkout)
    try:
        fn()  # the first call records the pooled connection
        before = {k: c.total_changes for k, c in seen.items()}
        fn()
        return sum(c.total_changes - before.get(k, 0) for k, c in seen.items())
    finally:
        sa.event.remove(engine, "checkout", checkout)


def test_an_update_writes_the_new_row_and_deletes_the_old_one_only(tmp_path: Path) -> None:
    with Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False) as s:
        c = s.collection("c", key="str", value="json")
        state = {"t": 0, "value": {"n": 0}}

        def update() -> None:
            t, old = state["t"], state["value"]
            new = {"n": int(old["n"]) + 1, "pad": "x" * 5000}  # type: ignore[index]
            b = AppendBatch(c, A(t), A(t + 1), A(t), t)
            if t:
                c.append_to_batch(b, "k", old, -1)
            c.append_to_batch(b, "k", new, 1)
            s.append([b])
            state["t"], state["value"] = t + 1, new

        # One row inserted, one deleted, the upper and the since updated: a retraction
        # written and then deleted would make 6.
        assert _row_changes(s, update) == 4
        assert s.peek(c) == [("k", state["value"], 1)]
        with sqlite3.connect(tmp_path / "s.db") as db:
            rows = db.execute("SELECT key, diff FROM data WHERE collection_id = ?", (c.id,))
            assert rows.fetchall() == [('"k"', 1)]
