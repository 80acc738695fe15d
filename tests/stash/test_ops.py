"""Operations on a whole stash: backup under concurrent writes restores a committed
state; export/import round-trips; the CLI's JSON output and its listing of internal
collections."""

from __future__ import annotations

import io
import json
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from stash import Antichain, Stash, StashError, TypedCollection, ops
from stash.cli import main
from tests.stash.conftest import OpenStash


def _writer(url: str, stop: threading.Event, committed: list[int]) -> None:
    """Appends order i and the count i + 1 atomically (one append of two collections),
    recording each committed count."""
    with Stash.open(url, fenced=False) as s:
        orders = s.collection("orders", key="int", value="str")
        count = s.collection("count", key="str", value="int")
        i = 0
        while not stop.is_set():
            bo, bc = orders.make_batch(s), count.make_batch(s)
            orders.append_to_batch(bo, i, f"order {i}", 1)
            if i:
                count.append_to_batch(bc, "n", i, -1)
            count.append_to_batch(bc, "n", i + 1, 1)
            s.append([bo, bc])
            i += 1
            committed.append(i)


def _state(url: str) -> tuple[dict[Any, Any], dict[Any, Any]]:
    with Stash.open(url, mode="readonly", fenced=False) as s:
        cs = s.collections()
        return s.peek_one(cs["orders"]), s.peek_one(cs["count"])


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_backup_under_writes_restores_a_committed_state(stash_url: str, tmp_path: Path) -> None:
    with Stash.open(stash_url, fenced=False) as s:  # the collections exist before
        s.collection("orders", key="int", value="str")
        s.collection("count", key="str", value="int")
    stop, committed = threading.Event(), []  # type: ignore[var-annotated]
    t = threading.Thread(target=_writer, args=(stash_url, stop, committed))
    t.start()
    try:
        while len(committed) < 5:
            stop.wait(0.01)
        before = len(committed)
        ops.backup(stash_url, tmp_path / "b.db")
        after = len(committed)
    finally:
        stop.set()
        t.join()
    for target in (f"sqlite:///{tmp_path}/restored.db", f"memory://restore-{tmp_path.name}"):
        ops.restore(tmp_path / "b.db", target)
        orders, count = _state(target) if target.startswith("sqlite") else _memory_state(target)
        n = count["n"]
        # One committed state: orders 0..n-1 and their count, as one append left them.
        assert orders == {i: f"order {i}" for i in range(n)}
        assert before <= n <= after


def _memory_state(url: str) -> tuple[dict[Any, Any], dict[Any, Any]]:
    s = Stash.open(url, mode="readonly", fenced=False)
    cs = s.collections()
    return s.peek_one(cs["orders"]), s.peek_one(cs["count"])


def test_restore_refuses_a_target_with_collections(tmp_path: Path) -> None:
    src, dst = f"sqlite:///{tmp_path}/a.db", f"sqlite:///{tmp_path}/b.db"
    for url in (src, dst):
        with Stash.open(url) as s:
            TypedCollection("c", "str", "int").upsert_key(s, "k", 1 if url == src else 2)
    ops.backup(src, tmp_path / "backup.db")
    with pytest.raises(StashError, match="holds collections; pass replace=True"):
        ops.restore(tmp_path / "backup.db", dst)
    ops.restore(tmp_path / "backup.db", dst, replace=True)
    with Stash.open(dst) as s:
        assert TypedCollection("c", "str", "int").peek_one(s) == {"k": 1}
    with pytest.raises(StashError, match="already has collection c"):
        ops.restore(tmp_path / "backup.db", "memory://restore-twice")
        ops.restore(tmp_path / "backup.db", "memory://restore-twice")


def test_export_import_round_trip(open_stash: OpenStash) -> None:
    s = open_stash()
    tc: TypedCollection[tuple[str, int], Any] = TypedCollection("routes", tuple, "json")
    tc.upsert(s, [(("EWR", 1), {"miles": 2454, "note": 'q"uote é'}), (("JFK", 2), None)])
    c = s.collection("raw", key="str", value="int")
    s.update(c, ("x", 5), 3, 2)  # a row beyond the upper: exported as stored
    buf = io.StringIO()
    rows = ops.export(s, buf)
    assert rows == 3
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert {"collection": "raw", "key": "x", "value": 5, "time": 3, "diff": 2} in lines
    target = Stash.open(f"memory://import-{uuid.uuid4().hex}", fenced=False)
    assert ops.import_(target, io.StringIO(buf.getvalue())) == 3
    for name in ("routes", "raw"):
        a, b = s.collections()[name], target.collections()[name]
        assert s.iter(a) == target.iter(b)
        assert (s.since(a), s.upper(a)) == (target.since(b), target.upper(b))
    with pytest.raises(StashError, match="already has collection"):
        ops.import_(target, io.StringIO(buf.getvalue()))
    with pytest.raises(StashError, match="import: line 2 is not JSON"):
        ops.import_(
            Stash.open("memory://", fenced=False), io.StringIO(lines_text(lines[:1]) + "{x\n")
        )


def lines_text(objs: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(o) + "\n" for o in objs)


@dataclass(frozen=True)
class Airline:
    name: str
    hubs: tuple[str, ...] = ()


def test_cli_json_is_one_object_per_line_without_reprs(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    with Stash.open(url) as s:
        TypedCollection("airlines", "str", Airline).upsert(
            s, [("AA", Airline("American", ("DFW", "CLT"))), ("DL", Airline("Delta"))]
        )
        s.collection("persist.shards")
    r = CliRunner()
    res = r.invoke(main, ["peek", url, "airlines", "--json"])
    assert res.exit_code == 0, res.output
    assert [json.loads(x) for x in res.output.splitlines()] == [
        {"key": "AA", "value": {"name": "American", "hubs": ["DFW", "CLT"]}, "diff": 1},
        {"key": "DL", "value": {"name": "Delta", "hubs": []}, "diff": 1},
    ]
    res = r.invoke(main, ["collections", url, "--json"])
    assert [json.loads(x)["name"] for x in res.output.splitlines()] == ["airlines"]
    res = r.invoke(main, ["collections", url, "--json", "--all"])
    assert [json.loads(x)["name"] for x in res.output.splitlines()] == [
        "airlines",
        "persist.shards",
    ]


def test_cli_backup_restore_export_import_never_fence(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    leader = Stash.open(url, fenced=True)
    tc: TypedCollection[str, int] = TypedCollection("c", "str", "int")
    tc.upsert_key(leader, "k", 1)
    r = CliRunner()
    for args in (
        ["collections", url],
        ["peek", url, "c", "--json"],
        ["iter", url, "c"],
        ["backup", url, str(tmp_path / "b.db")],
        ["export", url, str(tmp_path / "e.jsonl")],
        ["restore", f"sqlite:///{tmp_path}/r.db", str(tmp_path / "b.db")],
        ["import", f"sqlite:///{tmp_path}/r.db", "-"],
    ):
        stdin = None
        if args[0] == "import":
            stdin = (tmp_path / "e.jsonl").read_text().replace('"c"', '"c2"')
        res = r.invoke(main, args, input=stdin)
        assert res.exit_code == 0, (args, res.output)
    leader.confirm_leadership()  # still the leader: no command fenced it
    tc.upsert_key(leader, "k", 2)
    with Stash.open(f"sqlite:///{tmp_path}/r.db", fenced=False) as s:
        assert TypedCollection("c", "str", "int").peek_one(s) == {"k": 1}
        assert TypedCollection("c2", "str", "int").peek_one(s) == {"k": 1}
    assert Antichain.from_elem(0) <= leader.upper(tc.get(leader))
    leader.close()
