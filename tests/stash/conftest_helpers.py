"""Small helpers shared by the stash tests."""

from __future__ import annotations

from typing import Any

from stash import Stash, StashCollection


def tick(stash: Stash, c: StashCollection[Any, Any], entries: list[tuple[Any, Any, int]]) -> None:
    """Append ``entries`` as ``(key, value, diff)`` at the collection's upper, advancing it
    by one (``make_batch`` + ``append_to_batch`` + ``append``)."""
    b = c.make_batch(stash)
    for k, v, d in entries:
        c.append_to_batch(b, k, v, d)
    stash.append([b])
