"""A batch is appended once: one transmitted batch, decoded twice and appended in two
separate calls, is refused the second time because the shard already references its
parts (or did, before a compaction).

The defect: within one call two decodings were refused, but across calls the second
(after ``rewrite_ts``, as a retrying job would) was appended and the row read back with
``_diff = 2``.  Two clients on one SQLite stash file and blob directory play the two
processes that decode the bytes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist import BatchAppended, FileBlob, InvalidUsage, PersistClient, fsck
from stash import Antichain, Stash

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])


def ac(t: int) -> Antichain:
    return Antichain.from_elem(t)


def upd(k: int, v: str, t: int, d: int = 1) -> Any:
    return ((k,), (v,)), t, d


def rows(t: pa.Table) -> Counter[tuple[int, str]]:
    out: Counter[tuple[int, str]] = Counter()
    for r in t.to_pylist():
        out[(r["k"], r["v"])] += r["_diff"]
    return +out


@pytest.fixture
def clients(tmp_path: Path) -> Iterator[tuple[PersistClient, PersistClient]]:
    made = []
    for _ in range(2):
        s = Stash.open(f"sqlite:///{tmp_path / 'stash.db'}", fenced=False)
        c = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off", inline_max_bytes=0)
        made.append((c, s))
    yield made[0][0], made[1][0]
    for c, s in made:
        c.close()
        s.close()


def test_a_batch_decoded_twice_is_refused_in_a_second_call(clients: Any) -> None:
    c1, c2 = clients
    w, r = c1.open("twice", KS, VS)
    data = w.batch([upd(1, "a", 0)], 0, 1).into_transmittable()
    w.compare_and_append_batch([w.batch_from_transmittable(data)], 0, 1)
    w2, _ = c2.open("twice", KS, VS)
    copy = w2.batch_from_transmittable(data)  # decoded again, in another process
    copy.rewrite_ts(ac(1), ac(2))  # as a job retrying at the next time would
    seqno = c1.inspect("twice").seqno
    with pytest.raises(BatchAppended, match="already appended") as e:
        w2.compare_and_append_batch([copy], 1, 2)
    assert isinstance(e.value, InvalidUsage) and w.shard_id in str(e.value)
    assert e.value.keys == copy.blob_keys()
    st = c1.inspect("twice")
    assert st.upper == ac(1) and st.seqno == seqno  # nothing committed
    assert copy.consumed  # so deleting it deletes nothing the shard references
    copy.delete()
    assert rows(r.snapshot(0)) == Counter({(1, "a"): 1})
    assert fsck(c1, "twice").ok


def test_a_copy_is_refused_after_its_parts_were_compacted_away(clients: Any) -> None:
    """After a compaction the first copy's parts are retired, no longer referenced; the
    second copy is still refused (it would count twice, and GC deletes retired parts)."""
    c1, _ = clients
    w, r = c1.open("compacted", KS, VS)
    data = w.batch([upd(1, "a", 0)], 0, 1).into_transmittable()
    w.compare_and_append_batch([w.batch_from_transmittable(data)], 0, 1)
    for t in range(1, 8):
        w.compare_and_append([upd(2, "b", t)], t, t + 1)
    copy = w.batch_from_transmittable(data)
    (key,) = copy.blob_keys()
    c1.compactor.compact_once("compacted")
    assert key not in c1.inspect("compacted").referenced_blob_keys()
    copy.rewrite_ts(ac(8), ac(9))
    with pytest.raises(BatchAppended):
        w.compare_and_append_batch([copy], 8, 9)
    assert c1.inspect("compacted").upper == ac(8)
    assert rows(r.snapshot(7)) == Counter({(1, "a"): 1, (2, "b"): 7})


def test_a_copy_truncated_to_nothing_is_still_a_no_op(clients: Any) -> None:
    """A copy whose updates all lie outside its append is truncated into no part: it
    pushes none of the first copy's parts, so it is not refused."""
    c1, _ = clients
    w, r = c1.open("truncated", KS, VS)
    data = w.batch([upd(1, "a", 0)], 0, 3).into_transmittable()
    w.compare_and_append_batch([w.batch_from_transmittable(data)], 0, 1)
    w.compare_and_append_batch([w.batch_from_transmittable(data)], 1, 3)
    assert rows(r.snapshot(2)) == Counter({(1, "a"): 1})


def test_a_copy_rewritten_into_new_parts_is_refused(clients: Any) -> None:
    """A copy appended together with a batch of another rewrite frontier is rewritten
    physically into new parts: its rows would still count twice, so it is refused."""
    c1, _ = clients
    w, r = c1.open("rewritten", KS, VS)
    data = w.batch([upd(1, "a", 0)], 0, 1).into_transmittable()
    w.compare_and_append_batch([w.batch_from_transmittable(data)], 0, 1)
    copy = w.batch_from_transmittable(data)
    copy.rewrite_ts(ac(2), ac(3))
    other = w.batch([upd(2, "b", 1)], 1, 2)
    other.rewrite_ts(ac(1), ac(3))
    with pytest.raises(BatchAppended):
        w.compare_and_append_batch([copy, other], 1, 3)
    assert c1.inspect("rewritten").upper == ac(1)
    w.compare_and_append_batch([other], 1, 3)
    assert rows(r.snapshot(2)) == Counter({(1, "a"): 1, (2, "b"): 1})
