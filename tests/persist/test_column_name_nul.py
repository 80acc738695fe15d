"""A column name holding a NUL character is refused up front, naming the column, and
leaves nothing behind: no shard name registered without a state (the stash's JSON,
like Postgres ``jsonb``, cannot hold ``\\u0000``, so such a schema could never be
committed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from persist import InvalidUsage, MemoryBlob, PersistClient, UnknownShard
from stash import Stash
from tests.support.dbutil import backend_url


@pytest.fixture(params=["memory", "sqlite"])
def client(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[PersistClient]:
    s = Stash.open(backend_url(request, str(request.param), tmp_path), fenced=False)
    c = PersistClient(s, MemoryBlob())
    yield c
    c.close()


@pytest.mark.parametrize("role", ["key", "value"])
def test_nul_in_a_column_name_is_refused_and_registers_nothing(
    client: PersistClient, role: str
) -> None:
    bad = "a\x00b"
    cols = (
        [(bad, pa.int64()), ("v", pa.int64())]
        if role == "key"
        else [
            ("k", pa.int64()),
            (bad, pa.int64()),
        ]
    )
    key = [bad] if role == "key" else ["k"]
    with pytest.raises(InvalidUsage, match=r"column 'a\\x00b'.*NUL"):
        client.create_table("t", pa.schema(cols), key=key)
    with pytest.raises(UnknownShard):
        client.table("t")
    # the name stays free for a good schema
    good = client.create_table("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]), key=["k"])
    assert good.append(pa.table({"k": [1], "v": [2]})) == 0
    assert client.table("t").to_arrow().to_pylist() == [{"k": 1, "v": 2}]
