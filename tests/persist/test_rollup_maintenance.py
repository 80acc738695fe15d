"""Rollups written by maintenance, and lost races that apply only the newer diffs.

After Materialize's persist-client ``internal/state_versions.rs`` (a rollup is its own
version, written by maintenance, never inside a command's) and ``internal/apply.rs`` (a
writer that lost a race fetches only the diffs after its cached seqno):

* a command's version is a diff; once the diffs pass the bound
  (:meth:`persist.consensus.Consensus.rollup_due`) maintenance writes a version that
  changes nothing but its seqno as a rollup row, by its own compare-and-set, with no
  history record; with no maintenance the diffs stop at twice the bound (the next
  command's version is the rollup);
* a machine that lost a race reads the log rows after its cached version and decodes
  only the entries they set or removed (:meth:`persist.machine.ShardMachine.refresh`),
  falling back to the whole head for anything else.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import persist.consensus as consensus_mod
from persist import MemoryBlob, PersistClient, state_check
from persist.consensus import Consensus
from persist.errors import ConsensusError
from persist.ids import new_shard_id
from persist.lease_state import ReaderState
from persist.machine import ShardMachine
from persist.state import ShardState
from persist.types import HollowBatch
from stash import Antichain, Stash, logs
from stash.logs import LogEntry
from tests.support.rollups import one_row, write_maintenance_rollup

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])
KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])


def count_calls(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> list[int]:
    """Spy on the classmethod ``cls.name`` for the rest of the test: each call appends
    to the list returned (how the tests count full decodes)."""
    calls: list[int] = []
    orig = getattr(cls, name).__func__

    def spy(c: type, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return orig(c, *args, **kwargs)

    monkeypatch.setattr(cls, name, classmethod(spy))
    return calls


def _add_reader(m: ShardMachine, name: str) -> None:
    def fn(st: ShardState, fresh: bool) -> tuple[None, bool]:
        st.register_reader(name, m.now_ms(), 600_000)
        return None, True

    m._apply(fn)


class _Writes:
    """Every shard-log entry written, with the other log entries of its transaction."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.txns: list[list[LogEntry]] = []
        orig = logs.write

        def spy(stash: Any, entries: Any, batches: Any = ()) -> None:
            entries = list(entries)
            orig(stash, entries, batches)
            self.txns.append(entries)  # committed

        monkeypatch.setattr(consensus_mod.logs, "write", spy)

    def shard_entries(self, with_history: bool) -> list[LogEntry]:
        """The shard-log entries of transactions that did (a command's) or did not
        write a history record too."""
        out = []
        for t in self.txns:
            history = any(e.name.startswith(consensus_mod.HISTORY_LOG_PREFIX) for e in t)
            if history == with_history:
                out += [e for e in t if e.name.startswith(consensus_mod.SHARD_COLLECTION_PREFIX)]
        return out


