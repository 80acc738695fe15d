"""The leases recorded in a shard's state: :class:`ReaderState` and :class:`WriterState`,
and the idempotency tokens a writer's state records.

Invariants kept here: both are immutable (a command replaces them); a lease is expired
once ``now > last_heartbeat_ms + lease_duration_ms``; a writer's state of a version
written before the shard kept its own landed records (:mod:`persist.landed`) may hold
at most :data:`WRITER_TOKENS_KEPT` tokens of its recent appends, each as ``token`` or
``token + TOKEN_SEP + fingerprint`` (read, never written any more); their JSON forms
round-trip exactly, and states written before a field existed load with its default.

Source: Materialize's persist-client ``LeasedReaderState`` and ``WriterState``
(``src/persist-client/src/internal/state.rs``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from stash import Antichain

__all__ = [
    "TOKEN_FOREIGN",
    "TOKEN_LANDED",
    "TOKEN_NOT_LANDED",
    "TOKEN_SEP",
    "TOKEN_UNKNOWN",
    "WRITER_TOKENS_KEPT",
    "ReaderState",
    "WriterState",
    "token_for",
    "token_lo",
]

#: Separates an idempotency token from the fingerprint of its append in a writer's
#: recorded tokens (a control character: never part of a valid token).
TOKEN_SEP = "\x1f"


@dataclass(frozen=True)
class ReaderState:
    """A leased reader (Materialize's ``LeasedReaderState``).

    Attributes:
        since: the reader's since hold: the shard's since never passes it.
        last_heartbeat_ms: wall-clock time (ms since the epoch) of its last heartbeat.
        lease_duration_ms: the reader is expired once ``now > last_heartbeat_ms +
            lease_duration_ms``.
        purpose: a free-form description (``"read handle"``, ``"listen"``, ...).
        seqno: the reader's seqno hold: it may still read any version from this seqno
            on, so GC keeps every blob key that such a version references (a key retired
            at seqno ``R`` is deleted only once every live reader holds ``>= R``).  It
            only advances.  Versions written before seqno holds existed read as ``0``.
    """

    since: Antichain
    last_heartbeat_ms: int
    lease_duration_ms: int
    purpose: str = ""
    seqno: int = 0

    def expired(self, now_ms: int) -> bool:
        """True when the lease ran out at ``now_ms``."""
        return now_ms > self.last_heartbeat_ms + self.lease_duration_ms

    def to_json(self) -> dict[str, Any]:
        return {
            "since": self.since.to_json(),
            "last_heartbeat_ms": self.last_heartbeat_ms,
            "lease_duration_ms": self.lease_duration_ms,
            "purpose": self.purpose,
            "seqno": self.seqno,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ReaderState:
        return cls(
            Antichain.from_json(d["since"]),
            int(d["last_heartbeat_ms"]),
            int(d["lease_duration_ms"]),
            str(d.get("purpose", "")),
            int(d.get("seqno", 0)),
        )


@dataclass(frozen=True)
class WriterState:
    """A writer (Materialize's ``WriterState``).

    Attributes:
        last_heartbeat_ms: wall-clock time (ms) of its last append or heartbeat.
        lease_duration_ms: the writer is dropped once its lease runs out.
        last_token, tokens: in states written before the shard kept its own landed
            records (:mod:`persist.landed`), the idempotency tokens of the writer's last
            appends (``tokens`` oldest first, at most :data:`WRITER_TOKENS_KEPT` with
            ``last_token``); still read (a record there counts as landed), no longer
            written: ``None`` and ``()`` now.
        handed_off: batches with parts of this writer that its handle had handed out
            (e.g. transmitted to another process,
            :meth:`persist.batch.Batch.into_transmittable`) and not appended itself
            when it expired; ``0`` (omitted from the JSON) while the handle is in use.
            A handed-off writer is kept (for its hand-off lease, see
            :meth:`ShardState.hand_off_writer`) while some of them are outstanding, so
            that GC keeps their parts.
        settled: batches with parts of this writer that other writers appended (or
            whose decoded copies they deleted), before or after the hand-off; the
            writer is dropped once it is handed off and ``settled >= handed_off``.
            ``0`` (omitted from the JSON) at first.
    """

    last_heartbeat_ms: int
    lease_duration_ms: int
    last_token: str | None = None
    tokens: tuple[str, ...] = ()
    handed_off: int = 0
    settled: int = 0
    #: The JSON it was read from (:meth:`from_json`), which :meth:`to_json` gives back:
    #: a writer read in an earlier layout encodes as it is stored until it changes.
    _json: dict[str, Any] | None = field(default=None, init=False, compare=False, repr=False)

    @property
    def outstanding(self) -> int:
        """Handed-off batches neither appended nor deleted yet (``0`` while in use)."""
        return max(0, self.handed_off - self.settled) if self.handed_off else 0

    def expired(self, now_ms: int) -> bool:
        """True when the lease ran out at ``now_ms``."""
        return now_ms > self.last_heartbeat_ms + self.lease_duration_ms

    def token_entry(self, token: str) -> str | None:
        """The recorded entry of an append with ``token`` by this writer
        (``token``, or ``token + TOKEN_SEP + fingerprint``), or ``None``."""
        for entry in (self.last_token, *self.tokens):
            if entry is not None and entry.split(TOKEN_SEP, 1)[0] == token:
                return entry
        return None

    def has_token(self, token: str) -> bool:
        """Whether an append with ``token`` by this writer is recorded."""
        return self.token_entry(token) is not None

    def with_token(self, now_ms: int, lease_ms: int, token: str) -> WriterState:
        """This writer after an append with ``token`` (heartbeat renewed)."""
        older = self.tokens if self.last_token is None else (*self.tokens, self.last_token)
        older = older[-(WRITER_TOKENS_KEPT - 1) :] if WRITER_TOKENS_KEPT > 1 else ()
        return replace(
            self,
            last_heartbeat_ms=max(self.last_heartbeat_ms, now_ms),
            lease_duration_ms=lease_ms,
            last_token=token,
            tokens=older,
        )

    def to_json(self) -> dict[str, Any]:
        """``{"last_heartbeat_ms", "lease_duration_ms", ...}``; the legacy fields only
        when set (``last_token``: states before the landed records wrote it, ``null``
        when unset; left out since, read back as ``None``)."""
        if self._json is not None:
            return self._json
        d: dict[str, Any] = {
            "last_heartbeat_ms": self.last_heartbeat_ms,
            "lease_duration_ms": self.lease_duration_ms,
        }
        if self.last_token is not None:
            d["last_token"] = self.last_token
        if self.tokens:
            d["tokens"] = list(self.tokens)
        if self.handed_off:
            d["handed_off"] = self.handed_off
        if self.settled:
            d["settled"] = self.settled
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> WriterState:
        tok = d.get("last_token")
        w = cls(
            int(d["last_heartbeat_ms"]),
            int(d["lease_duration_ms"]),
            None if tok is None else str(tok),
            tuple(str(t) for t in d.get("tokens", ())),
            int(d.get("handed_off", 0)),
            int(d.get("settled", 0)),
        )
        object.__setattr__(w, "_json", d)
        return w


#: How many idempotency tokens of recent appends a writer's state keeps.
WRITER_TOKENS_KEPT = 8

#: A token persist made (:func:`token_for`): 16 hex digits of the writer's id, 8 of the
#: drawing process, an 8-digit counter and the hex seqno of a version read before the
#: append's first attempt, dot-separated (a form no uuid or plain hex token of a
#: caller's has).  Tokens of earlier versions lack the seqno.
_TOKEN_RE = re.compile(r"[0-9a-f]{16}\.[0-9a-f]{8}\.[0-9a-f]{8}(?:\.(-?[0-9a-f]{1,16}))?")
#: :func:`token_verdict`'s answers.
TOKEN_LANDED, TOKEN_NOT_LANDED, TOKEN_UNKNOWN, TOKEN_FOREIGN = (
    "landed",
    "not landed",
    "unknown",
    "foreign",
)


def token_for(writer_id: str, process: str, count: int, lo: int = -1) -> str:
    """The idempotency token ``count`` drawn by a process (8 hex digits ``process``) for
    ``writer_id`` (``w`` and 32 hex digits), for an append first tried after the version
    with seqno ``lo`` (see :mod:`persist.landed`)."""
    return f"{writer_id[1:17]}.{process}.{count:08x}.{lo:x}"


def token_lo(token: str) -> int | None:
    """The seqno a token of :func:`token_for` carries (``None``: another form)."""
    m = _TOKEN_RE.fullmatch(token)
    if m is None or m.group(1) is None:
        return None
    return int(m.group(1), 16)
