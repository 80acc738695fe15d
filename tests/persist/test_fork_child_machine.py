"""A child forked from a process using a persist client (Spark forks its Python
workers; ``multiprocessing`` with the fork start method) can write through the shard
machines it inherited, even when another thread of the parent held a machine's lock at
the fork (the maintenance worker writing a rollup, a lease renewal): the child's
machines get locks of their own (``persist/machine.py``), as its thread pools
(``persist/pool.py``) and stash connections (``stash/sql.py``) do."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pyarrow as pa

from persist import PersistClient
from stash import Stash

KS = pa.schema([pa.field("k", pa.int64(), False)])
VS = pa.schema([("v", pa.int64())])


def test_a_child_forked_while_a_thread_held_a_machine_lock_appends(tmp_path: Path) -> None:
    """Failed on the old code: the child's append waited forever for the lock the
    parent's thread held at the fork (the child's main thread is not its owner)."""
    with Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False) as s:
        c = PersistClient(s, f"file://{tmp_path / 'blob'}", compaction="off")
        try:
            w, r = c.open("s", KS, VS)
            w.compare_and_append([(((1,), (1,)), 0, 1)], 0, 1)
            m = w._machine
            held, release = threading.Event(), threading.Event()

            def holder() -> None:
                with m.lock:
                    held.set()
                    release.wait(30)

            t = threading.Thread(target=holder)
            t.start()
            assert held.wait(10)
            pid = os.fork()
            if pid == 0:  # the child: append on its main thread, report, leave
                code = 3
                try:
                    signal.signal(signal.SIGALRM, lambda *_: os._exit(4))
                    signal.alarm(20)
                    w.compare_and_append([(((2,), (2,)), 1, 1)], 1, 2)
                    code = 0
                finally:
                    os._exit(code)
            release.set()
            t.join()
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            assert code == 0, f"the child's append {'hung' if code == 4 else 'failed'}"
            # The parent's machine works on, and sees the child's version.
            w.compare_and_append([(((3,), (3,)), 2, 1)], 2, 3)
            assert sorted(r.snapshot(2).column("k").to_pylist()) == [1, 2, 3]
        finally:
            c.close()
