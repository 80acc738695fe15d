"""Diffs of one row that sum beyond int64: every update fits, their sum does not.

Persist cannot refuse this at append time without reading the row's earlier updates,
so a read that meets it raises ``DiffOverflow`` naming the shard and the row (its key,
value and time), never a bare "diffs sum beyond int64" that leaves the caller to find
which of its shards and rows it is.  One append holding such updates is refused at
append time, naming them too, with nothing committed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from persist import DiffOverflow, FileBlob, InvalidUsage, PersistClient
from stash import Antichain, Stash

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


def upd(k: str, v: int, t: int, d: int) -> Any:
    return ((k,), (v,)), t, d


@pytest.fixture
def client(tmp_path: Path) -> Iterator[PersistClient]:
    s = Stash.open(f"sqlite:///{tmp_path / 'stash.db'}", fenced=False)
    c = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off")
    yield c
    c.close()
    s.close()


def test_a_read_of_a_row_whose_diffs_overflow_names_the_shard_and_the_row(
    client: PersistClient,
) -> None:
    w, r = client.open("counts", KS, VS)
    w.compare_and_append([upd("big", 7, 0, 2**62), upd("ok", 1, 0, 1)], 0, 1)
    w.compare_and_append([upd("big", 7, 1, 2**62)], 1, 2)
    with pytest.raises(DiffOverflow) as e:
        r.snapshot(1)
    err = e.value
    assert isinstance(err, InvalidUsage)
    assert err.row == {"k": "big", "v": 7, "_time": 1}
    assert "'counts'" in str(err) and w.shard_id in str(err) and "'big'" in str(err)
    with pytest.raises(DiffOverflow, match="'big'"):
        r.snapshot(1, filter=pa.compute.field("k") == "big")
    assert r.snapshot(0).num_rows == 2  # before the second write, the row still counts


def test_one_append_whose_diffs_overflow_is_refused(client: PersistClient) -> None:
    w, r = client.open("one", KS, VS)
    with pytest.raises(DiffOverflow, match="'one'") as e:
        w.compare_and_append([upd("big", 7, 0, 2**62), upd("big", 7, 0, 2**62)], 0, 1)
    assert e.value.row == {"k": "big", "v": 7, "_time": 0}
    assert client.inspect("one").upper == Antichain.from_elem(0)


def test_an_overflow_on_a_value_python_cannot_hold_still_names_the_row(
    client: PersistClient,
) -> None:
    """A row whose key is a duration beyond ``timedelta``'s range: the error shows it
    as Arrow prints it (it raised ``OverflowError`` while making the message)."""
    ks = pa.schema([("k", pa.duration("s"))])
    w, r = client.open("durations", ks, VS)
    rows = pa.table(
        {
            "k": pa.array([2**62, 2**62], pa.duration("s")),
            "v": [7, 7],
            "_time": [0, 0],
            "_diff": [2**62, 2**62],
        }
    )
    with pytest.raises(DiffOverflow, match="'durations'") as e:
        w.compare_and_append(rows, 0, 1)
    shown = f"duration[s] {2**62}"  # how Arrow prints the value, beyond timedelta's range
    assert e.value.row == {"k": shown, "v": 7, "_time": 0}
    shard = client.inspect("durations")
    assert shard.upper == Antichain.from_elem(0)
