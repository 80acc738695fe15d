"""Child process of the persist crash campaign: appends to a shard in a loop until it is
SIGKILLed.

Usage: ``python crash_child_persist.py STASH_URL BLOB_URI ACK_PATH RUN``.  Loop iteration
``i`` appends one batch of :func:`batch_rows` ``(RUN, i)`` rows (keys ``(RUN, i, j)``, one
row per ``j``) by ``compare_and_append`` at ``[upper, upper + 1)`` and then records the
acknowledgement ``RUN i`` in ACK_PATH (written and fsynced after the append returned).
Batch sizes vary so that some batches stay inline in the state and some go to blob parts;
compaction runs inline after each append and GC (grace 0) every few appends, so the kill
also lands inside merges, blob uploads and deletions.

Invariant the parent checks after the kill: every acknowledged batch is in the shard
exactly once and whole, at most one unacknowledged batch (the one in flight) is, the
shard reopens, its Spine validates and GC leaves no unreferenced part.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Callable

import pyarrow as pa

from persist import PersistClient, UpperMismatch, collect_garbage
from stash import Stash

SHARD = "crash"
KEY_SCHEMA = pa.schema([("run", pa.int64()), ("i", pa.int64()), ("j", pa.int64())])
VALUE_SCHEMA = pa.schema([("payload", pa.string())])


def batch_rows(run: int, i: int) -> int:
    """How many rows batch ``i`` of run ``run`` has (1..60; small ones stay inline)."""
    return 1 + (run * 31 + i * 7919) % 60


def payload(run: int, i: int, j: int) -> str:
    """The value of row ``(run, i, j)`` (hex digits, which compress little, so that
    batches of more than a few rows leave the state despite its compressed inline
    parts)."""
    return f"{run}-{i}-{j}-" + hashlib.sha256(f"{run}-{i}-{j}".encode()).hexdigest()[:40]


def make_client(stash: Stash, blob: str, clock: Callable[[], float] = time.time) -> PersistClient:
    """The client both sides use: small inline threshold, inline compaction, short
    writer leases (killed writers' leases expire quickly; the checker passes a clock
    ahead of them rather than sleeping)."""
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
    w = client.open_writer(SHARD, KEY_SCHEMA, VALUE_SCHEMA)
    fd = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    print("ready", flush=True)
    upper = w.fetch_recent_upper().as_option()
    assert upper is not None
    i = 0
    while True:
        n = batch_rows(run, i)
        rows = [(((run, i, j), (payload(run, i, j),)), upper, 1) for j in range(n)]
        try:
            w.compare_and_append(rows, upper, upper + 1)
        except UpperMismatch as e:  # only after an earlier child's in-flight append
            cur = e.current.as_option()
            assert cur is not None
            upper = cur
            continue
        os.write(fd, f"{run} {i}\n".encode())
        os.fsync(fd)
        upper += 1
        i += 1
        if i % 7 == 0:
            collect_garbage(client, SHARD, grace_seconds=0)


if __name__ == "__main__":
    main()
