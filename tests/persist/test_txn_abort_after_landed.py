"""Protects: aborting a transaction never deletes parts a landed commit references.

The attack: ``txn.abort()`` (or an exception leaving ``with client.begin() as txn:``)
deletes the uploaded parts *unless a commit of it may have landed* (persist/txn.py
module docstring).  Only a ConsensusError marked indeterminate sets ``_maybe_landed``;
any other exception escaping the stash append (KeyboardInterrupt on Ctrl-C, a driver
error the stash did not wrap) after the stash committed leaves the transaction looking
uncommitted, and the ``with`` block's abort deletes parts the committed shard state
references: an acknowledged-by-the-stash write whose data is gone (fsck: missing part;
snapshot: CorruptPart).  A plain ``compare_and_append`` interrupted the same way keeps
its parts (checked below for contrast)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from persist import MemoryBlob, PersistClient, fsck
from stash import Stash
from tests.support.stash_faults import InterruptAfterCommit

pytestmark = pytest.mark.adversarial

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_with_block_interrupted_after_the_commit_landed_keeps_the_parts(
    exc: type[BaseException],
) -> None:
    inner = Stash.open("memory://", fenced=False)
    st = InterruptAfterCommit(inner, exc)
    blob = MemoryBlob()
    c = PersistClient(st, blob, compaction="off", inline_max_bytes=0)  # type: ignore[arg-type]
    c.open("a", KS, VS)
    c.open("b", KS, VS)
    raised = None
    try:
        with c.begin() as txn:
            txn.write("a", pa.table({"k": ["x"], "v": pa.array([1], pa.int64())}))
            txn.write("b", pa.table({"k": ["y"], "v": pa.array([2], pa.int64())}))
            st.armed = True
            txn.commit_at(0)
    except BaseException as e:  # noqa: BLE001 - the injected interrupt
        raised = e
    assert isinstance(raised, exc)
    c2 = PersistClient(inner, blob, compaction="off")
    assert c2.inspect("a").upper.as_option() == 1  # the transaction did commit
    damage = fsck(c2, "a").damage() + fsck(c2, "b").damage()
    assert not damage, f"abort deleted parts of a committed transaction: {damage}"
    snap = c2.open_reader("a", KS, VS).snapshot(0)
    assert snap.column("k").to_pylist() == ["x"]
    c2.close()
    inner.close()


def test_compare_and_append_interrupted_after_commit_keeps_its_parts() -> None:
    """Contrast (holds): the plain write path never deletes parts it may have
    committed."""
    inner = Stash.open("memory://", fenced=False)
    st = InterruptAfterCommit(inner, KeyboardInterrupt)
    blob = MemoryBlob()
    c = PersistClient(st, blob, compaction="off", inline_max_bytes=0)  # type: ignore[arg-type]
    w, _r = c.open("a", KS, VS)
    w.heartbeat()
    st.armed = True
    with pytest.raises(KeyboardInterrupt):
        w.compare_and_append([((("x",), (1,)), 0, 1)], 0, 1)
    c2 = PersistClient(inner, blob, compaction="off")
    assert c2.inspect("a").upper.as_option() == 1
    assert not fsck(c2, "a").damage()
    c2.close()
    inner.close()
