"""``Table.to_pandas`` is exact, so ``upsert(to_pandas())`` writes nothing: an integer
column holding a null used to come back as float64 (pyarrow's default), rounding
integers beyond 2**53, so the upsert of the unchanged frame inserted rows under other
keys (or refused uint64 values it had rounded past their maximum); a ``time64[ns]``
column with a value below the microsecond made ``to_pandas`` raise (Python's ``time``
holds microseconds)."""

from __future__ import annotations

from collections.abc import Iterator

import pandas as pd
import pyarrow as pa
import pytest

from persist import MemoryBlob, PersistClient
from stash import Stash


@pytest.fixture
def client() -> Iterator[PersistClient]:
    c = PersistClient(Stash.open("memory://", fenced=False), MemoryBlob())
    yield c
    c.close()


@pytest.mark.parametrize(
    ("typ", "values"),
    [
        (pa.int64(), [2**60 + 1, 2**60, None]),
        (pa.uint64(), [2**64 - 1, 0, None]),
        (pa.int8(), [-128, 127, None]),
        (pa.time64("ns"), [1, 86_399_999_999_999, None]),
    ],
    ids=["int64", "uint64", "int8", "time64ns"],
)
def test_upsert_of_to_pandas_writes_nothing(
    client: PersistClient, typ: pa.DataType, values: list[int | None]
) -> None:
    schema = pa.schema([("k", typ), ("v", typ), ("n", pa.int64())])
    t = client.create_table("t", schema, key=["k"])
    rows = pa.table(
        {"k": pa.array(values, typ), "v": pa.array(values, typ), "n": [1, 2, 3]}, schema=schema
    )
    t.append(rows)
    df = t.to_pandas()
    assert isinstance(df, pd.DataFrame) and list(df.columns) == ["k", "v", "n"]
    assert df["n"].dtype == "int64"  # columns without a null keep numpy dtypes
    before = t.details()["upper"]
    r = t.upsert(df)
    assert (r.inserted, r.retracted) == (0, 0)
    assert t.details()["upper"] == before
    assert t.to_arrow().sort_by("n").equals(rows)


def test_a_column_alone_and_no_rows(client: PersistClient) -> None:
    schema = pa.schema([("k", pa.int64()), ("v", pa.time64("ns"))])
    t = client.create_table("t", schema, key=["k"])
    assert t.to_pandas().shape == (0, 2)
    t.append(
        pa.table(
            {
                "k": pa.array([None, 2**62 + 1], pa.int64()),
                "v": pa.array([1, None], pa.time64("ns")),
            }
        )
    )
    only = t.to_pandas(columns=["k"])
    assert list(only.columns) == ["k"] and only["k"].dtype == "Int64"
    assert sorted(only["k"].dropna().tolist()) == [2**62 + 1]
    assert list(t.to_pandas(columns=["v", "k"]).columns) == ["v", "k"]
