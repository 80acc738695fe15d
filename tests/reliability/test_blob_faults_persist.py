"""Blob-fault campaign: persist over an :class:`UnreliableBlob` (after Materialize's
``UnreliableBlob`` in ``src/persist/src/unreliable.rs``: calls that fail, slow calls, puts
and deletes that fail *after* doing their work) during writes, compaction, reads and GC.

Invariants checked:

* nothing acknowledged is lost and nothing is duplicated: after the faults stop, a
  snapshot holds exactly the acknowledged batches, each row once;
* a failed ``compare_and_append`` commits nothing (the upper did not move, the error is a
  :class:`BlobError` naming the blob key, never indeterminate: consensus is reliable here);
* GC never deletes a referenced part: after every GC pass (and at the end) every blob key
  the latest state references is still in the store;
* later calls recover: after :meth:`UnreliableBlob.make_unavailable` /
  :meth:`~UnreliableBlob.make_available`, the next append succeeds with no restart;
* once faults stop, compaction and GC (grace 0) leave exactly the referenced parts.

Two settings: a sequential one (appends, inline compaction, GC with grace 0, snapshots
interleaved in one thread, no blob retries so every fault reaches the caller) and a
concurrent one (writer and reader threads, the background compactor and its periodic GC
with a short grace, over a FileBlob).
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist import (
    Blob,
    BlobError,
    CorruptPart,
    FileBlob,
    MemoryBlob,
    PersistClient,
    PersistError,
    ReadHandle,
    UnreliableBlob,
    WriteHandle,
    collect_garbage,
    fsck,
)
from stash import Stash
from tests.reliability.campaign import LONG, record, runs

KS = pa.schema([("i", pa.int64()), ("j", pa.int64())])
VS = pa.schema([("v", pa.string())])


def rows_of(i: int, t: int) -> list[Any]:
    """Batch ``i``: 1..40 rows (larger ones leave the state for blob parts)."""
    n = 1 + (i * 7919) % 40
    return [(((i, j), (f"{i}-{j}-" + "y" * 30,)), t, 1) for j in range(n)]


def _referenced_present(client: PersistClient, inner: Blob, shard: str) -> list[str]:
    """Referenced keys of the latest state that are missing from the real store."""
    st = client.inspect(shard)
    return sorted(k for k in st.referenced_blob_keys() if inner.get(k) is None)


def _check_contents(client: PersistClient, shard: str, acked: set[int]) -> None:
    """Faults off: the shard holds exactly the acknowledged batches, each row once."""
    r = client.open_reader(shard, KS, VS)
    upper = r.fetch_recent_upper().as_option()
    assert upper is not None
    snap = r.snapshot(upper - 1) if upper > 0 else None
    got: dict[int, int] = {}
    if snap is not None:
        assert set(snap.column("_diff").to_pylist()) <= {1}, "duplicated rows"
        for i in snap.column("i").to_pylist():
            got[i] = got.get(i, 0) + 1
    lost = sorted(acked - set(got))
    assert not lost, f"acknowledged batches lost: {lost[:5]}"
    extra = sorted(set(got) - acked)
    assert not extra, f"unacknowledged batches visible: {extra[:5]}"
    partial = {i: n for i, n in got.items() if n != len(rows_of(i, 0))}
    assert not partial, f"half-present batches: {partial}"
    r.expire()


def _final_cleanup_check(
    client: PersistClient, inner: Blob, shard: str, w: WriteHandle, r: ReadHandle
) -> None:
    """Faults off: compaction answers every request; once the writers (the writer, the
    compactor) are expired and the reader holds no old version, GC (grace 0) leaves
    exactly the referenced parts, the Spine validates and fsck finds no damage."""
    client.compactor.compact_once(shard)
    # A live writer's parts are never collected: expire the writers first.
    w.expire()
    client.compactor.expire_writers()
    r.heartbeat()  # no read in progress: its seqno hold moves to the latest version
    collect_garbage(client, shard, grace_seconds=0)
    st = client.inspect(shard)
    st.trace.validate()
    listed = {k for k, _ in inner.list_keys(st.shard_id + "/")}
    assert listed == st.referenced_blob_keys(), (
        f"unreferenced left: {sorted(listed - st.referenced_blob_keys())[:3]}, "
        f"referenced missing: {sorted(st.referenced_blob_keys() - listed)[:3]}"
    )
    report = fsck(client, shard)
    assert report.ok, report.damage()


@pytest.mark.campaign
def test_blob_faults_sequential() -> None:
    """Appends, inline compaction, GC and snapshots in one thread; every fault surfaces."""
    inner = MemoryBlob()
    blob = UnreliableBlob(inner, fail_probability=0.12, seed=3, slow_seconds=0.001)
    stash = Stash.open("memory://", fenced=False)
    client = PersistClient(
        stash,
        blob,
        compaction="inline",
        blob_retries=1,
        inline_max_bytes=256,
        gc_interval_seconds=None,
    )
    errors = gc_passes = reads = unclear = 0
    for _ in range(20):  # opening checks the store's identity marker: a fault surfaces too
        try:
            w, r = client.open("faulty", KS, VS)
            break
        except BlobError as e:
            assert not e.is_indeterminate()
            errors += 1
    else:
        raise AssertionError("20 opens in a row failed at a 12% fault rate")
    rng = random.Random(5)
    n_batches = runs(150, 2000)
    acked: set[int] = set()
    referenced_deleted = 0
    upper = 0
    i = 0
    while i < n_batches:
        try:
            w.compare_and_append(rows_of(i, upper), upper, upper + 1)
        except BlobError as e:
            errors += 1
            assert not e.is_indeterminate()
            if "'" not in str(e):  # names the blob key
                unclear += 1
            blob.faults(False)
            now = w.fetch_recent_upper().as_option()
            blob.faults(True)
            assert now == upper, "a failed append moved the upper"
            continue
        acked.add(i)
        upper += 1
        i += 1
        if i % 10 == 0:
            try:
                collect_garbage(client, "faulty", grace_seconds=0)
                gc_passes += 1
            except BlobError:
                errors += 1
            blob.faults(False)
            missing = _referenced_present(client, inner, "faulty")
            blob.faults(True)
            referenced_deleted += len(missing)
            assert not missing, f"GC deleted referenced parts {missing[:3]}"
        if i % 15 == 0:
            for _ in range(20):  # a snapshot under faults: fails cleanly or is right
                try:
                    snap = r.snapshot(upper - 1)
                except CorruptPart as e:  # a transient fault must not look like corruption
                    raise AssertionError(f"transient blob fault reported as corruption: {e}") from e
                except BlobError:
                    errors += 1
                    continue
                reads += 1
                assert snap.num_rows == sum(len(rows_of(k, 0)) for k in acked)
                break
        if i % 50 == 0:
            # Blob down for a while: appends fail cleanly, then recover without a restart.
            blob.make_unavailable()
            big = [(((10**9 + i, j), ("z" * 200,)), upper, 1) for j in range(20)]
            for _ in range(3):
                try:
                    w.compare_and_append(big, upper, upper + 1)
                    raise AssertionError("an append succeeded with the blob unavailable")
                except BlobError:
                    errors += 1
            blob.make_available()
        if rng.random() < 0.05:
            r.downgrade_since(max(0, upper - 3))
    blob.faults(False)
    assert w.fetch_recent_upper().as_option() == upper
    parts_before = len(client.inspect("faulty").referenced_blob_keys())
    _check_contents(client, "faulty", acked)
    _final_cleanup_check(client, inner, "faulty", w, r)
    _check_contents(client, "faulty", acked)
    injected = blob.faults_injected
    client.close()
    stash.close()
    assert errors > 0 and injected >= errors
    record(
        "blob faults: persist sequential (memory blob)",
        runs=n_batches,
        faults=injected,
        acknowledged=len(acked),
        lost=0,
        duplicated=0,
        partial=0,
        unclear=unclear,
        errors_surfaced=errors,
        gc_passes=gc_passes,
        snapshots=reads,
        referenced_deleted=referenced_deleted,
        parts_under_faults=parts_before,
    )
    assert unclear == 0


@pytest.mark.campaign
def test_blob_faults_concurrent(tmp_path: Path) -> None:
    """A writer thread and a reader thread, with the background compactor and its GC
    (grace 0.5 s), over a FileBlob with faults and slow calls; then faults off."""
    inner = FileBlob(tmp_path / "blob")
    blob = UnreliableBlob(inner, fail_probability=0.1, seed=9, slow_seconds=0.005)
    stash = Stash.open(f"sqlite:///{tmp_path}/s.db", fenced=False)
    client = PersistClient(
        stash,
        blob,
        compaction="background",
        blob_retries=2,
        inline_max_bytes=256,
        gc_grace_seconds=0.5,
        gc_interval_seconds=0.2,
    )
    w, r = client.open("faulty", KS, VS)
    duration = 60.0 if LONG else 4.0
    stop = threading.Event()
    acked: set[int] = set()
    figures = {"write_errors": 0, "read_errors": 0, "reads": 0, "corrupt": 0, "other": 0}
    problems: list[str] = []

    def writer() -> None:
        upper, i = 0, 0
        while not stop.is_set():
            try:
                w.compare_and_append(rows_of(i, upper), upper, upper + 1)
            except BlobError:
                figures["write_errors"] += 1
                continue
            except Exception as e:  # noqa: BLE001 - the campaign reports anything else
                problems.append(f"writer: {type(e).__name__}: {e}")
                return
            acked.add(i)
            upper += 1
            i += 1
            if i % 20 == 0:
                r.downgrade_since(upper - 5)

    def reader() -> None:
        rr = client.open_reader("faulty", KS, VS)
        while not stop.is_set():
            try:
                up = rr.fetch_recent_upper().as_option()
                assert up is not None
                if up > 0:
                    rr.snapshot(up - 1)
                    figures["reads"] += 1
                    rr.downgrade_since(max(0, up - 2))
            except CorruptPart as e:
                figures["corrupt"] += 1
                problems.append(f"reader: {e}")
            except BlobError:
                figures["read_errors"] += 1
            except PersistError as e:
                figures["other"] += 1
                problems.append(f"reader: {type(e).__name__}: {e}")
            time.sleep(0.01)
        rr.expire()

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    time.sleep(duration)
    stop.set()
    for t in threads:
        t.join(60)
    assert not problems, problems[:5]
    blob.faults(False)
    assert client.compactor.wait_idle(timeout=60)
    assert not _referenced_present(client, inner, "faulty")
    _check_contents(client, "faulty", acked)
    _final_cleanup_check(client, inner, "faulty", w, r)
    _check_contents(client, "faulty", acked)
    injected = blob.faults_injected
    client.close()
    stash.close()
    assert acked and injected > 0
    record(
        "blob faults: persist concurrent (file blob, background compaction + GC)",
        runs=1,
        faults=injected,
        acknowledged=len(acked),
        lost=0,
        duplicated=0,
        partial=0,
        unclear=0,
        seconds=duration,
        write_errors=figures["write_errors"],
        read_errors=figures["read_errors"],
        snapshots=figures["reads"],
    )
