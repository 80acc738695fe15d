"""Row-level changes (upsert, delete, update) on TPC-H ``lineitem`` against delta-rs and
pyiceberg, on the same data, in one run.

The table is ``lineitem`` (SF1, about 6,000,000 rows; SF0.1 with ``--quick``) keyed by
``(l_orderkey, l_linenumber)``, loaded once (untimed, load times reported) into:

* **persist**: a shard with those key columns and the other 14 as value columns, on a
  SQLite stash (``synchronous=FULL``) and a file blob store, background compaction on (as
  users run it); written by one ``compare_and_append``;
* **delta-rs**: ``deltalake.write_deltalake`` defaults;
* **pyiceberg**: ``SqlCatalog`` on SQLite, ``create_table`` + ``Table.append``.

Sections (``--only`` picks some), each run ``rounds`` times after one warm-up round,
contestants in an order rotated every round (:func:`bench.common.interleave`):

* ``upsert``: 1% of the rows, clustered: every row of a contiguous ``l_orderkey`` range
  holding 1% of the table; the first half of them are **updates of existing keys**
  (``l_quantity + 1``, a new ``l_comment``), the second half **inserts of new keys** (the
  same rows with ``l_linenumber + 100``).  persist ``WriteHandle.upsert(rows)``, delta-rs
  ``DeltaTable.merge(source, predicate on both key columns).when_matched_update_all()
  .when_not_matched_insert_all()``; pyiceberg's ``Table.upsert(rows, join_cols=keys)``
  builds an ``Or`` of one ``And(EqualTo, EqualTo)`` per incoming key and ran for minutes
  on 6,000 keys (SF0.1), so its contestant is the merge a pyiceberg user writes for a
  clustered batch: ``scan`` the batch's ``l_orderkey`` range, an Arrow anti-join keeps
  the rows not replaced, ``Table.overwrite(kept + rows, overwrite_filter=range)`` (one
  transaction).
  Goal: at least 1.0 times the faster peer (faster peer's time / persist's time).
* ``delete``: every row of a contiguous ``l_orderkey`` range holding 1% of the table:
  persist ``WriteHandle.delete(filter)``, delta-rs ``DeltaTable.delete(predicate)``,
  pyiceberg ``Table.delete(filter)``.  Goal: at least 1.0 times the faster peer.
* ``update``: one row by its key, ``l_quantity + 1``: persist
  ``WriteHandle.update(filter, {"l_quantity": expression})``, delta-rs
  ``DeltaTable.update(updates, predicate)``; pyiceberg has no update, so its contestant
  reads the row (``scan(row_filter)``) and upserts it changed.  Goal: at least 10 times
  the faster peer.
* ``merge``: a conditional MERGE of a 1% slice against delta-rs's ``DeltaTable.merge``
  with the same clauses (pyiceberg has no merge): the source holds the slice's first
  third with ``l_quantity + 1`` (updated: ``when_matched_update_all`` where the source's
  quantity is greater), its second third with ``l_quantity - 1`` (matched, condition
  false: unchanged), and new keys (``l_linenumber + 100``, inserted:
  ``when_not_matched_insert_all``); the slice's last third, absent from the source, is
  deleted by ``when_not_matched_by_source_delete`` restricted to the slice's key range.
  Goal: at least 1.0 times delta-rs.

Invariants kept here:

* every round of every section changes a *different* 1% slice (disjoint key ranges), the
  same slice for the three contestants, so each run changes the same amount on a table of
  nearly the same size;
* only the change is timed; after every round, all three tables are read back on the
  changed key range and must equal the expected rows (the bench fails the section
  otherwise): a correctness check inside the bench;
* the ratio is taken round by round against the faster peer of that round, and reported
  as the median with its spread (min-max); the machine's load average is recorded.

Run: ``python -m bench.bench_rows [--quick] [--json PATH] [--only SECTION ...]``.
"""

from __future__ import annotations

import decimal
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bench.common import (
    BenchResults,
    Goal,
    Table,
    fmt_num,
    interleave,
    median,
    profile_text,
    ratio_record,
    work_dir,
)

