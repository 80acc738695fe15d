"""Row-level changes on shards (:mod:`persist.rows`, ``WriteHandle.upsert`` / ``delete`` /
``update``): the planning, the handle's read-plan-append loop, a model test against a
dict, four processes racing ``update(v = v + 1)``, schema evolution and pruning."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from persist import (
    ChangeContended,
    ConsensusError,
    CorruptPart,
    FileBlob,
    InvalidUsage,
    MemoryBlob,
    PersistClient,
    RowChanges,
    SchemaMismatch,
    UpperMismatch,
)
from persist import rows as rows_mod
from stash import Antichain, Stash
from tests.support.procs import process_context
from tests.support.stash_faults import AckLostStash

KEY = pa.schema([pa.field("id", pa.int64(), False)])
VAL = pa.schema([pa.field("v", pa.int64())])


@pytest.fixture()
def client() -> Iterator[PersistClient]:
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="inline")
    try:
        yield c
    finally:
        c.close()
        s.close()


def live(r: Any, w: Any) -> Counter[tuple[Any, ...]]:
    """The shard's contents at ``upper - 1`` as ``{(id, v, ...): count}``."""
    upper = w.fetch_recent_upper().as_option()
    if not upper:
        return Counter()
    t = r.snapshot(upper - 1)
    names = [n for n in t.column_names if n not in ("_time", "_diff")]
    cols = [t.column(n).to_pylist() for n in names]
    return Counter(dict(zip(zip(*cols, strict=True), t.column("_diff").to_pylist(), strict=True)))


def table(rows: list[tuple[int, int | None]]) -> pa.Table:
    return pa.table(
        {"id": pa.array([r[0] for r in rows], pa.int64()), "v": [r[1] for r in rows]},
        schema=pa.schema([*KEY, *VAL]),
    )


# ----------------------------------------------------------------- the handle
def test_changes_that_change_nothing_write_nothing(client: PersistClient) -> None:
    """A change that changes nothing commits nothing (no part, no version: the upper
    stays) and returns ``upper - 1`` of the version it read, with zero counts."""
    w, r = client.open("s", KEY, VAL)
    seqno = client.inspect("s").seqno
    assert w.delete(pc.field("id") == 1) == RowChanges(-1, 0, 0)  # upper 0: no rows
    assert w.upsert(table([])) == RowChanges(-1, 0, 0)
    assert w.update(pc.field("id") == 1, {"v": 3}) == RowChanges(-1, 0, 0)
    assert w.fetch_recent_upper() == Antichain([0]) and client.inspect("s").seqno == seqno
    assert w.upsert(table([(1, 10), (2, 20)])) == RowChanges(0, 2, 0)
    assert w.delete(pc.field("id") == 3) == RowChanges(0, 0, 0)
    assert w.fetch_recent_upper() == Antichain([1])
    assert live(r, w) == Counter({(1, 10): 1, (2, 20): 1})


def test_upsert_replaces_every_live_row_of_its_key(client: PersistClient) -> None:
    w, r = client.open("s", KEY, VAL)
    # raw appends: key 1 twice with one value, once with another
    w.compare_and_append(
        [(((1,), (10,)), 0, 2), (((1,), (11,)), 0, 1), (((2,), (20,)), 0, 1)], 0, 1
    )
    ch = w.upsert(table([(1, 12), (3, 30)]))
    assert ch == RowChanges(1, 2, 3)
    assert live(r, w) == Counter({(1, 12): 1, (2, 20): 1, (3, 30): 1})


def test_duplicate_keys_refused_nothing_committed(client: PersistClient) -> None:
    w, r = client.open("s", KEY, VAL)
    w.upsert(table([(1, 10)]))
    with pytest.raises(InvalidUsage, match=r"two rows have one key \['id'\] = \[2\]"):
        w.upsert(table([(2, 1), (1, 5), (2, 2)]))
    assert w.fetch_recent_upper() == Antichain([1])
    assert live(r, w) == Counter({(1, 10): 1})


