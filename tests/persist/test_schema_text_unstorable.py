"""A timestamp column whose time zone holds NUL is refused up front, naming the
column, and leaves nothing behind (no shard name registered without a state), as a
column name holding NUL is (``test_column_name_nul.py``): the stash stores schemas as
JSON, which cannot hold ``\\u0000`` (Postgres ``jsonb``).  Before, a bare ``StashError``
(``value contains a NUL character``) came from the first state commit, after the shard
name had been registered, so ``client.table(name)`` then failed with "has no state in
consensus".  (A column name holding a lone surrogate cannot reach persist: pyarrow
refuses it.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from persist import InvalidUsage, MemoryBlob, PersistClient, UnknownShard
from stash import Stash
from tests.support.dbutil import backend_url

pytest_plugins = ["tests.support.pg_fixtures"]


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def client(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[PersistClient]:
    s = Stash.open(backend_url(request, str(request.param), tmp_path), fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off")
    yield c
    c.close()
    s.close()


BAD = {
    "nul-time-zone": (
        pa.schema([("k", pa.int64()), ("ts", pa.timestamp("us", tz="UTC\x00"))]),
        ["k"],
        r"column 'ts'.*NUL",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_an_unstorable_schema_is_refused_and_registers_nothing(
    client: PersistClient, case: str
) -> None:
    schema, key, match = BAD[case]
    with pytest.raises(InvalidUsage, match=match):
        client.create_table("t", schema, key=key)
    with pytest.raises(UnknownShard):
        client.table("t")
    good = client.create_table("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]), key=["k"])
    assert good.append(pa.table({"k": [1], "v": [2]})) == 0
    assert client.table("t").to_arrow().to_pylist() == [{"k": 1, "v": 2}]
