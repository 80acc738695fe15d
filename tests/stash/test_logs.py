"""Compare-and-set logs (stash/logs.py) on every backend: a write lands only on the
expected head; a lost race names the log and commits nothing; log entries and append
batches commit together or not at all; head reads from the latest rollup; truncate
never drops the head; fencing, readonly and savepoint handles behave as for appends;
racing writers on SQL backends never both win; the rows are readable through the
``stash_logs`` view."""

from __future__ import annotations

import logging
import tempfile
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stash import AppendBatch, AppendLowerMismatch, Stash
from stash import logs as L
from stash.antichain import Antichain
from stash.errors import FenceError, LogRaceLost, ReadOnlyError, StashError
from tests.stash.conftest import OpenStash


def _batch(s: Stash, name: str, lower: int, key: str = "k") -> AppendBatch:
    c = s.collection(name, key="str", value="int")
    b = AppendBatch(
        collection=c,
        lower=Antichain.from_elem(lower),
        upper=Antichain.from_elem(lower + 1),
        compact=Antichain.from_elem(0),
        timestamp=lower,
    )
    c.append_to_batch(b, key, lower, 1)
    return b


def _e(name: str, expected: int | None, data: str, rollup: bool = False) -> L.LogEntry:
    return L.LogEntry(name, expected, 0 if expected is None else expected + 1, data, rollup)


def test_write_on_expected_head_and_lost_race(open_stash: OpenStash) -> None:
    s = open_stash()
    assert L.head(s, "a") == [] and L.names(s) == [] and L.head_seqno(s, "a") is None
    L.write(s, [_e("a", None, "v0", True)])
    L.write(s, [_e("a", 0, "d1")])
    with pytest.raises(LogRaceLost) as ei:
        L.write(s, [_e("a", 0, "other")])
    assert ei.value.collection == "a" and "log a" in str(ei.value)
    assert isinstance(ei.value, AppendLowerMismatch)
    with pytest.raises(LogRaceLost):
        L.write(s, [_e("a", None, "again", True)])  # not empty
    assert L.scan(s, "a") == [L.LogRow(0, True, "v0"), L.LogRow(1, False, "d1")]
    assert L.names(s) == ["a"] and L.head_seqno(s, "a") == 1


def test_head_from_latest_rollup_scan_and_truncate(open_stash: OpenStash) -> None:
    s = open_stash()
    L.write(s, [_e("x", None, "r0", True)])
    for n in range(0, 6):
        L.write(s, [_e("x", n, f"e{n + 1}", rollup=(n + 1) == 4)])
    assert [r.seqno for r in L.head(s, "x")] == [4, 5, 6]
    assert [r.seqno for r in L.scan(s, "x", 5)] == [5, 6]
    assert L.truncate(s, "x", 4) == 4
    assert [r.seqno for r in L.scan(s, "x")] == [4, 5, 6]
    assert L.truncate(s, "x", 100) == 2  # never the head
    assert L.scan(s, "x") == [L.LogRow(6, False, "e6")]
    assert L.head(s, "x") == [L.LogRow(6, False, "e6")]
    L.write(s, [_e("x", 6, "e7")])  # the head seqno never goes back
    assert [r.seqno for r in L.scan(s, "x")] == [6, 7]
    # A log without a rollup: head is every entry.
    L.write(s, [_e("y", None, "y0")])
    L.write(s, [_e("y", 0, "y1")])
    assert [r.data for r in L.head(s, "y")] == ["y0", "y1"]


def test_entries_and_batches_all_or_nothing(open_stash: OpenStash) -> None:
    s = open_stash()
    c = s.collection("c", key="str", value="int")
    L.write(s, [_e("a", None, "a0", True), _e("b", None, "b0", True)], [_batch(s, "c", 0)])
    assert s.upper(c) == Antichain.from_elem(1)
    # A stale batch: nothing of the log entries commits.
    with pytest.raises(AppendLowerMismatch) as ei:
        L.write(s, [_e("a", 0, "a1"), _e("b", 0, "b1")], [_batch(s, "c", 0)])
    assert not isinstance(ei.value, LogRaceLost) and ei.value.collection == "c"
    assert [r.seqno for r in L.scan(s, "a")] == [0]
    assert [r.seqno for r in L.scan(s, "b")] == [0]
    # One stale log: nothing of the other log, nor of the batch, commits.
    L.write(s, [_e("b", 0, "b1")])
    with pytest.raises(LogRaceLost) as el:
        L.write(s, [_e("a", 0, "a1"), _e("b", 0, "b1x")], [_batch(s, "c", 1)])
    assert el.value.collection == "b"
    assert [r.seqno for r in L.scan(s, "a")] == [0]
    assert s.upper(c) == Antichain.from_elem(1)
    L.write(s, [_e("a", 0, "a1"), _e("b", 1, "b2")], [_batch(s, "c", 1)])
    assert s.upper(c) == Antichain.from_elem(2)
    assert [r.data for r in L.scan(s, "b")] == ["b0", "b1", "b2"]


