"""A SQLite stash URL whose driver option has a value the driver cannot read is refused
by a ``StashError`` naming the option and creates nothing; and
``uri`` is read as SQLAlchemy reads it (``yes``, ``on``, ``t``, ``y`` are true too), so
a SQLite URI's own parameters are not refused as misplaced ``?``.

Before, ``sqlite:///d/a?timeout=5/s.db`` (a raw ``?`` in the path followed by an option's
name) or ``?timeout=abc`` raised a bare ``ValueError`` from SQLAlchemy's dialect after
the stash had created an empty file at the path cut at the ``?``; and
``file:...?mode=ro&uri=yes`` was refused as holding a path's ``?``."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from stash import Stash, StashError


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("timeout=abc", "timeout"),
        ("timeout=5/s.db", "timeout"),
        ("uri=true/s.db", "uri"),
        ("check_same_thread=x/s.db", "check_same_thread"),
        ("cached_statements=many", "cached_statements"),
        ("detect_types=1.5", "detect_types"),
    ],
)
def test_an_unreadable_option_value_is_refused_and_creates_nothing(
    tmp_path: Path, query: str, name: str
) -> None:
    url = f"sqlite:///{tmp_path}/a?{query}"
    with pytest.raises(StashError, match=rf"option '{name}' has a value .*%3F"):
        Stash.open(url, fenced=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("yes", ["true", "yes", "on", "1"])
def test_uri_is_true_as_sqlalchemy_reads_it(tmp_path: Path, yes: str) -> None:
    path = tmp_path / "s.db"
    sqlite3.connect(path).close()
    with Stash.open(f"sqlite:///file:{path}?mode=rw&uri={yes}", fenced=False) as s:
        s.collection("c")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.db"]
