"""Protects: a part read through the inline cache equals its decoded bytes.

The inline cache must answer exactly what decoding the stored bytes gives."""

from decimal import Decimal

import numpy as np
import pyarrow as pa
import pytest

from persist.blob import MemoryBlob
from persist.decoding import INLINE_CACHE, decode_part
from persist.parts import read_parts, write_parts

pytestmark = pytest.mark.adversarial


def _big_table(n: int) -> pa.Table:
    f = pa.field("s", pa.large_string(), metadata={b"x": b"y"})
    return pa.Table.from_arrays(
        [
            pa.array([f"s{i}" if i % 3 else None for i in range(n)], pa.large_string()),
            pa.array(np.arange(n) * 1000, pa.int64()).cast(pa.timestamp("ms", tz="Europe/Paris")),
            pa.array([Decimal(i) / 100 for i in range(n)], pa.decimal128(12, 2)),
            pa.array([bytes([i % 256]) * 3 for i in range(n)], pa.binary(3)),
            pa.array([float(i) if i % 5 else None for i in range(n)], pa.float32()),
            pa.array(np.arange(n, dtype=np.int64)),
            pa.array(np.ones(n, dtype=np.int64)),
        ],
        schema=pa.schema(
            [
                f,
                ("ts", pa.timestamp("ms", tz="Europe/Paris")),
                ("d", pa.decimal128(12, 2)),
                ("fb", pa.binary(3)),
                ("g", pa.float32()),
                pa.field("_time", pa.int64(), nullable=False),
                pa.field("_diff", pa.int64(), nullable=False),
            ]
        ),
    )


@pytest.mark.parametrize("start,length", [(0, 1), (7, 1), (1000, 3), (4999, 1), (10, 0)])
def test_cached_slice_equals_decoded(start: int, length: int) -> None:
    big = _big_table(5000)
    piece = big.slice(start, length)
    blob = MemoryBlob()
    refs = write_parts(blob, piece, "p", inline_max_bytes=1 << 16) if length else []
    if not length:
        return
    assert len(refs) == 1 and refs[0].inline is not None
    ref = refs[0]
    cached = INLINE_CACHE.get(ref)
    decoded = decode_part(ref.inline, ref)
    assert decoded.equals(piece.replace_schema_metadata(None))
    if cached is not None:
        assert cached.schema.equals(decoded.schema, check_metadata=True)
        assert cached.equals(decoded)
    got = read_parts(blob, [ref])
    assert got.equals(decoded)
    assert got.schema.equals(decoded.schema, check_metadata=True)
    got2 = read_parts(blob, [ref], columns=["ts", "s"])
    assert got2.equals(decoded.select(["ts", "s"]))
