"""Protects: ``persist sql`` reads each named shard's own rows, whatever the case of
the names.

The attack: persist sql registers every shard named in the query as a DuckDB view under its
name; DuckDB names are case-insensitive, so two shards whose names differ only in case
collide and one shard's rows are returned for the other (``persist sql`` runs
over consolidated snapshots of the shards the query names)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from persist import PersistClient
from persist.cli import main
from stash import Stash

pytestmark = pytest.mark.adversarial

KS = pa.schema([("id", pa.int64())])
VS = pa.schema([("v", pa.int64())])


def _setup(tmp_path: Path) -> list[str]:
    url, blob = f"sqlite:///{tmp_path}/s.db", f"file://{tmp_path}/blob"
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, blob, compaction="off")
        for name, v in (("A", 100), ("a", 1)):
            w = c.open_writer(name, KS, VS)
            w.compare_and_append([(((1,), (v,)), 0, 1)], 0, 1)
        c.close()
    return ["--stash", url, "--blob", blob]


def test_sql_two_shards_differing_in_case_read_their_own_rows(tmp_path: Path) -> None:
    base = _setup(tmp_path)
    q = "SELECT 'A' AS s, v FROM \"A\" UNION ALL SELECT 'a' AS s, v FROM \"a\" ORDER BY s"
    res = CliRunner().invoke(main, [*base, "sql", q, "--json"])
    if res.exit_code == 1:
        # A clear refusal naming the ambiguity would be acceptable too.
        assert "case" in res.output.lower() or "ambiguous" in res.output.lower(), res.output
        return
    assert res.exit_code == 0, res.output
    got = [json.loads(line) for line in res.output.splitlines()]
    # Shard "A" holds v=100, shard "a" holds v=1: each must read its own row.
    assert got == [{"s": "A", "v": 100}, {"s": "a", "v": 1}], got


def test_sql_finds_a_shard_named_with_other_case_and_each_of_two_alone(tmp_path: Path) -> None:
    """DuckDB resolves table names without case: an unquoted name reads the one shard
    equal to it but for case; with two such shards, each is still readable by its exact
    (quoted) name alone."""
    base = _setup(tmp_path)
    with Stash.open(base[1], fenced=False) as s:
        c = PersistClient(s, base[3], compaction="off")
        w = c.open_writer("Orders", KS, VS)
        w.compare_and_append([(((7,), (70,)), 0, 1)], 0, 1)
        c.close()
    runner = CliRunner()
    res = runner.invoke(main, [*base, "sql", "SELECT id, v FROM orders", "--json"])
    assert res.exit_code == 0, res.output
    assert [json.loads(x) for x in res.output.splitlines()] == [{"id": 7, "v": 70}]
    for query, v in (('SELECT v FROM "A"', 100), ('SELECT v FROM "a"', 1)):
        res = runner.invoke(main, [*base, "sql", query, "--json"])
        assert res.exit_code == 0, res.output
        assert [json.loads(x) for x in res.output.splitlines()] == [{"v": v}], (query, res.output)
