"""Checking a shard's stored data against its state: ``persist fsck``.

:func:`fsck` reads a shard's latest state and verifies that every part it references
exists in the blob store with the recorded size (bytes) and SHA-256 (inline parts are
checked against their recorded size and SHA-256 too); it lists *orphans* (keys under
the shard's prefix that no state references and that are not retired: garbage for GC,
not damage), keys persist's layouts could not have produced (reported, not damage) and,
on a blob store that can tell (``find_symlinks``, a :class:`~persist.blob.FileBlob`),
symbolic links under the shard's prefix (damage: persist never writes one).

Invariants kept here: fsck changes nothing (it only reads, and works on a readonly
stash); a report is ``ok`` exactly when no referenced part is missing, of the wrong
size or checksum, and no symlink was found.

Source of the idea: persist-client's ``persistcli inspect``/admin consistency checks.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

from persist.context import HasContext, PersistContext, as_context
from persist.keys import parse_part_key

__all__ = ["FsckReport", "fsck"]


@dataclass
class FsckReport:
    """What :func:`fsck` found in one shard.

    Attributes:
        shard_id, name: the shard.  seqno: the state version checked.
        checked_parts: parts verified (blob and inline).
        missing: referenced blob keys absent from the blob store.
        wrong_size: ``[key, recorded bytes, stored bytes]`` of referenced parts.
        wrong_checksum: referenced parts whose SHA-256 differs from the recorded one.
        orphans: unreferenced, unretired keys (garbage for GC; not damage).
        retired: retired keys still present (waiting for GC; not damage).
        unrecognized: keys under the shard's prefix that persist could not have written.
        symlinks: symbolic links under the shard's prefix (damage).
        tombstone: the shard was finalized.
    """

    shard_id: str
    name: str
    seqno: int
    checked_parts: int = 0
    missing: list[str] = field(default_factory=list)
    wrong_size: list[list[Any]] = field(default_factory=list)
    wrong_checksum: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    retired: int = 0
    unrecognized: list[str] = field(default_factory=list)
    symlinks: list[str] = field(default_factory=list)
    tombstone: bool = False

    @property
    def ok(self) -> bool:
        """True when no damage was found."""
        return not (self.missing or self.wrong_size or self.wrong_checksum or self.symlinks)

    def damage(self) -> list[str]:
        """One line per damage found (empty when :attr:`ok`)."""
        out = [f"missing part {k}" for k in self.missing]
        out += [
            f"part {k} has {got} bytes, the state says {want}" for k, want, got in self.wrong_size
        ]
        out += [f"part {k} does not match its recorded SHA-256" for k in self.wrong_checksum]
        out += [f"symbolic link {k} under the shard's prefix" for k in self.symlinks]
        return out

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable form (with ``ok``)."""
        d = asdict(self)
        d["ok"] = self.ok
        return d


def _find_symlinks(blob: Any, prefix: str) -> list[str]:
    """Symlinks under ``prefix``, if the blob store (or one it wraps) can list them."""
    seen = 0
    while blob is not None and seen < 8:
        fn = getattr(blob, "find_symlinks", None)
        if callable(fn):
            return list(fn(prefix))
        blob = getattr(blob, "inner", None)
        seen += 1
    return []


def fsck(source: PersistContext | HasContext, shard: str) -> FsckReport:
    """Check a shard (see the module docstring).

    Args:
        source: the client, or its :class:`~persist.context.PersistContext` (its stash
            may be readonly).
        shard: a name, or ``id:<shard id>`` (:meth:`PersistContext.shard_id`).

    Returns: the report; ``report.ok`` is False on damage.

    Raises:
        InvalidUsage: unknown shard.  BlobError, ConsensusError: a store failed (nothing
        can be concluded).
    """
    ctx = as_context(source)
    shard_id = ctx.shard_id(shard)
    # A full read from scratch (never a catch-up from this process's cache): fsck
    # checks what is stored, so it must decode the whole head itself.
    st = ctx.machine(shard_id).fetch()
    report = FsckReport(shard_id, st.name, st.seqno, tombstone=st.tombstone)
    referenced: set[str] = set()
    for b in st.batches():
        for p in b.parts:
            report.checked_parts += 1
            if p.key is None:
                data: bytes | None = p.inline
            else:
                referenced.add(p.key)
                data = ctx.blob.get(p.key)
                if data is None:
                    report.missing.append(p.key)
                    continue
            assert data is not None
            name = p.key or "<inline>"
            if len(data) != p.encoded_size_bytes:
                report.wrong_size.append([name, p.encoded_size_bytes, len(data)])
            elif hashlib.sha256(data).hexdigest() != p.checksum:
                report.wrong_checksum.append(name)
    retired = ctx.consensus.retired(shard_id)
    for key, _size in ctx.blob.list_keys(f"{shard_id}/"):
        if key in referenced:
            continue
        if parse_part_key(shard_id, key) is None:
            report.unrecognized.append(key)
        elif key in retired:
            report.retired += 1
        else:
            report.orphans.append(key)
    report.symlinks = sorted(_find_symlinks(ctx.raw_blob, f"{shard_id}/"))
    return report
