"""Row-level changes in a transaction (:mod:`persist.txn_rows`: ``Txn.upsert`` /
``delete`` / ``update``): atomic with other shards and the stash catalog, planned on the
version the commit lands on (a race re-plans and loses nothing), refused changes commit
nothing, a re-plan uploads only what changed, and processes racing transactions lose no
update."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import persist.txn_commit as txn_commit
from persist import (
    ConsensusError,
    FileBlob,
    InvalidUsage,
    MemoryBlob,
    PersistClient,
    RowChanges,
    SchemaMismatch,
)
from stash import Antichain, Stash
from tests.support.procs import process_context
from tests.support.stash_faults import AckLostStash

KEY = pa.schema([pa.field("id", pa.int64(), False)])
VAL = pa.schema([pa.field("v", pa.int64())])
INC = {"v": pc.field("v") + 1}


class CountingBlob(MemoryBlob):
    """A memory blob counting its puts of writers' batch parts (not compaction's)."""

    def __init__(self) -> None:
        super().__init__()
        self.puts: list[str] = []

    def set(self, key: str, value: bytes) -> None:
        if key.endswith(".parquet") and key.split("/")[1] == "b":
            self.puts.append(key)
        super().set(key, value)


def table(rows: list[tuple[int, int | None]]) -> pa.Table:
    return pa.table(
        {"id": pa.array([r[0] for r in rows], pa.int64()), "v": [r[1] for r in rows]},
        schema=pa.schema([*KEY, *VAL]),
    )


def live(c: PersistClient, name: str) -> Counter[tuple[Any, ...]]:
    """The shard's contents at ``upper - 1`` as ``{(id, v): count}``."""
    upper = c.inspect(name).upper.as_option()
    if not upper:
        return Counter()
    t = c.open_reader(name, KEY, VAL).snapshot(upper - 1)
    out: Counter[tuple[Any, ...]] = Counter()
    for r in t.to_pylist():
        out[(r["id"], r["v"])] += r["_diff"]
    return +out


@pytest.fixture()
def stash() -> Iterator[Stash]:
    s = Stash.open("memory://", fenced=False)
    yield s
    s.close()


@pytest.fixture()
def blob() -> CountingBlob:
    return CountingBlob()


@pytest.fixture()
def client(stash: Stash, blob: CountingBlob) -> Iterator[PersistClient]:
    c = PersistClient(stash, blob, compaction="inline", inline_max_bytes=0)
    for name in ("a", "b"):
        w, _ = c.open(name, KEY, VAL)
        w.upsert(table([(0, 0), (1, 10)]))
    yield c
    c.close()


def test_atomic_across_two_shards_and_a_stash_collection(
    client: PersistClient, stash: Stash
) -> None:
    cat = stash.collection("catalog", key="str", value="json")
    with client.begin() as txn:
        txn.upsert("a", table([(1, 11), (2, 20)]))
        txn.update("b", pc.field("id") == 0, INC)
        txn.delete("b", pc.field("id") == 1)
        cb = cat.make_batch(stash)
        cat.append_to_batch(cb, "a", {"rows": 3}, 1)
        txn.stash_append([cb])
    ts = txn.committed_ts
    assert ts == 1
    assert live(client, "a") == Counter({(0, 0): 1, (1, 11): 1, (2, 20): 1})
    assert live(client, "b") == Counter({(0, 1): 1})
    assert stash.peek_one(cat) == {"a": {"rows": 3}}
    assert txn.row_changes() == [RowChanges(1, 2, 1), RowChanges(1, 1, 1), RowChanges(1, 0, 1)]
    for name in "ab":  # one time, the transaction's, in both shards
        assert client.inspect(name).upper == Antichain([2])
        snap = client.open_reader(name, KEY, VAL).snapshot(0)
        assert {r["_time"] for r in snap.to_pylist()} == {0}


