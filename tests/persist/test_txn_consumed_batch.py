"""Protects: a batch's parts are appended once, through transactions too.

The attack: ``compare_and_append_batch``
refuses a consumed batch (InvalidUsage "already appended"), and ``Txn.write_batches``
refuses one that is consumed when it is added, but a commit never re-checks: a Batch
added to two transactions (or appended elsewhere after being added) is committed again
by the second, and its rows are counted twice."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pytest

from persist import InvalidUsage, MemoryBlob, PersistClient, PersistError
from persist.txn import RAW_TIME
from stash import Antichain, Stash

pytestmark = pytest.mark.adversarial

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


@pytest.fixture
def client() -> Iterator[PersistClient]:
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off", inline_max_bytes=0)
    yield c
    c.close()
    s.close()


def test_a_batch_committed_by_one_txn_is_not_committed_again_by_another(
    client: PersistClient,
) -> None:
    w, r = client.open("a", KS, VS)
    b = w.builder(Antichain.from_elem(RAW_TIME))
    b.add(
        pa.table(
            {
                "k": ["x"],
                "v": pa.array([1], pa.int64()),
                "_time": pa.array([RAW_TIME], pa.int64()),
                "_diff": pa.array([1], pa.int64()),
            }
        )
    )
    batch = b.finish(Antichain.from_elem(RAW_TIME + 1))
    t1, t2 = client.begin(), client.begin()
    t1.write_batches("a", [batch])
    t2.write_batches("a", [batch])
    ts1 = t1.commit()
    assert batch.consumed
    with pytest.raises(InvalidUsage):
        # the batch was appended by t1: appending it again must be refused, as
        # compare_and_append_batch and write_batches refuse a consumed batch
        try:
            t2.commit()
        finally:
            up = w.fetch_recent_upper().as_option()
            assert up is not None
            snap = r.snapshot(up - 1)
            assert snap.column("_diff").to_pylist() == [1], (
                f"the one row written once is counted {snap.to_pylist()} after a second "
                f"transaction committed the batch t1 already committed at {ts1}"
            )


def test_consumed_batch_refused_by_compare_and_append_batch(client: PersistClient) -> None:
    """The reference behaviour (holds)."""
    w, _r = client.open("a", KS, VS)
    b = w.builder(Antichain.from_elem(0))
    b.add([((("x",), (1,)), 0, 1)])
    batch = b.finish(Antichain.from_elem(1))
    w.compare_and_append_batch([batch], 0, 1)
    with pytest.raises(PersistError):
        w.compare_and_append_batch([batch], 0, 1)
