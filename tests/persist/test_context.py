"""The client as a facade: its knobs (persist.config), what its handles share
(persist.context), the shard opener (persist.shards) and the background worker
(persist.maintenance).

Protects: handles, transactions, the compactor, GC and fsck hold the client's context and
never import or hold the client; the knobs are validated once, with errors naming them;
the public functions that took a client (collect_garbage, fsck, snapshot_many) still do.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from persist import (
    InvalidUsage,
    MemoryBlob,
    PersistClient,
    collect_garbage,
    fsck,
    snapshot_many,
)
from persist.config import PersistConfig
from persist.context import PersistContext, as_context
from persist.shards import Shards
from stash import Antichain, Stash

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])
ROOT = Path(__file__).resolve().parents[2]

#: The modules below the client: none may import it (not even for types).
BELOW_CLIENT = [
    "config",
    "context",
    "fetch",
    "handle",
    "read",
    "write",
    "txn",
    "compactor",
    "gc",
    "fsck",
    "shards",
    "maintenance",
]


def upd(k: str, v: int, t: int, d: int = 1) -> tuple[tuple[tuple[str], tuple[int]], int, int]:
    return ((k,), (v,)), t, d


@pytest.fixture
def client() -> Iterator[PersistClient]:
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="inline")
    yield c
    c.close()
    s.close()


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


@pytest.mark.parametrize("name", BELOW_CLIENT)
def test_modules_below_the_client_never_import_it(name: str) -> None:
    imported = _imports(ROOT / "persist" / f"{name}.py")
    assert "persist.client" not in imported, f"persist/{name}.py imports persist.client"


def test_handles_hold_the_context_not_the_client(client: PersistClient) -> None:
    w, r = client.open("s", KS, VS)
    w.compare_and_append([upd("a", 1, 0)], Antichain.from_elem(0), Antichain.from_elem(1))
    listen = r.listen(0)
    txn = client.begin()
    try:
        for obj in (w, r, listen._h, client.compactor, txn._shard_ops):
            assert not any(v is client for v in vars(obj).values()), obj
        assert w._ctx is client.context and r._ctx is client.context
        assert client.compactor.ctx is client.context
        assert client.shard_ops.ctx is client.context
        assert client.context.maintenance is client.maintenance
    finally:
        listen.close()
        txn.abort()


def test_config_defaults_are_the_clients(client: PersistClient) -> None:
    cfg = PersistConfig(compaction="inline")
    assert client.config == PersistConfig(compaction="inline", clock=client.clock)
    for knob in (
        "reader_lease_seconds",
        "writer_lease_seconds",
        "handoff_lease_seconds",
        "inline_max_bytes",
        "inline_total_max_bytes",
        "target_part_bytes",
        "write_workers",
        "read_workers",
        "gc_grace_seconds",
        "gc_interval_seconds",
        "piggyback_seconds",
    ):
        assert getattr(client, knob) == getattr(cfg, knob), knob


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"compaction": "sometimes"}, "compaction"),
        ({"handoff_lease_seconds": 0}, "handoff_lease_seconds"),
        ({"handoff_lease_seconds": -1.0}, "handoff_lease_seconds"),
        ({"handoff_lease_seconds": math.nan}, "handoff_lease_seconds"),
    ],
)
def test_bad_knobs_are_refused_naming_them(changes: dict[str, object], named: str) -> None:
    with pytest.raises(InvalidUsage, match=named):
        PersistConfig(**changes)  # type: ignore[arg-type]
    with pytest.raises(InvalidUsage, match=named):
        PersistConfig().replace(**changes)
    s = Stash.open("memory://", fenced=False)
    try:
        with pytest.raises(InvalidUsage, match=named):
            PersistClient(s, MemoryBlob(), **changes)  # type: ignore[arg-type]
    finally:
        s.close()


def test_config_is_frozen() -> None:
    cfg = PersistConfig()
    with pytest.raises(AttributeError):
        cfg.compaction = "off"  # type: ignore[misc]


def test_compaction_mode_can_be_changed_but_not_to_nonsense(client: PersistClient) -> None:
    client.compaction = "off"
    assert client.compaction == "off" and client.context.config.compaction == "off"
    with pytest.raises(InvalidUsage, match="compaction"):
        client.compaction = "sometimes"  # type: ignore[assignment]
    assert client.compaction == "off"


def test_a_context_is_closed_with_its_client() -> None:
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="background")
    ctx = c.context
    c.close()
    assert ctx.closed
    with pytest.raises(InvalidUsage, match="closed"):
        ctx.check_open()
    with pytest.raises(InvalidUsage, match="closed"):
        c.open("s", KS, VS)
    with pytest.raises(InvalidUsage, match="closed"):
        c.begin()
    assert c.compactor.wait_idle(timeout=10)
    s.close()


def test_gc_fsck_and_snapshot_many_take_the_client_or_its_parts(client: PersistClient) -> None:
    w, _r = client.open("s", KS, VS)
    w.compare_and_append([upd("a", 1, 0)], Antichain.from_elem(0), Antichain.from_elem(1))
    ctx = client.context
    assert as_context(client) is ctx and as_context(ctx) is ctx
    assert fsck(client, "s").ok and fsck(ctx, "s").ok
    assert collect_garbage(client, "s").shard_id == collect_garbage(ctx, "s").shard_id
    by_client = snapshot_many(client, ["s"])["s"]
    by_shards = snapshot_many(client.shard_ops, ["s"])["s"]
    assert by_client.equals(by_shards) and by_client.num_rows == 1


def test_a_txn_refuses_a_writer_of_another_client(client: PersistClient) -> None:
    s2 = Stash.open("memory://", fenced=False)
    other = PersistClient(s2, MemoryBlob(), compaction="off")
    try:
        w2 = other.open_writer("s", KS, VS)
        txn = client.begin()
        with pytest.raises(InvalidUsage, match="another PersistClient"):
            txn.write(w2, pa.table({"k": ["a"], "v": [1]}))
        txn.abort()
    finally:
        other.close()
        s2.close()


def test_shards_registry_makes_one_machine_per_shard(client: PersistClient) -> None:
    ops = Shards(client.context)
    m1, sid1 = ops.open_machine("s", KS, VS)
    m2, sid2 = client.shard_ops.open_machine("s", KS, VS)
    assert m1 is m2 and sid1 == sid2 == 0
    assert isinstance(client.context, PersistContext)
    assert client.machine(m1.shard_id) is m1 and client._machines[m1.shard_id] is m1
