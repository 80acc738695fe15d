"""The transaction modules (``persist.txn``, ``persist.txn_commit``, ``persist.snapshots``):
the import paths callers use keep naming the same objects, and the commit protocol's
pure pieces (merging one collection's stash batches, the retry time of a lost race)
behave as :class:`persist.Txn` documents them."""

from __future__ import annotations

from pathlib import Path

import persist
import persist.snapshots as snapshots
import persist.txn as txn
import persist.txn_commit as txn_commit
from persist.txn import RAW_TIME, Txn, TxnUpperMismatch, snapshot_many
from persist.txn_commit import merged_stash_batches
from stash import Antichain, Stash
from stash.antichain import I64_MIN


def test_import_paths_name_the_same_objects() -> None:
    assert TxnUpperMismatch is txn_commit.TxnUpperMismatch is persist.TxnUpperMismatch
    assert snapshot_many is snapshots.snapshot_many is persist.snapshot_many
    assert Txn is persist.Txn
    assert RAW_TIME == I64_MIN
    assert {"Txn", "TxnUpperMismatch", "snapshot_many"} <= set(txn.__all__)


def test_merged_stash_batches_one_per_collection(tmp_path: Path) -> None:
    s = Stash.open(f"sqlite:///{tmp_path}/stash.db", fenced=False)
    try:
        cat = s.collection("catalog", key="str", value="int")
        log = s.collection("log", key="str", value="int")
        b1, b2, b3 = cat.make_batch(s), cat.make_batch(s), log.make_batch(s)
        cat.append_to_batch(b1, "a", 1, 1)
        log.append_to_batch(b3, "l", 3, 1)
        cat.append_to_batch(b2, "b", 2, 1)
        before = (list(b1.entries), list(b2.entries))

        merged = merged_stash_batches([b1, b3, b2])

        assert [m.collection.name for m in merged] == ["catalog", "log"]
        assert merged[0].entries == before[0] + before[1]  # in the order added
        assert (merged[0].lower, merged[0].upper) == (b1.lower, b1.upper)
        assert merged[1] is b3  # a collection's only batch is sent as it is
        assert (b1.entries, b2.entries) == before  # the caller's batches are unchanged
    finally:
        s.close()


def test_upper_mismatch_retry_ts() -> None:
    e = TxnUpperMismatch(5, {"a": Antichain.from_elem(9), "b": Antichain.from_elem(3)})
    assert e.retry_ts() == 9
    assert (e.expected, e.current) == (Antichain.from_elem(5), Antichain.from_elem(9))
    assert "shard 'a' upper" in str(e) and "retry at a later time" in str(e)
    # A shard sealed for ever, a stash batch to rebuild, or timed writes now below the
    # upper: no later time can fix the race.
    assert TxnUpperMismatch(5, {"a": Antichain()}).retry_ts() is None
    assert TxnUpperMismatch(5, {}, {"catalog": Antichain.from_elem(2)}).retry_ts() is None
    sealed = TxnUpperMismatch(5, {"a": Antichain.from_elem(7)}, unfixable={"a"})
    assert sealed.retry_ts() is None
    assert "now below the upper" in str(sealed)
