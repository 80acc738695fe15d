"""Schema migrations under concurrency and from older revisions.

* A writable SQLite stash at an older revision (0001, 0002) upgrades itself at open, as an
  empty one does (it used to refuse with "run: stash migrate").
* Opens of fresh stashes from several threads of one process at once never crash: alembic
  keeps its migration context in process-global module proxies, so the stash runs one
  alembic command at a time per process (it used to crash the interpreter).
* Several processes opening one fresh Postgres database with ``auto_migrate=True`` at once,
  and two ``stash migrate`` runs at once, all succeed: the migration holds a
  transaction-level advisory lock, and a process that waited finds the schema at head.

The concurrent runs happen in child processes, so that a crash fails the test instead of
the test run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command

from stash import Stash
from stash.migrate import alembic_config, current_revision, upgrade
from stash.schema import SCHEMA_HEAD

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.parametrize("revision", ["0001", "0002"])
def test_older_sqlite_stash_upgrades_itself(tmp_path: Path, revision: str) -> None:
    url = f"sqlite:///{tmp_path}/old.db"
    engine = sa.create_engine(url)
    try:
        upgrade(engine, revision)
        with engine.connect() as conn:
            assert current_revision(conn) == revision
    finally:
        engine.dispose()
    with Stash.open(url) as s:  # auto_migrate is the default of a writable SQLite stash
        c = s.collection("c")
        s.update(c, ("k", 1), 0, 1)
        s.seal(c, s.upper(c).__class__.from_elem(1))
        assert s.peek_one(c) == {"k": 1}
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            assert current_revision(conn) == SCHEMA_HEAD
    finally:
        engine.dispose()


def test_older_sqlite_stash_readonly_still_refuses(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/old.db"
    engine = sa.create_engine(url)
    try:
        upgrade(engine, "0001")
    finally:
        engine.dispose()
    with pytest.raises(Exception, match="stash migrate"):
        Stash.open(url, mode="readonly")


_THREADED_OPENS = """
import sys, threading
from stash import Stash

urls = sys.argv[1:]
errors = []
barrier = threading.Barrier(len(urls))

def run(url):
    try:
        barrier.wait()
        with Stash.open(url, fenced=False, auto_migrate=True) as s:
            c = s.collection("c")
            s.update(c, ("k", 1), 0, 1)
    except BaseException as e:  # reported below
        errors.append(f"{type(e).__name__}: {e}")

threads = [threading.Thread(target=run, args=(u,)) for u in urls]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("\\n".join(errors))
sys.exit(1 if errors else 0)
"""


def test_threads_open_fresh_sqlite_stashes_at_once(tmp_path: Path) -> None:
    for round_ in range(3):
        urls = [f"sqlite:///{tmp_path}/r{round_}_{i}.db" for i in range(8)]
        r = _python(_THREADED_OPENS, *urls)
        assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-3000:])


def test_threads_and_processes_migrate_one_fresh_postgres_at_once(postgres_url: str) -> None:
    """Threads of one process (the same database, ``auto_migrate=True``) and two
    processes at once: every open succeeds and the schema ends at head."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_THREADED_OPENS), *[postgres_url] * 4],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, (p.returncode, out, err[-3000:])
    engine = sa.create_engine(postgres_url)
    try:
        with engine.connect() as conn:
            assert current_revision(conn) == SCHEMA_HEAD
    finally:
        engine.dispose()


def _waiting_on_a_lock(engine: sa.Engine) -> bool:
    with engine.connect() as watch:
        return bool(
            watch.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock'"
                )
            ).scalar_one()
        )


def test_stash_migrate_while_another_migration_runs_on_postgres(postgres_url: str) -> None:
    """``stash migrate`` started while another session's migration of the same fresh
    database has not committed yet waits for it, then finds the schema at head and
    succeeds (without the lock it created the tables again and failed)."""
    engine = sa.create_engine(postgres_url)
    try:
        with engine.connect() as conn:
            tx = conn.begin()
            command.upgrade(alembic_config(conn), "head")  # not committed yet
            p = subprocess.Popen(
                [sys.executable, "-m", "stash.cli", "migrate", postgres_url],
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                # Commit once the other session waits on a lock held here (or is done);
                # each look is a transaction of its own (pg_stat_activity is a snapshot
                # per transaction).
                for _ in range(1200):
                    if p.poll() is not None or _waiting_on_a_lock(engine):
                        break
                    time.sleep(0.05)
                tx.commit()
                out, err = p.communicate(timeout=120)
            finally:
                if p.poll() is None:
                    p.kill()
        assert p.returncode == 0, (p.returncode, out, err[-3000:])
        with engine.connect() as conn:
            assert current_revision(conn) == SCHEMA_HEAD
    finally:
        engine.dispose()