# ===================================================================== rollups
@pytest.mark.parametrize("mode", ["background", "inline"])
def test_appends_past_the_bound_write_no_rollup_row_maintenance_does(
    sqlite_stash: Stash, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """A user's append never pays for a rollup: its transaction writes a diff row; the
    rollups are versions of their own, written by maintenance (no history record), and
    the head stays bounded.  Failed on the old code, whose appends crossing the bound
    wrote the rollup row themselves."""
    client = PersistClient(sqlite_stash, MemoryBlob(), compaction=mode)
    writes = _Writes(monkeypatch)
    try:
        client.consensus.max_diffs = 4
        write, read = client.open("grow", SCHEMA, pa.schema([]))
        sid = write._machine.shard_id
        name = Consensus.log_name(sid)
        longest = 0
        for i in range(40):
            write.append(one_row(i), i, i + 1)
            if mode == "background":
                assert client.maintenance.wait_idle(10)
            longest = max(longest, len(logs.head(sqlite_stash, name)))
        user = [e for e in writes.shard_entries(with_history=True) if e.name == name]
        assert len(user) >= 40 and not any(e.rollup for e in user[1:])
        rollups = [e for e in writes.shard_entries(with_history=False) if e.rollup]
        assert len(rollups) >= 3
        # A rollup changes nothing but the seqno: no history record, and the
        # history holds the user's commands only.
        hist = client.consensus.history(sid)
        assert not any(h["seqno"] in {e.seqno for e in rollups} for h in hist)
        assert longest <= 2 * 4 + 2
        got = sorted(row["k"] for row in read.snapshot(39).to_pylist())
        assert got == list(range(40))
        fresh = ShardMachine(Consensus(sqlite_stash), sid).fetch()
        assert fresh == write._machine.state()
    finally:
        client.close()


def test_the_default_cadence_writes_a_rollup_every_128_diffs(
    sqlite_stash: Stash, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the default ``max_diffs`` (Materialize's rollup threshold, 128) a client
    with maintenance writes no rollup over the first 128 one-row appends, and one soon
    after: a rollup rewrites the whole state, so the cadence sets most of the database
    log a small append costs.  Failed on the old code (a rollup every 32 diffs)."""
    assert Consensus(None).max_diffs == 128  # type: ignore[arg-type]
    client = PersistClient(sqlite_stash, MemoryBlob(), compaction="inline")
    writes = _Writes(monkeypatch)
    try:
        write, read = client.open("cadence", SCHEMA, pa.schema([]))
        name = Consensus.log_name(write._machine.shard_id)
        for i in range(140):
            write.append(one_row(i), i, i + 1)
        rollups = [e.seqno for e in writes.shard_entries(with_history=False) if e.rollup]
        assert rollups and min(rollups) > 128, rollups
        assert len(rollups) == 1
        assert sorted(r["k"] for r in read.snapshot(139).to_pylist()) == list(range(140))
        assert logs.head(sqlite_stash, name)[0].rollup
    finally:
        client.close()


def test_a_rollup_changes_nothing_but_the_seqno(sqlite_stash: Stash) -> None:
    c = Consensus(sqlite_stash, max_diffs=2)
    sid = new_shard_id()
    m = ShardMachine(c, sid)
    m.initialize(ShardState(sid, "s", KS, VS))
    assert not m.write_rollup()  # not due: nothing written
    for i in range(3):
        _add_reader(m, f"r{i}")
    before = m.state()
    hist = len(c.history(sid))
    assert m.write_rollup()
    after = m.state()
    assert after.seqno == before.seqno + 1
    after_as_before = after.clone()
    after_as_before.seqno = before.seqno
    assert after_as_before == before and after.readers == before.readers
    assert len(c.history(sid)) == hist  # no history record
    rows = logs.scan(sqlite_stash, c.log_name(sid))
    assert [(r.seqno, r.rollup) for r in rows] == [(after.seqno, True)]  # truncated
    assert not m.write_rollup()
    assert ShardMachine(Consensus(sqlite_stash), sid).fetch() == after


def test_the_head_stays_bounded_with_maintenance_off(sqlite_stash: Stash) -> None:
    """Compaction off (no maintenance): the diffs stop at twice the bound, where a
    command's own version becomes the rollup."""
    client = PersistClient(sqlite_stash, MemoryBlob(), compaction="off")
    try:
        client.consensus.max_diffs = 3
        write, _read = client.open("off", SCHEMA, pa.schema([]))
        name = Consensus.log_name(write._machine.shard_id)
        lengths = []
        for i in range(30):
            write.append(one_row(i), i, i + 1)
            lengths.append(len(logs.head(sqlite_stash, name)))
        assert max(lengths) <= 2 * 3 + 2
        assert min(lengths[5:]) < max(lengths)  # rollups happened
    finally:
        client.close()


def test_a_rollup_racing_a_command_retries_or_gives_up_harmlessly(sqlite_stash: Stash) -> None:
    c = Consensus(sqlite_stash, max_diffs=2)
    sid = new_shard_id()
    m1, m2 = ShardMachine(c, sid), ShardMachine(c, sid)
    m1.initialize(ShardState(sid, "s", KS, VS))
    for i in range(3):
        _add_reader(m1, f"r{i}")
    m2.state()
    _add_reader(m2, "x")  # m1's cached version is now stale
    # m1 loses its first compare-and-set, catches up, and still owes a rollup.
    assert m1.write_rollup()
    head = ShardMachine(Consensus(sqlite_stash), sid).fetch()
    assert head == m1.state() and "x" in head.readers
    assert logs.scan(sqlite_stash, c.log_name(sid))[0].rollup
    # m2 is stale now; by the time it looks, no rollup is due: nothing, no error.
    _add_reader(m1, "y")
    assert not m2.write_rollup(attempts=1) or m2.state().seqno == head.seqno + 2
    assert not m2.write_rollup()
    _add_reader(m2, "z")  # m2 catches up over the rollup (a full read) and commits
    assert set(ShardMachine(Consensus(sqlite_stash), sid).fetch().readers) >= {"x", "y", "z"}


def test_appends_racing_background_rollups_land_once(tmp_path: Path) -> None:
    """Threads of two clients append while their maintenance threads write rollups:
    every acknowledged append is read back once; the head is what each cache holds."""
    stash = Stash.open(f"sqlite:///{tmp_path}/s.db", fenced=False)
    blob = MemoryBlob()
    clients = [PersistClient(stash, blob, compaction="background") for _ in range(2)]
    for c in clients:
        c.consensus.max_diffs = 2
    errors: list[BaseException] = []
    acked: Counter[tuple[int, int]] = Counter()
    lock = threading.Lock()
    ks = pa.schema([("k", pa.string())])
    vs = pa.schema([("v", pa.int64())])

    def run(i: int) -> None:
        try:
            w, _r = clients[i].open("t", ks, vs)
            for j in range(12):
                while True:
                    lo = w.fetch_recent_upper().as_option()
                    try:
                        w.compare_and_append(
                            [(((f"c{i}",), (j,)), lo, 1)],
                            Antichain.from_elem(lo),
                            Antichain.from_elem(lo + 1),
                        )
                    except Exception as e:
                        if type(e).__name__ == "UpperMismatch":
                            continue
                        raise
                    with lock:
                        acked[(i, j)] += 1
                    break
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for c in clients:
            assert c.maintenance.wait_idle(10)
        w, r = clients[0].open("t", ks, vs)
        upper = w.fetch_recent_upper().as_option()
        got: Counter[tuple[int, int]] = Counter()
        for row in r.snapshot(upper - 1).to_pylist():
            got[(int(row["k"][1:]), row["v"])] += row["_diff"]
        assert got == acked and len(acked) == 24
        sid = w._machine.shard_id
        assert sum(c._ctx.machine(sid).metrics["rollups"] for c in clients) >= 1
    finally:
        for c in clients:
            c.close()
        stash.close()


# ================================================================ lost races
def test_a_lost_race_decodes_only_the_newer_entries(
    sqlite_stash: Stash, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failed on the old code, which re-read and decoded the whole head."""
    c = Consensus(sqlite_stash)
    sid = new_shard_id()
    m1, m2 = ShardMachine(c, sid), ShardMachine(c, sid)
    m1.initialize(ShardState(sid, "s", KS, VS))
    for i in range(20):
        _add_reader(m1, f"r{i}")
    m2.state()
    _add_reader(m1, "new")
    monkeypatch.setattr(state_check, "ENABLED", False)  # its check decodes in full
    full = count_calls(monkeypatch, ShardState, "from_entries")
    decoded = count_calls(monkeypatch, ReaderState, "from_json")
    _add_reader(m2, "mine")  # loses once, catches up, commits
    assert m2.metrics["cas_lost"] == 1
    assert full == [] and len(decoded) == 1  # the reader "new" alone
    monkeypatch.undo()
    assert ShardMachine(Consensus(sqlite_stash), sid).fetch() == m2.state()
    assert {"new", "mine"} <= set(m2.state().readers)


def test_recent_catches_up_without_a_full_read(
    sqlite_stash: Stash, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handle asking for the latest state (``fetch_recent_upper``, a snapshot) after
    another process's commits decodes only what they changed.  Failed on the old code,
    which read and decoded the whole head once the seqno moved."""
    c = Consensus(sqlite_stash)
    sid = new_shard_id()
    m1, m2 = ShardMachine(c, sid), ShardMachine(c, sid)
    m1.initialize(ShardState(sid, "s", KS, VS))
    for i in range(10):
        _add_reader(m1, f"r{i}")
    m2.recent()
    _add_reader(m1, "new")
    monkeypatch.setattr(state_check, "ENABLED", False)
    full = count_calls(monkeypatch, ShardState, "from_entries")
    st = m2.recent()
    assert full == [] and "new" in st.readers
    assert m2.recent() is st  # nothing newer: the cached state
    monkeypatch.undo()
    assert ShardMachine(Consensus(sqlite_stash), sid).fetch() == st


def test_a_lost_append_decodes_only_the_new_batches(
    sqlite_stash: Stash,
    two_clients: tuple[PersistClient, PersistClient],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = two_clients
    wa, _ = a.open("t", SCHEMA, pa.schema([]))
    wb, rb = b.open("t", SCHEMA, pa.schema([]))
    for i in range(60):
        wa.append(one_row(i), i, i + 1)
    wb._machine.fetch()  # cached at the head
    wa.append(one_row(60), 60, 61)
    wa.append(one_row(61), 61, 62)
    monkeypatch.setattr(state_check, "ENABLED", False)
    calls = count_calls(monkeypatch, HollowBatch, "from_json")
    wb.append(one_row(62), 62, 63)
    assert 0 < len(calls) <= 4  # the two newer batches (and a spine merge's)
    assert wb._machine.metrics["catch_ups"] >= 1
    monkeypatch.undo()
    sid = wb._machine.shard_id
    assert ShardMachine(Consensus(sqlite_stash), sid).fetch() == wb._machine.state()
    got = sorted(row["k"] for row in rb.snapshot(62).to_pylist())
    assert got == list(range(63))


def test_catch_up_falls_back_to_the_head(sqlite_stash: Stash) -> None:
    """Rows truncated past the cached version with no rollup (a gap), a malformed diff
    or rollup row: the whole head is read (which tells a corrupt log apart).  A rollup
    among the newer rows is caught up across (the rows before it truncated or not)."""
    c = Consensus(sqlite_stash, max_diffs=2)
    sid = new_shard_id()
    m1, m2 = ShardMachine(c, sid), ShardMachine(c, sid)
    m1.initialize(ShardState(sid, "s", KS, VS))
    m2.state()
    v0 = m2._cache.version  # type: ignore[union-attr]
    assert c.catch_up(sid, v0) == (v0, set())  # nothing newer: the same version
    for i in range(3):
        _add_reader(m1, f"r{i}")
    assert m1.write_rollup()  # a rollup; the rows before it are truncated
    got = c.catch_up(sid, v0)
    assert got is not None and got[1] == {"meta", "reader/r0", "reader/r1", "reader/r2"}
    assert got[0] == c.head(sid)
    heads = m2.metrics["heads"]
    assert m2.refresh() == m1.state() and m2.metrics["heads"] == heads
    _add_reader(m1, "g")
    m2.refresh()
    # A rollup row that is not a compact JSON object, or names another seqno: the
    # head is read (it reads a well-formed one whatever its spacing).
    v = m2._cache.version  # type: ignore[union-attr]
    spaced = json.dumps(c.head(sid).data | {"meta": v.data["meta"] | {"seqno": v.seqno + 1}})  # type: ignore[union-attr]
    logs.write(sqlite_stash, [LogEntry(c.log_name(sid), v.seqno, v.seqno + 1, spaced, True)])
    assert c.catch_up(sid, v) is None
    heads = m2.metrics["heads"]
    assert m2.refresh().seqno == v.seqno + 1 and m2.metrics["heads"] == heads + 1
    v = m2._cache.version  # type: ignore[union-attr]
    other = v.data | {"meta": v.data["meta"] | {"seqno": v.seqno + 5}}
    logs.write(
        sqlite_stash,
        [
            LogEntry(
                c.log_name(sid), v.seqno, v.seqno + 1, consensus_mod.canonical_json(other), True
            )
        ],
    )
    assert c.catch_up(sid, v) is None
    with pytest.raises(ConsensusError, match="corrupt"):
        m2.refresh()


def test_catch_up_with_a_malformed_diff_row_reads_the_head(
    tmp_path: Path, sqlite_stash: Stash
) -> None:
    c = Consensus(sqlite_stash, max_diffs=2)
    sid = new_shard_id()
    m1, m2 = ShardMachine(c, sid), ShardMachine(c, sid)
    m1.initialize(ShardState(sid, "s", KS, VS))
    m2.state()
    _add_reader(m1, "a")
    _add_reader(m1, "b")
    # A gap: the row after the cached version is missing, no rollup after it.
    v = m2._cache.version  # type: ignore[union-attr]
    with sqlite3.connect(tmp_path / "s.db") as db:
        db.execute("DELETE FROM logs WHERE name = ? AND seqno = ?", (c.log_name(sid), 1))
    assert c.catch_up(sid, v) is None
    with pytest.raises(ConsensusError, match="corrupt"):
        m2.refresh()
    # A malformed diff row after the cached version.
    sid = new_shard_id()
    m1, m2 = ShardMachine(c, sid), ShardMachine(c, sid)
    m1.initialize(ShardState(sid, "s", KS, VS))
    m2.state()
    v = m2._cache.version  # type: ignore[union-attr]
    logs.write(sqlite_stash, [LogEntry(c.log_name(sid), v.seqno, v.seqno + 1, '{"del": 1}')])
    assert c.catch_up(sid, v) is None
    with pytest.raises(ConsensusError, match="corrupt"):
        m2.refresh()


@pytest.mark.parametrize("diffs_before, diffs_after", [(0, 0), (2, 0), (0, 2), (2, 2)])
def test_catching_up_across_a_maintenance_rollup_decodes_no_batch_in_full(
    sqlite_stash: Stash,
    two_clients: tuple[PersistClient, PersistClient],
    monkeypatch: pytest.MonkeyPatch,
    diffs_before: int,
    diffs_after: int,
) -> None:
    """Another process's maintenance rollup among the newer rows (the rows before it
    truncated): a machine catching up decodes only the entries that differ from its
    cached version, no spine batch in full and no whole state.  Failed on the old
    code, which read and decoded the whole head once a rollup was among the rows."""
    a, b = two_clients
    wa, _ = a.open("t", SCHEMA, pa.schema([]))
    wb, rb = b.open("t", SCHEMA, pa.schema([]))
    for i in range(40):
        wa.append(one_row(i), i, i + 1)
    mb = wb._machine
    mb.fetch()  # cached at the head
    upper = 40
    for _ in range(diffs_before):
        wa.append(one_row(upper), upper, upper + 1)
        upper += 1
    write_maintenance_rollup(wa._machine)
    for _ in range(diffs_after):
        wa.append(one_row(upper), upper, upper + 1)
        upper += 1
    monkeypatch.setattr(state_check, "ENABLED", False)
    full = count_calls(monkeypatch, ShardState, "from_entries")
    batches = count_calls(monkeypatch, HollowBatch, "from_json")
    heads, catch_ups = mb.metrics["heads"], mb.metrics["catch_ups"]
    st = mb.refresh()
    assert full == [] and len(batches) <= diffs_before + diffs_after + 2
    assert mb.metrics["heads"] == heads and mb.metrics["catch_ups"] == catch_ups + 1
    monkeypatch.undo()
    head = ShardMachine(Consensus(sqlite_stash), mb.shard_id).fetch()
    assert st == head and st.seqno == head.seqno
    assert mb._cache.version == Consensus(sqlite_stash).head(mb.shard_id)  # type: ignore[union-attr]
    wb.append(one_row(upper), upper, upper + 1)  # builds on the caught-up layout
    got = sorted(row["k"] for row in rb.snapshot(upper).to_pylist())
    assert got == list(range(upper + 1))


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 1), st.sampled_from(["append", "reader", "since", "rollup"])),
        min_size=1,
        max_size=14,
    ),
    compaction=st.sampled_from(["off", "inline"]),
    max_diffs=st.sampled_from([2, 32]),
)
def test_racing_machines_catch_up_to_what_a_full_read_gives(
    ops: list[tuple[int, str]], compaction: str, max_diffs: int
) -> None:
    """Two clients on one shard run random commands and maintenance rollups, each on its
    stale cache: every catch-up (checked against the full decoding by
    :mod:`persist.state_check`) equals a full read of the head, and none reads the
    whole head, a rollup among the newer rows or not (the no-head-read check failed on
    the old code, which read the head once a rollup was among them)."""
    with Stash.open("memory://", fenced=False) as stash:
        blob = MemoryBlob()
        clients = [PersistClient(stash, blob, compaction=compaction) for _ in range(2)]
        try:
            for c in clients:
                c.consensus.max_diffs = max_diffs
            handles = [c.open("t", SCHEMA, pa.schema([])) for c in clients]
            sid = handles[0][0]._machine.shard_id
            upper = 0
            for who, op in ops:
                w, r = handles[who]
                m = w._machine
                if op == "append":
                    w.append(one_row(upper), upper, upper + 1)
                    upper += 1
                elif op == "reader":
                    _add_reader(m, f"x{len(m.state().readers)}")
                elif op == "since":
                    r.downgrade_since(Antichain.from_elem(max(0, upper - 1)))
                else:
                    m.write_rollup()
                for c in clients:
                    cm = c._ctx.machine(sid)
                    heads = cm.metrics["heads"]
                    got = cm.refresh()
                    assert cm.metrics["heads"] == heads  # caught up, across rollups too
                    head = ShardMachine(Consensus(stash), sid).fetch()
                    assert got == head
                    assert got.to_entries() == json.loads(json.dumps(head.to_entries()))
        finally:
            for c in clients:
                c.close()


def test_a_transaction_that_lost_a_seqno_race_catches_up_from_the_diffs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A multi-shard transaction whose compare-and-set lost to another process's
    version re-stages on its cached versions caught up with the newer diffs.  Failed
    on the old code, which re-read and decoded every shard's whole head."""
    with Stash.open("memory://", fenced=False) as stash:
        blob = MemoryBlob()
        a = PersistClient(stash, blob, compaction="off")
        b = PersistClient(stash, blob, compaction="off")
        try:
            ks = pa.schema([("k", pa.string())])
            vs = pa.schema([("v", pa.int64())])
            wa, _ = a.open("a", ks, vs)
            wa.compare_and_append([((("o",), (0,)), 0, 1)], 0, 1)
            txn = a.begin()
            txn.write("a", pa.table({"k": ["x"], "v": [1]}))
            orig = a.consensus.append_atomic
            raced: list[int] = []
            full: list[int] = []

            def racing(batches: Any, what: str) -> str | None:
                if not raced:
                    raced.append(1)
                    b.open("a", ks, vs)  # another process's version (a new reader)
                    monkeypatch.setattr(state_check, "ENABLED", False)
                    orig_full = ShardState.from_entries.__func__  # type: ignore[attr-defined]

                    def spy(cls: type[ShardState], entries: Any) -> ShardState:
                        full.append(1)
                        return orig_full(cls, entries)  # type: ignore[no-any-return]

                    monkeypatch.setattr(ShardState, "from_entries", classmethod(spy))
                return orig(batches, what)

            monkeypatch.setattr(a.consensus, "append_atomic", racing)
            assert txn.commit() == 1
            assert raced == [1] and full == []
            monkeypatch.undo()
            sid = wa._machine.shard_id
            assert wa._machine.metrics["catch_ups"] >= 1
            assert ShardMachine(Consensus(stash), sid).fetch() == wa._machine.state()
        finally:
            a.close()
            b.close()


_chars = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(_chars, max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(_chars, max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)
_entries = st.dictionaries(st.sampled_from(["meta", "a", "b/1", 'q"\\', "é"]), _json_values)


@settings(max_examples=200, deadline=None)
@given(prev=_entries, new=_entries, spaced=st.booleans())
def test_rollup_members_equal_a_full_parse(
    prev: dict[str, Any], new: dict[str, Any], spaced: bool
) -> None:
    """Splitting a rollup row against an older version's entries (reusing the ones
    whose texts are unchanged) gives what parsing and re-encoding it in full gives; a
    row that is not compact is refused (the caller reads it in full)."""
    from persist.log_text import rollup_members, rollup_text
    from stash.codec import canonical_json

    prev_texts = {k: canonical_json(v) for k, v in prev.items()}
    new_texts = {k: canonical_json(v) for k, v in new.items()}
    text = rollup_text(new_texts)
    assert json.loads(text) == new
    if spaced:
        text = json.dumps(new, indent=1)
        if "\n" in text:  # spaces outside strings
            assert rollup_members(text, prev_texts, prev) is None
            return
    got = rollup_members(text, prev_texts, prev)
    assert got is not None
    data, texts, changed = got
    assert texts == new_texts
    assert {k: canonical_json(v) for k, v in data.items()} == new_texts
    want = {k for k in set(prev_texts) | set(new_texts) if prev_texts.get(k) != new_texts.get(k)}
    assert changed == want
    for bad in ("", "[]", text[:-1], text + " ", text + "x", '{"a" 1}', '{"a":1,}', "{1:2}"):
        if bad != text:
            assert rollup_members(bad, prev_texts, prev) is None