@pytest.mark.parametrize(
    "entry, why",
    [
        (L.LogEntry("a", None, 1, "d"), "must have seqno 0"),
        (L.LogEntry("a", 3, 5, "d"), "must have seqno 4"),
        (L.LogEntry("a", -1, 0, "d"), "expected must be"),
        (L.LogEntry("", None, 0, "d"), "must not be empty"),
        (L.LogEntry("a\x00", None, 0, "d"), "control character"),
        (L.LogEntry("a", None, 0, b"d"), "data must be a str"),  # type: ignore[arg-type]
    ],
)
def test_bad_entries_refused_naming_the_rule(
    open_stash: OpenStash, entry: L.LogEntry, why: str
) -> None:
    s = open_stash()
    with pytest.raises(StashError, match=why):
        L.write(s, [entry])
    assert L.names(s) == []


def test_two_entries_of_one_log_refused(open_stash: OpenStash) -> None:
    s = open_stash()
    with pytest.raises(StashError, match="names one log twice"):
        L.write(s, [_e("a", None, "x"), _e("a", None, "y")])
    assert L.names(s) == []


def test_readonly_fenced_and_savepoint_handles(open_stash: OpenStash) -> None:
    w = open_stash(fenced=True)
    L.write(w, [_e("a", None, "a0", True)])
    ro = open_stash(mode="readonly")
    assert [r.data for r in L.head(ro, "a")] == ["a0"]
    with pytest.raises(ReadOnlyError):
        L.write(ro, [_e("a", 0, "a1")])
    sp = open_stash(mode="savepoint")
    L.write(sp, [_e("a", 0, "sp1")])
    assert L.truncate(sp, "a", 5) == 1
    assert [r.data for r in L.scan(sp, "a")] == ["sp1"]
    open_stash(fenced=True)  # takes the epoch: w is fenced
    with pytest.raises(FenceError):
        L.write(w, [_e("a", 0, "late")])
    with pytest.raises(FenceError):
        L.truncate(w, "a", 1)
    assert [r.data for r in L.scan(ro, "a")] == ["a0"]


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_racing_writers_never_both_win(open_stash: OpenStash) -> None:
    """Writers on their own handles append to one log by reading its head and writing on
    top; every entry that reports success is in the log, and seqnos have no gap."""
    handles = [open_stash() for _ in range(3)]
    L.write(handles[0], [_e("r", None, "w0/0", True)])
    won: list[str] = []
    lost = [0]
    lock = threading.Lock()

    def run(i: int) -> None:
        s = handles[i]
        for j in range(15):
            h = L.head(s, "r")[-1].seqno
            data = f"w{i}/{j}"
            try:
                L.write(s, [_e("r", h, data)])
            except LogRaceLost:
                with lock:
                    lost[0] += 1
                continue
            with lock:
                won.append(data)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    rows = L.scan(handles[0], "r")
    assert [r.seqno for r in rows] == list(range(len(rows)))
    assert sorted(r.data for r in rows[1:]) == sorted(won)
    assert len(won) + lost[0] == 45


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_view_is_readable_with_plain_sql(open_stash: OpenStash, stash_url: str) -> None:
    s = open_stash()
    L.write(s, [_e("v", None, '{"a":1}', True)])
    L.write(s, [_e("v", 0, '{"b":2}')])
    import sqlalchemy as sa

    engine = sa.create_engine(stash_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT log, seqno, rollup, data FROM stash_logs ORDER BY seqno")
            ).all()
    finally:
        engine.dispose()
    assert [(r[0], r[1], bool(r[2]), r[3]) for r in rows] == [
        ("v", 0, True, '{"a":1}'),
        ("v", 1, False, '{"b":2}'),
    ]


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
@settings(max_examples=25, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["write", "stale", "truncate"]),
            st.sampled_from(["p", "q"]),
            st.booleans(),
            st.integers(0, 6),
        ),
        max_size=20,
    )
)
def test_against_a_model(kind: str, ops: list[tuple[str, str, bool, int]]) -> None:
    """Writes, lost races and truncations against a dict per log."""
    with tempfile.TemporaryDirectory() as d:
        url = "memory://" if kind == "memory" else f"sqlite:///{d}/m.db"
        with Stash.open(url, fenced=False, synchronous="OFF") as s:
            _run_model(s, ops)


