"""Eight processes append to one SQLite file at once, each to its own collection (and all
to one shared collection with retry on a lost race): zero errors, every acknowledged entry
present exactly once."""

from __future__ import annotations

from pathlib import Path

from stash import AppendLowerMismatch, Stash
from tests.support.procs import process_context

PROCS = 8
APPENDS = 40


def _worker(url: str, wid: int, ack_path: str) -> None:
    s = Stash.open(url, fenced=False)
    own = s.collection(f"w{wid}", key="int", value="int")
    shared = s.collection("shared", key="str", value="int")
    with open(ack_path, "w") as acks:
        for i in range(APPENDS):
            b = own.make_batch(s)
            own.append_to_batch(b, i, wid, 1)
            s.append([b])
            acks.write(f"own {i}\n")
            acks.flush()
            if i % 4 == 0:
                while True:
                    sb = shared.make_batch(s)
                    shared.append_to_batch(sb, f"{wid}-{i}", i, 1)
                    try:
                        s.append([sb])
                        break
                    except AppendLowerMismatch:
                        continue
                acks.write(f"shared {wid}-{i}\n")
                acks.flush()
    s.close()


def test_eight_processes_append_to_one_sqlite_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/stash.db"
    Stash.open(url, fenced=False).close()  # create + migrate once
    ctx = process_context()
    procs = [
        ctx.Process(target=_worker, args=(url, w, str(tmp_path / f"ack{w}"))) for w in range(PROCS)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0] * PROCS
    s = Stash.open(url, mode="readonly")
    shared = s.collection("shared", key="str", value="int")
    shared_rows = s.peek(shared)
    assert all(d == 1 for _, _, d in shared_rows)
    for w in range(PROCS):
        acked = (tmp_path / f"ack{w}").read_text().split("\n")
        own_acked = {int(line.split()[1]) for line in acked if line.startswith("own")}
        c = s.collection(f"w{w}", key="int", value="int")
        assert s.peek(c) == [(i, w, 1) for i in sorted(own_acked)]
        assert len(own_acked) == APPENDS
        shared_acked = {line.split()[1] for line in acked if line.startswith("shared")}
        assert shared_acked <= {k for k, _, _ in shared_rows}
    assert len(shared_rows) == PROCS * len(range(0, APPENDS, 4))


def test_readonly_open_never_takes_the_write_lock(tmp_path: Path) -> None:
    """A writer holds SQLite's write lock; a readonly handle opens and reads anyway (with a
    retry budget far too short to outwait the writer, so waiting for the lock would fail)."""
    import sqlite3

    from stash import Antichain

    path = tmp_path / "stash.db"
    url = f"sqlite:///{path}"
    with Stash.open(url) as w:
        c = w.collection("c", key="str", value="int")
        w.update(c, ("k", 1), 0, 1)
        w.seal(c, Antichain.from_elem(1))
    writer = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        writer.execute("BEGIN IMMEDIATE")
        writer.execute(
            "INSERT INTO data (collection_id, key, value, time, diff) VALUES (1, '\"x\"', '2', 5, 1)"
        )
        with Stash.open(url, mode="readonly", busy_timeout=0.05, retry_budget=0.1) as r:
            rc = r.collection("c", key="str", value="int")
            assert r.peek(rc) == [("k", 1, 1)]
            assert r.upper(rc) == Antichain.from_elem(1)
    finally:
        writer.execute("ROLLBACK")
        writer.close()
