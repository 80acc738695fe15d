"""A backup (or a restore into a new file) that fails half way leaves no file: the copy
is written beside the target under a temporary name and put in place only once whole.
A failed backup used to leave the file it had created (an empty file, or an empty
migrated stash), so running it again was refused ("exists; choose a new file") and a
restore of that file restored an empty stash without a word."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from stash import Stash, StashError, TypedCollection, ops

CFG: TypedCollection[str, int] = TypedCollection("cfg", key="str", value="int")


def _failing_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite's online backup fails half way (half the pages copied, then an I/O
    error: SQLite rolls the target back to what it was, an empty file)."""

    class Conn:
        def __init__(self, inner: sqlite3.Connection) -> None:
            self.inner = inner

        def backup(self, target: Any) -> None:
            def progress(_status: int, remaining: int, total: int) -> None:
                if remaining < total // 2:
                    raise sqlite3.OperationalError("disk I/O error")

            self.inner.backup(target.inner, pages=1, progress=progress)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    def connect(*a: Any, **kw: Any) -> Any:
        return Conn(sqlite3.connect(*a, **kw))

    monkeypatch.setattr(ops, "sqlite3", SimpleNamespace(connect=connect))


def _failing_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writing the snapshot into the new file fails (a full disk)."""

    def write(stash: Any, snap: Any) -> None:
        raise StashError("sqlite: database or disk is full")

    monkeypatch.setattr(ops, "write_snapshot", write)


@pytest.mark.parametrize(
    ("source", "fail"),
    [("sqlite", _failing_copy), ("memory", _failing_write)],
    ids=["sqlite online copy", "snapshot written"],
)
def test_a_failed_backup_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, fail: Any
) -> None:
    url = f"sqlite:///{tmp_path}/src.db" if source == "sqlite" else "memory://backup-src"
    with Stash.open(url, fenced=False) as s:
        CFG.upsert(s, [(f"k{i}", i) for i in range(2000)])
        dst = tmp_path / "out" / "backup.db"
        dst.parent.mkdir()
        with monkeypatch.context() as m:
            fail(m)
            with pytest.raises((StashError, sqlite3.Error)):
                ops.backup(url, dst)
        assert list(dst.parent.iterdir()) == []  # nothing left behind
        ops.backup(url, dst)  # run again: it works, and the copy is whole
    assert sorted(p.name for p in dst.parent.iterdir()) == ["backup.db"]
    with Stash.open(f"sqlite:///{dst}", mode="readonly", fenced=False) as b:
        assert len(CFG.peek_one(b)) == 2000


def test_a_failed_restore_into_a_new_file_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore into a SQLite file that does not exist yet, failing half way, leaves
    no file.  It used to leave the file it had created (empty: SQLite rolled the copy
    back), where a stash then opened as an empty one."""
    with Stash.open(f"sqlite:///{tmp_path}/src.db", fenced=False) as s:
        CFG.upsert(s, [(f"k{i}", i) for i in range(2000)])
    ops.backup(f"sqlite:///{tmp_path}/src.db", tmp_path / "backup.db")
    target = tmp_path / "out" / "restored.db"
    target.parent.mkdir()
    with monkeypatch.context() as m:
        _failing_copy(m)
        with pytest.raises((StashError, sqlite3.Error)):
            ops.restore(tmp_path / "backup.db", f"sqlite:///{target}")
    assert list(target.parent.iterdir()) == []
    ops.restore(tmp_path / "backup.db", f"sqlite:///{target}")  # again: it works
    with Stash.open(f"sqlite:///{target}", mode="readonly", fenced=False) as t:
        assert len(CFG.peek_one(t)) == 2000
