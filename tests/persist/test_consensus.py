"""Consensus on the stash, the shard state and its JSON forms, the state machine."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pyarrow as pa
import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from persist.consensus import ROLLUP_SHARE, Consensus, HistoryAppend, diff_key
from persist.errors import ConsensusError, InvalidUsage
from persist.ids import new_shard_id, validate_shard_id, validate_shard_name
from persist.machine import ShardMachine, Stale
from persist.spine import FueledMergeRes
from persist.state import LeaseExpired, ShardState
from persist.types import Description, HollowBatch, PartRef
from stash import Antichain, MemoryStash, Stash, StashError, logs
from stash.codec import canonical_json
from stash.sql import SqlStash

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string()), ("n", pa.float64())])


@pytest.fixture(params=["memory", "sqlite"])
def stash(request: pytest.FixtureRequest, tmp_path: Path) -> Stash:
    url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path}/stash.db"
    s = Stash.open(url, fenced=False)
    yield s
    s.close()


def ac(t: int) -> Antichain:
    return Antichain.from_elem(t)


def texts(cons: Consensus, seqno: int, **extra: object) -> dict[str, str]:
    d: dict[str, object] = {"meta": {"seqno": seqno}, **extra}
    return {k: cons.encode(v) for k, v in d.items()}


def test_head_and_compare_and_set(stash: Stash) -> None:
    c = Consensus(stash)
    sid = new_shard_id()
    assert c.head(sid) is None
    assert c.head_seqno(sid) is None
    v0 = texts(c, 0, a={"x": 1}, b=[1, 2])
    assert c.compare_and_set(sid, None, v0)
    h = c.head(sid)
    assert h is not None and h.seqno == 0 and h.data["a"] == {"x": 1}
    assert h.texts == v0
    # A second "first version" loses: nothing changes.
    assert not c.compare_and_set(sid, None, texts(c, 0, a={"x": 2}))
    v1 = texts(c, 1, a={"x": 3}, c="new")  # b removed, a changed, c added
    assert c.compare_and_set(sid, 0, v1, v0)
    # Stale expected seqno loses and commits nothing.
    assert not c.compare_and_set(sid, 0, texts(c, 1, a={"x": 9}), v0)
    h = c.head(sid)
    assert h is not None and h.seqno == 1
    assert h.data == {"meta": {"seqno": 1}, "a": {"x": 3}, "c": "new"}
    assert c.head_seqno(sid) == 1
    assert [v.seqno for v in c.scan(sid)] == [1]
    with pytest.raises(InvalidUsage, match="meta"):
        c.compare_and_set(sid, 1, {"a": "1"}, v1)


def test_history_records_are_log_entries_committed_with_their_version(stash: Stash) -> None:
    c = Consensus(stash)
    sid = new_shard_id()
    v0 = texts(c, 0, a=1)
    rec0 = {"seqno": 0, "op": "create"}
    assert c.compare_and_set(sid, None, v0, history=HistoryAppend(0, f"{0:020d}", rec0))
    v1 = texts(c, 1, a=2)
    rec1 = {"seqno": 1, "op": "append"}
    assert c.compare_and_set(sid, 0, v1, v0, history=HistoryAppend(1, f"{1:020d}", rec1))
    assert c.history(sid) == [rec0, rec1]
    # Entries of the log persist.history.<id>, numbered by record; no collection.
    rows = logs.scan(stash, c.history_log_name(sid))
    assert [r.seqno for r in rows] == [0, 1]
    assert not [n for n in stash.collections() if n.startswith("persist.history.")]
    # A lost version race commits no record.
    lost = HistoryAppend(2, f"{1:020d}", {"seqno": 1, "op": "lost"})
    assert not c.compare_and_set(sid, 0, texts(c, 1, a=9), v0, history=lost)
    assert c.history(sid) == [rec0, rec1]
    # A record out of step with the log is refused, and its version is not committed.
    bad = HistoryAppend(5, f"{2:020d}", {"seqno": 2, "op": "append"})
    with pytest.raises(ConsensusError, match="history log .* out of step"):
        c.compare_and_set(sid, 1, texts(c, 2, a=3), v1, history=bad)
    assert c.head_seqno(sid) == 1
    assert c.history(sid) == [rec0, rec1]


def test_racing_compare_and_set_has_one_winner(stash: Stash) -> None:
    c = Consensus(stash)
    sid = new_shard_id()
    v0 = texts(c, 0)
    assert c.compare_and_set(sid, None, v0)
    wins: list[int] = []
    barrier = threading.Barrier(6)

    def attempt(i: int) -> None:
        barrier.wait()
        if c.compare_and_set(sid, 0, texts(c, 1, who=i), v0):
            wins.append(i)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    h = c.head(sid)
    assert h is not None and h.seqno == 1 and h.data["who"] == wins[0]


def _register_readers(c: Consensus, sid: str, n: int) -> ShardMachine:
    m = ShardMachine(c, sid)
    m.initialize(ShardState(sid, "orders", KS, VS))
    for i in range(n):

        def fn(st: ShardState, fresh: bool, i: int = i) -> tuple[None, bool]:
            st.register_reader(f"r{i}", m.now_ms(), 60_000)
            return None, True

        m._apply(fn)
    return m


def test_old_versions_are_truncated_and_state_is_readable(stash: Stash) -> None:
    """Every version written as a rollup (``max_diffs=0``): the rows before each rollup
    are deleted once it commits, so the log holds the head alone, a readable JSON
    object of the entries."""
    c = Consensus(stash, max_diffs=0)
    sid = new_shard_id()
    _register_readers(c, sid, 5)
    rows = logs.scan(stash, c.log_name(sid))
    assert [(r.seqno, r.rollup) for r in rows] == [(5, True)]
    c.truncate(sid)
    assert logs.scan(stash, c.log_name(sid)) == rows
    by_key = json.loads(rows[0].data)
    keys = list(by_key)
    assert by_key["meta"]["seqno"] == 5
    assert by_key["shard"]["name"] == "orders"
    assert by_key["shard"]["key_schema"]["fields"] == ["k: int64"]
    assert sorted(k for k in keys if k.startswith("reader/")) == [f"reader/r{i}" for i in range(5)]


def test_versions_are_diffs_after_a_rollup_and_roll_up_every_max_diffs(stash: Stash) -> None:
    """The layout with nobody writing rollups (no maintenance): version 0 is a rollup,
    each later version one diff entry, until twice ``max_diffs`` diffs follow the
    rollup (the hard cap); the next version is a rollup, and the rows before it are
    deleted once it commits.  Every head read assembles the same state as the machine
    that wrote it."""
    c = Consensus(stash, max_diffs=3)
    sid = new_shard_id()
    m = ShardMachine(c, sid)
    m.initialize(ShardState(sid, "orders", KS, VS))
    name = c.log_name(sid)
    layouts = []
    for i in range(9):

        def fn(st: ShardState, fresh: bool, i: int = i) -> tuple[None, bool]:
            st.register_reader(f"r{i}", m.now_ms(), 60_000)
            if i % 3 == 2:
                st.expire_reader(f"r{i - 1}")  # a removed entry travels in a diff too
            return None, True

        m._apply(fn)
        rows = logs.scan(stash, name)
        assert rows == logs.head(stash, name) and rows[0].rollup
        layouts.append((len(rows) - 1, rows[0].seqno))
        fresh_state = ShardMachine(Consensus(stash), sid).fetch()
        assert fresh_state.to_json() == m.state().to_json()
        assert c.head_seqno(sid) == i + 1
    # seqnos 1..6 diffs on rollup 0; 7 a rollup (the hard cap); 8, 9 diffs.
    assert layouts == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (6, 0), (0, 7), (1, 7), (2, 7)]
    assert sorted(m.state().readers) == ["r0", "r2", "r3", "r5", "r6", "r8"]
    h = c.head(sid)
    assert h is not None and h.stored is not None
    assert [k for k, _ in h.stored.diffs] == [diff_key(8), diff_key(9)]
    # The diff entry is readable JSON naming what changed.
    diff = json.loads(logs.scan(stash, name)[-1].data)
    assert diff["seqno"] == 9 and diff["del"] == ["reader/r7"] and "reader/r8" in diff["set"]


@settings(max_examples=60, deadline=None)
@given(
    versions=st.lists(
        st.dictionaries(
            st.sampled_from(["a", "b", "c/1", "c/2", "é", 'q"x']),
            st.one_of(
                st.none(),
                st.integers(),
                st.text(
                    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                    max_size=5,
                ),
                st.lists(st.integers()),
            ),
            max_size=6,
        ),
        min_size=1,
        max_size=12,
    ),
    max_diffs=st.integers(0, 4),
)
def test_any_sequence_of_versions_reads_back_whatever_the_layout(
    versions: list[dict[str, object]], max_diffs: int
) -> None:
    """A model of consensus: each version's entries (random keys added, changed and
    removed) read back exactly from a fresh handle, the diff texts are canonical JSON,
    and a stale compare-and-set commits nothing, whatever ``max_diffs`` is."""
    with Stash.open("memory://", fenced=False) as s:
        c = Consensus(s, max_diffs=max_diffs)
        sid = new_shard_id()
        prev = None
        for seqno, extra in enumerate(versions):
            new = texts(c, seqno, **{k: v for k, v in extra.items() if v is not None})
            plan = c.plan(sid, None if prev is None else seqno - 1, new, prev)
            text = plan.entry.data
            assert canonical_json(json.loads(text)) == text
            if prev is not None:  # a stale expected seqno loses
                assert not c.compare_and_set(sid, seqno - 2 if seqno > 1 else None, new)
            assert c.compare_and_set(sid, None if prev is None else seqno - 1, new, plan=plan)
            prev = Consensus(s).head(sid)
            assert prev is not None and prev.seqno == seqno and prev.texts == new
            assert prev.stored == plan.stored
            d = prev.stored
            # Without maintenance, past twice max_diffs only while the diffs stay
            # under twice the rollup's share.
            assert len(d.diffs) <= 2 * max_diffs or (
                max_diffs > 0 and d.diff_chars < 2 * d.base_chars * ROLLUP_SHARE
            )


def test_a_large_rollup_is_followed_by_diffs_up_to_its_share(stash: Stash) -> None:
    """Past ``max_diffs``, versions stay diffs while the diffs add up to less than
    :data:`ROLLUP_SHARE` of the rollup's length: a rollup rewrites the whole state, and
    a large state once paid a whole rollup every ``max_diffs`` versions (a one-row
    append to a shard of 3,000 inline batches cost 2.3x one to a fresh shard)."""
    c = Consensus(stash, max_diffs=2)
    sid = new_shard_id()
    big = "x" * 8_000
    rows = []
    for seqno in range(60):
        new = texts(c, seqno, big=big, n=seqno)
        assert c.compare_and_set(
            sid, None if seqno == 0 else seqno - 1, new, Consensus(stash).head(sid)
        )
        rows.append(logs.head(stash, c.log_name(sid)))
    h = Consensus(stash).head(sid)
    assert h is not None and h.stored is not None
    layout = [(r[0].seqno, len(r) - 1) for r in rows]
    first_rollup_after_0 = next(seqno for seqno, (at, _n) in enumerate(layout) if at > 0)
    # each diff is about 50 characters: an eighth of a rollup of 8,000 is about 20 of them
    assert first_rollup_after_0 > 10
    diffs = rows[first_rollup_after_0 - 1][1:]
    assert sum(len(r.data) for r in diffs) >= 8_000 * ROLLUP_SHARE - 100


def _damage(stash: Stash, name: str, changes: dict[int, tuple[bool, str] | None]) -> None:
    """Rewrite rows of log ``name`` behind the stash's back (``None`` deletes)."""
    if isinstance(stash, MemoryStash):
        log = stash._store.logs[name]
        for n, row in changes.items():
            if row is None:
                log.pop(n, None)
            else:
                log[n] = row
        return
    assert isinstance(stash, SqlStash)
    with stash.engine.begin() as conn:
        for n, row in changes.items():
            conn.execute(
                sa.text("DELETE FROM logs WHERE name = :n AND seqno = :s"), {"n": name, "s": n}
            )
            if row is not None:
                conn.execute(
                    sa.text("INSERT INTO logs VALUES (:n, :s, :r, :d)"),
                    {"n": name, "s": n, "r": row[0], "d": row[1]},
                )


