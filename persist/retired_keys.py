"""The rows of a shard's retired collection (blob keys a version stopped referencing,
waiting for GC's grace period; see :mod:`persist.consensus`): their keys and the
changes one version makes to them.

Invariant kept here: a row key is ``<blob key>@<seqno>`` (``@`` is never part of a blob
key, so the split is unambiguous), or the blob key alone for rows written before
retirement seqnos were recorded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["RetiredChange", "RetiredKey", "parse_retired", "retired_entry"]


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
        """The retired blob key."""
        return self.entry.rpartition("@")[0] if self.seqno is not None else self.entry


def retired_entry(blob_key: str, seqno: int) -> str:
    """The retired collection's row key for ``blob_key`` retired at ``seqno`` (``@`` is
    never part of a blob key, so the split is unambiguous)."""
    return f"{blob_key}@{seqno}"


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
