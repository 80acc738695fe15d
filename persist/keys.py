"""The blob key layout of a shard's parts: who wrote a part, and when.

A part written by persist lives at ``<shard_id>/<kind>/<writer_id>-<unix ms>-<uuid>.parquet``:
``kind`` is ``b`` (a writer's batch) or ``c`` (a compaction output), ``writer_id`` is the
id (``w`` + 32 hex digits) under which the writing handle or compactor is registered in
the shard state, ``unix ms`` is the wall-clock time at which the run holding the part
was written (stamped per run, not per builder), ``uuid`` is 32 hex digits.  One flat
directory per shard and kind, so an upload creates no directory; the writer id comes
first so that one listing finds every part of one writer.

Older layouts, still understood (GC treats their keys as owned by no writer):
``<shard_id>/<kind>/<unix ms>-<16 hex>-<uuid>.parquet`` (flat, before writer ids) and
``<shard_id>/<kind>/<unix ms>-<16 hex>[t<5 digits>]/<uuid>.parquet`` (a directory per
batch; the ``t<task>`` form is written by the Spark compaction job).

Invariant kept here: :func:`parse_part_key` recognises exactly the keys these layouts
can produce for the given shard; anything else under a shard's prefix is not persist's
and is never deleted by GC (only reported).

Source of the idea: persist-client names its blobs by writer (``PartialBatchKey`` with a
``WriterKey``) so that GC can tell a live writer's parts from abandoned ones.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

__all__ = [
    "PartKey",
    "key_created_ms",
    "key_writer_id",
    "new_writer_id",
    "parse_part_key",
    "part_name_prefix",
]

_WRITER = r"w[0-9a-f]{32}"
_WRITER_RE = re.compile(_WRITER)
_NEW = re.compile(
    rf"(?P<kind>[bc])/(?P<writer>{_WRITER})-(?P<ms>[0-9]{{1,16}})-[0-9a-f]{{32}}\.parquet"
)
_FLAT = re.compile(r"(?P<kind>[bc])/(?P<ms>[0-9]{1,16})-[0-9a-f]{16}-[0-9a-f]{32}\.parquet")
_DIR = re.compile(
    r"(?P<kind>[bc])/(?P<ms>[0-9]{1,16})-[0-9a-f]{16}(?:t[0-9]{5})?/[0-9a-f]{32}\.parquet"
)


@dataclass(frozen=True)
class PartKey:
    """What a part's blob key says.

    Attributes:
        kind: ``"b"`` (a writer's batch) or ``"c"`` (a compaction output).
        created_ms: unix ms at which the part's run was written.
        writer_id: the writer that wrote it, or ``None`` for the older layouts.
    """

    kind: str
    created_ms: int
    writer_id: str | None


def new_writer_id() -> str:
    """A fresh writer id: ``w`` + 32 hex digits (what :func:`parse_part_key` accepts)."""
    return "w" + uuid.uuid4().hex


def part_name_prefix(writer_id: str, now_ms: int) -> str:
    """The file-name prefix of a run's parts, ``<writer_id>-<unix ms>-`` (the parts are
    ``<shard_id>/<kind>/<prefix><uuid>.parquet``, see :func:`persist.parts.write_parts`).

    Raises:
        ValueError: ``writer_id`` is not a writer id, or ``now_ms`` is negative.
    """
    if not _WRITER_RE.fullmatch(writer_id):
        raise ValueError(f"{writer_id!r} is not a writer id ('w' + 32 hex digits)")
    if now_ms < 0:
        raise ValueError(f"a key's time must be >= 0 ms, got {now_ms}")
    return f"{writer_id}-{now_ms}-"


def parse_part_key(shard_id: str, key: str) -> PartKey | None:
    """Parse a part key of shard ``shard_id`` (any layout above), or ``None`` if
    persist's layouts could not have produced it for this shard."""
    head = shard_id + "/"
    if not key.startswith(head):
        return None
    rest = key[len(head) :]
    m = _NEW.fullmatch(rest)
    if m is not None:
        return PartKey(m["kind"], int(m["ms"]), m["writer"])
    m = _FLAT.fullmatch(rest) or _DIR.fullmatch(rest)
    if m is not None:
        return PartKey(m["kind"], int(m["ms"]), None)
    return None


def key_writer_id(key: str) -> str | None:
    """The writer id a part key names (``None`` for older layouts and foreign keys)."""
    segs = key.split("/")
    if len(segs) != 3:
        return None
    m = _NEW.fullmatch(segs[1] + "/" + segs[2])
    return None if m is None else m["writer"]


def key_created_ms(key: str) -> int | None:
    """The creation time (unix ms) a part key records, any layout and any shard, or
    ``None`` if it records none."""
    segs = key.split("/")
    if len(segs) < 3:
        return None
    name = segs[2]
    if _WRITER_RE.match(name):
        parts = name.split("-")
        return int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else None
    head = name.split("-", 1)[0]
    return int(head) if head.isdigit() else None
