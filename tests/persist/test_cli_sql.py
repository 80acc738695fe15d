"""``persist cat`` and ``persist sql``: a shard's consolidated rows as of a time, and DuckDB
SQL over shards registered as Arrow tables (one row per unit of multiplicity), checked
against pandas; bad input is refused with a message naming the rule."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
        (["sql", "SELECT count(*) FROM flights", "--as-of", "-1"], "since"),
        (["cat", "flights", "--as-of", "9"], "upper"),
        (["cat", "nosuch"], "nosuch"),
    ):
        res = runner.invoke(main, [*base, *args])
        assert res.exit_code == 1, (args, res.output)
        assert words in res.output, (args, res.output)


# ---------------------------------- persist sql: no filesystem probing, limits, consistent reads


def _one_row_shard(tmp_path: Path, name: str = "flights", diff: int = 1) -> list[str]:
    url, blob = f"sqlite:///{tmp_path}/s.db", f"file://{tmp_path}/blob"
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, blob)
        w = c.open_writer(name, pa.schema([("id", pa.int64())]), pa.schema([("v", pa.int64())]))
        w.compare_and_append([(((1,), (2,)), 0, diff)], 0, 1)
        c.close()
    return ["--stash", url, "--blob", blob]


def test_sql_query_parsing_touches_no_filesystem(tmp_path: Path) -> None:
    """The query is parsed on the locked connection too: ``EXPORT DATABASE`` given to
    DuckDB's default connection (external access on) created the directory."""
    base = _one_row_shard(tmp_path)
    target = tmp_path / "exported"
    res = CliRunner().invoke(main, [*base, "sql", f"EXPORT DATABASE '{target}'"])
    assert res.exit_code == 1, res.output
    assert "persist sql" in res.output
    assert not target.exists(), "persist sql created a directory on the filesystem"


def test_sql_file_existence_is_not_revealed(tmp_path: Path) -> None:
    """A file that exists and one that does not get the same refusal: ``persist sql`` is
    no file-existence oracle (parsing on the default connection answered "No files
    found" for the absent one only)."""
    base = _one_row_shard(tmp_path)
    there, absent = tmp_path / "there.csv", tmp_path / "absent.csv"
    there.write_text("a,b\n1,2\n")
    r = CliRunner()
    q = "SELECT * FROM flights, read_csv('{}')"
    a = r.invoke(main, [*base, "sql", q.format(there)])
    b = r.invoke(main, [*base, "sql", q.format(absent)])
    assert a.exit_code == 1 and b.exit_code == 1, (a.output, b.output)
    assert a.output.replace(str(there), "F") == b.output.replace(str(absent), "F")


def test_sql_over_a_large_multiplicity_is_clearly_refused(tmp_path: Path) -> None:
    """One row with ``_diff`` 2**50 is a valid multiset, but one row per unit of it
    does not fit in memory: refused with a message naming the shard, the counts and the
    way around (it died with a bare ``MemoryError``).  Under the limit, the expansion
    answers exactly."""
    base = _one_row_shard(tmp_path, "big", 2**50)
    r = CliRunner()
    res = r.invoke(main, [*base, "sql", "SELECT count(*) AS n FROM big", "--json"])
    assert res.exit_code == 1, (res.output, res.exception)
    for words in ("'big'", str(2**50), "--max-expanded-rows", "persist cat big"):
        assert words in res.output, (words, res.output)
    base = _one_row_shard(tmp_path / "small", "small", 1000)
    q = ["sql", "SELECT count(*) AS n, sum(v) AS s FROM small", "--json"]
    res = r.invoke(main, [*base, *q])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == {"n": 1000, "s": 2000}
    res = r.invoke(main, [*base, *q, "--max-expanded-rows", "998"])
    assert res.exit_code == 1 and "over the limit of 998" in res.output, res.output


def test_sql_join_never_sees_half_a_transaction(tmp_path: Path, monkeypatch: Any) -> None:
    """All shards of a query are read at one time, so a transaction committing to
    ``orders`` and ``lines`` between the reads of the two is wholly absent (reading each
    shard at its own latest time showed the order without its line).  The commit is
    injected right after the first shard's snapshot."""
    from persist import snapshots

    url, blob = f"sqlite:///{tmp_path}/s.db", f"file://{tmp_path}/blob"
    ks, vs = pa.schema([("id", pa.int64())]), pa.schema([("v", pa.int64())])
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, blob)
        t = c.begin()
        t.write("orders", pa.table({"id": [1], "v": [10]}), key_schema=ks, value_schema=vs)
        t.write("lines", pa.table({"id": [1], "v": [100]}), key_schema=ks, value_schema=vs)
        t.commit()
        c.close()
    real = snapshots.read_version
    calls: list[str] = []

    def racing(ctx: Any, m: Any, st: Any, *args: Any, **kwargs: Any) -> Any:
        out = real(ctx, m, st, *args, **kwargs)
        calls.append(st.shard_id)
        if len(calls) == 1:  # another process commits a transaction right now
            with Stash.open(url, fenced=False) as s2:
                c2 = PersistClient(s2, blob)
                t2 = c2.begin()
                t2.write("orders", pa.table({"id": [2], "v": [20]}))
                t2.write("lines", pa.table({"id": [2], "v": [200]}))
                t2.commit()
                c2.close()
        return out

    monkeypatch.setattr(snapshots, "read_version", racing)
    base = ["--stash", url, "--blob", blob]
    q = "SELECT o.id, l.v AS lv FROM orders o LEFT JOIN lines l ON l.id = o.id ORDER BY 1"
    res = CliRunner().invoke(main, [*base, "sql", q, "--json"])
    assert res.exit_code == 0, res.output
    assert len(calls) == 2, calls  # the commit landed between the two reads
    rows = [json.loads(x) for x in res.output.splitlines()]
    assert rows == [{"id": 1, "lv": 100}], f"half a transaction visible: {rows}"
    monkeypatch.setattr(snapshots, "read_version", real)
    # Both transactions are there at the latest common time, and --as-of reads all at T.
    res = CliRunner().invoke(main, [*base, "sql", q, "--json"])
    assert [json.loads(x) for x in res.output.splitlines()] == [
        {"id": 1, "lv": 100},
        {"id": 2, "lv": 200},
    ]
    res = CliRunner().invoke(main, [*base, "sql", q, "--json", "--as-of", "0"])
    assert [json.loads(x) for x in res.output.splitlines()] == [{"id": 1, "lv": 100}]


def test_sql_names_the_shard_without_a_readable_time(tmp_path: Path) -> None:
    """The common time of a query's shards is the latest time all of them have; a shard
    with none yet (upper still its since) is refused by name, the others unaffected."""
    base = _one_row_shard(tmp_path, "filled")
    with Stash.open(base[1], fenced=False) as s:
        c = PersistClient(s, base[3])
        c.open_writer("empty", pa.schema([("id", pa.int64())]), pa.schema([("v", pa.int64())]))
        c.close()
    r = CliRunner()
    res = r.invoke(main, [*base, "sql", "SELECT * FROM filled, empty"])
    assert res.exit_code == 1 and "shard 'empty' has no readable time yet" in res.output
    res = r.invoke(main, [*base, "sql", "SELECT count(*) AS n FROM filled", "--json"])
    assert res.exit_code == 0 and json.loads(res.output) == {"n": 1}, res.output
