"""Protects: ``Stash.open(url, mode="readonly")`` reads a SQLite stash on a read-only
file system (a backup on a read-only mount, an archived copy), and never writes there.

A stash file closed cleanly has no ``-wal`` and ``-shm`` files beside it. SQLite opens
a WAL-mode database only when it can create them, or when the database is opened
``immutable``: on a read-only directory a readonly handle fails with "unable to open
database file", and so does a persist client reading a table through it.

The directory is made read-only with ``chmod`` for an ordinary user, and as root (whom
permissions do not stop) with a read-only bind mount; where neither is possible the
tests fail under CI (the check must run there) and skip elsewhere."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import pyarrow as pa
import pytest

from persist import PersistClient
from stash import Stash, TypedCollection
from tests.support.pg_fixtures import in_ci

pytestmark = pytest.mark.adversarial

CFG = TypedCollection("cfg", key="str", value="int")


def _unavailable(reason: str) -> NoReturn:
    """Fail under CI (the check must run there), skip otherwise; never returns."""
    if in_ci():
        pytest.fail(f"a read-only directory is required under CI: {reason}", pytrace=False)
    pytest.skip(reason)


@contextmanager
def _read_only_mount(src: Path, mnt: Path) -> Iterator[Path]:
    """``src`` seen through a read-only bind mount at ``mnt`` (root only: permissions
    do not stop root)."""
    mnt.mkdir()
    mount, umount = shutil.which("mount"), shutil.which("umount")
    if mount is None or umount is None:
        _unavailable("root without mount(8): cannot make a read-only directory")
    if subprocess.run([mount, "--bind", str(src), str(mnt)], capture_output=True).returncode:
        _unavailable("root cannot bind-mount here: cannot make a read-only directory")
    try:
        r = subprocess.run([mount, "-o", "remount,ro,bind", str(mnt)], capture_output=True)
        if r.returncode:
            _unavailable("cannot remount read-only here")
        yield mnt
    finally:
        subprocess.run([umount, str(mnt)], capture_output=True)


@contextmanager
def read_only_copy(src: Path, where: Path) -> Iterator[Path]:
    """``src`` seen through a read-only directory (a copy, made read-only by
    permissions; as root, a read-only bind mount)."""
    if os.geteuid() == 0:
        with _read_only_mount(src, where / "mnt") as mnt:
            yield mnt
        return
    dst = where / "ro"
    shutil.copytree(src, dst)
    for root, dirs, files in os.walk(dst):
        for f in files:
            os.chmod(os.path.join(root, f), 0o444)
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o555)
    os.chmod(dst, 0o555)
    try:
        yield dst
    finally:
        for root, dirs, _ in os.walk(dst):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o755)
        os.chmod(dst, 0o755)


def _written(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    with Stash.open(f"sqlite:///{src}/stash.db") as s:
        CFG.upsert_key(s, "retention_days", 7)
        client = PersistClient(s, f"file://{src}/blob")
        schema = pa.schema([("id", pa.int64()), ("qty", pa.int64())])
        t = client.create_table("orders", schema, key=["id"])
        t.append(pa.table({"id": [1, 2], "qty": [5, 7]}))
        client.close()
    assert sorted(os.listdir(src)) == ["blob", "stash.db"]  # closed cleanly: no -wal
    return src


def test_readonly_stash_reads_a_file_on_a_read_only_directory(tmp_path: Path) -> None:
    src = _written(tmp_path)
    with read_only_copy(src, tmp_path) as ro:
        s = Stash.open(f"sqlite:///{ro}/stash.db", mode="readonly")
        try:
            assert CFG.peek_one(s) == {"retention_days": 7}
            client = PersistClient(s, f"file://{ro}/blob")
            assert client.table("orders").to_arrow().sort_by("id").to_pylist() == [
                {"id": 1, "qty": 5},
                {"id": 2, "qty": 7},
            ]
            client.close()
        finally:
            s.close()
        assert sorted(os.listdir(ro)) == ["blob", "stash.db"]  # nothing written


@contextmanager
def read_only_view(src: Path, where: Path) -> Iterator[tuple[Path, Callable[[], None]]]:
    """``src`` itself (live, not a copy) seen through a directory this process cannot
    write, and a function that lets a writer at ``src`` in (another user, or another
    mount's view of the same directory)."""
    if os.geteuid() == 0:
        with _read_only_mount(src, where / "view") as mnt:
            yield mnt, lambda: None  # the writer writes through src
        return
    os.chmod(src, 0o555)
    try:
        yield src, lambda: os.chmod(src, 0o755)
    finally:
        os.chmod(src, 0o755)


def test_readonly_stash_on_a_read_only_view_sees_a_writer_that_starts_later(
    tmp_path: Path,
) -> None:
    """A readonly handle opened while the file was closed (read immutable), then a
    writer opens the file from elsewhere (its owner, a writable mount of the same
    directory) and commits: the reader's later reads see the commits, through the
    writer's -wal and after the writer closed, as a reader opened then sees them.  It
    used to keep reading the file as it was at its open (immutable: SQLite trusts
    nothing changes, ignores the -wal and keeps its cache)."""
    src = tmp_path / "src"
    src.mkdir()
    with Stash.open(f"sqlite:///{src}/stash.db") as s:
        CFG.upsert_key(s, "n", 1)
    with read_only_view(src, tmp_path) as (ro, let_writer_in):
        r = Stash.open(f"sqlite:///{ro}/stash.db", mode="readonly")
        try:
            assert CFG.peek_one(r) == {"n": 1}
            let_writer_in()
            w = Stash.open(f"sqlite:///{src}/stash.db")
            try:
                CFG.upsert_key(w, "n", 2)
                assert CFG.peek_one(r) == {"n": 2}  # read through the writer's -wal
                CFG.upsert_key(w, "n", 3)
                assert CFG.peek_one(r) == {"n": 3}
            finally:
                w.close()
            assert CFG.peek_one(r) == {"n": 3}  # checkpointed into the file, -wal gone
            w = Stash.open(f"sqlite:///{src}/stash.db")
            try:
                CFG.upsert_key(w, "n", 4)
            finally:
                w.close()
            assert CFG.peek_one(r) == {"n": 4}
        finally:
            r.close()


def test_a_read_that_a_writer_overlaps_is_read_again(tmp_path: Path) -> None:
    """A read of an immutable connection that a writer's checkpoint overlaps (the writer
    opened the file elsewhere, committed and closed, copying its pages into the file
    under the read): the read is run again on a new connection and sees one committed
    state.  It used to fail with "database disk image is malformed" (pages of two
    states read as one B-tree), or could return rows of two states."""
    a: TypedCollection[str, int] = TypedCollection("a", key="str", value="int")
    b: TypedCollection[str, int] = TypedCollection("b", key="str", value="int")
    src = tmp_path / "src"
    src.mkdir()
    with Stash.open(f"sqlite:///{src}/stash.db") as s:
        for c in (a, b):  # enough rows that the collections lie on pages of their own
            c.upsert(s, [(f"k{i:05d}", i) for i in range(3000)])
            c.upsert_key(s, "n", 1)
        ids = a.get(s).id, b.get(s).id
    with read_only_view(src, tmp_path) as (ro, let_writer_in):
        r = Stash.open(f"sqlite:///{ro}/stash.db", mode="readonly")
        runs = []

        def read(tx: Any) -> list[list[Any]]:
            runs.append(1)
            first = tx.rows(ids[0])
            if len(runs) == 1:  # a writer commits and checkpoints meanwhile
                let_writer_in()
                with Stash.open(f"sqlite:///{src}/stash.db") as w:
                    a.upsert_key(w, "n", 2)
                    b.upsert_key(w, "n", 2)
            return [[x for x in rows if x[0] == '"n"'] for rows in (first, tx.rows(ids[1]))]

        try:
            got = r._read(read, codecs=())
        finally:
            r.close()
        assert len(runs) == 2  # read again, after the writer closed
        assert [[v for _k, v, _t, _d in rows] for rows in got] == [["2"], ["2"]]
