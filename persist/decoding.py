"""Decoding of one part, verified against its checksum, and the inline-part cache.

Invariants kept here:

* :func:`decode_part` never returns data whose SHA-256 differs from the
  :class:`~persist.types.PartRef`'s checksum: it raises
  :class:`~persist.errors.CorruptPart` naming the part's key instead;
* column types come back exactly: ``date64``, ``time32[s]`` and ``timestamp[s]``,
  which Parquet stores otherwise, are restored on decode, and string and binary columns read as
  dictionaries (:func:`_dictionary_columns`) are expanded to their stored type;
* :data:`INLINE_CACHE` answers only a ref carrying the very ``bytes`` object this process
  encoded or already verified, with the table those bytes decode to.
"""

import base64
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from persist.encoding import (
    _IPC_STREAM_MAGIC,
    INLINE_BARE_MAGIC,
    INLINE_ZSTD_MAGIC,
    _sha256,
    bare_inline_batches,
    inline_stream,
)
from persist.errors import CorruptPart, InvalidUsage
from persist.types import PartRef

_MIB = 1024 * 1024
#: Parts at least this large (encoded bytes) are decoded by Arrow's thread pool.
_THREADED_DECODE_MIN_BYTES = 1 * _MIB
#: Parts of at least this many rows read dictionary-encoded string and binary columns as
#: dictionaries (:func:`_dictionary_columns`); on smaller ones the footer scan costs
#: more than it saves.
_DICTIONARY_READ_MIN_ROWS = 4096


def _part_name(ref: PartRef) -> str:
    return ref.key if ref.key is not None else "<inline>"


class _Stream(NamedTuple):
    """An Arrow IPC stream kept by the inline cache, and the schema it was written with."""

    stream: pa.Buffer
    schema: pa.Schema


_CONTINUATION = b"\xff\xff\xff\xff"
#: The end-of-stream marker of an Arrow IPC stream: a continuation token, a zero length.
_END_OF_STREAM = _CONTINUATION + b"\x00\x00\x00\x00"


def _read_stream(held: _Stream) -> pa.Table:
    """The table of an Arrow IPC stream that this process wrote with ``held.schema``
    (schema metadata dropped), as ``pyarrow.ipc.open_stream(stream).read_all()`` gives it.

    The record batch messages after the schema message are read against the schema in
    hand (``pyarrow.ipc.read_record_batch``), without parsing the schema message again
    or setting up a stream reader: half the time for a one-row part (9 against 19 us),
    read once by the compaction that merges it. A stream holding any other message
    (a dictionary batch) is read by the stream reader.
    """
    stream, schema = held
    size = stream.size
    head = stream[:8].to_pybytes()
    if head[:4] == _CONTINUATION and stream[size - 8 :].to_pybytes() == _END_OF_STREAM:
        # The schema message: a continuation token, the length of its metadata (padded
        # to 8 bytes), the metadata and no body; the stream ends with the end-of-stream
        # marker (the Arrow columnar format's "Encapsulated message format").
        src = pa.BufferReader(stream)
        src.seek(8 + int.from_bytes(head[4:], "little"))
        batches = []
        while src.tell() < size - 8:
            message = pa.ipc.read_message(src)
            if message.type != "record batch":
                break
            batches.append(pa.ipc.read_record_batch(message, schema))
        else:
            table = pa.Table.from_batches(batches, schema)
            return table if schema.metadata is None else table.replace_schema_metadata(None)
    return pa.ipc.open_stream(stream).read_all().replace_schema_metadata(None)


