"""Encoding of one part: Parquet for blob parts, Arrow IPC for small inline parts.

:func:`encode_part` chooses per column between dictionary, delta and plain encodings;
:func:`encode_inline_part` writes a zstd-compressed Arrow IPC stream for parts small
enough to live in the shard's state (:data:`INLINE_ZSTD_MAGIC`, the stream's length,
then the zstd frame; decoders also read the plain streams written before), or, for a
table of exactly the shard's updates schema, only its record batch messages
(:data:`INLINE_BARE_MAGIC`: its readers give the schema); :func:`make_part_ref`
describes encoded bytes with their SHA-256 checksum (the persist-client batch builder, Materialize's
``src/persist-client/src/batch.rs``).

Invariants kept here:

* decoding what :func:`encode_part` or :func:`encode_inline_part` produced gives back the
  table, column types included;
* an inline part's stream is exactly the bytes pyarrow's ``RecordBatchStreamWriter``
  makes of the table, though put together from a cached schema message and the
  batches' messages, and compressed by a zstd context reused per thread
  (``zstandard``); a schema-less one compresses the same stream without its schema
  message and end-of-stream marker: its reader reads the record batch messages with
  the schema it gives, after checking that schema's digest;
* a :class:`~persist.types.PartRef` from :func:`make_part_ref` carries the SHA-256 of
  exactly the bytes given, and a blob part's key is a valid blob key; the statistics it
  carries are the caller's, computed from the very table encoded.
"""

import hashlib
import json
import os
import threading
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import zstandard

from persist.blob import validate_key
from persist.consolidation import _scratch_pool
from persist.errors import InvalidUsage
from persist.stats import ColumnStats
from persist.types import PartRef
from persist.updates import TIME

_MIB = 1024 * 1024
#: Parts of at most this many rows are encoded without dictionaries.
_DICTIONARY_MIN_ROWS = 64
#: Rows sampled (strided) to choose the dictionary-encoded columns of a part.
_DICTIONARY_SAMPLE_ROWS = 8192
#: A column is dictionary-encoded when its sample has fewer distinct values than this
#: fraction of the sample's rows.
_DICTIONARY_MAX_DISTINCT = 0.3
#: Integer-like columns whose sample has at most this many distinct values keep their
#: dictionary whatever their range (see :func:`_dictionary_columns`).
_DICTIONARY_ALWAYS = 16
#: Tables up to this many in-memory bytes are encoded whole first (as one part if it fits).

#: A part is written as about this many Parquet row groups ...
ROW_GROUPS_PER_PART = 8
#: ... of at least this many rows each.
ROW_GROUP_MIN_ROWS = 16_384

# -------------------------------------------------------------------------- parts


