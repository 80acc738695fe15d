"""Protects: a reader on an older schema never gets a value nobody wrote.

The attack: a reader opened with an older compatible schema keeps its view; for an
older reader a value written later under a wider type must fit the reader's type, else
SchemaMismatch (persist.updates.SchemaHistory docstring; the int case raises).  A
float64 value outside float32's range read by a float32 reader comes back as ``inf``:
a value nobody wrote."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest

from persist import MemoryBlob, PersistClient, SchemaMismatch
from stash import Stash

pytestmark = pytest.mark.adversarial

KS = pa.schema([("k", pa.string())])
V1 = pa.schema([("v", pa.float32())])
V2 = pa.schema([("v", pa.float64())])
V1I = pa.schema([("v", pa.int8())])
V2I = pa.schema([("v", pa.int64())])


@pytest.fixture
def client():
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off")
    yield c
    c.close()
    s.close()


def test_int_out_of_range_for_an_older_reader_is_schema_mismatch(client: PersistClient) -> None:
    """The reference behaviour (holds): int64 300 read by an int8 reader."""
    w1, r1 = client.open("i", KS, V1I)
    w1.compare_and_append([((("a",), (1,)), 0, 1)], 0, 1)
    w2, _r2 = client.open("i", KS, V2I)
    w2.compare_and_append([((("c",), (300,)), 1, 1)], 1, 2)
    with pytest.raises(SchemaMismatch):
        r1.snapshot(1)


def test_float_out_of_range_for_an_older_reader_is_not_silently_inf(
    client: PersistClient,
) -> None:
    w1, r1 = client.open("f", KS, V1)
    w1.compare_and_append([((("a",), (1.5,)), 0, 1)], 0, 1)
    w2, r2 = client.open("f", KS, V2)
    w2.compare_and_append([((("c",), (1e300,)), 1, 1)], 1, 2)
    assert r2.snapshot(1).column("v").to_pylist() == [1.5, 1e300]
    try:
        snap = r1.snapshot(1)
    except SchemaMismatch:
        return  # the contract's answer
    vals = snap.column("v").to_pylist()
    assert not any(math.isinf(x) for x in vals), (
        f"the float32 reader sees {vals}: 1e300 was read as inf, a value never written"
    )
