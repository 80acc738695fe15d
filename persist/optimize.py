"""Full compaction of a shard: every batch merged into one, consolidated at the since
(:func:`optimize`), what ``Table.optimize()`` and ``persist compact --full`` run.

The Spine's fueled merges (:mod:`persist.compactor`) keep a logarithmic number of
batches and consolidate each merge at the since of its time; after the since moves on,
older batches can hold updates that now cancel or coincide without any merge request
being outstanding.  A full compaction reads every batch of one state version, advances
every time to that version's since, consolidates, writes one sorted run (parts cut by
size, in key order) and swaps it in for exactly the batches it read
(:meth:`persist.state.ShardState.replace_batches`), keeping the batches appended since.

Invariants kept here: what any readable ``as_of`` (``>= since``) sees is unchanged (the
output holds exactly the inputs' updates with times advanced to a since that every
readable ``as_of`` is at or after); the output is written by the client's compactor
writer, registered before any part is uploaded, so GC never deletes it before it is
applied; an output that lost the race is released (deleted unless a state references
it) and the compaction starts again on the newer version; a shard already in one
consolidated run at its since is left alone (nothing is written).

Source of the idea: Delta Lake's ``OPTIMIZE`` (bin-packing into fewer, larger files)
and Materialize's persist-client compaction (``internal/compact.rs``), applied to a
whole trace.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from persist.commit_note import noting
from persist.compactor import Compactor
from persist.context import PersistContext
from persist.errors import ConsensusError
from persist.fetch import read_batches
from persist.keys import part_name_prefix
from persist.machine import ShardMachine
from persist.parts import consolidate_order, updates_schema, write_parts
from persist.spine import FueledMergeRes
from persist.types import Description, HollowBatch

__all__ = ["OptimizeReport", "optimize"]

log = logging.getLogger(__name__)

#: How many times a full compaction starts again after losing the race to a merge.
ATTEMPTS = 5


@dataclass(frozen=True)
class OptimizeReport:
    """What a full compaction did.

    Attributes:
        applied: whether a new trace was committed (``False``: nothing to do).
        since: the since the updates were consolidated at (``None``: none).
        batches_before, batches_after: hollow batches before and after.
        parts_before, parts_after: parts before and after.
        updates_before, updates_after: stored updates (rows of the parts).
        bytes_written: encoded bytes of the output's parts.
    """

    applied: bool
    since: int | None
    batches_before: int
    batches_after: int
    parts_before: int
    parts_after: int
    updates_before: int
    updates_after: int
    bytes_written: int

    def to_dict(self) -> dict[str, Any]:
        """The report as a JSON-able dict."""
        return dict(self.__dict__)


def _done(batches: tuple[HollowBatch, ...], since: Any) -> bool:
    """Whether the batches are already one consolidated run at ``since``."""
    return len(batches) == 1 and not batches[0].runs and batches[0].desc.since == since


def optimize(ctx: PersistContext, compactor: Compactor, machine: ShardMachine) -> OptimizeReport:
    """Merge every batch of the shard into one batch, consolidated at its since (see
    the module docstring).

    Raises:
        InvalidUsage: the shard was dropped.
        CorruptPart, BlobError: reading or writing parts failed (nothing applied).
        ConsensusError: committing failed, or every attempt lost the race.
    """
    cfg = ctx.config
    for _attempt in range(ATTEMPTS):
        st = machine.refresh()
        st.check_not_finalized()
        prefix = tuple(st.batches())
        parts_before = sum(len(b.parts) for b in prefix)
        updates_before = sum(b.len for b in prefix)
        since = st.since.as_option()
        if not prefix or _done(prefix, st.since):
            n = len(prefix)
            return OptimizeReport(
                False, since, n, n, parts_before, parts_before, updates_before, updates_before, 0
            )
        ks, vs = st.key_schema, st.value_schema
        history = st.schemas()
        table = read_batches(
            ctx.blob,
            list(prefix),
            updates_schema(ks, vs),
            max_workers=cfg.read_workers,
            schemas=(history, history.newest),
        )
        table, order = consolidate_order(table, ks.names, vs.names, since=since)
        rows_out = table.num_rows if order is None else len(order)
        wid = compactor.writer_id(machine)  # registered before any part is uploaded
        parts = write_parts(
            ctx.blob,
            table,
            f"{machine.shard_id}/c",
            target_part_bytes=cfg.target_part_bytes,
            inline_max_bytes=cfg.inline_max_bytes,
            max_workers=cfg.write_workers,
            order=order,
            name_prefix=part_name_prefix(wid, machine.now_ms()),
            key_names=ks.names,
            schema=history.updates_schema(history.newest),
        )
        if history.newest:
            parts = [replace(p, schema_id=history.newest) for p in parts]
        desc = Description(prefix[0].desc.lower, prefix[-1].desc.upper, st.since)
        output = HollowBatch(desc, tuple(parts), rows_out)
        with noting("optimize", {"full": True}):
            applied = machine.replace_batches(prefix, output)
        if applied:
            after = machine.state().batches()
            return OptimizeReport(
                True,
                since,
                len(prefix),
                len(after),
                parts_before,
                sum(len(b.parts) for b in after),
                updates_before,
                sum(b.len for b in after),
                sum(p.encoded_size_bytes for p in parts),
            )
        log.info("full compaction of shard %s lost a race; starting again", machine.shard_id)
        compactor.release_outputs(machine, [FueledMergeRes(output)])
    raise ConsensusError(
        f"full compaction of shard {machine.shard_id} lost the race to other compactions "
        f"{ATTEMPTS} times; try again"
    )
