"""The ``persist`` commands of tables (``persist/cli.py``): ``history``, on a
SQLite stash and a file blob store, read through a readonly stash."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from click.testing import CliRunner

from persist import PersistClient
from persist.cli import main
from stash import Stash

SCHEMA = pa.schema([pa.field("id", pa.int64(), False), ("v", pa.int64())])


def _store(tmp_path: Path) -> tuple[str, str]:
    url, blob = f"sqlite:///{tmp_path}/s.db", f"file://{tmp_path}/blob"
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, blob, compaction="off")
        t = c.create_table("orders", SCHEMA, key=["id"])
        t.append(pa.table({"id": [1, 2], "v": [10, 20]}))
        t.delete(pc.field("id") == 2)
        c.close()
    return url, blob


def test_history_command(tmp_path: Path) -> None:
    url, blob = _store(tmp_path)
    r = CliRunner()
    res = r.invoke(main, ["history", "orders", "--stash", url, "--blob", blob, "--json"])
    assert res.exit_code == 0, (res.output, res.exception)
    lines = [json.loads(x) for x in res.output.splitlines()]
    assert [x["operation"] for x in lines] == ["delete", "append", "create"]
    assert lines[1]["metrics"]["rows_inserted"] == 2 and lines[0]["time"] == 1
    assert lines[0]["timestamp"].endswith("+00:00")
    res = r.invoke(main, ["history", "orders", "--limit", "1", "--stash", url, "--blob", blob])
    assert res.exit_code == 0 and "delete" in res.output and "create" not in res.output
    res = r.invoke(main, ["history", "ordrs", "--stash", url, "--blob", blob])
    assert res.exit_code == 1 and "did you mean 'orders'" in res.output


def test_compact_full(tmp_path: Path) -> None:
    url, blob = _store(tmp_path)
    res = CliRunner().invoke(
        main, ["compact", "orders", "--full", "--json", "--stash", url, "--blob", blob]
    )
    assert res.exit_code == 0, (res.output, res.exception)
    rep = json.loads(res.output)
    assert rep["applied"] and rep["batches_after"] == 1 and rep["batches_before"] == 2


def test_retention_command(tmp_path: Path) -> None:
    url, blob = _store(tmp_path)
    r = CliRunner()
    args = ["--stash", url, "--blob", blob, "--json"]

    def retention(*option: str) -> int | None:
        """Run ``persist retention orders [--duration D]``; the retention it reports
        (a setting the command parsed and stored, not a measured time)."""
        res = r.invoke(main, ["retention", "orders", *option, *args])
        assert res.exit_code == 0, (res.output, res.exception)
        value: int | None = json.loads(res.output)["retention_seconds"]
        return value

    week, day_and_a_half = 7 * 86400, 36 * 3600
    set_to, shown = retention("--duration", "7d"), retention()  # shown readonly
    assert set_to == week and shown == week
    set_to = retention("--duration", "1d12h")
    assert set_to == day_and_a_half
    set_to = retention("--duration", "none")
    assert set_to is None
    res = r.invoke(main, ["retention", "orders", "--duration", "7 days", *args])
    refused = res.exit_code == 2 and "not a duration" in res.output
    assert refused, res.output


def test_cat_and_sql_write_nothing(tmp_path: Path) -> None:
    """``persist cat`` and ``persist sql`` read without a lease: the shard's seqno does
    not move (each read used to register and expire a reader: two versions)."""
    url, blob = _store(tmp_path)

    def seqno() -> int:
        with Stash.open(url, mode="readonly", fenced=False) as s:
            c = PersistClient(s, blob, compaction="off")
            try:
                return c.inspect("orders").seqno
            finally:
                c.close()

    before = seqno()
    r = CliRunner()
    res = r.invoke(main, ["cat", "orders", "--json", "--stash", url, "--blob", blob])
    assert res.exit_code == 0 and json.loads(res.output) == {"id": 1, "v": 10, "_diff": 1}
    q = "SELECT sum(v) AS s FROM orders"
    res = r.invoke(main, ["sql", q, "--json", "--stash", url, "--blob", blob])
    assert res.exit_code == 0 and json.loads(res.output) == {"s": 10}, res.output
    assert seqno() == before
