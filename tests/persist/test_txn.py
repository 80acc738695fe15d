"""Transactions across shards and stash collections (persist.txn).

Each test names the rule of ``persist/txn.py`` it checks: all or nothing, races name
every shard and commit nothing, a retry never uploads a part twice, clear errors before
anything is written, abort deletes uploaded parts, unknown outcomes are resolved without
double-applying, and cross-shard-consistent reads."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from persist import (
    ConsensusError,
    InvalidUsage,
    LeaseExpired,
    MemoryBlob,
    PersistClient,
    Txn,
    TxnUpperMismatch,
    UpperMismatch,
)
from stash import Antichain, Stash
from tests.support.clock import Clock
from tests.support.stash_faults import AckLostStash

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


def ac(t: int) -> Antichain:
    return Antichain.from_elem(t)


def rows(ks: list[str], vs: list[int], diffs: list[int] | None = None) -> pa.Table:
    cols: dict[str, Any] = {"k": ks, "v": vs}
    if diffs is not None:
        cols["_diff"] = pa.array(diffs, pa.int64())
    return pa.table(cols)


def contents(table: pa.Table) -> Counter[tuple[str, int]]:
    out: Counter[tuple[str, int]] = Counter()
    for r in table.to_pylist():
        out[(r["k"], r["v"])] += r["_diff"]
    return out


@pytest.fixture
def stash() -> Iterator[Stash]:
    s = Stash.open("memory://", fenced=False)
    yield s
    s.close()


@pytest.fixture
def blob() -> MemoryBlob:
    return MemoryBlob()


@pytest.fixture
def clock() -> Clock:
    return Clock(1_000_000.0)


@pytest.fixture
def client(stash: Stash, blob: MemoryBlob, clock: Clock) -> Iterator[PersistClient]:
    c = PersistClient(stash, blob, compaction="inline", inline_max_bytes=0, clock=clock)
    c.open("a", KS, VS)
    c.open("b", KS, VS)
    c.open("c", KS, VS)
    yield c
    c.close()


def parts_in(blob: MemoryBlob) -> set[str]:
    return {k for k, _ in blob.list_keys("") if k.endswith(".parquet")}


def batch_parts(blob: MemoryBlob) -> set[str]:
    """Writers' batch parts (not compaction outputs, kind ``c``)."""
    return {k for k in parts_in(blob) if k.split("/")[1] == "b"}


def test_commit_at_makes_every_shard_and_the_catalog_visible_together(
    client: PersistClient, stash: Stash
) -> None:
    cat = stash.collection("catalog", key="str", value="json")
    txn = client.begin()
    assert isinstance(txn, Txn)
    txn.write("a", rows(["x", "y"], [1, 2]))
    txn.write("b", rows(["z"], [3], [2]))
    b = cat.make_batch(stash)
    cat.append_to_batch(b, "plane", {"seats": 2}, 1)
    txn.stash_append([b])
    assert txn.commit_at(4) == 4
    snap = client.snapshot_many({"a": 4, "b": 4})
    assert contents(snap["a"]) == Counter({("x", 1): 1, ("y", 2): 1})
    assert contents(snap["b"]) == Counter({("z", 3): 2})
    assert {r["_time"] for r in snap["a"].to_pylist()} == {4}
    for name in ("a", "b"):
        st = client.inspect(name)
        assert st.upper == ac(5)
        # [0, 4) is recorded empty; the updates sit in [4, 5).
        descs = [(hb.desc.lower, hb.desc.upper, hb.len) for hb in st.batches()]
        assert (ac(4), ac(5)) in [(lo, up) for lo, up, _ in descs]
    assert stash.peek_one(cat) == {"plane": {"seats": 2}}
    assert client.inspect("c").upper == ac(0)  # an unwritten shard is untouched
    # Before ts nothing of it shows.
    r = client.open_reader("a", KS, VS)
    assert contents(r.snapshot(3)) == Counter()


