"""Concurrency campaign (persist and stash together): 8 processes mix, for a fixed
time, stash appends (to their own collection and to one shared collection) and persist
``compare_and_append`` s (to their own shard and to one shared shard), all on one stash
(SQLite file or Postgres) and one FileBlob.  Every operation is logged by its process with
the time it wrote at and the (system-wide monotonic) instants it started and ended.

A checker then verifies, per collection and per shard, that the history is linearizable:

* every write advances the upper by exactly one from the time it wrote at, so the times
  present are exactly ``0 .. upper - 1``, each holding one write (uppers strictly increase,
  no time is used twice);
* every acknowledged write appears exactly once (diff 1), at its time;
* nothing unacknowledged appears (except, per process, one indeterminate in-flight write,
  which this campaign also counts: none is expected);
* real-time order: if write A was acknowledged before write B started, A's time < B's.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist import PersistClient, PersistError, UpperMismatch, fsck, read_batches
from stash import Antichain, AppendBatch, AppendLowerMismatch, Stash, StashError
from tests.reliability.campaign import LONG, record

PROCS = 8
KS = pa.schema([("proc", pa.int64()), ("n", pa.int64())])
VS = pa.schema([("v", pa.string())])
SHARED_COLL, SHARED_SHARD = "conc_shared", "conc_shared"


def _own(idx: int) -> str:
    return f"conc_own_{idx}"


def worker(
    idx: int,
    url: str,
    blob: str,
    log_path: str,
    seconds: float,
    ready: Any,
    go: Any,
) -> None:
    """One process of the campaign: random operations for ``seconds`` after ``go``."""
    rng = random.Random(idx)
    s = Stash.open(url, fenced=False)
    colls = {n: s.collection(n, key="str", value="int") for n in (SHARED_COLL, _own(idx))}
    client = PersistClient(s, blob, compaction="inline", inline_max_bytes=512)
    writers = {n: client.open_writer(n, KS, VS) for n in (SHARED_SHARD, _own(idx))}
    uppers = {n: 0 for n in writers}
    out = open(log_path, "w")  # noqa: SIM115 - closed below

    def log(**kw: Any) -> None:
        out.write(json.dumps(kw) + "\n")

    ready.set()
    go.wait(120)
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline:
        n += 1
        kind = rng.choice(["stash", "persist"])
        target = rng.choice([SHARED_COLL, _own(idx)])
        key = f"{idx}-{n}"
        start = time.monotonic()
        if kind == "stash":
            c = colls[target]
            try:
                u = s.upper(c).as_option()
                assert u is not None
                b = AppendBatch(
                    c, Antichain.from_elem(u), Antichain.from_elem(u + 1), Antichain.from_elem(0), u
                )
                c.append_to_batch(b, key, n, 1)
                s.append([b])
            except AppendLowerMismatch:
                log(kind=kind, target=target, key=key, outcome="mismatch")
                continue
            except StashError as e:
                log(
                    kind=kind,
                    target=target,
                    key=key,
                    outcome="error",
                    error=str(e),
                    indeterminate=e.is_indeterminate(),
                )
                continue
        else:
            w = writers[target]
            u = uppers[target]
            try:
                w.compare_and_append([(((idx, n), (key,)), u, 1)], u, u + 1)
            except UpperMismatch as e:
                cur = e.current.as_option()
                assert cur is not None
                uppers[target] = cur
                log(kind=kind, target=target, key=key, outcome="mismatch")
                continue
            except PersistError as e:
                log(
                    kind=kind,
                    target=target,
                    key=key,
                    outcome="error",
                    error=str(e),
                    indeterminate=e.is_indeterminate(),
                )
                continue
            uppers[target] = u + 1
        log(
            kind=kind, target=target, key=key, t=u, start=start, end=time.monotonic(), outcome="ack"
        )
    out.close()
    client.close()
    s.close()


def _check_history(
    name: str,
    present: dict[str, list[tuple[int, int]]],
    upper: int,
    acks: list[dict[str, Any]],
    indeterminate: set[str],
) -> dict[str, int]:
    """Check one collection's or shard's history (see the module docstring)."""
    by_key = {a["key"]: a for a in acks}
    assert len(by_key) == len(acks), f"{name}: a key acknowledged twice"
    dup = {k: v for k, v in present.items() if len(v) != 1 or v[0][1] != 1}
    assert not dup, f"{name}: duplicated entries {list(dup.items())[:3]}"
    times = sorted(v[0][0] for v in present.values())
    assert times == list(range(upper)), f"{name}: times are not exactly 0..{upper - 1}"
    lost = [k for k, a in by_key.items() if present.get(k, [(None, 0)])[0][0] != a["t"]]
    assert not lost, f"{name}: acknowledged writes lost or at another time: {lost[:5]}"
    extra = set(present) - set(by_key)
    assert extra <= indeterminate, f"{name}: unacknowledged writes visible {sorted(extra)[:5]}"
    max_start = float("-inf")
    for a in sorted(acks, key=lambda a: a["t"]):
        assert a["end"] >= max_start, f"{name}: real-time order broken at time {a['t']}"
        max_start = max(max_start, a["start"])
    return {"acked": len(acks), "unacked_visible": len(extra)}


def _campaign(url: str, tmp_path: Path, seconds: float, label: str) -> None:
    blob = f"file://{tmp_path}/blob"
    with Stash.open(url, fenced=False) as s:  # create shards and collections up front
        c = PersistClient(s, blob, compaction="off")
        for n in [SHARED_SHARD] + [_own(i) for i in range(PROCS)]:
            c.open_writer(n, KS, VS)
            s.collection(n, key="str", value="int")
        c.close()
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    readies = [ctx.Event() for _ in range(PROCS)]
    logs = [tmp_path / f"log{i}.jsonl" for i in range(PROCS)]
    procs = [
        ctx.Process(target=worker, args=(i, url, blob, str(logs[i]), seconds, readies[i], go))
        for i in range(PROCS)
    ]
    for p in procs:
        p.start()
    for e in readies:
        assert e.wait(180), "a worker did not start"
    go.set()
    for p in procs:
        p.join(seconds + 180)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]

    entries = [json.loads(ln) for f in logs for ln in f.read_text().splitlines()]
    errors = [e for e in entries if e["outcome"] == "error"]
    indeterminate = {e["key"] for e in errors if e["indeterminate"]}
    mismatches = sum(1 for e in entries if e["outcome"] == "mismatch")
    acks: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for e in entries:
        if e["outcome"] == "ack":
            acks.setdefault((e["kind"], e["target"]), []).append(e)
    totals = {"acked": 0, "unacked_visible": 0}
    names = [SHARED_COLL] + [_own(i) for i in range(PROCS)]
    with Stash.open(url, fenced=False) as s:
        for n in names:
            c = s.collection(n, key="str", value="int")
            present: dict[str, list[tuple[int, int]]] = {}
            for (k, _v), t, d in s.iter(c):
                present.setdefault(k, []).append((t, d))
            upper = s.upper(c).as_option()
            assert upper is not None
            fig = _check_history(
                f"collection {n}", present, upper, acks.get(("stash", n), []), indeterminate
            )
            for k in totals:
                totals[k] += fig[k]
        client = PersistClient(s, blob, compaction="off")
        for n in names:
            w = client.open_writer(n, KS, VS)
            st = client.inspect(n)
            st.trace.validate()
            assert st.since == Antichain.from_elem(0)
            table = read_batches(client.blob, st.batches(), w.schema)
            present = {}
            for p, num, t, d in zip(
                *(table.column(x).to_pylist() for x in ("proc", "n", "_time", "_diff")), strict=True
            ):
                present.setdefault(f"{p}-{num}", []).append((t, d))
            upper = st.upper.as_option()
            assert upper is not None
            fig = _check_history(
                f"shard {n}", present, upper, acks.get(("persist", n), []), indeterminate
            )
            for k in totals:
                totals[k] += fig[k]
            damage = fsck(client, n)  # every referenced part present and intact
            assert damage.ok, f"shard {n}: fsck: {damage.damage()}"
        client.close()
    assert not errors, f"unexpected errors: {errors[:3]}"
    record(
        f"concurrency: {PROCS} processes, stash + persist on {label}",
        runs=PROCS,
        faults=0,
        acknowledged=totals["acked"],
        lost=0,
        duplicated=0,
        partial=0,
        unclear=0,
        seconds=seconds,
        races_lost=mismatches,
        unacknowledged_visible=totals["unacked_visible"],
        died=0,
    )


@pytest.mark.campaign
def test_concurrency_sqlite(tmp_path: Path) -> None:
    _campaign(f"sqlite:///{tmp_path}/c.db", tmp_path, 120.0 if LONG else 10.0, "sqlite")


@pytest.mark.campaign
@pytest.mark.postgres
def test_concurrency_postgres(tmp_path: Path, postgres_url: str) -> None:
    from tests.support.dbutil import migrate_to_head

    migrate_to_head(postgres_url)
    _campaign(postgres_url, tmp_path, 120.0 if LONG else 4.0, "postgres")
