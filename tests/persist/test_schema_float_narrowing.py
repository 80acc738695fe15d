"""An older float32 reader of a column widened to float64 reads a value written under
float64 only if it round-trips exactly (cast to float32 and back, it is the value
written; NaN and infinities do): anything else raises ``SchemaMismatch`` naming the
column, as an integer overflow does, rather than hand the reader a value nobody wrote."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest

from persist import MemoryBlob, PersistClient, SchemaMismatch
from stash import Stash

KS = pa.schema([("k", pa.string())])
V32 = pa.schema([("v", pa.float32())])
V64 = pa.schema([("v", pa.float64())])


@pytest.fixture
def client():
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off")
    yield c
    c.close()
    s.close()


def _widened(client: PersistClient, rows: list[tuple[str, float]]):
    """A float32 reader, and ``rows`` written at time 1 by a float64 writer."""
    w32, r32 = client.open("f", KS, V32)
    w32.compare_and_append([((("a",), (1.5,)), 0, 1)], 0, 1)
    w64, r64 = client.open("f", KS, V64)
    w64.compare_and_append([(((k,), (v,)), 1, 1) for k, v in rows], 1, 2)
    return r32, r64


def test_a_tiny_float64_is_not_read_as_zero_by_a_float32_reader(client: PersistClient) -> None:
    r32, r64 = _widened(client, [("tiny", 1e-50)])
    assert sorted(r64.snapshot(1).column("v").to_pylist()) == [1e-50, 1.5]
    with pytest.raises(SchemaMismatch, match=r"'v'.*1e-50.*not exactly representable"):
        r32.snapshot(1)


def test_two_float64_rows_rounding_to_one_float32_do_not_cancel(client: PersistClient) -> None:
    """``1.0`` and ``1.0 + 2**-40`` are one float32: with diffs +1 and -1 they would
    consolidate to nothing for the float32 reader."""
    w32, r32 = client.open("f", KS, V32)
    w32.compare_and_append([((("a",), (1.5,)), 0, 1)], 0, 1)
    w64, _ = client.open("f", KS, V64)
    w64.compare_and_append([((("x",), (1.0,)), 1, 1), ((("x",), (1.0 + 2**-40,)), 1, -1)], 1, 2)
    with pytest.raises(SchemaMismatch, match="'v'"):
        r32.snapshot(1)


def test_exactly_representable_values_nan_and_infinities_read_as_float32(
    client: PersistClient,
) -> None:
    r32, _ = _widened(
        client, [("half", 0.25), ("nan", math.nan), ("inf", math.inf), ("ninf", -math.inf)]
    )
    got = {r["k"]: r["v"] for r in r32.snapshot(1).to_pylist()}
    assert got["half"] == 0.25 and got["a"] == 1.5
    assert math.isnan(got["nan"]) and got["inf"] == math.inf and got["ninf"] == -math.inf
    assert r32.snapshot(1).schema.field("v").type == pa.float32()


def test_a_null_reads_as_null_for_a_float32_reader(client: PersistClient) -> None:
    r32, _ = _widened(client, [("n", None)])  # type: ignore[list-item]
    got = {r["k"]: r["v"] for r in r32.snapshot(1).to_pylist()}
    assert got == {"a": 1.5, "n": None}
