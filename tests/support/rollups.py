"""Helpers for tests of shard-log rollups: a one-row update table and a maintenance
rollup of a machine's head written on demand (due or not)."""

from __future__ import annotations

import pyarrow as pa

from persist.machine import ShardMachine


def one_row(i: int) -> pa.Table:
    """The update ``(k=i, v="v{i}")`` at time ``i`` with diff 1 (schema ``k int64, v string``)."""
    return pa.table({"k": [i], "v": [f"v{i}"], "_time": [i], "_diff": [1]})


def write_maintenance_rollup(m: ShardMachine) -> None:
    """Write a rollup of ``m``'s head as maintenance does (:meth:`ShardMachine.write_rollup`:
    a version that changes nothing but its seqno, by its own compare-and-set), whether
    one is due or not; ``m`` is caught up before and after."""
    m.refresh()
    c = m._cache
    assert c is not None
    st = c.state.clone()
    st.seqno += 1
    _data, texts, _touched = m._encode(c, st)
    plan = m.consensus.plan_rollup(m.shard_id, c.state.seqno, texts)
    assert m.consensus.compare_and_set(m.shard_id, c.state.seqno, texts, c.version, plan=plan)
    m.refresh()
