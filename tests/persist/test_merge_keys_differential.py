"""Differential property: a merge written as an upsert
(``when_matched_update_all().when_not_matched_insert_all()``) matches keys as the
upsert does, over every key type of :mod:`tests.persist.arrow_strategies` (nanosecond
timestamps, times and durations, floats with ``-0.0`` and NaN, decimals, binaries,
nulls): on a shard holding one row per key, the two give the same outcomes (counts, or
the error refusing the change) and the same live rows, change after change.  Both go
through :mod:`persist.key_identity`, so this checks the merge's matching against the
one definition of a key."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from persist import MemoryBlob, PersistClient, PersistError
from persist.write import WriteHandle
from stash import Stash
from tests.persist.test_row_paths_differential import _examples, _live
from tests.reliability.campaign import runs


@pytest.fixture(scope="module")
def client() -> Iterator[PersistClient]:
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="inline", inline_max_bytes=0)
    try:
        yield c
    finally:
        c.close()
        s.close()


def _upsert(w: WriteHandle, rows: Any) -> tuple[int, int]:
    ch = w.upsert(rows)
    return ch.inserted, ch.retracted


def _merge(w: WriteHandle, rows: Any) -> tuple[int, int]:
    m = w.merge(rows).when_matched_update_all().when_not_matched_insert_all().execute()
    return m.num_target_rows_inserted + m.num_target_rows_updated, m.num_target_rows_updated


@pytest.mark.sized
@settings(
    max_examples=runs(25, 300),
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
@given(example=_examples())
def test_a_merge_matches_keys_as_upsert_does(client: PersistClient, example: Any) -> None:
    ks, vs, _, ops = example
    upserts = [op[1] for op in ops if op[0] == "upsert"]
    results = {}
    for name, change in (("upsert", _upsert), ("merge", _merge)):
        w, r = client.open(f"m-{uuid.uuid4().hex}", ks, vs)
        r.expire()
        outcomes: list[Any] = []
        for rows in upserts:
            try:
                outcomes.append(change(w, rows))
            except PersistError as e:
                outcomes.append(type(e).__name__)
        results[name] = (outcomes, _live(w))
        w.expire()
    assert results["merge"] == results["upsert"]
