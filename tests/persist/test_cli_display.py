"""How the CLIs show values (``stash/cli.py`` ``print_table``): numbers and timestamps
unquoted, numeric columns right-aligned, byte counts humanized in tables and exact in
``--json``; ``stash collections`` hides persist's internal collections unless ``--all``."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pyarrow as pa
from click.testing import CliRunner

from persist import PersistClient
from persist.cli import main
from stash import Stash
from stash.cli import main as stash_main


def _store(tmp_path: Path) -> tuple[str, str]:
    url, blob = f"sqlite:///{tmp_path}/s.db", f"file://{tmp_path}/blob"
    schema = pa.schema(
        [pa.field("id", pa.int64(), False), ("name", pa.string()), ("at", pa.timestamp("us"))]
    )
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, blob, compaction="off", inline_max_bytes=0)
        t = c.create_table("orders", schema, key=["id"])
        at = dt.datetime(2024, 5, 6, 7, 8, 9)
        t.append(pa.table({"id": [1, 12345], "name": ["a", "b"], "at": [at, at]}, schema=schema))
        c.close()
    return url, blob


def test_sql_numbers_and_timestamps_unquoted_numbers_right_aligned(tmp_path: Path) -> None:
    url, blob = _store(tmp_path)
    res = CliRunner().invoke(
        main,
        ["sql", 'SELECT id, name, "at" FROM orders ORDER BY id', "--stash", url, "--blob", blob],
    )
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert '"' not in res.output, res.output  # was "12345"-style JSON for timestamps
    row1 = next(x for x in lines if " a " in x)
    row2 = next(x for x in lines if " b " in x)
    assert "2024-05-06T07:08:09" in row1
    # right-aligned: the short number ends where the long one ends
    assert row1.index("1 ") + 1 == row2.index("12345") + 5, (row1, row2)


def test_bytes_humanized_in_tables_exact_in_json(tmp_path: Path) -> None:
    url, blob = _store(tmp_path)
    r = CliRunner()
    res = r.invoke(main, ["shards", "--stash", url, "--blob", blob])
    assert res.exit_code == 0 and " kB" in res.output, res.output
    res = r.invoke(main, ["shards", "--json", "--stash", url, "--blob", blob])
    (row,) = json.loads(res.output)
    assert isinstance(row["bytes"], int) and row["bytes"] > 1000


def test_stash_collections_hides_persist_unless_all(tmp_path: Path) -> None:
    url, _blob = _store(tmp_path)
    with Stash.open(url, fenced=False) as s:
        s.collection("mine", key="str", value="json")
    r = CliRunner()
    res = r.invoke(stash_main, ["collections", url, "--json"])
    assert res.exit_code == 0, res.output
    names = [json.loads(line)["name"] for line in res.output.splitlines()]
    assert names == ["mine"]
    res = r.invoke(stash_main, ["collections", url, "--json", "--all"])
    names = [json.loads(line)["name"] for line in res.output.splitlines()]
    assert "mine" in names and "persist.shards" in names
