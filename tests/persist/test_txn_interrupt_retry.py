"""Protects: a transaction retried after an interrupt past the lease never commits
twice.

The attack: commit 2757e3a makes a transaction attempt cut short by an exception that is
none of the stash's answers (KeyboardInterrupt, an unwrapped driver error) count as
maybe landed.  A retry of ``commit_at`` then resolves it from the shard state, but
``_unknown_since_ms`` is only set for an indeterminate ConsensusError: once the
record's lease has run out, the token's absence is taken as "did not land" (not as
"cannot be learned", as it is for an indeterminate outcome) and the transaction
commits a second time."""

from __future__ import annotations

import pyarrow as pa
import pytest

from persist import ConsensusError, MemoryBlob, PersistClient
from stash import Stash
from tests.support.clock import Clock
from tests.support.stash_faults import InterruptAfterCommit

pytestmark = pytest.mark.adversarial

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


def _sum_diffs(c: PersistClient, name: str, as_of: int) -> int:
    snap = c.open_reader(name, KS, VS).snapshot(as_of)
    return sum(snap.column("_diff").to_pylist())


@pytest.mark.parametrize("wait_s", [0, 3600])
def test_txn_retried_after_an_interrupt_past_the_lease_commits_twice(wait_s: int) -> None:
    clock = Clock()
    inner = Stash.open("memory://", fenced=False)
    st = InterruptAfterCommit(inner, RuntimeError)
    blob = MemoryBlob()
    c = PersistClient(
        st,
        blob,
        compaction="off",
        writer_lease_seconds=60,
        clock=clock,  # type: ignore[arg-type]
    )
    other = PersistClient(inner, blob, compaction="off", writer_lease_seconds=60, clock=clock)
    c.open("a", KS, VS)
    txn = c.begin()
    txn.write("a", pa.table({"k": ["x"], "v": pa.array([1], pa.int64())}))
    st.armed = True
    with pytest.raises(RuntimeError):
        txn.commit_at(0)  # landed; the driver error escaped unwrapped
    clock.now += wait_s
    ow, _ = other.open("a", KS, VS)
    ow.heartbeat()  # another client's transition drops expired leases
    try:
        ts = txn.commit_at(5)  # the caller's retry
    except ConsensusError as e:  # refusing as unknown is acceptable
        assert e.is_indeterminate()
    else:
        assert ts == 0, f"the retry committed again at {ts}"
    up = other.inspect("a").upper.as_option()
    assert _sum_diffs(other, "a", up - 1) == 1, "the transaction's row was written twice"
    other.close()
    c.close()