@pytest.mark.parametrize(
    "damage",
    [
        "gap",
        "garbage",
        "not json",
        "wrong seqno",
        "no meta",
        "sets a diff key",
        "removes a missing entry",
        "orphan",
        "rollup of another version",
        "rollup not an object",
    ],
)
def test_a_damaged_diff_entry_reads_as_a_corrupt_collection(stash: Stash, damage: str) -> None:
    """A diff row missing, malformed, out of order or without a rollup under it, or a
    malformed rollup, is a ConsensusError naming the shard, never a state."""
    c = Consensus(stash, max_diffs=8)
    sid = new_shard_id()
    _register_readers(c, sid, 3)
    name = c.log_name(sid)
    rows = {r.seqno: r for r in logs.scan(stash, name)}
    d2 = json.loads(rows[2].data)
    r0 = json.loads(rows[0].data)

    def diff(v: object) -> tuple[bool, str]:
        return (False, canonical_json(v))

    changes: dict[int, tuple[bool, str] | None] = {
        "gap": {2: None},
        "garbage": {2: diff([1, 2])},
        "not json": {2: (False, "{not json")},
        "wrong seqno": {2: diff({**d2, "seqno": 7})},
        "no meta": {2: diff({**d2, "set": {}})},
        "sets a diff key": {2: diff({**d2, "set": {**d2["set"], diff_key(9): 1}})},
        "removes a missing entry": {2: diff({**d2, "del": ["reader/nobody"]})},
        "orphan": {0: None},
        "rollup of another version": {0: (True, canonical_json({**r0, "meta": {"seqno": 4}}))},
        "rollup not an object": {0: (True, "[1]")},
    }[damage]
    _damage(stash, name, changes)
    with pytest.raises(ConsensusError, match=f"shard {sid} is corrupt"):
        Consensus(stash).head(sid)


