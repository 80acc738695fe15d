"""Canonical JSON text: the one spelling of a JSON value that the stash stores and
compares, its total order, and the fast parse of stored texts.

Invariants kept here:

* :func:`canonical_json` writes one text per JSON value (sorted object keys, no
  insignificant spaces, whole floats as integers, UTF-8 kept), so two values are equal
  for the stash exactly when their texts are equal, as ``jsonb`` compares them;
* it refuses what is not JSON the stash accepts (NaN and infinities, non-str object
  keys, nesting deeper than :data:`MAX_JSON_DEPTH`, a NUL character or a lone surrogate
  in a string, a text larger than :data:`MAX_ENCODED_BYTES`), naming the rule broken;
* :func:`json_sort_key` is a total order over JSON values (null < false < true <
  numbers < strings < arrays < objects);
* :func:`_loads` and :func:`_loads_all` return exactly what ``json.loads`` returns, and
  raise :class:`~stash.errors.StashError` where it raises.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from stash.errors import StashError

MAX_JSON_DEPTH = 64
MAX_ENCODED_BYTES = 16 * 1024 * 1024


def _raise_not_json(value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise StashError(f"value {value!r} is not JSON: NaN and infinities are not allowed")
    raise StashError(f"value of type {type(value).__name__} is not JSON-encodable")


def _scan(value: Any, depth: int) -> bool:
    """Check that ``value`` is JSON the codec accepts (str keys, finite floats, at most
    ``MAX_JSON_DEPTH`` levels: a container at depth ``d`` holds keys and items at depth
    ``d + 1``); return whether it holds a whole float (to be written as an integer).
    Strings are checked later, on the encoded text (see :func:`canonical_json`)."""
    t = type(value)
    items: Any = None
    if t is dict:
        for k in value:
            if type(k) is not str and not isinstance(k, str):
                raise StashError(f"JSON object keys must be strings, got {type(k).__name__}")
        items = value.values()
    elif t is list or t is tuple:
        items = value
    if items is not None:
        if value and depth >= MAX_JSON_DEPTH:
            raise StashError(f"value is nested deeper than {MAX_JSON_DEPTH} levels")
        found = False
        for v in items:
            tv = type(v)
            if tv is str or tv is int or tv is bool or v is None:
                continue
            if _scan(v, depth + 1):
                found = True
        return found
    if t is float:
        if not math.isfinite(value):
            _raise_not_json(value)
        return bool(value.is_integer())
    if t is str or t is int or t is bool or value is None:
        return False
    # Subclasses (IntEnum, str enums, OrderedDict, ...): as their base type.
    if depth > MAX_JSON_DEPTH:
        raise StashError(f"value is nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, dict):
        return _scan(dict(value), depth)
    if isinstance(value, list | tuple):
        return _scan(list(value), depth)
    if isinstance(value, float):
        return _scan(float(value), depth)
    if isinstance(value, str | int):
        return False
    _raise_not_json(value)
    return False  # pragma: no cover - _raise_not_json always raises


def _check_strings(value: Any) -> None:
    """Raise for a NUL character anywhere in ``value``'s strings (keys included)."""
    if isinstance(value, str):
        if "\x00" in value:
            raise StashError("value contains a NUL character (\\u0000), which is not allowed")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k)
            _check_strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            _check_strings(v)


#: The encoder of :func:`canonical_json`, made once (``json.dumps`` with options builds
#: one per call); ``encode`` keeps no state between calls, so threads share it.
_encode = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
).encode


def canonical_json(value: Any) -> str:
    """Canonical JSON text: sorted keys, no spaces, UTF-8 kept, floats that are whole
    numbers written as integers (so ``1.0`` and ``1`` are the same value, as in ``jsonb``,
    which keeps a number's exact decimal).

    One pass in Python checks the structure (and finds whole floats); strings are checked
    on the encoded text, in C: a NUL is always escaped as ``\\u0000`` there (only then
    are the strings searched), and a lone surrogate makes the text unencodable as UTF-8.

    Raises:
        StashError: the value is not JSON (NaN, sets, objects, non-str keys, too deep,
            a NUL character or a lone surrogate in a string, larger than 16 MiB encoded).
    """
    if _scan(value, 0):
        value = _normalize(value)
    try:
        text = _encode(value)
    except (TypeError, ValueError) as e:
        raise StashError(f"value is not JSON-encodable: {e}") from None
    except RecursionError:
        raise StashError(f"value is nested deeper than {MAX_JSON_DEPTH} levels") from None
    if "\\u0000" in text:
        _check_strings(value)
    if not text.isascii():  # a lone surrogate is not ASCII (isascii reads a flag of the str)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise StashError("value contains a lone surrogate, which is not valid UTF-8") from None
    if len(text) > MAX_ENCODED_BYTES:
        raise StashError(f"encoded value is larger than {MAX_ENCODED_BYTES} bytes")
    return text


def _normalize(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        return {k: _normalize(v) for k, v in value.items()}
    return [_normalize(v) for v in value]


def json_sort_key(value: Any) -> tuple[Any, ...]:
    """Total order over JSON values: null < false < true < numbers < strings < arrays <
    objects; arrays lexicographic; objects by their sorted (key, value) items."""
    t = type(value)
    if t is str:
        return (3, value)
    if t is int or t is float:
        return (2, value)
    if t is dict:
        return (5, tuple([(k, json_sort_key(value[k])) for k in sorted(value)]))
    if t is list or t is tuple:
        return (4, tuple([json_sort_key(v) for v in value]))
    if value is None:
        return (0,)
    if t is bool:
        return (1, value)
    # Subclasses of the JSON types.
    if isinstance(value, bool):
        return (1, value)
    if isinstance(value, int | float):
        return (2, value)
    if isinstance(value, str):
        return (3, value)
    if isinstance(value, list | tuple):
        return (4, tuple(json_sort_key(v) for v in value))
    if isinstance(value, dict):
        return (5, tuple((k, json_sort_key(value[k])) for k in sorted(value)))
    return (6, repr(value))


#: The C scanner of the default JSON decoder: ``json.loads`` of a text without
#: surrounding whitespace is exactly ``_scan_once(text, 0)`` parsing the whole text, and
#: calling the scanner directly skips several Python-level calls per value (a 100,000
#: entry ``peek_one`` decodes 200,000 texts).
_scan_once: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def _loads(text: str, codec: str) -> Any:
    """``json.loads(text)``; stored canonical texts take the direct scanner path, any
    other text (whitespace around it, not JSON, not a ``str``) goes through
    ``json.loads``, so values and errors are exactly those of ``json.loads``.

    Raises:
        StashError: the text is not JSON.
    """
    try:
        value, end = _scan_once(text, 0)
        if end == len(text):
            return value
    except (StopIteration, TypeError, ValueError):
        pass
    try:
        return json.loads(text)
    except (TypeError, ValueError) as e:
        raise StashError(f"{codec} codec: stored text is not JSON: {e}") from None


def _loads_all(texts: Sequence[str], codec: str) -> list[Any]:
    """``[_loads(t, codec) for t in texts]`` with the scanner called inline: the same
    values and errors, about three times faster than ``json.loads`` per text (a 100,000
    entry ``peek_one`` decodes 100,000 values this way)."""
    scan = _scan_once
    out: list[Any] = []
    app = out.append
    for t in texts:
        try:
            v, end = scan(t, 0)
            if end == len(t):
                app(v)
                continue
        except (StopIteration, TypeError, ValueError):
            pass
        # A text the scanner did not parse whole takes the checked path (json.loads).
        app(_loads(t, codec))
    return out
