"""Protects: every use of a finalized (dropped) shard fails saying it was dropped.

The attack: ``finalize_shard`` / ``persist drop`` tombstones a shard and later uses
fail with a clear error.  ``snapshot``, ``open``, writes and ``persist sql`` all say the
shard "was finalized (dropped ...)"; two paths do not (low severity, misleading):
``ReadHandle.listen`` raises SinceViolation "as_of 0 is not beyond the shard's since
{}" and ``persist cat`` says the shard "is closed and compacted away"."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from persist import InvalidUsage, MemoryBlob, PersistClient, PersistError
from persist.cli import main
from stash import Stash

pytestmark = pytest.mark.adversarial

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


def test_listen_on_a_dropped_shard_says_it_was_dropped() -> None:
    s = Stash.open("memory://", fenced=False)
    c = PersistClient(s, MemoryBlob(), compaction="off")
    w, r = c.open("a", KS, VS)
    w.compare_and_append([((("x",), (1,)), 0, 1)], 0, 1)
    c.finalize_shard("a")
    with pytest.raises(InvalidUsage, match="finalized"):
        r.snapshot(0)  # holds
    with pytest.raises(PersistError) as e:
        r.listen(0)
    assert "finalized" in str(e.value) or "dropped" in str(e.value), (
        f"{type(e.value).__name__}: {e.value}"
    )
    c.close()
    s.close()


def test_persist_cat_of_a_dropped_shard_says_it_was_dropped(tmp_path: Path) -> None:
    url, blob = f"sqlite:///{tmp_path}/s.db", f"file://{tmp_path}/blob"
    with Stash.open(url, fenced=False) as s:
        c = PersistClient(s, blob, compaction="off")
        w = c.open_writer("x", KS, VS)
        w.compare_and_append([((("a",), (1,)), 0, 1)], 0, 1)
        c.close()
    base = ["--stash", url, "--blob", blob]
    r = CliRunner()
    assert r.invoke(main, [*base, "drop", "x", "--yes"]).exit_code == 0
    sql = r.invoke(main, [*base, "sql", "SELECT * FROM x"])
    assert sql.exit_code == 1 and "finalized" in sql.output  # holds
    cat = r.invoke(main, [*base, "cat", "x"])
    assert cat.exit_code == 1
    assert "finalized" in cat.output or "dropped" in cat.output, cat.output