def test_bad_input_refused_nothing_committed(client: PersistClient) -> None:
    w, r = client.open("s", KEY, VAL)
    w.upsert(table([(1, 10)]))
    bad_rows = pa.table({"id": [1], "v": [1], "_diff": [1]})
    with pytest.raises(InvalidUsage, match="unknown"):
        w.upsert(bad_rows)
    with pytest.raises(InvalidUsage, match="missing"):
        w.upsert(pa.table({"id": [1]}))
    with pytest.raises(InvalidUsage, match="non-nullable"):
        w.upsert(pa.table({"id": pa.array([None], pa.int64()), "v": [1]}))
    with pytest.raises(InvalidUsage, match="non-nullable column 'id'"):
        w.update(pc.field("id") == 1, {"id": None})
    with pytest.raises(InvalidUsage, match="not key or value columns"):
        w.update(pc.field("id") == 1, {"_diff": 2})
    with pytest.raises(InvalidUsage, match="does not apply"):  # even matching no row
        w.update(pc.field("id") == 99, {"v": pc.field("nope") + 1})
    with pytest.raises(InvalidUsage, match="non-empty"):
        w.update(pc.field("id") == 1, {})
    with pytest.raises(InvalidUsage, match="'v'"):
        w.update(pc.field("id") == 1, {"v": "not an int"})
    with pytest.raises(InvalidUsage):
        w.delete(pc.field("nope") == 1)
    assert w.fetch_recent_upper() == Antichain([1])


def test_update_expression_on_old_row_keeps_count(client: PersistClient) -> None:
    w, r = client.open("s", KEY, VAL)
    w.compare_and_append([(((1,), (10,)), 0, 2), (((2,), (20,)), 0, 1)], 0, 1)
    ch = w.update(pc.field("id") == 1, {"v": pc.field("v") * 2 + pc.field("id")})
    assert ch == RowChanges(1, 2, 2)
    assert live(r, w) == Counter({(1, 21): 2, (2, 20): 1})
    w.delete(pc.field("v") > 20)
    assert live(r, w) == Counter({(2, 20): 1})


def test_update_of_key_columns(client: PersistClient) -> None:
    """The decision: an update may change keys unless two live rows would then share
    a key they did not share before."""
    w, r = client.open("s", KEY, VAL)
    w.upsert(table([(1, 10), (2, 20), (5, 50)]))
    # shifting 1, 2 -> 2, 3: key 2 is retracted by the same update, so allowed
    assert w.update(pc.field("id") <= 2, {"id": pc.field("id") + 1}).retracted == 2
    assert live(r, w) == Counter({(2, 10): 1, (3, 20): 1, (5, 50): 1})
    upper = w.fetch_recent_upper()
    with pytest.raises(InvalidUsage, match=r"key \['id'\] = \[5\] of a live row"):
        w.update(pc.field("id") == 3, {"id": 5})
    with pytest.raises(InvalidUsage, match="two updated rows would get one key"):
        w.update(pc.field("id") <= 3, {"id": 9})
    assert w.fetch_recent_upper() == upper  # nothing committed
    assert w.update(pc.field("id") == 5, {"id": 7, "v": None}) == RowChanges(
        upper.as_option(), 1, 1
    )
    assert live(r, w) == Counter({(2, 10): 1, (3, 20): 1, (7, None): 1})


def test_upsert_reads_only_parts_that_can_hold_its_keys(tmp_path: Path) -> None:
    """Clustered keys: three batches of blob parts, keys [0, 100), [100, 200), [200, 300).
    The part files of the last two are removed; an upsert of keys in [0, 100) still
    succeeds, so it never fetched them (key statistics pruned them)."""
    s = Stash.open("memory://", fenced=False)
    blob = FileBlob(str(tmp_path / "blob"))
    c = PersistClient(s, blob, compaction="off", inline_max_bytes=0)
    try:
        w, r = c.open("s", KEY, VAL)
        for b in range(3):
            w.upsert(table([(i, i) for i in range(b * 100, b * 100 + 100)]))
        st_ = w.change_state()
        later = [p.key for bt in st_.batches()[1:] for p in bt.parts]
        assert later and all(k is not None for k in later)
        for k in later:
            blob.delete(k)
        # many keys: Arrow does not prune an ``is_in`` of many values by itself
        ch = w.upsert(table([(i, -i) for i in range(5, 95)]))
        assert ch == RowChanges(3, 90, 90)
        # a key whose part is gone: the missing part is re-read twice, then reported
        upper = w.fetch_recent_upper()
        with pytest.raises(CorruptPart) as e:
            w.upsert(table([(150, 0)]))
        assert e.value.missing and w.fetch_recent_upper() == upper
        got = w.read_live(w.change_state(), pc.field("id") < 10).column("v").to_pylist()
        assert got == [0, 1, 2, 3, 4, -5, -6, -7, -8, -9]
    finally:
        c.close()
        s.close()


