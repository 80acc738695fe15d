"""A transaction's stash batch whose lower check failed is rebuilt inside the
transaction: ``Txn.stash_replace`` swaps the rebuilt batch in, the shard writes and
their uploaded parts are kept (no part is uploaded again), and the commit lands once."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from persist import FileBlob, InvalidUsage, PersistClient, TxnUpperMismatch
from stash import Stash

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


class CountingBlob(FileBlob):
    """A file blob store counting the keys it is asked to ``set``."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.sets = 0

    def set(self, key: str, value: bytes) -> None:
        self.sets += 1
        super().set(key, value)


@pytest.fixture
def env(tmp_path: Path):
    url = f"sqlite:///{tmp_path}/stash.db"
    s = Stash.open(url, fenced=False)
    blob = CountingBlob(str(tmp_path / "blob"))
    c = PersistClient(s, blob, compaction="off", inline_max_bytes=0)
    c.open("orders", KS, VS)
    cat = s.collection("catalog", key="str", value="int")
    other = Stash.open(url, fenced=False)  # another writer of the catalog
    yield s, c, cat, blob, other
    c.close()
    s.close()
    other.close()


def _race(other: Stash) -> None:
    cat = other.collection("catalog", key="str", value="int")
    b = cat.make_batch(other)
    cat.append_to_batch(b, "theirs", 7, 1)
    other.append([b])


def test_a_stash_batch_that_lost_its_lower_check_is_replaced(env) -> None:
    s, c, cat, blob, other = env
    txn = c.begin()
    txn.write("orders", pa.table({"k": ["a"], "v": [1]}))
    uploads = blob.sets
    assert uploads >= 1
    batch = cat.make_batch(s)
    cat.append_to_batch(batch, "orders", 1, 1)
    txn.stash_append([batch])
    _race(other)
    with pytest.raises(TxnUpperMismatch) as ei:
        txn.commit_at(5)
    assert set(ei.value.collections) == {"catalog"} and ei.value.retry_ts() is None
    rebuilt = cat.make_batch(s)
    cat.append_to_batch(rebuilt, "orders", 1, 1)
    with pytest.raises(InvalidUsage, match="stash_replace"):
        txn.stash_append([rebuilt])  # two batches of one collection from two uppers
    txn.stash_replace([rebuilt])
    assert txn.commit_at(5) == 5
    assert blob.sets == uploads  # the parts written once are the ones committed
    assert sorted(s.peek_one(cat).items()) == [("orders", 1), ("theirs", 7)]
    snap = c.snapshot_many({"orders": 5})["orders"]
    assert snap.column("k").to_pylist() == ["a"] and snap.column("_diff").to_pylist() == [1]


def test_stash_replace_keeps_other_collections_and_checks_like_stash_append(env) -> None:
    s, c, cat, _blob, _other = env
    log = s.collection("log", key="str", value="int")
    txn = c.begin()
    txn.write("orders", pa.table({"k": ["a"], "v": [1]}))
    b1, b2 = cat.make_batch(s), log.make_batch(s)
    cat.append_to_batch(b1, "x", 1, 1)
    log.append_to_batch(b2, "y", 2, 1)
    txn.stash_append([b1, b2])
    with pytest.raises(InvalidUsage, match="AppendBatch"):
        txn.stash_replace(["not a batch"])  # type: ignore[list-item]
    b3 = cat.make_batch(s)
    cat.append_to_batch(b3, "z", 3, 1)
    txn.stash_replace([b3])
    txn.commit_at(1)
    assert s.peek_one(cat) == {"z": 3}  # b1 was replaced, not appended
    assert s.peek_one(log) == {"y": 2}
