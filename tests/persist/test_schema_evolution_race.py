"""Two processes racing to evolve a shard's schema.

Each process, in rounds, reads the newest value schema, adds a nullable column of its
own, opens the shard with it (registering a version by compare-and-set, re-checked on
every race) and appends one row with its handle.  Both end correct: every open
registered exactly one version, each version is a compatible evolution of the one
before it that drops nothing (a drop must be named; an open whose schema lacks the
other process's new column, because it was planned before that column existed, is
refused with ``SchemaMismatch`` and plans again on the newest schema), each handle got
the id of a version equal to its schema, and every row appended is read back with its
own column's value.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa

from persist import MemoryBlob, PersistClient
from persist.updates import check_schema_evolution
from stash import Stash

ROUNDS = 6

CHILD = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    import pyarrow as pa
    from persist import PersistClient, SchemaMismatch, UpperMismatch
    from stash import Stash

    tmp, me = Path(sys.argv[1]), sys.argv[2]
    K = pa.schema([pa.field("k", pa.string(), nullable=False)])
    stash = Stash.open(f"sqlite:///{tmp}/stash.db", fenced=False)
    client = PersistClient(stash, f"file://{tmp}/blob", compaction="off")
    while not (tmp / "go").exists():
        time.sleep(0.001)
    out = []
    for r in range(int(sys.argv[3])):
        own = f"{me}{r}"
        replanned = 0
        while True:
            newest = client.inspect("s").value_schema
            schema = newest.append(pa.field(own, pa.int64()))
            try:
                w, rd = client.open("s", K, schema)
                break
            except SchemaMismatch:
                # The other process registered a column after our read: our schema
                # lacks it, and a drop must be named, so plan again on the newest.
                replanned += 1
        assert w.schema_id == rd.schema_id
        while True:
            values = tuple(r if n == own else None for n in schema.names)
            u = w.fetch_recent_upper().as_option()
            try:
                w.compare_and_append([(((own,), values), u, 1)], u, u + 1)
                break
            except UpperMismatch:
                pass
        out.append(
            {"round": r, "schema_id": w.schema_id, "names": schema.names, "replanned": replanned}
        )
        rd.expire()
    print(json.dumps(out))
    client.close()
    stash.close()
    """
)


def test_two_processes_racing_to_evolve_the_schema(tmp_path: Path) -> None:
    key = pa.schema([pa.field("k", pa.string(), nullable=False)])
    v0 = pa.schema([pa.field("v", pa.int64())])
    stash = Stash.open(f"sqlite:///{tmp_path}/stash.db", fenced=False)
    client = PersistClient(stash, f"file://{tmp_path}/blob", compaction="off")
    try:
        client.open("s", key, v0)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", CHILD, str(tmp_path), me, str(ROUNDS)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for me in ("x", "y")
        ]
        (tmp_path / "go").touch()
        reports = {}
        for me, p in zip(("x", "y"), procs, strict=True):
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err
            reports[me] = json.loads(out.strip().splitlines()[-1])
        st = client.inspect("s")
        history = st.schema_history
        # Every open registered exactly one version, a compatible evolution of the one
        # before it that dropped nothing (whichever process won each race); a refused
        # open registered nothing.
        assert len(history) == 1 + 2 * ROUNDS
        for old, new in zip(history, history[1:], strict=False):
            check_schema_evolution("s", key, old, key, new)
            assert set(old.names) <= set(new.names), f"{old.names} -> {new.names} dropped"
        for rounds in reports.values():
            for r in rounds:
                assert history[r["schema_id"]].names == r["names"]
        # Every row is read back under the newest version with its own column's value.
        _, reader = client.open("s", key, st.value_schema)
        snap = reader.snapshot(st.upper.as_option() - 1)
        got = {row["k"]: row for row in snap.to_pylist()}
        assert set(got) == {f"{me}{r}" for me in ("x", "y") for r in range(ROUNDS)}
        for me, rounds in reports.items():
            for r in rounds:
                col = f"{me}{r['round']}"
                row = got[col]
                assert row[col] == r["round"], (col, row)
                assert all(row[n] is None for n in st.value_schema.names if n != col)
    finally:
        client.close()
        stash.close()


def test_racing_clients_in_one_process_both_register() -> None:
    """The compare-and-set path: a client whose cached state is stale re-reads and
    re-checks against the version the other registered meanwhile."""
    key = pa.schema([pa.field("k", pa.int64(), nullable=False)])
    v0 = pa.schema([pa.field("a", pa.int32())])
    stash = Stash.open("memory://", fenced=False)
    blob = MemoryBlob()
    c1 = PersistClient(stash, blob, compaction="off")
    c2 = PersistClient(stash, blob, compaction="off")
    try:
        c1.open("s", key, v0)
        c2.open("s", key, v0)  # c2 caches the state of version 0
        w1, _ = c1.open("s", key, pa.schema([pa.field("a", pa.int64())]))
        # Against c2's stale newest (a: int32), narrowing back is "equal to version
        # 0"; against the fresh one, adding b to a: int32 drops nothing but narrows a.
        w2, _ = c2.open(
            "s", key, pa.schema([pa.field("a", pa.int64()), pa.field("b", pa.string())])
        )
        assert (w1.schema_id, w2.schema_id) == (1, 2)
        hist = c1.inspect("s").schema_history
        assert [s.names for s in hist] == [["a"], ["a"], ["a", "b"]]
    finally:
        c1.close()
        c2.close()
        stash.close()
