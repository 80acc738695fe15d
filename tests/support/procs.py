"""The multiprocessing context of tests that race real processes: ``forkserver``, with the
project's heavy modules imported once in the server.

Each child is forked from the server, a fresh interpreter started for the purpose (not
from the test process: no thread, connection, cache or monkeypatch of the test is
inherited, as with ``spawn``), but it starts with pyarrow, SQLAlchemy, psycopg, stash and
persist already imported instead of importing them itself (about a CPU-second a child,
2-3 s of wall time on a loaded machine). Importing them starts no thread and opens no
file or connection (the invariant :mod:`spark.daemon` relies on as well), so forking
after the imports is safe.

The server lives as long as the pytest process and serves every test of it; its
children get the environment the server started with (the first call's). A test that
sets an environment variable for its children must use ``spawn`` instead.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.context import ForkServerContext

#: Modules the fork server imports before it forks a child.
PRELOAD = [
    "pyarrow",
    "pyarrow.compute",
    "pyarrow.parquet",
    "sqlalchemy",
    "psycopg",
    "hypothesis",
    "pytest",
    "stash",
    "persist",
]


def process_context() -> ForkServerContext:
    """The ``forkserver`` context, its server preloading :data:`PRELOAD`; use it where a
    test would call ``multiprocessing.get_context("spawn")``."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
