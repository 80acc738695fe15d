"""An entry of the shard registry (stash collection ``persist.shards``) that persist did
not write raises ``ConsensusError`` naming the entry and the rule it breaks, when a
table is opened, created or listed: a value without ``shard_id`` used to raise a bare
``KeyError: 'shard_id'``, a value that is not an object was skipped (so
``create_table`` registered the name a second time), and ``shards()`` listed the
string ``'None'`` as a shard id."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from persist import ConsensusError, MemoryBlob, PersistClient
from persist.shard_registry import REGISTRY_COLLECTION
from stash import Stash

SCHEMA = pa.schema([pa.field("k", pa.int64(), False)])
GOOD = "s00000000-0000-4000-8000-000000000000"


@pytest.fixture
def world() -> Iterator[tuple[Stash, PersistClient]]:
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off")
    c.create_table("fine", SCHEMA, key=["k"])
    yield s, c
    c.close()
    s.close()


def put(s: Stash, name: Any, value: Any, diff: int = 1) -> None:
    reg = s.collection(REGISTRY_COLLECTION, key="str", value="json")
    b = reg.make_batch(s)
    reg.append_to_batch(b, name, value, diff)
    s.append([b])


@pytest.mark.parametrize(
    ("value", "diff", "rule"),
    [
        ({"created_ms": 1}, 1, r"'shard_id' is 's' followed by a lower-case UUID"),
        ("s-not-an-object", 1, r"value 's-not-an-object': it must be an object"),
        ({"shard_id": 42}, 1, r"value \{'shard_id': 42\}"),
        ({"shard_id": "sNOT-A-UUID"}, 1, r"'shard_id' is 's' followed"),
        ({"shard_id": GOOD}, 2, "multiplicity 2: a name is registered once"),
    ],
    ids=["no shard_id", "not an object", "not a str", "not an id", "twice"],
)
def test_a_bad_entry_is_named_with_its_rule(
    world: tuple[Stash, PersistClient], value: Any, diff: int, rule: str
) -> None:
    s, c = world
    put(s, "bad", value, diff)
    where = r"shard registry entry 'bad' \(stash collection persist.shards\)"
    for call in (
        lambda: c.table("bad"),
        lambda: c.create_table("bad", SCHEMA, key=["k"]),
        lambda: c.shards(),
    ):
        with pytest.raises(ConsensusError, match=where + ".*" + rule):
            call()
    assert c.table("fine").to_arrow().num_rows == 0  # other names still open


def test_two_live_entries_for_one_name_are_named(world: tuple[Stash, PersistClient]) -> None:
    s, c = world
    put(s, "fine", {"shard_id": GOOD, "created_ms": 0})
    with pytest.raises(ConsensusError, match="2 live entries for the name 'fine'"):
        c.table("fine")


def test_a_bad_name_is_named(world: tuple[Stash, PersistClient]) -> None:
    s, c = world
    put(s, "../x", {"shard_id": GOOD})
    with pytest.raises(ConsensusError, match=r"entry '../x' .*its name is not a shard name"):
        c.shards()