class _InlineCache:
    """Decoded inline parts, by the identity of their bytes (an LRU bounded in Arrow
    bytes), so that a part this process encoded or verified is not parsed again, e.g. by
    the compactor merging the one-row batches its writer just appended.

    An entry holds the very ``bytes`` object of a :class:`PartRef`'s ``inline`` and the
    table those bytes decode to; it answers only a ref carrying that same object. The
    table was either encoded into those bytes (whose SHA-256 the ref was made with) or
    decoded from them after their checksum was verified, so a hit returns exactly what
    decoding the verified bytes would; a ref read anew from consensus (other bytes
    objects) is verified and decoded. Thread-safe.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        # By id of the bytes: (the bytes, the table or the Arrow IPC stream to read it
        # from on first use, the bytes accounted).
        self._entries: OrderedDict[int, tuple[bytes, pa.Table | _Stream, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, ref: PartRef) -> pa.Table | None:
        data = ref.inline
        if data is None:
            return None
        with self._lock:
            entry = self._entries.get(id(data))
            if entry is None or entry[0] is not data:
                return None
            self._entries.move_to_end(id(data))
            held, size = entry[1], entry[2]
        if isinstance(held, pa.Table):
            return held
        # Kept as the stream just encoded (its rows only): read on first use. The table
        # is read without a copy (its buffers are slices of the stream), so it stays
        # accounted as the stream was (measuring its buffers cost ~15 us per one-row
        # part in a compaction, more than reading it).
        table = _read_stream(held)
        self._store(data, table, size, held)
        return table

    def put(self, ref: PartRef, table: pa.Table, stream: pa.Buffer | None = None) -> None:
        """Cache ``table`` as what ``ref``'s inline bytes decode to; ``stream``, if
        given, is the uncompressed Arrow IPC stream of those bytes (written from
        ``table``): then that stream is kept instead, and read (without a copy, against
        ``table``'s schema, :func:`_read_stream`) on the first :meth:`get`, not now.

        The stream holds exactly the part's rows, while ``table`` may be a slice of a
        larger table (a one-row slice of a batch) whose buffers caching it would pin;
        telling the two apart by measuring ``table``'s buffers cost about what reading
        the stream does (12 us for a one-row part of 21 columns), on every write, and a
        part that is never read back (a one-row append that no compaction merges) now
        pays nothing for the cache."""
        data = ref.inline
        if data is None or self.max_bytes <= 0:
            return
        if stream is not None:
            size = 2 * int(stream.size) + len(data)  # the stream, then the table read
            if size <= self.max_bytes // 4:
                self._store(data, _Stream(stream, table.schema), size)
            return
        size = table.get_total_buffer_size() + len(data)
        # The Arrow IPC stream's length (before the zstd of a compressed inline part).
        length = (
            int.from_bytes(data[4:8], "little")
            if data[:4] in (INLINE_ZSTD_MAGIC, INLINE_BARE_MAGIC)
            else len(data)
        )
        if size > 4 * length + 4096 or size > self.max_bytes // 4:
            # Buffers much bigger than the stream (an Arrow IPC stream holds the table's
            # bytes; a Parquet one holds them compressed): most likely a slice of a
            # larger table, and caching it would pin the parent's buffers (copying it
            # costs about what decoding does); or too big.
            return
        self._store(data, table.replace_schema_metadata(None), size)

    def _store(
        self, data: bytes, held: pa.Table | _Stream, size: int, replacing: object = None
    ) -> None:
        """Keep ``held`` for ``data`` (``size`` bytes accounted); with ``replacing``,
        only if the entry of ``data`` still holds that object (the stream a table was
        just read from), else the entry is left as it is."""
        with self._lock:
            old = self._entries.get(id(data))
            if replacing is not None:
                if old is None or old[0] is not data or old[1] is not replacing:
                    return
            if old is not None:
                del self._entries[id(data)]
                self._bytes -= old[2]
            self._entries[id(data)] = (data, held, size)
            self._bytes += size
            while self._bytes > self.max_bytes and self._entries:
                _, (_, _, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0


#: The process-wide cache of decoded inline parts (64 MiB of Arrow data at most).
INLINE_CACHE = _InlineCache(64 * _MIB)


def _maybe_coerced(t: pa.DataType) -> bool:
    """Whether a column read as ``t`` may have been stored as another Arrow type: the
    types Parquet coerces ``date64``, ``time32[s]`` and ``timestamp[s]`` to."""
    return bool(
        pa.types.is_date32(t)
        or pa.types.is_time32(t)
        or (pa.types.is_timestamp(t) and t.unit == "ms")
    )


def _restore_coerced_types(table: pa.Table, pf: pq.ParquetFile) -> pa.Table:
    """Give back the Arrow types that Parquet cannot hold and Arrow's reader does not
    restore from the stored Arrow schema: ``date64`` (written as a 32-bit date),
    ``time32[s]`` and ``timestamp[s]`` with or without a zone (written in
    milliseconds): a column read as one of the types they are coerced to
    (:func:`_maybe_coerced`) is cast to its type in the stored schema. Each cast is checked to be
    exact (Arrow's safe cast: a value that does not fit raises, and is reported as a corrupt part by
    the caller).

    Source: pyarrow's Parquet writer coerces these units (``parquet/arrow/schema.cc``,
    Parquet having no second or 64-bit date logical type); its reader restores only
    what the stored ``ARROW:schema`` lets it."""
    if not any(_maybe_coerced(t) for t in table.schema.types):
        return table
    raw = (pf.metadata.metadata or {}).get(b"ARROW:schema")
    if raw is None:
        return table
    stored = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(raw)))
    for i, f in enumerate(table.schema):
        j = stored.get_field_index(f.name)
        if j < 0:
            continue
        want = stored.field(j).type
        if want != f.type and not pa.types.is_dictionary(f.type):
            table = table.set_column(i, f.with_type(want), table.column(i).cast(want, safe=True))
    return table


def _dictionary_columns(pf: pq.ParquetFile, columns: Sequence[str] | None) -> list[str]:
    """The string and binary columns of ``pf`` (among ``columns``, if given) that every
    row group stores dictionary-encoded (a dictionary page in each column chunk), for
    parts of at least :data:`_DICTIONARY_READ_MIN_ROWS` rows.

    Reading the indices as a ``DictionaryArray`` and expanding it with one take
    (:func:`_expand_dictionaries`) gives the array Arrow's dense read gives, in less
    time (a lineitem part of 333,400 rows, its four low-cardinality string columns so
    read: 35.5 ms against 44.5 ms on one thread; a flights part: 18 against 21 ms). A
    chunk whose later pages fell back to plain encoding (its dictionary page full) is
    still read correctly as a dictionary (Arrow builds one), only more slowly; that is
    rare, since the encoder chooses dictionaries only for columns whose sample has few
    distinct values (:func:`persist.encoding._dictionary_columns`).
    """
    md = pf.metadata
    if md.num_rows < _DICTIONARY_READ_MIN_ROWS or md.num_row_groups == 0:
        return []
    arrow = pf.schema_arrow
    wanted = None if columns is None else set(columns)
    groups = [md.row_group(i) for i in range(md.num_row_groups)]
    out = []
    for j in range(md.num_columns):
        first = groups[0].column(j)
        name = first.path_in_schema
        if first.physical_type != "BYTE_ARRAY" or (wanted is not None and name not in wanted):
            continue
        i = arrow.get_field_index(name)
        if i < 0:
            continue
        t = arrow.field(i).type
        if not (
            pa.types.is_string(t)
            or pa.types.is_large_string(t)
            or pa.types.is_binary(t)
            or pa.types.is_large_binary(t)
        ):
            continue
        if all(g.column(j).has_dictionary_page for g in groups):
            out.append(name)
    return out


def _expand_dictionaries(table: pa.Table, names: Sequence[str], arrow: pa.Schema) -> pa.Table:
    """``table`` with the dictionary columns ``names`` expanded to their type in the
    part's Arrow schema ``arrow`` (values, nulls and nullability unchanged)."""
    for name in names:
        i = table.schema.get_field_index(name)
        if i < 0:
            continue
        col = table.column(i)
        if not pa.types.is_dictionary(col.type):
            continue
        field = arrow.field(name)
        chunks = [c.dictionary_decode() for c in col.chunks]
        dense = pa.chunked_array(
            [c if c.type == field.type else c.cast(field.type) for c in chunks], field.type
        )
        table = table.set_column(i, field, dense)
    return table


