"""Protects: every cached shard version equals the head's, and snapshots a model.

A workload: several clients (each its own Consensus and ShardMachine) on one
shard, small max_diffs, injected clock past leases, inline compaction. After every step,
every machine whose cached seqno is the head's must cache exactly the head's texts and
state, and snapshots must equal a model."""

from collections import Counter

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist import MemoryBlob, PersistClient
from persist.state import ShardState
from stash import Antichain, Stash
from tests.support.clock import Clock

pytestmark = pytest.mark.adversarial

KS = pa.schema([("k", pa.string())])
VS = pa.schema([("v", pa.int64())])


def _check_caches(clients) -> None:
    for c in clients:
        for sid, m in c._machines.items():
            cache = m._cache
            if cache is None:
                continue
            head = c.consensus.head(sid)
            if head is None or head.seqno != cache.version.seqno:
                continue
            assert cache.version.texts == head.texts, "cached texts differ from the head's"
            assert cache.version.data == head.data
            assert ShardState.from_entries(head.data).to_entries() == cache.state.to_entries()
            # the cached layout must be the stored one (a plan is built on it)
            assert cache.version.stored is not None and head.stored is not None
            assert dict(cache.version.stored.base) == dict(head.stored.base)
            assert cache.version.stored.diffs == head.stored.diffs


ops = st.lists(
    st.tuples(
        st.sampled_from(["append", "append", "append", "since", "tick", "reopen", "snap"]),
        st.integers(0, 2),  # which client
        st.integers(0, 3),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(ops=ops, max_diffs=st.sampled_from([0, 1, 2, 3]))
def test_multi_client_cached_versions_match_head(ops, max_diffs) -> None:
    s = Stash.open("memory://", fenced=False)
    blob = MemoryBlob()
    clock = Clock(1_000_000.0)
    clients = [
        PersistClient(
            s,
            blob,
            compaction="inline",
            clock=clock,
            reader_lease_seconds=10,
            writer_lease_seconds=10,
            inline_max_bytes=1 << 14,
        )
        for _ in range(3)
    ]
    for i, c in enumerate(clients):
        c.consensus.max_diffs = [max_diffs, 1, 2][i]
    handles = [c.open("t", KS, VS) for c in clients]
    model: Counter = Counter()
    since = 0
    try:
        for op, who, arg in ops:
            c = clients[who]
            w, r = handles[who]
            if op == "append":
                lo = w.fetch_recent_upper().as_option()
                assert lo is not None
                ups = [
                    (((f"k{(lo + j) % 3}",), (arg,)), lo, 1 if j % 2 == 0 else -1)
                    for j in range(arg + 1)
                ]
                try:
                    w.compare_and_append(ups, Antichain.from_elem(lo), Antichain.from_elem(lo + 1))
                except Exception as e:
                    if type(e).__name__ != "LeaseExpired":
                        raise
                    handles[who] = c.open("t", KS, VS)
                    continue
                for (k, v), t, d in ups:
                    model[(k[0], v[0], t)] += d
            elif op == "since":
                up = w.fetch_recent_upper().as_option()
                target = min(up, since + arg) if up else since
                try:
                    r.downgrade_since(target)
                except Exception:
                    pass
            elif op == "tick":
                clock.t += 11 * (arg + 1)  # past every lease
            elif op == "reopen":
                try:
                    w.expire()
                    r.expire()
                except Exception:
                    pass
                handles[who] = c.open("t", KS, VS)
            elif op == "snap":
                try:
                    up = w.fetch_recent_upper().as_option()
                    if up and up > 0:
                        at = up - 1
                        got = Counter()
                        for row in r.snapshot(at).to_pylist():
                            got[(row["k"], row["v"])] += row["_diff"]
                        want = Counter()
                        for (k, v, t), d in model.items():
                            if t <= at:
                                want[(k, v)] += d
                        want = Counter({k: v for k, v in want.items() if v})
                        assert got == want
                except Exception as e:
                    if type(e).__name__ in ("LeaseExpired", "SinceViolation"):
                        handles[who] = c.open("t", KS, VS)
                    else:
                        raise
            _check_caches(clients)
    finally:
        for c in clients:
            c.close()
        s.close()
