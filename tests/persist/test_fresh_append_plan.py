"""The plan of an append of the one batch ``compare_and_append`` just wrote
(``persist.write.fresh_alone``) against the general planning of batches (the batch
rules' checks and ``WriteHandle._plan_batches``): whenever the short plan is taken, the
general one accepts the batch and plans exactly the same pushes, gifts and owners."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from persist import MemoryBlob, PersistClient
from persist.batch import Batch
from persist.batch_rules import check_batches, validate_truncate
from persist.keys import part_name_prefix
from persist.types import Description, HollowBatch, PartRef
from persist.write import WriteHandle, fresh_alone
from stash import Antichain, Stash

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.int64())])


@pytest.fixture(scope="module")
def writer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WriteHandle]:
    d: Path = tmp_path_factory.mktemp("fresh")
    s = Stash.open(f"sqlite:///{d / 'stash.db'}", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off")
    w, _r = c.open("fresh", KS, VS)
    yield w
    c.close()
    s.close()


def _other_writer() -> str:
    return "w" + uuid.uuid4().hex


@st.composite
def _appends(draw: Any, shard_id: str, writer_id: str) -> tuple[Batch, Antichain, Antichain]:
    lo = draw(st.integers(0, 5))
    hi = lo + draw(st.integers(1, 3))
    expected, new = Antichain.from_elem(lo), Antichain.from_elem(hi)
    # The batch's description: mostly the append's, sometimes wider or advanced.
    d_lo = lo - draw(st.sampled_from([0, 0, 0, 1]))
    d_hi = hi + draw(st.sampled_from([0, 0, 0, 1]))
    since = draw(st.sampled_from([0, 0, 0, 1]))
    desc = Description(
        Antichain.from_elem(max(d_lo, 0)),
        Antichain.from_elem(d_hi),
        Antichain.from_elem(since),
    )
    parts = []
    for _ in range(draw(st.integers(0, 3))):
        rows = draw(st.integers(1, 3))
        if draw(st.booleans()):
            parts.append(
                PartRef(
                    None,
                    rows,
                    4,
                    "0" * 64,
                    inline=b"abcd",
                    nonce=draw(st.sampled_from([None, uuid.uuid4().hex])),
                )
            )
        else:
            w = writer_id if draw(st.booleans()) else _other_writer()
            key = f"{shard_id}/b/{part_name_prefix(w, 1)}{uuid.uuid4().hex}.parquet"
            parts.append(PartRef(key, rows, 10, "0" * 64))
    n = sum(p.rows for p in parts) + draw(st.sampled_from([0, 0, 0, 1]))
    runs = draw(st.sampled_from([(), (), (1,)])) if len(parts) > 1 else ()
    hb = HollowBatch(desc, tuple(parts), n if parts else draw(st.sampled_from([0, 0, 1])), runs)
    rng = draw(st.sampled_from([None, (lo, hi - 1), (lo, lo), (max(lo - 1, 0), hi - 1), (lo, hi)]))
    b = Batch(MemoryBlob(), shard_id, hb, time_range=rng)
    if draw(st.integers(0, 9)) == 0:
        b.rewrite_ts(Antichain.from_elem(lo), Antichain.from_elem(d_hi))
    if draw(st.integers(0, 9)) == 0:
        b.mark_consumed()
    return b, expected, new


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_fresh_plan_is_the_general_plan(writer: WriteHandle, data: st.DataObject) -> None:
    b, expected, new = data.draw(_appends(writer.shard_id, writer.writer_id))
    fast = fresh_alone([b], b, expected, new, writer.writer_id)
    if fast is None:
        return
    check_batches([b], writer.shard_id)  # raises if the general path refuses it
    validate_truncate([b], expected, new)
    general = writer._plan_batches([b], expected, new, b)
    assert fast == general
    assert fast.temps == []
    event("short plan taken")


def test_fresh_plan_is_taken_by_compare_and_append(
    writer: WriteHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The short plan is the one a one-row ``compare_and_append`` takes."""
    import persist.write as write_mod

    taken: list[Any] = []
    real = write_mod.fresh_alone

    def spy(*args: Any) -> Any:
        taken.append(real(*args))
        return taken[-1]

    monkeypatch.setattr(write_mod, "fresh_alone", spy)
    up = writer.upper.as_option()
    assert up is not None
    writer.compare_and_append(_one(up), up, up + 1)
    assert taken and taken[0] is not None


def _one(t: int) -> pa.Table:
    return pa.table(
        {"k": [1], "v": [2], "_time": pa.array([t], pa.int64()), "_diff": pa.array([1], pa.int64())}
    )
