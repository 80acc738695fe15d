"""An app id's record is what its rows sum to at the upper, whatever times they are
kept at: with a retention on the table's app transaction collection (set by an
operator, e.g. to audit the records), the record a newer version replaced stays as an
insertion and a retraction at two times, not consolidated away.  Reading them as the
key's live values found three rows and raised "it was not written by persist" from
every later append and ``transaction_version`` of that app id."""

from __future__ import annotations

import pyarrow as pa

from persist import AppTransaction, MemoryBlob, PersistClient
from persist.app_txn import APP_TXN_COLLECTION_PREFIX
from stash import Stash

SCHEMA = pa.schema([pa.field("k", pa.int64(), False), ("v", pa.string())])


def test_records_kept_at_several_times_read_as_their_sum() -> None:
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off")
    t = c.create_table("t", SCHEMA, key=["k"])
    one = pa.table({"k": [1], "v": ["x"]}, schema=SCHEMA)
    assert t.append(one, app_transaction=AppTransaction("job", 1)) == 0
    coll = s.collection(APP_TXN_COLLECTION_PREFIX + t.shard_id, key="str", value="json")
    s.set_retention(coll, keep_times=None)  # every time stays readable
    two = pa.table({"k": [2], "v": ["y"]}, schema=SCHEMA)
    assert t.append(two, app_transaction=AppTransaction("job", 2)) == 1
    assert t.transaction_version("job") == 2
    seqno = c.inspect("t").seqno
    assert t.append(two, app_transaction=AppTransaction("job", 2)) == 1  # a retry
    assert c.inspect("t").seqno == seqno
    assert t.append(one, app_transaction=AppTransaction("job", 3)) == 2
    assert t.transaction_version("job") == 3
    assert t.to_arrow().num_rows == 3
    c.close()
    s.close()