def test_schema_evolution_conforms_old_rows_and_refuses_old_handles(
    client: PersistClient,
) -> None:
    w1, _r1 = client.open("s", KEY, VAL)
    w1.upsert(table([(1, 10), (2, 20)]))
    val2 = pa.schema([pa.field("v", pa.int64()), pa.field("w", pa.string())])
    w2, r2 = client.open("s", KEY, val2)
    rows = pa.table({"id": [1], "v": [11], "w": ["x"]}, schema=pa.schema([*KEY, *val2]))
    assert w2.upsert(rows) == RowChanges(1, 1, 1)
    assert w2.update(pc.field("id") == 2, {"w": "y"}) == RowChanges(2, 1, 1)
    assert live(r2, w2) == Counter({(1, 11, "x"): 1, (2, 20, "y"): 1})
    upper = w2.fetch_recent_upper()
    with pytest.raises(SchemaMismatch, match="newest schema version 1"):
        w1.upsert(table([(1, 12)]))
    with pytest.raises(SchemaMismatch):
        w1.delete(pc.field("id") == 1)
    assert w2.fetch_recent_upper() == upper


def test_rows_differing_only_in_a_dropped_column_are_one_row(client: PersistClient) -> None:
    """Rows of an older version are conformed before they are compared: after ``w`` is
    dropped, (1, 10, "a") and (1, 10, "b") are one row (1, 10) with count 2, and an
    upsert of key 1 retracts both; a widened column (int32 -> int64) reads as int64."""
    val1 = pa.schema([pa.field("v", pa.int32()), pa.field("w", pa.string())])
    w1, _ = client.open("s", KEY, val1)
    w1.compare_and_append([(((1,), (10, "a")), 0, 1), (((1,), (10, "b")), 0, 1)], 0, 1)
    w2, r2 = client.open("s", KEY, VAL, drop=["w"])
    assert live(r2, w2) == Counter({(1, 10): 2})
    assert w2.upsert(table([(1, 11)])) == RowChanges(1, 1, 2)
    assert live(r2, w2) == Counter({(1, 11): 1})
    assert w2.update(pc.field("v") == 11, {"v": 2**40}) == RowChanges(2, 1, 1)
    assert live(r2, w2) == Counter({(1, 2**40): 1})


@pytest.mark.parametrize("reads", [3, 50], ids=["resolved", "unresolved"])
def test_lost_ack_never_applies_a_change_twice(reads: int) -> None:
    """The commit of ``update(v = v + 1)`` lands but its acknowledgement is lost (then
    ``reads`` re-reads fail): resolved, the change reports its time; unresolved, it
    raises the indeterminate error and is not re-planned.  Either way ``v`` is
    incremented exactly once."""
    inner = Stash.open("memory://", fenced=False)
    flaky = AckLostStash(inner)
    c = PersistClient(flaky, MemoryBlob(), compaction="off", consensus_retries=1)  # type: ignore[arg-type]
    try:
        w, r = c.open("idem", KEY, VAL)
        w.resolve_max_wait = 0.001
        w.resolve_attempts = 8 if reads < 10 else 2
        w.upsert(table([(0, 0)]))
        flaky.arm(reads=reads)
        if reads < 10:
            assert w.update(pc.field("id") == 0, {"v": pc.field("v") + 1}) == RowChanges(1, 1, 1)
        else:
            with pytest.raises(ConsensusError) as e:
                w.update(pc.field("id") == 0, {"v": pc.field("v") + 1})
            assert e.value.is_indeterminate()
            flaky.reads_to_fail = 0
        assert flaky.lost_acks == 1
        assert w.fetch_recent_upper() == Antichain([2])
        assert live(r, w) == Counter({(0, 1): 1})
    finally:
        c.close()
        inner.close()


def test_since_beyond_the_upper_after_compaction(client: PersistClient) -> None:
    """A reader's since beyond the upper (100 > 12) and a compaction: the merged rows
    carry time 100, beyond ``upper - 1``; a change still sees them (it reads every
    committed update, as of the later of ``upper - 1`` and the since)."""
    client.compaction = "off"
    w, r = client.open("s", KEY, VAL)
    for i in range(6):
        w.upsert(table([(i, i)]))
    r.downgrade_since(100)
    for i in range(6, 12):
        w.upsert(table([(i, i)]))
    client.compactor.compact_once("s")
    assert w.update(pc.field("id") == 3, {"v": 30}) == RowChanges(12, 1, 1)
    assert w.upsert(table([(7, 70)])) == RowChanges(13, 1, 1)
    assert live_rows(w) == Counter({(i, {3: 30, 7: 70}.get(i, i)): 1 for i in range(12)})


