"""The durable record of landed appends: did the append with this idempotency token
land, and where?

Every append and every transaction that commits records, in the version that commits
it, a :class:`Landed` record under its idempotency token: the token with the append's
fingerprint (:mod:`persist.fingerprint`: bounds and contents, so the record also says at
which upper it landed; a transaction records ``t<ts>``), the seqno of that version and
the recording process's clock.  The records live in the shard state apart from the
writer leases (``landed/<seqno>`` entries, see :mod:`persist.state_codec` and
:meth:`Landed.entry_json`; states written before them hold ``landed/<digest of the
token>`` entries, read as before and kept under their key): a writer's expiry, a hand-off, GC, or a process whose clock
is ahead by more than every lease never drop them, and appends of other threads through
a shared handle do not push them out as they did the few tokens a writer kept.

The shard keeps the newest :data:`TOKENS_KEPT` records; older ones are pruned oldest
first (by seqno, never by a clock, so a skewed clock cannot prune early), and the state
keeps the *horizon*: the highest seqno of a pruned record (``-1``: none pruned; a state
written before these records existed reads with its own seqno as horizon, since a
writer's lease may have taken the record of any earlier append with it).  So the
question has one of three answers, decided on a version read from consensus
(:func:`verdict`):

* ``LANDED``: the record is there (its fingerprint must be this append's, else the token
  names another append: ``InvalidUsage``);
* ``NOT_LANDED``: no record, and no record of a version after ``lo`` (the seqno of a
  version read before the append's first attempt) was ever pruned;
* ``UNKNOWN``: no record, but one may have been pruned (the horizon is past ``lo``, or
  ``lo`` is unknown: a caller's token retried by a process that did not make the first
  attempt).  The caller gets the indeterminate ``ConsensusError``, never
  ``UpperMismatch`` (which would invite appending the rows a second time).

Invariants kept here: records are immutable; a token has at most one record; the kept
records are exactly the newest :data:`TOKENS_KEPT` by seqno, and every pruned record's
seqno is ``<=`` the horizon, which only grows; no two kept records share an entry key (a
record's key is ``landed/<seqno>``, or its token's digest when another record holds that
seqno, or the key it was read under).

Source of the idea: Materialize's persist-client ``internal/state.rs``, where
``WriterState`` keeps the writer's most recent write token and upper
(``most_recent_write_token``, ``most_recent_write_upper``) and an expired writer's work
is refused; here the record is the shard's, not the writer's, so it outlives the lease.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from persist.errors import ConsensusError
from persist.lease_state import TOKEN_SEP

__all__ = [
    "LANDED",
    "NOT_LANDED",
    "NO_HORIZON",
    "PREFIX",
    "TOKENS_KEPT",
    "UNKNOWN",
    "Landed",
    "OutcomeUnknown",
    "entry_key",
    "record",
    "verdict",
]

#: The entry key prefix of a landed record.
PREFIX = "landed/"
#: How many landed records a shard keeps (the newest, by seqno).
TOKENS_KEPT = 256
#: The horizon of a shard that never pruned a record.
NO_HORIZON = -1
#: :func:`verdict`'s answers.
LANDED, NOT_LANDED, UNKNOWN = "landed", "not landed", "unknown"


@dataclass(frozen=True)
class Landed:
    """The record of one landed append (or transaction).

    Attributes:
        entry: ``token + TOKEN_SEP + fingerprint`` (a transaction's fingerprint is
            ``t<ts>``, the time it committed at).
        seqno: the version that committed it.
        ms: the recording process's clock (ms since the epoch; informational only).
    """

    entry: str
    seqno: int
    ms: int
    _json: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    _key: str | None = field(default=None, compare=False, repr=False)
    _entry: list[Any] | dict[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def token(self) -> str:
        """The idempotency token."""
        return self.entry.split(TOKEN_SEP, 1)[0]

    @property
    def key(self) -> str:
        """Its state entry key: the key it was read under or given by :func:`record`,
        else ``landed/<seqno>`` (computed once)."""
        if self._key is None:
            object.__setattr__(self, "_key", f"{PREFIX}{self.seqno}")
        assert self._key is not None
        return self._key

    def to_json(self) -> dict[str, Any]:
        """``{"entry", "seqno", "ms"}``, the readable document's form (the same dict
        every call: do not mutate it)."""
        if self._json is None:
            object.__setattr__(
                self, "_json", {"entry": self.entry, "seqno": self.seqno, "ms": self.ms}
            )
        assert self._json is not None
        return self._json

    def entry_json(self) -> list[Any] | dict[str, Any]:
        """The value of its state entry: ``[token, fingerprint, seqno, ms]``, or the
        :meth:`to_json` form (some 25 characters longer) for an entry without
        ``TOKEN_SEP`` and for a record read in that form (:meth:`from_entry`: it is
        stored so).  The same object every call: do not mutate it."""
        if self._entry is None:
            token, sep, fp = self.entry.partition(TOKEN_SEP)
            value = [token, fp, self.seqno, self.ms] if sep else self.to_json()
            object.__setattr__(self, "_entry", value)
        assert self._entry is not None
        return self._entry

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Landed:
        """Inverse of :meth:`to_json`."""
        return cls(str(d["entry"]), int(d["seqno"]), int(d["ms"]))

    @classmethod
    def from_entry(cls, key: str, value: Any) -> Landed:
        """The record of the state entry ``key`` (kept as its :attr:`key`) whose value
        is ``value``: :meth:`entry_json`'s form, or :meth:`to_json`'s (states written
        before the short form).

        Raises:
            ValueError, KeyError, TypeError: ``value`` is neither form."""
        if isinstance(value, list):
            token, fp, seqno, ms = value
            rec = cls(f"{token}{TOKEN_SEP}{fp}", int(seqno), int(ms))
        else:  # the earlier form: kept in it (an unchanged record encodes the same)
            rec = cls.from_json(value)
            object.__setattr__(rec, "_entry", rec.to_json())
        object.__setattr__(rec, "_key", key)
        return rec


class OutcomeUnknown(ConsensusError):
    """The indeterminate :class:`~persist.errors.ConsensusError` of an append (or
    transaction) whose outcome the shard state can no longer tell (:data:`UNKNOWN`):
    re-reading will not settle it.  ``idempotency_token`` is the append's token; read
    the shard to see whether its updates are there.  Nothing is written by the call
    that raises it."""

    def __init__(self, token: str, shard_id: str, what: str = "append") -> None:
        super().__init__(
            f"the outcome of the {what} with idempotency token {token!r} on shard "
            f"{shard_id} cannot be learned: the shard no longer holds the record of "
            f"every append that landed since it was first tried (it keeps the newest "
            f"{TOKENS_KEPT}); read the shard to see whether its updates are there",
            indeterminate=True,
        )
        self.idempotency_token = token


def entry_key(token: str) -> str:
    """The digest entry key of ``token``'s record (``landed/`` and 32 hex digits: tokens
    are any printable text): what states before ``landed/<seqno>`` keys used, and the
    key of a record whose seqno another kept record holds."""
    return PREFIX + hashlib.sha256(token.encode()).hexdigest()[:32]


def record(landed: dict[str, Landed], horizon: int, entry: str, seqno: int, ms: int) -> int:
    """Add the record ``entry`` (``token + TOKEN_SEP + fingerprint``) landed at ``seqno``
    to ``landed`` (token -> record, oldest first), pruning the oldest beyond
    :data:`TOKENS_KEPT`; returns the new horizon."""
    token = entry.split(TOKEN_SEP, 1)[0]
    landed.pop(token, None)
    rec = Landed(entry, seqno, ms)
    # One record per version is the rule (one command per version): a second at the
    # same seqno (the newest record, if any) takes its token's digest key instead.
    newest = next(reversed(landed.values()), None)
    if newest is not None and newest.seqno == seqno:
        object.__setattr__(rec, "_key", entry_key(token))
    landed[token] = rec
    while len(landed) > TOKENS_KEPT:
        oldest = next(iter(landed))
        horizon = max(horizon, landed.pop(oldest).seqno)
    return horizon


def verdict(
    landed: Mapping[str, Landed], horizon: int, token: str, lo: int | None
) -> tuple[str, str | None]:
    """What a version (its records ``landed`` and ``horizon``) says of the append with
    ``token`` whose first attempt started after the version with seqno ``lo`` (``None``:
    not known): ``(LANDED, entry)``, ``(NOT_LANDED, None)`` or ``(UNKNOWN, None)`` (see
    the module docstring)."""
    rec = landed.get(token)
    if rec is not None:
        return LANDED, rec.entry
    if horizon == NO_HORIZON or (lo is not None and horizon <= lo):
        return NOT_LANDED, None
    return UNKNOWN, None
