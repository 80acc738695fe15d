"""Snapshots of several shards at once, consistent across them: :func:`snapshot_many`.

A transaction (:class:`~persist.txn.Txn`) committed at ``ts`` is wholly visible in every
shard it wrote as of any time ``>= ts`` and wholly absent as of any time ``< ts``; so
reading every shard at ONE time gives a cross-shard-consistent view.  This module picks
that time and reads the shards.

Invariants kept here:

* the common time is decided on each shard's latest state, read at the call (never this
  process's cached version): ``min(upper) - 1`` over the shards read at the common time,
  the latest time definite in all of them (``2**63 - 1`` when every one is closed);
* each shard is read in its newest value schema as of that latest state (a column
  another process added or widened is there), without a lease
  (:func:`persist.version_read.read_version`: nothing is written, so it works on a
  readonly stash; a part GC removed meanwhile is read from the newer version at the
  same time).

Source of the idea: Materialize's ``src/txn-wal`` (a read at one timestamp across the
data shards a transaction wrote) and ``src/persist-client/src/read.rs``
(``ReadHandle::snapshot_and_fetch`` at an ``as_of`` not beyond the upper).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import pyarrow as pa

from persist.errors import SinceViolation
from persist.machine import ShardMachine
from persist.shards import Shards
from persist.version_read import read_version
from stash.antichain import I64_MAX, I64_MIN

__all__ = ["HasShards", "snapshot_many"]


class HasShards(Protocol):
    """Anything holding a :class:`~persist.shards.Shards` (a
    :class:`~persist.client.PersistClient`)."""

    @property
    def shard_ops(self) -> Shards: ...


def snapshot_many(
    source: Shards | HasShards, as_ofs: Mapping[str, int | None] | Sequence[str]
) -> dict[str, pa.Table]:
    """Consolidated snapshots of several shards, consistent across them.

    Args:
        source: the client, or its :class:`~persist.shards.Shards`.
        as_ofs: shard name -> as_of time, or ``None`` (or a list of names) for "the
            latest time definite in every listed shard": ``min(upper) - 1`` over them,
            read once (``2**63 - 1`` when every one is closed, upper ``{}``).  A
            transaction committed at ``ts`` is wholly visible in every shard read at
            ``as_of >= ts`` and wholly absent at ``as_of < ts``, so reading every shard
            at one time gives a cross-shard-consistent view; shards given different
            explicit times are each consistent at their own time.

    Returns: shard name -> table (see :meth:`persist.read.ReadHandle.snapshot`), in
        each shard's newest value schema as of its latest state (read at the call, so
        a column another process added or widened is there).

    Raises:
        InvalidUsage: unknown shard; an explicit ``as_of`` at or beyond a shard's upper.
        SinceViolation: an ``as_of`` before a shard's since (also when a listed
            shard has no definite time yet: its upper is still its since).
    """
    names = list(as_ofs) if not isinstance(as_ofs, Mapping) else list(as_ofs.keys())
    wanted: dict[str, int | None] = (
        dict(as_ofs) if isinstance(as_ofs, Mapping) else dict.fromkeys(names)
    )
    ops = source if isinstance(source, Shards) else source.shard_ops
    machines: dict[str, ShardMachine] = {}
    for n in names:
        machines[n] = ops.ctx.machine(ops.ctx.shard_id(n))
    # Each shard's latest state, read now: its upper and its newest schema (another
    # process may have evolved it), never this process's cached version.
    latest = {n: machines[n].recent() for n in names}
    common: int | None = None
    if any(v is None for v in wanted.values()):
        ts = [latest[n].upper.as_option() for n, v in wanted.items() if v is None]
        finite = [t for t in ts if t is not None]
        # Every shard closed (upper {}): every time is definite, the greatest included
        # (a row may be at I64_MAX, as ReadHandle.snapshot(I64_MAX) shows).
        common = min(finite) - 1 if finite else I64_MAX
    out: dict[str, pa.Table] = {}
    for n in names:
        m = machines[n]
        st = latest[n]
        t = wanted[n] if wanted[n] is not None else common
        assert t is not None
        if t < I64_MIN:
            raise SinceViolation(t, st.since)
        out[n] = read_version(ops.ctx, m, st, t)
    return out
