"""The persist Spark writer's ``abort`` (driver side, run here without a SparkSession):
after an indeterminate commit that landed and was compacted since, the batch's parts
are retired, not referenced; ``abort`` must leave them to GC (which keeps them while a
reader holds a version referencing them), never delete them itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from persist import PersistClient
from spark.persist_common import ShardTarget
from spark.persist_writer import PersistCommitMessage, PersistWriter, WriteSettings
from stash import Stash

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])


def _upd(k: int, t: int) -> Any:
    return ((k,), (f"v{k}",)), t, 1


def test_abort_leaves_retired_parts_of_a_landed_commit_to_gc(tmp_path: Path) -> None:
    target = ShardTarget(f"sqlite:///{tmp_path}/stash.db", f"file://{tmp_path}/blob", "flights")
    with Stash.open(target.stash_url, fenced=False) as s:
        c = PersistClient(s, target.blob_uri, compaction="off", inline_max_bytes=0)
        w, r = c.open(target.shard, KS, VS)
        for t in range(4):
            w.compare_and_append([_upd(t, t)], t, t + 1)
        # A task's batch, transmitted to the driver; the driver's commit lands but its
        # acknowledgement is lost, so Spark calls abort with the same messages.
        b = w.batch([_upd(9, 4)], 4, 5)
        msg = PersistCommitMessage(b.into_transmittable(), 4, 5, 1, 4, 4)
        landed = w.batch_from_transmittable(msg.batch)
        keys = set(landed.blob_keys())
        w.compare_and_append_batch([landed], 4, 5)
        held = r.snapshot_batches(4)  # a reader holds the version referencing them
        t = 5
        while keys & c.inspect(target.shard).referenced_blob_keys():
            assert t < 64, "compaction never merged the landed batch"
            w.compare_and_append([_upd(t, t)], t, t + 1)
            t += 1
            r.downgrade_since(t - 1)
            c.compactor.compact_once(target.shard)
        assert not keys & c.inspect(target.shard).referenced_blob_keys()  # retired now
        settings = WriteSettings(
            target=target,
            key_columns=["k"],
            value_columns=["v"],
            key_schema=KS,
            value_schema=VS,
            time_mode="auto",
        )
        PersistWriter(settings).abort([msg])
        present = {k for k, _ in c.raw_blob.list_keys(c.shard_id(target.shard) + "/")}
        assert keys <= present, "abort deleted parts a reader still holds"
        assert len(held) >= 1
        c.close()
