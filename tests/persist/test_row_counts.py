"""RowChanges count by role (persist.rows.net_changes): a retracted live row counts as
retracted whatever the sign of its count, and what cancels between a change's
retractions and insertions is not counted; the handle and a transaction agree."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from persist import MemoryBlob, PersistClient
from stash import Stash

KEY = pa.schema([pa.field("id", pa.int64(), False)])
VAL = pa.schema([("v", pa.string())])


@pytest.fixture()
def client() -> Iterator[PersistClient]:
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="inline")
    yield c
    c.close()
    s.close()


def _shard(client: PersistClient, name: str, count: int) -> None:
    w, _ = client.open(name, KEY, VAL)
    w.compare_and_append(pa.table({"id": [1], "v": ["a"], "_time": [0], "_diff": [count]}), 0, 1)


def _handle(client: PersistClient, name: str, op: str) -> tuple[int, int]:
    w, _ = client.open(name, KEY, VAL)
    if op == "delete":
        ch = w.delete(pc.field("id") == 1)
    else:
        ch = w.upsert(pa.table({"id": [1], "v": ["a"]}))
    return ch.inserted, ch.retracted


def _txn(client: PersistClient, name: str, op: str) -> tuple[int, int]:
    with client.begin() as txn:
        if op == "delete":
            txn.delete(name, pc.field("id") == 1)
        else:
            txn.upsert(name, pa.table({"id": [1], "v": ["a"]}))
    (ch,) = txn.row_changes()
    return ch.inserted, ch.retracted


@pytest.mark.parametrize("path", [_handle, _txn], ids=["handle", "txn"])
@pytest.mark.parametrize(
    ("count", "op", "expected"),
    [
        (-1, "delete", (0, 1)),  # the retraction of a count -1 row is retracted, not inserted
        (2, "delete", (0, 2)),
        (1, "upsert", (0, 0)),  # equal to its live row: nothing
        (2, "upsert", (0, 1)),  # two copies become one
        (-1, "upsert", (1, 1)),  # the -1 row retracted, the row inserted
    ],
)
def test_counts_by_role(
    client: PersistClient, path: object, count: int, op: str, expected: tuple[int, int]
) -> None:
    name = f"s{count}{op}"
    _shard(client, name, count)
    assert path(client, name, op) == expected  # type: ignore[operator]
