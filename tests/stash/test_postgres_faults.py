"""Server faults under a stream of appends on a real Postgres: restarts (fast and crash),
``pg_terminate_backend`` of the stash's sessions, a COMMIT whose answer is lost (through a
TCP proxy between the stash and the server), and a server that is down at open.

What must hold: the handle recovers without being reopened; every append reported as
done is there exactly once; every append reported as failed is not there; one reported
indeterminate may be there (at most once); uppers only grow.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from sqlalchemy.engine import make_url

from stash import (
    Antichain,
    AppendBatch,
    AppendLowerMismatch,
    Stash,
    StashCollection,
    StashError,
    logs,
)
from tests.support.dbutil import migrate_to_head
from tests.support.pgserver import PostgresServer

pytestmark = pytest.mark.postgres

A = Antichain.from_elem
COMMIT_MESSAGE = b"Q\x00\x00\x00\x0bCOMMIT\x00"  # a simple-protocol Query "COMMIT"


@pytest.fixture
def pg(postgres_url: str) -> str:
    migrate_to_head(postgres_url)
    return postgres_url


def dbname(url: str) -> str:
    name = make_url(url).database
    assert name
    return name


# ------------------------------------------------------------- append stream


@dataclass
class Stream:
    """One writer thread appending ``(i, i)`` at the upper it believes current."""

    stash: Stash
    coll: StashCollection[int, int]
    outcomes: dict[int, str] = field(default_factory=dict)  # i -> ok|failed|indeterminate
    uppers: list[int] = field(default_factory=list)  # upper after each acknowledged append
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    count: int = 0

    def run(self) -> None:
        upper = self.stash.upper(self.coll).as_option()
        assert upper is not None
        i = 0
        while not self.stop.is_set():
            i += 1
            b = AppendBatch(self.coll, A(upper), A(upper + 1), A(upper), upper)
            self.coll.append_to_batch(b, i, i, 1)
            try:
                self.stash.append([b])
            except AppendLowerMismatch:
                # Only after an indeterminate append that did commit.
                self.outcomes[i] = "failed"
                upper = self.stash.upper(self.coll).as_option()
                assert upper is not None
                continue
            except StashError as e:
                if e.is_indeterminate():
                    self.outcomes[i] = "indeterminate"
                else:
                    self.outcomes[i] = "failed"
                    self.errors.append(str(e))
                upper = self.stash.upper(self.coll).as_option()
                assert upper is not None
                continue
            self.outcomes[i] = "ok"
            upper += 1
            self.uppers.append(upper)
            self.count += 1

    def wait_for(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        target = self.count + n
        while self.count < target:
            assert time.monotonic() < deadline, f"the stream made no progress: {self.errors[-3:]}"
            time.sleep(0.01)

    def check(self, reader: Stash) -> None:
        c = reader.collection(self.coll.name, key="int", value="int")
        present: dict[int, int] = {}
        for k, v, d in reader.peek(c):
            assert k == v
            present[k] = present.get(k, 0) + d
        assert all(d == 1 for d in present.values()), "an append is there twice"
        for i, outcome in self.outcomes.items():
            if outcome == "ok":
                assert present.get(i) == 1, f"acknowledged append {i} is missing"
            elif outcome == "failed":
                assert i not in present, f"append {i} reported failed is there"
        assert set(present) <= set(self.outcomes)
        assert all(a < b for a, b in zip(self.uppers, self.uppers[1:], strict=False))
        assert reader.upper(c) == A(len(present))


@pytest.fixture
def stream(pg: str) -> Iterator[Callable[..., tuple[Stream, threading.Thread]]]:
    started: list[tuple[Stream, threading.Thread, Stash]] = []

    def start(url: str | None = None, **kw: object) -> tuple[Stream, threading.Thread]:
        s = Stash.open(url or pg, **kw)  # type: ignore[arg-type]
        c = s.collection("stream", key="int", value="int")
        st = Stream(s, c)
        t = threading.Thread(target=st.run, daemon=True)
        t.start()
        started.append((st, t, s))
        return st, t

    yield start
    for st, t, s in started:
        st.stop.set()
        t.join(timeout=60)
        s.close()


def _finish(st: Stream, t: threading.Thread, pg: str, campaign: str, faults: int) -> None:
    st.stop.set()
    t.join(timeout=60)
    assert not t.is_alive()
    with Stash.open(pg, mode="readonly") as reader:
        st.check(reader)
    from tests.reliability.campaign import record

    outcomes = list(st.outcomes.values())
    record(
        campaign,
        runs=1,
        faults=faults,
        acknowledged=outcomes.count("ok"),
        lost=0,
        duplicated=0,
        partial=0,
        unclear=0,
        indeterminate=outcomes.count("indeterminate"),
        failed=outcomes.count("failed"),
    )


def test_server_restarts_during_appends(
    pg, postgres_server: PostgresServer, stream, caplog
) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO)
    st, t = stream(fenced=True, retry_budget=45)
    st.wait_for(20)
    postgres_server.restart("fast")
    st.wait_for(20)  # recovered without reopening the handle
    postgres_server.restart("immediate")  # a crash: WAL recovery at start
    st.wait_for(20)
    _finish(st, t, pg, "server faults: postgres restarted (fast, immediate) during appends", 2)
    assert st.errors == []
    password = make_url(pg).password
    assert password and password not in caplog.text
    assert "transient failure" in caplog.text  # the restarts were noticed and retried


def test_backends_terminated_during_appends(pg, postgres_server: PostgresServer, stream) -> None:  # type: ignore[no-untyped-def]
    st, t = stream(fenced=True, retry_budget=30)
    st.wait_for(10)
    killed = 0
    for _ in range(5):
        killed += postgres_server.terminate_backends(dbname(pg))
        st.wait_for(10)
    _finish(st, t, pg, "server faults: pg_terminate_backend during appends", killed)
    assert killed >= 5
    assert st.errors == []


# --------------------------------------------------------- lost COMMIT answer


class FaultProxy:
    """A TCP proxy to the server that can, once armed, lose a COMMIT:

    * ``"drop"``: the COMMIT never reaches the server (which then aborts);
    * ``"cut"``: the COMMIT reaches the server, which commits, and its answer is lost;
    * ``"cut-and-refuse"``: like ``cut``, then every session is closed and new ones are
      refused until :meth:`accept` (the server cannot be asked what happened).
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.mode: str | None = None
        self.refusing = False
        self.fired = 0
        self.lock = threading.Lock()
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.closed = threading.Event()
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def arm(self, mode: str) -> None:
        with self.lock:
            self.mode = mode

    def accept(self) -> None:
        self.refusing = False

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
        self._close_all()

    def _close_all(self) -> None:
        with self.lock:
            pairs, self.pairs = self.pairs, []
        for a, b in pairs:
            _kill(a, b)

    def _accept_loop(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            if self.refusing:
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            swallow = threading.Event()
            with self.lock:
                self.pairs.append((client, upstream))
            threading.Thread(
                target=self._pump_up, args=(client, upstream, swallow), daemon=True
            ).start()
            threading.Thread(
                target=self._pump_down, args=(upstream, client, swallow), daemon=True
            ).start()

    def _pump_up(
        self, client: socket.socket, upstream: socket.socket, swallow: threading.Event
    ) -> None:
        try:
            while data := client.recv(65536):
                if COMMIT_MESSAGE in data:
                    with self.lock:
                        mode, self.mode = self.mode, None
                    if mode == "drop":
                        self.fired += 1
                        return
                    if mode in ("cut", "cut-and-refuse"):
                        self.fired += 1
                        if mode == "cut-and-refuse":
                            self.refusing = True
                        swallow.set()
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            _kill(client, upstream)

    def _pump_down(
        self, upstream: socket.socket, client: socket.socket, swallow: threading.Event
    ) -> None:
        try:
            while data := upstream.recv(65536):
                if swallow.is_set():
                    # The server answered the COMMIT; the client never hears of it.
                    if self.refusing:
                        self._close_all()
                    break
                client.sendall(data)
        except OSError:
            pass
        finally:
            _kill(client, upstream)


def _kill(*socks: socket.socket) -> None:
    """Shut down (which wakes a thread blocked in ``recv`` and sends FIN) and close."""
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            sock.close()
        except OSError:
            pass


@pytest.fixture
def proxy(postgres_server: PostgresServer) -> Iterator[FaultProxy]:
    p = FaultProxy(postgres_server.port)
    yield p
    p.close()


def via(proxy: FaultProxy, url: str) -> str:
    u = make_url(url).set(port=proxy.port, query={"sslmode": "disable", "gssencmode": "disable"})
    return u.render_as_string(hide_password=False)


def _append(
    s: Stash, c: StashCollection[int, int], k: int, before: Callable[[], None] | None = None
) -> None:
    b = c.make_batch(s)
    c.append_to_batch(b, k, k, 1)
    if before is not None:
        before()
    s.append([b])


@pytest.mark.parametrize("mode", ["cut", "drop"])
def test_lost_commit_is_resolved_by_asking_the_server(
    pg, proxy: FaultProxy, mode: str, caplog
) -> None:  # type: ignore[no-untyped-def]
    """``cut``: committed, answer lost -> success, there once.  ``drop``: never reached
    the server -> run again -> success, there once."""
    caplog.set_level(logging.WARNING, logger="stash")
    with Stash.open(via(proxy, pg), fenced=True) as s:
        c = s.collection("c", key="int", value="int")
        _append(s, c, 1)
        _append(s, c, 2, lambda: proxy.arm(mode))  # the COMMIT of this append is lost
        assert proxy.fired == 1
        _append(s, c, 3)
        assert s.peek(c) == [(1, 1, 1), (2, 2, 1), (3, 3, 1)]
        assert s.upper(c) == A(3)
    expected = "committed" if mode == "cut" else "aborted, running it again"
    assert "reports transaction" in caplog.text and expected in caplog.text


def test_unresolvable_commit_is_indeterminate(pg, proxy: FaultProxy) -> None:  # type: ignore[no-untyped-def]
    with Stash.open(via(proxy, pg), fenced=False, retry_budget=1.0) as s:
        c = s.collection("c", key="int", value="int")
        _append(s, c, 1)
        b = c.make_batch(s)
        c.append_to_batch(b, 2, 2, 1)
        proxy.arm("cut-and-refuse")
        with pytest.raises(StashError) as e:
            s.append([b])
        assert proxy.fired == 1
        assert e.value.is_indeterminate() and not e.value.is_unrecoverable()
        assert "outcome is unknown" in str(e.value)
        assert str(e.value).startswith("stash error: postgres: ")
        proxy.accept()
        # The handle carries on once the server can be reached again.  The append did
        # commit (only its answer was lost), so doing it again is refused rather than
        # applied twice.
        with pytest.raises(AppendLowerMismatch):
            s.append([b])
        assert s.peek(c) == [(1, 1, 1), (2, 2, 1)]
        _append(s, c, 3)
        assert s.upper(c) == A(3)


@pytest.mark.parametrize("mode", ["cut", "drop"])
def test_lost_commit_of_a_log_write_is_resolved(pg, proxy: FaultProxy, mode: str, caplog) -> None:  # type: ignore[no-untyped-def]
    """A compare-and-set log write on an unfenced handle (no fence statement gives the
    transaction id: the INSERT's RETURNING does) whose COMMIT answer is lost: ``cut``
    committed -> success, there once; ``drop`` -> run again -> there once."""
    caplog.set_level(logging.WARNING, logger="stash")
    with Stash.open(via(proxy, pg), fenced=False) as s:
        logs.write(s, [logs.LogEntry("l", None, 0, "a", True)])
        proxy.arm(mode)
        logs.write(s, [logs.LogEntry("l", 0, 1, "b")])  # its COMMIT answer is lost
        assert proxy.fired == 1
        logs.write(s, [logs.LogEntry("l", 1, 2, "c")])
        assert [(r.seqno, r.data) for r in logs.scan(s, "l")] == [(0, "a"), (1, "b"), (2, "c")]
    expected = "committed" if mode == "cut" else "aborted, running it again"
    assert "reports transaction" in caplog.text and expected in caplog.text


def test_unresolvable_commit_of_a_log_write_is_indeterminate(pg, proxy: FaultProxy) -> None:  # type: ignore[no-untyped-def]
    with Stash.open(via(proxy, pg), fenced=False, retry_budget=1.0) as s:
        logs.write(s, [logs.LogEntry("l", None, 0, "a", True)])
        proxy.arm("cut-and-refuse")
        with pytest.raises(StashError) as e:
            logs.write(s, [logs.LogEntry("l", 0, 1, "b")])
        assert e.value.is_indeterminate() and "outcome is unknown" in str(e.value)
        assert s._held is None  # the connection this handle held for writes is dropped
        proxy.accept()
        # It did commit: writing it again is a lost race, never a second entry.
        with pytest.raises(logs.LogRaceLost):
            logs.write(s, [logs.LogEntry("l", 0, 1, "b")])
        assert [r.data for r in logs.scan(s, "l")] == ["a", "b"]


def test_read_whose_commit_is_lost_is_run_again(pg, proxy: FaultProxy) -> None:  # type: ignore[no-untyped-def]
    with Stash.open(via(proxy, pg), fenced=True) as s:
        c = s.collection("c", key="int", value="int")
        _append(s, c, 1)
        proxy.arm("cut")
        assert s.peek(c) == [(1, 1, 1)]
        assert proxy.fired == 1


# ------------------------------------------------------------ down at open


def test_server_down_at_open_fails_fast(pg, postgres_server: PostgresServer) -> None:  # type: ignore[no-untyped-def]
    """Nothing listening: the open fails with a postgres error after a handful of
    connection attempts (libpq's own), not after a retry loop."""
    attempts = 0
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    done = threading.Event()

    def count() -> None:
        nonlocal attempts
        listener.settimeout(0.1)
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            attempts += 1
            conn.close()

    t = threading.Thread(target=count, daemon=True)
    t.start()
    url = make_url(pg).set(port=port).render_as_string(hide_password=False)
    try:
        with pytest.raises(StashError) as e:
            Stash.open(url)
    finally:
        done.set()
        t.join()
        listener.close()
    msg = str(e.value)
    assert msg.startswith("stash error: postgres: ")
    assert not e.value.is_indeterminate()
    assert 1 <= attempts <= 4, attempts  # sslmode=prefer and gssencmode make libpq try twice
    password = make_url(pg).password
    assert password and password not in msg

    postgres_server.stop()
    try:
        with pytest.raises(StashError) as e:
            Stash.open(pg)
        assert str(e.value).startswith("stash error: postgres: ")
        assert "gave up" not in str(e.value)
        assert password not in str(e.value)
    finally:
        postgres_server.start()
    Stash.open(pg).close()
