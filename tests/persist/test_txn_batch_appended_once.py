"""A transaction appends a batch once: a copy of a batch the shard already references
(its transmittable bytes decoded again) is refused with ``BatchAppended`` when the
transaction commits, as ``compare_and_append_batch`` refuses it, and two decodings in one
transaction are refused when added (their rows would count twice)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from persist import FileBlob, InvalidUsage, PersistClient
from persist.txn import RAW_TIME
from stash import Stash

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


@pytest.fixture
def client(tmp_path: Path) -> Iterator[PersistClient]:
    s = Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False)
    c = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off", inline_max_bytes=0)
    yield c
    c.close()
    s.close()


def _data(c: PersistClient) -> tuple[bytes, object, object]:
    w, r = c.open("a", KS, VS)
    raw = w.batch(
        pa.table({"k": ["x"], "v": [1], "_time": [RAW_TIME], "_diff": [1]}),
        RAW_TIME,
        RAW_TIME + 1,
    )
    return raw.into_transmittable(), w, r


def test_txn_refuses_a_batch_decoded_twice_across_transactions(client: PersistClient) -> None:
    data, w, r = _data(client)
    t1 = client.begin()
    t1.write_batches("a", [w.batch_from_transmittable(data)])  # type: ignore[attr-defined]
    t1.commit()
    t2 = client.begin()
    t2.write_batches("a", [w.batch_from_transmittable(data)])  # type: ignore[attr-defined]
    with pytest.raises(InvalidUsage):  # BatchAppended is an InvalidUsage
        t2.commit()
    up = client.inspect("a").upper.as_option()
    assert up is not None
    assert [x["_diff"] for x in r.snapshot(up - 1).to_pylist()] == [1]  # type: ignore[attr-defined]


def test_txn_refuses_a_batch_decoded_twice_in_one_transaction(client: PersistClient) -> None:
    data, w, r = _data(client)
    t = client.begin()
    t.write_batches("a", [w.batch_from_transmittable(data)])  # type: ignore[attr-defined]
    with pytest.raises(InvalidUsage):
        t.write_batches("a", [w.batch_from_transmittable(data)])  # type: ignore[attr-defined]
        t.commit()
