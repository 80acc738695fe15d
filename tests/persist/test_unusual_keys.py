"""Persist writes and reads with unusual keys: a
string key holding NUL (which the stash's JSON cannot hold, so statistics and key
samples leave it out) and very long keys, and the read surface of ``persist/read.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pytest

from persist import MemoryBlob, PersistClient, PersistError
from stash import Stash

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


@pytest.fixture
def client() -> Iterator[PersistClient]:
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off", inline_max_bytes=0)
    yield c
    c.close()
    s.close()


def test_string_key_with_nul_character_round_trips(client: PersistClient) -> None:
    """A NUL inside an Arrow string key is valid data (Parquet stores it), but the part's
    key statistics go into the JSON state, which the stash refuses: the append fails
    with a bare ``stash.StashError`` (not a ``PersistError``) naming no shard/column."""
    w, r = client.open("s", KS, VS)
    try:
        w.compare_and_append([((("a\x00b",), (1,)), 0, 1)], 0, 1)
    except PersistError as e:  # a clear refusal would at least be a PersistError
        pytest.fail(f"refused valid data: {e}")
    assert r.snapshot(0).column("k").to_pylist() == ["a\x00b"]


def test_string_key_with_nul_error_is_a_persist_error(client: PersistClient) -> None:
    """If refused, the error must be a PersistError (``persist/errors.py``: errors
    subclass persist.PersistError) naming the shard."""
    w, _ = client.open("s", KS, VS)
    try:
        w.compare_and_append([((("a\x00b",), (1,)), 0, 1)], 0, 1)
    except PersistError:
        pass
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"{type(e).__module__}.{type(e).__name__} escaped: {e}")


def test_snapshot_takes_filter_and_columns(client: PersistClient) -> None:
    """``ReadHandle.snapshot(as_of, filter=pyarrow.compute.Expression,
    columns=[...])``."""
    import pyarrow.compute as pc

    w, r = client.open("s", KS, VS)
    w.compare_and_append([((("a",), (1,)), 0, 1), ((("b",), (2,)), 0, 1)], 0, 1)
    t = r.snapshot(0, filter=pc.field("k") == "b", columns=["k"])  # type: ignore[call-arg]
    assert t.column("k").to_pylist() == ["b"]


def test_long_string_keys_are_not_copied_into_the_state(client: PersistClient) -> None:
    """Key samples keep at most MAX_SAMPLE_STRING_BYTES per value: a part of 2,000-byte
    keys has none (its reads fall back to one key range) and still reads exactly."""
    from persist.parts import MAX_SAMPLE_STRING_BYTES

    w, r = client.open("s", KS, VS)
    keys = [("x" * 2000) + str(i) for i in range(20)]
    w.compare_and_append([(((k,), (i,)), 0, 1) for i, k in enumerate(keys)], 0, 1)
    parts = [p for b in client.inspect("s").batches() for p in b.parts]
    assert parts and all(p.key_samples is None for p in parts)
    assert len(keys[0]) > MAX_SAMPLE_STRING_BYTES
    snap = r.snapshot(0)
    assert sorted(snap.column("k").to_pylist()) == sorted(keys)
    streamed = pa.Table.from_batches(list(r.snapshot_stream(0)))
    assert streamed.to_pylist() == snap.to_pylist()
