"""Adversarial tests of consensus's rollup + diff layout (31215db).

Each shard's versions are a rollup plus one ``diff/<seqno>`` entry per later version, a
new rollup every ``max_diffs`` versions retracting the diffs; ShardMachine caches the
stored layout and multi-shard transactions send staged plans.  The tests attack the
layout across rollup boundaries: racing machines and clients (threads and processes)
with different ``max_diffs``, indeterminate commits landing (or not) on a diff or a
rollup, transactions interleaved with appends at the 31st/32nd/33rd version, readers,
listen and GC while diffs accumulate, and Postgres (``jsonb`` values).

The defects found (a version handed in as texts alone rolled up on texts never stored;
a plan made on texts before the head reached ``expected`` moving the since past the
rollup) are fixed; their tests, and those of what held, are regression tests.
"""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persist import ConsensusError, MemoryBlob, PersistClient, UpperMismatch, collect_garbage
from persist.consensus import Consensus, VersionedData
from persist.errors import InvalidUsage
from persist.ids import new_shard_id
from persist.machine import ShardMachine, Stale
from persist.state import ShardState
from stash import IndeterminateError, Stash, logs
from tests.support.procs import process_context

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


# ----------------------------------------------------------------------------- helpers
@pytest.fixture(params=["memory", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return "memory://" if request.param == "memory" else f"sqlite:///{tmp_path}/stash.db"


def _pg(postgres_url: str) -> str:
    from tests.support.dbutil import migrate_to_head

    migrate_to_head(postgres_url)
    return postgres_url


@pytest.fixture(params=["sqlite", "postgres"])
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store several handles (or processes) can share."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/stash.db"
    return _pg(str(request.getfixturevalue("postgres_url")))


def _texts(c: Consensus, seqno: int, **extra: object) -> dict[str, str]:
    d: dict[str, object] = {"meta": {"seqno": seqno}, **extra}
    return {k: c.encode(v) for k, v in d.items()}


def _add_reader(m: ShardMachine, rid: str) -> None:
    def fn(st: ShardState, fresh: bool) -> tuple[None, bool]:
        if rid in st.readers:
            return None, False
        st.register_reader(rid, m.now_ms(), 3_600_000)
        return None, True

    m._apply(fn)


def _physical_rows(stash: Stash, c: Consensus, sid: str) -> list[logs.LogRow]:
    c.truncate(sid)
    return logs.scan(stash, c.log_name(sid))


def _check_layout(stash: Stash, c: Consensus, sid: str) -> None:
    """Once truncated, the log holds exactly the head's rollup row and its diff rows, in
    seqno order without a gap (no diff left behind by a rollup)."""
    h = Consensus(stash).head(sid)
    assert h is not None and h.stored is not None
    rows = _physical_rows(stash, c, sid)
    first = h.seqno - len(h.stored.diffs)
    assert [(r.seqno, r.rollup) for r in rows] == [
        (first + i, i == 0) for i in range(len(h.stored.diffs) + 1)
    ]
    assert json.loads(rows[0].data) == {k: json.loads(t) for k, t in h.stored.base.items()}
    assert [r.data for r in rows[1:]] == [t for _, t in h.stored.diffs]
    assert logs.head_seqno(stash, c.log_name(sid)) == h.seqno


def _snapshot_counts(r: Any, upper: int) -> Counter[str]:
    got: Counter[str] = Counter()
    if upper == 0:
        return got
    snap = r.snapshot(upper - 1)
    for k, d in zip(snap.column("k").to_pylist(), snap.column("_diff").to_pylist(), strict=True):
        got[k] += d
    return +got


def _append(w: Any, key: str, token: str | None = None) -> None:
    """Append ``key`` once at the current upper (retrying lost upper races)."""
    for _ in range(10_000):
        up = w.fetch_recent_upper().as_option()
        try:
            w.compare_and_append([(((key,), (1,)), up, 1)], up, up + 1, idempotency_token=token)
            return
        except UpperMismatch:
            continue
    raise AssertionError(f"append of {key} never won a race")


class _Indeterminate:
    """Stash wrapper: the armed append (a shard's log entry goes in an ``append`` too)
    raises IndeterminateError, after committing (``landed``) or without touching the
    store."""

    def __init__(self, inner: Stash) -> None:
        self.inner = inner
        self.armed: bool | None = None  # None: off; True: lands; False: does not
        self.hits = 0

    def append(self, batches: Any) -> None:
        armed, self.armed = self.armed, None
        if armed is None:
            self.inner.append(batches)
            return
        self.hits += 1
        if armed:
            self.inner.append(batches)
        raise IndeterminateError("injected: connection lost during COMMIT")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# ============================================= fixed during the session
def test_a_plan_made_before_the_head_reached_expected_leaves_the_shard_writable(
    url: str,
) -> None:
    """Invariant: a version that commits leaves the collection's since at its rollup's
    seqno, so the next version (a diff on the head) commits.  Found: a plan made on
    texts alone while the head was behind ``expected`` was a diff with ``compact`` its
    own seqno; once another writer committed ``expected``, the early plan's append
    passed the lower check, set the since past the rollup, and every later diff was
    refused ("compact request {0} is less than the current since frontier {2}").  Now
    no such plan is made (``InvalidUsage`` naming the head), ``compare_and_set`` on
    texts of a version that is not the head reports a lost race, and the shard goes
    on."""
    with Stash.open(url, fenced=False) as s:
        c = Consensus(s, max_diffs=8)
        sid = new_shard_id()
        assert c.compare_and_set(sid, None, _texts(c, 0, a=0))
        t1 = _texts(c, 1, a=1)
        with pytest.raises(InvalidUsage, match="the head is version 0"):
            c.plan(sid, 1, _texts(c, 2, a=2), t1)  # the head is still version 0
        assert not c.compare_and_set(sid, 1, _texts(c, 2, a=2), t1)  # nothing committed
        assert c.compare_and_set(sid, 0, t1, c.head(sid))  # another writer: version 1
        assert c.compare_and_set(sid, 1, _texts(c, 2, a=2), t1)
        h = c.head(sid)
        assert h is not None and h.seqno == 2 and h.data["a"] == 2
        # The shard goes on: the next version on the head commits.
        assert c.compare_and_set(sid, 2, _texts(c, 3, a=3), h)
        h3 = Consensus(s).head(sid)
        assert h3 is not None and h3.seqno == 3 and h3.data["a"] == 3


# ============================================= fixed during the session (c240bbe)
@pytest.mark.parametrize("form", ["texts", "versioned-without-layout"])
def test_compare_and_set_on_the_heads_texts_publishes_the_new_version(url: str, form: str) -> None:
    """Invariant: ``compare_and_set(expected, new, prev)`` with ``prev`` the ``expected``
    version in a documented form (its entry texts; a ``VersionedData`` with
    ``stored=None``) either publishes ``new`` (the next head read returns it) or refuses
    committing nothing; it never commits a batch that turns the collection corrupt.
    Before c240bbe: once the head had diff entries, passing its texts committed a
    "rollup" built on the assembled texts (retracting rows never stored, leaving the
    diffs) and ``head`` raised "is corrupt: entry ... has multiplicity -1"."""
    with Stash.open(url, fenced=False) as s:
        c = Consensus(s, max_diffs=8)
        sid = new_shard_id()
        assert c.compare_and_set(sid, None, _texts(c, 0, a=1, b="keep"))
        h0 = c.head(sid)
        assert c.compare_and_set(sid, 0, _texts(c, 1, a=2, b="keep"), h0)
        h = c.head(sid)
        assert h is not None and h.stored is not None and len(h.stored.diffs) == 1
        prev: Any = h.texts if form == "texts" else VersionedData(h.seqno, h.data, h.texts)
        new = _texts(c, 2, a=3, b="keep")
        try:
            ok = c.compare_and_set(sid, 1, new, prev)
        except (InvalidUsage, ConsensusError):
            ok = False  # a refusal is fine, if nothing was committed
        after = Consensus(s).head(sid)
        assert after is not None
        if ok:
            assert after.seqno == 2 and after.texts == new
        else:
            assert after.seqno == 1 and after.texts == h.texts
        _check_layout(s, c, sid)


def test_the_rollup_rule_as_documented(url: str) -> None:
    """The rule as documented since c240bbe (it used to read "once the diffs outweigh
    the rollup", which small states never obeyed): diffs go on while their summed
    length stays within both the rollup's and :data:`MAX_DIFF_CHARS`; past both, a
    rollup is due (maintenance writes it as its own version); a version whose diffs
    would pass twice both is a rollup itself (nobody wrote one); a diff alone longer
    than the constant is one."""
    from persist.consensus import MAX_DIFF_CHARS

    with Stash.open(url, fenced=False) as s:
        c = Consensus(s, max_diffs=32)
        sid = new_shard_id()
        assert c.compare_and_set(sid, None, _texts(c, 0))
        n = 0

        due: list[bool] = []

        def put(**extra: object) -> int:
            nonlocal n
            prev = c.head(sid)
            assert prev is not None
            n += 1
            plan = c.plan(sid, n - 1, _texts(c, n, **extra), prev)
            assert c.compare_and_set(sid, n - 1, _texts(c, n, **extra), plan=plan)
            due.append(c.rollup_due(plan.stored))
            return len(plan.stored.diffs)

        # A small rollup: eight ~2,000-character diffs stay diffs (within 1 MiB).
        assert [put(blob=f"{i}" * 2000) for i in range(8)] == list(range(1, 9))
        assert not any(due)
        # A diff alone past the constant: a rollup (of about 1.2 MiB).
        assert put(big="x" * (MAX_DIFF_CHARS + 200_000)) == 0
        # Diffs of 400,000 characters each: within the rollup's length; past both, a
        # rollup is due (maintenance writes it); past twice both, the version is one.
        due.clear()
        got = [put(blob=f"{i}" * 400_000) for i in range(8)]
        assert got[:3] == [1, 2, 3] and due[:2] == [False, False] and True in due[2:4]
        first = got.index(0)
        assert 5 <= first < 8 and got[first - 1] == first and due[first - 1]
        _check_layout(s, c, sid)


# ================================================================ regression tests
@pytest.mark.parametrize("max_diffs", [1, 2, 31, 32])
def test_machines_with_other_max_diffs_race_across_rollups(shared_url: str, max_diffs: int) -> None:
    """Three machines (own stash handles; ``max_diffs`` 0, N and 32) add readers to one
    shard concurrently for well past a rollup boundary: every transition lands once, the
    head reads back on a fresh handle, and the collection holds exactly the head's
    rollup and diffs (every rollup retracted exactly the stored texts: SQLite text
    equality, Postgres jsonb)."""
    sid = new_shard_id()
    stashes = [Stash.open(shared_url, fenced=False) for _ in range(3)]
    try:
        cons = [
            Consensus(s, max_diffs=md) for s, md in zip(stashes, [0, max_diffs, 32], strict=True)
        ]
        ms = [ShardMachine(c, sid) for c in cons]
        ms[0].initialize(ShardState(sid, "adv", KS, VS))
        errors: list[BaseException] = []
        per = 14

        def run(i: int) -> None:
            try:
                for j in range(per):
                    _add_reader(ms[i], f"m{i}x{j}")
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        ts = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors
        st = ShardMachine(Consensus(stashes[0]), sid).fetch()
        want = {f"m{i}x{j}" for i in range(3) for j in range(per)}
        assert set(st.readers) == want
        assert st.seqno == 3 * per
        _check_layout(stashes[0], cons[1], sid)
    finally:
        for s in stashes:
            s.close()


def test_a_stale_cached_layout_is_never_built_on(url: str) -> None:
    """Machine A caches a head with diffs; machine B (``max_diffs=0``) rolls up under it;
    A's next transition loses its compare-and-set (its cached seqno is old), re-reads
    and builds on the rollup: no diff left behind, no stale retraction."""
    with Stash.open(url, fenced=False) as s:
        sid = new_shard_id()
        a = ShardMachine(Consensus(s, max_diffs=32), sid)
        b = ShardMachine(Consensus(s, max_diffs=0), sid)
        a.initialize(ShardState(sid, "adv", KS, VS))
        for j in range(5):
            _add_reader(a, f"a{j}")
        _add_reader(b, "b0")  # a rollup retracting a's 5 diffs
        for j in range(5, 40):  # a: diffs on b's rollup, then a rollup of its own
            _add_reader(a, f"a{j}")
        _add_reader(b, "b1")
        _add_reader(a, "a40")
        st = ShardMachine(Consensus(s), sid).fetch()
        assert set(st.readers) == {*(f"a{j}" for j in range(41)), "b0", "b1"}
        _check_layout(s, Consensus(s), sid)


@pytest.mark.parametrize("landed", [True, False])
@pytest.mark.parametrize("at", [1, 31, 32, 33, 34, 66])
def test_an_indeterminate_version_on_a_diff_or_a_rollup_is_resolved(
    url: str, at: int, landed: bool
) -> None:
    """The append of version ``at`` (with ``max_diffs=32``: 1 to 32 are diffs, 33 and
    66 rollups, 34 the first diff on a rollup) loses its acknowledgement, having committed or not: the machine re-reads,
    the transition recognises its own effect (or runs again), and the shard ends with
    every reader once and a clean layout."""
    with Stash.open(url, fenced=False) as inner:
        flaky = _Indeterminate(inner)
        c = Consensus(flaky, max_diffs=32)  # type: ignore[arg-type]
        sid = new_shard_id()
        m = ShardMachine(c, sid)
        m.initialize(ShardState(sid, "adv", KS, VS))
        for j in range(1, at + 4):
            if j == at:
                flaky.armed = landed
            _add_reader(m, f"r{j}")
        assert flaky.hits == 1
        st = ShardMachine(Consensus(inner), sid).fetch()
        assert set(st.readers) == {f"r{j}" for j in range(1, at + 4)}
        assert st.seqno == at + 3
        _check_layout(inner, Consensus(inner), sid)


@pytest.mark.parametrize("landed", [True, False])
@pytest.mark.parametrize("at", [31, 32, 33])
def test_an_indeterminate_append_at_a_rollup_boundary_lands_once(
    url: str, at: int, landed: bool
) -> None:
    """A PersistClient append whose version is the 31st/32nd/33rd after the shard's
    creation loses its acknowledgement (committed or not) and is retried with its
    idempotency token: the row is visible exactly once."""
    with Stash.open(url, fenced=False) as inner:
        flaky = _Indeterminate(inner)
        client = PersistClient(flaky, MemoryBlob(), compaction="inline")  # type: ignore[arg-type]
        client.consensus.max_diffs = 32  # the cadence the boundaries above are counted in
        w, r = client.open("adv", KS, VS)
        w.resolve_max_wait = 0.001
        m = client.machine(w.shard_id)
        i = 0
        while m.seqno() + 1 < at:
            _append(w, f"k{i}")
            i += 1
        flaky.armed = landed
        token: str | None = None
        try:
            _append(w, "boundary")
        except ConsensusError as e:
            assert e.is_indeterminate()
            token = e.idempotency_token
            _append(w, "boundary", token=token)
        got = _snapshot_counts(r, w.fetch_recent_upper().as_option() or 0)
        assert got == Counter({**{f"k{j}": 1 for j in range(i)}, "boundary": 1})
        _check_layout(inner, client.consensus, w.shard_id)
        client.close()


def test_txns_interleaved_with_appends_across_rollup_boundaries(shared_url: str) -> None:
    """Two clients (``max_diffs`` 32 and 0) alternate single-shard appends and
    two-shard transactions so that transactions' staged versions land on the 31st,
    32nd and 33rd versions (and later boundaries) of both shards, racing each other in
    threads: every acknowledged row is visible once on both shards, and both
    collections hold exactly their heads' layouts."""
    stashes = [Stash.open(shared_url, fenced=False) for _ in range(2)]
    blob = MemoryBlob()
    clients = [PersistClient(s, blob, compaction="inline") for s in stashes]
    try:
        clients[0].consensus.max_diffs = 32  # the cadence the boundaries are counted in
        clients[1].consensus.max_diffs = 0
        handles = [(c.open("a", KS, VS), c.open("b", KS, VS)) for c in clients]
        acked: Counter[tuple[str, str]] = Counter()
        lock = threading.Lock()
        errors: list[BaseException] = []

        def run(i: int) -> None:
            rng = random.Random(i)
            c = clients[i]
            (wa, _), (wb, _) = handles[i]
            try:
                for j in range(45):
                    key = f"c{i}n{j}"
                    if rng.random() < 0.4:
                        with c.begin() as txn:
                            tbl = pa.table({"k": [key], "v": [1]})
                            txn.write("a", tbl)
                            txn.write("b", tbl)
                            txn.commit()
                        with lock:
                            acked["a", key] += 1
                            acked["b", key] += 1
                    else:
                        shard, w = ("a", wa) if rng.random() < 0.5 else ("b", wb)
                        _append(w, key)
                        with lock:
                            acked[shard, key] += 1
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors
        for shard in ("a", "b"):
            (w, r) = handles[0][0] if shard == "a" else handles[0][1]
            got = _snapshot_counts(r, w.fetch_recent_upper().as_option() or 0)
            assert got == Counter({k: n for (sh, k), n in acked.items() if sh == shard})
            _check_layout(stashes[0], clients[0].consensus, w.shard_id)
            assert clients[0].machine(w.shard_id).fetch().seqno > 64
    finally:
        for c in clients:
            c.close()
        for s in stashes:
            s.close()


def test_readers_listen_and_gc_while_diffs_accumulate(url: str) -> None:
    """A second client reads every version (snapshot, a listen, heartbeats) while the
    writer's diffs accumulate and roll up, and GC runs every few versions: each
    snapshot is exactly the acknowledged prefix and the listen sees every row once."""
    with Stash.open(url, fenced=False) as s:
        blob = MemoryBlob()
        wc = PersistClient(s, blob, compaction="inline", inline_max_bytes=0)
        rc = PersistClient(s, blob, compaction="off")
        rc.consensus.max_diffs = 3
        w, _ = wc.open("adv", KS, VS)
        _, r = rc.open("adv", KS, VS)
        seen: Counter[str] = Counter()
        with r.listen(0) as lis:
            events: Iterator[Any] = iter(lis)
            for i in range(70):
                w.compare_and_append([((((f"k{i}",), (1,)), i, 1))], i, i + 1)
                assert _snapshot_counts(r, i + 1) == Counter({f"k{j}": 1 for j in range(i + 1)})
                while True:
                    ev = next(events)
                    if ev.kind == "updates":
                        seen.update(ev.updates.column("k").to_pylist())
                    elif ev.progress.as_option() == i + 1:
                        break
                if i % 7 == 6:
                    collect_garbage(wc, "adv", grace_seconds=0)
                    r.downgrade_since(i - 3)
        assert seen == Counter({f"k{j}": 1 for j in range(1, 70)})
        _check_layout(s, wc.consensus, w.shard_id)
        wc.close()
        rc.close()


def _process_writer(url: str, blob_root: str, i: int, n: int, max_diffs: int, q: Any) -> None:
    s = Stash.open(url, fenced=False)
    from persist import FileBlob

    c = PersistClient(s, FileBlob(blob_root), compaction="inline")
    c.consensus.max_diffs = max_diffs
    w, _ = c.open("adv", KS, VS)
    for j in range(n):
        _append(w, f"p{i}n{j}")
    c.close()
    s.close()
    q.put(i)


@pytest.mark.campaign
def test_processes_with_other_max_diffs_append_across_rollups(
    shared_url: str, tmp_path: Path
) -> None:
    """Three processes (``max_diffs`` 0, 2 and 32) append to one shard concurrently
    through many rollups: every row once, the head and layout clean."""
    blob_root = str(tmp_path / "blob")
    Path(blob_root).mkdir()
    from persist import FileBlob

    with Stash.open(shared_url, fenced=False) as s:
        c = PersistClient(s, FileBlob(blob_root), compaction="off")
        w, r = c.open("adv", KS, VS)
        ctx = process_context()
        q = ctx.Queue()
        n = 25
        procs = [
            ctx.Process(target=_process_writer, args=(shared_url, blob_root, i, n, md, q))
            for i, md in enumerate([0, 2, 32])
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
            assert p.exitcode == 0
        assert sorted(q.get(timeout=5) for _ in procs) == [0, 1, 2]
        got = _snapshot_counts(r, w.fetch_recent_upper().as_option() or 0)
        assert got == Counter({f"p{i}n{j}": 1 for i in range(3) for j in range(n)})
        _check_layout(s, c.consensus, w.shard_id)
        c.close()


def test_postgres_jsonb_round_trip_keeps_the_layout(postgres_url: str) -> None:
    """On Postgres the values come back from ``jsonb``: the layout a fresh handle reads
    equals the one the writer planned (diff texts and rollup texts alike), for entries
    with unicode, escapes, large and fractional numbers; a rollup by another handle
    leaves no residue."""
    url = _pg(postgres_url)
    with Stash.open(url, fenced=False) as s:
        c = Consensus(s, max_diffs=3)
        sid = new_shard_id()
        odd: list[dict[str, object]] = [
            {"u": "é\u2028\U0001f600", "q": 'a"b\\c\n\t'},
            {"n": [1e-7, 0.1, 2**70, -0.0, 1e22, 123456789.125]},
            {"nested": {"z": 1, "a": [None, True, False, {"y": 2.5}]}},
            {"u": "ascii again"},
        ]
        prev: VersionedData | None = None
        for n in range(12):
            extra = odd[n % len(odd)]
            new = _texts(c, n, **extra, **{f"k{n % 5}": n})
            plan = c.plan(sid, None if prev is None else n - 1, new, prev)
            assert c.compare_and_set(sid, None if prev is None else n - 1, new, plan=plan)
            prev = Consensus(s).head(sid)
            assert prev is not None and prev.texts == new
            assert prev.stored == plan.stored
        other = Consensus(s, max_diffs=0)
        assert prev is not None
        assert other.compare_and_set(sid, 11, _texts(other, 12, fin=True), prev)
        _check_layout(s, c, sid)
        assert [r.rollup for r in logs.scan(s, c.log_name(sid))] == [True]


def test_txn_staged_plans_survive_a_lost_race_at_the_rollup(url: str) -> None:
    """A transaction staged on a shard's 31st version loses its seqno race to an append
    that makes the 32nd (a diff) and the 33rd (the rollup) versions first: it re-stages
    on the fresh layout and commits; both shards read back whole."""
    with Stash.open(url, fenced=False) as s:
        blob = MemoryBlob()  # one store: a shard records its store's identity
        c1 = PersistClient(s, blob, compaction="off")
        c2 = PersistClient(s, blob, compaction="off")
        for c in (c1, c2):  # the cadence the 31st/32nd/33rd versions are counted in
            c.consensus.max_diffs = 32
        w1, r1 = c1.open("a", KS, VS)
        c1.open("b", KS, VS)
        w2, _ = c2.open("a", KS, VS)
        m = c1.machine(w1.shard_id)
        i = 0
        while m.recent().seqno < 30:
            _append(w1, f"x{i}")
            i += 1
        txn = c1.begin()
        tbl = pa.table({"k": ["t"], "v": [1]})
        txn.write("a", tbl)
        txn.write("b", tbl)
        orig: Callable[..., Any] = m._stage
        raced = False

        def stage(*args: Any, **kw: Any) -> Any:
            nonlocal raced
            if not raced:
                raced = True
                _append(w2, "y0")
                _append(w2, "y1")
            return orig(*args, **kw)

        m._stage = stage  # type: ignore[method-assign]
        txn.commit()
        assert raced and m.metrics["cas"] > 0
        got = _snapshot_counts(r1, w1.fetch_recent_upper().as_option() or 0)
        assert got == Counter({**{f"x{j}": 1 for j in range(i)}, "y0": 1, "y1": 1, "t": 1})
        _check_layout(s, c1.consensus, w1.shard_id)
        c1.close()
        c2.close()


def _remove_reader(m: ShardMachine, rid: str) -> None:
    def fn(st: ShardState, fresh: bool) -> tuple[None, bool]:
        if rid not in st.readers and not fresh:
            raise Stale()  # the cached state may predate the reader
        return None, st.expire_reader(rid)

    m._apply(fn)


@settings(max_examples=40, deadline=None)
@given(
    max_diffs=st.lists(st.sampled_from([0, 1, 2, 3, 32]), min_size=3, max_size=3),
    ops=st.lists(
        st.tuples(
            st.integers(0, 2),
            st.sampled_from(["add", "add", "remove", "landed", "lost"]),
            st.integers(0, 1000),
        ),
        min_size=1,
        max_size=60,
    ),
)
def test_model_of_machines_faults_and_layouts(
    max_diffs: list[int], ops: list[tuple[int, str, int]]
) -> None:
    """A model: three machines on one shard (each its own ``max_diffs`` and a stash
    handle whose next append may lose its acknowledgement, having committed or not)
    add and remove readers in a random interleaving; the state read on a fresh handle
    is the model's and the collection holds exactly the head's layout."""
    with Stash.open("memory://", fenced=False) as inner:
        sid = new_shard_id()
        wraps = [_Indeterminate(inner) for _ in range(3)]
        ms = [
            ShardMachine(Consensus(w, max_diffs=md), sid)  # type: ignore[arg-type]
            for w, md in zip(wraps, max_diffs, strict=True)
        ]
        ms[0].initialize(ShardState(sid, "adv", KS, VS))
        model: set[str] = set()
        for n, (i, kind, pick) in enumerate(ops):
            if kind == "remove":
                if model:
                    rid = sorted(model)[pick % len(model)]
                    _remove_reader(ms[i], rid)
                    model.discard(rid)
                continue
            if kind in ("landed", "lost"):
                wraps[i].armed = kind == "landed"
            _add_reader(ms[i], f"r{n}")
            model.add(f"r{n}")
        st_ = ShardMachine(Consensus(inner), sid).fetch()
        assert set(st_.readers) == model
        _check_layout(inner, Consensus(inner), sid)
