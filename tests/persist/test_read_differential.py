"""Differential properties of persist's read paths, over every column type a shard
accepts and every filter shape a read accepts.

Each example writes a shard (one to three appends) through inline parts or through blob
parts, then reads it back by a *fresh* client (a new ``PersistClient`` over a new
connection to the same SQLite stash and the same blob directory, so every part
reference, key sample and statistic is decoded from the stash) and compares:

* ``snapshot(as_of)`` with the model (:func:`arrow_strategies.model_snapshot`: a
  multiset of canonical rows, Python equality after the shard's canonicalisation, NaN
  one value and ``-0.0 == 0.0``);
* ``snapshot_stream(as_of)`` with ``snapshot(as_of)``, row for row;
* ``snapshot(as_of, filter=f, columns=c)`` with ``snapshot(as_of).filter(f).select(c)``,
  row for row, or, where that raises, with an ``InvalidUsage`` naming the filter.

Examples are bounded for ``make test``; ``STASH_RELIABILITY=long`` runs many more. Each
run records its figures as a reliability campaign row (``tests/reliability/campaign.py``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist import InvalidUsage, PersistClient
from persist.fetch import stream_snapshot
from persist.merge import decode_keys, encode_keys
from persist.updates import updates_schema
from stash import Stash
from tests.persist.arrow_strategies import (
    COLUMN_TYPES,
    canonical_rows,
    close_client,
    filters,
    fresh_client,
    model_snapshot,
    shard_schemas,
    update_tables,
    write_shard,
    written_values,
)
from tests.reliability.campaign import record, runs


@pytest.fixture(scope="module")
def where(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A SQLite stash URL and a blob directory URL shared by the module's examples (each
    example writes its own shard)."""
    d: Path = tmp_path_factory.mktemp("differential")
    url = f"sqlite:///{d / 'stash.db'}"
    Stash.open(url).close()
    yield url, f"file://{d / 'blob'}"


@pytest.fixture(scope="module")
def tally() -> Iterator[dict[str, Counter[str]]]:
    """Counts of the module's examples, recorded as reliability campaign rows at its end
    (``docs/reliability.md``): runs, reads compared with the model (``acknowledged``),
    filters refused with ``InvalidUsage`` where ``snapshot().filter()`` raises
    (``faults``); a mismatch or a raw Arrow error fails the test instead."""
    counts: dict[str, Counter[str]] = {"small": Counter(), "large": Counter()}
    yield counts
    names = {
        "small": "reads: every column type and filter shape, inline and blob parts, fresh client",
        "large": "reads: large blob parts (row groups, dictionaries, key ranges), fresh client",
    }
    for kind, c in counts.items():
        if c["runs"]:
            record(
                names[kind],
                runs=c["runs"],
                faults=c["refused"],
                acknowledged=c["reads"],
                lost=0,
                duplicated=0,
                partial=0,
                unclear=0,
                types=len(COLUMN_TYPES),
            )


def _rows(table: pa.Table) -> list[tuple[Any, ...]]:
    return canonical_rows(table)


@st.composite
def _shards(draw: st.DrawFn) -> tuple[pa.Schema, pa.Schema, list[pa.Table], bool, str]:
    ks, vs = draw(shard_schemas())
    n = draw(st.integers(1, 3))
    tables = [draw(update_tables(ks, vs, times=(i,))) for i in range(n)]
    return ks, vs, tables, draw(st.booleans()), draw(st.sampled_from(["off", "inline"]))


def _check_reads(
    r: Any,
    as_of: int,
    tables: list[pa.Table],
    data_cols: list[str],
    data: st.DataObject,
    tally: Counter[str],
) -> None:
    """The reads of ``r`` at ``as_of`` against the model of ``tables`` (see the module
    docstring), with a drawn filter and projection; ``tally`` counts the reads compared
    and the filters refused (as ``snapshot().filter()`` refuses them)."""
    snap = r.snapshot(as_of)
    assert model_snapshot([snap], as_of, data_cols) == model_snapshot(tables, as_of, data_cols)
    assert all(d != 0 for d in snap.column("_diff").to_pylist())

    streamed = [row for b in r.snapshot_stream(as_of) for row in _rows(b)]
    assert streamed == _rows(snap)

    schema = snap.schema
    seen: dict[str, list[Any]] = {}
    for t in tables:
        for k, v in written_values(t).items():
            seen.setdefault(k, []).extend(v[:50])
    filt = data.draw(filters(schema, seen), label="filter")
    names = [*schema.names]
    cols = data.draw(
        st.none()
        | st.permutations(names).flatmap(lambda p: st.integers(1, len(p)).map(lambda k: p[:k])),
        label="columns",
    )
    try:
        want = snap.filter(filt)
    except pa.ArrowException:
        with pytest.raises(InvalidUsage, match="filter"):
            r.snapshot(as_of, filter=filt, columns=cols)
        tally["refused"] += 1
        tally["reads"] += 2
        return
    if cols is not None:
        want = want.select(cols)
    got = r.snapshot(as_of, filter=filt, columns=cols)
    assert got.column_names == want.column_names
    assert _rows(got) == _rows(want)
    tally["reads"] += 3


