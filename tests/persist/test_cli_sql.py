"""``persist cat`` and ``persist sql``: a shard's consolidated rows as of a time, and DuckDB
SQL over shards registered as Arrow tables (one row per unit of multiplicity), checked
against pandas; bad input is refused with a message naming the rule."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
from click.testing import CliRunner

from persist import PersistClient
from persist.cli import main
from stash import Stash

KS = pa.schema([("id", pa.int64())])
VS = pa.schema([("carrier", pa.string()), ("arr_delay", pa.float64())])


def _setup(tmp_path: Path) -> tuple[list[str], pd.DataFrame]:
    """Shard ``flights``: ids 0..59 at times id % 4, then id 5 retracted at time 4, id 7
    inserted a second time (multiplicity 2) at time 4; shard ``neg``: one retraction."""
    url, blob = f"sqlite:///{tmp_path}/s.db", f"file://{tmp_path}/blob"
    rows = [
        (i, ["AA", "UA", "DL"][i % 3], None if i % 11 == 0 else float((i * 7) % 40 - 10))
        for i in range(60)
    ]
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, blob, compaction="inline", inline_max_bytes=256)
        w = c.open_writer("flights", KS, VS)
        for t in range(4):
            w.compare_and_append(
                [(((i,), (cr, d)), t, 1) for i, cr, d in rows if i % 4 == t], t, t + 1
            )
        r5, r7 = rows[5], rows[7]
        w.compare_and_append(
            [(((5,), r5[1:]), 4, -1), (((7,), r7[1:]), 4, 1)],
            4,
            5,
        )
        n = c.open_writer("neg", KS, VS)
        n.compare_and_append([(((1,), ("AA", 1.0)), 0, -1)], 0, 1)
        c.close()
    df = pd.DataFrame(rows, columns=["id", "carrier", "arr_delay"])
    df = pd.concat([df[df["id"] != 5], df[df["id"] == 7]])  # as of 4
    return ["--stash", url, "--blob", blob], df


def test_sql_matches_pandas_and_cat_prints_rows(tmp_path: Path) -> None:
    base, df = _setup(tmp_path)
    runner = CliRunner()
    q = (
        "SELECT carrier, count(*) AS flights, count(arr_delay) AS arrived, "
        "sum(CASE WHEN arr_delay <= 15 THEN 1 ELSE 0 END) AS on_time "
        "FROM flights GROUP BY 1 ORDER BY 1"
    )
    res = runner.invoke(main, [*base, "sql", q, "--json"])
    assert res.exit_code == 0, res.output
    got = [json.loads(line) for line in res.output.splitlines()]
    g = df.groupby("carrier").agg(
        flights=("id", "size"),
        arrived=("arr_delay", "count"),
        on_time=("arr_delay", lambda s: int((s <= 15).sum())),
    )
    want = [
        {
            "carrier": k,
            "flights": int(v.flights),
            "arrived": int(v.arrived),
            "on_time": int(v.on_time),
        }
        for k, v in g.sort_index().iterrows()
    ]
    assert got == want
    # As of time 1: ids with id % 4 in (0, 1) only, before the corrections.
    res = runner.invoke(main, [*base, "sql", "SELECT count(*) AS n FROM flights", "--as-of", "1"])
    assert res.exit_code == 0, res.output
    assert "30" in res.output

    res = runner.invoke(main, [*base, "cat", "flights", "--json"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.output.splitlines()]
    assert len(rows) == 59 and {r["_diff"] for r in rows} == {1, 2}
    assert [r["id"] for r in rows] == sorted(r["id"] for r in rows)
    assert next(r for r in rows if r["id"] == 7)["_diff"] == 2
    res = runner.invoke(main, [*base, "cat", "flights", "--limit", "3", "--as-of", "0"])
    assert res.exit_code == 0, res.output
    assert "flights as of 0" in res.output and "carrier" in res.output


def test_sql_and_cat_refuse_bad_input(tmp_path: Path) -> None:
    base, _ = _setup(tmp_path)
    runner = CliRunner()
    for args, words in (
        (["sql", "SELECT * FROM nosuch"], "names no shard"),
        (["sql", "SELECT nosuchcol FROM flights"], "persist sql"),
        (["sql", "SELEC oops"], "cannot parse"),
        (["sql", "SELECT count(*) FROM neg"], "negative multiplicity"),
        (["sql", "SELECT * FROM flights, read_csv('/etc/passwd')"], "persist sql"),
        (["sql", "COPY flights TO 'out.csv'"], "persist sql"),
        (["sql", "SET enable_external_access = true; SELECT 1 FROM flights"], "persist sql"),
        (["cat", "flights", "--as-of", "9"], "upper"),
        (["cat", "nosuch"], "nosuch"),
    ):
        res = runner.invoke(main, [*base, *args])
        assert res.exit_code == 1, (args, res.output)
        assert words in res.output, (args, res.output)