def test_a_shard_written_whole_goes_on_in_diffs_and_back(stash: Stash) -> None:
    """A shard whose versions were all written as rollups (as before diffs existed, or
    by a ``max_diffs=0`` handle) is read and continued by a handle writing diffs, and
    the other way round: layouts mix on one shard, every head reads the same state."""
    sid = new_shard_id()
    whole = Consensus(stash, max_diffs=0)
    m0 = _register_readers(whole, sid, 3)
    diffs = Consensus(stash, max_diffs=4)
    m1 = ShardMachine(diffs, sid)
    for i in range(3, 9):

        def fn(st: ShardState, fresh: bool, i: int = i) -> tuple[None, bool]:
            st.register_reader(f"r{i}", m1.now_ms(), 60_000)
            return None, True

        (m1 if i < 6 else m0)._apply(fn)  # m0's cache is stale: it re-reads and goes on
        for c in (whole, diffs):
            assert ShardMachine(c, sid).fetch().to_json() == (m1 if i < 6 else m0).state().to_json()
    assert sorted(ShardMachine(Consensus(stash), sid).fetch().readers) == [
        f"r{i}" for i in range(9)
    ]
    rows = logs.head(stash, whole.log_name(sid))
    assert [r.rollup for r in rows] == [True]  # m0 rolled them up