def test_a_lost_stash_lower_check_commits_nothing_in_any_shard(
    client: PersistClient, stash: Stash
) -> None:
    cat = stash.collection("catalog", key="str", value="json")
    stale = cat.make_batch(stash)
    cat.append_to_batch(stale, "x", 1, 1)
    fresh = cat.make_batch(stash)
    cat.append_to_batch(fresh, "y", 1, 1)
    stash.append([fresh])  # moves the catalog's upper: the stale batch's check fails
    before = {n: live(client, n) for n in "ab"}
    txn = client.begin()
    txn.update("a", pc.field("id") == 0, INC)
    txn.upsert("b", table([(5, 5)]))
    txn.stash_append([stale])
    with pytest.raises(txn_commit.TxnUpperMismatch, match="catalog"):
        txn.commit()
    txn.abort()
    assert {n: live(client, n) for n in "ab"} == before
    assert {n: client.inspect(n).upper for n in "ab"} == {n: Antichain([1]) for n in "ab"}


def test_several_changes_to_one_shard_apply_in_order(client: PersistClient) -> None:
    with client.begin() as txn:
        txn.upsert("a", table([(7, 70)]))
        txn.update("a", pc.field("id") >= 1, INC)  # sees the upserted row
        txn.upsert("a", table([(1, 100)]))  # replaces the updated row 1 (11)
        txn.delete("a", pc.field("v") == 0)
    assert live(client, "a") == Counter({(1, 100): 1, (7, 71): 1})
    assert txn.row_changes() == [
        RowChanges(1, 1, 0),
        RowChanges(1, 2, 2),
        RowChanges(1, 1, 1),
        RowChanges(1, 0, 1),
    ]


def _race_once(monkeypatch: pytest.MonkeyPatch, other: Any) -> list[int]:
    """After the first plan of shard ``a`` in a commit, run ``other()`` (another
    writer's change): the commit's compare-and-set then fails and it re-plans.  Returns
    the plan count (both shards)."""
    real = txn_commit.plan_on_head
    calls = [0]
    raced = [False]

    def plan(sw: Any, *args: Any) -> None:
        real(sw, *args)
        calls[0] += 1
        if sw.name == "a" and not raced[0]:
            raced[0] = True
            other()

    monkeypatch.setattr(txn_commit, "plan_on_head", plan)
    return calls


