"""Protects: the inline cache's first read of a part it keeps as the Arrow IPC stream
just encoded (:func:`persist.decoding._read_stream`: record batch messages read against
the schema in hand) gives exactly what Arrow's stream reader gives: the same values,
schema (field metadata kept, schema metadata dropped), nullability and chunks, for
every column type a shard holds, slices, several chunks and dictionary columns (read
by the stream reader); and a one-row part's first read builds no stream reader."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import persist.decoding as decoding
from persist.blob import MemoryBlob
from persist.decoding import INLINE_CACHE, decode_part
from persist.encoding import encode_inline_part_stream, make_part_ref
from persist.parts import read_parts, write_parts
from tests.persist.arrow_strategies import shard_schemas, update_tables


def _stream_reader(stream: pa.Buffer) -> pa.Table:
    return pa.ipc.open_stream(stream).read_all().replace_schema_metadata(None)


@st.composite
def _tables(draw: st.DrawFn) -> pa.Table:
    ks, vs = draw(shard_schemas(max_keys=3, max_values=3))
    table = draw(update_tables(ks, vs, times=(0, 1, 5), max_rows=12))
    if draw(st.booleans()):
        table = table.replace_schema_metadata({"k": "v"})
    if draw(st.booleans()) and table.num_columns:
        f = table.schema.field(0).with_metadata({b"m": b"x"})
        table = table.set_column(0, f, table.column(0))
    if table.num_rows > 1 and draw(st.booleans()):
        a = draw(st.integers(0, table.num_rows - 1))
        table = table.slice(a, draw(st.integers(0, table.num_rows - a)))
    if table.num_rows > 1 and draw(st.booleans()):
        cut = draw(st.integers(1, table.num_rows - 1))
        table = pa.concat_tables([table.slice(0, cut), table.slice(cut)])
    return table


@settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(table=_tables())
def test_stream_read_against_the_schema_matches_the_stream_reader(table: pa.Table) -> None:
    _data, stream = encode_inline_part_stream(table, table.schema)
    want = _stream_reader(stream)
    got = decoding._read_stream(decoding._Stream(stream, table.schema))
    assert got.schema.equals(want.schema, check_metadata=True)
    assert got.equals(want)
    assert [c.num_chunks for c in got.columns] == [c.num_chunks for c in want.columns]
    assert got.num_rows == want.num_rows


def test_a_one_row_parts_first_cached_read_builds_no_stream_reader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A one-row slice of a larger table (an append cut from a batch) is cached as its
    stream; the compaction that merges it reads it against the schema in hand, not
    through ``pyarrow.ipc.open_stream`` (which parses the schema message again)."""
    big = pa.table(
        {
            "k": pa.array(range(1000), pa.int64()),
            "s": pa.array([f"v{i}" for i in range(1000)], pa.string()),
            "_time": pa.array([0] * 1000, pa.int64()),
            "_diff": pa.array([1] * 1000, pa.int64()),
        }
    )
    row = big.slice(500, 1)
    blob = MemoryBlob()
    (ref,) = write_parts(blob, row, "p", inline_max_bytes=1 << 16, schema=row.schema)
    assert ref.inline is not None

    def no_stream_reader(*_a: object, **_k: object) -> None:
        raise AssertionError("pyarrow.ipc.open_stream called")

    monkeypatch.setattr(pa.ipc, "open_stream", no_stream_reader)
    got = INLINE_CACHE.get(ref)
    monkeypatch.undo()
    assert got is not None and got.equals(row)
    assert got.equals(decode_part(ref.inline, ref, schema=row.schema))
    assert read_parts(blob, [ref], schema=row.schema).equals(row)


def test_the_first_read_keeps_the_parts_accounted_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream read on first use holds the stream's buffers (read without a copy): the
    entry stays accounted as it was put, without measuring the table read (which cost
    more than reading it), and later reads answer the very table read first."""
    cache = decoding._InlineCache(1 << 20)
    monkeypatch.setattr(decoding, "INLINE_CACHE", cache)
    big = pa.table({"k": pa.array(range(5000), pa.int64()), "s": [f"v{i}" for i in range(5000)]})
    row = big.slice(4321, 1)
    data, stream = encode_inline_part_stream(row, row.schema)
    ref = make_part_ref(None, data, 1, inline=True)
    cache.put(ref, row, stream)
    before = cache._bytes
    assert before > 0
    got = cache.get(ref)
    assert got is not None and got.equals(row)
    assert cache._bytes == before
    assert cache.get(ref) is got


def test_a_part_put_with_its_stream_keeps_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """A part written with its stream (every inline write) is cached as that stream,
    whatever the table (a slice or a table of its own): nothing is measured or read at
    write time, and the first read gives what decoding the part gives."""
    cache = decoding._InlineCache(1 << 20)
    monkeypatch.setattr(decoding, "INLINE_CACHE", cache)
    table = pa.table({"k": pa.array([3, 1, 2], pa.int64()), "s": ["a", None, "é"]})
    data, stream = encode_inline_part_stream(table, table.schema)
    ref = make_part_ref(None, data, 3, inline=True)
    cache.put(ref, table, stream)
    held = cache._entries[id(data)][1]
    assert isinstance(held, decoding._Stream) and held.stream is stream
    got = cache.get(ref)
    assert got is not None and got.equals(table)
    assert got.equals(decode_part(data, ref, schema=table.schema))
