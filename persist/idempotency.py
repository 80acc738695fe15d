"""Idempotency tokens of appends and the resolution of an append's unknown outcome.

This module holds what a writer needs to tell whether an append of its own landed:

* :class:`TokenSource` / :func:`checked_token`: a fresh token per append (or the caller's,
  checked), naming the writer that drew it (:func:`persist.lease_state.token_for`);
* :func:`carrying_token`: an indeterminate error leaving a block carries the token, so
  the caller's retry with it stays idempotent;
* :func:`apply_resolving`: a machine command re-applied, with backoff, while its outcome
  is unknown (the command recognises its own committed effect by its token);
* :func:`token_landed`: whether the append a caller's token names landed, decided on a
  freshly fetched shard state by its landed records (:mod:`persist.landed`, kept apart
  from writer leases), never on a cached one; :func:`token_floor`: the version any
  attempt of a token lands after, as far as this process (or the token) knows.

Invariants kept here:

* fresh tokens never repeat: per process 8 random hex digits (drawn again in a forked
  child, which also gets a fresh lock) and a counter;
* a token names one append exactly: a landed entry whose fingerprint differs from the
  append's is refused (``InvalidUsage``, :func:`persist.fingerprint.check_same_append`),
  never taken for a landed retry;
* an outcome that can no longer be learned is reported as an indeterminate
  ``ConsensusError`` (:class:`persist.landed.OutcomeUnknown`), never as "not landed"
  nor as ``UpperMismatch`` (either would invite a double append).

The fingerprints themselves are in :mod:`persist.fingerprint`.  Sources of the idea:
Materialize's ``src/persist-client/src/internal/machine.rs`` (``compare_and_append``
retrying an indeterminate commit with the same idempotency token) and ``write.rs``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from persist.errors import ConsensusError, InvalidUsage, PersistError
from persist.fingerprint import check_same_append
from persist.landed import OutcomeUnknown
from persist.lease_state import TOKEN_LANDED, TOKEN_UNKNOWN, token_for, token_lo
from persist.state_base import token_verdict

if TYPE_CHECKING:
    from persist.machine import ShardMachine

__all__ = [
    "TokenSource",
    "apply_resolving",
    "carrying_token",
    "checked_token",
    "token_floor",
    "token_landed",
    "tokens",
]

_T = TypeVar("_T")


@contextlib.contextmanager
def carrying_token(token: str) -> Iterator[None]:
    """Set ``idempotency_token`` on an indeterminate :class:`PersistError` leaving the
    block (e.g. the writer's registration before an upload), so that the caller's retry
    with it stays idempotent whichever commit's outcome was lost."""
    try:
        yield
    except PersistError as e:
        if e.is_indeterminate() and e.idempotency_token is None:
            e.idempotency_token = token
        raise


class TokenSource:
    """Fresh idempotency tokens without a system call each (:func:`token_for`): the first
    16 hex digits of the writer's id, 8 random ones per process (``os.urandom``, drawn
    again in a forked child), an 8-digit counter and the seqno of a version read before
    the append (so a restarted process retrying with the token knows which pruned
    records could have been its own, :mod:`persist.landed`), dot-separated, so tokens
    never repeat.  A
    forked child gets a fresh lock (:meth:`after_fork_in_child`), so a fork while another
    thread draws a token cannot deadlock the child.  (A ``uuid4`` per append costs a
    ``getrandom`` call, which releases the GIL and so waits for the compactor thread to
    hand it back.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._process = ""
        self._count = 0

    def after_fork_in_child(self) -> None:
        """Make the source usable in a forked child: a fresh lock (the parent's may have
        been held by a thread that does not exist in the child) and new random digits."""
        self._lock = threading.Lock()
        self._pid = -1

    def next(self, writer_id: str, lo: int = -1) -> str:
        """A fresh token of ``writer_id`` (``w`` and 32 hex digits) for an append first
        tried after the version with seqno ``lo`` (carried in the token, see
        :func:`persist.lease_state.token_lo`)."""
        with self._lock:
            pid = os.getpid()
            if pid != self._pid or self._count >= (1 << 32) - 1:
                self._pid, self._process, self._count = pid, os.urandom(4).hex(), 0
            self._count += 1
            return token_for(writer_id, self._process, self._count, lo)


#: The process's token source.
tokens = TokenSource()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=tokens.after_fork_in_child)


def checked_token(token: str | None, writer_id: str, lo: int = -1) -> str:
    """A fresh idempotency token of ``writer_id`` for an append first tried after the
    version with seqno ``lo``, or ``token`` checked.

    Raises:
        InvalidUsage: ``token`` is not a printable str of 8 to 128 characters.
    """
    if token is None:
        return tokens.next(writer_id, lo)
    if not isinstance(token, str) or not 8 <= len(token) <= 128 or not token.isprintable():
        raise InvalidUsage(
            "idempotency_token must be a printable str of 8 to 128 characters "
            "(the one an indeterminate error carried)"
        )
    return token


def apply_resolving(
    apply: Callable[[], _T], *, attempts: int, max_wait: float, shard_id: str
) -> _T:
    """``apply()`` (a machine command), re-applied while its outcome is unknown (the
    command recognises its own committed effect by its token), with tenacity backoff
    (exponential from 5 ms up to ``max_wait`` seconds), at most ``attempts`` times.  Once
    an attempt was indeterminate, a later attempt's consensus failure leaves the outcome
    unknown too (the earlier commit may have landed), so it is retried as well and, at
    the end, reported as indeterminate.

    Raises:
        UpperMismatch (only when the command is known not to have landed), the command's
        errors, ConsensusError (indeterminate when the outcome stays unknown).
    """
    try:
        first: _T = apply()  # the common case, without a retry loop
        return first
    except PersistError as e:
        if not e.is_indeterminate() or attempts <= 1:
            raise

    def retry(e: BaseException) -> bool:
        # The first attempt's commit may have landed: any consensus failure of a
        # later attempt leaves the outcome unknown too (but one that re-reading
        # cannot settle).
        if isinstance(e, OutcomeUnknown):
            return False
        return isinstance(e, ConsensusError) or (
            isinstance(e, PersistError) and e.is_indeterminate()
        )

    retrying = Retrying(
        stop=stop_after_attempt(attempts - 1),
        wait=wait_exponential_jitter(multiplier=0.005, max=max_wait, jitter=0.005),
        retry=retry_if_exception(retry),
        reraise=True,
    )
    try:
        out: _T = retrying(apply)
    except ConsensusError as e:
        if not e.is_indeterminate():
            raise ConsensusError(
                f"the outcome of a change to shard {shard_id} is unknown: a commit "
                f"was indeterminate and resolving it failed: {e}",
                indeterminate=True,
            ) from e
        raise
    return out


def token_floor(machine: ShardMachine, token: str) -> int | None:
    """The seqno of a version read before the first attempt of the append with
    ``token`` (``lo`` of :func:`persist.landed.verdict`): noted by this process when an
    attempt's outcome was left unknown (:meth:`ShardMachine.note_attempt`), else the one
    a token persist made carries (:func:`token_lo`); ``None``: not known (a caller's own
    token retried by another process)."""
    lo = machine.attempt_floor(token)
    if lo is None:
        lo = token_lo(token)
    return lo


def token_landed(
    machine: ShardMachine,
    token: str,
    fingerprint: str,
    earlier: Callable[[str], str] | None = None,
) -> tuple[bool, int]:
    """Whether an append with the caller's ``token`` landed, decided on a freshly
    fetched shard state by the shard's landed records (:mod:`persist.landed`, which
    outlive the writer and its lease); it must be this append (``fingerprint``, or in
    another version ``earlier``: :func:`persist.fingerprint.check_same_append`).
    Returns ``(landed, seqno of the state read)``: a retry that did not land is tried
    again with that seqno as its ``lo``.

    Raises:
        InvalidUsage: the token names another append.
        ConsensusError: indeterminate (:class:`~persist.landed.OutcomeUnknown`): the
            record of the append may have been pruned, so the outcome cannot be learned.
    """
    lo = token_floor(machine, token)
    st = machine.refresh()  # the head as read now (caught up from the cached version)
    verdict, entry = token_verdict(st, token, lo)
    if verdict == TOKEN_LANDED:
        assert entry is not None
        check_same_append(entry, token, fingerprint, earlier)
        return True, st.seqno
    if verdict == TOKEN_UNKNOWN:
        raise OutcomeUnknown(token, machine.shard_id)
    return False, st.seqno
