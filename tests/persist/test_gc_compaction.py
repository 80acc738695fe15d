"""Compaction, GC, corrupted parts and the ``persist`` command line."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from click.testing import CliRunner

from persist import (
    CorruptPart,
    FileBlob,
    MemoryBlob,
    PersistClient,
    collect_garbage,
)
from persist.cli import main
from persist.gc import key_created_ms
from stash import Stash

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])


def upd(k: int, v: str, t: int, d: int = 1) -> Any:
    return ((k,), (v,)), t, d


@pytest.fixture
def stash() -> Iterator[Stash]:
    s = Stash.open("memory://", fenced=False)
    yield s
    s.close()


def blob_keys(client: PersistClient, shard: str) -> set[str]:
    return {k for k, _ in client.raw_blob.list_keys(client.shard_id(shard) + "/")}


@pytest.mark.parametrize(
    "n",
    [2_000, pytest.param(10_000, marks=[pytest.mark.slow, pytest.mark.campaign], id="10000")],
    ids=str,
)
def test_one_row_appends_with_moving_since_stay_logarithmic(stash: Stash, n: int) -> None:
    """n one-row appends (every tenth a retraction) with a moving since and the
    background compactor: at most 2*log2(n) batches, and GC leaves no unreferenced part.
    The goal is 10,000 (about 30 s here, marked slow); 2,000 runs always."""
    blob = MemoryBlob()
    # Small batches inline, merged outputs beyond 512 bytes (compressed: a few dozen rows)
    # in blob: GC has parts to collect.
    c = PersistClient(stash, blob, compaction="background", inline_max_bytes=512)
    w, r = c.open("ten", KS, VS)
    live = set()
    for i in range(n):
        if i % 10 == 9:  # every tenth append retracts an earlier row
            w.compare_and_append([upd(i - 5, "x", i, -1)], i, i + 1)
            live.discard(i - 5)
        else:
            w.compare_and_append([upd(i, "x", i)], i, i + 1)
            live.add(i)
        if i % 100 == 99:
            r.downgrade_since(i - 20)
    assert c.compactor.wait_idle(timeout=120)
    c.compactor.compact_once("ten")
    st = c.inspect("ten")
    st.trace.validate()
    assert st.trace.num_hollow_batches() <= 2 * math.log2(n)
    assert st.trace.num_updates() < n  # retractions were consolidated away
    snap = r.snapshot(n - 1)
    assert set(snap.column("k").to_pylist()) == live and set(snap.column("_diff").to_pylist()) == {
        1
    }
    # Live writers' parts (the writer's, the compactor's unapplied outputs) and parts of
    # versions a reader still holds are kept: release them first.
    c.compactor.stop()
    w.expire()
    c.compactor.expire_writers()
    r.heartbeat()  # no read in progress: its seqno hold moves to the latest version
    report = collect_garbage(c, "ten", grace_seconds=0)
    assert report.deleted_retired  # compaction retired parts, GC deleted them
    assert blob_keys(c, "ten") == c.inspect("ten").referenced_blob_keys()
    assert r.snapshot(n - 1).num_rows == len(live)
    c.close()


def test_gc_waits_for_the_grace_period(stash: Stash) -> None:
    now = [1_000.0]
    c = PersistClient(
        stash,
        MemoryBlob(),
        compaction="off",
        inline_max_bytes=0,
        writer_lease_seconds=30,
        clock=lambda: now[0],
    )
    w, r = c.open("g", KS, VS)
    for t in range(8):
        w.compare_and_append([upd(t, "a", t)], t, t + 1)
    r.downgrade_since(7)
    report = c.compactor.compact_once("g")
    assert report.applied >= 1
    st = c.inspect("g")
    retired = c.consensus.retired(st.shard_id)
    assert retired and not set(retired) & st.referenced_blob_keys()
    assert set(retired.values()) == {1_000_000}  # retired "now", by the injected clock
    abandoned = w.batch([upd(99, "z", 8)], 8, 9)  # written, never appended
    (abandoned_key,) = abandoned.blob_keys()
    assert key_created_ms(abandoned_key) == 1_000_000

    g1 = collect_garbage(c, "g", grace_seconds=60)
    # The batch's writer is live: kept whatever its age (not merely for the grace).
    assert not g1.deleted_retired and not g1.deleted_abandoned and g1.kept_live_writer == 1
    now[0] += 61  # the writer's 30 s lease ran out
    r.downgrade_since(7)  # keep the reader's lease alive (and move its seqno hold)
    g2 = collect_garbage(c, "g", grace_seconds=60)
    assert set(g2.deleted_retired) == set(retired)
    assert g2.deleted_abandoned == [abandoned_key]
    st2 = c.inspect("g")
    assert c.consensus.retired(st2.shard_id) == {}
    assert blob_keys(c, "g") == st2.referenced_blob_keys()
    assert r.snapshot(7).num_rows == 8
    c.close()


def test_corrupted_part_names_its_key_and_other_shards_work(stash: Stash, tmp_path: Path) -> None:
    root = tmp_path / "blob"
    c = PersistClient(stash, FileBlob(root), compaction="off", inline_max_bytes=0)
    wa, ra = c.open("a", KS, VS)
    wb, rb = c.open("b", KS, VS)
    for t in range(4):
        wa.compare_and_append([upd(t, "a", t)], t, t + 1)
        wb.compare_and_append([upd(t, "b", t)], t, t + 1)
    key = sorted(c.inspect("a").referenced_blob_keys())[0]
    path = root / key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptPart) as e:
        ra.snapshot(3)
    assert e.value.key == key and key in str(e.value)
    # Compaction of the broken shard fails cleanly (logged, nothing applied)...
    report = c.compactor.compact_once("a")
    assert report.failed >= 1 and report.applied == 0
    # ...and the other shard keeps working.
    wb.compare_and_append([upd(9, "b", 4)], 4, 5)
    assert rb.snapshot(4).num_rows == 5
    assert c.compactor.compact_once("b").failed == 0
    # A missing part is reported the same way.
    path.unlink()
    with pytest.raises(CorruptPart, match="missing"):
        ra.snapshot(3)
    c.close()


def test_compaction_output_is_consolidated(stash: Stash) -> None:
    c = PersistClient(stash, MemoryBlob(), compaction="inline")
    w, r = c.open("cons", KS, VS)
    for t in range(32):
        w.compare_and_append(
            [upd(t % 3, "v", t), upd(t % 3, "v", t, -1)] if t % 2 else [upd(t % 3, "v", t)],
            t,
            t + 1,
        )
        r.downgrade_since(t)
    st = c.inspect("cons")
    st.trace.validate()
    assert st.trace.num_updates() <= 12
    assert (
        c.compactor.totals.applied > 0 and c.compactor.totals.rows_out < c.compactor.totals.rows_in
    )
    assert sorted(r.snapshot(31).to_pylist(), key=lambda x: x["k"]) == [
        {"k": k, "v": "v", "_time": 31, "_diff": n} for k, n in ((0, 6), (1, 5), (2, 5))
    ]
    c.close()


def test_cli(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/stash.db"
    blob = f"file://{tmp_path}/blob"
    runner = CliRunner()
    base = ["--stash", url, "--blob", blob]
    with Stash.open(url, fenced=False) as s:
        res = runner.invoke(main, [*base, "shards", "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.output) == []
        c = PersistClient(s, blob, compaction="off", inline_max_bytes=0)
        w, r = c.open("orders", KS, VS)
        for t in range(6):
            w.compare_and_append([upd(t, "a", t)], t, t + 1)
        r.downgrade_since(4)
        shard_id = w.shard_id
        c.close()
    res = runner.invoke(main, [*base, "shards", "--json"])
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.output)
    assert row["name"] == "orders" and row["shard_id"] == shard_id and row["upper"] == [6]
    res = runner.invoke(main, [*base, "inspect", "orders", "--json", "--state"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    s = doc["summary"]
    assert (s["since"], s["upper"], s["updates"], s["batches"]) == ([4], [6], 6, 6)
    assert s["parts"] == 6 and s["bytes"] > 0 and s["merges_outstanding"] >= 1
    assert doc["state"]["seqno"] == s["seqno"] and len(doc["batches"]) == 6
    res = runner.invoke(main, [*base, "inspect", f"id:{shard_id}"])  # by id, as a table
    assert res.exit_code == 0 and "since" in res.output and "upper" in res.output
    res = runner.invoke(main, [*base, "inspect", shard_id])  # a plain string is a name
    assert res.exit_code == 1 and f"no shard named {shard_id!r}" in res.output
    res = runner.invoke(main, [*base, "compact", "orders", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["applied"] >= 1 and out["batches_after"] < 6
    res = runner.invoke(main, [*base, "gc", "orders", "--grace", "0", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["deleted_retired"] >= 1
    res = runner.invoke(main, [*base, "shards"])
    assert res.exit_code == 0 and "orders" in res.output
    res = runner.invoke(main, [*base, "inspect", "nope"])
    assert res.exit_code == 1 and "no shard named 'nope'" in res.output
