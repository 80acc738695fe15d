"""Protects: decoding a part returns what was written, for dictionary-read string and
binary columns.

Checks of the dictionary read of string/binary columns (persist.decoding) against
pyarrow's own Parquet reader."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from persist.decoding import decode_part
from persist.encoding import encode_part, make_part_ref

pytestmark = pytest.mark.adversarial


def _ref_decode(data: bytes, columns=None) -> pa.Table:
    return pq.read_table(pa.BufferReader(data), columns=columns).replace_schema_metadata(None)


def _check(table: pa.Table, columns=None) -> None:
    data = encode_part(table)
    ref = make_part_ref("k/x.parquet", data, table.num_rows)
    got = decode_part(data, ref, columns)
    want = table if columns is None else table.select(columns)
    assert got.schema.equals(want.schema), (got.schema, want.schema)
    assert got.equals(want)
    assert got.equals(_ref_decode(data, columns))


N = 5000


def _low_card(n: int, values):
    return [values[i % len(values)] for i in range(n)]


@pytest.mark.parametrize(
    "typ,vals",
    [
        (pa.string(), ["", "a", None, "b\x00c", "é"]),
        (pa.large_string(), ["", "a", None, "zz"]),
        (pa.binary(), [b"", b"\x00", None, b"ab"]),
        (pa.large_binary(), [b"", b"\x00\x01", None]),
        (pa.string(), [None]),
        (pa.large_string(), [None]),
        (pa.string(), [""]),
    ],
)
def test_dictionary_columns_roundtrip(typ, vals) -> None:
    table = pa.table(
        {
            "k": pa.array(np.arange(N), pa.int64()),
            "s": pa.array(_low_card(N, vals), typ),
            "_time": pa.array(np.zeros(N, dtype=np.int64)),
            "_diff": pa.array(np.ones(N, dtype=np.int64)),
        }
    )
    _check(table)
    _check(table, ["s"])
    _check(table, ["s", "k"])


def test_non_nullable_field_roundtrip() -> None:
    schema = pa.schema(
        [pa.field("s", pa.string(), nullable=False), pa.field("_time", pa.int64(), nullable=False)]
    )
    table = pa.table(
        {"s": _low_card(N, ["x", "y", ""]), "_time": np.zeros(N, dtype=np.int64)}, schema=schema
    )
    _check(table)


def test_fallback_chunks_several_row_groups() -> None:
    # The strided sample sees one value; the other rows are long distinct strings, so the
    # dictionary page fills and the rest of the chunk falls back to plain encoding.
    n = 80_000
    step = n // 8192
    vals = [("a" if i % step == 0 else f"{i:0100d}") for i in range(n)]
    vals[5] = None
    table = pa.table(
        {
            "s": pa.array(vals, pa.string()),
            "b": pa.array([v.encode() if v else None for v in vals], pa.large_binary()),
            "_time": pa.array(np.zeros(n, dtype=np.int64)),
        }
    )
    _check(table)
    _check(table, ["b"])
