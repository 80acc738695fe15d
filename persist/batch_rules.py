"""Validating and planning an append of batches against its bounds ``[expected, new)``.

This module holds the rules a compare-and-append checks before it writes or commits
anything, and the plan of the hollow batches it pushes:

* :func:`append_bounds` and :func:`check_times`: the append's frontiers and its updates'
  times in ``[expected, new)``;
* :func:`check_batches`: the batches given to one append are distinct, unconsumed, of
  this shard and share no part;
* :func:`validate_truncate`: Materialize's ``validate_truncate_batch``;
* :func:`check_appendable`: every blob part the batches reference exists;
* :func:`handed_off_owners`: which other writers' hand-offs the append counts down;
* :func:`plan_pieces` and :func:`assemble` (with :func:`needs_rewrite` and
  :func:`materialize`): the hollow batches to push, rewriting physically what metadata
  cannot express, and the parts the append gives the shard.

Invariants kept here:

* each batch covers the append (``batch.lower <= expected``, ``new <= batch.upper``, else
  ``InvalidBatchBounds``) and only its updates in ``[expected, new)`` become visible (the
  rest is truncated away: metadata only when the batch's time range shows nothing to
  cut, else by writing the kept updates as a new run);
* a rewritten batch must end exactly at ``new`` and mean no time before ``expected``
  (``InvalidRewrite``); its rewrite is applied without a blob call when the append's
  rewritten batches share one frontier;
* a refused batch commits nothing: every check here runs before the commit, and
  :func:`assemble` deletes the temporary batches it wrote if it fails;
* the batches given are never changed (a caller may retry them).

Everything but :func:`check_appendable` (a blob listing) and :func:`materialize` (a read
and a write of one batch) is pure.  Source: ``validate_truncate_batch`` in Materialize's
``src/persist-client/src/batch.rs``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from persist.appended import inline_ids
from persist.batch import Batch
from persist.blob import Blob
from persist.builder import RunWriter, time_range
from persist.errors import (
    InvalidBatchBounds,
    InvalidBounds,
    InvalidRewrite,
    InvalidUsage,
    PartsMissing,
    UpdateBeyondUpper,
    UpdateNotBeyondLower,
)
from persist.fetch import read_batch
from persist.keys import key_writer_id
from persist.machine import ShardMachine
from persist.parts import TIME
from persist.types import Description, HollowBatch, PartRef, as_frontier
from stash import Antichain

__all__ = [
    "append_bounds",
    "assemble",
    "check_appendable",
    "check_batches",
    "check_times",
    "handed_off_owners",
    "materialize",
    "needs_rewrite",
    "plan_pieces",
    "validate_truncate",
]


def append_bounds(
    expected_upper: Antichain | int, new_upper: Antichain | int
) -> tuple[Antichain, Antichain]:
    """``(expected, new)`` of an append as frontiers.

    Raises:
        InvalidUsage: not a frontier or an int time.
        InvalidBounds: ``expected_upper`` is not ``<= new_upper``.
    """
    expected = as_frontier(expected_upper, "expected_upper")
    new = as_frontier(new_upper, "new_upper")
    if not expected <= new:
        raise InvalidBounds(expected, new)
    return expected, new


def check_times(table: pa.Table, expected: Antichain, new: Antichain) -> tuple[int, int] | None:
    """The time range of the normalized updates ``table`` (:func:`time_range`), checked
    to lie in ``[expected, new)``.

    Raises:
        UpdateNotBeyondLower, UpdateBeyondUpper.
    """
    rng = time_range(table)
    if rng is not None:
        if not expected.less_equal(rng[0]):
            raise UpdateNotBeyondLower(rng[0], expected)
        if new.less_equal(rng[1]):
            raise UpdateBeyondUpper(rng[1], new)
    return rng


def check_batches(batches: Sequence[Batch], shard_id: str) -> None:
    """The batches of one append: each a :class:`Batch` of shard ``shard_id``, not yet
    consumed, listed once, and no two sharing a part.

    Raises:
        InvalidUsage: naming the batch and the rule.
    """
    if len({id(b) for b in batches}) != len(batches):
        raise InvalidUsage("the same batch is listed twice in one compare_and_append_batch")
    keys = [k for b in batches if isinstance(b, Batch) for k in b.part_ids()]
    if len(set(keys)) != len(keys):
        raise InvalidUsage(
            "two batches of one compare_and_append_batch share parts (one batch's "
            "transmittable bytes decoded twice?): its updates would be appended twice"
        )
    for b in batches:
        if not isinstance(b, Batch):
            raise InvalidUsage(f"expected a Batch, got {type(b).__name__}")
        if b.consumed:
            raise InvalidUsage(f"{b!r} was already appended, deleted or transmitted")
        if b.shard_id != shard_id:
            raise InvalidUsage(f"{b!r} was written for another shard than {shard_id}")


def validate_truncate(batches: Sequence[Batch], expected: Antichain, new: Antichain) -> None:
    """Materialize's ``validate_truncate_batch``: every batch must *cover* the append
    (``batch.lower <= expected`` and ``new <= batch.upper``; what lies outside
    ``[expected, new)`` is truncated away); if any batch was rewritten, every batch
    must end exactly at ``new`` and mean no time before ``expected``.

    Raises:
        InvalidRewrite, InvalidBatchBounds.
    """
    any_rewrite = any(b.rewritten for b in batches)
    for b in batches:
        if any_rewrite:
            if b.upper != new:
                raise InvalidRewrite(
                    f"rewritten batches must end at the append's upper: {b!r} might "
                    f"have data past {new} up to {b.upper}"
                )
            if not expected <= b.floor():
                raise InvalidRewrite(
                    f"rewritten batches must not mean times before the append's lower: "
                    f"{b!r} might have data below {expected} at {b.floor()}"
                )
        if not (b.lower <= expected and new <= b.upper):
            raise InvalidBatchBounds(
                f"batch [{b.lower}, {b.upper}) does not cover the append "
                f"[{expected}, {new}): a batch's lower must be <= the expected upper "
                f"and its upper >= the new upper (updates outside are truncated away)"
            )


def check_appendable(
    blob: Blob, shard_id: str, batches: Sequence[Batch], fresh: Batch | None
) -> set[str]:
    """Before an append of pre-written ``batches``: every blob part they reference
    (but those of ``fresh``, just written) must exist (one listing per writer whose
    parts they hold).  Returns the writers the parts name, which must be live when the
    append commits.

    Raises:
        PartsMissing: a part is not in the blob store (nothing is committed).
    """
    owners: set[str] = set()
    keys = [k for b in batches if b is not fresh for k in b.blob_keys()]
    for b in batches:
        owners.update(w for k in b.blob_keys() if (w := key_writer_id(k)) is not None)
    if not keys:
        return owners
    prefixes: dict[str, list[str]] = {}
    for k in keys:
        w = key_writer_id(k)
        prefix = k if w is None else k[: k.index(w) + len(w) + 1]
        prefixes.setdefault(prefix, []).append(k)
    missing: list[str] = []
    for prefix, ks in prefixes.items():
        present = {k for k, _ in blob.list_keys(prefix)}
        missing.extend(k for k in ks if k not in present)
    if missing:
        raise PartsMissing(shard_id, sorted(missing))
    return owners


def handed_off_owners(batches: Sequence[Batch], appender: str) -> dict[str, int]:
    """How many of ``batches`` each other writer wrote parts of (writer id -> batches):
    an append of them counts those batches down from the writers' hand-off (see
    :meth:`ShardState.release_handed_off`)."""
    out: dict[str, int] = {}
    for b in batches:
        for w in {key_writer_id(k) for k in b.blob_keys()}:
            if w is not None and w != appender:
                out[w] = out.get(w, 0) + 1
    return out


def needs_rewrite(b: Batch, lo: Antichain, expected: Antichain, new: Antichain) -> bool:
    """Whether ``b``'s parts cannot be pushed as they are in ``[lo, new)`` (whose
    readers advance every time to ``lo``)."""
    if b.rewritten:
        # It covers up to `new` exactly and means times from its floor (>= expected)
        # on; readers advance only to lo, so a later floor must be applied physically
        # unless no raw time lies below it.
        f = b.floor().as_option()
        raw = b.time_range
        return b.floor() != lo and (raw is None or f is None or raw[0] < f)
    raw = b.time_range
    if raw is None:
        # Unknown times: only a batch with the append's exact bounds is known to fit.
        return not (b.lower == expected and b.upper == new)
    return not expected.less_equal(raw[0]) or new.less_equal(raw[1])


def materialize(
    b: Batch, expected: Antichain, new: Antichain, machine: ShardMachine, runs: RunWriter
) -> Batch:
    """A temporary batch holding ``b``'s updates with its rewrite applied (times
    advanced to its rewrite frontier) and only the times in ``[floor, new)``
    (``floor`` its rewrite frontier, or ``expected``: the truncation), written as
    one run by ``runs`` in the shard's newest schema version.  ``b`` is left as it was
    (the caller may still retry it).

    Raises:
        BlobError: reading ``b`` or writing the run failed.
    """
    # Conformed to the newest schema version: the batch may mix parts of writers
    # opened with other versions.
    history = machine.state().schemas()
    if any(p.schema_id > history.newest for p in b.hollow.parts):
        history = machine.refresh().schemas()  # a version this process has not seen
    table = read_batch(
        runs.blob,
        b.hollow,
        history.view_schema(history.newest),
        schemas=(history, history.newest),
    )
    f = b.rewrite_frontier
    lower = (expected if f is None else f).as_option()
    ti = table.schema.get_field_index(TIME)
    if f is not None and lower is not None and table.num_rows:
        times = pc.max_element_wise(table.column(TIME), pa.scalar(lower, pa.int64()))
        table = table.set_column(ti, table.schema.field(ti), times)
    up = new.as_option()
    mask = None
    if lower is not None:
        mask = pc.greater_equal(table.column(TIME), pa.scalar(lower, pa.int64()))
    if up is not None:
        m2 = pc.less(table.column(TIME), pa.scalar(up, pa.int64()))
        mask = m2 if mask is None else pc.and_(mask, m2)
    if mask is not None and table.num_rows:
        table = table.filter(mask)
    run = runs.write_run(table, history.newest, history.versions[history.newest])
    hollow = HollowBatch(b.hollow.desc, tuple(run), sum(p.rows for p in run))
    return Batch(runs.blob, runs.shard_id, hollow, time_range=time_range(table))


def assemble(
    batches: Sequence[Batch],
    expected: Antichain,
    new: Antichain,
    rewrite: Callable[[Batch], Batch],
    sources: list[str] | None = None,
) -> tuple[list[HollowBatch], list[Batch]]:
    """The hollow batches to push for an append ``[expected, new)`` of ``batches``
    (already validated), and the temporary batches written to truncate or rewrite
    some of them physically (``rewrite(b)``, e.g. :func:`materialize`; their parts are
    pushed instead of the originals').  ``sources`` (when given) collects the part keys
    of the batches rewritten into a non-empty temporary batch.

    One hollow batch ``[lo, new)`` holds every part, preceded by an empty
    ``[expected, lo)`` when every rewritten batch means times from ``lo`` on (readers
    advance a batch's times to its lower, which applies a single rewrite frontier
    without a blob call).  A batch whose data may lie outside ``[expected, new)``
    (truncation) or below ``lo`` while meaning a later time (several rewrite
    frontiers) is rewritten physically into a temporary batch.  If a rewrite fails,
    the temporary batches already written are deleted.
    """
    live = [b for b in batches if b.len > 0]
    lo = expected
    if any(b.rewritten for b in live):
        lo = live[0].floor()
        for b in live[1:]:
            lo = lo.meet(b.floor())
    temps: list[Batch] = []
    use: list[Batch] = []
    try:
        for b in live:
            if needs_rewrite(b, lo, expected, new):
                t = rewrite(b)
                if t.len > 0:
                    temps.append(t)
                    use.append(t)
                    if sources is not None:
                        sources.extend(b.blob_keys())
            else:
                use.append(b)
    except BaseException:
        for t in temps:
            t.delete()
        raise
    out: list[HollowBatch] = []
    if lo != expected:
        out.append(HollowBatch(Description(expected, lo)))
    out.append(concat_runs(lo, new, use))
    return out, temps


def concat_runs(lower: Antichain, upper: Antichain, batches: Sequence[Batch]) -> HollowBatch:
    """One hollow batch ``[lower, upper)`` holding the parts of ``batches`` in order,
    each batch's runs kept as runs (a batch's first part starts a new run)."""
    parts: list[PartRef] = []
    runs: list[int] = []
    n = 0
    for b in batches:
        off = len(parts)
        if off:
            runs.append(off)
        runs.extend(off + r for r in b.hollow.runs)
        parts.extend(b.hollow.parts)
        n += b.len
    return HollowBatch(Description(lower, upper), tuple(parts), n, tuple(sorted(set(runs))))


def plan_pieces(
    batches: Sequence[Batch],
    expected: Antichain,
    new: Antichain,
    fresh: Batch | None,
    rewrite: Callable[[Batch], Batch],
) -> tuple[list[HollowBatch], list[Batch], list[str]]:
    """``(pieces, temps, given)`` of an append ``[expected, new)`` of ``batches``
    (validated): the hollow batches to push and the temporary batches written for them
    (:func:`assemble`), and the ids of the given parts whose rows the append pushes, as
    they are or rewritten into new parts: none may be in the shard already (see
    :mod:`persist.appended`).  ``fresh``: a batch whose parts the append itself just
    wrote (not given).  An empty range pushes nothing."""
    if expected == new:
        return [], [], []
    given: list[str] = []
    pieces, temps = assemble(batches, expected, new, rewrite, given)
    fresh_keys = {k for b in [fresh, *temps] if b is not None for k in b.blob_keys()}
    given.extend(
        p.key for hb in pieces for p in hb.parts if p.key is not None and p.key not in fresh_keys
    )
    # Inline parts: their nonces name them (see PartRef.part_id).
    given.extend(inline_ids(b for b in batches if b is not fresh))
    return pieces, temps, given
