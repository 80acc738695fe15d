"""Protects: racing appends across rollups are each read back once; caches stay at
the head.

Threads of several clients appending to one shard across rollup boundaries: every
acknowledged append is read back exactly once, and every client's cached version equals
the head (SQLite stash, several max_diffs)."""

import threading
from collections import Counter

import pyarrow as pa
import pytest

from persist import MemoryBlob, PersistClient
from stash import Antichain, Stash

pytestmark = pytest.mark.adversarial

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


@pytest.mark.parametrize("url_kind", ["memory", "sqlite"])
def test_racing_appends_across_rollups(tmp_path, url_kind) -> None:
    url = "memory://" if url_kind == "memory" else f"sqlite:///{tmp_path}/s.db"
    s = Stash.open(url, fenced=False)
    blob = MemoryBlob()
    clients = [PersistClient(s, blob, compaction="inline") for _ in range(3)]
    for c, md in zip(clients, [0, 1, 2], strict=True):
        c.consensus.max_diffs = md
    errors: list[BaseException] = []
    acked: Counter = Counter()
    lock = threading.Lock()

    def run(i: int) -> None:
        try:
            w, _r = clients[i].open("t", KS, VS)
            for j in range(15):
                while True:
                    lo = w.fetch_recent_upper().as_option()
                    try:
                        w.compare_and_append(
                            [(((f"c{i}",), (j,)), lo, 1)],
                            Antichain.from_elem(lo),
                            Antichain.from_elem(lo + 1),
                        )
                    except Exception as e:
                        if type(e).__name__ == "UpperMismatch":
                            continue
                        raise
                    with lock:
                        acked[(f"c{i}", j)] += 1
                    break
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    try:
        assert not errors, errors
        w, r = clients[0].open("t", KS, VS)
        up = w.fetch_recent_upper().as_option()
        got: Counter = Counter()
        for row in r.snapshot(up - 1).to_pylist():
            got[(row["k"], row["v"])] += row["_diff"]
        assert got == acked
        for c in clients:
            for sid, m in c._machines.items():
                head = c.consensus.head(sid)
                m.fetch()
                assert m._cache.version.texts == head.texts
    finally:
        for c in clients:
            c.close()
        s.close()
