"""A SQLite append merges its rows with the stored rows of their keys before writing
anything: a retraction and the row it cancels are never written only to be deleted
(before, an update of a 4 KB persist state entry wrote its 4 KB retraction to the WAL
and freed it again in the same transaction)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

import stash.sql_txn as stash_sql
from stash import Antichain, AppendBatch, Stash, StashError

A = Antichain.from_elem


def _row_changes(s: Stash, fn: Any) -> int:
    """Rows inserted, updated or deleted by ``fn()`` on the stash's connections
    (``sqlite3.Connection.total_changes``): the pooled ones and the one it holds."""
    seen: dict[int, sqlite3.Connection] = {}

    def checkout(dbapi_conn: sqlite3.Connection, *_: Any) -> None:
        seen.setdefault(id(dbapi_conn), dbapi_conn)

    engine = s.engine  # type: ignore[attr-defined]
    sa.event.listen(engine, "checkout", checkout)
    try:
        fn()  # the first call records the pooled connection
        held = getattr(s, "_held", None)  # the connection the handle holds for writes
        if held is not None:
            seen.setdefault(id(held.driver_connection), held.driver_connection)
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


_entry = st.tuples(
    st.sampled_from(["a", "b", "c"]),
    st.integers(0, 2),
    st.integers(0, 3),  # time offset from the batch lower
    st.sampled_from([-2, -1, 1, 2, 2**62]),
)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(_entry, max_size=5), st.integers(0, 2)), max_size=8))
def test_taking_the_rows_out_leaves_what_reading_them_leaves(
    tmp_path_factory: Any, batches: list[tuple[list[tuple[str, int, int, int]], int]]
) -> None:
    """The append consolidation that deletes a touched key's rows with RETURNING leaves
    the same physical rows (and refuses the same appends) as the one that reads them
    first and deletes by rowid."""
    results = []
    for returning in (True, False):
        path = tmp_path_factory.mktemp("ret") / "s.db"
        old = stash_sql._HAS_RETURNING
        stash_sql._HAS_RETURNING = returning
        try:
            with Stash.open(f"sqlite:///{path}", fenced=False) as s:
                c = s.collection("c", key="str", value="int")
                outcomes = []
                t = 0
                for entries, lag in batches:
                    b = AppendBatch(c, A(t), A(t + 4), A(max(0, t + 4 - lag)), t)
                    for k, v, dt, d in entries:
                        kv = (c.key_codec.encode(k), c.value_codec.encode(v))
                        b.entries.append((kv, t + dt, d))
                    try:
                        s.append([b])
                        t += 4
                        outcomes.append("ok")
                    except StashError as e:
                        outcomes.append(str(e))
            with sqlite3.connect(path) as db:
                rows = sorted(db.execute("SELECT key, value, time, diff FROM data").fetchall())
        finally:
            stash_sql._HAS_RETURNING = old
        results.append((outcomes, rows))
    assert results[0] == results[1]


_lone = st.tuples(
    st.sampled_from(["a", "b", "c", "d", "e"]),
    st.integers(0, 1),
    st.integers(0, 3),  # time offset from the batch lower
    st.sampled_from([0, -1, 1, 3, 2**63 - 1, -(2**63)]),
)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(_lone, min_size=1, max_size=2), st.integers(0, 4)),
        max_size=10,
    )
)
def test_a_fresh_key_inserted_alone_leaves_what_consolidation_leaves(
    tmp_path_factory: Any, batches: list[tuple[list[tuple[str, int, int, int]], int]]
) -> None:
    """Differential: the one-entry append of a key with no stored row, written by one
    conditional INSERT (``SqlTxn._insert_fresh``), leaves the same physical rows, and
    refuses the same appends, as the general consolidation (the key's rows taken out,
    merged with the entry, written back), over keys fresh and stored, zero and extreme
    diffs, and times before and past the since."""
    results = []
    for fast in (True, False):
        path = tmp_path_factory.mktemp("fresh") / "s.db"
        original = stash_sql.SqlTxn._insert_fresh
        if not fast:
            stash_sql.SqlTxn._insert_fresh = lambda *_: False  # type: ignore[method-assign]
        try:
            with Stash.open(f"sqlite:///{path}", fenced=True) as s:
                c = s.collection("c", key="str", value="int")
                outcomes = []
                t = 0
                for entries, lag in batches:
                    b = AppendBatch(c, A(t), A(t + 4), A(max(0, t + 4 - lag)), t)
                    for k, v, dt, d in entries:
                        kv = (c.key_codec.encode(k), c.value_codec.encode(v))
                        b.entries.append((kv, t + dt, d))
                    try:
                        s.append([b])
                        t += 4
                        outcomes.append("ok")
                    except StashError as e:
                        outcomes.append(str(e))
            with sqlite3.connect(path) as db:
                rows = sorted(db.execute("SELECT key, value, time, diff FROM data").fetchall())
        finally:
            stash_sql.SqlTxn._insert_fresh = original  # type: ignore[method-assign]
        results.append((outcomes, rows))
    assert results[0] == results[1]
