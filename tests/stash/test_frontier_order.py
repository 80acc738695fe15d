"""The frontier checks of an append compare the stored options (``stash.base._le``)
without building antichains: the same order as ``Antichain``'s (``{}`` greatest)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from stash.antichain import I64_MAX, I64_MIN, Antichain
from stash.base import _le

opt = st.none() | st.integers(I64_MIN, I64_MAX) | st.integers(-3, 3)


@given(opt, opt)
def test_le_is_the_antichain_order(a: int | None, b: int | None) -> None:
    assert _le(a, b) == (Antichain.from_option(a) <= Antichain.from_option(b))
    assert (a != b) == (Antichain.from_option(a) != Antichain.from_option(b))
