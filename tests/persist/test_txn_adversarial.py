"""Regression tests for defects found in persist.txn (``persist/txn.py``,
``persist/txn_commit.py``): an unknown outcome resolved exactly even after later appends
(each transaction records its token under its own writer id), a stash-only transaction that
lost its acknowledgement never reported as "nothing committed", a refused write that leaves
the shard's schema alone, two stash batches of one collection merged, clear errors for
finalized shards, shards at the largest time and timed writes below the upper.  Each test
failed on the code before its fix."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pytest

from persist import ConsensusError, InvalidUsage, MemoryBlob, PersistClient, TxnUpperMismatch
from stash import Stash
from tests.support.clock import Clock
from tests.support.stash_faults import AckLostStash

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


def _row(k: str, v: int = 1) -> pa.Table:
    return pa.table({"k": [k], "v": pa.array([v], pa.int64())})


@pytest.fixture
def inner() -> Iterator[Stash]:
    s = Stash.open("memory://", fenced=False)
    yield s
    s.close()


def test_stash_only_txn_retry_after_lost_ack_does_not_claim_nothing_committed(
    inner: Stash,
) -> None:
    """A stash-only transaction whose append landed but lost its acknowledgement is
    indeterminate; retrying ``commit_at`` must not then report "nothing was committed"
    (a definite failure that tells the caller to rebuild and re-append: a duplicate)."""
    flaky = AckLostStash(inner)
    c = PersistClient(flaky, MemoryBlob(), compaction="off", consensus_retries=3)  # type: ignore[arg-type]
    cat = inner.collection("catalog", key="str", value="json")
    b = cat.make_batch(inner)
    cat.append_to_batch(b, "k", 1, 1)
    txn = c.begin()
    txn.stash_append([b])
    flaky.arm(reads=0)
    with pytest.raises(ConsensusError) as e:
        txn.commit_at(0)
    assert e.value.is_indeterminate()
    assert inner.iter(cat) == [(("k", 1), 0, 1)]  # it did land
    # The retry must either succeed (it landed) or stay indeterminate; it must never
    # claim a definite "nothing was committed" race.
    try:
        txn.commit_at(0)
    except TxnUpperMismatch as err:
        pytest.fail(f"a landed commit reported as a definite failure: {err}")
    except ConsensusError as err:
        assert err.is_indeterminate()
    c.close()


def test_two_stash_batches_for_one_collection_are_not_reported_as_a_race(
    inner: Stash,
) -> None:
    """Two ``stash_append`` batches for the same collection in one transaction: the
    commit raises ``TxnUpperMismatch`` "lower check failed ... upper {0}" although nothing
    raced (the upper IS the batches' lower) and tells the caller to rebuild, which fails
    the same way for ever.  It must be refused up front (InvalidUsage at
    ``stash_append``) or committed as one batch."""
    c = PersistClient(inner, MemoryBlob())
    c.open("a", KS, VS)
    cat = inner.collection("planes", key="str", value="json")
    b1 = cat.make_batch(inner)
    cat.append_to_batch(b1, "A", 1, 1)
    b2 = cat.make_batch(inner)
    cat.append_to_batch(b2, "B", 2, 1)
    txn = c.begin()
    txn.write("a", pa.table({"k": ["x"], "v": pa.array([1], pa.int64())}))
    txn.stash_append([b1])
    try:
        txn.stash_append([b2])
    except InvalidUsage:
        return  # refused up front with a clear error: fine
    try:
        txn.commit()
    except TxnUpperMismatch as e:
        pytest.fail(f"no race happened, yet: {e}")
    assert inner.peek_one(cat) == {"A": 1, "B": 2}
    c.close()


def test_commit_on_a_dropped_shard_is_invalid_usage_not_a_retryable_race(inner: Stash) -> None:
    """``commit_at`` on a shard dropped after the write raises InvalidUsage ("was
    finalized"), as documented; ``commit()`` raises ``TxnUpperMismatch`` "upper {}
    (retry at a later time)" instead: a race that tells the caller to retry, for a
    shard that can never be written again."""
    c = PersistClient(inner, MemoryBlob())
    c.open("a", KS, VS)
    txn = c.begin()
    txn.write("a", pa.table({"k": ["x"], "v": pa.array([1], pa.int64())}))
    c.finalize_shard("a")
    with pytest.raises(InvalidUsage, match="finalized"):
        txn.commit()
    c.close()


def test_refused_txn_write_does_not_evolve_the_shard_schema(inner: Stash) -> None:
    """``Txn.write(name, bad_updates, key_schema=, value_schema=newer)`` raises
    InvalidUsage ("Nothing is written": clear errors, nothing half-done),
    yet the newer value schema has already been registered in the shard's state by
    compare-and-set: a refused write of an uncommitted transaction committed a schema
    change (and abort does not undo it)."""
    c = PersistClient(inner, MemoryBlob())
    c.open("a", KS, VS)
    before = c.inspect("a").schemas().versions
    newer = pa.schema([("v", pa.int64()), ("z", pa.int32())])
    txn = c.begin()
    with pytest.raises(InvalidUsage):
        txn.write("a", pa.table({"k": ["x"]}), key_schema=KS, value_schema=newer)
    txn.abort()
    after = c.inspect("a").schemas().versions
    assert len(after) == len(before), f"schema history grew: {after}"
    c.close()


def test_unknown_outcome_retry_after_other_txns_never_double_applies(inner: Stash) -> None:
    """T1's commit lands but its acknowledgement is lost and the re-reads fail: an
    indeterminate ConsensusError (correct).  The same client then commits 8 more
    transactions to the shard (other threads, or once the stash is back): they share
    the client's transaction writer, whose state keeps only the last
    WRITER_TOKENS_KEPT (8) tokens, so T1's token is pushed out.  Retrying T1 with
    ``commit()`` no longer finds its token, takes the upper beyond its time for a race
    and commits T1 a second time: its row shows with diff 2.  (An unknown outcome
    is never resolved by applying twice.)"""
    flaky = AckLostStash(inner)
    c = PersistClient(  # type: ignore[arg-type]
        flaky, MemoryBlob(), compaction="off", consensus_retries=1, inline_max_bytes=0
    )
    c.open("a", KS, VS)
    t1 = c.begin()
    t1.resolve_attempts = 1
    t1.resolve_max_wait = 0.001
    t1.write("a", pa.table({"k": ["t1"], "v": pa.array([1], pa.int64())}))
    flaky.arm(reads=100)
    with pytest.raises(ConsensusError) as e:
        t1.commit_at(0)
    assert e.value.is_indeterminate()
    flaky.reads_to_fail = 0
    for i in range(8):
        t = c.begin()
        t.write("a", pa.table({"k": [f"o{i}"], "v": pa.array([i], pa.int64())}))
        t.commit()
    try:
        t1.commit()
    except (TxnUpperMismatch, ConsensusError):
        pass  # refusing (or staying indeterminate) is acceptable; applying twice is not
    snap = c.snapshot_many(["a"])["a"]
    diffs = {r["k"]: r["_diff"] for r in snap.to_pylist()}
    assert diffs["t1"] == 1, f"transaction T1 applied {diffs['t1']} times"
    c.close()


def test_commit_on_a_shard_at_the_largest_time_names_the_shard(inner: Stash) -> None:
    """After ``commit_at(2**63 - 2)`` a shard's upper is ``{2**63 - 1}``: no time is left
    to write at.  A later ``txn.commit()`` (no time given by the caller) raises
    ``InvalidUsage: commit time 9223372036854775807 is outside [-2**63, 2**63 - 1)``: a
    complaint about a time the caller never passed, naming no shard."""
    from persist import PersistError

    c = PersistClient(inner, MemoryBlob())
    c.open("full", KS, VS)
    t = c.begin()
    t.write("full", pa.table({"k": ["x"], "v": pa.array([1], pa.int64())}))
    t.commit_at(2**63 - 2)
    t2 = c.begin()
    t2.write("full", pa.table({"k": ["y"], "v": pa.array([1], pa.int64())}))
    with pytest.raises(PersistError) as e:
        t2.commit()
    assert "full" in str(e.value), f"unclear: {type(e.value).__name__}: {e.value}"
    assert not isinstance(e.value, InvalidUsage) or "commit time" not in str(e.value)
    c.close()


def test_unknown_outcome_via_a_handle_survives_later_appends_through_it(inner: Stash) -> None:
    """Like the test above, with ``Txn.write(handle, ...)``: 8 later appends through the
    same handle must not push the transaction's token out of the state (before the
    fix the token was recorded with the handle's writer, which keeps only 8)."""
    flaky = AckLostStash(inner)
    c = PersistClient(  # type: ignore[arg-type]
        flaky, MemoryBlob(), compaction="off", consensus_retries=1, inline_max_bytes=0
    )
    w, r = c.open("a", KS, VS)
    r.expire()
    t1 = c.begin()
    t1.resolve_attempts = 1
    t1.resolve_max_wait = 0.001
    t1.write(w, _row("t1"))
    flaky.arm(reads=100)
    with pytest.raises(ConsensusError) as e:
        t1.commit_at(0)
    assert e.value.is_indeterminate()
    flaky.reads_to_fail = 0
    for i in range(8):
        up = c.inspect("a").upper.as_option()
        assert up is not None
        u = _row(f"o{i}", i)
        u = u.append_column("_time", pa.array([up], pa.int64()))
        u = u.append_column("_diff", pa.array([1], pa.int64()))
        w.compare_and_append(u, up, up + 1)
    try:
        assert t1.commit() == 0  # it landed at 0: found, not applied again
    except (TxnUpperMismatch, ConsensusError):
        pass
    diffs = {r["k"]: r["_diff"] for r in c.snapshot_many(["a"])["a"].to_pylist()}
    assert diffs["t1"] == 1, f"transaction T1 applied {diffs['t1']} times"
    c.close()


def test_transaction_records_do_not_pile_up_in_the_shard_state(inner: Stash) -> None:
    """Each transaction records its token under its own writer id; the ids of
    acknowledged transactions are dropped by the client's next commit on the shard, so
    a stream of transactions keeps the shard's writer list small."""
    c = PersistClient(inner, MemoryBlob())
    c.open("a", KS, VS)
    for i in range(20):
        t = c.begin()
        t.write("a", _row(f"k{i}"))
        t.commit()
    st = c.machine(c.shard_id("a")).fetch()
    assert len(st.writers) <= 3, sorted(st.writers)
    assert len(c.snapshot_many(["a"])["a"]) == 20
    c.close()


def test_stash_batches_for_one_collection_that_disagree_are_refused(inner: Stash) -> None:
    """Batches for one collection are merged only when made from the same upper; one
    batch added twice would append its entries twice: both refused at
    ``stash_append``."""
    c = PersistClient(inner, MemoryBlob())
    cat = inner.collection("planes", key="str", value="json")
    b1 = cat.make_batch(inner)
    cat.append_to_batch(b1, "A", 1, 1)
    txn = c.begin()
    txn.stash_append([b1])
    with pytest.raises(InvalidUsage, match="added twice"):
        txn.stash_append([b1])
    txn.commit()
    b2 = cat.make_batch(inner)  # from the new upper
    t2 = c.begin()
    b3 = cat.make_batch(inner)
    b3.lower = b3.compact = inner.upper(cat).__class__.from_elem(0)
    t2.stash_append([b2])
    with pytest.raises(InvalidUsage, match="disagree"):
        t2.stash_append([b3])
    assert inner.peek_one(cat) == {"A": 1}
    c.close()


def test_time_column_write_below_the_shard_upper_is_bad_input(inner: Stash) -> None:
    """A ``time_column`` write whose times are already below the shard's upper can
    never commit: it is refused at ``write`` (InvalidUsage naming the shard and the
    times), not reported at commit as a race."""
    c = PersistClient(inner, MemoryBlob())
    w, _ = c.open("a", KS, VS)
    w.compare_and_append([], 0, 5)
    txn = c.begin()
    t = pa.table({"k": ["x"], "v": pa.array([1], pa.int64()), "d": pa.array([3], pa.int64())})
    with pytest.raises(InvalidUsage, match=r"'a'.*from 3 to 3.*upper is already \{5\}"):
        txn.write("a", t, time_column="d")
    assert txn.shards == []
    txn.abort()
    c.close()


@pytest.mark.parametrize("inline", [True, False])
def test_unknown_outcome_is_learned_after_its_writer_lease_ran_out(
    inner: Stash, inline: bool
) -> None:
    """A landed-but-unacknowledged transaction retried after its writer lease ran out:
    the retry must not apply it again (it did with inline parts, before a fix) nor call
    it a lease failure ("nothing committed").  The shard's record of the transaction's
    token outlives the lease (persist/landed.py), so the retry learns that it landed,
    at its first time (it reported the outcome unknown while the record lived with a
    writer lease)."""
    flaky = AckLostStash(inner)
    clock = Clock(1000.0)
    c = PersistClient(  # type: ignore[arg-type]
        flaky,
        MemoryBlob(),
        compaction="off",
        consensus_retries=1,
        inline_max_bytes=1 << 20 if inline else 0,
        clock=clock,
    )
    c.open("a", KS, VS)
    t1 = c.begin()
    t1.resolve_attempts = 1
    t1.resolve_max_wait = 0.001
    t1.write("a", _row("t1"))
    flaky.arm(reads=100)
    with pytest.raises(ConsensusError):
        t1.commit_at(0)
    flaky.reads_to_fail = 0
    clock.t += c.writer_lease_seconds + 10
    t = c.begin()  # expires the lapsed leases as it commits
    t.write("a", _row("other"))
    t.commit()
    assert t1.commit() == 0
    diffs = {r["k"]: r["_diff"] for r in c.snapshot_many(["a"])["a"].to_pylist()}
    assert diffs["t1"] == 1, f"transaction T1 applied {diffs['t1']} times"
    c.close()