@pytest.mark.sized
@settings(
    max_examples=runs(40, 600),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(shard=_shards(), data=st.data())
def test_reads_of_a_fresh_client_equal_the_model(
    where: tuple[str, str],
    tally: dict[str, Counter[str]],
    shard: tuple[pa.Schema, pa.Schema, list[pa.Table], bool, str],
    data: st.DataObject,
) -> None:
    ks, vs, tables, inline, compaction = shard
    name = write_shard(*where, inline, ks, vs, tables, compaction=compaction)
    c = fresh_client(*where, inline)
    try:
        r = c.open_reader(name, ks, vs)
        _check_reads(r, len(tables) - 1, tables, [*ks.names, *vs.names], data, tally["small"])
        tally["small"]["runs"] += 1
    finally:
        close_client(c)


@st.composite
def _large_shards(draw: st.DrawFn) -> tuple[pa.Schema, pa.Schema, list[pa.Table]]:
    """Two appends of about 20,000 updates each, their values drawn from a few dozen
    per column (so parts hold dictionary pages, several row groups and key samples)."""
    ks, vs = draw(shard_schemas(max_keys=1, max_values=2))
    pools = [draw(update_tables(ks, vs, times=(0,), max_rows=30, dictionary=False)) for _ in "ab"]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tables = []
    for i, pool in enumerate(pools):
        if pool.num_rows == 0:
            tables.append(pool)
            continue
        idx = pa.array(rng.integers(0, pool.num_rows, size=_LARGE_ROWS), pa.int64())
        t = pool.take(idx)
        t = t.set_column(
            t.schema.get_field_index("_time"), "_time", pa.array(np.full(t.num_rows, i))
        )
        tables.append(t)
    return ks, vs, tables


#: Updates per append of the large examples (two row groups of ROW_GROUP_MIN_ROWS and
#: more than the dictionary read's threshold).
_LARGE_ROWS = 40_000


@pytest.mark.sized
@settings(
    max_examples=runs(4, 60),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(shard=_large_shards(), data=st.data())
def test_reads_of_large_blob_parts_equal_the_model(
    where: tuple[str, str],
    tally: dict[str, Counter[str]],
    shard: tuple[pa.Schema, pa.Schema, list[pa.Table]],
    data: st.DataObject,
) -> None:
    """As above, for parts of several row groups read with dictionary pages, cut into
    key ranges by their samples, several parts per batch."""
    ks, vs, tables = shard
    name = write_shard(*where, False, ks, vs, tables, target_part_bytes=256 * 1024)
    c = fresh_client(*where, False)
    try:
        r = c.open_reader(name, ks, vs)
        _check_reads(r, 1, tables, [*ks.names, *vs.names], data, tally["large"])
        _check_key_ranges(c, r, ks, vs, data)
        tally["large"]["runs"] += 1
        tally["large"]["reads"] += 1
    finally:
        close_client(c)


def _check_key_ranges(
    c: PersistClient, r: Any, ks: pa.Schema, vs: pa.Schema, data: st.DataObject
) -> None:
    """``stream_snapshot`` over the key ranges ``(-inf, b1)``, ``[b1, b2)``, ``[b2, inf)``
    (the bounds two snapshot keys, passed through JSON as encoded keys: a key holding
    NUL characters is a bound too, though such keys are never recorded as part key
    samples in the shard state) yields the snapshot's rows, in order, exactly once."""
    snap = r.snapshot(1)
    if snap.num_rows == 0:
        return
    i, j = sorted(data.draw(st.lists(st.integers(0, snap.num_rows - 1), min_size=2, max_size=2)))

    def bound(row: int) -> pa.Table:
        sample = encode_keys(snap.select(ks.names).slice(row, 1))
        return decode_keys(json.loads(json.dumps([list(x) for x in sample])), ks)

    b1, b2 = bound(i), bound(j)
    batches = r.snapshot_batches(1)
    schema = updates_schema(ks, vs)
    got: list[tuple[Any, ...]] = []
    for lower, upper in ((None, b1), (b1, b2), (b2, None)):
        for t in stream_snapshot(
            c.blob, batches, schema, ks.names, vs.names, 1, key_schema=ks, lower=lower, upper=upper
        ):
            got.extend(_rows(t))
    assert got == _rows(snap)