def test_state_entries_may_not_use_the_diff_namespace(stash: Stash) -> None:
    with pytest.raises(InvalidUsage, match="max_diffs must be >= 0"):
        Consensus(stash, max_diffs=-1)
    c = Consensus(stash, max_diffs=2)
    sid = new_shard_id()
    v0 = texts(c, 0)
    assert c.compare_and_set(sid, None, v0)
    with pytest.raises(InvalidUsage, match="namespace"):
        c.plan(sid, 0, {**texts(c, 1), diff_key(5): "1"}, c.head(sid))
    with pytest.raises(InvalidUsage, match="namespace"):
        c.plan(sid, 0, {**texts(c, 1), diff_key(5): "1"}, v0)


def test_registry(stash: Stash) -> None:
    c = Consensus(stash)
    a = c.register("orders", 1)
    assert c.register("orders", 2) == a
    assert c.lookup("orders") == a and c.lookup("nope") is None
    ids: list[str] = []
    barrier = threading.Barrier(4)

    def reg() -> None:
        barrier.wait()
        ids.append(c.register("customers", 3))

    threads = [threading.Thread(target=reg) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1
    assert c.shards() == {"customers": ids[0], "orders": a}
    validate_shard_id(a)


@pytest.mark.parametrize("bad", ["", "../x", "a/b", ".hidden", "x" * 201, "a b", "é"])
def test_shard_names_are_validated(bad: str) -> None:
    with pytest.raises(InvalidUsage, match="shard name"):
        validate_shard_name(bad)


@pytest.mark.parametrize("bad", ["x", "s123", "S" + "0" * 36, "s../../etc"])
def test_shard_ids_are_validated(bad: str) -> None:
    with pytest.raises(InvalidUsage, match="shard id"):
        validate_shard_id(bad)


def _part(i: int, inline: bool) -> PartRef:
    if inline:
        return PartRef(None, 1, 3, "ab" * 32, inline=b"abc")
    return PartRef(f"s/b/1-x/{i}.parquet", 10, 100, "cd" * 32)


def _state_with_everything() -> ShardState:
    sid = new_shard_id()
    st = ShardState(sid, "orders", KS, VS)
    for i in range(6):
        hb = HollowBatch(Description(ac(i), ac(i + 1)), (_part(i, i % 2 == 0),), 1)
        st.trace.push_batch(hb)
    st.register_reader("r1", 1000, 60_000, "read handle")
    st.heartbeat_writer("w1", 1000, 60_000)
    st.retired_upper = 3
    st.seqno = 7
    return st


def test_state_json_round_trips() -> None:
    st = _state_with_everything()
    assert ShardState.from_json(st.to_json()) == st
    assert ShardState.from_entries(st.to_entries()) == st
    assert st.inline_bytes() == 9 and st.blob_bytes() == 300
    assert st.referenced_blob_keys() == {f"s/b/1-x/{i}.parquet" for i in (1, 3, 5)}


def test_malformed_state_is_reported() -> None:
    st = _state_with_everything()
    entries = st.to_entries()
    del entries["trace/hollow_batches/0-1"]
    with pytest.raises(Exception, match="seqno 7"):
        ShardState.from_entries(entries)


def test_reader_leases_hold_the_since() -> None:
    st = ShardState(new_shard_id(), "orders", KS, VS)
    st.register_reader("a", now_ms=0, lease_ms=1000)
    st.register_reader("b", now_ms=0, lease_ms=10_000)
    st.downgrade_reader_since("a", ac(5), now_ms=10)
    assert st.since == ac(0)  # b still holds 0
    st.downgrade_reader_since("b", ac(3), now_ms=10)
    assert st.since == ac(3)  # the meet of the holds
    with pytest.raises(InvalidUsage, match="backwards"):
        st.downgrade_reader_since("a", ac(4), now_ms=20)
    # a's lease ran out long ago; b's did not: expiring a releases nothing below b.
    assert st.expire_leases(now_ms=5000)
    assert set(st.readers) == {"b"} and st.since == ac(3)
    with pytest.raises(LeaseExpired):
        st.heartbeat_reader("a", 5000)
    st.downgrade_reader_since("b", ac(8), now_ms=5000)
    assert st.since == ac(8)
    st.expire_reader("b")
    assert st.since == ac(8)  # no reader: the since stays
    with pytest.raises(InvalidUsage, match="already"):
        st.register_reader("c", 0, 10, since=ac(2))


def test_machine_retries_lost_races_on_fresh_state(stash: Stash) -> None:
    c = Consensus(stash)
    sid = new_shard_id()
    m1, m2 = ShardMachine(c, sid), ShardMachine(c, sid)
    m1.initialize(ShardState(sid, "orders", KS, VS))
    m2.state()  # cache version 0

    def add(name: str):  # type: ignore[no-untyped-def]
        def fn(st: ShardState, fresh: bool) -> tuple[None, bool]:
            st.register_reader(name, m1.now_ms(), 60_000)
            return None, True

        return fn

    m1._apply(add("one"))
    m2._apply(add("two"))  # m2's cache is stale: it loses once, re-reads, re-applies
    assert m2.metrics["cas_lost"] == 1
    assert set(m1.fetch().readers) == {"one", "two"}
    assert m1.fetch().seqno == 2

    def fails_on_stale(st: ShardState, fresh: bool) -> tuple[None, bool]:
        if "three" not in st.readers:
            if not fresh:
                raise Stale()
            raise InvalidUsage("really not there")
        return None, False

    with pytest.raises(InvalidUsage, match="really"):
        m1._apply(fails_on_stale)
    assert m1.fetch().seqno == 2  # nothing committed


class BrokenStash:
    """A stash whose every call fails (determinately)."""

    def __init__(self, inner: Stash) -> None:
        self.inner = inner

    def collection(self, *a: object, **k: object) -> object:
        return self.inner.collection(*a, **k)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> object:
        def fail(*a: object, **k: object) -> None:
            raise StashError("connection refused")

        return fail


def test_stash_failures_become_consensus_errors(stash: Stash) -> None:
    c = Consensus(BrokenStash(stash), retries=2)  # type: ignore[arg-type]
    sid = new_shard_id()
    with pytest.raises(ConsensusError, match="connection refused") as e:
        c.head(sid)
    assert not e.value.is_indeterminate()


def test_merge_results_retire_replaced_blob_keys() -> None:
    st = _state_with_everything()
    reqs = st.trace.all_fueled_merge_reqs()
    if not reqs:
        for i in range(6, 12):
            reqs += st.trace.push_batch(
                HollowBatch(Description(ac(i), ac(i + 1)), (_part(i, False),), 1)
            )
    assert reqs
    req = reqs[0]
    out = HollowBatch(req.desc, (PartRef("s/c/2-y/out.parquet", 1, 10, "ef" * 32),), 1)
    before = st.referenced_blob_keys()
    r = st.apply_merge_res(FueledMergeRes(out), now_ms=4242)
    assert r.applied()
    gone = before - st.referenced_blob_keys()
    assert gone and st.retire_adds == {k: 4242 for k in gone}
    assert "s/c/2-y/out.parquet" in st.referenced_blob_keys()
    st.trace.validate()


def test_a_diff_version_is_one_conditional_insert_and_the_commit(tmp_path: Path) -> None:
    """On SQLite, publishing a version that is a diff runs ``BEGIN IMMEDIATE``, one
    ``INSERT`` into the shard's log and ``COMMIT``: no frontier rows, no consolidation
    (the stash ``append`` it replaced ran about ten statements)."""
    with Stash.open(f"sqlite:///{tmp_path}/s.db", fenced=False) as s:
        assert isinstance(s, SqlStash)
        c = Consensus(s)
        sid = new_shard_id()
        v0 = texts(c, 0, a=1)
        assert c.compare_and_set(sid, None, v0)
        h = c.head(sid)
        statements: list[str] = []
        sa.event.listen(
            s.engine,
            "checkout",
            lambda dbc, _rec, _proxy: dbc.set_trace_callback(statements.append),
        )
        if s._held is not None:  # the connection the stash holds for its writes
            s._held.driver_connection.set_trace_callback(statements.append)
        assert c.compare_and_set(sid, 0, texts(c, 1, a=2), h)
        assert [t.split()[0] for t in statements] == ["BEGIN", "INSERT", "COMMIT"]
        assert "INTO logs" in statements[1]
        assert c.head_seqno(sid) == 1
