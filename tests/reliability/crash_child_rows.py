"""Child process of the row-change crash campaign: applies row-level changes (upsert,
update, delete, alone through a write handle and together in a ``Txn`` with a catalog
entry) in a loop until it is SIGKILLed.

Usage: ``python crash_child_rows.py STASH_URL BLOB_URI ACK_PATH RUN``.  Loop iteration
``i`` is change ``(RUN, i)`` (:func:`apply_change`); once it returned, ``RUN i`` is
appended to ACK_PATH and fsynced.  :func:`model_change` is the same change on a dict
model, for the parent: after a kill the shards must equal the model after exactly the
acknowledged changes, or after them and the one in flight, never anything between
(a partial change) or beyond (a change applied twice).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc

from persist import PersistClient, WriteHandle
from stash import Stash

SHARDS = ("rows0", "rows1")
CATALOG = "crash.rows.catalog"
KEYS = 12
KEY_SCHEMA = pa.schema([pa.field("id", pa.int64(), False)])
VALUE_SCHEMA = pa.schema([pa.field("v", pa.int64()), pa.field("tag", pa.string())])

#: shard -> {id: (v, tag)}, and the catalog's keys
Model = tuple[dict[str, dict[int, tuple[int, str]]], set[str]]


def initial() -> Model:
    """The shards as the parent sets them up: every key with ``v`` 0."""
    return {s: {k: (0, "init") for k in range(KEYS)} for s in SHARDS}, set()


def _keys(run: int, i: int, n: int) -> list[int]:
    return sorted({(run * 5 + i * 7 + j * 5) % KEYS for j in range(n)})


def _rows(ids: list[int], v: int, tag: str) -> pa.Table:
    return pa.table(
        {"id": pa.array(ids, pa.int64()), "v": [v] * len(ids), "tag": [tag] * len(ids)},
        schema=pa.schema([*KEY_SCHEMA, *VALUE_SCHEMA]),
    )


def _in(ids: list[int]) -> pc.Expression:
    return pc.field("id").isin(pa.array(ids, pa.int64()))


def kind(i: int) -> str:
    """The change iteration ``i`` makes: ``upsert``, ``update``, ``delete`` (one shard,
    through a write handle) or ``txn`` (both shards and a catalog entry)."""
    return ("upsert", "update", "delete", "txn")[i % 4]


def model_change(model: Model, run: int, i: int) -> Model:
    """``model`` after change ``(run, i)`` (a new model; ``model`` is not changed)."""
    shards = {s: dict(rows) for s, rows in model[0].items()}
    catalog = set(model[1])
    tag = f"{run}-{i}"
    k = kind(i)
    s0, s1 = shards[SHARDS[i % 2]], shards[SHARDS[(i + 1) % 2]]
    if k == "upsert":
        for key in _keys(run, i, 4):
            s0[key] = (run * 1000 + i, tag)
    elif k == "update":
        for key in _keys(run, i, 5):
            if key in s0:
                s0[key] = (s0[key][0] + 1, tag)
    elif k == "delete":
        for key in _keys(run, i, 2):
            s0.pop(key, None)
    else:
        for key in _keys(run, i, 6):
            if key in s0:
                s0[key] = (s0[key][0] + 1, tag)
        for key in _keys(run, i + 1, 3):
            s1[key] = (-i, tag)
        s1.pop(_keys(run, i + 2, 1)[0], None)
        catalog.add(tag)
    return shards, catalog


def apply_change(
    client: PersistClient, stash: Stash, writers: dict[str, WriteHandle], run: int, i: int
) -> None:
    """Change ``(run, i)`` on the stores (see :func:`model_change`), through
    ``writers`` (a write handle per shard) or a transaction of ``client``."""
    tag = f"{run}-{i}"
    k = kind(i)
    n0, n1 = SHARDS[i % 2], SHARDS[(i + 1) % 2]
    if k == "upsert":
        writers[n0].upsert(_rows(_keys(run, i, 4), run * 1000 + i, tag))
    elif k == "update":
        writers[n0].update(_in(_keys(run, i, 5)), {"v": pc.field("v") + 1, "tag": tag})
    elif k == "delete":
        writers[n0].delete(_in(_keys(run, i, 2)))
    else:
        cat = stash.collection(CATALOG, key="str", value="json")
        txn = client.begin()
        txn.update(n0, _in(_keys(run, i, 6)), {"v": pc.field("v") + 1, "tag": tag})
        txn.upsert(n1, _rows(_keys(run, i + 1, 3), -i, tag))
        txn.delete(n1, pc.field("id") == _keys(run, i + 2, 1)[0])
        b = cat.make_batch(stash)
        cat.append_to_batch(b, tag, {"run": run, "i": i}, 1)
        txn.stash_append([b])
        txn.commit()


def make_client(stash: Stash, blob: str, clock: Callable[[], float] = time.time) -> PersistClient:
    """The client both sides use: parts of a few rows leave the state for the blob
    store (so kills land in uploads too), inline compaction, short leases."""
    return PersistClient(
        stash,
        blob,
        compaction="inline",
        inline_max_bytes=200,
        writer_lease_seconds=2.0,
        reader_lease_seconds=2.0,
        gc_interval_seconds=None,
        clock=clock,
    )


def main() -> None:
    url, blob, ack_path, run = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    s = Stash.open(url, fenced=False)
    client = make_client(s, blob)
    fd = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    writers = {n: client.open_writer(n, KEY_SCHEMA, VALUE_SCHEMA) for n in SHARDS}
    for shard in SHARDS:  # load the shards' states before the kill window opens
        client.machine(client.shard_id(shard)).state()
    print("ready", flush=True)
    i = 0
    while True:
        apply_change(client, s, writers, run, i)
        os.write(fd, f"{run} {i}\n".encode())
        os.fsync(fd)
        i += 1


if __name__ == "__main__":
    main()