__all__ = ["KEYS", "SECTIONS", "Contestants", "main", "run"]

SECTIONS = ("upsert", "delete", "update", "merge")
KEYS = ("l_orderkey", "l_linenumber")
GOALS = {
    "upsert": Goal(">=", 1.0),
    "delete": Goal(">=", 1.0),
    "update": Goal(">=", 10.0),
    "merge": Goal(">=", 1.0),
}
PEERS = ("delta-rs", "pyiceberg")
PERSIST = "persist"
#: Slots (1% slices of the table) reserved per section: rounds + warm-up + profile.
SLOTS_PER_SECTION = 24
ONE = pa.scalar(decimal.Decimal("1.00"), pa.decimal128(15, 2))


@dataclass(frozen=True)
class Slice:
    """A contiguous ``l_orderkey`` range ``[lo, hi)`` and the original rows in it."""

    lo: int
    hi: int
    rows: pa.Table


class Contestants:
    """The three tables holding the same ``lineitem``, and the changes on them.

    Args:
        root: scratch directory (emptied by the caller).
        table: the normalised ``lineitem`` (see :mod:`bench.data`), sorted by
            ``l_orderkey``.
        log: progress lines.
    """

    def __init__(self, root: Path, table: pa.Table, log: Callable[[str], None]) -> None:
        from pyiceberg.catalog.sql import SqlCatalog

        from persist import PersistClient
        from stash import Stash

        self.schema = table.schema
        self.values = [n for n in table.column_names if n not in KEYS]
        self.load_seconds: dict[str, float] = {}
        self.stash = Stash.open(f"sqlite:///{root / 'stash.db'}", fenced=False)
        self.client = PersistClient(self.stash, f"file://{root / 'blob'}")
        ks = pa.schema([table.schema.field(k) for k in KEYS])
        vs = pa.schema([table.schema.field(v) for v in self.values])
        self.write, self.read = self.client.open("lineitem", ks, vs)
        self.delta_path = str(root / "delta")
        self.catalog = SqlCatalog(
            "bench",
            uri=f"sqlite:///{root / 'iceberg.db'}",
            warehouse=f"file://{root / 'warehouse'}",
        )
        self.catalog.create_namespace("bench")
        self.iceberg = self.catalog.create_table(("bench", "lineitem"), schema=table.schema)
        self._load(table, log)

    def _load(self, table: pa.Table, log: Callable[[str], None]) -> None:
        from deltalake import write_deltalake

        n = table.num_rows
        t0 = time.perf_counter()
        self.write.compare_and_append(
            table.append_column("_time", pa.array(np.zeros(n, np.int64))).append_column(
                "_diff", pa.array(np.ones(n, np.int64))
            ),
            0,
            1,
        )
        self.load_seconds[PERSIST] = time.perf_counter() - t0
        t0 = time.perf_counter()
        write_deltalake(self.delta_path, table, mode="error")
        self.load_seconds["delta-rs"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.iceberg.append(table)
        self.load_seconds["pyiceberg"] = time.perf_counter() - t0
        log(
            "loaded: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in self.load_seconds.items())
            + f" ({n:,} rows)"
        )

    def close(self) -> None:
        self.write.expire()
        self.read.expire()
        self.client.close()
        self.stash.close()

    # ------------------------------------------------------------- the changes
    def upsert(self, name: str, rows: pa.Table) -> None:
        if name == PERSIST:
            self.write.upsert(rows)
        elif name == "delta-rs":
            from deltalake import DeltaTable

            on = " AND ".join(f"t.{k} = s.{k}" for k in KEYS)
            (
                DeltaTable(self.delta_path)
                .merge(rows, on, source_alias="s", target_alias="t", streamed_exec=False)
                .when_matched_update_all()
                .when_not_matched_insert_all()
                .execute()
            )
        else:
            # Table.upsert builds an Or of one And(EqualTo, EqualTo) per incoming key:
            # with 6,000 keys it ran for minutes; so the merge a pyiceberg user writes
            # for a clustered batch: read the key range, replace it in one transaction.
            ok = pc.min_max(rows.column("l_orderkey"))
            rng = f"l_orderkey >= {ok['min'].as_py()} and l_orderkey <= {ok['max'].as_py()}"
            old = self.iceberg.scan(row_filter=rng).to_arrow()
            kept = old.join(rows.select(list(KEYS)), keys=list(KEYS), join_type="left anti")
            new = pa.concat_tables([kept.select(rows.column_names).cast(rows.schema), rows])
            self.iceberg.overwrite(new, overwrite_filter=rng)

    def merge(self, name: str, source: pa.Table, lo: int, hi: int) -> None:
        rng = f"t.l_orderkey >= {lo} AND t.l_orderkey < {hi}"
        if name == PERSIST:
            (
                self.write.merge(source, source_alias="s", target_alias="t")
                .when_matched_update_all(condition="s.l_quantity > t.l_quantity")
                .when_not_matched_insert_all()
                .when_not_matched_by_source_delete(condition=rng)
                .execute()
            )
        else:
            from deltalake import DeltaTable

            on = " AND ".join(f"t.{k} = s.{k}" for k in KEYS)
            (
                DeltaTable(self.delta_path)
                .merge(source, on, source_alias="s", target_alias="t", streamed_exec=False)
                .when_matched_update_all(predicate="s.l_quantity > t.l_quantity")
                .when_not_matched_insert_all()
                .when_not_matched_by_source_delete(predicate=rng)
                .execute()
            )

    def delete(self, name: str, lo: int, hi: int) -> None:
        if name == PERSIST:
            self.write.delete((pc.field("l_orderkey") >= lo) & (pc.field("l_orderkey") < hi))
        elif name == "delta-rs":
            from deltalake import DeltaTable

            DeltaTable(self.delta_path).delete(f"l_orderkey >= {lo} AND l_orderkey < {hi}")
        else:
            self.iceberg.delete(f"l_orderkey >= {lo} and l_orderkey < {hi}")

    def update(self, name: str, orderkey: int, linenumber: int) -> None:
        if name == PERSIST:
            self.write.update(
                (pc.field("l_orderkey") == orderkey) & (pc.field("l_linenumber") == linenumber),
                {"l_quantity": pc.add(pc.field("l_quantity"), ONE)},
            )
        elif name == "delta-rs":
            from deltalake import DeltaTable

            DeltaTable(self.delta_path).update(
                updates={"l_quantity": "l_quantity + 1"},
                predicate=f"l_orderkey = {orderkey} AND l_linenumber = {linenumber}",
            )
        else:
            row = self.iceberg.scan(
                row_filter=f"l_orderkey = {orderkey} and l_linenumber = {linenumber}"
            ).to_arrow()
            i = row.schema.get_field_index("l_quantity")
            row = row.set_column(
                i, row.schema.field(i), pc.add(row.column(i), ONE).cast(row.schema.field(i).type)
            )
            self.iceberg.upsert(row, join_cols=list(KEYS))

    # -------------------------------------------------------------- read back
    def rows_in(self, name: str, lo: int, hi: int) -> pa.Table:
        """The live rows of ``l_orderkey`` in ``[lo, hi)`` of one contestant, in the
        bench's schema, sorted by key (persist: every ``_diff`` must be 1)."""
        if name == PERSIST:
            upper = self.write.change_state().upper.as_option()
            assert upper is not None
            t = self.read.snapshot(
                upper - 1,
                filter=(pc.field("l_orderkey") >= lo) & (pc.field("l_orderkey") < hi),
            )
            diffs = t.column("_diff")
            if len(diffs) and (pc.min(diffs).as_py() != 1 or pc.max(diffs).as_py() != 1):
                raise AssertionError(f"persist: a row of [{lo}, {hi}) has a _diff other than 1")
            t = t.drop_columns(["_time", "_diff"])
        elif name == "delta-rs":
            from deltalake import DeltaTable

            t = DeltaTable(self.delta_path).to_pyarrow_table(
                filters=[("l_orderkey", ">=", lo), ("l_orderkey", "<", hi)]
            )
        else:
            t = (
                self.catalog.load_table(("bench", "lineitem"))
                .scan(row_filter=f"l_orderkey >= {lo} and l_orderkey < {hi}")
                .to_arrow()
            )
        return _canonical(t, self.schema)

    def check(
        self,
        lo: int,
        hi: int,
        expected: pa.Table,
        what: str,
        names: tuple[str, ...] = (PERSIST, *PEERS),
    ) -> None:
        """The tables ``names`` (default all three) hold exactly ``expected`` in
        ``[lo, hi)``.

        Raises:
            AssertionError: naming the contestant that differs.
        """
        want = _canonical(expected, self.schema)
        for name in names:
            got = self.rows_in(name, lo, hi)
            if not got.equals(want):
                raise AssertionError(
                    f"{what}: {name} holds {got.num_rows} rows in l_orderkey [{lo}, {hi}) "
                    f"that differ from the {want.num_rows} expected"
                )


def _canonical(t: pa.Table, schema: pa.Schema) -> pa.Table:
    t = t.select(schema.names).cast(schema)
    return t.sort_by([(k, "ascending") for k in KEYS]).combine_chunks()


def slices(table: pa.Table, count: int) -> list[Slice]:
    """``count`` disjoint slices of about 1% of ``table``'s rows each, on ``l_orderkey``
    boundaries (``table`` sorted by ``l_orderkey``)."""
    n = table.num_rows
    size = n // 100
    ok = table.column("l_orderkey").to_numpy()
    if count > 99:
        raise ValueError(f"at most 99 slices of 1% fit, asked for {count}")
    out = []
    for s in range(count):
        lo, hi = int(ok[s * size]), int(ok[(s + 1) * size])
        start = int(np.searchsorted(ok, lo))
        stop = int(np.searchsorted(ok, hi))
        out.append(Slice(lo, hi, table.slice(start, stop - start)))
    return out


def upsert_rows(orig: pa.Table, tag: str) -> tuple[pa.Table, pa.Table]:
    """The upsert of a slice: (incoming rows, the rows the slice then holds).  Its first
    half updates existing keys (``l_quantity + 1``, ``l_comment`` = ``tag``), its second
    half inserts new keys (``l_linenumber + 100``)."""
    half = orig.num_rows // 2
    upd = orig.slice(0, half)
    q = upd.schema.get_field_index("l_quantity")
    upd = upd.set_column(
        q, upd.schema.field(q), pc.add(upd.column(q), ONE).cast(upd.schema.field(q).type)
    )
    c = upd.schema.get_field_index("l_comment")
    upd = upd.set_column(c, upd.schema.field(c), pa.array([tag] * half, pa.string()))
    ins = orig.slice(half)
    ln = ins.schema.get_field_index("l_linenumber")
    ins = ins.set_column(
        ln, ins.schema.field(ln), pc.add(ins.column(ln), 100).cast(ins.schema.field(ln).type)
    )
    incoming = pa.concat_tables([upd, ins])
    return incoming, pa.concat_tables([upd, orig.slice(half), ins])


def merge_rows(orig: pa.Table, tag: str) -> tuple[pa.Table, pa.Table]:
    """The merge of a slice: (source rows, the rows the slice then holds).  See the
    module docstring: a third updated, a third matched but unchanged, a third deleted,
    and new keys inserted."""
    third = orig.num_rows // 3
    q = orig.schema.get_field_index("l_quantity")
    qt = orig.schema.field(q)
    upd = orig.slice(0, third)
    upd = upd.set_column(q, qt, pc.add(upd.column(q), ONE).cast(qt.type))
    c = upd.schema.get_field_index("l_comment")
    upd = upd.set_column(c, upd.schema.field(c), pa.array([tag] * third, pa.string()))
    kept = orig.slice(third, third)
    lower = kept.set_column(q, qt, pc.subtract(kept.column(q), ONE).cast(qt.type))
    ins = orig.slice(0, third)
    ln = ins.schema.get_field_index("l_linenumber")
    ins = ins.set_column(
        ln, ins.schema.field(ln), pc.add(ins.column(ln), 100).cast(ins.schema.field(ln).type)
    )
    return pa.concat_tables([upd, lower, ins]), pa.concat_tables([upd, kept, ins])


def one_row_update(orig: pa.Table) -> tuple[int, int, pa.Table]:
    """The update of a slice's first row: (orderkey, linenumber, the rows of its order
    after it)."""
    ok = int(orig.column("l_orderkey")[0].as_py())
    ln = int(orig.column("l_linenumber")[0].as_py())
    order = orig.filter(pc.field("l_orderkey") == ok)
    hit = pc.equal(order.column("l_linenumber"), ln)
    q = order.schema.get_field_index("l_quantity")
    newq = pc.if_else(hit, pc.add(order.column(q), ONE), order.column(q)).cast(
        order.schema.field(q).type
    )
    return ok, ln, order.set_column(q, order.schema.field(q), newq)


def _records(
    res: BenchResults, section: str, what: str, samples: dict[str, list[float]], rows: int
) -> None:
    peers = [p for p in PEERS if p in samples]
    faster = [min(r) for r in zip(*(samples[p] for p in peers), strict=True)]
    rec = res.add(
        ratio_record(
            section,
            f"{what}: persist vs the faster peer",
            subject="persist",
            subject_samples=samples[PERSIST],
            reference=(
                "faster of delta-rs and pyiceberg (per round)" if len(peers) > 1 else peers[0]
            ),
            reference_samples=faster,
            measure="speed",
            goal=GOALS[section],
            note=f"{rows:,} rows changed per round; load average {_load()}",
        )
    )
    for peer in peers:
        res.add(
            ratio_record(
                section,
                f"{what}: persist vs {peer}",
                subject="persist",
                subject_samples=samples[PERSIST],
                reference=peer,
                reference_samples=samples[peer],
                measure="speed",
            )
        )
    sp = rec.spread or (0.0, 0.0)
    res.tables[0].rows.append(
        [
            what,
            f"{median(samples[PERSIST]):.3f} s",
            f"{median(samples['delta-rs']):.3f} s",
            f"{median(samples['pyiceberg']):.3f} s" if "pyiceberg" in samples else "-",
            f"{fmt_num(rec.value)}x",
            str(GOALS[section]),
            f"{fmt_num(sp[0])}-{fmt_num(sp[1])}x",
            rec.verdict or "",
            _load(),
        ]
    )


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_section(
    res: BenchResults, c: Contestants, section: str, sl: list[Slice], rounds: int
) -> None:
    """One section: ``rounds`` measured rounds (plus a warm-up) on the slices ``sl``
    (one per round; the last one profiles persist's change)."""
    names = (PERSIST, *PEERS)
    if section == "upsert":
        plans = [upsert_rows(s.rows, f"upserted {i}") for i, s in enumerate(sl)]
        what = f"upsert {sl[0].rows.num_rows:,} rows (1%, half updates, half inserts)"

        def op(name: str) -> Callable[[int], float]:
            return lambda r: _timed(lambda: c.upsert(name, plans[r][0]))

        def check(r: int) -> None:
            c.check(sl[r].lo, sl[r].hi, plans[r][1], f"upsert round {r}")

        profiled: Callable[[], object] = lambda: c.upsert(PERSIST, plans[-1][0])  # noqa: E731
    elif section == "delete":
        what = f"delete {sl[0].rows.num_rows:,} rows (1%, a key range)"

        def op(name: str) -> Callable[[int], float]:
            return lambda r: _timed(lambda: c.delete(name, sl[r].lo, sl[r].hi))

        def check(r: int) -> None:
            c.check(sl[r].lo, sl[r].hi, sl[r].rows.schema.empty_table(), f"delete round {r}")

        profiled = lambda: c.delete(PERSIST, sl[-1].lo, sl[-1].hi)  # noqa: E731
    elif section == "merge":
        merges = [merge_rows(s.rows, f"merged {i}") for i, s in enumerate(sl)]
        what = f"merge of a {sl[0].rows.num_rows:,}-row slice (update, insert, by-source delete)"
        names = (PERSIST, "delta-rs")

        def op(name: str) -> Callable[[int], float]:
            return lambda r: _timed(lambda: c.merge(name, merges[r][0], sl[r].lo, sl[r].hi))

        def check(r: int) -> None:
            c.check(sl[r].lo, sl[r].hi, merges[r][1], f"merge round {r}", (PERSIST, "delta-rs"))

        profiled = lambda: c.merge(PERSIST, merges[-1][0], sl[-1].lo, sl[-1].hi)  # noqa: E731
    else:
        ups = [one_row_update(s.rows) for s in sl]
        what = "update 1 row by key"

        def op(name: str) -> Callable[[int], float]:
            return lambda r: _timed(lambda: c.update(name, ups[r][0], ups[r][1]))

        def check(r: int) -> None:
            ok = ups[r][0]
            c.check(ok, ok + 1, ups[r][2], f"update round {r}")

        profiled = lambda: c.update(PERSIST, ups[-1][0], ups[-1][1])  # noqa: E731
    samples = interleave({n: op(n) for n in names}, rounds, log=res.log, after_round=check)
    _records(res, section, what, samples, 1 if section == "update" else sl[0].rows.num_rows)
    res.profiles[f"persist {section}"] = profile_text(profiled)


def run(quick: bool, only: tuple[str, ...] = (), json_path: str | None = None) -> Path:
    """Load the three tables, run the selected sections, save the results JSON; return
    its path."""
    from bench.data import lineitem

    scale = 0.1 if quick else 1.0
    rounds = 3
    res = BenchResults(
        "rows",
        "Row-level changes against delta-rs and pyiceberg",
        quick=quick,
        params={"quick": quick, "scale_factor": scale, "rounds": rounds, "keys": list(KEYS)},
    )
    res.tables.append(
        Table(
            "rows",
            f"Row-level changes on lineitem SF{scale:g} (median seconds of {rounds} rounds)",
            [
                "op",
                "persist",
                "delta-rs",
                "pyiceberg",
                "ratio vs faster peer",
                "goal",
                "spread",
                "verdict",
                "load (1, 5, 15 min)",
            ],
        )
    )
    root = work_dir("rows")
    c: Contestants | None = None
    try:
        with res.section("load"):
            table = lineitem(scale)
            res.params["rows"] = table.num_rows
            c = Contestants(root, table, res.log)
            res.tables.append(
                Table(
                    "rows-load",
                    f"Loading lineitem SF{scale:g} ({table.num_rows:,} rows; untimed for the ratios)",
                    ["contestant", "seconds"],
                    [[k, f"{v:.1f}"] for k, v in c.load_seconds.items()],
                )
            )
            all_slices = slices(table, SLOTS_PER_SECTION * len(SECTIONS))
        if c is None:
            return res.save(json_path)
        for i, name in enumerate(SECTIONS):
            if only and name not in only:
                continue
            with res.section(name):
                base = i * SLOTS_PER_SECTION
                run_section(res, c, name, all_slices[base : base + rounds + 2], rounds)
        res.notes.append(
            "delta-rs merge runs with streamed_exec=False, so it derives its early pruning "
            "predicate from the source's key ranges; pyiceberg's upsert is a scan of the "
            "batch's key range and an overwrite of it (Table.upsert with a 2-column key "
            "ran for minutes on 6,000 keys); pyiceberg has no update: its one-row update "
            "is a scan of the row and Table.upsert of it changed."
        )
    finally:
        if c is not None:
            c.close()
        shutil.rmtree(root, ignore_errors=True)
    return res.save(json_path)


@click.command()
@click.option("--quick", is_flag=True, help="lineitem SF0.1 and 3 rounds.")
@click.option("--only", multiple=True, type=click.Choice(SECTIONS), help="Sections to run.")
@click.option(
    "--json", "json_path", default=None, help="Results file (default var/bench-results/rows.json)."
)
def main(quick: bool, only: tuple[str, ...], json_path: str | None) -> None:
    """Upsert, delete and update on lineitem against delta-rs and pyiceberg."""
    path = run(quick, only, json_path)
    click.echo(f"rows bench results: {path}")


if __name__ == "__main__":
    main()
