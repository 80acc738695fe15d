"""Schema-less inline parts (:data:`persist.encoding.INLINE_BARE_MAGIC`).

A table whose schema is exactly the shard's updates schema of its schema version is kept
inline without its Arrow IPC schema message; its readers give that schema back. Checked
here: every column type round-trips; a one-row flights part is about half the size of the
schema-carrying one; decoding without the schema, or with another, is refused naming the
part; a shard of schema-carrying (``PZI1``) inline parts, as written before, still reads;
and reads of a shard of schema-less inline parts equal those of the same rows written as
blob parts, by a fresh client (every part decoded from the stash).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist import parts as parts_module
from persist.decoding import decode_part
from persist.encoding import (
    INLINE_BARE_MAGIC,
    INLINE_ZSTD_MAGIC,
    encode_inline_part,
    encode_inline_part_stream,
    make_part_ref,
)
from persist.errors import CorruptPart, InvalidUsage
from persist.parts import read_parts
from stash import Stash
from tests.persist.arrow_strategies import (
    canonical_rows,
    close_client,
    fresh_client,
    shard_schemas,
    update_tables,
    write_shard,
)


def _batches(table: pa.Table) -> list[bytes]:
    """The record batch messages of ``table`` (NaN-proof equality of decoded tables)."""
    return [b.serialize().to_pybytes() for b in table.combine_chunks().to_batches()]


@st.composite
def tables(draw: st.DrawFn) -> pa.Table:
    ks, vs = draw(shard_schemas())
    t = draw(update_tables(ks, vs, max_rows=8, dictionary=False))
    if t.num_rows > 2 and draw(st.booleans()):  # several chunks
        cut = draw(st.integers(0, t.num_rows))
        t = pa.concat_tables([t.slice(0, cut), t.slice(cut)])
    if t.num_rows > 1 and draw(st.booleans()):  # a slice of a bigger table
        t = t.slice(1)
    if draw(st.booleans()):  # field metadata: part of the exact schema
        t = t.cast(t.schema.set(0, t.schema.field(0).with_metadata({"m": "1"})))
    return t


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(table=tables())
def test_every_column_type_round_trips_without_its_schema(table: pa.Table) -> None:
    schema = table.schema
    bare = encode_inline_part(table, schema)
    assert bare[:4] == INLINE_BARE_MAGIC
    old = encode_inline_part(table)
    assert old[:4] == INLINE_ZSTD_MAGIC
    ref = make_part_ref(None, bare, table.num_rows, inline=True)
    back = decode_part(bare, ref, schema=schema)
    assert back.schema.equals(schema, check_metadata=True)
    assert canonical_rows(back) == canonical_rows(table)
    # The very table the schema-carrying part decodes to.
    before = decode_part(old, make_part_ref(None, old, table.num_rows, inline=True))
    assert before.schema.equals(back.schema, check_metadata=True)
    assert _batches(back) == _batches(before)
    # Some columns only.
    cols = [schema.names[-1], schema.names[0]]
    assert decode_part(bare, ref, cols, schema=schema).column_names == cols


def test_the_schema_must_equal_exactly_else_the_part_carries_its_schema() -> None:
    t = pa.table({"k": pa.array([1], pa.int64()), "v": ["a"]})
    other_nullability = pa.schema([pa.field("k", pa.int64(), False), pa.field("v", pa.string())])
    other_metadata = t.schema.with_metadata({"x": "y"})
    other_field_metadata = t.schema.set(1, t.schema.field(1).with_metadata({"x": "y"}))
    for schema in (None, other_nullability, other_metadata, other_field_metadata):
        assert encode_inline_part(t, schema)[:4] == INLINE_ZSTD_MAGIC
    assert encode_inline_part(t, t.schema)[:4] == INLINE_BARE_MAGIC
    # Dictionary columns need their dictionary messages: the schema-carrying stream.
    d = pa.table({"k": pa.array(["a"]).dictionary_encode()})
    assert encode_inline_part(d, d.schema)[:4] == INLINE_ZSTD_MAGIC


def test_a_one_row_flights_part_is_about_half_the_size() -> None:
    from bench.bench_commit import _one, _rows

    one = _one(_rows(10), 3, 3)
    old = encode_inline_part(one)
    new, stream = encode_inline_part_stream(one, one.schema)
    # 518 bytes against 1,007: the schema message (1,160 bytes before zstd) is gone.
    assert new[:4] == INLINE_BARE_MAGIC and len(new) < 0.55 * len(old)
    ref = make_part_ref(None, new, 1, inline=True)
    assert decode_part(new, ref, schema=one.schema).equals(one)
    # The stream handed to the inline cache is still the whole stream.
    assert pa.ipc.open_stream(stream).read_all().equals(one)


def test_decoding_without_the_schema_or_with_another_is_refused() -> None:
    t = pa.table({"k": pa.array([1, 2], pa.int64()), "v": ["a", None]})
    data = encode_inline_part(t, t.schema)
    ref = make_part_ref(None, data, 2, inline=True)
    with pytest.raises(InvalidUsage, match=r"part <inline> \(schema version 0\) is stored without"):
        decode_part(data, ref)
    with pytest.raises(InvalidUsage, match="stored without its schema"):
        read_parts(None, [ref])  # type: ignore[arg-type]  # no blob needed
    # Same buffers, other type: refused by the schema digest, never garbage.
    other = pa.schema([pa.field("k", pa.uint64()), pa.field("v", pa.binary())])
    with pytest.raises(CorruptPart, match="written with another schema"):
        decode_part(data, ref, schema=other)
    with pytest.raises(CorruptPart, match="<inline>"):
        read_parts(None, [ref], schema=other)  # type: ignore[arg-type]
    # Damaged bytes whose checksum matches (a bug, not bit rot): refused, named.
    for bad in (data[:12], data[:-3], data[:4] + (9999).to_bytes(4, "little") + data[8:]):
        with pytest.raises(CorruptPart, match="<inline>"):
            decode_part(bad, make_part_ref(None, bad, 2, inline=True), schema=t.schema)
    # A schema differing only in metadata reads it (batches do not depend on metadata).
    meta = t.schema.set(0, t.schema.field(0).with_metadata({"a": "b"}))
    assert decode_part(data, ref, schema=meta).column("k").to_pylist() == [1, 2]
    assert read_parts(None, [ref], schema=t.schema).equals(t)  # type: ignore[arg-type]


# ------------------------------------------------------------------ whole shards


@pytest.fixture(scope="module")
def where(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    d: Path = tmp_path_factory.mktemp("schemaless")
    url = f"sqlite:///{d / 'stash.db'}"
    Stash.open(url).close()
    yield url, f"file://{d / 'blob'}"


def _read(where: tuple[str, str], name: str, ks: pa.Schema, vs: pa.Schema, as_of: int = 2) -> Any:
    """``(snapshot at as_of, snapshot stream, inline parts' magics)`` by a fresh client."""
    c = fresh_client(*where, inline=True)
    try:
        magics = {
            p.inline[:4] for b in c.inspect(name).batches() for p in b.parts if p.inline is not None
        }
        r = c.open_reader(name, ks, vs)
        snap = r.snapshot(as_of)
        stream = pa.Table.from_batches(list(r.snapshot_stream(as_of)), snap.schema)
        return snap, stream, magics
    finally:
        close_client(c)


_KS = pa.schema([pa.field("k", pa.int64(), False), pa.field("s", pa.string())])
_VS = pa.schema([pa.field("v", pa.float64()), pa.field("t", pa.timestamp("us", "UTC"))])


def _appends() -> list[pa.Table]:
    rows = [
        {"k": [1, 2], "s": ["a", None], "v": [1.5, None], "t": [0, 1]},
        {"k": [2, 3], "s": [None, "c"], "v": [None, -0.0], "t": [1, None]},
        {"k": [1], "s": ["a"], "v": [1.5], "t": [0]},
    ]
    out = []
    for i, r in enumerate(rows):
        t = pa.table(r, schema=pa.schema([*_KS, *_VS]))
        n = t.num_rows
        t = t.append_column("_time", pa.array([i] * n, pa.int64()))
        out.append(t.append_column("_diff", pa.array([1] * n, pa.int64())))
    return out


def test_reads_of_schemaless_inline_parts_equal_reads_of_blob_parts(
    where: tuple[str, str],
) -> None:
    tables = _appends()
    inline = write_shard(*where, True, _KS, _VS, tables)
    blob = write_shard(*where, False, _KS, _VS, tables)
    snap, stream, magics = _read(where, inline, _KS, _VS)
    assert magics == {INLINE_BARE_MAGIC}
    want, want_stream, none = _read(where, blob, _KS, _VS)
    assert none == set()
    assert canonical_rows(snap) == canonical_rows(want)
    assert canonical_rows(stream) == canonical_rows(want_stream) == canonical_rows(want)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_differential_over_column_types(where: tuple[str, str], data: st.DataObject) -> None:
    ks, vs = data.draw(shard_schemas())
    tables = [
        data.draw(update_tables(ks, vs, times=(i,), max_rows=4, dictionary=False)) for i in range(2)
    ]
    inline = write_shard(*where, True, ks, vs, tables)
    blob = write_shard(*where, False, ks, vs, tables)
    snap, _, magics = _read(where, inline, ks, vs, 1)
    assert magics <= {INLINE_BARE_MAGIC}
    want, _, _ = _read(where, blob, ks, vs, 1)
    assert canonical_rows(snap) == canonical_rows(want)


def test_a_shard_of_schema_carrying_inline_parts_still_reads(
    where: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tables = _appends()
    # Written as the code before schema-less parts wrote them (the schema ignored).
    real = parts_module.encode_inline_part_stream
    monkeypatch.setattr(
        parts_module, "encode_inline_part_stream", lambda table, schema=None: real(table)
    )
    old = write_shard(*where, True, _KS, _VS, tables)
    monkeypatch.undo()
    new = write_shard(*where, True, _KS, _VS, tables)
    snap, stream, magics = _read(where, old, _KS, _VS)
    assert magics == {INLINE_ZSTD_MAGIC}
    want, _, new_magics = _read(where, new, _KS, _VS)
    assert new_magics == {INLINE_BARE_MAGIC}
    assert canonical_rows(snap) == canonical_rows(want) == canonical_rows(stream)
    # Appending schema-less parts to the old shard: both formats in one read.
    c = fresh_client(*where, inline=True)
    try:
        w = c.open_writer(old, _KS, _VS)
        w.compare_and_append(tables[0].set_column(4, "_time", pa.array([3, 3])), 3, 4)
    finally:
        close_client(c)
    c = fresh_client(*where, inline=True)
    try:
        got = c.open_reader(old, _KS, _VS).snapshot(3)
        magics = {p.inline[:4] for b in c.inspect(old).batches() for p in b.parts if p.inline}
        assert magics == {INLINE_ZSTD_MAGIC, INLINE_BARE_MAGIC}
    finally:
        close_client(c)
    assert sum(r[-1] for r in canonical_rows(got)) == sum(t.num_rows for t in tables) + 2


def test_key_samples_of_a_schemaless_part_need_its_schema() -> None:
    from persist.decoding import INLINE_CACHE
    from persist.merge import part_key_samples
    from persist.updates import SchemaHistory

    ks = pa.schema([pa.field("k", pa.int64(), False)])
    vs = pa.schema([pa.field("v", pa.string())])
    t = pa.table(
        {"k": [1, 2, 3], "v": ["a", "b", None], "_time": [0, 0, 0], "_diff": [1, 1, 1]},
        schema=pa.schema(
            [*ks, *vs, pa.field("_time", pa.int64(), False), pa.field("_diff", pa.int64(), False)]
        ),
    )
    history = SchemaHistory(ks, [vs])
    assert t.schema.equals(history.updates_schema(0), check_metadata=True)
    data = encode_inline_part(t, history.updates_schema(0))
    ref = make_part_ref(None, data, 3, inline=True)
    INLINE_CACHE.clear()
    assert part_key_samples(ref, ["k"]) is None  # unknown without the schema
    by_history = part_key_samples(ref, ["k"], history)
    assert by_history and part_key_samples(ref, ["k"], t.schema) == by_history
