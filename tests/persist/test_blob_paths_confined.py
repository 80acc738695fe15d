"""Protects: no shard or blob name reaches a file outside the ``file://`` blob root.

Names through every public entry point never touch a file outside a
``file://`` blob root (held: these pass)."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from persist import PersistClient, collect_garbage
from persist.cli import main as persist_main
from stash import Stash

pytestmark = pytest.mark.adversarial

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])

EVIL = [
    "..",
    "../outside",
    "a/../../outside",
    "/etc/passwd",
    "..\\outside",
    "a\x00b",
    "%2e%2e",
    "%2e%2e%2foutside",
    "\u2025",
    "\uff0e\uff0e",
    "a" * 5000,
    "id:../outside",
    "id:s00000000-0000-0000-0000-000000000000/../../outside",
    "a..b",
    ".hidden",
    "CON",
]


def _tree(d: Path) -> dict[str, tuple[int, float]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime) for p in d.rglob("*")}


def test_no_name_escapes_the_blob_root(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sentinel").write_text("keep me")
    (tmp_path / "sentinel").write_text("keep me")
    root = tmp_path / "root" / "blob"
    blob = f"file://{root}"
    db = f"sqlite:///{tmp_path}/s.db"
    before = {
        k: v
        for k, v in _tree(tmp_path).items()
        if not k.startswith(str(tmp_path / "root")) and not k.startswith(str(tmp_path / "s.db"))
    }
    with Stash.open(db, fenced=False) as s:
        c = PersistClient(s, blob, compaction="inline", gc_interval_seconds=None)
        w, _r = c.open("ok", KS, VS)
        w.compare_and_append([((("a",), (1,)), 0, 1)], 0, 1)
        for name in EVIL:
            for call in (
                lambda name=name: c.open(name, KS, VS),
                lambda name=name: c.finalize_shard(name),
                lambda name=name: collect_garbage(c, name, grace_seconds=0),
                lambda name=name: c.shard_id(name),
            ):
                try:
                    call()
                except Exception:  # noqa: BLE001 - refusals are fine
                    pass
        c.close()
    runner = CliRunner()
    for name in EVIL:
        if "\x00" in name:
            continue
        for args in (
            ["inspect", name],
            ["gc", name, "--grace", "0"],
            ["fsck", name],
            ["drop", name, "--yes"],
            ["cat", name],
            ["compact", name],
        ):
            runner.invoke(persist_main, ["--stash", db, "--blob", blob, *args])
    after = {k: v for k, v in _tree(tmp_path).items() if k in before}
    assert after == before
    assert (outside / "sentinel").read_text() == "keep me"
    assert (tmp_path / "sentinel").read_text() == "keep me"
    assert set(os.listdir(tmp_path)) >= {"outside", "sentinel", "root"}
