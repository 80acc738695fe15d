"""Closing a SQL stash handle: in a forked child, and while another thread writes.

A process forked from one holding a SQL stash handle (``multiprocessing`` with the
fork start method, Spark's forked Python workers) may close its copy of the handle, as
any ``with Stash.open(...)`` block or cleanup does, without ever having used it: that
close must leave the parent's connections alone (``SqlStash._close`` in a child: the
held and pooled connections are the parent's sockets and SQLite handles).

Source of the rule: SQLAlchemy's "Using Connection Pools with Multiprocessing or
os.fork()" (a child calls ``Engine.dispose(close=False)``, never closing the parent's
connections).

A write racing ``close`` in another thread either ends before ``close`` returns (the
held connection's, which ``close`` waits for) or fails with "closed", committing
nothing and leaving no connection open."""

from __future__ import annotations

import os
import threading

import pytest

from stash import logs as L
from stash.sql import SqlStash
from tests.stash.conftest import OpenStash

pytestmark = pytest.mark.parametrize("backend", ["sqlite", "postgres"])


def _e(name: str, expected: int | None, data: str) -> L.LogEntry:
    return L.LogEntry(name, expected, 0 if expected is None else expected + 1, data)


def _in_child(fn: object) -> int:
    """Run ``fn()`` in a forked child that leaves without any cleanup; its exit code
    (``0``: ``fn`` returned; ``3``: it raised; ``4``: it did not return within 20 s)."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            done = threading.Event()

            def run() -> None:
                fn()  # type: ignore[operator]
                done.set()

            t = threading.Thread(target=run, daemon=True)
            t.start()
            code = 0 if done.wait(20) else 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("busy", [False, True])
def test_a_forked_child_closing_its_copy_leaves_the_parents_connections(
    open_stash: OpenStash, backend: str, busy: bool
) -> None:
    """The child closes the handle it inherited (never having used it): the parent's
    held connection is still its own and still works (no reconnect), and the parent's
    pooled connections too.  ``busy``: another thread of the parent was writing on the
    held connection at the fork (its lock, copied locked, is never released in the
    child): the child's close does not wait for it forever.  Failed on the old code: the
    child's close gave the parent's held connection back to its copy of the pool (a
    ``ROLLBACK`` on the parent's socket) and disposed of the pool, closing the parent's
    Postgres connections (the server ended their sessions); with ``busy`` it hung."""
    s = open_stash(fenced=False)
    assert isinstance(s, SqlStash)
    L.write(s, [_e("p", None, "p0")])
    held = s._held
    assert held is not None
    dbc = held.driver_connection
    backend_pid = dbc.info.backend_pid if backend == "postgres" else None
    if busy:
        s._held_lock.acquire()
    try:
        code = _in_child(s.close)
    finally:
        if busy:
            s._held_lock.release()
    assert code == 0, f"the child's close {'hung' if code == 4 else 'failed'} (exit {code})"
    # The parent's held connection is untouched: a statement on it works, and the next
    # write runs on it (no reconnect after a lost connection).
    cur = dbc.cursor()
    cur.execute("SELECT 1")
    assert cur.fetchall() == [(1,)]
    cur.close()
    dbc.rollback()
    L.write(s, [_e("p", 0, "p1")])
    assert s._held is held
    if backend == "postgres":
        assert s._held.driver_connection.info.backend_pid == backend_pid
    assert [x.data for x in L.scan(s, "p")] == ["p0", "p1"]


def test_a_write_racing_close_on_a_pooled_connection_commits_nothing_after_it(
    open_stash: OpenStash, backend: str
) -> None:
    """A thread's write that found the held connection busy and was checking out a
    pooled one while another thread closed the handle fails with "closed", commits
    nothing, and leaves no connection open behind the closed handle.  Failed on the old
    code: the write committed after ``close`` returned, on a connection of the disposed
    pool that stayed open."""
    import sqlalchemy as sa

    from stash import Stash, StashError

    s = open_stash(fenced=False)
    assert isinstance(s, SqlStash)
    L.write(s, [_e("p", None, "p0")])  # the held connection exists
    entered, go = threading.Event(), threading.Event()
    made: list[object] = []

    @sa.event.listens_for(s.engine, "connect")
    def _connect(dbapi_connection: object, _record: object) -> None:
        made.append(dbapi_connection)
        entered.set()
        go.wait(20)

    out: list[BaseException | None] = []

    def write() -> None:
        try:
            L.write(s, [_e("p", 0, "late")])
            out.append(None)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out.append(e)

    s._held_lock.acquire()  # another thread's write on the held connection
    t = threading.Thread(target=write)
    t.start()
    try:
        assert entered.wait(20)  # checking out a new pooled connection
    finally:
        s._held_lock.release()
    s.close()
    go.set()
    t.join(20)
    assert len(out) == 1
    assert isinstance(out[0], StashError) and "closed" in str(out[0]), out
    (dbc,) = made
    with pytest.raises(Exception):  # noqa: B017,PT011 - the driver's "closed" error
        dbc.cursor().execute("SELECT 1")  # type: ignore[attr-defined]
    with Stash.open(s._url.render_as_string(hide_password=False), fenced=False) as s2:
        assert [x.data for x in L.scan(s2, "p")] == ["p0"]
