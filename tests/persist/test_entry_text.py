"""``persist.log_text.entry_text`` (the state entries' fast canonical encoder) against
``stash.codec.canonical_json``: the very same text for every JSON value with ``str``
keys, and the same error for every value the stash refuses."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persist.log_text import _may_hold_float, diff_text, entry_text, rollup_text
from stash import StashError
from stash.codec import MAX_JSON_DEPTH, canonical_json

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([0.0, -0.0, 1.0, -2.0, 1e16, 1e-5, 1e22, 123456789.0, 0.5])
    | st.text()
    | st.sampled_from(["1.5", ":1.5", "[2e+5", ",3.", "\x00", "é", "\ud800", "e+", "a.b"])
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=24,
)


def _same(value: Any) -> None:
    try:
        want = canonical_json(value)
    except StashError as e:
        with pytest.raises(StashError) as got:
            entry_text(value)
        assert str(got.value) == str(e)
        return
    assert entry_text(value) == want


@settings(max_examples=300, deadline=None)
@given(_json)
def test_entry_text_is_canonical_json(value: Any) -> None:
    _same(value)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "seqno"]), _json, max_size=3), _json)
def test_entry_text_top_level_and_nested(d: dict[str, Any], v: Any) -> None:
    _same(d)
    _same([v, d])
    _same(v)


@pytest.mark.parametrize(
    "value",
    [
        1.0,
        -3.0,
        2.5,
        "x",
        {"a": [1.0]},
        {"a": {"b": -0.0}},
        [1e16],
        {"t": [5, 1e-7]},
        {"n": float("nan")},
        {"n": [math.inf]},
        {"s": "a\x00b"},
        {"s": "\ud800"},
        {"s": "é", "f": 2.0},
        {"o": object()},
        {"b": b"bytes"},
        {"set": {1, 2}},
        {"a": "x" * 40},
    ],
)
def test_entry_text_edge_values(value: Any) -> None:
    _same(value)


def test_entry_text_depth_bound() -> None:
    for depth in range(MAX_JSON_DEPTH - 2, MAX_JSON_DEPTH + 3):
        v: Any = 1
        for _ in range(depth):
            v = [v]
        _same(v)
        w: Any = 1.0
        for _ in range(depth):
            w = {"k": w}
        _same(w)


def test_may_hold_float_finds_every_float_text() -> None:
    for f in [0.5, 1.0, -1.0, 1e16, 1e-5, -2.5e-9, 1e300, 123.0]:
        for text in [f"[{f!r}]", f'{{"a":{f!r}}}', f"[1,{f!r}]", repr(f)]:
            assert _may_hold_float(text), text
    for text in ['{"a":1}', "[1,2,-3]", '{"a":"1.5"}', '"x.y"', '{"k":"e+5"}']:
        assert not _may_hold_float(text), text


_entries = st.dictionaries(
    st.text(max_size=8) | st.sampled_from(["meta", 'a"b', "c\\d", "é", "\x01", "trace/x"]),
    _json,
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(_entries, _entries, st.integers(0, 2**40), st.booleans())
def test_diff_and_rollup_texts_are_canonical(
    prev: dict[str, Any], new: dict[str, Any], seqno: int, with_touched: bool
) -> None:
    """A diff row's and a rollup row's texts, built from entry texts, are the canonical
    JSON of the values they denote (keys written by json's own string encoder)."""
    try:
        pt = {k: canonical_json(v) for k, v in prev.items()}
        nt = {k: canonical_json(v) for k, v in new.items()}
        canonical_json([list(prev), list(new)])  # keys too
    except StashError:
        return  # not storable entries: never texts
    touched = set(pt) | set(nt) if with_touched else None
    changed = {k: json.loads(t) for k, t in nt.items() if pt.get(k) != t}
    removed = sorted(k for k in pt if k not in nt)
    want = canonical_json({"del": removed, "seqno": seqno, "set": changed})
    assert diff_text(pt, nt, seqno, touched) == want
    assert rollup_text(nt) == canonical_json({k: json.loads(t) for k, t in nt.items()})
