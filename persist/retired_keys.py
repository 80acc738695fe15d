"""The rows of a shard's retired collection (blob keys a version stopped referencing,
waiting for GC's grace period; see :mod:`persist.consensus`): their keys and the
changes one version makes to them.

Invariants kept here: a row key is ``<blob key>@<seqno>`` (``@`` is never part of a blob
key, so the split is unambiguous), or the blob key alone for rows written before
retirement seqnos were recorded; the ids of inline parts one version retires together
(``inline:`` and a nonce of hex digits: a compaction merging several inline parts away)
share rows, up to :data:`INLINE_IDS_PER_ROW` per row, ``inlines:<nonce>,<nonce>,...@<seqno>``
(a prefix no row of one id has; ``,`` is never part of a hex nonce), so a merge of eight
one-row batches writes one row and its indexes rather than eight (and GC later retracts
one).  An id in such a row reads as retired exactly as one in a row of its own; rows of
one id each (written before) read as before.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "INLINE_IDS_PER_ROW",
    "RetiredChange",
    "RetiredKey",
    "parse_retired",
    "retired_entry",
    "retired_ids",
    "retired_rows",
]

#: The most inline part ids one row of the retired collection holds (a row key stays
#: short enough for the collection's key indexes: about 1 KB).
INLINE_IDS_PER_ROW = 32
_INLINE = "inline:"
#: The prefix of a row of several inline ids (``inline:`` is that of a row of one).
_INLINES = "inlines:"
_NONCE = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True)
class RetiredKey:
    """One row of a shard's retired collection.

    Attributes:
        entry: the row's key as stored: ``<blob key>@<seqno>`` (``<blob key>`` alone for
            rows written before retirement seqnos were recorded).
        ms: wall-clock ms of the retirement.
        seqno: the state version that stopped referencing the blob key (versions before
            it reference it), or ``None`` for the older rows.
    """

    entry: str
    ms: int
    seqno: int | None

    @property
    def blob_key(self) -> str:
        """The retired blob key (for a row of several inline ids, ``inlines:`` and their
        nonces: :func:`retired_ids` names each)."""
        return self.entry.rpartition("@")[0] if self.seqno is not None else self.entry


def retired_entry(blob_key: str, seqno: int) -> str:
    """The retired collection's row key for ``blob_key`` retired at ``seqno`` (``@`` is
    never part of a blob key, so the split is unambiguous)."""
    return f"{blob_key}@{seqno}"


def retired_rows(adds: Mapping[str, int], seqno: int) -> dict[str, int]:
    """The retired collection's rows (row key -> retirement ms) that record ``adds``
    (blob key or inline part id -> ms) retired at ``seqno``: a row per blob key, and
    the inline ids of one ms together, sorted, up to :data:`INLINE_IDS_PER_ROW` a row
    (an id whose nonce is not hex digits gets a row of its own)."""
    rows: dict[str, int] = {}
    groups: dict[int, list[str]] = {}
    for k, ms in adds.items():
        nonce = k[len(_INLINE) :] if k.startswith(_INLINE) else None
        if nonce is not None and _NONCE.fullmatch(nonce):
            groups.setdefault(ms, []).append(nonce)
        else:
            rows[retired_entry(k, seqno)] = ms
    for ms, nonces in groups.items():
        nonces.sort()
        for i in range(0, len(nonces), INLINE_IDS_PER_ROW):
            chunk = nonces[i : i + INLINE_IDS_PER_ROW]
            head = _INLINE + chunk[0] if len(chunk) == 1 else _INLINES + ",".join(chunk)
            rows[retired_entry(head, seqno)] = ms
    return rows


def retired_ids(r: RetiredKey) -> list[str]:
    """The blob key or inline part ids the row ``r`` retires."""
    head = r.blob_key
    if head.startswith(_INLINES):
        return [_INLINE + n for n in head[len(_INLINES) :].split(",")]
    return [head]


def parse_retired(entry: str, ms: int) -> RetiredKey:
    """The :class:`RetiredKey` of the row ``entry`` with value ``ms``."""
    head, sep, tail = entry.rpartition("@")
    if sep and tail.isdigit():
        return RetiredKey(entry, ms, int(tail))
    return RetiredKey(entry, ms, None)


@dataclass(frozen=True)
class RetiredChange:
    """Changes to a shard's retired collection made with one version: the collection's
    current upper ``lower`` and the rows (row key, see :class:`RetiredKey`, ->
    retirement ms) to add and remove."""

    lower: int
    adds: Mapping[str, int]
    removes: Mapping[str, int]
