"""Checking the options given to the ``stash`` and ``persist`` Spark sources.

Spark hands a data source every ``.option(name, value)`` it was given, lower-cased, and
ignores the ones the source does not read: a typo (``diff_colum``) would silently change
what a write stores or a read returns. The sources therefore check every option name
against the set they understand before doing anything, and parse booleans strictly.

Invariants: :func:`check_names` accepts exactly the names it is given (compared
case-insensitively, as Spark passes them) and raises, naming the unknown option and the
closest valid names (:func:`difflib.get_close_matches`), for anything else;
:func:`parse_bool` accepts only ``true``/``false`` (and ``1``/``0``, ``yes``/``no``,
``on``/``off``), any case, and raises for any other text; :func:`redacted_repr` shows
a settings dataclass with every store location passed through :func:`stash.redact`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping

TRUE = ("true", "1", "yes", "on")
FALSE = ("false", "0", "no", "off")


def check_names(
    options: Mapping[str, object],
    valid: Iterable[str],
    what: str,
    error: type[Exception],
) -> None:
    """Raise ``error`` if an option name is not one of ``valid``.

    Args:
        options: the options Spark passed (any mapping; names compared lower-cased).
        valid: the option names the source reads for this operation.
        what: what the options are for, e.g. ``"reading a persist shard"``, used in the
            message.
        error: the exception class to raise (the source's own error type).

    Raises:
        error: an unknown option; the message names it, suggests the closest valid
            names and lists every valid one.
    """
    allowed = sorted({v.lower() for v in valid})
    unknown = sorted(str(k) for k in options if str(k).lower() not in allowed)
    if not unknown:
        return
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name.lower(), allowed, n=2, cutoff=0.6)
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        parts.append(f"{name!r}{hint}")
    raise error(
        f"unknown option{'s' if len(unknown) > 1 else ''} for {what}: {', '.join(parts)}; "
        f"valid options are {', '.join(allowed)}"
    )


def parse_bool(name: str, raw: str | None, default: bool, error: type[Exception]) -> bool:
    """The boolean value of option ``name`` (``default`` when not given or empty).

    Raises:
        error: ``raw`` is not one of the accepted spellings of true or false.
    """
    if raw is None or not str(raw).strip():
        return default
    text = str(raw).strip().lower()
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise error(f"option {name!r} must be true or false, got {raw!r}")


def redacted_repr(obj: object, *locations: str) -> str:
    """The dataclass ``obj``'s repr, its fields named in ``locations`` (stash URLs, blob
    URIs: they may carry credentials) shown through :func:`stash.redact`.  The settings
    the sources pickle into every task embed these locations, and their reprs end up in
    Spark's logs and errors."""
    from stash import redact

    shown = []
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        if not f.repr:
            continue
        value = getattr(obj, f.name)
        text = repr(redact(value)) if f.name in locations and value is not None else repr(value)
        shown.append(f"{f.name}={text}")
    return f"{type(obj).__name__}({', '.join(shown)})"
