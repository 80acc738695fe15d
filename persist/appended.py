"""A batch is appended once: the checks an append's transition runs against copies.

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

Source: Materialize's persist-client ``internal/state.rs`` decides a
``compare_and_append`` on the state it commits on, never on an earlier read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from persist.batch import Batch
from persist.errors import BatchAppended
from persist.types import HollowBatch

if TYPE_CHECKING:
    from persist.consensus import Consensus
    from persist.state import ShardState

__all__ = ["check_not_appended", "copy_check", "inline_ids"]


def inline_ids(batches: Iterable[Batch | HollowBatch]) -> list[str]:
    """The :attr:`~persist.types.PartRef.part_id` of each inline part of ``batches``
    that has one (inline parts of older writers have none)."""
    out: list[str] = []
    for b in batches:
        hb = b.hollow if isinstance(b, Batch) else b
        out.extend(i for p in hb.parts if p.key is None and (i := p.part_id) is not None)
    return out


def check_not_appended(
    consensus: Consensus,
    st: ShardState,
    keys: list[str],
    retired: list[tuple[int, set[str]]],
) -> None:
    """In an append's transition: no part of ``keys`` (part ids of the appended batches)
    may be referenced by ``st`` (the version committed on) or retired from it
    (referenced once, then compacted away): such a batch is a copy of one already
    appended, whose updates would count twice.  The retired keys are those read at
    ``st``'s ``retired_upper`` (``retired`` caches ``[(upper, keys)]``; a newer read
    means a newer version, on which the compare-and-set fails and this runs again).

    Raises:
        BatchAppended: naming the shard and a part already appended.
    """
    ref = st.referenced_part_ids()
    again = [k for k in keys if k in ref]
    if not again and st.retired_upper > 0:
        if not retired or retired[0][0] != st.retired_upper:
            upper, rows = consensus.retired_entries(st.shard_id)
            retired[:] = [(upper, set(rows))]
        again = [k for k in keys if k in retired[0][1]]
    if again:
        raise BatchAppended(st.shard_id, again)


def copy_check(
    consensus: Consensus,
    keys: list[str],
    relist: Callable[[], object],
    checked_upper: int | None,
) -> Callable[[ShardState], None]:
    """The check an append's transition runs on the version ``st`` it commits on,
    before adding batches whose given part ids are ``keys`` (not the call's own new
    parts):

    * no key may be referenced by ``st`` or retired from it (:func:`check_not_appended`,
      ``BatchAppended``);
    * once ``st``'s retired collection moved past ``checked_upper`` (its upper in a
      version read before the parts were last listed; ``None``: never listed), the
      parts are listed again (``relist``, which raises ``PartsMissing``): a GC may have
      deleted retired parts and forgotten them in between, and a copy of their batch
      would then be neither referenced nor retired.  GC deletes before it forgets, and
      its forgetting moves the upper, so a version with an unchanged upper has every
      part listed (or still retired).
    """
    retired: list[tuple[int, set[str]]] = []  # the retired keys, read at an upper
    checked = [checked_upper]

    def check(st: ShardState) -> None:
        if not keys:
            return
        check_not_appended(consensus, st, keys, retired)
        if checked[0] != st.retired_upper:
            relist()
            checked[0] = st.retired_upper

    return check
