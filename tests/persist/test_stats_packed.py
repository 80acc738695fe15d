"""Part statistics of short fixed-width strings and binaries: the packed-integer min and
max (``persist.stats._packed_min_max``) are exactly Arrow's ``min_max``, and
``column_stats`` records the same statistics whichever path finds them."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persist import stats
from persist.stats import _packed_min_max, column_stats

#: Characters of one to four UTF-8 bytes, the extremes of byte order among them.
_CHARS = ["\x00", "\x01", "!", "a", "~", "\x7f", "\x80", "é", "ÿ", "€", "\uffff", "𝄞"]


def _fit(chars: list[str], width: int) -> str:
    """A string of exactly ``width`` UTF-8 bytes: ``chars`` while they fit, then ``!``."""
    out = ""
    for ch in chars:
        if len((out + ch).encode()) > width:
            break
        out += ch
    return out + "!" * (width - len(out.encode()))


@st.composite
def _columns(draw: st.DrawFn) -> pa.ChunkedArray | pa.Array:
    width = draw(st.integers(1, 9))
    n = draw(st.integers(1, 40))
    binary = draw(st.booleans())
    if binary:
        values: list[Any] = draw(
            st.lists(st.binary(min_size=width, max_size=width), min_size=n, max_size=n)
        )
    else:
        values = [
            _fit(draw(st.lists(st.sampled_from(_CHARS), max_size=width)), width) for _ in range(n)
        ]
    if draw(st.booleans()) and n > 1:  # one value of another width: not packed
        i = draw(st.integers(0, n - 1))
        values[i] = values[i][:-1]
    t = pa.binary() if binary else pa.string()
    prefix = draw(st.integers(0, 3))
    pad = [b"zz" if binary else "zz"] * prefix
    arr = pa.array(pad + values, t).slice(prefix)  # an offset into a longer array
    if draw(st.booleans()):
        return pa.chunked_array([arr], t)
    return arr


@settings(max_examples=200, deadline=None)
@given(_columns())
def test_packed_min_max_is_arrows_min_max(column: pa.ChunkedArray | pa.Array) -> None:
    saved = stats._PACKED_MIN_ROWS
    stats._PACKED_MIN_ROWS = 1
    try:
        packed = _packed_min_max(column)
        fast = column_stats("c", column)
    finally:
        stats._PACKED_MIN_ROWS = saved
    mm = pc.min_max(column)
    lengths = pc.binary_length(column).to_pylist()
    if len(set(lengths)) == 1 and 1 <= lengths[0] <= stats._PACKED_MAX_WIDTH:
        assert packed is not None
    if packed is not None:
        assert packed[0].equals(mm["min"]) and packed[1].equals(mm["max"])
        assert packed[0].type == column.type
    stats._PACKED_MIN_ROWS = 10**9
    try:
        slow = column_stats("c", column)
    finally:
        stats._PACKED_MIN_ROWS = saved
    assert fast == slow


def test_columns_that_do_not_qualify_are_left_to_arrow() -> None:
    n = stats._PACKED_MIN_ROWS
    assert _packed_min_max(pa.array(["ab"] * n)) is not None
    assert _packed_min_max(pa.array(["ab"] * (n - 1))) is None  # few values
    assert _packed_min_max(pa.array(["ab"] * n + [None])) is None  # a null
    assert _packed_min_max(pa.array(["ab"] * n + ["abc"])) is None  # two widths
    assert _packed_min_max(pa.array(["abcdefghi"] * n)) is None  # too wide
    assert _packed_min_max(pa.array([""] * n)) is None  # empty strings
    assert _packed_min_max(pa.array(["ab"] * n, pa.large_string())) is None
    two = pa.chunked_array([["ab"] * n, ["cd"] * n])
    assert _packed_min_max(two) is None  # several chunks


@pytest.mark.parametrize("t", [pa.string(), pa.binary()])
def test_packed_statistics_of_a_long_column(t: pa.DataType) -> None:
    raw = [b"LGA", b"EWR", b"JFK", b"\xc3\xa9z", b"AB\x00"] * 200
    values: list[Any] = raw if t == pa.binary() else [v.decode() for v in raw]
    col = pa.array(values, t)
    lo, hi = _packed_min_max(col)  # type: ignore[misc]
    assert lo.equals(pc.min_max(col)["min"]) and hi.equals(pc.min_max(col)["max"])
    # The min holds a NUL: no statistics for the string column (the stash's JSON cannot
    # hold one), base64 for the binary one.
    want = None if t == pa.string() else ("c", "QUIA", "w6l6", 0)
    assert column_stats("c", col) == want
    codes = pa.array(["LGA", "EWR", "JFK", "éz"] * 200, t)
    want = ("c", "EWR", "éz", 0) if t == pa.string() else ("c", "RVdS", "w6l6", 0)
    assert column_stats("c", codes) == want
