"""The batch rules of an append (:mod:`persist.batch_rules`) as pure functions: no
machine, no consensus, no blob call (batches of made-up part references; a rewrite is a
plain function).  The same rules through a write handle are in test_batch_rules.py."""

from __future__ import annotations

import pyarrow as pa
import pytest

from persist import MemoryBlob
from persist.batch import Batch
from persist.batch_rules import (
    append_bounds,
    assemble,
    check_batches,
    check_times,
    handed_off_owners,
    needs_rewrite,
    plan_pieces,
    validate_truncate,
)
from persist.errors import (
    InvalidBatchBounds,
    InvalidBounds,
    InvalidRewrite,
    InvalidUsage,
    UpdateBeyondUpper,
    UpdateNotBeyondLower,
)
from persist.types import Description, HollowBatch, PartRef
from stash import Antichain

SHARD = "s" + "0" * 32
W1, W2 = "w" + "1" * 32, "w" + "2" * 32
BLOB = MemoryBlob()


def ac(t: int) -> Antichain:
    return Antichain.from_elem(t)


def part(writer: str, n: int) -> PartRef:
    return PartRef(f"{SHARD}/b/{writer}-1700000000000-{n:032x}.parquet", 3, 10, "00")


def batch(
    lo: int, up: int, times: tuple[int, int] | None, *parts: PartRef, shard: str = SHARD
) -> Batch:
    hb = HollowBatch(Description(ac(lo), ac(up)), tuple(parts), sum(p.rows for p in parts))
    return Batch(BLOB, shard, hb, time_range=times)


def no_rewrite(b: Batch) -> Batch:
    raise AssertionError(f"{b!r} should be pushed as it is")


def test_append_bounds_and_times() -> None:
    assert append_bounds(1, 3) == (ac(1), ac(3))
    with pytest.raises(InvalidBounds):
        append_bounds(3, 1)
    with pytest.raises(InvalidUsage, match="expected_upper must be an Antichain or an int"):
        append_bounds("1", 3)  # type: ignore[arg-type]
    t = pa.table({"_time": pa.array([1, 2], pa.int64())})
    assert check_times(t, ac(1), ac(3)) == (1, 2)
    with pytest.raises(UpdateNotBeyondLower):
        check_times(t, ac(2), ac(3))
    with pytest.raises(UpdateBeyondUpper):
        check_times(t, ac(1), ac(2))


def test_check_batches_names_the_rule_broken() -> None:
    a = batch(0, 2, (0, 1), part(W1, 1))
    with pytest.raises(InvalidUsage, match="listed twice"):
        check_batches([a, a], SHARD)
    with pytest.raises(InvalidUsage, match="share parts"):
        check_batches([a, batch(0, 2, (0, 1), part(W1, 1))], SHARD)
    with pytest.raises(InvalidUsage, match="another shard"):
        check_batches([batch(0, 2, None, shard="s" + "9" * 32)], SHARD)
    with pytest.raises(InvalidUsage, match="expected a Batch"):
        check_batches(["b"], SHARD)  # type: ignore[list-item]
    check_batches([a, batch(0, 2, (0, 1), part(W2, 1))], SHARD)


def test_validate_truncate_follows_materialize() -> None:
    validate_truncate([batch(0, 5, None)], ac(1), ac(4))  # covers: truncated
    with pytest.raises(InvalidBatchBounds):
        validate_truncate([batch(2, 5, None)], ac(1), ac(4))
    with pytest.raises(InvalidBatchBounds):
        validate_truncate([batch(0, 3, None)], ac(1), ac(4))
    r = batch(0, 2, (0, 1), part(W1, 1))
    r.rewrite_ts(ac(3), ac(4))
    validate_truncate([r], ac(3), ac(4))
    with pytest.raises(InvalidRewrite, match="before the append's lower"):
        validate_truncate([r], ac(4), ac(4))  # it means times from 3 on
    with pytest.raises(InvalidRewrite, match="end at the append's upper"):
        validate_truncate([r, batch(0, 5, None)], ac(3), ac(4))


def test_needs_rewrite_only_when_metadata_cannot_express_it() -> None:
    assert not needs_rewrite(batch(1, 4, (1, 3)), ac(1), ac(1), ac(4))
    assert needs_rewrite(batch(0, 4, (0, 3)), ac(1), ac(1), ac(4))  # truncates time 0
    assert needs_rewrite(batch(1, 5, (1, 4)), ac(1), ac(1), ac(4))  # truncates time 4
    assert not needs_rewrite(batch(1, 4, None), ac(1), ac(1), ac(4))  # exact bounds
    assert needs_rewrite(batch(0, 4, None), ac(1), ac(1), ac(4))  # unknown times


def test_assemble_pushes_parts_as_they_are_and_rewrites_the_rest() -> None:
    a = batch(1, 4, (1, 3), part(W1, 1))
    b = batch(0, 4, (0, 3), part(W2, 2))  # its time 0 is truncated away
    t = batch(0, 4, (1, 3), part(W1, 9))
    seen: list[Batch] = []

    def rewrite(x: Batch) -> Batch:
        seen.append(x)
        return t

    sources: list[str] = []
    pieces, temps = assemble([a, b], ac(1), ac(4), rewrite, sources)
    assert seen == [b] and temps == [t] and sources == b.blob_keys()
    (hb,) = pieces
    assert hb.desc == Description(ac(1), ac(4))
    assert [p.key for p in hb.parts] == [part(W1, 1).key, part(W1, 9).key]
    assert hb.len == 6 and hb.runs == (1,)
    # plan_pieces: the given parts are those pushed as they are or rewritten; the fresh
    # batch's and the temporaries' are not given.
    pieces, temps, given = plan_pieces([a, b], ac(1), ac(4), a, rewrite)
    assert given == b.blob_keys()
    assert plan_pieces([a], ac(4), ac(4), None, no_rewrite) == ([], [], [])


def test_assemble_applies_one_rewrite_frontier_without_a_blob_call() -> None:
    r = batch(0, 2, (0, 1), part(W1, 1))
    r.rewrite_ts(ac(3), ac(5))
    pieces, temps = assemble([r], ac(2), ac(5), no_rewrite)
    assert temps == []
    assert [p.desc for p in pieces] == [
        Description(ac(2), ac(3)),
        Description(ac(3), ac(5)),
    ]


def test_a_failed_rewrite_deletes_the_temporaries_written() -> None:
    deleted: list[Batch] = []

    class Temp(Batch):
        def delete(self) -> None:
            deleted.append(self)

    t = Temp(BLOB, SHARD, HollowBatch(Description(ac(0), ac(4)), (part(W1, 7),), 3))
    calls = iter([t])

    def rewrite(b: Batch) -> Batch:
        try:
            return next(calls)
        except StopIteration:
            raise OSError("blob down") from None

    with pytest.raises(OSError):
        assemble(
            [batch(0, 4, (0, 3), part(W1, 1)), batch(0, 4, (0, 3), part(W1, 2))],
            ac(1),
            ac(4),
            rewrite,
        )
    assert deleted == [t]


def test_handed_off_owners_counts_batches_per_other_writer() -> None:
    bs = [
        batch(0, 1, None, part(W1, 1), part(W2, 2)),
        batch(0, 1, None, part(W2, 3), part(W2, 4)),
    ]
    assert handed_off_owners(bs, W1) == {W2: 2}
    assert handed_off_owners(bs, W2) == {W1: 1}
