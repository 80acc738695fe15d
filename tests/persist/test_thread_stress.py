"""Thread stress: one PersistClient and its handles, one WriteHandle and one ReadHandle,
shared by several threads (``persist/client.py``: handles are thread-safe).  Writers append
with ``compare_and_append`` and retry upper races; readers take snapshots, a listen follows
every append, another thread downgrades the since.  Everything is checked against a model
multiset of the acknowledged appends."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest

from persist import FileBlob, MemoryBlob, PersistClient, SinceViolation, UpperMismatch
from persist.read import Listen
from stash import Antichain, Stash
from tests.reliability.campaign import record

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])
WRITERS = 4
APPENDS = 25  # per writer


@pytest.mark.parametrize(
    ("backend", "compaction"), [("memory", "background"), ("sqlite", "inline")]
)
def test_shared_handles_under_threads(backend: str, compaction: str, tmp_path: Path) -> None:
    url = "memory://" if backend == "memory" else f"sqlite:///{tmp_path / 'stash.db'}"
    s = Stash.open(url, fenced=False)
    c = PersistClient(
        s,
        FileBlob(str(tmp_path / "blob")) if backend == "sqlite" else MemoryBlob(),
        compaction=compaction,  # type: ignore[arg-type]
        inline_max_bytes=256,
    )
    w, r = c.open("stress", KS, VS)
    w.compare_and_append([((("seed",), (0,)), 0, 1)], 0, 1)
    model: Counter[tuple[str, int, int]] = Counter({("seed", 0, 0): 1})
    lock = threading.Lock()
    errors: list[BaseException] = []
    done = threading.Event()
    stats: Counter[str] = Counter()

    def guard(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # reported by the main thread
                errors.append(e)
                done.set()

        return run

    def writer(who: int) -> None:
        for i in range(APPENDS):
            k = f"w{who}-{i}"
            while True:
                upper = w.fetch_recent_upper().as_option()
                assert upper is not None
                rows = [(((k,), (who,)), upper, 1), (((k + "x",), (who,)), upper, 2)]
                try:
                    w.compare_and_append(rows, upper, upper + 1)
                except UpperMismatch:
                    with lock:
                        stats["races"] += 1
                    continue
                with lock:
                    model[(k, who, upper)] += 1
                    model[(k + "x", who, upper)] += 2
                break

    def batch_writer() -> None:
        # Builds each batch once and, on an upper race, rewrites it in metadata.
        for i in range(APPENDS):
            k = f"b-{i}"
            upper = w.fetch_recent_upper().as_option()
            assert upper is not None
            b = w.builder(upper)
            b.add([(((k,), (99,)), upper, 1)])
            batch = b.finish(upper + 1)
            while True:
                try:
                    w.compare_and_append_batch(
                        [batch], Antichain.from_elem(upper), Antichain.from_elem(upper + 1)
                    )
                except UpperMismatch as e:
                    current = e.current.as_option()
                    assert current is not None and current > upper
                    upper = current
                    batch.rewrite_ts(e.current, Antichain.from_elem(upper + 1))
                    continue
                with lock:
                    model[(k, 99, upper)] += 1
                break

    def waiter() -> None:
        while not done.is_set():
            upper = w.fetch_recent_upper().as_option()
            assert upper is not None
            if upper + 2 >= final_upper:
                return
            snap = r.snapshot(upper + 2, wait=True, timeout=60)
            assert set(snap.column("_diff").to_pylist()) <= {1, 2}
            with lock:
                stats["waits"] += 1

    def snapshotter() -> None:
        last = 0
        while not done.is_set():
            upper = w.fetch_recent_upper().as_option()
            assert upper is not None
            try:
                snap = r.snapshot(upper - 1)
            except SinceViolation:
                continue
            n = sum(snap.column("_diff").to_pylist())
            assert n >= last, "a snapshot lost rows"
            last = n
            with lock:
                stats["snapshots"] += 1

    def downgrader(lag: int) -> None:
        # Two downgraders race: the later one may ask for an earlier since (a no-op).
        while not done.is_set():
            upper = w.fetch_recent_upper().as_option()
            assert upper is not None
            r.downgrade_since(max(0, upper - lag))
            with lock:
                stats["downgrades"] += 1

    final_upper = 1 + (WRITERS + 1) * APPENDS
    heard_by = [Counter[tuple[str, int, int]](), Counter[tuple[str, int, int]]()]

    # Opened before any thread starts: a listen takes its since hold when it opens,
    # and the downgraders may move the reader's since past 0 before a listener thread
    # runs (a listen at as_of 0 then is rightly refused).
    listens = [r.listen(0, poll_max_seconds=0.01) for _ in heard_by]

    def listener(heard: Counter[tuple[str, int, int]], listen: Listen) -> None:
        with listen:
            for ev in listen:
                if ev.updates is not None:
                    for row in ev.updates.to_pylist():
                        heard[(row["k"], row["v"], row["_time"])] += row["_diff"]
                if ev.progress is not None and ev.progress == Antichain.from_elem(final_upper):
                    return

    threads = [threading.Thread(target=guard(lambda i=i: writer(i))) for i in range(WRITERS)]
    threads.append(threading.Thread(target=guard(batch_writer)))
    background = [
        threading.Thread(target=guard(f))
        for f in (
            snapshotter,
            snapshotter,
            waiter,
            lambda: downgrader(20),
            lambda: downgrader(25),
        )
    ]
    ears = [
        threading.Thread(target=guard(lambda h=h, ls=ls: listener(h, ls)))
        for h, ls in zip(heard_by, listens, strict=True)
    ]
    for t in [*threads, *background, *ears]:
        t.start()
    for t in threads:
        t.join(120)
    for t in ears:
        t.join(60)
    done.set()
    for t in background:
        t.join(60)
    assert not errors, errors
    assert all(not t.is_alive() for t in [*threads, *background, *ears])
    assert w.fetch_recent_upper() == Antichain.from_elem(final_upper)
    snap = r.snapshot(final_upper - 1)
    got: Counter[tuple[str, int, int]] = Counter()
    for row in snap.to_pylist():
        got[(row["k"], row["v"])] += row["_diff"]
    want: Counter[tuple[str, int]] = Counter()
    for (k, v, _t), d in model.items():
        want[(k, v)] += d
    assert got == want
    seed_free = Counter({k: d for k, d in model.items() if k[0] != "seed"})
    for heard in heard_by:  # each listen heard every append once, at its time
        assert +heard == seed_free
    assert stats["snapshots"] > 0 and stats["downgrades"] > 0 and stats["waits"] > 0
    record(
        f"threads sharing one handle: persist on {backend} ({compaction} compaction)",
        runs=1,
        faults=0,
        acknowledged=sum(d for k, d in model.items() if k[0] != "seed"),
        lost=0,
        duplicated=0,
        partial=0,
        unclear=0,
        unreadable=0,
        listens=len(heard_by),
        snapshots=stats["snapshots"],
    )
    c.close()
    s.close()
