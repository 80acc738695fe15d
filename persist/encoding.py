"""Encoding of one part: Parquet for blob parts, Arrow IPC for small inline parts.

:func:`encode_part` chooses per column between dictionary, delta and plain encodings;
:func:`encode_inline_part` writes an Arrow IPC stream for parts small enough to live in
the shard's state; :func:`make_part_ref` describes encoded bytes with their SHA-256
checksum (the persist-client batch builder, seed ``004``).

Invariants kept here:

* decoding what :func:`encode_part` or :func:`encode_inline_part` produced gives back the
  table, column types included;
* a :class:`~persist.types.PartRef` from :func:`make_part_ref` carries the SHA-256 of
  exactly the bytes given, and a blob part's key is a valid blob key; the statistics it
  carries are the caller's, computed from the very table encoded.
"""

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

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
#: Tables up to this many in-memory bytes are encoded whole first (as one part if it fits).

#: A part is written as about this many Parquet row groups ...
ROW_GROUPS_PER_PART = 8
#: ... of at least this many rows each.
ROW_GROUP_MIN_ROWS = 16_384

# -------------------------------------------------------------------------- parts


def _dictionary_columns(table: pa.Table) -> list[str]:
    """The columns worth dictionary-encoding: those with few distinct values (under
    ``_DICTIONARY_MAX_DISTINCT`` of a strided sample of ``_DICTIONARY_SAMPLE_ROWS`` rows).
    A column of mostly distinct values would fill a dictionary page and fall back to
    plain encoding, the dictionary work wasted (~15% of encoding lineitem)."""
    n = table.num_rows
    if n <= _DICTIONARY_MIN_ROWS:
        return []
    step = max(1, n // _DICTIONARY_SAMPLE_ROWS)
    sample = table.take(pa.array(np.arange(0, n, step, dtype=np.int64))) if step > 1 else table
    limit = _DICTIONARY_MAX_DISTINCT * sample.num_rows
    return [
        name
        for name, col in zip(sample.column_names, sample.columns, strict=True)
        if pc.count_distinct(col, mode="all").as_py() < limit
    ]


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


def _encoding_plan(table: pa.Table) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """How :func:`encode_part` encodes each column: ``(dictionary columns,
    column_encoding, compression)``.

    * few distinct values (:func:`_dictionary_columns`): dictionary, LZ4;
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
    return dictionary, encoding, compression


def encode_part(table: pa.Table) -> bytes:
    """Encode one part as Parquet bytes.

    Settings chosen for speed and size (:func:`_encoding_plan`): dictionaries for the
    columns with few distinct values, ``DELTA_BINARY_PACKED`` for the other integer-like
    columns, LZ4 (``LZ4_RAW``) for everything but delta-encoded columns; statistics
    only for ``_time`` (min/max time of the part); decimals of precision up to 18 stored
    as integers; about :data:`ROW_GROUPS_PER_PART` row groups (of at least
    :data:`ROW_GROUP_MIN_ROWS` rows) so that key-range reads can skip some; the Arrow schema stored so that types such as ``large_string`` or time
    zones round-trip.

    Raises:
        InvalidUsage: pyarrow cannot encode the table.
    """
    sink = pa.BufferOutputStream()
    stats: bool | list[str] = [TIME] if TIME in table.column_names else False
    dictionary, encoding, compression = _encoding_plan(table)
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
            # the ones its range overlaps (persist.read.stream_snapshot).
            row_group_size=max(ROW_GROUP_MIN_ROWS, -(-table.num_rows // ROW_GROUPS_PER_PART)),
            memory_pool=_scratch_pool(),
        )
    except (pa.ArrowException, ValueError, TypeError) as e:
        raise InvalidUsage(f"cannot encode part as Parquet: {e}") from None
    return bytes(sink.getvalue())


_PARQUET_MAGIC = b"PAR1"
_IPC_STREAM_MAGIC = b"\xff\xff\xff\xff"


def encode_inline_part(table: pa.Table) -> bytes:
    """Encode a small part to be kept inline in the shard state, as an Arrow IPC stream.

    A one-row flights part encodes in about 20 us and decodes in about 30 us this way,
    against about 400 us and 320 us as Parquet (whose writer and reader set-up dominates
    for a few rows); the bytes are also smaller. :func:`decode_part` tells the two
    formats apart by their magic bytes. Blob parts are always Parquet.

    Raises:
        InvalidUsage: pyarrow cannot encode the table.
    """
    sink = pa.BufferOutputStream()
    try:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    except (pa.ArrowException, ValueError, TypeError) as e:
        raise InvalidUsage(f"cannot encode inline part as Arrow IPC: {e}") from None
    return bytes(sink.getvalue())


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
        )
    if key is None:
        raise InvalidUsage("a part that is not inline needs a blob key")
    validate_key(key)
    return PartRef(
        key=key, rows=rows, encoded_size_bytes=len(data), checksum=_sha256(data), stats=stats
    )
