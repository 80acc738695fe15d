"""One rule for putting a user's values into a column (:mod:`persist.casts`): the same
values are taken or refused alike by an update's expressions and a merge's values."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from persist import InvalidUsage, MemoryBlob, PersistClient
from persist.casts import cast_column
from stash import Stash

F = pa.field("v", pa.int64())


@pytest.mark.parametrize(
    ("values", "field", "ok"),
    [
        (pa.array([1, 2], pa.int32()), F, True),
        (pa.array([1.0, 2.0]), F, True),
        (pa.array([1.5]), F, False),  # truncation
        (pa.array(["1"]), F, False),  # text is not a number
        (pa.array([2**40], pa.int64()), pa.field("v", pa.int32()), False),  # overflow
        (pa.array([1e300]), pa.field("v", pa.float32()), False),  # finite made infinite
        (pa.array([float("inf")]), pa.field("v", pa.float32()), True),
        (pa.array([None], pa.int64()), pa.field("v", pa.int64(), False), False),
        (pa.nulls(2), F, True),
        (pa.array([1_500], pa.timestamp("ns")), pa.field("t", pa.timestamp("us")), False),
        (pa.array([1_000], pa.timestamp("ns")), pa.field("t", pa.timestamp("us")), True),
        (pa.array([1], pa.int64()), pa.field("d", pa.decimal128(22, 2)), True),
    ],
)
def test_cast_column(values: pa.Array, field: pa.Field, ok: bool) -> None:
    if ok:
        assert cast_column(values, field, "x").type == field.type
    else:
        with pytest.raises(InvalidUsage, match=repr(field.name)):
            cast_column(values, field, "x")


@pytest.fixture()
def client() -> Iterator[PersistClient]:
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="inline")
    yield c
    c.close()
    s.close()


# (update expression, merge SQL) giving the same values to the int64 column n
PAIRS: list[tuple[Any, str, bool]] = [
    (pc.field("n") + 1, "target.n + 1", True),
    (pc.field("n").cast(pa.float64()) / 2, "target.n / 2", False),  # 0.5 truncated
    (pc.field("n").cast(pa.string()), "CAST(target.n AS VARCHAR)", False),  # text
]


@pytest.mark.parametrize(("expr", "sql", "ok"), PAIRS)
def test_update_and_merge_cast_alike(client: PersistClient, expr: Any, sql: str, ok: bool) -> None:
    key = pa.schema([pa.field("id", pa.int64(), False)])
    val = pa.schema([("n", pa.int64())])
    rows = pa.table({"id": [1], "n": [1]})
    outcomes = []
    for name, change in (
        ("u", lambda w: w.update(pc.field("id") == 1, {"n": expr})),
        ("m", lambda w: w.merge(rows).when_matched_update(set={"n": sql}).execute()),
    ):
        w, r = client.open(name, key, val)
        w.upsert(rows)
        try:
            change(w)
            t = w.fetch_recent_upper().as_option() - 1
            outcomes.append(r.snapshot(t).column("n").to_pylist())
        except InvalidUsage:
            outcomes.append("refused")
    assert outcomes[0] == outcomes[1]
    assert (outcomes[0] != "refused") == ok
