"""Stash: durable collections of ``((key, value), time, diff)`` with since and upper
frontiers (Materialize's ``Stash`` trait, ``src/stash/src/lib.rs``).

This package's ``__init__`` is its public face only: it re-exports the public names of
the modules below it.  Invariants kept here: every name in ``__all__`` keeps its import
path (``from stash import Stash``); no module of ``stash`` imports this package back
(``tests/test_layers.py`` checks it), so the modules form layers without a circle:
errors and frontiers; codecs, URLs and the primitive transaction; collection handles;
the :class:`Stash` contract (:mod:`stash.base`, which finds its backends by name);
the backends (:mod:`stash.memory`, :mod:`stash.sql`) and the SQL dialects
(:mod:`stash.sqlite`, :mod:`stash.postgres`).
"""

from stash.antichain import Antichain
from stash.errors import (
    AppendLowerMismatch,
    FenceError,
    IndeterminateError,
    LogRaceLost,
    MigrationRequired,
    PeekSinceUpperError,
    ReadOnlyError,
    StashError,
    UniquenessViolation,
)

__all__ = [
    "Antichain",
    "AppendLowerMismatch",
    "FenceError",
    "IndeterminateError",
    "LogRaceLost",
    "MigrationRequired",
    "PeekSinceUpperError",
    "ReadOnlyError",
    "StashError",
    "UniquenessViolation",
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
