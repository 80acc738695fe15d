"""The texts of a shard log's rows (:mod:`persist.consensus`), built and split
without decoding the state.

A rollup row's text is the canonical JSON object of the state's entries and a diff
row's text ``{"del": [...], "seqno": n, "set": {...}}``; both are built from the
entries' canonical texts (:func:`rollup_text`, :func:`diff_text`): canonical texts
nested under sorted keys are the canonical text of the whole.  :func:`rollup_members`
splits a rollup row back into its entries' texts, so a machine catching up across a
rollup re-encodes and decodes only the entries that changed.

Also here: :func:`entry_text`, the canonical text of one state entry, the way
:func:`stash.codec.canonical_json` writes it but at the cost of one call of the
``json`` module's C encoder for the entries that hold no float.

Invariant kept here: every text built here is canonical JSON (:func:`stash.codec.canonical_json`
of the value it denotes), given canonical entry texts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from json import encoder as _json_encoder
from typing import Any

from stash import StashError
from stash.codec import MAX_ENCODED_BYTES, MAX_JSON_DEPTH, canonical_json

__all__ = ["diff_text", "entry_text", "rollup_members", "rollup_text"]


def _not_json(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} is not JSON")


# The C encoder of canonical_json's options (sorted keys, no spaces, UTF-8 kept, no NaN),
# made once: json.JSONEncoder.encode makes one per call.  None without the C module.
# (c_make_encoder is absent from typeshed's stub.)
_MAKE: Any = getattr(_json_encoder, "c_make_encoder", None)
_C_ENCODE: Callable[[Any, int], list[str]] | None = (
    None
    if _MAKE is None
    else _MAKE(None, _not_json, _json_encoder.encode_basestring, None, ":", ",", True, False, False)
)

# A float's text (``repr``) holds a ``.`` or an exponent with its sign (``1e+16``,
# ``1e-05``), after a digit.
_FLOAT_MARKS = (".", "e+", "e-")


def _may_hold_float(text: str) -> bool:
    """Whether the compact JSON ``text`` (ASCII) may hold a float: a float mark after
    digits that follow ``:``, ``[`` or ``,`` (where a number stands in compact JSON, but
    for a whole text that is a number), or the start of the text.  A false alarm (a
    string holding such characters) only costs the slow path."""
    for mark in _FLOAT_MARKS:
        i = text.find(mark)
        while i != -1:
            j = i
            while j > 0 and "0" <= text[j - 1] <= "9":
                j -= 1
            if j < i:
                if j > 0 and text[j - 1] == "-":
                    j -= 1
                if j == 0 or text[j - 1] in ":[,":
                    return True
            i = text.find(mark, i + 1)
    return False


def entry_text(value: Any) -> str:
    """:func:`stash.codec.canonical_json` of ``value``, a state entry (a JSON value
    whose object keys are all ``str``, as every entry :mod:`persist.state_codec` makes),
    the very same text: one call of the C encoder (``canonical_json`` first walks the
    value in Python, for floats, keys and depth).  The few texts it cannot vouch for
    are made by ``canonical_json`` itself (raising what it raises): those that may
    hold a float (a whole one is written as an integer there), a NUL escape or a
    character beyond ASCII, more than ``MAX_JSON_DEPTH`` brackets, or that are not an
    object, array or string (a top-level number), or too long; and any value the C
    encoder refuses.  A key that is not a ``str`` is the one thing not checked: the
    state codec makes none."""
    if _C_ENCODE is None:
        return canonical_json(value)
    try:
        chunks = _C_ENCODE(value, 0)
    except (TypeError, ValueError, RecursionError):
        return canonical_json(value)
    text = chunks[0] if len(chunks) == 1 else "".join(chunks)
    if (
        text[:1] not in ("{", "[", '"')
        or not text.isascii()
        or "\\u0000" in text
        or len(text) > MAX_ENCODED_BYTES
        or text.count("[") + text.count("{") > MAX_JSON_DEPTH
        or (("." in text or "e+" in text or "e-" in text) and _may_hold_float(text))
    ):
        return canonical_json(value)
    return text


def diff_text(
    prev: Mapping[str, str],
    new: Mapping[str, str],
    seqno: int,
    touched: Collection[str] | None = None,
) -> str:
    """The canonical JSON text of the diff entry turning ``prev`` into ``new`` (entry
    texts by key, both canonical): ``{"del": [removed keys], "seqno": seqno, "set":
    {added or changed key: value}}``.  Built from the entries' texts without decoding
    them: canonical texts nested under sorted keys are the canonical text of the whole
    (the keys were checked to be outside the diffs' namespace by
    :meth:`persist.consensus.Consensus.plan`).
    ``touched``: only these keys may differ (see :meth:`persist.consensus.Consensus.plan`).
    """
    if touched is None:  # every key may have changed
        changed = [k for k, t in new.items() if prev.get(k) != t]
        removed = [k for k in prev if k not in new]
    else:
        changed = [k for k in touched if k in new and prev.get(k) != new[k]]
        removed = [k for k in touched if k in prev and k not in new]
    changed.sort()
    removed.sort()
    # Entry keys are str (as JSON: what canonical_json makes of a str).
    sets = ",".join([f"{_key(k)}:{new[k]}" for k in changed])
    dels = ",".join([_key(k) for k in removed])
    return f'{{"del":[{dels}],"seqno":{seqno},"set":{{{sets}}}}}'


#: The JSON text of a str, as canonical_json writes it (``json``'s own function for
#: strings, without the encoder's Python method around it).
_key: Callable[[str], str] = _json_encoder.encode_basestring


def rollup_text(new: Mapping[str, str]) -> str:
    """The canonical JSON text of a rollup row: the object of the entries ``new``
    (canonical texts by key; canonical texts nested under sorted keys are the canonical
    text of the whole, as in :func:`diff_text`)."""
    return "{" + ",".join([f"{_key(k)}:{new[k]}" for k in sorted(new)]) + "}"


# The C scanner of the json module: (value, end) of the JSON value at an index of a
# text (set by JSONDecoder.__init__; absent from typeshed's stub).
_SCAN: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def rollup_members(
    text: str, prev_texts: Mapping[str, str], prev_data: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, str], set[str]] | None:
    """The entries of a rollup row's ``text`` by key, their canonical texts, and the
    keys whose texts differ from ``prev_texts`` (an older version's entry texts by key,
    whose values are ``prev_data``) or that only the older version has; ``None`` when
    ``text`` is not a compact JSON object of JSON values (no space outside strings, as
    every canonical text: the caller then decodes it in full).

    A member whose text in the row is the older version's (canonical) text is that
    entry, unchanged: its value is ``prev_data``'s, not parsed again (a complete JSON
    value followed by ``,`` or ``}`` is the member's whole value).  Only the other
    members are parsed (the ``json`` module's C scanner) and re-encoded
    (:func:`canonical_json`).  A rollup's text is made of its entries' canonical texts
    (:func:`rollup_text`), so a catch-up across a rollup decodes and re-encodes only
    what changed, never the whole state.
    """
    data: dict[str, Any] = {}
    texts: dict[str, str] = {}
    changed: set[str] = set()
    scan = _SCAN
    get = prev_texts.get
    try:
        if text[:1] != "{":
            return None
        i = 1
        if text[1:2] == "}":
            i = 2
        else:
            while True:
                key, i = scan(text, i)
                if type(key) is not str or text[i] != ":":
                    return None
                i += 1
                old = get(key)
                if old is not None and text.startswith(old, i) and text[i + len(old)] in ",}":
                    data[key] = prev_data[key]
                    texts[key] = old
                    i += len(old)
                else:
                    value, i = scan(text, i)
                    t = canonical_json(value)
                    if t != old:
                        changed.add(key)
                    data[key] = value
                    texts[key] = t
                c = text[i]
                i += 1
                if c == "}":
                    break
                if c != ",":
                    return None
        if i != len(text):
            return None
    except (StopIteration, IndexError, KeyError, ValueError, RecursionError, StashError):
        return None
    changed.update(k for k in prev_texts if k not in texts)
    return data, texts, changed