# ------------------------------------------------------------------ the loop
class _AlwaysRaced:
    name = "racy"
    shard_id = "s-1"

    def __init__(self, client: PersistClient) -> None:
        self.w, _ = client.open("racy", KEY, VAL)
        self.calls = 0

    def change_state(self) -> Any:
        return self.w.change_state()

    def read_live(self, state: Any, filter: Any) -> pa.Table:
        return self.w.read_live(state, filter)

    def compare_and_append(self, updates: pa.Table, expected: int, new: int) -> None:
        self.calls += 1
        raise UpperMismatch(Antichain([expected]), Antichain([expected + 1]))


def test_lost_races_are_bounded_then_name_the_shard(client: PersistClient) -> None:
    racy = _AlwaysRaced(client)
    with pytest.raises(ChangeContended, match=r"shard 'racy' \(s-1\).* 4 times") as e:
        rows_mod.apply_change(
            racy,
            lambda read, upper: rows_mod.plan_upsert(read(None), table([(1, 1)]), ["id"], ["v"]),
            attempts=4,
            wait_max=0.001,
        )
    assert racy.calls == 4 and e.value.attempts == 4


# ------------------------------------------------------------------ the model
_ids = st.integers(0, 5)
_vals = st.integers(-3, 3)
_op = st.one_of(
    st.tuples(st.just("upsert"), st.dictionaries(_ids, _vals, max_size=4)),
    st.tuples(st.just("delete"), st.frozensets(_ids, max_size=3)),
    st.tuples(st.just("update_add"), _ids, _vals),
    st.tuples(st.just("update_set"), _ids, _vals),
    st.tuples(st.just("append"), st.lists(st.tuples(_ids, _vals), max_size=3)),
    st.tuples(st.just("since")),
)


def _pg(postgres_url: str) -> str:
    from tests.support.dbutil import migrate_to_head

    migrate_to_head(postgres_url)
    return postgres_url


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def stash_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return "memory://"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'stash.db'}"
    return _pg(str(request.getfixturevalue("postgres_url")))


def live_rows(w: Any) -> Counter[tuple[Any, ...]]:
    """What a change reads: every update of the latest state, consolidated (works with
    the since at the upper, where no snapshot can be read)."""
    t = w.read_live(w.change_state(), None)
    cols = [t.column(n).to_pylist() for n in ("id", "v")]
    return Counter(dict(zip(zip(*cols, strict=True), t.column("_diff").to_pylist(), strict=True)))


@pytest.mark.parametrize("inline_max_bytes", [16 * 1024, 0], ids=["inline", "blob"])
@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(_op, max_size=8))
@example(ops=[("append", [(2, 0), (2, 1)]), ("update_add", 2, 1)])  # an update onto a live row
def test_model(stash_url: str, inline_max_bytes: int, ops: list[tuple[Any, ...]]) -> None:
    """Upsert, delete, update, raw appends (duplicates included), since downgrades beyond
    the upper and inline compaction, against a dict of (id, v) -> count; after every
    step the shard equals the model (so every key that went through upsert has one row
    with ``_diff`` 1)."""
    s = Stash.open(stash_url, fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="inline", inline_max_bytes=inline_max_bytes)
    try:
        w, r = c.open(f"m-{uuid.uuid4().hex}", KEY, VAL)
        model: Counter[tuple[Any, ...]] = Counter()
        for op in ops:
            upper = w.fetch_recent_upper().as_option()
            kind = op[0]
            before = +model
            if kind == "since":  # up to beyond the upper: compaction may advance past it
                r.downgrade_since(upper + 2)
                continue
            if kind == "upsert":
                w.upsert(table(sorted(op[1].items())))
                for k in [k for k in model if k[0] in op[1]]:
                    del model[k]
                model.update({(i, v): 1 for i, v in op[1].items()})
            elif kind == "delete":
                w.delete(pc.field("id").isin(list(op[1])))
                for k in [k for k in model if k[0] in op[1]]:
                    del model[k]
            elif kind in ("update_add", "update_set"):
                _, i, x = op
                value = pc.field("v") + x if kind == "update_add" else x
                w.update(pc.field("id") == i, {"v": value})
                moved = [(k, model.pop(k)) for k in [k for k in model if k[0] == i]]
                for k, n in moved:  # all retracted first, then all inserted
                    model[(i, k[1] + x if kind == "update_add" else x)] += n
            else:
                w.compare_and_append([(((i,), (v,)), upper, 1) for i, v in op[1]], upper, upper + 1)
                model.update(op[1])
            # a change that changes nothing writes nothing: the upper stays
            moved = kind == "append" or +model != before
            assert w.fetch_recent_upper().as_option() == upper + moved
            assert live_rows(w) == +model
    finally:
        c.close()
        s.close()


