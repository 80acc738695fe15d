"""Transactions (``persist/txn.py``), race: four processes commit overlapping transactions
(each writes two of three shards, plus a row of its own stash collection) on one SQLite
stash and one file blob store.  Every acknowledged transaction is visible exactly once, in
all of its shards and its collection, at its commit time; and no part is uploaded twice
(every blob ``set`` of every process is counted: one per ``Txn.write``, however many races
the commits lost)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa

from persist import FileBlob, PersistClient
from stash import Stash
from tests.support.procs import process_context

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])
SHARDS = ("r0", "r1", "r2")


class CountingBlob(FileBlob):
    """A file blob store that records every key it is asked to ``set``."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.set_keys: list[str] = []

    def set(self, key: str, value: bytes) -> None:
        self.set_keys.append(key)
        super().set(key, value)


def _committer(url: str, blob_root: str, who: int, n: int, q: Any) -> None:
    s = Stash.open(url, fenced=False)
    blob = CountingBlob(blob_root)
    c = PersistClient(s, blob, compaction="off", inline_max_bytes=0)
    coll = s.collection(f"acks.{who}", key="str", value="int")
    acks: list[tuple[str, tuple[str, ...], int]] = []
    writes = 0
    for i in range(n):
        pair = (SHARDS[(who + i) % 3], SHARDS[(who + i + 1) % 3])
        tid = f"p{who}-{i}"
        txn = c.begin()
        for sh in pair:
            txn.write(sh, pa.table({"k": [tid], "v": [who]}))
            writes += 1
        b = coll.make_batch(s)
        coll.append_to_batch(b, tid, i, 1)
        txn.stash_append([b])
        ts = txn.commit()
        acks.append((tid, pair, ts))
    c.close()
    s.close()
    q.put((who, acks, writes, blob.set_keys))


def test_four_processes_commit_overlapping_transactions(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/stash.db"
    blob_root = str(tmp_path / "blob")
    with Stash.open(url, fenced=False) as s:
        c0 = PersistClient(s, FileBlob(blob_root), compaction="off")
        for sh in SHARDS:
            c0.open_writer(sh, KS, VS)
        c0.close()
    ctx = process_context()
    q = ctx.Queue()
    n = 12
    procs = [ctx.Process(target=_committer, args=(url, blob_root, i, n, q)) for i in range(4)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    all_sets = [k for _, _, _, keys in results for k in keys]
    writes = sum(w for _, _, w, _ in results)
    part_sets = [k for k in all_sets if k.endswith(".parquet")]
    assert len(part_sets) == len(set(part_sets)), "a part was uploaded twice"
    assert len(part_sets) == writes == 4 * n * 2  # one upload per write, none per retry
    acks = [a for _, acks, _, _ in results for a in acks]
    assert len(acks) == 4 * n
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, FileBlob(blob_root), compaction="off")
        # Each shard at its own latest time (the common default, min(upper) - 1, may
        # leave out the last transactions of the shards that moved on).
        snap = c.snapshot_many({sh: c.inspect(sh).upper.as_option() - 1 for sh in SHARDS})
        for sh in SHARDS:
            got = Counter()
            for r in snap[sh].to_pylist():
                got[r["k"]] += r["_diff"]
            want = Counter({tid: 1 for tid, pair, _ in acks if sh in pair})
            assert got == want, sh  # each acknowledged txn exactly once
        # Each txn at its own commit time in all of its shards: visible as of ts,
        # absent just before.
        by_ts: dict[int, list[tuple[str, tuple[str, ...]]]] = {}
        for tid, pair, ts in acks:
            by_ts.setdefault(ts, []).append((tid, pair))
        for ts, txns in sorted(by_ts.items())[:: max(1, len(by_ts) // 6)]:
            names = sorted({sh for _, pair in txns for sh in pair})
            at = c.snapshot_many(dict.fromkeys(names, ts))
            before = c.snapshot_many(dict.fromkeys(names, ts - 1)) if ts > 0 else None
            for tid, pair in txns:
                for sh in pair:
                    assert tid in at[sh].column("k").to_pylist()
                    if before is not None:
                        assert tid not in before[sh].column("k").to_pylist()
        for who in range(4):
            coll = s.collection(f"acks.{who}", key="str", value="int")
            rows = {k: v for (k, v), _t, d in s.iter(coll) if d == 1}
            assert rows == {f"p{who}-{i}": i for i in range(n)}
        c.close()
