"""Stash: durable collections of ``((key, value), time, diff)`` with since and upper
frontiers (Materialize's ``Stash`` trait, ``src/stash/src/lib.rs``)."""

from stash.antichain import Antichain
from stash.errors import (
    AppendLowerMismatch,
    FenceError,
    IndeterminateError,
    MigrationRequired,
    PeekSinceUpperError,
    ReadOnlyError,
    StashError,
)

__all__ = [
    "Antichain",
    "AppendLowerMismatch",
    "FenceError",
    "IndeterminateError",
    "MigrationRequired",
    "PeekSinceUpperError",
    "ReadOnlyError",
    "StashError",
]

from stash.base import Stash  # noqa: E402
from stash.collection import AppendBatch, StashCollection  # noqa: E402
from stash.memory import Memory, MemoryStash  # noqa: E402
from stash.table import TableTransaction  # noqa: E402
from stash.typed import TypedCollection  # noqa: E402
from stash.url import redact  # noqa: E402

__all__ += [
    "AppendBatch",
    "Memory",
    "MemoryStash",
    "Stash",
    "StashCollection",
    "TableTransaction",
    "TypedCollection",
    "redact",
]
