"""MERGE on a table that holds two distinct live rows with one key (a table is a
multiset: ``append`` keeps what it is given).  Delta's semantics: every matched target
row takes its clause, so both rows are updated, as two copies of one row already were;
an update is not an insert, so the rule "two inserted rows with one key" does not apply
to it (the merge was refused with that message although it inserted nothing)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pyarrow as pa
import pytest

from persist import InvalidUsage, MemoryBlob, PersistClient, Table
from stash import Stash

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])


@pytest.fixture
def client() -> Iterator[PersistClient]:
    c = PersistClient(Stash.open("memory://", fenced=False), MemoryBlob())
    yield c
    c.close()


def _table(client: PersistClient, rows: list[tuple[int | None, str]]) -> Table:
    t = client.create_table("t", SCHEMA, key=["k"])
    t.append(pa.table({"k": pa.array([r[0] for r in rows], pa.int64()), "v": [r[1] for r in rows]}))
    return t


def _rows(t: Table) -> Counter[tuple[int | None, str]]:
    return Counter((r["k"], r["v"]) for r in t.to_arrow().to_pylist())


@pytest.mark.parametrize("key", [1, None])
@pytest.mark.parametrize("live", [["a", "b"], ["a", "a"]])
def test_every_matched_row_of_a_key_is_updated(
    client: PersistClient, key: int | None, live: list[str]
) -> None:
    t = _table(client, [(key, v) for v in live] + [(7, "x")])
    src = pa.table({"k": pa.array([key], pa.int64()), "v": ["c"]})
    r = t.merge(src).when_matched_update_all().execute()
    assert r.num_target_rows_updated == 2
    assert _rows(t) == Counter({(key, "c"): 2, (7, "x"): 1})


def test_a_condition_updates_one_of_the_rows_of_a_key(client: PersistClient) -> None:
    t = _table(client, [(1, "a"), (1, "b")])
    src = pa.table({"k": [1], "v": ["c"]})
    r = (
        t.merge(src)
        .when_matched_update(condition="target.v = 'a'", set={"v": "source.v"})
        .execute()
    )
    assert r.num_target_rows_updated == 1
    assert _rows(t) == Counter({(1, "c"): 1, (1, "b"): 1})


def test_two_inserted_rows_with_one_key_are_still_refused(client: PersistClient) -> None:
    t = _table(client, [(1, "a"), (1, "b")])
    before = t.details()["upper"]
    src = pa.table({"k": [2, 2], "v": ["c", "d"]})
    with pytest.raises(InvalidUsage, match="two inserted rows have one key"):
        t.merge(src).when_matched_update_all().when_not_matched_insert_all().execute()
    assert t.details()["upper"] == before
