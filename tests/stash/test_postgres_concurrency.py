"""Concurrent writers on one Postgres stash: four processes doing read-modify-write
appends on shared collections (``TypedCollection.upsert`` / ``upsert_key`` with retry on
a lost race, a counter, and atomic appends to overlapping pairs of collections); readers
that must never see half an append; and collection creation racing on the unique name.

What must hold: every acknowledged write is visible exactly once; no write is lost (the
counter equals the number of acknowledged increments); each collection's acknowledged
uppers are distinct and grow in every process; a pair append is in both collections or
in neither; no deadlock is ever detected by the server.
"""

from __future__ import annotations

import random
import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from sqlalchemy.engine import make_url

from stash import (
    AppendLowerMismatch,
    PeekSinceUpperError,
    Stash,
    StashError,
    TypedCollection,
)
from tests.support.dbutil import migrate_to_head
from tests.support.pgserver import PostgresServer
from tests.support.procs import process_context

pytestmark = pytest.mark.postgres

PROCS = 4
OPS = 40
PAIRS = [("a", "b"), ("b", "c"), ("c", "a")]
R = TypeVar("R")


def _retry(fn: Callable[[], R]) -> R:
    while True:
        try:
            return fn()
        except AppendLowerMismatch:
            continue


def _worker(url: str, wid: int, ack_path: str) -> None:
    """One process: OPS operations, each acknowledged by a line in ``ack_path`` once the
    stash returned from it."""
    rnd = random.Random(wid)
    shared = TypedCollection("shared", key="str", value="int")
    latest = TypedCollection("latest", key="str", value="int")
    with Stash.open(url, fenced=False) as s, open(ack_path, "w") as acks:
        counter = s.collection("counter", key="str", value="int")
        multi = {n: s.collection(n, key="str", value="int") for n in "abc"}

        def increment() -> int:
            b = counter.make_batch(s)  # first the batch (its lower), then the read
            n = s.peek_key_one(counter, "n")
            assert n is not None
            counter.append_to_batch(b, "n", n, -1)
            counter.append_to_batch(b, "n", n + 1, 1)
            s.append([b])
            return int(b.upper.as_option())  # type: ignore[arg-type]

        def pair(names: tuple[str, str], key: str) -> list[tuple[str, int]]:
            batches = []
            for n in names:
                b = multi[n].make_batch(s)
                multi[n].append_to_batch(b, key, wid, 1)
                batches.append(b)
            rnd.shuffle(batches)  # the stash orders its locks, whatever the batch order
            s.append(batches)
            return [(b.collection.name, int(b.upper.as_option())) for b in batches]  # type: ignore[arg-type]

        for i in range(OPS):
            op = i % 4
            if op == 0:
                _retry(lambda i=i: shared.upsert(s, [(f"{wid}-{i}", i)]))
                acks.write(f"shared {wid}-{i} {i}\n")
            elif op == 1:
                _retry(lambda i=i: latest.upsert_key(s, f"w{wid}", i))
                acks.write(f"latest w{wid} {i}\n")
            elif op == 2:
                upper = _retry(increment)
                acks.write(f"counter {upper}\n")
            else:
                names = PAIRS[(i // 4 + wid) % 3]
                key = f"{wid}-{i}"
                done = _retry(lambda names=names, key=key: pair(names, key))
                acks.write(f"pair {key} " + " ".join(f"{n}:{u}" for n, u in done) + "\n")
            acks.flush()


def _deadlocks(server: PostgresServer, db: str) -> int:
    with server.connect(db) as conn:
        row = conn.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = %s", (db,)
        ).fetchone()
    return int(row[0]) if row else 0


def test_four_processes_read_modify_write(
    postgres_url: str, postgres_server: PostgresServer, tmp_path: Path
) -> None:
    migrate_to_head(postgres_url)
    db = make_url(postgres_url).database
    assert db
    with Stash.open(postgres_url, fenced=False) as s:
        counter = s.collection("counter", key="str", value="int")
        b = counter.make_batch(s)
        counter.append_to_batch(b, "n", 0, 1)
        s.append([b])
    deadlocks_before = _deadlocks(postgres_server, db)

    ctx = process_context()
    procs = [
        ctx.Process(target=_worker, args=(postgres_url, w, str(tmp_path / f"ack{w}")))
        for w in range(PROCS)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0] * PROCS

    acks = {w: (tmp_path / f"ack{w}").read_text().splitlines() for w in range(PROCS)}
    assert all(len(lines) == OPS for lines in acks.values())
    with Stash.open(postgres_url, mode="readonly") as r:
        shared = r.peek_one(r.collection("shared", key="str", value="int"))
        latest = r.peek_one(r.collection("latest", key="str", value="int"))
        n = r.peek_one(r.collection("counter", key="str", value="int"))
        multi = {x: r.peek(r.collection(x, key="str", value="int")) for x in "abc"}
        uppers = {x: r.upper(r.collection(x, key="str", value="int")).as_option() for x in "abc"}

    shared_acked: dict[str, int] = {}
    counter_uppers: list[int] = []
    pair_uppers: dict[str, list[int]] = defaultdict(list)
    pair_keys: dict[str, set[str]] = defaultdict(set)
    for w, lines in acks.items():
        last_latest = None
        mine: dict[str, list[int]] = defaultdict(list)
        for line in lines:
            kind, *rest = line.split()
            if kind == "shared":
                shared_acked[rest[0]] = int(rest[1])
            elif kind == "latest":
                last_latest = int(rest[1])
            elif kind == "counter":
                mine["counter"].append(int(rest[0]))
                counter_uppers.append(int(rest[0]))
            else:
                key = rest[0]
                for item in rest[1:]:
                    name, u = item.split(":")
                    mine[name].append(int(u))
                    pair_uppers[name].append(int(u))
                    pair_keys[name].add(key)
        assert latest[f"w{w}"] == last_latest
        for us in mine.values():  # uppers grow within every process
            assert all(a < b for a, b in zip(us, us[1:], strict=False))
    # Every acknowledged upsert is there exactly once (peek_one checks multiplicity 1).
    assert shared == shared_acked
    # No lost update: the counter counts every acknowledged increment, once.
    assert n == {"n": len(counter_uppers)}
    assert len(set(counter_uppers)) == len(counter_uppers)
    for name in "abc":
        # Each acknowledged upper was given to exactly one append.
        assert len(set(pair_uppers[name])) == len(pair_uppers[name])
        assert uppers[name] == len(pair_uppers[name])
        # Pair appends are atomic: present in both collections of the pair, once.
        assert {k for k, _, d in multi[name] if d == 1} == pair_keys[name]
        assert all(d == 1 for _, _, d in multi[name])
    assert _deadlocks(postgres_server, db) == deadlocks_before


def test_readers_never_see_half_an_append(postgres_url: str) -> None:
    """A writer replaces one key's value and compacts as it goes (``make_batch``: since
    follows the upper); readers must always see exactly one value for it, never less
    (consolidation moved rows past their snapshot) and never two."""
    migrate_to_head(postgres_url)
    w = Stash.open(postgres_url, fenced=True)
    r = Stash.open(postgres_url, mode="readonly")
    try:
        latest = TypedCollection("latest", key="str", value="int")
        latest.upsert_key(w, "k", 0)
        stop = threading.Event()
        bad: list[Any] = []
        seen: list[int] = []

        def reader() -> None:
            c = latest.get(r)
            while not stop.is_set():
                try:
                    got = r.peek(c)
                except PeekSinceUpperError:
                    continue
                if len(got) != 1 or got[0][2] != 1:
                    bad.append(got)
                else:
                    seen.append(got[0][1])

        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        for i in range(1, 150):
            latest.upsert_key(w, "k", i)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        assert bad == []
        assert len(seen) > 10
        assert latest.peek_one(w) == {"k": 149}
    finally:
        w.close()
        r.close()


def test_collection_creation_race_surfaces_no_integrity_error(postgres_url: str) -> None:
    migrate_to_head(postgres_url)
    handles = [Stash.open(postgres_url, fenced=False) for _ in range(6)]
    try:
        for round_ in range(5):
            name = f"race{round_}"
            barrier = threading.Barrier(len(handles))
            results: list[Any] = [None] * len(handles)

            def create(
                i: int,
                name: str = name,
                barrier: threading.Barrier = barrier,
                results: list[Any] = results,
            ) -> None:
                barrier.wait()
                codec = "str" if i == 0 else "int"  # one of them asks for other codecs
                try:
                    results[i] = handles[i].collection(name, key=codec).id
                except StashError as err:
                    results[i] = err

            threads = [threading.Thread(target=create, args=(i,)) for i in range(len(handles))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
            ids = {x for x in results if isinstance(x, int)}
            errors = [x for x in results if not isinstance(x, int)]
            assert len(ids) == 1, results
            # Whoever lost the race with other codecs gets the codec error, nothing else.
            for e in errors:
                assert isinstance(e, StashError) and "was created with codecs" in str(e), e
            assert len(errors) in (0, 1, len(handles) - 1)
        listed = handles[0].collections()
        assert sorted(listed) == [f"race{i}" for i in range(5)]
    finally:
        for h in handles:
            h.close()
