"""A SQLite stash URL opens the file it names or fails: a raw ``?`` in the file's path
starts SQLAlchemy's query string, and what follows it was dropped (``?b/s.db``) or
ignored with a warning (``?x=1/s.db``), so the stash silently opened another file (the
path cut at the ``?``).  Such a URL is refused, naming the rule (percent-encode the
``?`` as ``%3F``); the encoded spelling opens the file the path names."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import pytest

from stash import Stash, StashError


@pytest.mark.parametrize("tail", ["b/s.db", "x=1/s.db", "b", "timeout=5&b/s.db"])
def test_a_raw_question_mark_in_the_path_is_refused(tmp_path: Path, tail: str) -> None:
    url = f"sqlite:///{tmp_path}/a?{tail}"
    with pytest.raises(StashError, match=r"%3F"):
        Stash.open(url)
    assert list(tmp_path.iterdir()) == []  # nothing created, not even the cut path


def test_the_encoded_path_opens_the_file_it_names(tmp_path: Path) -> None:
    d = tmp_path / "a b%20c#d?e"
    d.mkdir()
    with Stash.open(f"sqlite:///{quote(str(d))}/s.db") as s:
        c = s.collection("c")
        b = c.make_batch(s)
        c.append_to_batch(b, "k", 1, 1)
        s.append([b])
    assert sorted(p.name for p in d.iterdir())[0] == "s.db"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a b%20c#d?e"]


def test_known_driver_options_still_open(tmp_path: Path) -> None:
    with Stash.open(f"sqlite:///{tmp_path}/s.db?timeout=5") as s:
        s.collection("c")
    assert (tmp_path / "s.db").exists()