def _sample(table: pa.Table) -> pa.Table:
    """About :data:`_DICTIONARY_SAMPLE_ROWS` rows of ``table``, strided over all of it
    (the table itself when it is small)."""
    n = table.num_rows
    step = max(1, n // _DICTIONARY_SAMPLE_ROWS)
    if step == 1:
        return table
    return table.take(pa.array(np.arange(0, n, step, dtype=np.int64)))


def _integer_range_bits(col: pa.Array | pa.ChunkedArray) -> int | None:
    """Bits of ``max - min`` over the integer values Parquet stores for an integer-like
    column (:func:`_is_integer_physical`: integers, temporal types by their storage,
    decimals scaled to integers); ``None`` when it has no non-null value."""
    t = col.type
    if pa.types.is_decimal(t):
        if not (pa.types.is_decimal128(t) or pa.types.is_decimal256(t)):
            # decimal32/decimal64: Arrow has no min_max kernel for them.
            col = col.cast(pa.decimal128(t.precision, t.scale))
        mm = pc.min_max(col)
        lo, hi = mm["min"].as_py(), mm["max"].as_py()
        if lo is None or hi is None:
            return None
        return int((hi - lo).scaleb(t.scale)).bit_length()
    if not pa.types.is_integer(t):
        storage = pa.int32() if t.bit_width == 32 else pa.int64()
        chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
        col = pa.chunked_array([c.view(storage) for c in chunks], storage)
    mm = pc.min_max(col)
    lo, hi = mm["min"].as_py(), mm["max"].as_py()
    if lo is None or hi is None:
        return None
    return int(hi - lo).bit_length()


def _dictionary_columns(table: pa.Table) -> list[str]:
    """The columns worth dictionary-encoding, judged on a strided sample of
    :data:`_DICTIONARY_SAMPLE_ROWS` rows of ``table`` (:func:`_sample`): those with few
    distinct values (fewer than :data:`_DICTIONARY_MAX_DISTINCT` of the sample's rows; a
    column of mostly distinct values would fill a dictionary page and fall back to plain
    encoding, the dictionary work wasted: ~15% of encoding lineitem).

    But an integer-like column (:func:`_is_integer_physical`) of more than
    :data:`_DICTIONARY_ALWAYS` distinct values whose sample's values span at most one bit
    more than a dictionary index
    (``(max - min).bit_length() <= (distinct - 1).bit_length() + 1``) is left to
    ``DELTA_BINARY_PACKED``: its codes are about as narrow (a delta of two values in the
    range fits in the range's bits, plus a sign) and they encode faster than the
    dictionary's hashing. A handful of values (flags, months,
    a constant ``_time`` or ``_diff``) keeps its dictionary: runs of narrow indices
    encode as fast and decode faster. Integers of a wide, sparse range (``distance``,
    ids, prices) keep theirs too: their indices are far narrower than their deltas.
    Measured against dictionaries for every such column: half of flights, sorted,
    encodes in 44.1 ms instead of 48.4 and decodes in 19.6 instead of 20.3, 0.7% larger; a
    300,000-row lineitem part encodes in 85.8 ms instead of 92.4 and decodes in 35.9
    instead of 35.5, 2% smaller."""
    if table.num_rows <= _DICTIONARY_MIN_ROWS:
        return []
    sample = _sample(table)
    limit = _DICTIONARY_MAX_DISTINCT * sample.num_rows
    dictionary: list[str] = []
    for name, col in zip(sample.column_names, sample.columns, strict=True):
        distinct = pc.count_distinct(col, mode="all").as_py()
        if distinct >= limit:
            continue
        if _is_integer_physical(col.type):
            bits = _integer_range_bits(col)
            narrow = bits is None or bits <= (distinct - 1).bit_length() + 1
            if distinct > _DICTIONARY_ALWAYS and narrow:
                continue  # delta-encoded (encoding_plan)
        dictionary.append(name)
    return dictionary


def _is_integer_physical(t: pa.DataType) -> bool:
    """Whether Parquet stores ``t`` as INT32/INT64 (with :func:`encode_part`'s settings):
    integers, dates, times, timestamps, durations and decimals of precision <= 18."""
    return bool(
        pa.types.is_integer(t)
        or pa.types.is_temporal(t)
        or (pa.types.is_decimal(t) and t.precision <= 18)
    )


#: Codec of the columns that are not delta-encoded (Parquet's LZ4_RAW).
_CODEC = "lz4"


class EncodingPlan(NamedTuple):
    """How :func:`encode_part` encodes each column (:func:`encoding_plan`): the
    dictionary-encoded columns, ``column_encoding`` and ``compression`` by column."""

    dictionary: list[str]
    encoding: dict[str, str]
    compression: dict[str, str]


def encoding_plan(table: pa.Table) -> EncodingPlan:
    """How :func:`encode_part` encodes the columns of ``table``, or of any table of its
    rows in another order or cut into parts (every part of one run is encoded with the
    plan of all its rows, made once: :func:`_dictionary_columns` judges a sample):

    * few distinct values: dictionary, LZ4; but integer-like columns of more than a
      handful of values spanning about as few bits as a dictionary index:
      ``DELTA_BINARY_PACKED``, uncompressed;
    * other integer-like columns (:func:`_is_integer_physical`): ``DELTA_BINARY_PACKED``,
      uncompressed. Deltas of sorted or clustered integers pack into a few bits; on
      lineitem parts this was smaller than LZ4 over plain values and 2-3x faster to
      encode (e.g. ``l_partkey``: 0.84 MB in 2.1 ms against 1.5 MB in 4.2 ms), and it
      decodes as fast;
    * the rest (floats, strings, binary, bool, wide decimals): plain, LZ4.
    """
    dictionary = _dictionary_columns(table)
    in_dict = set(dictionary)
    encoding: dict[str, str] = {}
    compression: dict[str, str] = {}
    for f in table.schema:
        if f.name not in in_dict and _is_integer_physical(f.type):
            encoding[f.name] = "DELTA_BINARY_PACKED"
            compression[f.name] = "none"
        else:
            compression[f.name] = _CODEC
    return EncodingPlan(dictionary, encoding, compression)


def encode_part(table: pa.Table, plan: EncodingPlan | None = None) -> bytes:
    """Encode one part as Parquet bytes, as ``plan`` says (by default
    :func:`encoding_plan` of ``table``; parts of at most :data:`_DICTIONARY_MIN_ROWS` rows
    never have dictionaries).

    Settings chosen for speed and size (:func:`encoding_plan`): dictionaries for the
    columns with few distinct values (but integers of a dense range),
    ``DELTA_BINARY_PACKED`` for the other integer-like columns, LZ4 (``LZ4_RAW``)
    for everything but delta-encoded columns; statistics only for ``_time`` (min/max
    time of the part); decimals of precision up to 18 stored as integers; about
    :data:`ROW_GROUPS_PER_PART` row groups (of at least :data:`ROW_GROUP_MIN_ROWS` rows)
    so that key-range reads can skip some; the Arrow schema stored so that types such as
    ``large_string`` or time zones round-trip.

    Raises:
        InvalidUsage: pyarrow cannot encode the table.
    """
    sink = pa.BufferOutputStream()
    stats: bool | list[str] = [TIME] if TIME in table.column_names else False
    dictionary, encoding, compression = encoding_plan(table) if plan is None else plan
    if dictionary and table.num_rows <= _DICTIONARY_MIN_ROWS:
        dictionary = []
    try:
        pq.write_table(
            table,
            sink,
            # LZ4 (Parquet's LZ4_RAW): as fast to write as snappy and as small, and
            # its parts decode ~30% faster (lineitem) than snappy's.
            compression=compression,
            use_dictionary=dictionary,
            column_encoding=encoding or None,
            write_statistics=stats,
            store_schema=True,
            # Decimals of precision <= 18 as INT32/INT64 (as delta-rs and pyiceberg write
            # them): they decode ~1.7x faster than fixed-length byte arrays.
            store_decimal_as_integer=True,
            # Several row groups per big part, so that a key-range read decodes only
            # the ones its range overlaps (persist.fetch.stream_snapshot).
            row_group_size=max(ROW_GROUP_MIN_ROWS, -(-table.num_rows // ROW_GROUPS_PER_PART)),
            memory_pool=_scratch_pool(),
        )
    except (pa.ArrowException, ValueError, TypeError) as e:
        raise InvalidUsage(f"cannot encode part as Parquet: {e}") from None
    return bytes(sink.getvalue())


_PARQUET_MAGIC = b"PAR1"
_IPC_STREAM_MAGIC = b"\xff\xff\xff\xff"
#: The first bytes of a compressed inline part: then the Arrow IPC stream's length in
#: bytes (4 bytes, little-endian) and the stream as one zstd frame.
INLINE_ZSTD_MAGIC = b"PZI1"
#: The first bytes of a schema-less inline part: then the length in bytes of its Arrow
#: IPC record batch messages (4 bytes, little-endian), a digest of the schema they were
#: written with (the shard's updates schema of the part's schema version; see
#: :func:`_schema_digest`), and those messages as one zstd frame. The
#: stream's schema message and end-of-stream marker are left out: the reader gives the
#: schema (:func:`bare_inline_batches`), and a schema whose digest differs is refused.
INLINE_BARE_MAGIC = b"PZS1"
#: The header of a schema-less inline part: magic, length, schema digest.
_BARE_HEADER = 16
#: The longest IPC stream a compressed inline part may announce (a guard against a
#: corrupt length; inline parts are a few KiB).
INLINE_MAX_STREAM_BYTES = 64 * _MIB
#: The zstd level of inline parts: a one-row flights part's 2,840-byte stream becomes
#: 1,012 bytes in about 16 us (level 3: 960 bytes, 19 us).
_INLINE_LEVEL = 1
#: The options of inline parts' Arrow IPC streams: pyarrow's defaults (metadata V5, no
#: legacy format), made once (``pa.ipc.new_stream`` reads two environment variables
#: for them on every call, about a sixth of a one-row part's encoding).
_IPC_OPTIONS = pa.ipc.IpcWriteOptions()
#: The end-of-stream marker of an Arrow IPC stream (a continuation token, then a
#: zero length: the Arrow columnar format's "Streaming format").
_IPC_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"
#: The schema messages of the last few schemas encoded: ``(schema, message, digest)``
#: (the first 8 bytes of the message's SHA-256).
_SCHEMA_MESSAGES: tuple[tuple[pa.Schema, bytes, bytes], ...] = ()
_SCHEMA_MESSAGES_KEPT = 8
#: One zstd compression context per thread (``zstandard.ZstdCompressor`` is not
#: thread-safe), reused: ``pyarrow.Codec.compress`` makes and frees a context per call;
#: likewise one decompression context (``d``).
_COMPRESSORS = threading.local()


def _has_dictionary(t: pa.DataType) -> bool:
    """Whether ``t`` is or nests a dictionary type."""
    if pa.types.is_dictionary(t):
        return True
    return any(_has_dictionary(t.field(i).type) for i in range(t.num_fields))


def _schema_message(schema: pa.Schema) -> bytes | None:
    """The IPC schema message of ``schema`` (cached for the last few schemas, compared
    by value, metadata included), or ``None`` when a stream of it needs more than a
    schema and record batch messages (dictionary-encoded columns: their dictionaries
    are messages of their own)."""
    found = _schema_entry(schema)
    return None if found is None else found[0]


def _schema_digest(schema: pa.Schema) -> bytes:
    """The first 8 bytes of the SHA-256 of a canonical text of ``schema``'s columns: the
    JSON list of ``[name, type, nullable]`` per column, in order (``type`` as pyarrow
    prints it, e.g. ``timestamp[us, tz=UTC]``). Metadata is left out (record batch messages do
    not depend on it: a reader whose schema differs only in metadata reads the part),
    and so is pyarrow's serialization of the schema, which a pyarrow release may change
    without changing the schema."""
    text = json.dumps([[f.name, str(f.type), f.nullable] for f in schema])
    return hashlib.sha256(text.encode("utf-8")).digest()[:8]


def _schema_entry(schema: pa.Schema) -> tuple[bytes, bytes] | None:
    """``(message, digest)`` of ``schema`` (:func:`_schema_message`,
    :func:`_schema_digest`), or ``None`` (dictionary columns)."""
    global _SCHEMA_MESSAGES
    known = _SCHEMA_MESSAGES
    for s, cached, digest in known:
        if s is schema or s.equals(schema, check_metadata=True):
            return cached, digest
    if any(_has_dictionary(f.type) for f in schema):
        return None
    message: bytes = schema.serialize().to_pybytes()
    digest = _schema_digest(schema)
    # Replaced whole (threads may be reading the old tuple).
    _SCHEMA_MESSAGES = ((schema, message, digest), *known[: _SCHEMA_MESSAGES_KEPT - 1])
    return message, digest


def _ipc_stream(table: pa.Table) -> pa.Buffer:
    """The Arrow IPC stream of ``table`` (pyarrow's ``RecordBatchStreamWriter`` with
    default options, one record batch per chunk).  For a schema without dictionaries it
    is put together from the cached schema message and each chunk's record batch
    message (``RecordBatch.serialize``), the very bytes the writer writes (checked in
    tests/persist/test_parts.py) without its set-up and schema serialization per call."""
    schema = table.schema
    message = _schema_message(schema)
    if message is None:
        sink = pa.BufferOutputStream()
        with pa.ipc.RecordBatchStreamWriter(sink, schema, options=_IPC_OPTIONS) as writer:
            writer.write_table(table)
        return sink.getvalue()
    pieces: list[bytes | pa.Buffer] = [message]
    pieces.extend(b.serialize() for b in table.to_batches())
    pieces.append(_IPC_EOS)
    return pa.py_buffer(b"".join(pieces))


def _compress(stream: pa.Buffer) -> bytes:
    """``stream`` as one zstd frame at :data:`_INLINE_LEVEL`, with its content size (as
    ``pyarrow.Codec("zstd").compress`` writes it) and zstd's content checksum (4 bytes,
    checked by every decompression), by this thread's reused context.

    The checksum is what catches damage to an inline part at rest: a state entry names
    an inline part by its bytes alone, without their SHA-256
    (:meth:`persist.types.PartRef.to_json`); parts written before it carry none and are
    checked by the SHA-256 their entries hold."""
    c = getattr(_COMPRESSORS, "c", None)
    if c is None:
        c = _COMPRESSORS.c = zstandard.ZstdCompressor(level=_INLINE_LEVEL, write_checksum=True)
    frame: bytes = c.compress(stream)
    return frame


def encode_inline_part(table: pa.Table, schema: pa.Schema | None = None) -> bytes:
    """Encode a small part to be kept inline in the shard state: an Arrow IPC stream,
    compressed whole with zstd behind :data:`INLINE_ZSTD_MAGIC` and the stream's length;
    or, when ``schema`` is given and ``table``'s schema equals it exactly (names, types,
    nullability, schema and field metadata), only the stream's record batch messages,
    behind :data:`INLINE_BARE_MAGIC`, their length and the schema's digest: its reader
    must then give that schema (:func:`persist.decoding.decode_part`).

    ``schema`` is the shard's updates schema of the part's schema version
    (:meth:`persist.updates.SchemaHistory.updates_schema` of ``PartRef.schema_id``),
    which every reader knows. The schema message is most of a tiny part: a one-row
    flights part is 1,007 bytes with it and 518 without (its record batch message is
    1,672 bytes before zstd, 1,176 of them metadata: each column's buffer offsets).

    A one-row flights part encodes in about 40 us and decodes in about 40 us this way,
    against about 400 us and 320 us as Parquet (whose writer and reader set-up dominates
    for a few rows). Compressing the stream makes a one-row flights part 2.8 times
    smaller than the plain stream (1,020 bytes against 2,840). :func:`decode_part` tells
    the formats apart by their magic bytes (and still reads plain IPC streams). Blob
    parts are always Parquet.

    Raises:
        InvalidUsage: pyarrow cannot encode the table.
    """
    return encode_inline_part_stream(table, schema)[0]


def encode_inline_part_stream(
    table: pa.Table, schema: pa.Schema | None = None
) -> tuple[bytes, pa.Buffer]:
    """:func:`encode_inline_part`, and the whole Arrow IPC stream it compressed (or
    whose record batch messages it compressed; reading the stream back gives the table
    without copying, in buffers of the stream's size).

    Raises:
        InvalidUsage: pyarrow cannot encode the table.
    """
    try:
        stream = _ipc_stream(table)
    except (pa.ArrowException, ValueError, TypeError) as e:
        raise InvalidUsage(f"cannot encode inline part as Arrow IPC: {e}") from None
    size = int(stream.size)
    if size > INLINE_MAX_STREAM_BYTES:
        raise InvalidUsage(
            f"an inline part's Arrow IPC stream may be at most {INLINE_MAX_STREAM_BYTES} "
            f"bytes, got {size}"
        )
    if schema is not None and (
        table.schema is schema or table.schema.equals(schema, check_metadata=True)
    ):
        entry = _schema_entry(schema)
        if entry is not None:
            message, digest = entry
            # The stream is that very message, the batches' messages and the marker.
            batches = memoryview(stream)[len(message) : size - len(_IPC_EOS)]
            head = INLINE_BARE_MAGIC + len(batches).to_bytes(4, "little") + digest
            return head + _compress(batches), stream
    return INLINE_ZSTD_MAGIC + size.to_bytes(4, "little") + _compress(stream), stream


def inline_stream(data: bytes) -> bytes | pa.Buffer:
    """The Arrow IPC stream of an inline part's bytes (decompressed if they carry
    :data:`INLINE_ZSTD_MAGIC`, else as given: a plain stream of older versions).

    Raises:
        ValueError: a compressed form whose announced length is out of bounds or whose
            frame does not decompress to exactly that many bytes.
    """
    if data[:4] != INLINE_ZSTD_MAGIC:
        return data
    if len(data) < 8:
        raise ValueError("truncated compressed inline part header")
    return _decompress(data, 8)


def _decompress(data: bytes, start: int) -> pa.Buffer:
    """The zstd frame of ``data`` from ``start``, of the length ``data[4:8]`` announces,
    by this thread's reused ``zstandard`` context (a third of ``pyarrow.Codec``'s time
    for a one-row part, which makes a context per call)."""
    n = int.from_bytes(data[4:8], "little")
    if n > INLINE_MAX_STREAM_BYTES:
        raise ValueError(f"compressed inline part announces {n} bytes, more than allowed")
    d = getattr(_COMPRESSORS, "d", None)
    if d is None:
        d = _COMPRESSORS.d = zstandard.ZstdDecompressor()
    try:
        out = d.decompress(memoryview(data)[start:], max_output_size=n)
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd frame does not decompress: {e}") from None
    if len(out) != n:
        raise ValueError(f"zstd frame decompresses to {len(out)} bytes, not the {n} announced")
    return pa.py_buffer(out)


def bare_inline_batches(data: bytes, schema: pa.Schema) -> list[pa.RecordBatch]:
    """The record batches of a schema-less inline part (:data:`INLINE_BARE_MAGIC`)
    written with ``schema``, read with it (``pyarrow.ipc.read_record_batch``: no schema
    message to parse, half the time of reading the whole stream for a one-row part).

    Raises:
        ValueError: a truncated header, a bad length or frame, or ``schema`` is not the
            one the part was written with (its digest differs), or has dictionaries.
        pyarrow.ArrowException: the messages are not record batches of ``schema``.
    """
    if len(data) < _BARE_HEADER:
        raise ValueError("truncated schema-less inline part header")
    entry = _schema_entry(schema)
    if entry is None:
        raise ValueError("a schema with dictionary columns cannot read a schema-less part")
    digest = entry[1]
    if data[8:16] != digest:
        raise ValueError(
            f"was written with another schema (digest {data[8:16].hex()}) than the one "
            f"given to read it ({digest.hex()})"
        )
    messages = _decompress(data, _BARE_HEADER)
    src = pa.BufferReader(messages)
    out = []
    while src.tell() < messages.size:
        message = pa.ipc.read_message(src)
        if message.type != "record batch":
            raise ValueError(f"holds a {message.type} message, not a record batch")
        out.append(pa.ipc.read_record_batch(message, schema))
    return out


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_part_ref(
    key: str | None,
    data: bytes,
    rows: int,
    inline: bool = False,
    stats: tuple[ColumnStats, ...] | None = None,
) -> PartRef:
    """A :class:`PartRef` for the Parquet ``data`` of ``rows`` updates.

    Args:
        key: the blob key the data is (to be) stored at; ignored when ``inline``.
        data: the encoded part.
        rows: number of updates in it.
        inline: keep the bytes in the reference itself (shard state) instead of a blob.
        stats: the part's column statistics (:func:`persist.stats.table_stats` of the
            table encoded), or ``None`` (unknown).

    Raises:
        InvalidUsage: neither a key nor ``inline``; an invalid key.
    """
    if inline:
        return PartRef(
            key=None,
            rows=rows,
            encoded_size_bytes=len(data),
            checksum=_sha256(data),
            inline=bytes(data),
            stats=stats,
            # Its identity (equal bytes may be two parts): 32 random hex digits.
            nonce=os.urandom(16).hex(),
        )
    if key is None:
        raise InvalidUsage("a part that is not inline needs a blob key")
    validate_key(key)
    return PartRef(
        key=key, rows=rows, encoded_size_bytes=len(data), checksum=_sha256(data), stats=stats
    )