def test_race_names_every_shard_commits_nothing_and_retry_uploads_nothing(
    client: PersistClient, stash: Stash, blob: MemoryBlob
) -> None:
    cat = stash.collection("catalog", key="str", value="json")
    wa, _ = client.open("a", KS, VS)
    wb, _ = client.open("b", KS, VS)
    txn = client.begin()
    txn.write("a", rows(["x"], [1]))
    txn.write("b", rows(["y"], [1]))
    txn.write("c", rows(["z"], [1]))
    cb = cat.make_batch(stash)
    cat.append_to_batch(cb, "k", 1, 1)
    txn.stash_append([cb])
    wa.compare_and_append([((("o",), (0,)), 3, 1)], 0, 7)
    wb.compare_and_append([((("p",), (0,)), 1, 1)], 0, 3)
    written = batch_parts(blob)
    uppers = {n: client.inspect(n).upper for n in "abc"}
    with pytest.raises(TxnUpperMismatch) as e:
        txn.commit_at(2)
    assert isinstance(e.value, UpperMismatch)
    assert e.value.shards == {"a": ac(7), "b": ac(3)}
    assert "'a' upper {7}" in str(e.value) and "'b' upper {3}" in str(e.value)
    assert e.value.retry_ts() == 7
    # Nothing committed anywhere: shards and catalog unchanged.
    assert {n: client.inspect(n).upper for n in "abc"} == uppers
    assert stash.upper(cat) == ac(0) and stash.iter(cat) == []
    assert txn.commit_at(7) == 7
    assert batch_parts(blob) == written  # metadata only: no part uploaded again
    snap = client.snapshot_many(["a", "b", "c"])
    assert contents(snap["a"]) == Counter({("o", 0): 1, ("x", 1): 1})
    assert contents(snap["b"]) == Counter({("p", 0): 1, ("y", 1): 1})
    assert contents(snap["c"]) == Counter({("z", 1): 1})
    assert stash.peek_one(cat) == {"k": 1}


def test_commit_picks_the_smallest_valid_time_and_retries_races(client: PersistClient) -> None:
    wa, _ = client.open("a", KS, VS)
    wa.compare_and_append([((("o",), (0,)), 0, 1)], 0, 5)
    txn = client.begin()
    txn.write("a", rows(["x"], [1]))
    txn.write("b", rows(["y"], [1]))
    assert txn.commit() == 5  # max of the uppers {5} and {0}
    assert client.inspect("a").upper == ac(6) and client.inspect("b").upper == ac(6)

    # A race between the time being picked and the commit: retried by itself.
    txn2 = client.begin()
    txn2.write("a", rows(["x"], [2]))
    orig = txn2.commit_at
    raced = []

    def racing_commit_at(ts: int) -> int:
        if not raced:
            raced.append(ts)
            wa.compare_and_append([], ts, ts + 3)
        return orig(ts)

    txn2.commit_at = racing_commit_at  # type: ignore[method-assign]
    assert txn2.commit() == 9
    assert raced == [6]
    assert client.inspect("a").upper == ac(10)


def test_stash_batch_lower_mismatch_commits_nothing(client: PersistClient, stash: Stash) -> None:
    cat = stash.collection("catalog", key="str", value="json")
    stale = cat.make_batch(stash)
    cat.append_to_batch(stale, "k", 1, 1)
    stash.update(cat, ("other", 0), 0, 1)
    stash.seal(cat, ac(1))
    txn = client.begin()
    txn.write("a", rows(["x"], [1]))
    txn.stash_append([stale])
    with pytest.raises(TxnUpperMismatch) as e:
        txn.commit()
    assert e.value.collections == {"catalog": ac(1)} and e.value.retry_ts() is None
    assert client.inspect("a").upper == ac(0)
    assert stash.peek_one(cat) == {"other": 0}


def test_schema_mismatch_and_bad_updates_are_refused_before_anything_is_written(
    client: PersistClient, blob: MemoryBlob
) -> None:
    txn = client.begin()
    before = parts_in(blob)
    other = pa.schema([("v", pa.string())])
    with pytest.raises(InvalidUsage, match="created with key schema|not a widening"):
        txn.write("a", rows(["x"], [1]), key_schema=KS, value_schema=other)
    with pytest.raises(InvalidUsage, match="shard 'a'.*columns do not match"):
        txn.write("a", pa.table({"k": ["x"], "w": [1]}))
    with pytest.raises(InvalidUsage, match="_time"):
        txn.write("a", pa.table({"k": ["x"], "v": [1], "_time": [3]}))
    with pytest.raises(InvalidUsage, match="no shard named"):
        txn.write("nope", rows(["x"], [1]))
    with pytest.raises(InvalidUsage, match="takes a pyarrow Table"):
        txn.write("a", [1, 2])  # type: ignore[arg-type]
    assert parts_in(blob) == before
    assert txn.shards == []  # a refused write leaves nothing behind
    # Schemas given with a new name create the shard.
    t2 = client.begin()
    t2.write("fresh", rows(["x"], [1]), key_schema=KS, value_schema=VS)
    assert t2.commit() == 0
    assert contents(client.snapshot_many(["fresh"])["fresh"]) == Counter({("x", 1): 1})


