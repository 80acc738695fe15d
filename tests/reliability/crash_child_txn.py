"""Child process of the transaction crash campaign: commits multi-shard
transactions in a loop until it is SIGKILLed.

Usage: ``python crash_child_txn.py STASH_URL BLOB_URI ACK_PATH RUN``.  Loop iteration
``i`` is transaction ``(RUN, i)``: it writes :func:`batch_rows` ``(RUN, i)`` rows (keys
``(RUN, i, j)``) to each shard of :func:`txn_shards` ``(RUN, i)`` (two or three of
:data:`SHARDS`) and a row ``"RUN-i"`` to the stash collection :data:`CATALOG`, commits them
with ``Txn.commit()`` and then records the acknowledgement ``RUN i`` in ACK_PATH (written
and fsynced after the commit returned).  Batch sizes vary so that some batches stay
inline and some go to blob parts; compaction runs inline after each commit and GC (grace
0) every few transactions, so the kill also lands inside uploads, merges and deletions,
but mostly inside ``commit_at``.

Invariant the parent checks after the kill: every transaction is in all of its shards
and in the catalog, whole and once, or in none of them; every acknowledged one is there;
at most one unacknowledged one (the one in flight) is.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Callable

import pyarrow as pa

from persist import PersistClient, collect_garbage
from stash import Stash

SHARDS = ("txn0", "txn1", "txn2")
CATALOG = "crash.txn.catalog"
KEY_SCHEMA = pa.schema([("run", pa.int64()), ("i", pa.int64()), ("j", pa.int64())])
VALUE_SCHEMA = pa.schema([("payload", pa.string())])


def batch_rows(run: int, i: int) -> int:
    """How many rows transaction ``(run, i)`` writes to each of its shards (1..40)."""
    return 1 + (run * 31 + i * 7919) % 40


def txn_shards(run: int, i: int) -> tuple[str, ...]:
    """The shards transaction ``(run, i)`` writes: two of them, or all three."""
    k = (run * 7 + i) % 4
    return SHARDS if k == 3 else (SHARDS[k], SHARDS[(k + 1) % 3])


def payload(run: int, i: int, j: int) -> str:
    """The value of row ``(run, i, j)`` (hex digits, which compress little, so that
    batches of more than a few rows leave the state despite its compressed inline
    parts)."""
    return f"{run}-{i}-{j}-" + hashlib.sha256(f"{run}-{i}-{j}".encode()).hexdigest()[:40]


def make_client(stash: Stash, blob: str, clock: Callable[[], float] = time.time) -> PersistClient:
    """The client both sides use (as the persist crash campaign's: small inline
    threshold, inline compaction, short leases the checker steps over with its clock)."""
    return PersistClient(
        stash,
        blob,
        compaction="inline",
        inline_max_bytes=450,  # a one-row batch stays inline (~370 bytes), 5 rows do not
        writer_lease_seconds=2.0,
        reader_lease_seconds=2.0,
        gc_interval_seconds=None,
        clock=clock,
    )


def main() -> None:
    url, blob, ack_path, run = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    s = Stash.open(url, fenced=False)
    client = make_client(s, blob)
    cat = s.collection(CATALOG, key="str", value="json")
    fd = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    for shard in SHARDS:  # load the shards' states before the kill window opens
        client.machine(client.shard_id(shard)).state()
    print("ready", flush=True)
    i = 0
    while True:
        n = batch_rows(run, i)
        table = pa.table(
            {
                "run": pa.array([run] * n, pa.int64()),
                "i": pa.array([i] * n, pa.int64()),
                "j": pa.array(range(n), pa.int64()),
                "payload": [payload(run, i, j) for j in range(n)],
            }
        )
        txn = client.begin()
        for shard in txn_shards(run, i):
            txn.write(shard, table)
        b = cat.make_batch(s)
        cat.append_to_batch(b, f"{run}-{i}", {"rows": n}, 1)
        txn.stash_append([b])
        txn.commit()
        os.write(fd, f"{run} {i}\n".encode())
        os.fsync(fd)
        i += 1
        if i % 7 == 0:
            for shard in SHARDS:
                collect_garbage(client, shard, grace_seconds=0)


if __name__ == "__main__":
    main()
