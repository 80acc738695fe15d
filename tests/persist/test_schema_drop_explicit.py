"""A schema evolution drops a value column only when it names it (``drop=[...]``).

Two writers planned against one version ``(k | a)``: the first adds ``c1`` and commits
values in it; the second, whose schema ``(a, c2)`` merely lacks ``c1`` (it never saw
it), is refused with ``SchemaMismatch`` naming ``c1`` instead of registering
``(a, c2)``, which would drop ``c1`` and make its acknowledged values read as null for
good.  The same through a transaction's ``Txn.write`` with schemas."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from persist import InvalidUsage, PersistClient, SchemaMismatch
from stash import Stash

KS = pa.schema([pa.field("k", pa.string(), nullable=False)])
VA = pa.schema([pa.field("a", pa.int64())])
V1 = VA.append(pa.field("c1", pa.int64()))
V2 = VA.append(pa.field("c2", pa.int64()))


@pytest.fixture
def two(tmp_path: Path):
    """Two clients (two processes' worth of caches) on one SQLite stash file."""
    url, blob = f"sqlite:///{tmp_path}/stash.db", f"file://{tmp_path}/blob"
    stashes = [Stash.open(url, fenced=False) for _ in range(2)]
    clients = [PersistClient(s, blob, compaction="off") for s in stashes]
    yield clients
    for c in clients:
        c.close()
    for s in stashes:
        s.close()


def _job1(c1: PersistClient) -> None:
    w, _ = c1.open("s", KS, V1)
    w.compare_and_append([((("x",), (1, 11)), 0, 1)], 0, 1)


def _c1_values(c: PersistClient) -> list[object]:
    st = c.inspect("s")
    _, r = c.open("s", KS, st.value_schema)
    return r.snapshot(st.upper.as_option() - 1).column("c1").to_pylist()


def test_a_writer_lacking_a_column_added_meanwhile_is_refused(two) -> None:
    c1, c2 = two
    c1.open("s", KS, VA)
    c2.open("s", KS, VA)  # both planned against (k | a)
    _job1(c1)
    before = c2.inspect("s")
    with pytest.raises(SchemaMismatch, match=r"column 'c1'.*drop=\['c1'\]"):
        c2.open("s", KS, V2)
    after = c2.inspect("s")
    assert after.seqno == before.seqno and len(after.schema_history) == 2
    assert _c1_values(c2) == [11]
    # Planned again on the newest schema, the second writer adds its column.
    w2, _ = c2.open("s", KS, after.value_schema.append(pa.field("c2", pa.int64())))
    w2.compare_and_append([((("y",), (2, None, 22)), 1, 1)], 1, 2)
    assert _c1_values(c2) == [11, None]


def test_a_transaction_write_with_a_schema_lacking_the_column_is_refused(two) -> None:
    c1, c2 = two
    c1.open("s", KS, VA)
    c2.open("s", KS, VA)
    _job1(c1)
    txn = c2.begin()
    with pytest.raises(SchemaMismatch, match="'c1'"):
        txn.write("s", pa.table({"k": ["y"], "a": [2], "c2": [22]}), key_schema=KS, value_schema=V2)
    txn.abort()
    assert len(c2.inspect("s").schema_history) == 2
    assert _c1_values(c2) == [11]


def test_a_named_drop_drops(two) -> None:
    c1, c2 = two
    _job1(c1)
    w, r = c2.open("s", KS, VA, drop=["c1"])
    st = c2.inspect("s")
    assert [v.names for v in st.schema_history] == [["a", "c1"], ["a"]]
    assert w.schema_id == r.schema_id == 1


def test_a_bad_drop_is_refused_and_registers_nothing(two) -> None:
    c1, _ = two
    _job1(c1)
    seqno = c1.inspect("s").seqno
    with pytest.raises(InvalidUsage, match=r"drop names \['a'\], which the schemas opened with"):
        c1.open("s", KS, pa.schema([pa.field("a", pa.int64())]), drop=["a", "c1"])
    with pytest.raises(InvalidUsage, match=r"drop names \['nope'\], which no version"):
        c1.open("s", KS, VA, drop=["c1", "nope"])
    with pytest.raises(InvalidUsage, match="not the str"):
        c1.open("s", KS, VA, drop="c1")
    assert c1.inspect("s").seqno == seqno
