"""Reads without a lease (``persist/version_read.py``): a client over a readonly stash
reads tables, history, details and ``snapshot_many`` writing nothing; a read that meets
a part GC deleted meanwhile reads the newer version at the same time, or fails naming
the since; on SQLite and PostgreSQL stashes (a memory stash cannot be opened twice)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from persist import MemoryBlob, PersistClient, SinceViolation
from persist import version_read as vr
from stash import Stash
from tests.support.dbutil import backend_url

SCHEMA = pa.schema([pa.field("id", pa.int64(), False), ("v", pa.int64())])


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def stash_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return backend_url(request, str(request.param), tmp_path)


@pytest.fixture
def writer(stash_url: str) -> Iterator[PersistClient]:
    s = Stash.open(stash_url, fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off", inline_max_bytes=0)
    try:
        yield c
    finally:
        c.close()
        s.close()


def _stash_rows(url: str) -> dict[str, Any]:
    """Every collection's upper and entries: what a write would change."""
    with Stash.open(url, mode="readonly", fenced=False) as s:
        out = {}
        for name in s.collections():
            c = (
                s.collection(name, key="str", value="json")
                if name.startswith("persist.shard")
                else None
            )
            out[name] = str(s.upper(c)) if c is not None else None
        return out


def test_readonly_client_reads_and_writes_nothing(writer: PersistClient, stash_url: str) -> None:
    t = writer.create_table("t", SCHEMA, key=["id"])
    t.append(pa.table({"id": [1, 2], "v": [10, 20]}))
    t.delete(pc.field("id") == 2)
    before = _stash_rows(stash_url)
    seqno = writer.inspect("t").seqno
    with Stash.open(stash_url, mode="readonly", fenced=False) as ro:
        c = PersistClient(ro, writer.raw_blob, compaction="off")
        try:
            rt = c.table("t")
            assert rt.to_arrow().to_pylist() == [{"id": 1, "v": 10}]
            assert rt.to_arrow(as_of=0).num_rows == 2
            assert rt.history().column("operation").to_pylist() == ["delete", "append", "create"]
            assert rt.details()["upper"] == 2
            snaps = c.snapshot_many(["t"])
            assert snaps["t"].column("_diff").to_pylist() == [1]
        finally:
            c.close()
    assert writer.inspect("t").seqno == seqno
    assert _stash_rows(stash_url) == before


