"""Crash campaign for persist: a child ``compare_and_append``s to a shard (stash
consensus on SQLite or Postgres, a FileBlob or an S3 prefix on moto) in a loop and is SIGKILLed at random moments.
After each kill:

* every acknowledged batch is in the shard exactly once (each of its rows with diff 1)
  and whole (all of its rows, none missing: no batch is half there);
* at most one unacknowledged batch (the one in flight at the kill) is durable;
* the shard reopens, its Spine trace validates (``Trace.validate``);
* GC (grace 0), once the killed child's leases ran out, leaves no unreferenced part in
  the blob store, and ``persist.fsck`` finds no damage.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from persist import collect_garbage
from stash import Stash
from tests.reliability.campaign import runs
from tests.reliability.crash_child_persist import (
    KEY_SCHEMA,
    SHARD,
    VALUE_SCHEMA,
    batch_rows,
    make_client,
    payload,
)
from tests.reliability.crash_harness import (
    CAMPAIGN_LIMIT,
    batch_counts,
    checker_clock,
    gc_then_check,
    kill_runs,
    record_kills,
)
from tests.support.dbutil import migrate_to_head

CHILD = Path(__file__).with_name("crash_child_persist.py")


def _check_after_kill(
    url: str, blob: str, run: int, acked: list[tuple[int, int]]
) -> dict[str, int]:
    """Reopen the shard and check the campaign's invariants; returns figures."""
    with Stash.open(url, fenced=False) as s:
        # The killed child's writer and compactor leases (2 s) have run out for this
        # clock: GC may take their leftovers (a live writer's parts are never taken).
        client = make_client(s, blob, clock=checker_clock)
        try:
            r = client.open_reader(SHARD, KEY_SCHEMA, VALUE_SCHEMA)
            st = client.inspect(SHARD)
            st.trace.validate()
            upper = st.upper.as_option()
            assert upper is not None
            rows: Counter[tuple[int, int]] = Counter()
            if upper > 0:
                rows = batch_counts(r.snapshot(upper - 1), payload)
            # Whole batches only, every one of them once.
            partial = {b: n for b, n in rows.items() if n != batch_rows(*b)}
            assert not partial, f"run {run}: half-present batches {partial}"
            lost = [b for b in acked if b not in rows]
            assert not lost, f"run {run}: acknowledged batches lost: {lost[:5]}"
            mine = {b for b in rows if b[0] == run}
            extra = mine - set(acked)
            # At most the batch in flight at the kill may be durable without its ack.
            assert len(extra) <= 1, f"run {run}: unacknowledged batches {extra}"
            assert len(rows) == upper, "each append advanced the upper by one"
            r.expire()
            gc_deleted, parts = gc_then_check(client, SHARD, run)
            return {"unacked": len(extra), "gc_deleted": gc_deleted, "parts": parts}
        finally:
            client.close()


def _stray_temp_files(root: Path) -> int:
    return sum(1 for p in root.rglob(".*") if p.is_file())


def _campaign(
    url: str, tmp_path: Path, kills: int, label: str, blob_uri: str | None = None
) -> None:
    """``kills`` SIGKILLed children appending to one shard on ``url``; the blob is a
    local directory, or ``blob_uri`` (an S3 prefix) when given."""
    blob_root = tmp_path / "blob"
    blob = f"file://{blob_root}" if blob_uri is None else blob_uri
    with Stash.open(url, fenced=False) as s:  # create the shard before the first kill
        c = make_client(s, blob)
        c.open_writer(SHARD, KEY_SCHEMA, VALUE_SCHEMA)
        c.close()
    acked_total = unacked_seen = gc_deleted = 0
    for run, acks in kill_runs(
        CHILD, [url, blob], tmp_path, kills, seed=11, window=(0.05, 1.0), label=label
    ):
        acked = [(int(a), int(b)) for a, b in acks]
        acked_total += len(acked)
        fig = _check_after_kill(url, blob, run, acked)
        stray = _stray_temp_files(blob_root)
        assert stray == 0, f"{label} run {run}: GC left {stray} temporary files of killed uploads"
        unacked_seen += fig["unacked"]
        gc_deleted += fig["gc_deleted"]
    record_kills(
        f"crash: persist on {label}",
        kills,
        acked_total,
        unacked_seen,
        gc_deleted_parts=gc_deleted,
        stray_temp_files_after_gc=_stray_temp_files(blob_root),
    )
    assert acked_total > 0


@pytest.mark.campaign
@pytest.mark.timeout(CAMPAIGN_LIMIT)
def test_crash_persist_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/crash.db"
    _campaign(url, tmp_path, runs(8, 200), "sqlite + file blob")


@pytest.mark.campaign
@pytest.mark.timeout(CAMPAIGN_LIMIT)
def test_crash_persist_sqlite_s3(tmp_path: Path, s3_blob_uri: str) -> None:
    """The same campaign with the parts on S3 (moto): a kill mid-upload leaves at most
    an unfinished multipart upload, never a visible half part; GC leaves no orphan."""
    url = f"sqlite:///{tmp_path}/crash.db"
    _campaign(url, tmp_path, runs(3, 50), "sqlite + s3 blob", blob_uri=s3_blob_uri)


@pytest.mark.campaign
@pytest.mark.postgres
@pytest.mark.timeout(CAMPAIGN_LIMIT)
def test_crash_persist_postgres(tmp_path: Path, postgres_url: str) -> None:
    migrate_to_head(postgres_url)
    _campaign(postgres_url, tmp_path, runs(4, 200), "postgres + file blob")


def test_regression_gc_sweeps_temporaries_of_killed_uploads(tmp_path: Path) -> None:
    """Found by the long campaign: a child SIGKILLed inside ``FileBlob.set`` leaves its
    ``.tmp-*`` file, which is never a key, so GC never saw it (21 left after 200 kills).
    GC now deletes such files older than the grace period, and keeps younger ones."""
    with Stash.open(f"sqlite:///{tmp_path}/s.db", fenced=False) as s:
        client = make_client(s, f"file://{tmp_path}/blob")
        w = client.open_writer(SHARD, KEY_SCHEMA, VALUE_SCHEMA)
        w.compare_and_append([(((0, 0, j), (payload(0, 0, j),)), 0, 1) for j in range(30)], 0, 1)
        shard_dir = tmp_path / "blob" / w.shard_id
        parts = [p for p in shard_dir.rglob("*") if p.is_file()]
        assert parts
        leftover = parts[0].parent / ".tmp-0123456789abcdef"
        leftover.write_bytes(b"half an upload")
        report = collect_garbage(client, SHARD, grace_seconds=3600)
        assert report.deleted_temporaries == 0
        assert leftover.exists()
        report = collect_garbage(client, SHARD, grace_seconds=0)
        assert report.deleted_temporaries == 1
        assert not leftover.exists()
        assert all(p.exists() for p in parts)  # referenced parts untouched
        client.close()
