"""Protects: GC never deletes a part a live Listen is reading.

The attack: a Listen reading the parts of a version while its own background
heartbeat (the lease keeper) advances its seqno hold past that version; compaction
retires the parts and GC (grace 0) deletes them under the listen's read.

Contract (persist/read.py module docstring): "a reader holds a *seqno* in the state
(its lease's seqno hold): never later than the oldest version a read of this handle
is using ... so GC keeps every part those versions reference".
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from persist import MemoryBlob, PersistClient, collect_garbage
from persist.lease import LeaseKeeper
from stash import Stash
from tests.support.clock import Clock

pytestmark = pytest.mark.adversarial

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])


class HookBlob:
    """A MemoryBlob that runs ``hook`` once, on the first ``get`` of a data part,
    before serving it."""

    def __init__(self) -> None:
        self.inner = MemoryBlob()
        self.hook: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get(self, key: str) -> bytes | None:
        hook, self.hook = self.hook, None
        if hook is not None and key.endswith(".parquet"):
            hook(key)
        elif hook is not None:
            self.hook = hook
        return self.inner.get(key)

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(key, value)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def list_keys(self, prefix: str = "") -> list[tuple[str, int]]:
        return self.inner.list_keys(prefix)


def test_listen_background_beat_lets_gc_delete_the_parts_it_is_reading() -> None:
    clock = Clock()
    keeper = LeaseKeeper(clock=clock, thread=False)
    blob = HookBlob()
    stash = Stash.open("memory://", fenced=False)
    client = PersistClient(
        stash,
        blob,
        compaction="off",
        inline_max_bytes=0,
        gc_interval_seconds=None,
        clock=clock,
    )
    w, r = client.open("s", KS, VS)
    r.lease_keeper = keeper
    for t in range(8):
        w.append([(((t,), (f"v{t}",)), t, 1)], t, t + 1)
    listen = r.listen(0, heartbeat_seconds=1.0)
    deleted: list[str] = []

    def under_the_read(key: str) -> None:
        # While the listen reads the batches of the version it fetched:
        client.compactor.compact_once("s")  # retires the parts it is reading
        client.compactor.expire_writers()
        clock.now += 5
        keeper.run_due()  # the listen's own background beat
        r.heartbeat()  # the handle reads nothing: its hold moves up too
        rep = collect_garbage(client, "s", grace_seconds=0)
        deleted.extend(rep.deleted_retired)

    blob.hook = under_the_read
    events = listen.poll()  # CorruptPart: a part it needed was deleted
    got = sorted(
        k for e in events if e.kind == "updates" for k in e.updates.column("k").to_pylist()
    )
    assert not deleted, f"GC deleted parts the listen was reading: {deleted[:2]}"
    assert got == list(range(1, 8))
    client.close()
