"""Damage to an inline part at rest is caught when it is read (:mod:`persist.encoding`,
:func:`persist.decoding.decode_part`).

A state entry names an inline part by its bytes alone (``{"rows", "inline", ...}``:
its size and SHA-256 are left out of the JSON because they are the bytes' own, see
:meth:`persist.types.PartRef.to_json`), so the stored SHA-256 no longer guards them.
The zstd frame of an inline part carries zstd's content checksum instead: a byte of the
frame changed in the database (or in its base64 text) fails the read with
:class:`~persist.errors.CorruptPart`, never gives other rows.
"""

from __future__ import annotations

import base64

import pyarrow as pa
import pytest

from persist.decoding import decode_part
from persist.encoding import INLINE_BARE_MAGIC, encode_inline_part, make_part_ref
from persist.errors import CorruptPart
from persist.types import PartRef

SCHEMA = pa.schema(
    [
        ("k", pa.int64()),
        ("name", pa.string()),
        ("v", pa.float64()),
        ("_time", pa.uint64(), False),
        ("_diff", pa.int64(), False),
    ]
)
ROW = pa.table(
    {
        "k": [7],
        "name": ["a name long enough to be literal bytes"],
        "v": [2.5],
        "_time": [3],
        "_diff": [1],
    },
    schema=SCHEMA,
)


def _stored(data: bytes) -> PartRef:
    """The part as a state written now holds it (size and checksum left out)."""
    d = make_part_ref(None, data, ROW.num_rows, inline=True).to_json()
    assert "sha256" not in d and "bytes" not in d
    return PartRef.from_json(d)


@pytest.mark.parametrize("bare", [False, True], ids=["with-schema", "schema-less"])
def test_every_changed_byte_of_an_inline_part_fails_its_read(bare: bool) -> None:
    data = encode_inline_part(ROW, SCHEMA if bare else None)
    assert (data[:4] == INLINE_BARE_MAGIC) == bare
    schema = SCHEMA if bare else None
    assert decode_part(data, _stored(data), schema=schema).equals(ROW)
    other_rows = []
    for i in range(len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 0x10
        try:
            back = decode_part(bytes(damaged), _stored(bytes(damaged)), schema=schema)
        except CorruptPart:
            continue
        if not back.equals(ROW):
            other_rows.append(i)
    assert not other_rows, f"bytes {other_rows} of {len(data)} changed the rows silently"


def test_a_changed_base64_character_fails_the_read() -> None:
    data = encode_inline_part(ROW, None)
    d = make_part_ref(None, data, ROW.num_rows, inline=True).to_json()
    text = d["inline"]
    middle = len(text) // 2
    swapped = "A" if text[middle] != "A" else "B"
    damaged = dict(d, inline=text[:middle] + swapped + text[middle + 1 :])
    ref = PartRef.from_json(damaged)
    assert ref.inline is not None and ref.inline != base64.b64decode(text)
    with pytest.raises(CorruptPart, match="<inline>"):
        decode_part(ref.inline, ref)
