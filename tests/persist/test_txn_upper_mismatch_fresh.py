"""``TxnUpperMismatch`` is decided on a fresh read of every shard of the transaction:
a shard whose upper another process advanced, but whose state this client cached
before that, is named too, so ``retry_ts()`` is large enough for
``commit_at(retry_ts())`` to commit."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from persist import PersistClient, TxnUpperMismatch
from stash import Stash
from tests.support.procs import process_context

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


def _advance(url: str, blob: str, uppers: dict[str, int]) -> None:
    """Another process: move each shard's upper to ``uppers[name]``."""
    s = Stash.open(url, fenced=False)
    c = PersistClient(s, blob, compaction="off")
    for name, upper in uppers.items():
        w, r = c.open(name, KS, VS)
        lo = w.fetch_recent_upper().as_option()
        w.compare_and_append([(((name,), (upper,)), lo, 1)], lo, upper)
        r.expire()
        w.expire()
    c.close()
    s.close()


def test_retry_ts_covers_shards_whose_cached_upper_is_stale(tmp_path: Path) -> None:
    url, blob = f"sqlite:///{tmp_path}/stash.db", f"file://{tmp_path}/blob"
    s = Stash.open(url, fenced=False)
    c = PersistClient(s, blob, compaction="off")
    try:
        for name in ("s1", "s2"):
            c.open(name, KS, VS)  # this client caches both at upper 0
        p = process_context().Process(target=_advance, args=(url, blob, {"s1": 5, "s2": 10}))
        p.start()
        p.join(120)
        assert p.exitcode == 0
        c.inspect("s1")  # s1's cached state is fresh (upper 5); s2's is still upper 0
        txn = c.begin()
        txn.write("s1", pa.table({"k": ["a"], "v": [1]}))
        txn.write("s2", pa.table({"k": ["a"], "v": [2]}))
        with pytest.raises(TxnUpperMismatch) as ei:
            txn.commit_at(3)
        e = ei.value
        assert {n: u.as_option() for n, u in e.shards.items()} == {"s1": 5, "s2": 10}
        assert e.retry_ts() == 10
        assert txn.commit_at(e.retry_ts()) == 10
        snap = c.snapshot_many({"s1": 10, "s2": 10})
        assert {r["k"] for r in snap["s2"].to_pylist()} == {"a", "s2"}
    finally:
        c.close()
        s.close()
