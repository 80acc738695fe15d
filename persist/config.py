"""The persist client's knobs: :class:`PersistConfig`, one frozen value shared by every
handle, the compactor, the maintenance worker and GC of one client.

Invariants kept here: a :class:`PersistConfig` is validated when it is made (a bad knob
raises :class:`~persist.errors.InvalidUsage` naming it and the rule broken, and no
config exists); it never changes afterwards (a changed knob is a new config, made with
:meth:`PersistConfig.replace`, validated again).  The defaults are the client's.

Source of the idea: Materialize's persist-client ``src/persist-client/src/cfg.rs``
(``PersistConfig``: the dynamic knobs a client hands to its handles, apart from the
client itself).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from persist.errors import InvalidUsage

__all__ = ["DEFAULT_TARGET_PART_BYTES", "CompactionMode", "PersistConfig"]

#: How merge requests are answered: by a background thread, by the writer right after
#: its append, or not at all (``persist compact`` / ``Compactor.compact_once``).
CompactionMode = Literal["background", "inline", "off"]

_MIB = 1024 * 1024
#: Default target size of one part, in bytes of in-memory Arrow data.
DEFAULT_TARGET_PART_BYTES = 64 * _MIB


@dataclass(frozen=True)
class PersistConfig:
    """The knobs of one :class:`~persist.client.PersistClient` (see its docstring for
    each): compaction mode; lease durations (seconds); inline and part sizes (bytes);
    worker threads; retry attempts; GC grace and interval (seconds, the interval
    ``None`` for no periodic GC); the piggyback window (seconds); and ``clock``, the
    wall clock in seconds (``time.time``), injectable for tests.

    Raises:
        InvalidUsage: ``compaction`` is not ``"background"``, ``"inline"`` or ``"off"``;
            ``handoff_lease_seconds`` is not ``> 0``.
    """

    compaction: CompactionMode = "background"
    reader_lease_seconds: float = 900.0
    writer_lease_seconds: float = 3600.0
    handoff_lease_seconds: float = 86400.0
    inline_max_bytes: int = 16 * 1024
    inline_total_max_bytes: int = 1024 * 1024
    target_part_bytes: int = DEFAULT_TARGET_PART_BYTES
    write_workers: int = 2
    read_workers: int = 4
    blob_retries: int = 3
    consensus_retries: int = 4
    gc_grace_seconds: float = 3600.0
    gc_interval_seconds: float | None = 300.0
    piggyback_seconds: float = 0.05
    clock: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        if self.compaction not in ("background", "inline", "off"):
            raise InvalidUsage(
                f"compaction must be 'background', 'inline' or 'off', got {self.compaction!r}"
            )
        h = self.handoff_lease_seconds
        if not h > 0:  # also refuses NaN
            raise InvalidUsage(f"handoff_lease_seconds must be > 0 seconds, got {h!r}")

    def replace(self, **changes: Any) -> PersistConfig:
        """A copy with ``changes`` (knob name -> value), validated again.

        Raises:
            InvalidUsage: a bad value (as the constructor); TypeError: an unknown knob.
        """
        return dataclasses.replace(self, **changes)