# ---------------------------------------------------------- several processes
def _incrementer(stash_url: str, blob_root: str, n: int) -> int:
    s = Stash.open(stash_url, fenced=False)
    c = PersistClient(s, FileBlob(blob_root), compaction="inline")
    try:
        w, _ = c.open("counter", KEY, VAL)
        for _ in range(n):
            w.update(pc.field("id") == 0, {"v": pc.field("v") + 1})
        return n
    finally:
        c.close()
        s.close()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A stash several processes can share."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'stash.db'}"
    return _pg(str(request.getfixturevalue("postgres_url")))


def test_four_processes_update_one_row_no_lost_update(shared_url: str, tmp_path: Path) -> None:
    """Four spawned processes each run ``update(id == 0, v = v + 1)`` 25 times: every
    update is acknowledged and none is lost (``v == 100``, at time 100)."""
    url, root = shared_url, str(tmp_path / "blob")
    s = Stash.open(url, fenced=False)
    c = PersistClient(s, FileBlob(root), compaction="inline")
    try:
        w, r = c.open("counter", KEY, VAL)
        w.upsert(table([(0, 0)]))
        with process_context().Pool(4) as pool:
            acked = sum(pool.starmap(_incrementer, [(url, root, 25)] * 4))
        assert acked == 100
        assert live(r, w) == Counter({(0, 100): 1})
        assert w.fetch_recent_upper() == Antichain([101])
    finally:
        c.close()
        s.close()


def _upserter(stash_url: str, blob_root: str, p: int, rounds: int) -> int:
    s = Stash.open(stash_url, fenced=False)
    c = PersistClient(s, FileBlob(blob_root), compaction="inline")
    try:
        w, _ = c.open("keys", KEY, VAL)
        for n in range(rounds):
            own = [(p * 10 + i, p * 1000 + n) for i in range(3)]
            shared = [(100 + i, p * 1000 + n) for i in range(2)]
            w.upsert(table(own + shared))
        return rounds
    finally:
        c.close()
        s.close()


@pytest.mark.slow
def test_four_processes_upsert_disjoint_and_overlapping_keys(
    shared_url: str, tmp_path: Path
) -> None:
    """Four processes upsert their own keys and two shared keys, 8 rounds each: every
    key ends with one live row of ``_diff`` 1, own keys with their process's last round,
    shared keys with some process's last round."""
    url, root = shared_url, str(tmp_path / "blob")
    s = Stash.open(url, fenced=False)
    c = PersistClient(s, FileBlob(root), compaction="inline")
    try:
        w, r = c.open("keys", KEY, VAL)
        w.upsert(table([(100, -1)]))
        with process_context().Pool(4) as pool:
            acked = sum(pool.starmap(_upserter, [(url, root, p, 8) for p in range(4)]))
        assert acked == 32 and w.fetch_recent_upper() == Antichain([33])
        got = live(r, w)
        assert set(got.values()) == {1} and len(got) == 4 * 3 + 2
        for p in range(4):
            for i in range(3):
                assert got[(p * 10 + i, p * 1000 + 7)] == 1
        finals = {p * 1000 + 7 for p in range(4)}
        shared = {v for (k, v) in got if k >= 100}
        assert len(shared) == 1 and shared <= finals  # one upsert wrote both last
    finally:
        c.close()
        s.close()


def test_threads_with_their_own_handles_lose_no_update(client: PersistClient) -> None:
    """Four threads, each with its own write handle on one client (one shared state
    machine), run ``update(v = v + 1)`` 10 times: ``v == 40``."""
    w, r = client.open("t", KEY, VAL)
    w.upsert(table([(0, 0)]))
    handles = [client.open("t", KEY, VAL)[0] for _ in range(4)]
    errors: list[BaseException] = []

    def run(h: Any) -> None:
        try:
            for _ in range(10):
                h.update(pc.field("id") == 0, {"v": pc.field("v") + 1})
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert live(r, w) == Counter({(0, 40): 1})