def _run_model(s: Stash, ops: list[tuple[str, str, bool, int]]) -> None:
    model: dict[str, dict[int, tuple[bool, str]]] = {n: {} for n in "pq"}
    for op, name, rollup, k in ops:
        log = model[name]
        h = max(log, default=None)
        if op == "write":
            L.write(s, [_e(name, h, f"{name}{k}", rollup)])
            log[0 if h is None else h + 1] = (rollup, f"{name}{k}")
        elif op == "stale":
            cands = [c for c in [None, *range((h or 0) + 3)] if c != h]
            with pytest.raises(LogRaceLost):
                L.write(s, [_e(name, cands[k % len(cands)], "x", rollup)])
        else:
            before = (h or 0) - k
            gone = [n for n in log if n < before and n != h]
            assert L.truncate(s, name, before) == len(gone)
            for n in gone:
                del log[n]
        got = L.scan(s, name)
        assert got == [L.LogRow(n, r, d) for n, (r, d) in sorted(log.items())]
        start = max((n for n, (r, _) in log.items() if r), default=0)
        assert L.head(s, name) == [r for r in got if r.seqno >= start]
        assert L.head_seqno(s, name) == max(log, default=None)
    assert L.names(s) == sorted(n for n in model if model[n])


@pytest.mark.parametrize("backend", ["postgres"])
def test_postgres_concurrent_insert_of_the_same_seqno_is_a_lost_race(
    open_stash: OpenStash, stash_url: str
) -> None:
    """Under READ COMMITTED both writers see the expected head; the later INSERT waits
    on the primary key and fails once the earlier commits: read as a lost race, and the
    stash's transaction ends with nothing written."""
    import psycopg
    from sqlalchemy.engine import make_url

    s = open_stash()
    L.write(s, [_e("l", None, "a", True)])
    conninfo = make_url(stash_url).set(drivername="postgresql").render_as_string(False)
    out: list[BaseException | None] = []
    with psycopg.connect(conninfo) as other:
        other.execute("INSERT INTO logs (name, seqno, rollup, data) VALUES ('l', 1, false, 'x')")
        t = threading.Thread(target=lambda: out.append(_try(s, _e("l", 0, "mine"))))
        t.start()
        with psycopg.connect(conninfo, autocommit=True) as watch:
            for _ in range(600):  # until the stash's INSERT waits on the other's row
                row = watch.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query LIKE '%INSERT INTO logs%'"
                ).fetchone()
                if row is not None and row[0]:
                    break
                time.sleep(0.05)
            else:
                raise AssertionError("the stash's INSERT never waited on the other writer")
        other.commit()
        t.join(60)
    assert len(out) == 1 and isinstance(out[0], LogRaceLost), out
    assert [r.data for r in L.scan(s, "l")] == ["a", "x"]
    L.write(s, [_e("l", 1, "next")])  # the handle carries on
    assert [r.seqno for r in L.head(s, "l")] == [0, 1, 2]


def _try(s: Stash, e: L.LogEntry) -> BaseException | None:
    try:
        L.write(s, [e])
    except BaseException as x:  # noqa: BLE001 - handed to the test thread
        return x
    return None


