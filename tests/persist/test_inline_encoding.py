"""Inline parts are the same bytes however they are put together (:mod:`persist.encoding`).

:func:`persist.encoding.encode_inline_part` builds the Arrow IPC stream from a cached
schema message and each chunk's record batch message, and compresses it with a zstd
context reused per thread.  The bytes must be exactly those of pyarrow's
``RecordBatchStreamWriter`` compressed as one zstd frame at level 1 with its content size
(as ``pyarrow.Codec("zstd", 1)`` writes it, the encoding before) and zstd's content
checksum (``zstandard.ZstdCompressor(level=1, write_checksum=True)``): every type a shard accepts, nulls, zero rows, several chunks, sliced tables,
dictionary columns (written by the writer), schema metadata; and threads encoding at
once get their own contexts.
"""

from __future__ import annotations

import re
import threading

import pyarrow as pa
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist import encoding
from persist.decoding import decode_part
from persist.encoding import (
    INLINE_ZSTD_MAGIC,
    encode_inline_part,
    encode_inline_part_stream,
    make_part_ref,
)
from tests.persist.arrow_strategies import shard_schemas, update_tables


def _reference(table: pa.Table) -> bytes:
    """The encoding with pyarrow's stream writer and a fresh zstd context (level 1, the
    content size, the content checksum)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.RecordBatchStreamWriter(sink, table.schema) as writer:
        writer.write_table(table)
    stream = sink.getvalue()
    frame: bytes = zstandard.ZstdCompressor(level=1, write_checksum=True).compress(stream)
    return INLINE_ZSTD_MAGIC + int(stream.size).to_bytes(4, "little") + frame


@st.composite
def tables(draw: st.DrawFn) -> pa.Table:
    ks, vs = draw(shard_schemas())
    t = draw(update_tables(ks, vs, max_rows=8))
    if t.num_rows > 2 and draw(st.booleans()):  # several chunks, one maybe empty
        cut = draw(st.integers(0, t.num_rows))
        t = pa.concat_tables([t.slice(0, cut), t.slice(cut)])
    if t.num_rows > 1 and draw(st.booleans()):  # a slice of a bigger table
        t = t.slice(1)
    if draw(st.booleans()):
        t = t.replace_schema_metadata({"origin": draw(st.text(max_size=8))})
    return t


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(table=tables())
def test_inline_parts_are_the_bytes_the_stream_writer_made(table: pa.Table) -> None:
    for _ in range(2):  # the second time from the cached schema message
        encoded, stream = encode_inline_part_stream(table)
        assert encoded == _reference(table)
        assert stream.to_pybytes() == encoding.inline_stream(encoded)
    back = decode_part(encoded, make_part_ref(None, encoded, table.num_rows, inline=True))
    # NaN is unequal to itself: compared as the bytes of the decoded table instead.
    assert back.schema.equals(table.schema) and back.num_rows == table.num_rows
    assert encode_inline_part(back) == _reference(back)


def test_threads_encode_with_their_own_contexts() -> None:
    tables = [
        pa.table({"k": pa.array([i] * (i + 1), pa.int64()), "v": [f"v{i}"] * (i + 1)})
        for i in range(8)
    ]
    want = [_reference(t) for t in tables]
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(200):
                for t, w in zip(tables, want, strict=True):
                    assert encode_inline_part(t) == w
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors


def test_an_inline_part_is_named_by_32_random_hex_digits() -> None:
    data = encode_inline_part(pa.table({"k": [1]}))
    nonces = {make_part_ref(None, data, 1, inline=True).nonce for _ in range(100)}
    assert len(nonces) == 100  # equal bytes, distinct parts
    assert all(n is not None and re.fullmatch(r"[0-9a-f]{32}", n) for n in nonces)
