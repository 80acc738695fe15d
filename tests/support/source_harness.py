"""In-process driver of the persist Spark source's reader (no JVM): plans partitions and
reads them exactly as Spark's Python workers do, so models can be checked cheaply."""

from __future__ import annotations

import math
import pickle
from collections import Counter
from typing import Any

import pyarrow as pa

from persist import PersistClient
from stash import Stash


def build(
    stash_url: str,
    blob_uri: str,
    name: str,
    keys: pa.Schema,
    values: pa.Schema,
    appends: list[list[list[tuple[tuple, tuple, int, int]]]],
    *,
    compact_after: int = 99,
    target_part_bytes: int = 150,
) -> int:
    """Each append: a list of runs, each run a list of (key, value, time_offset, diff).
    Returns the final upper."""
    with Stash.open(stash_url, fenced=False) as s:
        client = PersistClient(
            s, blob_uri, compaction="off", inline_max_bytes=0, target_part_bytes=target_part_bytes
        )
        try:
            write, read = client.open(name, keys, values)
            upper = 0
            for i, runs in enumerate(appends):
                if i == compact_after:
                    client.compaction = "inline"
                builder = write.builder(upper)
                for run in runs:
                    builder.add([((k, v), upper + t, d) for k, v, t, d in run])
                write.compare_and_append_batch([builder.finish(upper + 3)], upper, upper + 3)
                upper += 3
            write.expire()
            read.expire()
        finally:
            client.close()
    return upper


def model(appends, as_of: int) -> Counter:
    c: Counter = Counter()
    upper = 0
    for runs in appends:
        for run in runs:
            for k, v, t, d in run:
                if upper + t <= as_of:
                    c[norm(tuple(k) + tuple(v))] += d
        upper += 3
    return Counter({r: d for r, d in c.items() if d != 0})


def norm(row):
    return tuple(
        ("NaN",)
        if isinstance(x, float) and math.isnan(x)
        else (0.0 if isinstance(x, float) and x == 0.0 else x)
        for x in row
    )


def read_source(
    options: dict[str, str], filters: list[Any] | None = None, ncols: int | None = None
) -> list[tuple]:
    """Rows (data columns + _diff) the source yields, reading every planned partition
    after a pickle round trip (as Spark ships them); filters are pushed as on a PySpark
    that plans each query afresh (where the reader takes them)."""
    from unittest import mock

    from spark.persist_source import PersistDataSource

    ds = PersistDataSource(dict(options))
    schema = ds.schema()
    reader = ds.reader(schema)
    if filters:
        with mock.patch("spark.persist_reader.spark_reuses_pushed_plans", return_value=False):
            rest = reader.pushFilters(list(filters))
        assert list(rest) == [], f"filters not taken: {rest}"
    reader = pickle.loads(pickle.dumps(reader))
    parts = reader.partitions()
    out = []
    for p in parts or [None]:
        p = pickle.loads(pickle.dumps(p))
        r2 = pickle.loads(pickle.dumps(reader))
        for b in r2.read(p):
            out.extend(tuple(r.values()) for r in b.to_pylist())
    return out
