"""Protects: a transaction writes with the shard's current schema after it evolved.

The attack: ``txn.write(shard_name, updates)`` writes a shard's key and value
columns.  A client's transactions reuse one cached writer per shard
(``PersistClient._txn_writer``), made with the schema the shard had at the client's
first transaction on it; after the value schema evolves, every later transaction of
that client on the shard is validated (and written) against the stale schema, even when
the caller names the newest schemas explicitly."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pytest

from persist import MemoryBlob, PersistClient, PersistError
from stash import Stash

pytestmark = pytest.mark.adversarial

KS = pa.schema([("k", pa.string())])
V1 = pa.schema([("v", pa.int64()), ("x", pa.string())])
V_DROP = pa.schema([("v", pa.int64())])
V_ADD = pa.schema([("v", pa.int64()), ("x", pa.string()), ("w", pa.int64())])


@pytest.fixture
def env() -> Iterator[tuple[Stash, MemoryBlob]]:
    s = Stash.open("memory://", fenced=False)
    yield s, MemoryBlob()
    s.close()


def _first_txn(c: PersistClient) -> None:
    c.open("x", KS, V1)
    with c.begin() as txn:
        txn.write("x", pa.table({"k": ["a"], "v": pa.array([1], pa.int64()), "x": ["p"]}))


def test_txn_after_a_dropped_column_is_not_stuck_on_the_old_schema(
    env: tuple[Stash, MemoryBlob],
) -> None:
    s, blob = env
    c = PersistClient(s, blob, compaction="off")
    _first_txn(c)
    _w, r = c.open("x", KS, V_DROP, drop=["x"])  # a compatible evolution: drop x
    row = pa.table({"k": ["b"], "v": pa.array([2], pa.int64())})
    txn = c.begin()
    try:
        # The shard's newest schema is (k | v): a write of k, v must be taken.
        txn.write("x", row)
        ts = txn.commit()
    except PersistError as e:
        txn.abort()
        # A fresh client does exactly this without error.
        c2 = PersistClient(s, blob, compaction="off")
        t2 = c2.begin()
        t2.write("x", row)
        t2.commit()
        c2.close()
        pytest.fail(
            f"the client's transactions on shard 'x' are stuck on the schema of its first "
            f"transaction: {type(e).__name__}: {e} (a fresh client commits the same write)"
        )
    assert {"k": "b", "v": 2} in r.snapshot(ts).select(["k", "v"]).to_pylist()
    c.close()


def test_txn_with_explicit_newest_schemas_uses_them(env: tuple[Stash, MemoryBlob]) -> None:
    s, blob = env
    c = PersistClient(s, blob, compaction="off")
    _first_txn(c)
    _w, r = c.open("x", KS, V_ADD)  # a compatible evolution: add nullable w
    txn = c.begin()
    row = pa.table(
        {"k": ["b"], "v": pa.array([2], pa.int64()), "x": ["q"], "w": pa.array([7], pa.int64())}
    )
    try:
        txn.write("x", row, key_schema=KS, value_schema=V_ADD)
    except PersistError as e:
        txn.abort()
        pytest.fail(f"a write given the shard's newest schemas was refused: {e}")
    ts = txn.commit()
    got = r.snapshot(ts).to_pylist()
    assert {"k": "b", "v": 2, "x": "q", "w": 7, "_time": ts, "_diff": 1} in got, got
    c.close()
