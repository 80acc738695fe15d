"""The storage primitives every stash backend implements, inside one transaction.

A backend gives :class:`stash.base.Stash` a :class:`Txn` per operation; the base class
implements the whole contract (checks, error messages, consolidation rules) once on top
of these primitives.  Invariants a backend must keep:

* everything done through one ``Txn`` commits atomically or not at all;
* a new collection starts with no rows, since ``{0}`` and upper ``{0}``;
* ``None`` stands for the empty frontier in ``frontiers``/``set_upper``/``set_since``;
* keys and values are canonical JSON text (see :mod:`stash.codec`), so text equality is
  value equality (one exception: the values of a whole collection's ``peek_rows``);
* ``codecs`` and ``collection_name`` answer from the statement that read the collection's frontiers
  (or took its lock), so checking a handle's codecs costs no query of its own; in a write
  transaction, once ``lock`` (or ``frontiers``) returned, the codec names cannot change
  until the transaction ends (``set_collection_codecs`` of a concurrent migration waits).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

Row = tuple[str, str, int, int]
"""``(key_json, value_json, time, diff)``."""

KeyProbe = str | tuple[str, ...]
"""What a peek of one key is given: its text, or its candidate texts
(:func:`stash.codec.key_texts`), read in one statement."""

LogRow = tuple[int, bool, str]
"""An entry of a compare-and-set log (:mod:`stash.logs`): ``(seqno, rollup, data)``."""


class Txn(Protocol):
    """Primitive reads and writes of one backend transaction."""

    def lookup_collection(self, name: str) -> tuple[int, str, str] | None:
        """``(id, key_codec, value_codec)`` of the named collection, or ``None``."""
        ...

    def create_collection(self, name: str, key_codec: str, value_codec: str) -> int:
        """Create a collection (no rows, since ``{0}``, upper ``{0}``); return its id."""
        ...

    def list_collections(self) -> list[tuple[str, int, str, str]]:
        """``[(name, id, key_codec, value_codec)]`` of every collection."""
        ...

    def set_collection_codecs(self, cid: int, key_codec: str, value_codec: str) -> None:
        """Record other codec names for a collection (``TypedCollection.migrate``)."""
        ...

    def lock(self, ids: Sequence[int]) -> None:
        """Take write locks on these collections' frontiers, in the given (sorted) order."""
        ...

    def frontiers(self, cid: int) -> tuple[int | None, int | None]:
        """``(since, upper)`` of a collection; ``None`` is the empty frontier."""
        ...

    def codecs(self, cid: int) -> tuple[str, str]:
        """``(key_codec, value_codec)``: the names recorded for a collection now, read
        with its frontiers (no query of its own after ``frontiers`` or ``lock``)."""
        ...

    def collection_name(self, cid: int) -> str:
        """The collection's name, read with its frontiers (as :meth:`codecs`)."""
        ...

    def set_upper(self, cid: int, upper: int | None) -> None: ...

    def set_since(self, cid: int, since: int | None) -> None: ...

    def insert(self, cid: int, rows: Sequence[Row]) -> None:
        """Add rows (no consolidation needed)."""
        ...

    def rows(self, cid: int, key: str | None = None) -> list[Row]:
        """All rows of a collection (of one key if given), in no particular order."""
        ...

    def peek_rows(
        self, cid: int, ts: int, key: KeyProbe | None = None
    ) -> list[tuple[str, str, int]]:
        """``[(key, value, diff)]`` of rows with ``time <= ts``, consolidated by
        ``(key, value)``, zero sums dropped, in no particular order.  ``key`` is one key
        text or a tuple of texts (one key's candidate texts, :func:`stash.codec.key_texts`:
        read in one statement, as an IN list).  Without ``key``
        (a whole collection, read to be decoded), a value may be a non-canonical JSON
        text of the value stored (Postgres: as ``jsonb`` renders it; one value, one
        text); keys, and the values of one key's peek, are canonical."""
        ...

    def consolidate(self, cid: int, since: int | None, keys: Collection[str] | None) -> None:
        """Physically consolidate the collection's rows.  Without ``keys``: every row
        moves to ``max(time, since)``, one row per ``(key, value, time)``, no zero diff,
        so every backend holds the same rows afterwards.  With ``keys`` (after a write of
        those keys): at least the rows of those keys sharing a
        ``(key, value, max(time, since))`` become one row (a lone row may stay at its
        time).  ``since=None`` (the empty frontier) deletes every row.  Sums are exact.

        Raises:
            stash.consolidation.DiffSumOverflow: afterwards the positive or the negative
                diffs of a ``(key, value)`` (of these keys) sum beyond i64.
        """
        ...

    def record_commit_time(self, cid: int, time: int, at_ms: int, forget_before: int) -> None:
        """Record that ``time`` of the collection commits at wall clock ``at_ms`` (Unix
        milliseconds; a time recorded already keeps its first record), and forget the
        records of times before ``forget_before`` (the since: no retention asks for them
        again).  Kept for retentions by duration (:mod:`stash.retention`)."""
        ...

    def newest_time_committed_by(self, cid: int, at_ms: int) -> int | None:
        """The newest recorded time of the collection committed at or before wall clock
        ``at_ms`` (Unix ms), or ``None`` if none is recorded."""
        ...

    def check_fence(self) -> None:
        """Raise :class:`stash.errors.FenceError` if this handle has been fenced."""
        ...

    def stash_id(self) -> str:
        """The identity the stash recorded when it was created (a uuid as 32 hex
        digits), read in this transaction."""
        ...

    # ------------------------------------------------- compare-and-set logs
    def log_insert(
        self, name: str, expected: int | None, seqno: int, rollup: bool, data: str
    ) -> bool:
        """Add entry ``seqno`` to log ``name`` if the log's head (its greatest seqno) is
        ``expected`` (``None``: the log is empty); ``False`` (nothing written) if it is
        not, or if a concurrent transaction added ``seqno`` first.  A ``False`` may leave
        the transaction unusable (Postgres): the caller ends it.  ``seqno`` is
        ``expected + 1`` (``0`` for an empty log), checked by :mod:`stash.logs`."""
        ...

    def log_rows(self, name: str, from_seqno: int | None) -> list[LogRow]:
        """The entries of log ``name`` with seqno ``>= from_seqno``, oldest first;
        ``from_seqno=None``: from the latest rollup entry on (every entry if there is
        none)."""
        ...

    def log_head_seqno(self, name: str) -> int | None:
        """The head (greatest seqno) of log ``name``, ``None`` for a log with no entry."""
        ...

    def log_truncate(self, name: str, before: int) -> int:
        """Delete the entries of log ``name`` before ``before``, never the head; return
        how many were deleted."""
        ...

    def log_names(self) -> list[str]:
        """The names of every log that holds an entry, sorted."""
        ...
