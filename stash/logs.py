"""Compare-and-set logs: named sequences of entries, each written only on top of the
entry its writer read, in the stash's table ``logs(name, seqno, rollup, data)`` (read
with plain SQL through the view ``stash_logs(log, seqno, rollup, data)``).

A log's entries are numbered by ``seqno`` from ``0``; the greatest is the log's
**head**.  :func:`write` adds entry ``expected + 1`` (``0`` to an empty log) if the head
is still ``expected``, as ONE conditional ``INSERT ... SELECT ... WHERE (the head) IS
expected``; of two writers expecting the same head, one wins and the other gets
:class:`~stash.errors.LogRaceLost` (on Postgres the later ``INSERT`` fails on the
primary key once the earlier commits, read as the same lost race).  An entry marked
``rollup`` holds a whole value; the entries after it are changes to it, so a reader
needs only the rows from the latest rollup on (:func:`head`).  :func:`truncate` deletes
the entries below a seqno (never the head), as maintenance.

Invariants kept here:

* a write of several log entries together with ordinary stash
  :class:`~stash.collection.AppendBatch` es (:func:`write`, which is
  :meth:`stash.Stash.append` of both) is one database transaction: every head check
  and every batch's lower check pass and all commits, or nothing does (the first failed
  check is raised: :class:`~stash.errors.LogRaceLost` naming the log, or
  :class:`~stash.errors.AppendLowerMismatch` naming the collection);
* a write of log entries alone is the least a commit needs: one conditional ``INSERT``
  per entry and the ``COMMIT`` (no frontier rows, no consolidation), on the connection
  the handle holds for its writes (no pool checkout); a fenced handle's fence check
  rides on the ``INSERT`` (a fenced-out handle gets :class:`~stash.errors.FenceError`
  before any lost race), and on Postgres the ``INSERT`` s of several logs are one
  statement (one data-modifying CTE per log); failures are classified as for :meth:`stash.Stash.append` (a ``COMMIT``
  whose outcome is unknown raises :class:`~stash.errors.IndeterminateError` and drops
  the held connection; transient failures run the transaction again);
* a head only moves forward: entries are never rewritten and :func:`truncate` never
  deletes the head, so a seqno names one entry for the log's life;
* names are data (bound parameters only), validated as collection names.

Source of the idea: Materialize's Postgres consensus (``src/persist/src/postgres.rs``:
``compare_and_set`` as one conditional ``INSERT``, a unique violation read as a lost race,
``truncate`` as a ``DELETE`` below a seqno).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

from stash.collection import AppendBatch, validate_collection_name
from stash.errors import LogRaceLost, StashError
from stash.txn import Txn

__all__ = [
    "LogEntry",
    "LogRaceLost",
    "LogRow",
    "head",
    "head_seqno",
    "names",
    "scan",
    "truncate",
    "write",
]

R = TypeVar("R")


class LogEntry(NamedTuple):
    """One entry to write (:func:`write`).

    Attributes:
        name: the log's name (1 to 255 characters, no control characters).
        expected: the head seqno the entry is written on top of; ``None``: the log must
            be empty.
        seqno: the entry's seqno: ``expected + 1`` (``0`` when ``expected`` is ``None``).
        data: the entry's text.
        rollup: whether the entry holds a whole value (readers start from the latest).
    """

    name: str
    expected: int | None
    seqno: int
    data: str
    rollup: bool = False


class LogRow(NamedTuple):
    """One stored entry of a log: ``seqno``, ``rollup`` and ``data`` (see
    :class:`LogEntry`)."""

    seqno: int
    rollup: bool
    data: str


_MAX_SEQNO = (1 << 63) - 1


class _Stash(Protocol):
    """What this module needs of a :class:`stash.Stash` (which imports this module:
    :meth:`stash.Stash.append` writes log entries with its batches)."""

    def append(self, batches: Iterable[AppendBatch | LogEntry]) -> None: ...

    def _read(self, fn: Callable[[Txn], R], *, codecs: Sequence[Any]) -> R: ...

    def _write(self, fn: Callable[[Txn], R], *, codecs: Sequence[Any]) -> R: ...


def _check_entry(e: object) -> LogEntry:
    if not isinstance(e, LogEntry):
        raise StashError(f"log writes take LogEntry objects, got {type(e).__name__}")
    validate_collection_name(e.name)
    if e.expected is not None and (
        isinstance(e.expected, bool) or not isinstance(e.expected, int) or e.expected < 0
    ):
        raise StashError(f"log {e.name}: expected must be None or an int >= 0, got {e.expected!r}")
    want = 0 if e.expected is None else e.expected + 1
    if isinstance(e.seqno, bool) or e.seqno != want or want > _MAX_SEQNO:
        raise StashError(
            f"log {e.name}: the entry written on top of "
            f"{'an empty log' if e.expected is None else f'seqno {e.expected}'} must have "
            f"seqno {want}, got {e.seqno!r}"
        )
    if not isinstance(e.data, str):
        raise StashError(f"log {e.name}: data must be a str, got {type(e.data).__name__}")
    if not isinstance(e.rollup, bool):
        raise StashError(f"log {e.name}: rollup must be a bool, got {type(e.rollup).__name__}")
    return e


def checked_entries(entries: Sequence[object]) -> list[LogEntry]:
    """``entries`` checked against the rules of :class:`LogEntry`, at most one per log
    (what :meth:`stash.Stash.append` checks before its transaction).

    Raises:
        StashError: naming the log and the rule broken.
    """
    out = [_check_entry(e) for e in entries]
    if len({e.name for e in out}) != len(out):
        raise StashError("a log write names one log twice; write one entry per log")
    return out


def insert_entries(tx: Txn, entries: Sequence[LogEntry]) -> None:
    """Insert checked ``entries`` in the transaction ``tx``, each on top of its expected
    head (one conditional ``INSERT`` each; on Postgres several are one statement,
    ``PgTxn.log_insert_many``).

    Raises:
        LogRaceLost: the first log whose head is not the expected one (the caller's
            transaction then ends without committing anything).
    """
    many = getattr(tx, "log_insert_many", None)  # several at once (Postgres: one statement)
    if many is not None and len(entries) > 1:
        lost = many(entries)
        if lost is not None:
            raise LogRaceLost(entries[lost].name, entries[lost].expected)
        return
    for e in entries:
        if not tx.log_insert(e.name, e.expected, e.seqno, e.rollup, e.data):
            raise LogRaceLost(e.name, e.expected)


def write(stash: _Stash, entries: Iterable[LogEntry], batches: Iterable[AppendBatch] = ()) -> None:
    """Write ``entries`` (each on top of its log's expected head) and append ``batches``
    in ONE transaction, all or nothing: :meth:`stash.Stash.append` of both.

    Args:
        stash: a writable stash.
        entries: at most one per log.
        batches: ordinary append batches committed with them.

    Raises:
        LogRaceLost: a log's head was not the expected one (naming the log).
        AppendLowerMismatch: a batch's lower was not its collection's upper.
        StashError: an entry breaks a rule of :class:`LogEntry`, two entries name one
            log, or anything :meth:`stash.Stash.append` raises (fencing, a readonly
            handle, ...).  In every case nothing is committed.
        IndeterminateError: the ``COMMIT``'s outcome is unknown.
    """
    entries = list(entries)
    for e in entries:  # a LogEntry is told from a batch by its type: refuse others here
        if not isinstance(e, LogEntry):  # (Stash.append checks the entries' rules)
            raise StashError(f"log writes take LogEntry objects, got {type(e).__name__}")
    stash.append([*entries, *batches])


def head(stash: _Stash, name: str) -> list[LogRow]:
    """The entries of log ``name`` from its latest rollup on, oldest first (every entry
    if none is a rollup; ``[]`` for a log with no entry).  The last is the head."""
    validate_collection_name(name)
    return [LogRow(*r) for r in stash._read(lambda tx: tx.log_rows(name, None), codecs=())]


def head_seqno(stash: _Stash, name: str) -> int | None:
    """The head seqno of log ``name`` (one indexed read, no data), ``None`` when the log
    has no entry."""
    validate_collection_name(name)
    return stash._read(lambda tx: tx.log_head_seqno(name), codecs=())


def scan(stash: _Stash, name: str, from_seqno: int = 0) -> list[LogRow]:
    """The entries of log ``name`` with seqno ``>= from_seqno``, oldest first."""
    validate_collection_name(name)
    return [LogRow(*r) for r in stash._read(lambda tx: tx.log_rows(name, from_seqno), codecs=())]


def truncate(stash: _Stash, name: str, before: int) -> int:
    """Delete the entries of log ``name`` with seqno below ``before``, except the head
    (a log never loses its latest entry); return how many were deleted.  Maintenance:
    never part of a :func:`write`."""
    validate_collection_name(name)
    if isinstance(before, bool) or not isinstance(before, int):
        raise StashError(f"log {name}: truncate takes an int seqno, got {before!r}")
    return stash._write(lambda tx: tx.log_truncate(name, before), codecs=())


def names(stash: _Stash) -> list[str]:
    """The names of every log holding an entry, sorted."""
    return stash._read(lambda tx: tx.log_names(), codecs=())
