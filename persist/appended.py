"""A batch is appended once: copies of a batch are recognised by their parts' ids.

A batch's transmittable bytes (:meth:`persist.batch.Batch.into_transmittable`) may be
decoded more than once (a retried task, a duplicated message); each decoding names the
same parts.  A part is named by its identity (:attr:`persist.types.PartRef.part_id`): a
blob part by its key, an inline part by the random nonce it drew when written (a
checksum cannot name it: two real appends may write equal bytes).  An append, or a
transaction, is refused (:class:`~persist.errors.BatchAppended`) when a part it pushes as
it is is referenced by the version it commits on, or was retired from the shard (a
compaction merged it away; the retired collection keeps blob keys until GC deletes
them), so a batch's updates never count twice.

A compaction that merges an inline part away retires its id as it retires blob keys,
and GC forgets it after the grace period (with nothing to delete).  The window: a copy
of an inline batch appended after that (held for longer than the grace period after a
compaction merged its parts away) is not recognised.  A blob part's copy is recognised
by its retired key until GC deletes the part, and then refused for the missing blob:
once the retired collection moved since the parts were listed (a GC forgets deleted
keys only by moving it), they are listed again in the transition, so a copy racing a
GC never commits a deleted part.

The check itself is pure and runs in the append's command on the version it commits on
(``ShardState._check_copies`` in :mod:`persist.state`); the retired ids and the
re-listing it needs are read by the machine (:mod:`persist.machine`) as of that version.
This module names the parts.

Source: Materialize's persist-client ``internal/state.rs`` decides a
``compare_and_append`` on the state it commits on, never on an earlier read.
"""

from __future__ import annotations

from collections.abc import Iterable

from persist.batch import Batch
from persist.types import HollowBatch

__all__ = ["inline_ids"]


def inline_ids(batches: Iterable[Batch | HollowBatch]) -> list[str]:
    """The :attr:`~persist.types.PartRef.part_id` of each inline part of ``batches``
    that has one (inline parts of older writers have none)."""
    out: list[str] = []
    for b in batches:
        hb = b.hollow if isinstance(b, Batch) else b
        out.extend(i for p in hb.parts if p.key is None and (i := p.part_id) is not None)
    return out
