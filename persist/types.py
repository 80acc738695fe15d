"""Metadata types shared by persist's modules: batch descriptions, part references and
hollow batches.

Invariants kept here:

* a :class:`Description` satisfies ``lower <= upper`` (as frontiers) and describes the
  updates with ``lower <= time < upper``, whose times may have been advanced to ``since``;
* a :class:`PartRef` names exactly one immutable encoded part: either a blob key
  (``key``, a Parquet object) or inline bytes held in the shard state (``inline``, a
  zstd-compressed Arrow IPC stream; see ``persist.encoding.encode_inline_part``), never
  both; ``checksum`` is the SHA-256 hex digest of the encoded bytes; its ``schema_id``
  names the value schema version it was written with (``0``, omitted from the JSON, for
  parts of states older than schema versions: they were all written with the shard's
  first schema); its
  ``key_samples``, when present, are
  the keys of evenly spaced rows of the part, its first and last row included, encoded
  by :func:`persist.merge.encode_keys` (``None`` for parts written before they existed);
  its ``stats`` (per-column min, max
  and null count, :mod:`persist.stats`) describe exactly the rows of that part, or are
  ``None`` (unknown: states written before statistics existed, inline parts);
* a :class:`HollowBatch` lists its parts grouped into runs: ``runs`` holds the indexes in
  ``parts`` where each run after the first starts, and each run is sorted by
  (key, value, time) and consolidated (one row per distinct (key, value, time), its diff
  never zero: every writer of a run consolidates first), which lets a snapshot of a
  single run at a single time skip consolidation;
* all three are immutable and round-trip through JSON (``to_json`` / ``from_json``); a
  :class:`HollowBatch` computes its JSON once and returns the same (read-only) dict (a
  batch decoded from JSON returns that very JSON, so an entry of an earlier layout
  encodes as stored); an inline part's JSON leaves out its size and checksum when they
  are its bytes' own (computed from them when read).

Source of the idea: persist's ``Description`` and ``HollowBatch`` in Materialize's persist-client
(``src/persist-client/src/internal/trace.rs``, ``src/persist-client/src/batch.rs``).
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from persist.errors import InvalidUsage
from persist.stats import ColumnStats, stats_from_json, stats_to_json
from stash import Antichain


@dataclass(frozen=True)
class Description:
    """The bounds of a batch: updates at times in ``[lower, upper)``, advanced to ``since``.

    Raises:
        ValueError: ``lower`` is not ``<=`` ``upper``.
    """

    lower: Antichain
    upper: Antichain
    since: Antichain = field(default_factory=lambda: Antichain.from_elem(0))

    def __post_init__(self) -> None:
        if not self.lower <= self.upper:
            raise ValueError(f"description lower {self.lower} is not <= upper {self.upper}")

    def to_json(self) -> dict[str, Any]:
        return {
            "lower": self.lower.to_json(),
            "upper": self.upper.to_json(),
            "since": self.since.to_json(),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Description:
        return cls(
            Antichain.from_json(d["lower"]),
            Antichain.from_json(d["upper"]),
            Antichain.from_json(d["since"]),
        )

    def __str__(self) -> str:
        return f"({self.lower}, {self.upper}, {self.since})"


def _sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


#: The prefix of an inline part's :attr:`PartRef.part_id` (never a blob key's: those
#: start with the shard id, ``s`` and a UUID).
INLINE_ID_PREFIX = "inline:"


@dataclass(frozen=True)
class PartRef:
    """A reference to one part: Parquet in the blob store (``key``) or inline (``inline``).

    Attributes:
        key: blob key of the part, or ``None`` for an inline part.
        inline: the bytes of an inline part (zstd-compressed Arrow IPC; older states
            hold a plain IPC stream or Parquet), or ``None``.
        rows: number of updates (rows) in the part.
        encoded_size_bytes: size of the encoded bytes.
        checksum: SHA-256 hex digest of the encoded bytes.
        schema_id: the id of the shard's value schema version the part was written
            with (an index into ``ShardState.schema_history``);
            parts of states written before schemas were versioned read as ``0``.
        key_samples: the encoded keys (:func:`persist.merge.encode_keys`) of up to nine
            evenly spaced rows of the (sorted) part, first and last row included, which
            key-range planning (:func:`persist.merge.plan_ranges`) cuts by; ``None``
            when unknown (parts written before they were recorded).
        stats: per-column ``(column, min, max, nulls)`` of the part's rows
            (:mod:`persist.stats`), or ``None`` when unknown (never pruned).
        nonce: an inline part's identity, 32 random hex digits drawn when it was
            written (a blob part's is its key); ``None`` for blob parts and inline parts
            of older writers.  It lets an append refuse a copy of an inline part the
            shard already holds (see :attr:`part_id`): checksums cannot, since two real
            appends may write equal bytes.
    """

    key: str | None
    rows: int
    encoded_size_bytes: int
    checksum: str
    inline: bytes | None = None
    schema_id: int = 0
    key_samples: tuple[tuple[Any, ...], ...] | None = None
    stats: tuple[ColumnStats, ...] | None = None
    nonce: str | None = None

    def __post_init__(self) -> None:
        if (self.key is None) == (self.inline is None):
            raise ValueError("a part is either in the blob store (key) or inline, exactly one")

    @property
    def part_id(self) -> str | None:
        """The part's identity: its blob key, or ``"inline:" + nonce`` for an inline
        part (``None`` for an inline part of an older writer, which drew no nonce).
        Copies of a batch (its transmittable bytes decoded again) name the same ids;
        two parts written separately never do, even with equal bytes."""
        if self.key is not None:
            return self.key
        return None if self.nonce is None else INLINE_ID_PREFIX + self.nonce

    def to_json(self) -> dict[str, Any]:
        """``{"rows", "bytes", "sha256", "key" | "inline", ...}``: an inline part's
        ``bytes`` and ``sha256`` are left out when they are its bytes' own (the bytes
        are right there: :meth:`from_json` computes them), some 90 characters less in
        every state version that adds one."""
        d: dict[str, Any] = {"rows": self.rows}
        if self.key is not None:
            d["bytes"] = self.encoded_size_bytes
            d["sha256"] = self.checksum
            d["key"] = self.key
        else:
            assert self.inline is not None
            if self.encoded_size_bytes != len(self.inline):
                d["bytes"] = self.encoded_size_bytes
            if self.checksum != _sha256_hex(self.inline):
                d["sha256"] = self.checksum
            d["inline"] = base64.b64encode(self.inline).decode("ascii")
        if self.schema_id:
            d["schema"] = self.schema_id
        if self.key_samples is not None:
            d["keys"] = [list(k) for k in self.key_samples]
        if self.stats is not None:
            d["stats"] = stats_to_json(self.stats)
        if self.nonce is not None:
            d["nonce"] = self.nonce
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PartRef:
        inline = d.get("inline")
        data = None if inline is None else base64.b64decode(inline)
        # An inline part's size and checksum are its bytes' (left out of the JSON since
        # they are computed from them; older states hold them, checked as before).
        sha = d.get("sha256") if data is None or "sha256" in d else _sha256_hex(data)
        size = d["bytes"] if data is None or "bytes" in d else len(data)
        keys = d.get("keys")
        stats = None
        if "stats" in d:
            try:
                stats = stats_from_json(d["stats"])
            except (ValueError, TypeError):
                stats = None  # unreadable statistics are unknown ones: never prune
        return cls(
            key=d.get("key"),
            rows=int(d["rows"]),
            encoded_size_bytes=int(size),
            checksum=str(d["sha256"] if sha is None else sha),
            inline=data,
            schema_id=int(d.get("schema", 0)),
            key_samples=None if keys is None else tuple(tuple(k) for k in keys),
            stats=stats,
            nonce=None if d.get("nonce") is None else str(d["nonce"]),
        )


@dataclass(frozen=True)
class HollowBatch:
    """A batch's metadata plus references to its parts (Materialize's ``HollowBatch``).

    Attributes:
        desc: the batch's :class:`Description`.
        parts: the parts, run after run.
        len: the number of updates (rows) in all parts.
        runs: indexes into ``parts`` where the second, third, ... run begins; a batch
            with one run (or none) has ``runs == ()``.
    """

    desc: Description
    parts: tuple[PartRef, ...] = ()
    len: int = 0
    runs: tuple[int, ...] = ()

    def is_empty(self) -> bool:
        return self.len == 0

    def run_parts(self) -> list[tuple[PartRef, ...]]:
        """The parts split into their runs (each run sorted by key, value, time)."""
        bounds = [0, *self.runs, len(self.parts)]
        return [self.parts[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if a < b]

    @cached_property
    def inline_bytes(self) -> int:
        """The summed encoded size (bytes) of the batch's inline parts."""
        return sum(p.encoded_size_bytes for p in self.parts if p.inline is not None)

    def to_json(self) -> dict[str, Any]:
        """The JSON form; computed once per (immutable) batch and shared by every call,
        so that a state version re-serialises only its new batches: do not mutate it."""
        return self._json

    @cached_property
    def _json(self) -> dict[str, Any]:
        d = {
            "desc": self.desc.to_json(),
            "parts": [p.to_json() for p in self.parts],
            "len": self.len,
        }
        if self.runs:  # one run (or none): left out, read back as ``()``
            d["runs"] = list(self.runs)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HollowBatch:
        """Inverse of :meth:`to_json`; the batch's JSON is then ``d`` itself (read-only
        from here on), so a batch read in an earlier layout (its inline parts'
        ``sha256``, ``"runs": []``) encodes as it is stored."""
        hb = cls(
            desc=Description.from_json(d["desc"]),
            parts=tuple(PartRef.from_json(p) for p in d["parts"]),
            len=int(d["len"]),
            runs=tuple(int(r) for r in d.get("runs", ())),
        )
        hb.__dict__["_json"] = d  # the cached_property's slot
        return hb


def as_frontier(x: Antichain | int, what: str) -> Antichain:
    """``x`` as a frontier (an int ``t`` is ``{t}``).

    Raises:
        InvalidUsage: ``x`` (named ``what``) is neither an Antichain nor an int of the
            i64 range of times.
    """
    if isinstance(x, Antichain):
        return x
    if isinstance(x, bool) or not isinstance(x, int):
        raise InvalidUsage(f"{what} must be an Antichain or an int, got {type(x).__name__}")
    if not -(2**63) <= x < 2**63:
        raise InvalidUsage(f"{what} {x} is outside the i64 range of times")
    return Antichain.from_elem(x)
