"""Crash campaign for row-level changes: a child applies upserts, updates and deletes,
alone through write handles and together in transactions with a catalog entry (stash
consensus on SQLite or Postgres, a FileBlob), in a loop, and is SIGKILLed at random
moments (mostly inside a change: its read, plan, upload or compare-and-append).  After
each kill the stores are reopened and checked against a dict model replaying the
changes (``tests/reliability/crash_child_rows.py``):

* **no partial change, none applied twice**: the shards and the catalog equal the model
  after exactly the acknowledged changes, or after them and the one in flight at the
  kill; nothing in between (a change half applied, a transaction in one shard but not
  the other or not in the catalog) and nothing beyond (an update applied twice would
  add one more to ``v``);
* **no lost change**: every acknowledged change is there (implied by the above);
* **one live row per key, each with ``_diff`` 1**;
* at the end, ``persist.fsck`` finds no damage in either shard.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from persist import fsck
from stash import Stash
from tests.reliability.campaign import runs
from tests.reliability.crash_child_rows import (
    CATALOG,
    KEY_SCHEMA,
    SHARDS,
    VALUE_SCHEMA,
    Model,
    initial,
    make_client,
    model_change,
)
from tests.reliability.crash_harness import CAMPAIGN_LIMIT, checker_clock, kill_runs, record_kills
from tests.support.dbutil import migrate_to_head

CHILD = Path(__file__).with_name("crash_child_rows.py")


def _observed(url: str, blob: str) -> Model:
    """The shards' live rows and the catalog's keys, checked one row per key with
    ``_diff`` 1."""
    with Stash.open(url, fenced=False) as s:
        client = make_client(s, blob, clock=checker_clock)
        try:
            shards: dict[str, dict[int, tuple[int, str]]] = {}
            for shard in SHARDS:
                upper = client.inspect(shard).upper.as_option()
                assert upper is not None and upper > 0
                r = client.open_reader(shard, KEY_SCHEMA, VALUE_SCHEMA)
                snap = r.snapshot(upper - 1)
                r.expire()
                diffs = set(snap.column("_diff").to_pylist())
                assert diffs <= {1}, f"{shard}: a row with _diff other than 1: {diffs}"
                rows: dict[int, tuple[int, str]] = {}
                for row in snap.to_pylist():
                    assert row["id"] not in rows, f"{shard}: two live rows of key {row['id']}"
                    rows[row["id"]] = (row["v"], row["tag"])
                shards[shard] = rows
            cat = s.collection(CATALOG, key="str", value="json")
            counts: dict[str, int] = {}
            for (k, _v), _t, d in s.iter(cat):
                counts[k] = counts.get(k, 0) + d
            assert set(counts.values()) <= {1}, f"catalog entries applied twice: {counts}"
            return shards, set(counts)
        finally:
            client.close()


def _setup(url: str, blob: str) -> None:
    import pyarrow as pa

    with Stash.open(url, fenced=False) as s:
        c = make_client(s, blob)
        rows0 = initial()[0][SHARDS[0]]
        table = pa.table(
            {
                "id": pa.array(sorted(rows0), pa.int64()),
                "v": [rows0[k][0] for k in sorted(rows0)],
                "tag": [rows0[k][1] for k in sorted(rows0)],
            },
            schema=pa.schema([*KEY_SCHEMA, *VALUE_SCHEMA]),
        )
        for shard in SHARDS:
            w, _ = c.open(shard, KEY_SCHEMA, VALUE_SCHEMA)
            w.upsert(table)
            w.expire()
        s.collection(CATALOG, key="str", value="json")
        c.close()


def _campaign(url: str, tmp_path: Path, kills: int, label: str) -> None:
    blob = f"file://{tmp_path / 'blob'}"
    _setup(url, blob)
    model = initial()
    acked_total = in_flight_durable = 0
    for run, acks in kill_runs(
        CHILD, [url, blob], tmp_path, kills, seed=31, window=(0.1, 1.5), label=label
    ):
        acked = [int(fields[1]) for fields in acks]
        assert acked == list(range(len(acked)))
        acked_total += len(acked)
        after_acked = model
        for i in acked:
            after_acked = model_change(after_acked, run, i)
        with_in_flight = model_change(after_acked, run, len(acked))
        got = _observed(url, blob)
        if got == after_acked:
            model = after_acked
        elif got == with_in_flight:
            model = with_in_flight
            in_flight_durable += 1
        else:
            raise AssertionError(
                f"{label} run {run}: after {len(acked)} acknowledged changes the stores match "
                f"neither them nor them and the one in flight (a partial, lost or doubled "
                f"change):\n got {got}\n acked {after_acked}\n +1 {with_in_flight}"
            )
    with Stash.open(url, fenced=False) as s:
        client = make_client(s, blob, clock=checker_clock)
        try:
            for shard in SHARDS:
                damage = fsck(client, shard)
                assert damage.ok, f"{shard}: fsck: {damage.damage()}"
        finally:
            client.close()
    record_kills(
        f"crash: row changes on {label}",
        kills,
        acked_total,
        in_flight_durable,
    )
    assert acked_total > 0


@pytest.mark.campaign
@pytest.mark.timeout(CAMPAIGN_LIMIT)
def test_crash_row_changes_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/crash.db"
    _campaign(url, tmp_path, runs(4, 100), "sqlite + file blob")


@pytest.mark.campaign
@pytest.mark.timeout(CAMPAIGN_LIMIT)
@pytest.mark.postgres
def test_crash_row_changes_postgres(tmp_path: Path, postgres_url: str) -> None:
    migrate_to_head(postgres_url)
    _campaign(postgres_url, tmp_path, runs(3, 50), "postgres + file blob")
