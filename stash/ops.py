"""Operations on a whole stash: backup and restore, export and import as JSON lines.

* :func:`backup` writes a consistent snapshot of a stash to a SQLite stash file: a SQLite
  stash through SQLite's online backup API (``sqlite3.Connection.backup``: pages copied
  under a read lock, restarted by SQLite when a writer commits in between, so the copy
  is one committed state); any other stash through one read transaction (Postgres:
  ``REPEATABLE READ``) whose rows are written to a new SQLite stash file.  The backup is
  itself a stash: ``sqlite:///FILE`` opens it.  It is written under a temporary name
  beside ``FILE`` and put in place once whole: a backup that fails leaves no file.
* :func:`restore` brings a backup into a stash: onto a SQLite file with the online
  backup API (the whole database is replaced, in one step for readers; a file that
  does not exist yet is written under a temporary name and put in place once whole,
  so a failed restore leaves none); into any other stash by importing its snapshot
  (the target must hold none of its collections).
* :func:`export` writes a snapshot as JSON lines, one object per line: a
  ``{"collection": NAME, "key_codec", "value_codec", "since", "upper"}`` line per
  collection, then ``{"collection": NAME, "key", "value", "time", "diff"}`` per stored
  row (key and value as the stored JSON), then ``{"log": NAME, "seqno", "rollup",
  "data"}`` per entry of each compare-and-set log (:mod:`stash.logs`: persist keeps its
  shards' state versions there); :func:`import_` reads them back.

Invariants kept here: a snapshot is read in one read transaction, so it is one committed
state of every collection and every compare-and-set log; an import (and a restore by
import) writes everything in one write transaction or nothing, and refuses a target that
already holds a collection or a log of the snapshot; rows and log entries are copied as
stored (canonical JSON text, the entries' own text), never decoded with codecs (a
collection whose record type is not importable here copies alike).  The wall-clock
records of retentions by duration (``commit_times``) are not copied: a time without a
record only holds the since back (:mod:`stash.retention`).

Source of the idea: SQLite's online backup API (``sqlite3_backup_*``), ``pg_dump``'s
one-snapshot dump, and etcd's ``snapshot save`` / ``snapshot restore``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from stash.errors import StashError
from stash.txn import LogRow, Row, Txn

__all__ = ["Snapshot", "backup", "export", "import_", "read_snapshot", "restore"]


@dataclass
class CollectionSnapshot:
    """One collection of a snapshot: its codec names, frontiers and stored rows."""

    name: str
    key_codec: str
    value_codec: str
    since: int | None
    upper: int | None
    rows: list[Row] = field(default_factory=list)


@dataclass
class LogSnapshot:
    """One compare-and-set log of a snapshot: its entries ``(seqno, rollup, data)``,
    oldest first (those truncation left)."""

    name: str
    entries: list[LogRow] = field(default_factory=list)


@dataclass
class Snapshot:
    """Every collection and every compare-and-set log of a stash at one committed state."""

    collections: list[CollectionSnapshot]
    logs: list[LogSnapshot] = field(default_factory=list)


#: Below every seqno: a log read from here returns every entry it holds.
_FIRST_SEQNO = -(2**63)


def read_snapshot(stash: Any) -> Snapshot:
    """Every collection with its rows and every log with its entries, read in one read
    transaction."""

    def read(tx: Txn) -> Snapshot:
        out = []
        for name, cid, kc, vc in sorted(tx.list_collections()):
            since, upper = tx.frontiers(cid)
            out.append(CollectionSnapshot(name, kc, vc, since, upper, tx.rows(cid)))
        logs = [LogSnapshot(n, tx.log_rows(n, _FIRST_SEQNO)) for n in tx.log_names()]
        return Snapshot(out, logs)

    snap: Snapshot = stash._read(read, codecs=())
    return snap


def write_snapshot(stash: Any, snap: Snapshot) -> None:
    """Create every collection of ``snap`` in ``stash`` with its rows and frontiers, in
    one write transaction.

    Raises:
        StashError: the stash already holds a collection or a log of the snapshot
            (nothing is written).
    """

    def write(tx: Txn) -> None:
        for log in snap.logs:
            expected = tx.log_head_seqno(log.name)
            if expected is not None:
                raise StashError(
                    f"the target stash already has log {log.name}: restore or import into "
                    "a stash without the snapshot's logs; nothing was written"
                )
            for seqno, rollup, data in log.entries:
                if not tx.log_insert(log.name, expected, seqno, rollup, data):
                    raise StashError(
                        f"log {log.name}: entry {seqno} could not be written after "
                        f"{expected} (a concurrent writer?); nothing was written"
                    )
                expected = seqno
        for c in snap.collections:
            if tx.lookup_collection(c.name) is not None:
                raise StashError(
                    f"the target stash already has collection {c.name}: restore or import "
                    "into a stash without the snapshot's collections; nothing was written"
                )
            cid = tx.create_collection(c.name, c.key_codec, c.value_codec)
            tx.lock([cid])
            if c.rows:
                tx.insert(cid, c.rows)
            tx.set_upper(cid, c.upper)
            tx.set_since(cid, c.since)

    stash._write(write, codecs=())


def _sqlite_path(url: str) -> Path | None:
    from stash.url import parse_url

    u = parse_url(url)
    if u.get_backend_name() != "sqlite" or not u.database:
        return None
    return Path(u.database).expanduser()


def _online_copy(src: Path, dst: Path) -> None:
    """Copy SQLite database ``src`` onto ``dst`` with the online backup API."""
    from stash.migrate import create_sqlite_file

    create_sqlite_file(str(dst))
    source = sqlite3.connect(f"{src.resolve().as_uri()}?mode=ro", uri=True)
    try:
        target = sqlite3.connect(dst)
        try:
            source.backup(target)
            target.execute("PRAGMA journal_mode=WAL")
        finally:
            target.close()
    finally:
        source.close()


def backup(url: str, file: str | os.PathLike[str]) -> None:
    """Write a consistent snapshot of the stash at ``url`` to the new SQLite stash file
    ``file`` (see the module docstring).

    Raises:
        StashError: ``file`` exists; the stash cannot be opened.
    """
    from stash.base import Stash

    dst = Path(file).expanduser()
    if dst.exists():
        raise StashError(f"backup file {dst} exists; choose a new file")
    src = _sqlite_path(url)
    # Written under a temporary name beside the target, put in place once whole: a
    # backup that fails half way leaves no file (an empty or partial stash that a
    # restore would take for a backup).
    with _new_file(dst, f"backup file {dst} exists; choose a new file") as part:
        with Stash.open(url, mode="readonly", fenced=False) as s:  # checks the schema
            snap = None if src is not None else read_snapshot(s)
            if src is not None:
                _online_copy(src, part)
        if snap is not None:
            with Stash.open(f"sqlite:///{part}", fenced=False) as out:
                write_snapshot(out, snap)


@contextlib.contextmanager
def _new_file(dst: Path, exists: str) -> Iterator[Path]:
    """A temporary path beside ``dst`` to write a SQLite file at, put in place as
    ``dst`` when the block ends without error (never over a file that appeared there
    meanwhile: a hard link where the file system has them), and deleted (with its
    -wal and -shm) in every case.

    Raises:
        StashError: ``dst`` exists when the file is put in place (message ``exists``).
    """
    part = dst.with_name(f".{dst.name}.{uuid.uuid4().hex}.partial")
    try:
        yield part
        try:
            os.link(part, dst)
        except FileExistsError:
            raise StashError(exists) from None
        except OSError:  # no hard links here
            if dst.exists():
                raise StashError(exists) from None
            os.replace(part, dst)
    finally:
        for p in (part, part.with_name(part.name + "-wal"), part.with_name(part.name + "-shm")):
            p.unlink(missing_ok=True)


def restore(file: str | os.PathLike[str], url: str, *, replace: bool = False) -> None:
    """Bring the backup ``file`` into the stash at ``url`` (see the module docstring).

    Args:
        replace: a SQLite target that holds collections or logs is replaced whole
            (without it, such a target is refused).

    Raises:
        StashError: ``file`` is no stash; the target holds collections or logs (a
            SQLite one without ``replace``, any other those of the backup); nothing is
            written then.
    """
    from stash.base import Stash

    src = Path(file).expanduser()
    if not src.is_file():
        raise StashError(f"backup file {src} does not exist")
    with Stash.open(f"sqlite:///{src}", mode="readonly", fenced=False) as b:
        snap = read_snapshot(b)
    dst = _sqlite_path(url)
    if dst is not None and not dst.exists():
        # A new file is copied under a temporary name and put in place once whole: a
        # restore that fails half way leaves no partial stash behind.
        with _new_file(
            dst, f"the target stash file {dst} appeared meanwhile; restore again"
        ) as part:
            _online_copy(src, part)
        return
    if dst is not None:
        if not replace:
            from stash import logs

            with Stash.open(url, mode="readonly", fenced=False) as t:
                held = "collections" if t.collections() else "logs" if logs.names(t) else None
                if held is not None:
                    raise StashError(
                        f"the target stash {t.redacted_url} holds {held}; pass "
                        "replace=True (stash restore --replace) to replace it whole"
                    )
        _online_copy(src, dst)
        return
    with Stash.open(url, fenced=False) as t:
        write_snapshot(t, snap)


def export(stash: Any, out: IO[str]) -> int:
    """Write a snapshot of ``stash`` to ``out`` as JSON lines; return the rows and log
    entries written."""
    snap = read_snapshot(stash)
    n = 0
    for c in snap.collections:
        head = {
            "collection": c.name,
            "key_codec": c.key_codec,
            "value_codec": c.value_codec,
            "since": c.since,
            "upper": c.upper,
        }
        out.write(json.dumps(head, sort_keys=True, ensure_ascii=False) + "\n")
    for c in snap.collections:
        for k, v, t, d in c.rows:
            line = f'{{"collection":{json.dumps(c.name, ensure_ascii=False)},"diff":{d},'
            out.write(f'{line}"key":{k},"time":{t},"value":{v}}}\n')
            n += 1
    for log in snap.logs:
        for seqno, rollup, data in log.entries:
            entry = {"data": data, "log": log.name, "rollup": rollup, "seqno": seqno}
            out.write(json.dumps(entry, sort_keys=True, ensure_ascii=False) + "\n")
            n += 1
    return n


def _parse(lines: Iterable[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise StashError(f"import: line {i} is not JSON: {e}") from None
        if not isinstance(obj, dict) or ("collection" not in obj and "log" not in obj):
            raise StashError(f"import: line {i} is not an object with a collection or a log")
        yield i, obj


def import_(stash: Any, lines: Iterable[str]) -> int:
    """Create the collections and logs of an :func:`export` in ``stash``, in one write
    transaction; return the rows and log entries written.

    Raises:
        StashError: a line is malformed (naming it), a row names a collection without
            a header line, a log's entries are not in seqno order, or the stash already
            holds a collection or a log of the export; nothing is written then.
    """
    from stash.codec import canonical_json
    from stash.collection import check_diff, check_time

    snaps: dict[str, CollectionSnapshot] = {}
    logs: dict[str, LogSnapshot] = {}
    n = 0
    for i, obj in _parse(lines):
        if "collection" not in obj:
            logs.setdefault(str(obj["log"]), LogSnapshot(str(obj["log"]))).entries.append(
                _log_entry(i, obj)
            )
            n += 1
            continue
        name = obj["collection"]
        if "key_codec" in obj:
            snaps[name] = CollectionSnapshot(
                name, obj["key_codec"], obj["value_codec"], obj["since"], obj["upper"]
            )
            continue
        c = snaps.get(name)
        if c is None:
            raise StashError(f"import: line {i} is a row of collection {name!r} before its header")
        try:
            row = (
                canonical_json(obj["key"]),
                canonical_json(obj["value"]),
                check_time(obj["time"]),
                check_diff(obj["diff"]),
            )
        except (KeyError, StashError) as e:
            raise StashError(f"import: line {i}: {e}") from None
        c.rows.append(row)
        n += 1
    for log in logs.values():
        seqnos = [e[0] for e in log.entries]
        if seqnos != sorted(set(seqnos)):
            raise StashError(f"import: the entries of log {log.name!r} are not in seqno order")
    write_snapshot(stash, Snapshot(list(snaps.values()), list(logs.values())))
    return n


def _log_entry(i: int, obj: dict[str, Any]) -> LogRow:
    """The ``(seqno, rollup, data)`` of log entry line ``i``."""
    seqno, rollup, data = obj.get("seqno"), obj.get("rollup"), obj.get("data")
    if isinstance(seqno, bool) or not isinstance(seqno, int) or not -(2**63) <= seqno < 2**63:
        raise StashError(f"import: line {i}: a log entry's seqno must be an i64, got {seqno!r}")
    if not isinstance(rollup, bool) or not isinstance(data, str):
        raise StashError(f"import: line {i}: a log entry needs a boolean rollup and a string data")
    return seqno, rollup, data