def test_read_after_gc_deleted_a_part_reads_the_newer_version(
    writer: PersistClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The version read references parts; between reading it and fetching them a
    full compaction and GC (grace 0) replace and delete them: the read starts again on
    the newer version at the same as_of and returns the same rows."""
    t = writer.create_table("g", SCHEMA, key=["id"])
    for i in range(3):
        t.upsert(pa.table({"id": [1, 2], "v": [i, i]}))
    expected = t.to_arrow(as_of=2)
    real = vr.snapshot_table
    calls: list[int] = []

    def racing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            t.optimize()
            t.vacuum(grace_seconds=0)  # deletes the parts the version read references
        return real(*args, **kwargs)

    monkeypatch.setattr(vr, "snapshot_table", racing)
    assert t.to_arrow(as_of=2).equals(expected)
    assert len(calls) == 2  # read again, on the newer version


def test_read_after_gc_fails_naming_the_since_when_it_passed(
    writer: PersistClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = writer.create_table("g2", SCHEMA, key=["id"])
    for i in range(3):
        t.upsert(pa.table({"id": [1, 2], "v": [i, i]}))
    real = vr.snapshot_table
    calls: list[int] = []

    def racing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            ks, vs = pa.schema([SCHEMA.field("id")]), pa.schema([SCHEMA.field("v")])
            r = writer.open_reader("g2", ks, vs)
            r.downgrade_since(2)
            r.expire()  # its seqno hold would keep the parts
            t.optimize()
            t.vacuum(grace_seconds=0)
        return real(*args, **kwargs)

    monkeypatch.setattr(vr, "snapshot_table", racing)
    with pytest.raises(SinceViolation, match=r"since \{2\}"):
        t.to_arrow(as_of=0)


# ------------------------------------------------------------ the blob store identity
def test_a_client_over_another_store_is_refused_before_writing(
    writer: PersistClient, stash_url: str
) -> None:
    """All the data is inline, so another store used to read and write "fine": now the
    shard records its store's identity and another store is refused, naming both,
    before anything is written (the marker makes the store known)."""
    from persist import StoreMismatch

    t = writer.create_table("inl", SCHEMA, key=["id"])
    t.append(pa.table({"id": [1], "v": [1]}))
    st = writer.inspect("inl")
    assert st.store_id is not None and st.store_name == "MemoryBlob()"
    seqno = st.seqno
    other_blob = MemoryBlob("other")
    with Stash.open(stash_url, fenced=False) as s:
        c = PersistClient(s, other_blob, compaction="off")
        try:
            with pytest.raises(
                StoreMismatch, match=r"blob store MemoryBlob\(\).*MemoryBlob\('other'\)"
            ):
                c.table("inl")
            with pytest.raises(StoreMismatch):
                c.open("inl", pa.schema([SCHEMA.field("id")]), pa.schema([SCHEMA.field("v")]))
            with pytest.raises(StoreMismatch):
                c.create_table("inl", SCHEMA, key=["id"])
            with pytest.raises(StoreMismatch):
                c.snapshot_many(["inl"])
            with pytest.raises(StoreMismatch):
                txn = c.begin()
                txn.write("inl", pa.table({"id": [2], "v": [2]}))
        finally:
            c.close()
    assert other_blob.list_keys() == []  # nothing written to the wrong store
    assert writer.inspect("inl").seqno == seqno
    # the same store under another client object is fine
    with Stash.open(stash_url, fenced=False) as s:
        c = PersistClient(s, writer.raw_blob, compaction="off")
        try:
            assert c.table("inl").to_arrow().num_rows == 1
        finally:
            c.close()


def test_old_shards_adopt_the_store_that_holds_their_parts(
    writer: PersistClient, stash_url: str, tmp_path: Path
) -> None:
    from persist import FileBlob, StoreMismatch

    t = writer.create_table("old", SCHEMA, key=["id"])
    t.append(pa.table({"id": [1], "v": [1]}))  # a blob part (inline_max_bytes=0)
    m = writer.machine(t.shard_id)
    m._apply(lambda st, fresh: (None, _forget_store(st)))  # as made before identities
    assert writer.inspect("old").store_id is None
    with Stash.open(stash_url, fenced=False) as s:
        c = PersistClient(s, FileBlob(str(tmp_path / "empty")), compaction="off")
        try:
            with pytest.raises(StoreMismatch, match="holds none of its 1 blob parts"):
                c.table("old")
        finally:
            c.close()
    assert writer.inspect("old").store_id is None
    assert writer.table("old").to_arrow().num_rows == 1  # the right store adopts it
    assert writer.inspect("old").store_id == writer.context.store.current()


def _forget_store(st: Any) -> bool:
    st.store_id = st.store_name = None
    return True


def test_clients_creating_the_first_shards_of_a_store_at_once(
    stash_url: str, tmp_path: Path
) -> None:
    """Several clients create the first shards of a fresh store at once: each may write
    its own identity marker (a blob store has no create-if-absent), and every one names
    the store, so every shard opens from any client of it (a single overwritten marker
    refused the shards made with the lost one)."""
    import threading

    from persist import FileBlob

    root = str(tmp_path / "fresh")
    with Stash.open(stash_url, fenced=False) as s:
        clients = [PersistClient(s, FileBlob(root), compaction="off") for _ in range(4)]
        barrier = threading.Barrier(4)
        errors: list[BaseException] = []

        def create(i: int) -> None:
            try:
                barrier.wait()
                clients[i].create_table(f"t{i}", SCHEMA, key=["id"]).append(
                    pa.table({"id": [i], "v": [i]})
                )
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=create, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        fresh = PersistClient(s, FileBlob(root), compaction="off")
        try:
            for i in range(4):
                assert fresh.table(f"t{i}").to_arrow().to_pylist() == [{"id": i, "v": i}]
                assert clients[(i + 1) % 4].table(f"t{i}").to_arrow().num_rows == 1
        finally:
            fresh.close()
            for c in clients:
                c.close()