def test_a_race_between_plan_and_commit_replans_and_loses_no_update(
    client: PersistClient, stash: Stash, blob: CountingBlob, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer increments row 0 of shard ``a`` after the transaction planned its
    own increment: the commit re-plans on the version it lands on, so both count
    (``v == 2``), and the re-planned changes replace the first plan's parts."""
    other = PersistClient(stash, blob, compaction="inline")
    try:
        wa, _ = other.open("a", KEY, VAL)
        calls = _race_once(monkeypatch, lambda: wa.update(pc.field("id") == 0, INC))
        with client.begin() as txn:
            txn.update("a", pc.field("id") == 0, INC)
            txn.update("b", pc.field("id") == 0, INC)
        assert calls[0] >= 3  # a, b, then a again on the new version
        assert live(client, "a") == Counter({(0, 2): 1, (1, 10): 1})
        assert live(client, "b") == Counter({(0, 1): 1, (1, 10): 1})
        assert txn.committed_ts == 2  # the other writer's change took time 1
        assert txn.row_changes() == [RowChanges(2, 1, 1), RowChanges(2, 1, 1)]
    finally:
        other.close()


def test_a_replan_uploads_only_what_changed(
    client: PersistClient, stash: Stash, blob: CountingBlob, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blob puts are counted.  A shard's changes go up as one part when the commit
    plans them; a race that did not touch the rows the changes read re-plans to the
    same updates and uploads nothing; one that changed a retracted row uploads that
    shard's part again, and only that.  The replaced part is deleted."""
    other = PersistClient(stash, blob, compaction="off")  # inline parts: no puts
    try:
        wa, _ = other.open("a", KEY, VAL)
        wb, _ = other.open("b", KEY, VAL)
        txn = client.begin()
        start = len(blob.puts)
        txn.upsert("a", table([(1, 11), (2, 20)]))
        txn.update("b", pc.field("id") == 0, INC)
        assert len(blob.puts) == start  # planned at commit
        # A race on an unrelated key of a: the same plan, nothing uploaded again.
        calls = _race_once(monkeypatch, lambda: wa.upsert(table([(9, 9)])))
        mid = len(blob.puts)
        txn.commit()
        assert calls[0] >= 3
        assert len(blob.puts) - mid == 2  # a's upsert, b's update: once each
        assert live(client, "a") == Counter({(0, 0): 1, (1, 11): 1, (2, 20): 1, (9, 9): 1})
        assert live(client, "b") == Counter({(0, 1): 1, (1, 10): 1})

        # A race that changes the row a change retracts re-uploads that one part.
        monkeypatch.undo()
        txn = client.begin()
        txn.upsert("a", table([(1, 12)]))
        txn.update("b", pc.field("id") == 9, INC)  # no row: nothing to upload
        _race_once(monkeypatch, lambda: wa.update(pc.field("id") == 1, {"v": 99}))
        start = len(blob.puts)
        txn.commit()
        retractions = blob.puts[start:]
        assert len(retractions) == 2  # a's part retracting (1, 11), then (1, 99)
        assert blob.get(retractions[0]) is None  # the replaced one is deleted
        assert blob.get(retractions[1]) is not None
        assert live(client, "a") == Counter({(0, 0): 1, (1, 12): 1, (2, 20): 1, (9, 9): 1})
    finally:
        other.close()


def test_refused_changes_commit_nothing_in_any_shard(client: PersistClient) -> None:
    before = {n: (live(client, n), client.inspect(n).upper) for n in "ab"}
    with pytest.raises(InvalidUsage, match=r"two rows have one key \['id'\] = \[3\]"):
        with client.begin() as txn:
            txn.update("a", pc.field("id") == 0, INC)
            txn.upsert("b", table([(3, 1), (3, 2)]))
    with pytest.raises(InvalidUsage, match="nope"):
        with client.begin() as txn:
            txn.upsert("a", table([(3, 1)]))
            txn.delete("b", pc.field("nope") == 1)
    with pytest.raises(InvalidUsage, match="not key or value columns"):
        with client.begin() as txn:
            txn.upsert("a", table([(3, 1)]))
            txn.update("b", pc.field("id") == 0, {"_diff": 2})
    # Refused by the plan at commit: an update moving row 0 onto live key 1.
    with pytest.raises(InvalidUsage, match=r"key \['id'\] = \[1\] of a live row"):
        with client.begin() as txn:
            txn.upsert("a", table([(3, 1)]))
            txn.update("b", pc.field("id") == 0, {"id": 1})
    # Mixing raw writes and row changes on one shard is refused, naming it.
    with pytest.raises(InvalidUsage, match="'a'.*not both"):
        with client.begin() as txn:
            txn.upsert("a", table([(3, 1)]))
            txn.write("a", table([(4, 1)]))
    with pytest.raises(InvalidUsage, match="'a'.*not both"):
        with client.begin() as txn:
            txn.write("a", table([(4, 1)]))
            txn.upsert("a", table([(3, 1)]))
    assert {n: (live(client, n), client.inspect(n).upper) for n in "ab"} == before
    with pytest.raises(InvalidUsage, match="has not committed"):
        client.begin().row_changes()


@pytest.mark.parametrize("reads", [3, 50], ids=["resolved", "unresolved"])
def test_lost_ack_never_applies_the_changes_twice(reads: int) -> None:
    """The commit of two increments lands but its acknowledgement is lost (then
    ``reads`` re-reads fail): resolved, ``commit`` returns its time; unresolved, it
    raises the indeterminate error and the next ``commit`` learns it landed.  Either
    way each row is incremented exactly once."""
    inner = Stash.open("memory://", fenced=False)
    flaky = AckLostStash(inner)
    c = PersistClient(flaky, MemoryBlob(), compaction="off", consensus_retries=1)  # type: ignore[arg-type]
    try:
        for name in "ab":
            w, _ = c.open(name, KEY, VAL)
            w.upsert(table([(0, 0)]))
        txn = c.begin()
        txn.resolve_max_wait = 0.001
        txn.resolve_attempts = 8 if reads < 10 else 2
        txn.update("a", pc.field("id") == 0, INC)
        txn.update("b", pc.field("id") == 0, INC)
        flaky.arm(reads=reads)
        if reads < 10:
            assert txn.commit() == 1
        else:
            with pytest.raises(ConsensusError) as e:
                txn.commit()
            assert e.value.is_indeterminate()
            flaky.reads_to_fail = 0
            assert txn.commit() == 1
        assert flaky.lost_acks == 1
        for name in "ab":
            assert live(c, name) == Counter({(0, 1): 1})
            assert c.inspect(name).upper == Antichain([2])
    finally:
        c.close()
        inner.close()


def test_a_schema_evolved_since_the_change_commits_nothing(client: PersistClient) -> None:
    """A change added under the shard's schema version, which evolves before the
    commit: its retractions could not name the new column, so the commit refuses it
    (naming the shard) and commits nothing in any shard."""
    before = {n: (live(client, n), client.inspect(n).upper) for n in "ab"}
    txn = client.begin()
    txn.update("a", pc.field("id") == 0, INC)
    txn.upsert("b", table([(5, 5)]))
    val2 = pa.schema([*VAL, pa.field("note", pa.string())])
    client.open("a", KEY, val2)  # a newer schema version of a
    with pytest.raises(SchemaMismatch, match="'a'.*newest schema version"):
        txn.commit()
    txn.abort()
    assert {n: (live(client, n), client.inspect(n).upper) for n in "ab"} == before


def test_threads_of_one_client_racing_transactions_lose_no_update(client: PersistClient) -> None:
    """Four threads of one client each commit five transactions incrementing row 0 of
    both shards (the commits take the shards' locks while they plan and upload)."""

    def run() -> None:
        for _ in range(5):
            with client.begin() as txn:
                txn.update("a", pc.field("id") == 0, INC)
                txn.update("b", pc.field("id") == 0, INC)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    for name in "ab":
        assert live(client, name) == Counter({(0, 20): 1, (1, 10): 1})


# ---------------------------------------------------------- several processes
def _txn_incrementer(stash_url: str, blob_root: str, n: int) -> int:
    s = Stash.open(stash_url, fenced=False)
    c = PersistClient(s, FileBlob(blob_root), compaction="inline")
    try:
        for _ in range(n):
            with c.begin() as txn:
                txn.update("a", pc.field("id") == 0, INC)
                txn.update("b", pc.field("id") == 0, INC)
        return n
    finally:
        c.close()
        s.close()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A stash several processes can share."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'stash.db'}"
    from tests.support.dbutil import migrate_to_head

    url = str(request.getfixturevalue("postgres_url"))
    migrate_to_head(url)
    return url


def test_processes_racing_transactions_lose_no_update(shared_url: str, tmp_path: Path) -> None:
    """Three spawned processes each commit 6 transactions incrementing row 0 of two
    shards (SQLite stash; Postgres among the slow tests): both end at exactly the
    number acknowledged."""
    url, root = shared_url, str(tmp_path / "blob")
    s = Stash.open(url, fenced=False)
    c = PersistClient(s, FileBlob(root), compaction="inline")
    try:
        for name in "ab":
            w, _ = c.open(name, KEY, VAL)
            w.upsert(table([(0, 0)]))
        with process_context().Pool(3) as pool:
            acked = sum(pool.starmap(_txn_incrementer, [(url, root, 6)] * 3))
        assert acked == 18
        for name in "ab":
            assert live(c, name) == Counter({(0, 18): 1})
    finally:
        c.close()
        s.close()
