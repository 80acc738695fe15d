"""Protects: backup, restore, export and import carry the compare-and-set logs.

Persist keeps each shard's state versions and history in compare-and-set logs
(:mod:`stash.logs`, the table ``logs``), not in collections. ``stash.ops`` read and
wrote collections only, so ``stash export``/``import``, the backup of a Postgres (or
memory) stash and a restore into one dropped every log: the copy listed the tables
(``persist.shards`` is a collection) but every read failed with "has no state in
consensus". The SQLite online backup copied them only because it copies the file."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist import MemoryBlob, PersistClient
from stash import Stash, StashError, TypedCollection, logs, ops

pytestmark = pytest.mark.adversarial

CFG = TypedCollection("cfg", key="str", value="int")
_n = iter(range(10**6))


def _fill(s: Stash, blob: MemoryBlob) -> None:
    CFG.upsert_key(s, "a", 1)
    c = PersistClient(s, blob, compaction="off")
    t = c.create_table("orders", pa.schema([("id", pa.int64()), ("q", pa.int64())]), key=["id"])
    t.append(pa.table({"id": [1, 2], "q": [5, 7]}))
    t.upsert(pa.table({"id": [2], "q": [8]}))
    c.close()
    logs.write(s, [logs.LogEntry("app", None, 0, '{"v":0}', rollup=True)])
    for i in range(1, 4):
        logs.write(s, [logs.LogEntry("app", i - 1, i, f'{{"v":{i}}}')])
    logs.truncate(s, "app", 2)  # entries 2 and 3 are left


def _check(s: Stash, blob: MemoryBlob) -> None:
    assert CFG.peek_one(s) == {"a": 1}
    c = PersistClient(s, blob, compaction="off")
    t = c.table("orders")
    assert t.to_arrow().sort_by("id").to_pylist() == [{"id": 1, "q": 5}, {"id": 2, "q": 8}]
    assert t.to_arrow(as_of=0).sort_by("id").to_pylist() == [{"id": 1, "q": 5}, {"id": 2, "q": 7}]
    assert t.history().column("operation").to_pylist() == ["upsert", "append", "create"]
    c.close()

    def read(tx: Any) -> Any:
        return tx.log_rows("app", 0)

    assert s._read(read, codecs=()) == [(2, False, '{"v":2}'), (3, False, '{"v":3}')]
    logs.write(s, [logs.LogEntry("app", 3, 4, '{"v":4}')])  # the head moved with it


def test_export_import_carries_the_logs(open_stash: Any) -> None:
    src, blob = open_stash(), MemoryBlob()
    _fill(src, blob)
    buf = io.StringIO()
    ops.export(src, buf)
    with Stash.open(f"memory://ops-logs-{next(_n)}", fenced=False) as dst:
        ops.import_(dst, io.StringIO(buf.getvalue()))
        _check(dst, blob)


def test_backup_and_restore_carry_the_logs(open_stash: Any, stash_url: str, tmp_path: Path) -> None:
    blob = MemoryBlob()
    _fill(open_stash(), blob)
    ops.backup(stash_url, tmp_path / "b.db")
    with Stash.open(f"sqlite:///{tmp_path}/b.db", fenced=False) as b:
        _check(b, blob)
    ops.backup(stash_url, tmp_path / "c.db")
    target = f"memory://ops-logs-{next(_n)}"
    ops.restore(tmp_path / "c.db", target)
    with Stash.open(target, fenced=False) as dst:
        _check(dst, blob)


def test_import_refuses_a_target_holding_a_log_and_writes_nothing(open_stash: Any) -> None:
    src, blob = open_stash(), MemoryBlob()
    _fill(src, blob)
    buf = io.StringIO()
    ops.export(src, buf)
    with Stash.open(f"memory://ops-logs-{next(_n)}", fenced=False) as dst:
        logs.write(dst, [logs.LogEntry("app", None, 0, "{}", rollup=True)])
        with pytest.raises(StashError, match="already has log app"):
            ops.import_(dst, io.StringIO(buf.getvalue()))
        assert dst.collections() == {}


@pytest.mark.parametrize(
    "entry",
    [
        {"log": "x", "seqno": True, "rollup": False, "data": "{}"},
        {"log": "x", "seqno": 1, "rollup": 0, "data": "{}"},
        {"log": "x", "seqno": 1, "rollup": False, "data": {}},
    ],
)
def test_import_refuses_a_malformed_log_entry(entry: dict[str, Any]) -> None:
    with Stash.open(f"memory://ops-logs-{next(_n)}", fenced=False) as dst:
        with pytest.raises(StashError, match="line 1"):
            ops.import_(dst, [json.dumps(entry)])


def test_import_refuses_entries_out_of_order() -> None:
    lines = [json.dumps({"log": "x", "seqno": s, "rollup": False, "data": "{}"}) for s in (1, 0)]
    with Stash.open(f"memory://ops-logs-{next(_n)}", fenced=False) as dst:
        with pytest.raises(StashError, match="seqno order"):
            ops.import_(dst, lines)


def test_import_and_restore_into_postgres(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    from tests.support.dbutil import backend_url

    target = backend_url(request, "postgres", tmp_path)
    blob = MemoryBlob()
    with Stash.open(f"sqlite:///{tmp_path}/src.db", fenced=False) as src:
        _fill(src, blob)
        buf = io.StringIO()
        ops.export(src, buf)
    with Stash.open(target, fenced=False) as dst:
        ops.import_(dst, io.StringIO(buf.getvalue()))
        _check(dst, blob)


def test_restore_refuses_a_sqlite_target_holding_only_logs(tmp_path: Path) -> None:
    with Stash.open(f"sqlite:///{tmp_path}/src.db", fenced=False) as src:
        CFG.upsert_key(src, "a", 1)
    ops.backup(f"sqlite:///{tmp_path}/src.db", tmp_path / "b.db")
    target = f"sqlite:///{tmp_path}/t.db"
    with Stash.open(target, fenced=False) as t:
        logs.write(t, [logs.LogEntry("app", None, 0, '{"v":0}', rollup=True)])
    with pytest.raises(StashError, match="holds logs; pass replace=True"):
        ops.restore(tmp_path / "b.db", target)
    with Stash.open(target, fenced=False) as t:
        assert logs.head_seqno(t, "app") == 0  # not replaced
