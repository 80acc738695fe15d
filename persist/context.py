"""What the handles of one client share: :class:`PersistContext`.

A context holds the client's :class:`~persist.config.PersistConfig`, its stash, its blob
store (the retrying wrapper handles use, and the raw store under it), its consensus,
the registry of state machines (one :class:`~persist.consensus.ShardMachine` per shard),
the registry of open handles, whether the client is closed, and the maintenance hooks
(:class:`MaintenanceHooks`: what a handle calls after an append, when a since moved, or
with compaction outputs it did not use).  Write and read handles, transactions, the
compactor, GC and fsck hold a context, never the client, so none of them imports
:mod:`persist.client`.

Invariants kept here:

* one machine per shard id per context (:meth:`PersistContext.machine`), so all the
  handles of one shard in one client share one cached state version;
* names and ids are separate namespaces (:meth:`PersistContext.shard_id`): a plain
  string is a name, an id is written ``id:<shard id>``;
* once :attr:`PersistContext.closed` is set it stays set, and :meth:`check_open` raises;
* operations that delete blobs run only on a writable stash (:meth:`check_may_delete`);
* every state a machine reads is checked against this client's blob store
  (:class:`~persist.store_identity.StoreIdentity`) before it is used.

Source of the idea: Materialize's persist-client ``src/persist-client/src/write.rs``
(a ``WriteHandle`` holds ``cfg``, ``metrics``, ``machine``, ``compact``, ``blob`` and
``writer_id``, never the client) and ``src/persist-client/src/cache.rs`` (the client's
shared state per shard).
"""

from __future__ import annotations

import difflib
import weakref
from typing import TYPE_CHECKING, Any, Protocol

from persist.blob import Blob
from persist.config import PersistConfig
from persist.consensus import Consensus
from persist.errors import InvalidUsage, UnknownShard
from persist.ids import validate_shard_id, validate_shard_name
from persist.machine import ShardMachine
from persist.spine import FueledMergeReq, FueledMergeRes
from persist.store_identity import StoreIdentity
from stash import Stash

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "SHARD_ID_REF",
    "HasContext",
    "MaintenanceHooks",
    "NoMaintenance",
    "PersistContext",
    "as_context",
]

#: The prefix that marks a shard reference as a shard id rather than a name
#: (:meth:`PersistContext.shard_id`).
SHARD_ID_REF = "id:"


class MaintenanceHooks(Protocol):
    """The follow-up work a handle hands on (Materialize's persist-client
    ``internal/maintenance.rs``: commands return maintenance, the handle passes it on).
    Implemented by :class:`persist.maintenance.Maintenance`."""

    def after_append(self, machine: ShardMachine, reqs: list[FueledMergeReq]) -> None:
        """An append committed and produced merge requests worth answering."""

    def since_moved(self, shard_id: str) -> None:
        """A shard's since may have moved (a reader downgraded or went away)."""

    def rollup_due(self, machine: ShardMachine) -> None:
        """A version of the shard committed whose diffs passed the rollup bound: write
        a rollup as its own compare-and-set (:meth:`ShardMachine.write_rollup`), soon
        or now, never failing the caller.  Called holding the machine's lock."""

    def release_outputs(self, machine: ShardMachine, results: list[FueledMergeRes]) -> None:
        """Compaction outputs an append was offered but did not apply: delete those the
        latest known state neither references nor retired."""


class NoMaintenance:
    """Hooks that do nothing (a context before its maintenance is attached)."""

    def after_append(self, machine: ShardMachine, reqs: list[FueledMergeReq]) -> None:
        return None

    def since_moved(self, shard_id: str) -> None:
        return None

    def rollup_due(self, machine: ShardMachine) -> None:
        return None

    def release_outputs(self, machine: ShardMachine, results: list[FueledMergeRes]) -> None:
        return None