@pytest.mark.parametrize("backend", ["postgres"])
def test_postgres_fenced_log_write_waits_twice(
    open_stash: OpenStash, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fenced log write on Postgres sends its fence check inside the conditional
    INSERT: the client waits for the INSERT and the COMMIT (psycopg's BEGIN aside), not
    for a fence statement of its own.  A fenced-out handle and a lost race still come out
    as FenceError and LogRaceLost.  Fails on a log write that checks the fence first."""
    import psycopg

    s = open_stash(fenced=True)
    L.write(s, [_e("w", None, "a", True)])
    seen: list[str] = []
    execute, commit = psycopg.Cursor.execute, psycopg.Connection.commit

    def spy_execute(self: object, query: object, *a: object, **k: object) -> object:
        seen.append(str(query)[:30])
        return execute(self, query, *a, **k)  # type: ignore[arg-type]

    def spy_commit(self: psycopg.Connection[object]) -> None:
        seen.append("COMMIT")
        commit(self)

    monkeypatch.setattr(psycopg.Cursor, "execute", spy_execute)
    monkeypatch.setattr(psycopg.Connection, "commit", spy_commit)
    for h in range(3):
        seen.clear()
        L.write(s, [_e("w", h, f"d{h}")])
        assert len(seen) == 2 and seen[-1] == "COMMIT", seen
    with pytest.raises(LogRaceLost):
        L.write(s, [_e("w", 1, "stale")])
    open_stash(fenced=True)  # takes the epoch
    with pytest.raises(FenceError):
        L.write(s, [_e("w", 3, "late")])
    with pytest.raises(FenceError):  # fenced out and stale: the fence is reported
        L.write(s, [_e("w", 0, "late")])
    assert [r.data for r in L.scan(open_stash(mode="readonly"), "w")] == ["a", "d0", "d1", "d2"]


@pytest.mark.parametrize("backend", ["postgres"])
def test_postgres_log_write_of_several_logs_is_one_statement(
    open_stash: OpenStash, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write of entries of two logs (a persist commit: its state and its history)
    sends both conditional INSERTs as ONE statement, in one pipeline with the BEGIN
    (one cursor): the client waits for it and for the COMMIT.  A lost race still names
    the first log refused, on either log, and a fenced-out handle still gets FenceError.
    Fails on the old code (one statement per entry, in a pipeline; before that, one wait
    per INSERT)."""
    import psycopg

    s = open_stash(fenced=True)
    L.write(s, [_e("a", None, "a0", True), _e("b", None, "b0", True)])
    seen: list[str] = []
    execute, commit = psycopg.Cursor.execute, psycopg.Connection.commit

    def spy_execute(self: psycopg.Cursor[object], query: object, *a: object, **k: object) -> object:
        pipelined = self.connection._pipeline is not None
        seen.append(("pipelined " if pipelined else "") + str(query)[:30])
        return execute(self, query, *a, **k)  # type: ignore[arg-type]

    def spy_commit(self: psycopg.Connection[object]) -> None:
        seen.append("COMMIT")
        commit(self)

    monkeypatch.setattr(psycopg.Cursor, "execute", spy_execute)
    monkeypatch.setattr(psycopg.Connection, "commit", spy_commit)
    for h in range(3):
        seen.clear()
        L.write(s, [_e("a", h, f"a{h + 1}"), _e("b", h, f"b{h + 1}")])
        assert seen == ["pipelined WITH f AS (SELECT epoch, nonce", "COMMIT"], seen
    monkeypatch.undo()
    with pytest.raises(LogRaceLost) as ei:
        L.write(s, [_e("a", 2, "x"), _e("b", 3, "y")])
    assert ei.value.collection == "a"
    with pytest.raises(LogRaceLost) as ei:
        L.write(s, [_e("a", 3, "x"), _e("b", 2, "y")])
    assert ei.value.collection == "b"
    assert [r.data for r in L.scan(s, "b")] == ["b0", "b1", "b2", "b3"]
    open_stash(fenced=True)  # takes the epoch
    with pytest.raises(FenceError):
        L.write(s, [_e("a", 3, "late"), _e("b", 3, "late")])
    r = open_stash(mode="readonly")
    assert [x.data for x in L.scan(r, "a")] == ["a0", "a1", "a2", "a3"]


@pytest.mark.parametrize("backend", ["postgres"])
def test_postgres_write_of_several_logs_losing_on_the_key_names_the_log(
    open_stash: OpenStash, stash_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Under READ COMMITTED a concurrent writer of the same seqno makes the INSERT
    statement fail on the primary key once it commits: the log named is the one whose
    INSERT failed, first or second, and nothing of the write commits."""
    import psycopg
    from sqlalchemy.engine import make_url

    s = open_stash(fenced=True)
    L.write(s, [_e("a", None, "a0", True), _e("b", None, "b0", True)])
    conninfo = make_url(stash_url).set(drivername="postgresql").render_as_string(False)
    for n, (other, lost) in enumerate([("b", "b"), ("a", "a")]):
        with psycopg.connect(conninfo) as c:
            c.execute(
                "INSERT INTO logs (name, seqno, rollup, data) VALUES (%s, %s, false, 'other')",
                (other, n + 1),
            )
            timer = threading.Timer(0.3, c.commit)
            timer.start()
            with caplog.at_level(logging.WARNING), pytest.raises(LogRaceLost) as ei:
                L.write(s, [_e("a", n, "mine"), _e("b", n, "mine")])
            timer.join()
        assert ei.value.collection == lost
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        if other == "b":  # keep the heads in step for the next round
            L.write(s, [_e("a", 0, "a1")])
    assert [r.data for r in L.scan(s, "a")] == ["a0", "a1", "other"]
    assert [r.data for r in L.scan(s, "b")] == ["b0", "other"]


@pytest.mark.parametrize("backend", ["postgres"])
@pytest.mark.parametrize("fenced", [True, False])
def test_postgres_write_of_several_logs_names_the_first_log_that_lost(
    open_stash: OpenStash, stash_url: str, fenced: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The first log's head moved (its conditional INSERT writes no row) and the
    second's INSERT then fails on the key of a concurrent writer's row: the race is
    the first log's (a persist writer whose shard log moved by a rollup, which writes
    no history record, lost the shard race, not the history log's).  Failed before:
    the second log was named, which persist reports as a history log out of step.
    Fenced and not (the two INSERT statements)."""
    import psycopg
    from sqlalchemy.engine import make_url

    s = open_stash(fenced=fenced)
    L.write(s, [_e("a", None, "a0", True), _e("b", None, "b0", True)])
    L.write(s, [_e("a", 0, "a1", True)])  # a's head moved, b's did not
    conninfo = make_url(stash_url).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(conninfo) as c:
        c.execute("INSERT INTO logs (name, seqno, rollup, data) VALUES ('b', 1, false, 'other')")
        timer = threading.Timer(0.3, c.commit)
        timer.start()
        with caplog.at_level(logging.WARNING), pytest.raises(LogRaceLost) as ei:
            L.write(s, [_e("a", 0, "mine"), _e("b", 0, "mine")])
        timer.join()
    assert ei.value.collection == "a"
    # A lost race is routine: nothing logged (psycopg warned of an aborted pipeline when
    # the entries went out in one).
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.data for r in L.scan(s, "a")] == ["a0", "a1"]
    assert [r.data for r in L.scan(s, "b")] == ["b0", "other"]


@pytest.mark.parametrize("backend", ["postgres"])
def test_postgres_write_of_several_logs_losing_on_the_key_logs_nothing(
    open_stash: OpenStash,
    stash_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first log's entry fails on the key of a concurrent writer's row, the second
    is slow to go out: the race is reported as lost, and nothing is logged.  Written
    when the entries went out in a pipeline (the violation then arrived while the
    second was being sent, and psycopg warned "error ignored terminating Pipeline ...
    pipeline aborted"); they are one statement since, sent once."""
    import psycopg
    from sqlalchemy.engine import make_url

    s = open_stash(fenced=False)
    L.write(s, [_e("a", None, "a0", True), _e("b", None, "b0", True)])
    conninfo = make_url(stash_url).set(drivername="postgresql").render_as_string(False)
    sent: list[str] = []
    execute = psycopg.Cursor.execute

    def slow_second(cur: psycopg.Cursor, query: object, *args: object, **kw: object) -> object:
        if "INTO logs" in str(query) and cur.connection.info.dbname != "postgres":
            sent.append(str(query))
            if len(sent) == 2:
                time.sleep(0.6)  # the first INSERT's violation has arrived meanwhile
        return execute(cur, query, *args, **kw)  # type: ignore[arg-type]

    with psycopg.connect(conninfo) as c:
        c.execute("INSERT INTO logs (name, seqno, rollup, data) VALUES ('a', 1, false, 'other')")
        timer = threading.Timer(0.2, c.commit)
        timer.start()
        monkeypatch.setattr(psycopg.Cursor, "execute", slow_second)
        with caplog.at_level(logging.WARNING), pytest.raises(LogRaceLost) as ei:
            L.write(s, [_e("a", 0, "mine"), _e("b", 0, "mine")])
        monkeypatch.undo()
        timer.join()
    assert ei.value.collection == "a"
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.data for r in L.scan(s, "a")] == ["a0", "other"]
    assert [r.data for r in L.scan(s, "b")] == ["b0"]
