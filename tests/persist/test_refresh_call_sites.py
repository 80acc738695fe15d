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

import pyarrow as pa
import pytest

from persist import PersistClient
from persist.consensus import Consensus
from persist.gc import collect_garbage
from persist.idempotency import token_landed
from persist.machine import ShardMachine
from stash import Stash
from tests.support.rollups import one_row, write_maintenance_rollup

SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.string())])


@pytest.mark.parametrize("call", ["gc", "compact", "token"])
@pytest.mark.parametrize("with_rollup", [False, True])
def test_steady_state_maintenance_reads_no_whole_head(
    sqlite_stash: Stash,
    two_clients: tuple[PersistClient, PersistClient],
    call: str,
    with_rollup: bool,
) -> None:
    a, b = two_clients
    wa, _ = a.open("t", SCHEMA, pa.schema([]))
    wb, _rb = b.open("t", SCHEMA, pa.schema([]))
    for i in range(12):
        wa.append(one_row(i), i, i + 1)
    m = wb._machine
    m.refresh()  # cached (a steady state: the machine has read the shard before)
    upper = 12
    for rnd in range(3):
        wa.append(one_row(upper), upper, upper + 1)
        upper += 1
        if with_rollup:
            write_maintenance_rollup(wa._machine)
        heads, catch_ups = m.metrics["heads"], m.metrics["catch_ups"]
        if call == "gc":
            collect_garbage(b, "t", grace_seconds=0)
        elif call == "compact":
            b.compactor.compact_once("t")
        else:
            assert token_landed(m, f"tok{rnd}", "fp") == (False, m.state().seqno)
        assert m.metrics["heads"] == heads, call
        assert m.metrics["catch_ups"] > catch_ups
        assert m.state() == ShardMachine(Consensus(sqlite_stash), m.shard_id).fetch()
