"""Prometheus metrics (``persist/metrics.py``, ``stash/metrics.py``): the ``persist``
command serves ``/metrics`` with ``--metrics-port``; a scrape after appends, an upper race,
compaction, GC, a lease that ran out and stash transactions shows every family those modules
define, with values that moved; log lines carry structured fields (shard, seqno, writer
id)."""

from __future__ import annotations

import logging
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from click.testing import CliRunner
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from persist import PersistClient, UpperMismatch, collect_garbage
from persist.cli import main as persist_main
from stash import Antichain, AppendBatch, Stash
from stash.cli import main as stash_main
from stash.errors import AppendLowerMismatch

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])

FAMILIES = {
    # stash transactions, by backend
    "stash_txn_duration_seconds",
    "stash_txn_retries",
    "stash_txn_conflicts",
    "stash_fence_errors",
    # persist
    "persist_compare_and_append_duration_seconds",
    "persist_upper_mismatches",
    "persist_blob_written_bytes",
    "persist_blob_written_parts",
    "persist_blob_fetched_bytes",
    "persist_blob_fetched_parts",
    "persist_inline_bytes",
    "persist_compaction_merges",
    "persist_compaction_written_bytes",
    "persist_gc_deleted_parts",
    "persist_lease_expiries",
    "persist_shard_batches",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def upd(k: int, v: str, t: int, d: int = 1) -> Any:
    return ((k,), (v,)), t, d


def test_metrics_endpoint_serves_every_family(tmp_path: Path) -> None:
    now = [1_700_000_000.0]
    url = f"sqlite:///{tmp_path}/s.db"
    before = {
        "appends": _value("persist_compare_and_append_duration_seconds_count"),
        "mismatch": _value("persist_upper_mismatches_total"),
        "written": _value("persist_blob_written_bytes_total"),
        "fetched": _value("persist_blob_fetched_parts_total"),
        "merges": _value("persist_compaction_merges_total", result="applied"),
        "gc": _value("persist_gc_deleted_parts_total"),
        "expired": _value("persist_lease_expiries_total", kind="writer"),
        "txn": _value("stash_txn_duration_seconds_count", backend="sqlite", kind="write"),
    }
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(
            s,
            f"file://{tmp_path}/blob",
            compaction="off",
            inline_max_bytes=0,
            writer_lease_seconds=60,
            clock=lambda: now[0],
        )
        w, r = c.open("m", KS, VS)
        for t in range(6):
            w.compare_and_append([upd(t, "v", t)], t, t + 1)
        with pytest.raises(UpperMismatch):
            w.compare_and_append([upd(9, "v", 3)], 3, 4)
        r.downgrade_since(5)
        c.compactor.compact_once("m")
        assert r.snapshot(5).num_rows == 6
        w2 = c.open_writer("m", KS, VS)  # another writer, whose lease will run out
        w2.fetch_recent_upper()
        now[0] += 3600
        r.downgrade_since(5)  # a commit at the new time drops the expired writers
        collect_garbage(c, "m", grace_seconds=0)
        c.close()

    port = _free_port()
    res = CliRunner().invoke(
        persist_main,
        [
            "--stash",
            url,
            "--blob",
            f"file://{tmp_path}/blob",
            "--metrics-port",
            str(port),
            "shards",
        ],
    )
    assert res.exit_code == 0, res.output
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert FAMILIES <= set(families), sorted(FAMILIES - set(families))
    assert families["persist_blob_written_bytes"].type == "counter"
    assert families["persist_shard_batches"].type == "gauge"
    txn_latency = "stash_txn_duration_seconds"  # a metric's name, not a timing
    assert families[txn_latency].type == "histogram"
    batches = [s for s in families["persist_shard_batches"].samples if s.labels["shard"] == "m"]
    assert batches and batches[0].value >= 1

    appends_observed = _value("persist_compare_and_append_duration_seconds_count")
    assert appends_observed >= before["appends"] + 7
    assert _value("persist_upper_mismatches_total") == before["mismatch"] + 1
    assert _value("persist_blob_written_bytes_total") > before["written"]
    assert _value("persist_blob_fetched_parts_total") > before["fetched"]
    assert _value("persist_compaction_merges_total", result="applied") > before["merges"]
    assert _value("persist_gc_deleted_parts_total") > before["gc"]
    assert _value("persist_lease_expiries_total", kind="writer") >= before["expired"] + 1
    assert (
        _value("stash_txn_duration_seconds_count", backend="sqlite", kind="write") > before["txn"]
    )


def test_stash_conflicts_are_counted_and_stash_cli_takes_metrics_port(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    before = _value("stash_txn_conflicts_total", backend="sqlite")
    with Stash.open(url, fenced=False) as s:
        coll = s.collection("c")
        first = AppendBatch(
            coll, lower=Antichain([0]), upper=Antichain([1]), compact=Antichain([0])
        )
        coll.append_to_batch(first, "k", "v", 1)
        s.append([first])
        late = AppendBatch(coll, lower=Antichain([0]), upper=Antichain([2]), compact=Antichain([0]))
        with pytest.raises(AppendLowerMismatch):  # the upper moved to 1 meanwhile
            s.append([late])
    assert _value("stash_txn_conflicts_total", backend="sqlite") == before + 1
    port = _free_port()
    res = CliRunner().invoke(stash_main, ["--metrics-port", str(port), "collections", url])
    assert res.exit_code == 0, res.output
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        assert "stash_txn_conflicts_total" in resp.read().decode()


def test_log_lines_carry_shard_seqno_and_writer_fields(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="persist")
    with Stash.open(f"sqlite:///{tmp_path}/s.db", fenced=False) as s:
        c = PersistClient(s, "memory://", compaction="off", inline_max_bytes=0)
        w = c.open_writer("logs", KS, VS)
        w.compare_and_append([upd(1, "v", 0)], 0, 1)
        b = w.batch([upd(2, "v", 1)], 1, 2)
        b.into_transmittable()  # handed out: expire leaves the lease to run out, and logs
        w.expire()
        c.close()
    recs = [r for r in caplog.records if getattr(r, "writer_id", None)]
    assert recs, [r.getMessage() for r in caplog.records]
    assert recs[0].writer_id == w.writer_id and recs[0].shard == w.shard_id
