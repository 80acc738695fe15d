"""Two threads writing through one ``Table`` after an idle spell longer than the
writer's lease both commit: the table replaces its expired writer once.  Before, each
thread found the writer expired, opened a writer of its own and installed it, the
second expiring the first's brand-new writer while that thread wrote with it, so its
write failed with ``InvalidUsage: writer ... was expired`` (committing nothing)."""

from __future__ import annotations

import threading
from typing import Any

import pyarrow as pa
import pytest

from persist import MemoryBlob, PersistClient
from persist.shards import Shards
from stash import Stash
from tests.support.clock import Clock

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])


@pytest.mark.parametrize("ops", [("append", "append"), ("append", "upsert"), ("upsert", "upsert")])
def test_two_writes_after_an_idle_spell_both_commit(
    monkeypatch: pytest.MonkeyPatch, ops: tuple[str, str]
) -> None:
    clock = Clock()
    s, blob = Stash.open("memory://", fenced=False), MemoryBlob()
    c = PersistClient(s, blob, clock=clock, writer_lease_seconds=60, compaction="off")
    t = c.create_table("t", SCHEMA, key=["k"])
    t.append(pa.table({"k": [0], "v": ["a"]}))
    clock.advance(3600)
    # Both threads find the writer expired before either installs a new one.
    both = threading.Barrier(2, timeout=10)
    real = Shards.writer

    def writer(self: Shards, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name.startswith("w"):
            both.wait()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Shards, "writer", writer)
    errors: list[BaseException] = []

    def run(op: str, k: int) -> None:
        try:
            getattr(t, op)(pa.table({"k": [k], "v": [f"v{k}"]}))
        except BaseException as e:
            errors.append(e)

    threads = [
        threading.Thread(target=run, args=(op, i + 1), name=f"w{i}") for i, op in enumerate(ops)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors
    assert sorted(t.to_arrow().column("k").to_pylist()) == [0, 1, 2]
    c.close()
    s.close()
