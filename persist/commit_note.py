"""What a table operation says about the versions it commits: its name, parameters and
row counts (:class:`CommitNote`), carried to the state machine in a context variable.

A :class:`~persist.table.Table` operation (``upsert``, ``restore``, ...) runs the
handles' commands inside :func:`noting`; the machine (:mod:`persist.machine`) reads the
note with :func:`current` when it records the history of a version that changes the
shard's contents (``compare_and_append``, ``commit_txn``), and row-change planning
(:mod:`persist.rows`) sets its counts with :func:`note_rows` before each attempt's
append.  Without a note, versions are recorded under their command's name (``append``,
``txn``, ...) with the counts left unknown.

Invariants kept here: a note is visible only in the thread (context) that set it, and
only while its ``with`` block runs; it is never stored anywhere but in the history
record the machine writes in the same atomic append as the version.

Source of the idea: Delta Lake's ``commitInfo`` action (``operation``,
``operationParameters``, ``operationMetrics``), written with each commit.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

__all__ = [
    "OPERATIONS",
    "CommitNote",
    "current",
    "note_metrics",
    "note_rows",
    "noting",
    "noting_unless_noted",
    "param_text",
]

#: The operations history names (Delta's and pyiceberg's vocabulary, and ``txn``).
OPERATIONS = (
    "create",
    "append",
    "upsert",
    "delete",
    "update",
    "merge",
    "restore",
    "optimize",
    "schema",
    "retention",
    "txn",
)


@dataclass
class CommitNote:
    """The operation a table call is running.

    Attributes:
        op: one of :data:`OPERATIONS`.
        params: JSON-able parameters (e.g. ``{"predicate": "..."}``).
        metrics: JSON-able counts known before the commit (``rows_inserted``,
            ``rows_retracted``); the machine adds what it sees (bytes and parts added).
    """

    op: str
    params: Mapping[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


_NOTE: contextvars.ContextVar[CommitNote | None] = contextvars.ContextVar(
    "persist_commit_note", default=None
)


@contextmanager
def noting(op: str, params: Mapping[str, Any] | None = None) -> Iterator[CommitNote]:
    """Run the block with a :class:`CommitNote` for ``op`` (nested notes: the inner
    one wins inside its block)."""
    note = CommitNote(op, dict(params or {}))
    token = _NOTE.set(note)
    try:
        yield note
    finally:
        _NOTE.reset(token)


@contextmanager
def noting_unless_noted(op: str, params: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Run the block with a note for ``op`` unless a note runs already (a handle's
    ``upsert`` called by a table operation keeps the table's note)."""
    if _NOTE.get() is not None:
        yield
        return
    with noting(op, params):
        yield


def current() -> CommitNote | None:
    """The note of the running table operation, if any."""
    return _NOTE.get()


def note_metrics(metrics: Mapping[str, int]) -> None:
    """Record an operation's own counts for the attempt about to be appended (if a note
    runs), e.g. a merge's ``num_target_rows_updated``."""
    note = _NOTE.get()
    if note is not None:
        note.metrics.update({k: int(v) for k, v in metrics.items()})


def note_rows(inserted: int, retracted: int) -> None:
    """Record the row counts of the attempt about to be appended (if a note runs)."""
    note = _NOTE.get()
    if note is not None:
        note.metrics["rows_inserted"] = int(inserted)
        note.metrics["rows_retracted"] = int(retracted)


def param_text(value: Any) -> str:
    """A parameter's value as text for history: an Arrow scalar as Arrow prints it (a
    nanosecond timestamp beyond Python's ``datetime`` overflows ``str``), else
    ``str(value)``, else its ``repr``."""
    if isinstance(value, pa.Scalar):
        try:
            return str(value.cast(pa.string()).as_py())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            pass
    try:
        return str(value)
    except (OverflowError, ValueError):
        return repr(value)
