"""The connection a SQL stash holds for its writes (``SqlStash._attempt_held``): a write
(a compare-and-set log write, an append) runs on it without a pool checkout; a fenced-out
handle still refuses through it; threads sharing one handle write concurrently (one on
the held connection, the others on pooled ones) without losing or mixing anything; a
lost connection is dropped and replaced; ``close`` gives it back."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa

from stash import AppendBatch, Stash
from stash import logs as L
from stash.antichain import Antichain
from stash.errors import FenceError
from stash.sql import SqlStash
from tests.stash.conftest import OpenStash

pytestmark = pytest.mark.parametrize("backend", ["sqlite", "postgres"])


def _e(name: str, expected: int | None, data: str) -> L.LogEntry:
    return L.LogEntry(name, expected, 0 if expected is None else expected + 1, data)


def _checkouts(s: Stash) -> list[int]:
    """A counter of the pool checkouts of ``s`` from now on."""
    assert isinstance(s, SqlStash)
    n = [0]

    @sa.event.listens_for(s.engine, "checkout")
    def _count(*_: Any) -> None:
        n[0] += 1

    return n


def _append(s: Stash, name: str, t: int) -> None:
    _append_to(s, s.collection(name, key="int", value="int"), t)


def _append_to(s: Stash, c: Any, t: int) -> None:
    b = AppendBatch(
        c, Antichain.from_elem(t), Antichain.from_elem(t + 1), Antichain.from_elem(t), t
    )
    c.append_to_batch(b, t, t, 1)
    s.append([b])


def test_writes_do_not_check_out_from_the_pool(open_stash: OpenStash) -> None:
    """Fails on a stash that runs every write on a pooled connection (one checkout per
    write)."""
    s = open_stash(fenced=True)
    c = s.collection("c", key="int", value="int")
    L.write(s, [_e("l", None, "a")])
    _append_to(s, c, 0)
    n = _checkouts(s)
    for i in range(5):
        L.write(s, [_e("l", i, f"d{i}")])
        _append_to(s, c, i + 1)
    assert n[0] == 0
    assert s.peek(c) == [(i, i, 1) for i in range(6)]  # reads still use the pool
    assert [r.data for r in L.scan(s, "l")] == ["a", "d0", "d1", "d2", "d3", "d4"]
    assert n[0] == 2


def test_a_fenced_out_handle_refuses_through_the_held_connection(open_stash: OpenStash) -> None:
    w = open_stash(fenced=True)
    L.write(w, [_e("l", None, "a")])
    _append(w, "c", 0)
    assert isinstance(w, SqlStash) and w._held is not None
    open_stash(fenced=True)  # takes the epoch
    with pytest.raises(FenceError):
        L.write(w, [_e("l", 0, "late")])
    with pytest.raises(FenceError):
        _append(w, "c", 1)
    with pytest.raises(FenceError):  # and again: the refusal left nothing open
        L.write(w, [_e("l", 0, "late")])
    r = open_stash(mode="readonly")
    assert [x.data for x in L.scan(r, "l")] == ["a"]
    assert r.upper(r.collection("c", key="int", value="int")) == Antichain.from_elem(1)


def test_threads_sharing_a_handle_write_logs_concurrently(open_stash: OpenStash) -> None:
    s = open_stash(fenced=True)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            h = None
            for j in range(25):
                L.write(s, [_e(f"t{i}", h, f"{i}/{j}")])
                h = j
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []
    for i in range(4):
        rows = L.scan(s, f"t{i}")
        assert [(r.seqno, r.data) for r in rows] == [(j, f"{i}/{j}") for j in range(25)]


def test_close_gives_the_held_connection_back(open_stash: OpenStash) -> None:
    s = open_stash(fenced=True)
    L.write(s, [_e("l", None, "a")])
    assert isinstance(s, SqlStash)
    held = s._held
    assert held is not None and s.engine.pool.checkedout() == 1
    s.close()
    assert s._held is None and s.engine.pool.checkedout() == 0


def test_a_lost_held_connection_is_replaced(open_stash: OpenStash, backend: str) -> None:
    """The held connection dies between writes: on Postgres the next write fails before
    COMMIT on it, is run again on a new one and lands once; on SQLite (a connection
    closed underneath) the write fails and the next one gets a new connection."""
    s = open_stash(fenced=True)
    assert isinstance(s, SqlStash)
    L.write(s, [_e("l", None, "a")])
    old = s._held
    assert old is not None
    if backend == "postgres":
        pid = old.driver_connection.info.backend_pid
        other = open_stash(mode="readonly")
        assert isinstance(other, SqlStash)
        with other.engine.connect() as conn:
            conn.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid)})")
        L.write(s, [_e("l", 0, "b")])
    else:
        old.driver_connection.close()
        with pytest.raises(Exception):  # noqa: B017, PT011 - whatever sqlite3 says
            L.write(s, [_e("l", 0, "b")])
        L.write(s, [_e("l", 0, "b")])
    assert s._held is not None and s._held is not old
    assert [r.data for r in L.scan(s, "l")] == ["a", "b"]


@pytest.mark.parametrize("busy", [False, True])
def test_a_forked_child_writes_on_a_connection_of_its_own(
    open_stash: OpenStash, busy: bool
) -> None:
    """A process forked while the handle holds its write connection (as Spark forks its
    Python workers) never writes on the parent's connection (a shared socket or SQLite
    handle): it takes a new one, held for its own writes, even when another thread of
    the parent was using the held connection at the fork (``busy``: its lock, copied
    locked, is never released in the child); the parent's goes on working.  Failed
    before: the child wrote on the parent's held connection."""
    import os

    s = open_stash(fenced=False)
    assert isinstance(s, SqlStash)
    L.write(s, [_e("p", None, "p0")])
    held = s._held
    assert held is not None
    parent_dbc = id(held.driver_connection)
    r, w = os.pipe()
    if busy:
        s._held_lock.acquire()
    pid = os.fork()
    if busy and pid != 0:
        s._held_lock.release()
    if pid == 0:  # the child: report, then leave without running any cleanup
        code = 1
        try:
            L.write(s, [_e("c", None, "c0")])
            mine = s._held
            code = 0 if mine is not None and id(mine.driver_connection) != parent_dbc else 2
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert got == bytes([0]), f"the child reported {got!r} (2: it wrote on the parent's connection)"
    L.write(s, [_e("p", 0, "p1")])
    assert [x.data for x in L.scan(s, "p")] == ["p0", "p1"]
    assert [x.data for x in L.scan(s, "c")] == ["c0"]