def test_expired_writer_and_closed_client_are_refused(
    client: PersistClient, clock: Clock, blob: MemoryBlob
) -> None:
    w, _ = client.open("a", KS, VS)
    w.expire()
    txn = client.begin()
    with pytest.raises(InvalidUsage, match="was expired"):
        txn.write(w, rows(["x"], [1]))
    # A writer whose lease runs out between write and commit: LeaseExpired, nothing
    # committed (GC may have deleted its parts).
    txn.write("a", rows(["x"], [1]))
    txn.write("b", rows(["y"], [1]))
    clock.t += client.writer_lease_seconds + 10
    with pytest.raises(LeaseExpired):
        txn.commit_at(0)
    assert client.inspect("a").upper == ac(0) and client.inspect("b").upper == ac(0)
    # The client's next transaction gets a fresh writer.
    t2 = client.begin()
    t2.write("a", rows(["x"], [1]))
    assert t2.commit() == 0
    client.close()
    with pytest.raises(InvalidUsage, match="closed"):
        client.begin()


def test_stash_batch_of_another_stash_or_a_persist_collection_is_refused(
    client: PersistClient, stash: Stash
) -> None:
    other = Stash.open("memory://", fenced=False)
    try:
        foreign = other.collection("zzz_only_there", key="str", value="json")
        fb = foreign.make_batch(other)
        foreign.append_to_batch(fb, "k", 1, 1)
        txn = client.begin()
        with pytest.raises(InvalidUsage, match="not for this client's stash"):
            txn.stash_append([fb])
        # Same name, other id or codecs: still another stash's collection.
        stash.collection("shared", key="str", value="json")
        stash.collection("pad", key="str", value="json")
        other.collection("shared", key="str", value="int")
        sb = other.collection("shared", key="str", value="int").make_batch(other)
        with pytest.raises(InvalidUsage, match="not for this client's stash"):
            txn.stash_append([sb])
        sid = client.shard_id("a")
        internal = stash.collection(f"persist.shard.{sid}", key="str", value="json")
        with pytest.raises(InvalidUsage, match="persist's own collections"):
            txn.stash_append([internal.make_batch(stash)])
        with pytest.raises(InvalidUsage, match="AppendBatch"):
            txn.stash_append(["x"])  # type: ignore[list-item]
        assert txn.commit_at(0) == 0  # nothing was added
    finally:
        other.close()


def test_stash_batch_of_another_stash_with_equal_collection_is_refused(
    client: PersistClient, stash: Stash
) -> None:
    """Another stash whose collection has this one's name, id and codecs: only the
    stash's identity tells them apart; its batch is refused, naming both stashes."""
    mine = stash.collection("catalog", key="str", value="json")
    other = Stash.open("memory://", fenced=False)
    try:
        for i in range(mine.id - 1):
            other.collection(f"pad{i}")
        theirs = other.collection("catalog", key="str", value="json")
        assert (theirs.id, theirs.codec_names) == (mine.id, mine.codec_names)
        fb = theirs.make_batch(other)
        theirs.append_to_batch(fb, "k", 1, 1)
        txn = client.begin()
        with pytest.raises(InvalidUsage, match="not for this client's stash") as e:
            txn.stash_append([fb])
        assert f"stash id {theirs.stash_id}" in str(e.value)
        assert f"stash id {mine.stash_id}" in str(e.value)
        txn.write("a", rows(["x"], [1]))
        assert txn.commit_at(0) == 0
        assert stash.upper(mine) == Antichain.from_elem(0)
    finally:
        other.close()


def test_abort_and_exception_in_with_delete_uploaded_parts(
    client: PersistClient, blob: MemoryBlob
) -> None:
    before = parts_in(blob)
    txn = client.begin()
    txn.write("a", rows(["x"], [1]))
    txn.write("b", rows(["y"], [1]))
    assert len(parts_in(blob) - before) == 2  # uploaded at write time
    txn.abort()
    assert parts_in(blob) == before
    with pytest.raises(InvalidUsage, match="aborted"):
        txn.commit_at(0)

    with pytest.raises(RuntimeError), client.begin() as t2:
        t2.write("a", rows(["x"], [1]))
        assert len(parts_in(blob) - before) == 1
        raise RuntimeError("boom")
    assert parts_in(blob) == before
    assert client.inspect("a").upper == ac(0)

    with client.begin() as t3:  # a clean exit commits
        t3.write("a", rows(["x"], [1]))
    assert t3.committed_ts == 0 and client.inspect("a").upper == ac(1)
    t3.abort()  # a no-op after commit: the parts stay
    assert contents(client.snapshot_many(["a"])["a"]) == Counter({("x", 1): 1})


