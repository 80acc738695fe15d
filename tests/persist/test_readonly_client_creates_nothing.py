"""Protects: a client over a ``mode="readonly"`` stash writes nothing, not even the
root of a blob store a wrong URI names.

``PersistClient(readonly_stash, "file:///wrong/path")`` created ``/wrong/path`` (the
client opened its blob store with ``create=True``), though a readonly reader must
never write: a typo left an empty directory behind on every attempt."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from persist import PersistClient, StoreMismatch
from stash import Stash

pytestmark = pytest.mark.adversarial


def test_readonly_client_does_not_create_a_blob_root(tmp_path: Path) -> None:
    with Stash.open(f"sqlite:///{tmp_path}/s.db", fenced=False) as s:
        c = PersistClient(s, f"file://{tmp_path}/blob", inline_max_bytes=0)
        c.create_table("t", pa.schema([("id", pa.int64())]), key=["id"]).append(
            pa.table({"id": [1, 2]})
        )
        c.close()
    with Stash.open(f"sqlite:///{tmp_path}/s.db", mode="readonly") as ro:
        wrong = tmp_path / "typo" / "blob"
        c = PersistClient(ro, f"file://{wrong}")
        with pytest.raises(StoreMismatch):
            c.table("t").to_arrow()
        c.close()
        assert not (tmp_path / "typo").exists()
        c = PersistClient(ro, f"file://{tmp_path}/blob")
        assert c.table("t").to_arrow().num_rows == 2
        c.close()
