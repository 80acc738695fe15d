"""Shard ids and shard names: how a new :class:`ShardId` string is made and the rules an id
and a name must keep.

Invariants kept here: a shard id is ``"s"`` followed by a lower-case UUID (so ids never
collide with names and are safe in stash collection names and blob keys); a shard name is
1 to 200 characters of letters, digits, ``_``, ``.``, ``=`` and ``-``, starting with a
letter or digit.  Both validators return their argument unchanged or raise
:class:`~persist.errors.InvalidUsage` naming the rule broken.

Source: Materialize's persist-client ``ShardId`` (``src/persist-client/src/lib.rs``), an
``s``-prefixed UUID.
"""

from __future__ import annotations

import re
import uuid

from persist.errors import InvalidUsage

__all__ = ["new_shard_id", "validate_shard_id", "validate_shard_name"]

_SHARD_ID_RE = re.compile(r"s[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_SHARD_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.=-]{0,199}")


def new_shard_id() -> str:
    """A fresh ShardId: ``"s"`` followed by a UUID4."""
    return "s" + str(uuid.uuid4())


def validate_shard_id(shard_id: object) -> str:
    """Return ``shard_id`` if it is a ShardId (``s`` + lower-case UUID).

    Raises:
        InvalidUsage: it is not.
    """
    if not isinstance(shard_id, str) or not _SHARD_ID_RE.fullmatch(shard_id):
        raise InvalidUsage(f"invalid shard id {shard_id!r}: expected 's' followed by a UUID")
    return shard_id


def validate_shard_name(name: object) -> str:
    """Return ``name`` if it is a valid shard name: 1 to 200 characters, starting with a
    letter or digit, then letters, digits, ``_``, ``.``, ``=`` or ``-``.

    Raises:
        InvalidUsage: naming the rule broken.
    """
    if not isinstance(name, str):
        raise InvalidUsage(f"shard name must be a str, got {type(name).__name__}")
    if not _SHARD_NAME_RE.fullmatch(name):
        raise InvalidUsage(
            f"invalid shard name {name!r}: it must be 1 to 200 characters, start with a "
            "letter or digit, and contain only letters, digits, '_', '.', '=' and '-'"
        )
    return name