def test_lost_acknowledgement_is_resolved_and_never_double_applied(
    blob: MemoryBlob,
) -> None:
    inner = Stash.open("memory://", fenced=False)
    flaky = AckLostStash(inner)
    c = PersistClient(
        flaky,  # type: ignore[arg-type]
        blob,
        compaction="off",
        consensus_retries=1,
        inline_max_bytes=0,
    )
    try:
        c.open("a", KS, VS)
        c.open("b", KS, VS)
        txn = c.begin()
        txn.resolve_max_wait = 0.001
        txn.write("a", rows(["x"], [1]))
        txn.write("b", rows(["y"], [1]))
        flaky.arm(reads=3)
        assert txn.commit_at(2) == 2  # landed: success, not a race
        assert flaky.lost_acks == 1
        snap = c.snapshot_many(["a", "b"])
        assert contents(snap["a"]) == Counter({("x", 1): 1})
        assert contents(snap["b"]) == Counter({("y", 1): 1})

        # Unresolvable: indeterminate with the token; the retry finds it landed.
        t2 = c.begin()
        t2.resolve_attempts = 2
        t2.resolve_max_wait = 0.001
        t2.write("a", rows(["x"], [5]))
        t2.write("b", rows(["y"], [5]))
        flaky.arm(reads=100)
        with pytest.raises(ConsensusError) as e:
            t2.commit_at(3)
        assert e.value.is_indeterminate() and e.value.idempotency_token == t2.token
        flaky.reads_to_fail = 0
        sets = blob.metrics.snapshot().sets
        assert t2.commit_at(9) == 3  # the earlier attempt landed at 3
        assert blob.metrics.snapshot().sets == sets
        snap = c.snapshot_many(["a", "b"])
        assert contents(snap["a"]) == Counter({("x", 1): 1, ("x", 5): 1})
        assert c.inspect("a").upper == ac(4)

        # Abort after an unknown outcome keeps the parts (they may be referenced).
        t3 = c.begin()
        t3.resolve_attempts = 1
        t3.write("a", rows(["q"], [1]))
        flaky.arm(reads=100)
        with pytest.raises(ConsensusError):
            t3.commit_at(4)
        flaky.reads_to_fail = 0
        keys = [k for b in t3._shards[c.shard_id("a")].batches for k in b.blob_keys()]
        t3.abort()
        assert all(blob.get(k) is not None for k in keys)
        assert contents(c.snapshot_many(["a"])["a"])[("q", 1)] == 1
    finally:
        c.close()
        inner.close()


def test_snapshot_many_default_is_the_latest_time_definite_everywhere(
    client: PersistClient,
) -> None:
    wa, _ = client.open("a", KS, VS)
    txn = client.begin()
    txn.write("a", rows(["x"], [1]))
    txn.write("b", rows(["y"], [1]))
    txn.commit_at(3)
    wa.compare_and_append([((("later",), (0,)), 6, 1)], 4, 8)  # only shard a moves on
    snap = client.snapshot_many(["a", "b"])
    # Read at min(upper) - 1 = 3 in both: the single-shard append at 6 is not shown.
    assert contents(snap["a"]) == Counter({("x", 1): 1})
    assert {r["_time"] for r in snap["a"].to_pylist()} == {3}
    with pytest.raises(InvalidUsage):
        client.snapshot_many({"b": 7})  # beyond b's upper
    assert contents(client.snapshot_many({"a": 7})["a"]) == Counter({("x", 1): 1, ("later", 0): 1})


def test_a_shard_written_twice_in_one_txn_and_a_finished_txn(client: PersistClient) -> None:
    txn = client.begin()
    txn.write("a", rows(["x"], [1]))
    txn.write("a", rows(["x", "y"], [1, 2], [1, -1]))
    assert txn.commit() == 0
    assert contents(client.snapshot_many(["a"])["a"]) == Counter({("x", 1): 2, ("y", 2): -1})
    with pytest.raises(InvalidUsage, match="already committed"):
        txn.write("a", rows(["x"], [1]))
    with pytest.raises(InvalidUsage, match="commit time"):
        client.begin().commit_at(2**63 - 1)


