"""``snapshot_many`` and ``Txn.write`` resolve a shard's schema (and its schema id) on
the shard's latest state, never on this process's cached one: after another process
(a real one, or a second client on the same SQLite stash file) adds, widens, drops, or
drops and re-adds a column, this client reads and writes the newest version."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from persist import PersistClient
from stash import Stash
from tests.support.procs import process_context

KS = pa.schema([pa.field("k", pa.string(), nullable=False)])


def _other(url: str, blob: str, value_schema: pa.Schema, drop: list[str], row: tuple) -> None:
    """Another process: open ``s`` with ``value_schema`` (dropping ``drop``) and append
    ``row`` (key, values) at the shard's upper."""
    s = Stash.open(url, fenced=False)
    c = PersistClient(s, blob, compaction="off")
    w, r = c.open("s", KS, value_schema, drop=drop)
    lo = w.fetch_recent_upper().as_option()
    w.compare_and_append([(((row[0],), row[1]), lo, 1)], lo, lo + 1)
    r.expire()
    w.expire()
    c.close()
    s.close()


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[str, str, PersistClient]]:
    url, blob = f"sqlite:///{tmp_path}/stash.db", f"file://{tmp_path}/blob"
    s = Stash.open(url, fenced=False)
    c = PersistClient(s, blob, compaction="off")
    yield url, blob, c
    c.close()
    s.close()


def _start(c: PersistClient, value_schema: pa.Schema, table: pa.Table) -> int:
    """This client opens ``s`` and commits a transaction (caching the shard's state and
    a transaction writer of ``value_schema``).  Returns the commit time."""
    c.open("s", KS, value_schema)
    with c.begin() as txn:
        txn.write("s", table)
        return txn.commit()


def _rows(c: PersistClient, as_of: int | None = None) -> dict[str, dict]:
    snap = c.snapshot_many({"s": as_of})["s"]
    drop = [n for n in ("_time", "_diff") if n in snap.column_names]
    return {r["k"]: r for r in snap.drop_columns(drop).to_pylist()}


def test_a_column_added_by_another_process(env) -> None:
    url, blob, c = env
    va = pa.schema([pa.field("a", pa.int64())])
    ts0 = _start(c, va, pa.table({"k": ["p"], "a": [1]}))
    vx = va.append(pa.field("x", pa.string()))
    p = process_context().Process(target=_other, args=(url, blob, vx, [], ("q", (2, "x2"))))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    # At an explicit time (the other process appended at ts0 + 1): nothing here has
    # re-read the shard since.
    assert _rows(c, ts0 + 1) == {
        "p": {"k": "p", "a": 1, "x": None},
        "q": {"k": "q", "a": 2, "x": "x2"},
    }
    with c.begin() as txn:
        txn.write("s", pa.table({"k": ["r"], "a": [3], "x": ["x3"]}))
        ts = txn.commit()
    assert _rows(c, ts)["r"] == {"k": "r", "a": 3, "x": "x3"}


def test_a_column_widened_by_another_client_reads_at_an_explicit_time(env) -> None:
    url, blob, c = env
    v32 = pa.schema([pa.field("a", pa.int32())])
    ts0 = _start(c, v32, pa.table({"k": ["p"], "a": pa.array([1], pa.int32())}))
    _other(url, blob, pa.schema([pa.field("a", pa.int64())]), [], ("q", (2**40,)))
    snap = c.snapshot_many({"s": ts0 + 1})["s"]  # the other client appended at ts0 + 1
    assert snap.schema.field("a").type == pa.int64()
    assert sorted(snap.column("a").to_pylist()) == [1, 2**40]


def test_a_column_dropped_by_another_client(env) -> None:
    url, blob, c = env
    vab = pa.schema([pa.field("a", pa.int64()), pa.field("b", pa.string())])
    _start(c, vab, pa.table({"k": ["p"], "a": [1], "b": ["b1"]}))
    _other(url, blob, pa.schema([pa.field("a", pa.int64())]), ["b"], ("q", (2,)))
    with c.begin() as txn:
        txn.write("s", pa.table({"k": ["r"], "a": [3]}))
        ts = txn.commit()
    assert _rows(c, ts) == {k: {"k": k, "a": a} for k, a in (("p", 1), ("q", 2), ("r", 3))}


def test_a_column_dropped_and_re_added_by_another_client(env) -> None:
    url, blob, c = env
    vx = pa.schema([pa.field("a", pa.int64()), pa.field("x", pa.string())])
    _start(c, vx, pa.table({"k": ["p"], "a": [1], "x": ["old"]}))
    _other(url, blob, pa.schema([pa.field("a", pa.int64())]), ["x"], ("q", (2,)))
    _other(url, blob, vx, [], ("r", (3, "new")))  # x again: another column
    got = _rows(c)
    assert got["r"]["x"] == "new" and got["p"]["x"] is None  # the old x is gone
    for i in range(3):  # every later transaction commits, and its x reads back
        with c.begin() as txn:
            txn.write("s", pa.table({"k": [f"t{i}"], "a": [10 + i], "x": [f"t{i}"]}))
            ts = txn.commit()
        assert _rows(c, ts)[f"t{i}"]["x"] == f"t{i}"
