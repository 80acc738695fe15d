"""Crash campaign for transactions across shards and stash collections: a
child commits multi-shard transactions, each with a catalog row (stash consensus on
SQLite or Postgres, a FileBlob), in a loop and is SIGKILLed at random moments, mostly
inside ``Txn.commit_at``.  After each kill:

* every transaction is all or nothing: present, whole (all of its rows) and once (diff
  1), in every shard it wrote and in the catalog, or absent from all of them (``partial``
  counts the others);
* every acknowledged transaction is present (``lost``); at most one unacknowledged one
  (the one in flight at the kill) is durable;
* a transaction's rows sit at one time in all of its shards (its commit time; checked on
  each run's newest transaction, the one a kill may have cut);
* the shards reopen, their Spine traces validate; GC (grace 0), once the killed child's
  leases ran out, leaves no unreferenced part, and ``persist.fsck`` finds no damage.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from persist import PersistClient
from stash import Stash
from tests.reliability.campaign import runs
from tests.reliability.crash_child_txn import (
    CATALOG,
    KEY_SCHEMA,
    SHARDS,
    VALUE_SCHEMA,
    batch_rows,
    make_client,
    payload,
    txn_shards,
)
from tests.reliability.crash_harness import (
    CAMPAIGN_LIMIT,
    batch_counts,
    checker_clock,
    gc_then_check,
    kill_runs,
    record_kills,
)
from tests.support.dbutil import migrate_to_head

CHILD = Path(__file__).with_name("crash_child_txn.py")


def _first_visible(client: PersistClient, shard: str, txn: tuple[int, int]) -> int:
    """The least as_of at which transaction ``txn`` shows in ``shard`` (bisection)."""
    upper = client.inspect(shard).upper.as_option()
    assert upper is not None
    lo, hi = 0, upper - 1  # it shows as of hi

    def shows(t: int) -> bool:
        snap = client.snapshot_many({shard: t})[shard]
        pairs = zip(snap.column("run").to_pylist(), snap.column("i").to_pylist(), strict=True)
        return txn in set(pairs)

    while lo < hi:
        mid = (lo + hi) // 2
        if shows(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _check_after_kill(
    url: str, blob: str, run: int, acked: list[tuple[int, int]]
) -> dict[str, int]:
    """Reopen the shards and the catalog and check the campaign's invariants."""
    with Stash.open(url, fenced=False) as s:
        client = make_client(s, blob, clock=checker_clock)
        try:
            # Where each transaction shows up: shard -> (run, i) -> (row count, times).
            seen: dict[str, Counter[tuple[int, int]]] = {}
            for shard in SHARDS:
                st = client.inspect(shard)
                st.trace.validate()
                upper = st.upper.as_option()
                assert upper is not None
                rows: Counter[tuple[int, int]] = Counter()
                if upper > 0:
                    r = client.open_reader(shard, KEY_SCHEMA, VALUE_SCHEMA)
                    rows = batch_counts(r.snapshot(upper - 1), payload)
                    r.expire()
                seen[shard] = rows
            cat = s.collection(CATALOG, key="str", value="json")
            catalog: Counter[tuple[int, int]] = Counter()
            for (k, v), _t, d in s.iter(cat):
                a, b = (int(x) for x in k.split("-"))
                assert v == {"rows": batch_rows(a, b)}
                catalog[(a, b)] += d
            assert set(catalog.values()) <= {1}, "duplicated catalog rows"
            txns = set(catalog) | {t for rows in seen.values() for t in rows}
            partial = []
            for t in sorted(txns):
                want = set(txn_shards(*t))
                whole = {sh for sh in SHARDS if seen[sh].get(t) == batch_rows(*t)}
                there = {sh for sh in SHARDS if t in seen[sh]}
                if whole != want or there != want or t not in catalog:
                    partial.append((t, sorted(there), t in catalog))
            assert not partial, f"run {run}: partial transactions {partial[:5]}"
            lost = [t for t in acked if t not in txns]
            assert not lost, f"run {run}: acknowledged transactions lost: {lost[:5]}"
            extra = {t for t in txns if t[0] == run} - set(acked)
            assert len(extra) <= 1, f"run {run}: unacknowledged transactions {extra}"
            # One commit time per transaction across its shards: the first as_of at
            # which the run's newest transaction shows is the same in all of them.
            mine = sorted(t for t in txns if t[0] == run)
            if mine:
                newest = mine[-1]
                firsts = {sh: _first_visible(client, sh, newest) for sh in txn_shards(*newest)}
                assert len(set(firsts.values())) == 1, f"run {run}: {newest} at {firsts}"
            gc_deleted = 0
            parts = 0
            for shard in SHARDS:
                deleted, referenced = gc_then_check(client, shard, run)
                gc_deleted += deleted
                parts += referenced
            return {"unacked": len(extra), "gc_deleted": gc_deleted, "parts": parts}
        finally:
            client.close()


def _campaign(url: str, tmp_path: Path, kills: int, label: str) -> None:
    blob_root = tmp_path / "blob"
    blob = f"file://{blob_root}"
    with Stash.open(url, fenced=False) as s:  # create the shards before the first kill
        c = make_client(s, blob)
        for shard in SHARDS:
            c.open_writer(shard, KEY_SCHEMA, VALUE_SCHEMA)
        s.collection(CATALOG, key="str", value="json")
        c.close()
    acked_total = unacked_seen = gc_deleted = 0
    for run, acks in kill_runs(
        CHILD, [url, blob], tmp_path, kills, seed=14, window=(0.1, 2.0), label=label
    ):
        acked = [(int(a), int(b)) for a, b in acks]
        acked_total += len(acked)
        fig = _check_after_kill(url, blob, run, acked)
        unacked_seen += fig["unacked"]
        gc_deleted += fig["gc_deleted"]
    record_kills(
        f"crash: transactions on {label}",
        kills,
        acked_total,
        unacked_seen,
        gc_deleted_parts=gc_deleted,
    )
    assert acked_total > 0


@pytest.mark.campaign
@pytest.mark.timeout(CAMPAIGN_LIMIT)
def test_crash_txn_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/crash.db"
    _campaign(url, tmp_path, runs(8, 100), "sqlite + file blob")


@pytest.mark.campaign
@pytest.mark.timeout(CAMPAIGN_LIMIT)
@pytest.mark.postgres
def test_crash_txn_postgres(tmp_path: Path, postgres_url: str) -> None:
    migrate_to_head(postgres_url)
    _campaign(postgres_url, tmp_path, runs(4, 100), "postgres + file blob")
