"""The inputs of the shard state's commands that carry many values, as plain data.

A command of :class:`~persist.state.ShardState` (``compare_and_append``,
``commit_txn``...) takes what to change as a frozen dataclass (an :class:`AppendCmd`,
a :class:`TxnCmd`) and decides, on the version it runs on, whether it is still valid
(after pyiceberg's ``table/update/__init__.py``, which keeps "what to change" as data apart
from "is it still valid", the requirements checked at commit).  A check that needs a
fact only storage knows, read as of the version being committed on (the retired keys
at its ``retired_upper``, the parts listed again once a GC may have deleted some), raises
:class:`NeedsInput` before changing anything; the machine (:mod:`persist.machine`) reads
it into the command's :class:`Inputs` and runs the command again on the same version, so
the state's commands do no I/O themselves.

Invariants kept here: commands are immutable; :class:`Inputs` only records facts read
as of a given ``retired_upper``, which a command uses only on a version with that upper.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from persist.spine import FueledMergeRes
from persist.types import HollowBatch
from stash import Antichain

__all__ = ["AppendCmd", "Inputs", "NeedsInput", "TxnCmd"]


class NeedsInput(Exception):
    """Raised by a command, before it changed anything, when a check needs a fact read
    from storage as of the version it runs on: ``what`` is ``"retired"`` (the shard's
    retired part ids) or ``"parts"`` (list the command's given parts again), and
    ``retired_upper`` the version's retired-collection upper the fact must be read at."""

    def __init__(self, what: str, retired_upper: int) -> None:
        super().__init__(f"needs {what} at retired upper {retired_upper}")
        self.what = what
        self.retired_upper = retired_upper


@dataclass
class Inputs:
    """Facts a command asked for (:class:`NeedsInput`), read as of a ``retired_upper``:
    ``retired`` is ``(retired_upper, retired part ids)``; ``listed_upper`` the
    ``retired_upper`` of a version at which the given parts were (last) listed
    (``None``: never); ``maybe_landed``: an earlier attempt of the command may have
    committed (its outcome was indeterminate), so a missing record of its token may
    mean it was pruned (see :mod:`persist.landed`)."""

    retired: tuple[int, frozenset[str]] | None = None
    listed_upper: int | None = None
    maybe_landed: bool = False


@dataclass(frozen=True)
class AppendCmd:
    """What an append commits (:meth:`persist.state.ShardState.compare_and_append`).

    Attributes:
        writer_id: the appending writer.
        token: the append's idempotency token; ``recorded``: what the writer's state
            records of it (``token``, the token separator and the append's fingerprint).
        expected: the upper the append expects the shard to have.
        pieces: the hollow batches to add, in order (empty: nothing to commit).
        lease_ms: the writer's lease duration.
        registered: whether the writer registered before (then it must still be live).
        owners: writers whose parts the pieces reference (each must be live).
        handed: ``(writer id, batches)``: hand-offs this append settles.
        merges: compaction results riding along (applied unless already in the trace).
        given: part ids of given (not freshly written) parts: none may be in the shard
            already, or retired from it.
        lo: the seqno of a version read before the append's first attempt (any attempt
            of it lands after it; ``None``: not known), see :mod:`persist.landed`.
        consumed: part ids of given batches the append rewrote into new parts
            (truncated): retired in the version that commits it, so that another copy
            of those batches is refused as appended (``BatchAppended``).
        earlier: the append's fingerprint in another version, by the version's prefix
            (:func:`persist.fingerprint.check_same_append`), or ``None``.
    """

    writer_id: str
    token: str
    recorded: str
    expected: Antichain
    pieces: tuple[HollowBatch, ...]
    lease_ms: int
    registered: bool
    owners: frozenset[str]
    handed: tuple[tuple[str, int], ...] = ()
    merges: tuple[FueledMergeRes, ...] = ()
    given: tuple[str, ...] = ()
    lo: int | None = None
    consumed: tuple[str, ...] = ()
    earlier: Callable[[str], str] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class TxnCmd:
    """One shard's part of a multi-shard transaction committing at time ``ts``
    (:meth:`persist.state.ShardState.commit_txn`).

    Attributes:
        writer_id: the builder's writer (registered or renewed by the commit).
        record_id: the transaction's own record id (its token is recorded under it).
        token: the transaction's idempotency token.
        ts: the commit time.
        lease_ms: the writer's lease duration.
        registered: whether the writer registered before.
        owners: writers whose parts the batches reference (each must be live; the
            writer itself once registered).
        handed: ``(writer id, batches)``: hand-offs the commit settles.
        given: part ids of given parts (see :class:`AppendCmd`).
        timed_lo: the earliest time of timed updates (``None``: none are timed); the
            shard's upper must not be past it.
        done: record ids of this client's acknowledged transactions to drop (writers
            of states written before transactions recorded their token as
            :mod:`persist.landed` records).
        pieces: the hollow batches to add for a shard whose upper is the argument
            (pure: a function of the upper only).
    """

    writer_id: str
    record_id: str
    token: str
    ts: int
    lease_ms: int
    registered: bool
    owners: frozenset[str]
    handed: tuple[tuple[str, int], ...]
    given: tuple[str, ...]
    timed_lo: int | None
    done: tuple[str, ...]
    pieces: Callable[[Antichain], list[HollowBatch]]
