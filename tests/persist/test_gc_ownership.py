"""GC against live writers, held reads and compactors; idempotent forgetting of retired
keys; shard names versus ids; fsck; dropping a shard; GC deletes only persist's
keys."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from click.testing import CliRunner

from persist import (
    Blob,
    CorruptPart,
    FileBlob,
    InvalidUsage,
    LeaseExpired,
    MemoryBlob,
    PartsMissing,
    PersistClient,
    PersistError,
    collect_garbage,
    fsck,
    open_blob,
    read_batches,
)
from persist.cli import main
from persist.consensus import RETIRED_COLLECTION_PREFIX
from persist.keys import key_created_ms, key_writer_id, parse_part_key
from persist.lease import LeaseKeeper
from stash import Antichain, Stash
from tests.support.clock import Clock

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])
HOUR = 3600.0


def upd(k: int, v: str, t: int, d: int = 1) -> Any:
    return ((k,), (v,)), t, d


def rows(t: pa.Table) -> list[tuple[int, str, int]]:
    return sorted(zip(t["k"].to_pylist(), t["v"].to_pylist(), t["_diff"].to_pylist(), strict=True))


@pytest.fixture
def stash() -> Iterator[Stash]:
    s = Stash.open("memory://", fenced=False)
    yield s
    s.close()


@pytest.fixture(params=["memory", "file", "s3"])
def any_blob(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Blob]:
    """The GC suite runs on every kind of store: memory, local files and S3 (moto)."""
    if request.param == "s3":
        b: Blob = open_blob(request.getfixturevalue("s3_blob_uri"))
    elif request.param == "file":
        b = FileBlob(tmp_path / "any-blob")
    else:
        b = MemoryBlob()
    yield b
    b.close()


def client(stash: Stash, blob: Any, clock: Clock, **kw: Any) -> PersistClient:
    kw.setdefault("compaction", "off")
    kw.setdefault("inline_max_bytes", 0)
    kw.setdefault("writer_lease_seconds", 3 * HOUR)
    kw.setdefault("reader_lease_seconds", 3 * HOUR)
    return PersistClient(stash, blob, clock=clock, **kw)


def shard_keys(c: PersistClient, shard: str) -> set[str]:
    return {k for k, _ in c.raw_blob.list_keys(c.shard_id(shard) + "/")}


# ------------------------------------------------------------------ item 1: writers


def test_a_live_writers_batch_survives_gc_past_the_grace_period(
    stash: Stash, any_blob: Blob
) -> None:
    clock, blob = Clock(), any_blob
    c = client(stash, blob, clock)
    gc_client = client(stash, blob, clock)
    w, r = c.open("held", KS, VS)
    b = w.builder(0)
    b.add([upd(1, "a", 0)])
    batch = b.finish(1)
    (key,) = batch.blob_keys()
    assert key_writer_id(key) == w.writer_id
    for _ in range(3):  # held across three grace periods, heartbeating
        clock.now += HOUR + 1
        w.heartbeat()
        r.heartbeat()
        report = collect_garbage(gc_client, "held", grace_seconds=HOUR)
        assert key not in report.deleted_abandoned and report.kept_live_writer == 1
    w.compare_and_append_batch([batch], 0, 1)
    assert rows(r.snapshot(0)) == [(1, "a", 1)]
    assert fsck(c, "held").ok


def test_a_builder_stamps_each_run_when_it_is_written(stash: Stash, any_blob: Blob) -> None:
    clock = Clock()
    c = client(stash, any_blob, clock, target_part_bytes=1)
    w, _r = c.open("stamps", KS, VS)
    b = w.builder(0)
    clock.now += 5 * HOUR  # the builder stays open long before its first part
    w.heartbeat()
    b.add([upd(1, "a", 0)])  # flushed at once (tiny target part size)
    (key,) = b.finish(1).blob_keys()
    assert key_created_ms(key) == int(clock.now * 1000)


def test_append_refuses_a_batch_whose_writer_expired(stash: Stash, any_blob: Blob) -> None:
    clock, blob = Clock(), any_blob
    c = client(stash, blob, clock, writer_lease_seconds=60)
    other = client(stash, blob, clock)
    w, r = c.open("lapsed", KS, VS)
    batch = w.batch([upd(1, "a", 0)], 0, 1)
    clock.now += 2 * HOUR  # no heartbeat: the writer's lease runs out
    r.heartbeat()
    seqno = c.inspect("lapsed").seqno
    with pytest.raises(LeaseExpired) as e:
        w.compare_and_append_batch([batch], 0, 1)
    assert isinstance(e.value, PersistError) and w.writer_id in str(e.value)
    st = c.inspect("lapsed")
    assert st.upper == Antichain.from_elem(0) and st.seqno == seqno  # nothing committed
    # GC may now delete its parts; the append is refused all the same.
    report = collect_garbage(other, "lapsed", grace_seconds=HOUR)
    assert report.deleted_abandoned == batch.blob_keys()
    with pytest.raises(PartsMissing):
        w.compare_and_append_batch([batch], 0, 1)
    assert c.inspect("lapsed").upper == Antichain.from_elem(0)
    # A writer whose lease ran out is never registered again.
    with pytest.raises(LeaseExpired):
        w.heartbeat()


def test_append_refuses_a_batch_of_another_writer_that_expired(
    stash: Stash, any_blob: Blob
) -> None:
    clock, blob = Clock(), any_blob
    c = client(stash, blob, clock, writer_lease_seconds=60, handoff_lease_seconds=300)
    w1, _r = c.open("handoff", KS, VS)
    data = w1.batch([upd(1, "a", 0)], 0, 1).into_transmittable()
    w1.expire()  # handed a batch out: kept for the hand-off lease, not dropped
    w2 = c.open_writer("handoff", KS, VS)
    clock.now += 400  # the bytes are decoded after the hand-off lease ran out
    with pytest.raises(LeaseExpired, match="writer of an appended batch"):
        w2.compare_and_append_batch([w2.batch_from_transmittable(data)], 0, 1)
    assert c.inspect("handoff").upper == Antichain.from_elem(0)


def test_a_transmitted_batch_is_appended_after_its_writer_closed(
    stash: Stash, any_blob: Blob
) -> None:
    clock, blob = Clock(), any_blob
    c = client(stash, blob, clock)
    with c.open_writer("spark", KS, VS) as task:
        data = task.batch([upd(1, "a", 0)], 0, 1).into_transmittable()
    w, r = c.open("spark", KS, VS)
    w.compare_and_append_batch([w.batch_from_transmittable(data)], 0, 1)
    assert rows(r.snapshot(0)) == [(1, "a", 1)]


def test_append_refuses_a_batch_whose_part_is_gone(stash: Stash, any_blob: Blob) -> None:
    clock, blob = Clock(), any_blob
    c = client(stash, blob, clock)
    w, r = c.open("gone", KS, VS)
    batch = w.batch([upd(1, "a", 0)], 0, 1)
    (key,) = batch.blob_keys()
    blob.delete(key)
    with pytest.raises(PartsMissing) as e:
        w.compare_and_append_batch([batch], 0, 1)
    assert e.value.keys == [key] and "nothing was committed" in str(e.value)
    assert c.inspect("gone").upper == Antichain.from_elem(0)
    w.compare_and_append([upd(2, "b", 0)], 0, 1)  # the shard still works
    assert rows(r.snapshot(0)) == [(2, "b", 1)]


def test_gc_deletes_only_keys_persist_could_have_written(stash: Stash, any_blob: Blob) -> None:
    clock, blob = Clock(), any_blob
    c = client(stash, blob, clock)
    w, _r = c.open("foreign", KS, VS)
    w.compare_and_append([upd(1, "a", 0)], 0, 1)
    sid = w.shard_id
    foreign = [f"{sid}/b/1000-notes.parquet", f"{sid}/b/1000-x/y.txt", f"{sid}/README"]
    for k in foreign:
        blob.set(k, b"not persist's")
    old_layout = f"{sid}/b/1000-{'a' * 16}-{'b' * 32}.parquet"  # an abandoned old key
    blob.set(old_layout, b"x")
    report = collect_garbage(c, "foreign", grace_seconds=0)
    assert sorted(report.unrecognized) == sorted(foreign)
    assert report.deleted_abandoned == [old_layout]
    assert set(foreign) <= shard_keys(c, "foreign")
    assert parse_part_key(sid, old_layout) is not None
    assert parse_part_key(sid, f"{sid}/c/1000-{'a' * 16}t00003/{'b' * 32}.parquet") is not None


# ---------------------------------------------------------- item 7c: compactor outputs


def test_a_compaction_output_offered_to_an_append_survives_gc(stash: Stash, any_blob: Blob) -> None:
    clock, blob = Clock(), any_blob
    c = client(stash, blob, clock)
    gc_client = client(stash, blob, clock)
    w, r = c.open("piggy", KS, VS)
    for t in range(4):
        w.compare_and_append([upd(t, "a", t)], t, t + 1)
    r.downgrade_since(3)
    m = c.machine(w.shard_id)
    reqs = m.fetch().trace.all_fueled_merge_reqs()
    assert reqs
    results = [c.compactor.compute(m, q)[0] for q in reqs]
    outputs = [p.key for res in results for p in res.output.parts if p.key]
    assert outputs and all(key_writer_id(k) is not None for k in outputs)
    m.offer_merge_results(results)
    clock.now += 2 * HOUR
    w.heartbeat()
    r.heartbeat()
    report = collect_garbage(gc_client, "piggy", grace_seconds=HOUR)
    assert not set(outputs) & set(report.deleted_abandoned)
    w.compare_and_append([upd(9, "z", 4)], 4, 5)  # applies the offered results
    assert set(outputs) <= c.inspect("piggy").referenced_blob_keys()
    assert len(r.snapshot(4)) == 5
    assert fsck(c, "piggy").ok


# ---------------------------------------------------------------- item 7b: readers


def _compacted_shard(c: PersistClient, name: str) -> tuple[Any, Any]:
    w, r = c.open(name, KS, VS)
    for t in range(6):
        w.compare_and_append([upd(t, "a", t)], t, t + 1)
    return w, r


def test_a_reader_holding_snapshot_batches_survives_compaction_and_gc(
    stash: Stash, any_blob: Blob
) -> None:
    clock, blob = Clock(), any_blob
    c = client(stash, blob, clock)
    other = client(stash, blob, clock)
    w, r = _compacted_shard(c, "held-read")
    batches = r.snapshot_batches(5)
    # Another client compacts and collects with grace 0 (as the main job does).
    _w2, r2 = other.open("held-read", KS, VS)
    r2.downgrade_since(5)
    r.downgrade_since(5)  # moves the since, but r still holds the version it read
    assert other.compactor.compact_once("held-read").applied >= 1
    clock.now += 2 * HOUR
    r.heartbeat()
    r2.heartbeat()
    report = collect_garbage(other, "held-read", grace_seconds=0)
    assert report.kept_held >= 1
    got = read_batches(c.blob, batches, r.schema, upper=6)
    assert sorted(got["k"].to_pylist()) == list(range(6))
    # Once the reader reads again, its hold moves on and GC may delete the old parts.
    r.snapshot_batches(5)
    r.heartbeat()
    gc_report = collect_garbage(other, "held-read", grace_seconds=0)
    assert gc_report.deleted_retired
    assert fsck(c, "held-read").ok


def test_held_snapshot_batches_keep_their_lease_alive_past_every_grace(
    stash: Stash, any_blob: Blob
) -> None:
    """With default-like settings: a reader that holds
    ``snapshot_batches`` far past its lease and GC's grace, without calling anything
    itself, still reads every part: its lease is renewed in the background."""
    clock, blob = Clock(), any_blob
    c = client(stash, blob, clock, reader_lease_seconds=900)
    other = client(stash, blob, clock)
    w, r = _compacted_shard(c, "long-read")
    r.lease_keeper = LeaseKeeper(clock=clock, thread=False)  # beats only when told
    batches = r.snapshot_batches(5)
    _w2, r2 = other.open("long-read", KS, VS)
    r2.downgrade_since(5)
    r.downgrade_since(5)
    assert other.compactor.compact_once("long-read").applied >= 1
    for _ in range(40):  # 2 hours in steps of a fifth of the reader's lease
        clock.now += 180
        r.lease_keeper.run_due()
        w.heartbeat()
        r2.heartbeat()
    collect_garbage(other, "long-read", grace_seconds=HOUR)
    got = read_batches(c.blob, batches, r.schema, upper=6)
    assert sorted(got["k"].to_pylist()) == list(range(6))
    r.expire()  # the hold and its renewal end together
    assert not r.lease_keeper.run_due()
    gc_report = collect_garbage(other, "long-read", grace_seconds=0)
    assert gc_report.deleted_retired


def test_a_snapshot_refetches_state_when_a_part_is_missing(stash: Stash) -> None:
    clock, inner = Clock(), MemoryBlob()

    class VanishOnce(MemoryBlob):
        """Reports each key missing once (a version whose parts GC just deleted)."""

        def __init__(self) -> None:
            super().__init__()
            self._store = inner._store
            self.misses: set[str] = set()

        def get(self, key: str) -> bytes | None:
            if "/b/" in key and key not in self.misses:
                self.misses.add(key)
                return None
            return super().get(key)

    blob = VanishOnce()
    c = client(stash, blob, clock, blob_retries=1)
    w, r = c.open("vanish", KS, VS)
    w.compare_and_append([upd(1, "a", 0)], 0, 1)
    assert rows(r.snapshot(0)) == [(1, "a", 1)]
    assert blob.misses  # it did meet a missing part, and re-read


def test_a_snapshot_still_reports_a_part_missing_from_the_latest_state(
    stash: Stash, any_blob: Blob
) -> None:
    clock, blob = Clock(), any_blob
    c = client(stash, blob, clock)
    w, r = c.open("lost", KS, VS)
    w.compare_and_append([upd(1, "a", 0)], 0, 1)
    (key,) = c.inspect("lost").referenced_blob_keys()
    blob.delete(key)
    with pytest.raises(CorruptPart, match="missing"):
        r.snapshot(0)
    report = fsck(c, "lost")
    assert not report.ok and report.missing == [key]


def test_gc_keeps_retired_parts_until_every_reader_moved_past(stash: Stash, any_blob: Blob) -> None:
    clock, blob = Clock(), any_blob
    c = client(stash, blob, clock)
    w, r = _compacted_shard(c, "holds")
    slow = c.open_reader("holds", KS, VS)  # registered before the compaction
    r.downgrade_since(5)
    slow.downgrade_since(5)
    slow_batches = slow.snapshot_batches(5)
    c.compactor.compact_once("holds")
    r.heartbeat()
    report = collect_garbage(c, "holds", grace_seconds=0)
    assert not report.deleted_retired and report.kept_held >= 1
    assert len(read_batches(c.blob, slow_batches, slow.schema, upper=6)) == 6
    slow.expire()
    gc_report = collect_garbage(c, "holds", grace_seconds=0)
    assert gc_report.deleted_retired


# ------------------------------------------------------------- item 9a: idempotent


def test_overlapping_gc_passes_leave_no_negative_retired_rows(stash: Stash, any_blob: Blob) -> None:
    clock, inner = Clock(), any_blob
    c = client(stash, inner, clock)
    w, r = _compacted_shard(c, "twice")
    r.downgrade_since(5)
    c.compactor.compact_once("twice")
    r.heartbeat()
    other = client(stash, inner, clock)
    nested: list[Any] = []
    real_delete = c.blob.delete

    def delete(key: str) -> None:
        if not nested:  # a second GC runs to completion in the middle of the first
            nested.append(collect_garbage(other, "twice", grace_seconds=0))
        real_delete(key)

    c.blob.delete = delete  # type: ignore[method-assign]
    first = collect_garbage(c, "twice", grace_seconds=0)
    assert nested and nested[0].deleted_retired and first.deleted_retired
    coll = stash.collection(RETIRED_COLLECTION_PREFIX + w.shard_id, key="str", value="int")
    acc: dict[Any, int] = {}
    for (k, v), _t, d in stash.iter(coll):
        acc[(k, v)] = acc.get((k, v), 0) + d
    assert all(n in (0, 1) for n in acc.values()), acc
    assert c.consensus.retired(w.shard_id) == {}
    collect_garbage(c, "twice", grace_seconds=0)  # and again: still consistent
    assert c.consensus.retired(w.shard_id) == {}


# -------------------------------------------------------------- item 9b: namespaces


def test_a_name_shaped_like_an_id_is_a_name(stash: Stash, any_blob: Blob) -> None:
    clock, blob = Clock(), any_blob
    c = client(stash, blob, clock)
    wa, _ = c.open("a", KS, VS)
    wa.compare_and_append([upd(1, "a", 0)], 0, 1)
    impostor = wa.shard_id  # a valid shard name
    wb, _ = c.open(impostor, KS, VS)
    assert wb.shard_id != wa.shard_id
    assert c.inspect(impostor).shard_id == wb.shard_id
    assert c.inspect(impostor).name == impostor
    assert c.inspect(f"id:{wa.shard_id}").name == "a"
    assert collect_garbage(c, impostor).shard_id == wb.shard_id
    assert fsck(c, impostor).shard_id == wb.shard_id
    with pytest.raises(InvalidUsage, match="invalid shard id"):
        c.inspect("id:nope")


# ------------------------------------------------------------------- fsck and drop


def test_fsck_finds_damage_and_orphans(stash: Stash, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/stash.db"
    blob_uri = f"file://{tmp_path}/blob"
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, blob_uri, compaction="off", inline_max_bytes=0)
        w, _r = c.open("checked", KS, VS)
        for t in range(3):
            w.compare_and_append([upd(t, "a", t)], t, t + 1)
        orphan = w.batch([upd(9, "z", 3)], 3, 4)
        report = fsck(c, "checked")
        assert report.ok and report.checked_parts == 3
        assert report.orphans == orphan.blob_keys()
        keys = sorted(c.inspect("checked").referenced_blob_keys())
        c.close()
    runner = CliRunner()
    base = ["--stash", url, "--blob", blob_uri]
    res = runner.invoke(main, [*base, "fsck", "checked", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["ok"] is True
    root = tmp_path / "blob"
    (root / keys[0]).write_bytes(b"garbage")
    data = (root / keys[1]).read_bytes()
    (root / keys[1]).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    (root / keys[2]).unlink()
    res = runner.invoke(main, [*base, "fsck", "checked", "--json"])
    assert res.exit_code == 2, res.output
    out = json.loads(res.output.splitlines()[0])
    assert out["ok"] is False and out["missing"] == [keys[2]]
    assert [k for k, *_ in out["wrong_size"]] == [keys[0]]
    assert out["wrong_checksum"] == [keys[1]]


def test_drop_tombstones_the_shard_and_deletes_its_parts(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/stash.db"
    blob_uri = f"file://{tmp_path}/blob"
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, blob_uri, compaction="inline", inline_max_bytes=0)
        w, r = c.open("doomed", KS, VS)
        for t in range(6):
            w.compare_and_append([upd(t, "a", t)], t, t + 1)
            r.downgrade_since(t)
        keep, _ = c.open("kept", KS, VS)
        keep.compare_and_append([upd(1, "a", 0)], 0, 1)
        sid = w.shard_id
        c.close()
    runner = CliRunner()
    base = ["--stash", url, "--blob", blob_uri]
    res = runner.invoke(main, [*base, "drop", "doomed", "--yes", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["deleted_blobs"] >= 1
    assert not list((tmp_path / "blob" / sid).rglob("*.parquet"))
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off")
        with pytest.raises(InvalidUsage, match="finalized"):
            c.open("doomed", KS, VS)
        st = c.inspect("doomed")
        assert st.tombstone and st.upper == Antichain() and not st.batches()[0].parts
        assert c.consensus.retired(sid) == {}
        assert fsck(c, "doomed").ok
        assert c.finalize_shard("doomed") == 0  # idempotent
        _w, rk = c.open("kept", KS, VS)  # other shards are untouched
        assert rows(rk.snapshot(0)) == [(1, "a", 1)]
        c.close()


def test_fsck_reports_symlinks_when_the_blob_store_can_find_them(stash: Stash) -> None:
    clock = Clock()

    class LinkingBlob(MemoryBlob):
        def find_symlinks(self, prefix: str = "") -> list[str]:
            return [k for k in ("x/evil", f"{prefix}b/link") if k.startswith(prefix)]

    c = client(stash, LinkingBlob(), clock)
    w, _r = c.open("links", KS, VS)
    w.compare_and_append([upd(1, "a", 0)], 0, 1)
    report = fsck(c, "links")
    assert not report.ok and report.symlinks == [f"{w.shard_id}/b/link"]
    assert any("symbolic link" in line for line in report.damage())


def test_a_detached_planner_keeps_its_parts_but_not_the_since(stash: Stash, any_blob: Blob) -> None:
    clock, blob = Clock(), any_blob
    c = client(stash, blob, clock)
    w, r = _compacted_shard(c, "planned")
    with c.open_reader("planned", KS, VS) as planner:  # a Spark driver planning a read
        batches = planner.snapshot_batches(5)
        planner.detach()
    c.close()  # the driver is gone; its executors still read the planned parts
    other = client(stash, blob, clock)
    _w2, r2 = other.open("planned", KS, VS)
    r2.downgrade_since(5)
    assert other.inspect("planned").since == Antichain.from_elem(5)  # no since held back
    assert other.compactor.compact_once("planned").applied >= 1
    r2.heartbeat()
    gc_report = collect_garbage(other, "planned", grace_seconds=0)
    assert gc_report.kept_held >= 1
    got = read_batches(other.blob, batches, r2.schema, upper=6)
    assert sorted(got["k"].to_pylist()) == list(range(6))
    clock.now += 4 * HOUR  # the planner's lease runs out: the parts may go
    r2.heartbeat()
    gc_report = collect_garbage(other, "planned", grace_seconds=0)
    assert gc_report.deleted_retired
    assert fsck(other, "planned").ok
