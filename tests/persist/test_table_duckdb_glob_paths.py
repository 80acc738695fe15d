"""``Table.to_duckdb`` reads the Parquet files of its parts by their names, never as
patterns: DuckDB's ``read_parquet`` globs every name of its list (``*``, ``?``,
``[...]``), so a blob root holding one of those characters made the relation read the
files of sibling directories the pattern also matched (rows counted twice), or none.  A
name holding a glob character and a backslash has no literal spelling: persist reads
those parts itself."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from persist import PersistClient
from stash import Stash


@pytest.mark.parametrize(
    ("name", "sibling", "scanned"),
    [
        ("y*", "yZ", True),
        ("q[1]", "q1", True),
        ("r?", "rX", True),
        ("s]", None, True),
        ("b\\x", None, True),
        ("c*\\", "cZ\\", False),
    ],
)
def test_a_root_with_glob_characters_is_read_literally(
    tmp_path: Path, name: str, sibling: str | None, scanned: bool
) -> None:
    root = tmp_path / name / "blob"
    root.mkdir(parents=True)
    c = PersistClient(Stash.open(f"sqlite:///{tmp_path}/s.db"), root.as_uri(), compaction="off")
    t = c.create_table("t", pa.schema([("k", pa.int64()), ("v", pa.int64())]), key=["k"])
    t.append(pa.table({"k": list(range(5000)), "v": list(range(5000))}))
    assert t.details()["inline_bytes"] == 0  # a Parquet part DuckDB scans
    if sibling is not None:  # a directory the unescaped name would also match, whose
        # files (at the same paths) hold one row each
        shutil.copytree(tmp_path / name, tmp_path / sibling)
        for f in (tmp_path / sibling).rglob("*"):
            if f.is_file() and f.read_bytes()[:4] == b"PAR1":
                pq.write_table(pq.read_table(f).slice(0, 1), f)
    rel = t.to_duckdb()
    assert ("parquet" in rel.explain().lower()) == scanned
    assert rel.aggregate("count(*), sum(v)").fetchall() == [(5000, sum(range(5000)))]
    c.close()