def test_time_column_writes_keep_their_times(client: PersistClient, stash: Stash) -> None:
    cat = stash.collection("catalog", key="str", value="json")
    txn = client.begin()
    t = pa.table({"k": ["d0", "d1", "d2"], "v": [1, 1, 1], "day": pa.array([0, 1, 2], pa.int64())})
    txn.write("a", t, time_column="day")
    txn.write("b", rows(["plane"], [7]))  # untimed: at the commit time
    b = cat.make_batch(stash)
    cat.append_to_batch(b, "plane", 1, 1)
    txn.stash_append([b])
    with pytest.raises(InvalidUsage, match="time 2, after the commit time"):
        txn.commit_at(1)
    assert txn.commit() == 2  # the largest time written
    assert client.inspect("a").upper == ac(3) and client.inspect("b").upper == ac(3)
    assert contents(client.snapshot_many({"a": 0})["a"]) == Counter({("d0", 1): 1})
    assert contents(client.snapshot_many({"a": 1})["a"]) == Counter({("d0", 1): 1, ("d1", 1): 1})
    assert contents(client.snapshot_many({"b": 1})["b"]) == Counter()
    assert contents(client.snapshot_many({"b": 2})["b"]) == Counter({("plane", 7): 1})

    t2 = client.begin()
    t2.write("a", rows(["x"], [1]))
    with pytest.raises(InvalidUsage, match="not both"):
        t2.write("a", t, time_column="day")
    with pytest.raises(InvalidUsage, match="time_column 'nope'"):
        t2.write("b", t, time_column="nope")
    t2.abort()

    # A race that moves the upper past a timed write's time: no later ts fixes it.
    w, _ = client.open("c", KS, VS)
    t3 = client.begin()
    t3.write("c", t, time_column="day")
    w.compare_and_append([], 0, 2)
    with pytest.raises(TxnUpperMismatch) as e:
        t3.commit()
    assert e.value.unfixable == {"c"} and e.value.retry_ts() is None
    assert "own times" in str(e.value)
    t3.abort()


def test_write_batches_takes_transmitted_batches(client: PersistClient, blob: MemoryBlob) -> None:
    from persist.txn import RAW_TIME

    w, _ = client.open("a", KS, VS)
    wb, _ = client.open("b", KS, VS)
    # As a Spark executor would: untimed batch at RAW_TIME, timed batch with its times.
    raw = w.batch(
        pa.table({"k": ["x"], "v": [1], "_time": [RAW_TIME], "_diff": [1]}),
        RAW_TIME,
        RAW_TIME + 1,
    )
    timed = wb.batch(pa.table({"k": ["y"], "v": [1], "_time": [4], "_diff": [1]}), 4, 5)
    got_raw = w.batch_from_transmittable(raw.into_transmittable())
    got_timed = wb.batch_from_transmittable(timed.into_transmittable())
    txn = client.begin()
    with pytest.raises(InvalidUsage, match="another shard"):
        txn.write_batches("a", [got_timed])
    txn.write_batches("a", [got_raw])
    txn.write_batches("b", [got_timed])
    with pytest.raises(InvalidUsage, match="already"):
        txn.write_batches("b", [got_timed])
    assert txn.commit() == 4
    snap = client.snapshot_many({"a": 4, "b": 4})
    assert contents(snap["a"]) == Counter({("x", 1): 1})
    assert contents(snap["b"]) == Counter({("y", 1): 1})
    assert client.inspect("a").upper == ac(5)


def test_history_records_commit_with_the_transaction_or_not_at_all(
    client: PersistClient, stash: Stash
) -> None:
    """Each shard's history record is an entry of its history log inserted in the
    transaction's one database transaction: a record out of step on one shard commits
    nothing on any shard."""
    from stash import logs

    sids = {n: client.shard_id(n) for n in ("a", "b")}
    before = {n: client.consensus.history(s) for n, s in sids.items()}
    txn = client.begin()
    txn.write("a", rows(["x"], [1]))
    txn.write("b", rows(["y"], [2]))
    assert txn.commit_at(4) == 4
    after = {n: client.consensus.history(s) for n, s in sids.items()}
    for n in sids:
        assert after[n][: len(before[n])] == before[n]
        assert [r["op"] for r in after[n][len(before[n]) :]] == ["txn"]
    # Damage b's history log: an entry the state does not know of.
    name = client.consensus.history_log_name(sids["b"])
    head = logs.head_seqno(stash, name)
    assert head is not None
    logs.write(stash, [logs.LogEntry(name, head, head + 1, '{"seqno": -1}')])
    uppers = {n: client.inspect(n).upper for n in sids}
    txn = client.begin()
    txn.write("a", rows(["x2"], [1]))
    txn.write("b", rows(["y2"], [2]))
    with pytest.raises(ConsensusError, match="history log .* out of step"):
        txn.commit_at(6)
    assert {n: client.inspect(n).upper for n in sids} == uppers
    assert client.consensus.history(sids["a"]) == after["a"]
