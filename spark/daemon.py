"""Spark's Python worker daemon with this project's modules imported before it forks.

Spark starts one ``pyspark.daemon`` per executor (and for the driver's planning of
Python data sources), which forks a process per Python worker.  Each fork then imports
what it runs: for the ``persist`` and ``stash`` sources and the jobs' ``mapInArrow``
functions that is pyarrow, pandas, SQLAlchemy and persist, about 1 to 3 CPU-seconds per
fresh worker, paid again whenever Spark lets an idle worker go (after a minute).  With
``spark.python.daemon.module=spark.daemon`` (see :data:`DAEMON_CONF`) the daemon imports
them once and every fork starts with them loaded.

Invariants: nothing imported here starts a thread or opens a file or connection at
import time (persist's worker pools are made lazily and again in a forked child,
:mod:`persist.pool`), so forking after the imports is safe; a module that fails to
import is skipped (the worker imports it itself, and reports the error, when it needs
it).
"""

from __future__ import annotations

import importlib

DAEMON_CONF = {"spark.python.daemon.module": "spark.daemon"}
"""Spark settings that make executors (and the planner) fork workers from this daemon."""

PRELOAD = (
    "pyarrow",
    "pyarrow.compute",
    "pyarrow.parquet",
    "pandas",
    "pyspark.sql.pandas.types",
    "pyspark.worker",
    "stash",
    "persist",
    "spark.persist_source",
    "spark.persist_txn",
    "spark.stash_source",
    "spark.jobs.compact",
)
"""Modules the daemon imports before it forks."""


def preload() -> list[str]:
    """Import :data:`PRELOAD`; returns the names that failed (they are skipped)."""
    failed = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # the worker will import it and report the error
            failed.append(name)
    return failed


if __name__ == "__main__":
    preload()
    from pyspark import daemon

    daemon.manager()