def decode_part(
    data: bytes,
    ref: PartRef,
    columns: Sequence[str] | None = None,
    schema: pa.Schema | None = None,
) -> pa.Table:
    """Verify ``data`` against ``ref`` (size, SHA-256, row count) and parse it.

    Args:
        data: the part's bytes (from the blob store or ``ref.inline``).
        ref: the part's reference.
        columns: read only these columns (``None``: all).
        schema: the part's write schema, all its columns (the shard's updates schema of
            ``ref.schema_id``): needed to read a schema-less inline part
            (:data:`persist.encoding.INLINE_BARE_MAGIC`), unused by the other formats.

    Raises:
        CorruptPart: naming ``ref.key`` (or ``"<inline>"``) when the size or checksum
            differs, the bytes are not valid Parquet (or, inline, Arrow IPC), the row
            count differs, a requested column is missing, or ``schema`` is not the one
            a schema-less inline part was written with.
        InvalidUsage: a schema-less inline part and no ``schema``.
    """
    name = _part_name(ref)
    if len(data) != ref.encoded_size_bytes:
        raise CorruptPart(
            name, f"size is {len(data)} bytes, the reference says {ref.encoded_size_bytes}"
        )
    digest = _sha256(data)
    if digest != ref.checksum:
        raise CorruptPart(name, f"SHA-256 {digest} does not match the reference {ref.checksum}")
    bare = data[:4] == INLINE_BARE_MAGIC
    if bare and schema is None:
        raise InvalidUsage(
            f"part {name} (schema version {ref.schema_id}) is stored without its schema: "
            "its reader must give the shard's updates schema of that version"
        )
    if ref.inline is not None and (bare or data[:4] in (INLINE_ZSTD_MAGIC, _IPC_STREAM_MAGIC)):
        try:
            if bare and schema is not None:
                table = pa.Table.from_batches(bare_inline_batches(data, schema), schema)
            else:
                table = pa.ipc.open_stream(pa.BufferReader(inline_stream(data))).read_all()
            if columns is not None:
                table = table.select(list(columns))
        except KeyError:
            missing = [c for c in columns or () if c not in table.column_names]
            raise CorruptPart(name, f"has no column(s) {missing}") from None
        except (pa.ArrowException, OSError, ValueError, IndexError) as e:
            raise CorruptPart(name, f"not readable as Arrow IPC: {str(e)[:300]}") from None
    else:
        try:
            pf = pq.ParquetFile(pa.BufferReader(data))
            dictionary = _dictionary_columns(pf, columns)
            stored = pf.schema_arrow  # the part's types, before any read as dictionary
            if dictionary:
                pf = pq.ParquetFile(
                    pa.BufferReader(data), metadata=pf.metadata, read_dictionary=dictionary
                )
            table = pf.read(
                columns=list(columns) if columns is not None else None,
                # Arrow's column-parallel decoding only pays off on big parts; on small
                # ones its task dispatch costs more than the decoding. (Decoding each of
                # several parts in one of our threads instead was faster on repeated
                # reads, but with mimalloc, Arrow's default allocator, reads right after
                # a write then took up to 5x as long, in pool threads whose memory had
                # been freed by other threads.)
                use_threads=len(data) >= _THREADED_DECODE_MIN_BYTES,
            )
            if dictionary:
                table = _expand_dictionaries(table, dictionary, stored)
            table = _restore_coerced_types(table, pf)
        except (pa.ArrowException, OSError, ValueError, KeyError, IndexError) as e:
            raise CorruptPart(name, f"not readable as Parquet: {str(e)[:300]}") from None
    if table.num_rows != ref.rows:
        raise CorruptPart(name, f"has {table.num_rows} rows, the reference says {ref.rows}")
    if columns is not None and table.num_columns != len(columns):
        missing = [c for c in columns if c not in table.column_names]
        raise CorruptPart(name, f"has no column(s) {missing}")
    return table.replace_schema_metadata(None)
