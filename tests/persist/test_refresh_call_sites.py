"""Maintenance and lookups that need only the newest state catch up with it.

GC's lease expiry (:func:`persist.gc.collect_garbage`), the compactor's fresh read
(:meth:`persist.compactor.Compactor.compact_once`) and an idempotency token lookup
(:func:`persist.idempotency.token_landed`) in a process whose machine has a cached
version read only the log rows after it (:meth:`persist.machine.ShardMachine.refresh`),
a maintenance rollup among them or not: in a steady state no whole head is read
(``heads`` in the machine's metrics stays put, ``catch_ups`` grows).  Each failed on the
old code, which called ``fetch()`` (a full read and decode of the head) every time.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from persist import MemoryBlob, PersistClient
from persist.consensus import Consensus
from persist.gc import collect_garbage
from persist.idempotency import token_landed
from persist.machine import ShardMachine
from stash import Stash

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])


def _row(i: int) -> pa.Table:
    return pa.table({"k": [i], "v": [f"v{i}"], "_time": [i], "_diff": [1]})


def _rollup(m: ShardMachine) -> None:
    """A maintenance rollup of the head, due or not (as ``write_rollup`` writes one)."""
    m.refresh()
    c = m._cache
    assert c is not None
    st = c.state.clone()
    st.seqno += 1
    _data, texts, _touched = m._encode(c, st)
    plan = m.consensus.plan_rollup(m.shard_id, c.state.seqno, texts)
    assert m.consensus.compare_and_set(m.shard_id, c.state.seqno, texts, c.version, plan=plan)


@pytest.mark.parametrize("call", ["gc", "compact", "token"])
@pytest.mark.parametrize("with_rollup", [False, True])
def test_steady_state_maintenance_reads_no_whole_head(
    tmp_path: Path, call: str, with_rollup: bool
) -> None:
    stash = Stash.open(f"sqlite:///{tmp_path}/s.db", mode="writable", fenced=False)
    blob = MemoryBlob()
    a = PersistClient(stash, blob, compaction="off")
    b = PersistClient(stash, blob, compaction="off")
    try:
        wa, _ = a.open("t", SCHEMA, pa.schema([]))
        wb, _rb = b.open("t", SCHEMA, pa.schema([]))
        for i in range(12):
            wa.append(_row(i), i, i + 1)
        m = wb._machine
        m.refresh()  # cached (a steady state: the machine has read the shard before)
        upper = 12
        for rnd in range(3):
            wa.append(_row(upper), upper, upper + 1)
            upper += 1
            if with_rollup:
                _rollup(wa._machine)
            heads, catch_ups = m.metrics["heads"], m.metrics["catch_ups"]
            if call == "gc":
                collect_garbage(b, "t", grace_seconds=0)
            elif call == "compact":
                b.compactor.compact_once("t")
            else:
                assert token_landed(m, f"tok{rnd}", "fp") == (False, m.state().seqno)
            assert m.metrics["heads"] == heads, call
            assert m.metrics["catch_ups"] > catch_ups
            assert m.state() == ShardMachine(Consensus(stash), m.shard_id).fetch()
    finally:
        a.close()
        b.close()
        stash.close()