class PersistContext:
    """What the handles of one client share (see the module docstring).

    Attributes:
        config: the client's knobs (:class:`PersistConfig`; replaced, never mutated).
        stash: the :class:`stash.Stash` holding consensus (the caller's to close).
        blob: the blob store handles use (retrying transient errors).
        raw_blob: the store under ``blob`` (for what only it can tell: symlinks,
            temporary files, object-store directories).
        consensus: the shards' versioned log (:class:`~persist.consensus.Consensus`).
        machines: shard id -> its state machine (see :meth:`machine`).
        handles: the handles opened through this context that are still referenced
            (expired on close).
        maintenance: the hooks handles call (:class:`MaintenanceHooks`).
        closed: the client was closed.
        store: the blob store's identity (:class:`~persist.store_identity.StoreIdentity`).
    """

    def __init__(
        self,
        config: PersistConfig,
        stash: Stash,
        blob: Blob,
        raw_blob: Blob,
        consensus: Consensus,
    ) -> None:
        self.config = config
        self.stash = stash
        self.blob = blob
        self.raw_blob = raw_blob
        self.consensus = consensus
        self.machines: dict[str, ShardMachine] = {}
        self.handles: weakref.WeakSet[Any] = weakref.WeakSet()
        self.maintenance: MaintenanceHooks = NoMaintenance()
        self.closed = False
        self.store = StoreIdentity(blob, raw_blob)

    def __repr__(self) -> str:
        return f"PersistContext({self.stash!r}, {self.raw_blob!r})"

    @property
    def clock(self) -> Callable[[], float]:
        """The wall clock (seconds) of :attr:`config`."""
        return self.config.clock

    def machine(self, shard_id: str) -> ShardMachine:
        """The state machine of ``shard_id`` (one per shard, shared by the handles).

        Raises:
            InvalidUsage: a malformed shard id.
        """
        validate_shard_id(shard_id)
        m = self.machines.get(shard_id)
        if m is None:
            m = self.machines.setdefault(
                shard_id,
                ShardMachine(
                    self.consensus,
                    shard_id,
                    clock=self.config.clock,
                    check=self.store.check,
                    on_rollup_due=lambda m: self.maintenance.rollup_due(m),
                ),
            )
        return m

    def shard_id(self, shard: str) -> str:
        """Resolve a shard reference to a shard id.  Names and ids are kept apart: a
        plain string is always a *name* (even one shaped like a shard id); a shard id is
        given as ``"id:<shard id>"`` (``:`` is never part of a name).

        Raises:
            UnknownShard: no shard has that name (offering close names).
            InvalidUsage: a malformed name or ``id:`` reference.
        """
        if not isinstance(shard, str):
            raise InvalidUsage(f"a shard reference must be a str, got {type(shard).__name__}")
        if shard.startswith(SHARD_ID_REF):
            return validate_shard_id(shard[len(SHARD_ID_REF) :])
        validate_shard_name(shard)
        sid = self.consensus.lookup(shard)
        if sid is None:
            close = difflib.get_close_matches(shard, list(self.consensus.shards()), n=3)
            raise UnknownShard(shard, close)
        return sid

    def check_open(self) -> None:
        """Raises: InvalidUsage: the client is closed."""
        if self.closed:
            raise InvalidUsage("this PersistClient is closed")

    def check_may_delete(self, what: str) -> None:
        """Refuse an operation that deletes blobs (GC, finalizing a shard) unless the
        stash is writable.  A ``savepoint`` stash commits none of its state changes, so
        what it judges unreferenced may still be referenced by the live state that
        shares the blob store; a ``readonly`` one cannot record what it deleted.

        Raises:
            InvalidUsage: the stash's mode is not ``writable`` (names ``what``).
        """
        mode = getattr(self.stash, "mode", "writable")
        if mode != "writable":
            raise InvalidUsage(
                f"{what} deletes blobs and needs a writable stash, not a {mode} one: its "
                "state changes are never committed, so it could delete parts the live "
                "state still references"
            )


class HasContext(Protocol):
    """Anything holding a :class:`PersistContext` (a :class:`~persist.client.PersistClient`)."""

    @property
    def context(self) -> PersistContext: ...


def as_context(source: PersistContext | HasContext) -> PersistContext:
    """``source`` itself if it is a context, else its :attr:`~HasContext.context` (so the
    functions taking a context also take the client that holds it)."""
    if isinstance(source, PersistContext):
        return source
    return source.context
