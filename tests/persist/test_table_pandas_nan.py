"""``Table.to_pandas`` keeps a float column's NaN apart from its nulls, so
``upsert(to_pandas())`` writes nothing and never turns a NaN into a null: pyarrow's
default float64 column shows both as NaN, and pandas' NaN reads back as a null (pandas'
missing value), so a float column holding a NaN (as a key or a value) was rewritten with
nulls (a NaN-only column lost its NaNs; a NaN key became a null key)."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pytest

from persist import MemoryBlob, PersistClient
from stash import Stash

NAN = float("nan")


@pytest.fixture
def client() -> Iterator[PersistClient]:
    c = PersistClient(Stash.open("memory://", fenced=False), MemoryBlob(), compaction="off")
    yield c
    c.close()


@pytest.mark.parametrize("typ", [pa.float64(), pa.float32()], ids=str)
@pytest.mark.parametrize(
    "values", [[NAN, 1.5, 2.5], [NAN, None, 2.5], [None, 1.5, 2.5]], ids=["nan", "both", "null"]
)
@pytest.mark.parametrize("role", ["key", "value"])
def test_upsert_of_to_pandas_keeps_nan_and_writes_nothing(
    client: PersistClient, typ: pa.DataType, values: list[float | None], role: str
) -> None:
    schema = pa.schema([("k", typ if role == "key" else pa.int64()), ("v", typ), ("n", pa.int64())])
    t = client.create_table("t", schema, key=["k"])
    k = pa.array(values, typ) if role == "key" else pa.array([1, 2, 3])
    rows = pa.table({"k": k, "v": pa.array(values, typ), "n": [1, 2, 3]}, schema=schema)
    t.append(rows)
    before = t.details()["upper"]
    r = t.upsert(t.to_pandas())
    assert (r.inserted, r.retracted) == (0, 0)
    assert t.details()["upper"] == before
    back = t.to_arrow().sort_by("n")
    assert back.column("v").is_null().to_pylist() == [v is None for v in values]
    assert _rows(back) == _rows(rows)


def _rows(t: pa.Table) -> list[list[object]]:
    """The rows of ``t``, NaN as a string (NaN is not equal to itself)."""
    return [[("NaN" if x != x else x) for x in r.values()] for r in t.to_pylist()]
