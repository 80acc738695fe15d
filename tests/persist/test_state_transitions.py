"""Pure tests of every command of :class:`persist.state.ShardState`: no machine, no
consensus, no blob.  Each command runs on a state built in memory: the happy path, each
refusal (a refused command leaves the state as it was), and :class:`Stale` on a cached
(non-fresh) state where failing there could be wrong."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persist.commands import AppendCmd, Inputs, NeedsInput, TxnCmd
from persist.errors import (
    BatchAppended,
    InvalidUsage,
    SchemaMismatch,
    SinceViolation,
    UpperMismatch,
)
from persist.ids import new_shard_id
from persist.keys import new_writer_id, part_name_prefix
from persist.spine import ApplyMergeResult, FueledMergeRes
from persist.state import TOKEN_SEP, LeaseExpired, ShardState, Stale, WriterState, token_entry
from persist.types import Description, HollowBatch, PartRef
from stash import Antichain

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])
LEASE = 10_000


def ac(t: int) -> Antichain:
    return Antichain.from_elem(t)


def new_state() -> ShardState:
    return ShardState(new_shard_id(), "orders", KS, VS, seqno=3)


def part(st: ShardState, writer_id: str, i: int, rows: int = 1) -> PartRef:
    key = f"{st.shard_id}/b/{part_name_prefix(writer_id, 1000)}{i:032x}.parquet"
    return PartRef(key, rows, 10 * rows, f"{i:064x}")


def batch(st: ShardState, writer_id: str, lo: int, hi: int, i: int) -> HollowBatch:
    return HollowBatch(Description(ac(lo), ac(hi)), (part(st, writer_id, i),), 1)


def append_cmd(st: ShardState, wid: str, lo: int, hi: int, i: int = 0, **kw: object) -> AppendCmd:
    token = kw.pop("token", f"tok{i}")
    fields: dict[str, object] = {
        "writer_id": wid,
        "token": token,
        "recorded": f"{token}{TOKEN_SEP}fp{i}",
        "expected": ac(lo),
        "pieces": (batch(st, wid, lo, hi, i),),
        "lease_ms": LEASE,
        "registered": False,
        "owners": frozenset(),
    }
    fields.update(kw)
    return AppendCmd(**fields)  # type: ignore[arg-type]


def same(a: ShardState, b: ShardState) -> bool:
    return a.to_json() == b.to_json() and a.retire_adds == b.retire_adds


# ------------------------------------------------------------- compare_and_append
def test_compare_and_append_appends_and_records_the_token() -> None:
    st = new_state()
    wid = new_writer_id()
    reqs, changed = st.compare_and_append(append_cmd(st, wid, 0, 5), Inputs(), 100, True)
    assert changed and reqs == []
    assert st.upper == ac(5)
    assert token_entry(st, wid, "tok0") == f"tok0{TOKEN_SEP}fp0"
    assert st.writers[wid].last_heartbeat_ms == 100


def test_compare_and_append_of_a_landed_token_changes_nothing() -> None:
    st = new_state()
    wid = new_writer_id()
    cmd = append_cmd(st, wid, 0, 5)
    st.compare_and_append(cmd, Inputs(), 100, True)
    before = st.clone()
    # The same append again (an attempt whose outcome was indeterminate): no change,
    # even though the upper moved on.
    assert st.compare_and_append(cmd, Inputs(), 200, False) == ([], False)
    assert same(st, before)


def test_compare_and_append_upper_mismatch_is_stale_then_real() -> None:
    st = new_state()
    wid = new_writer_id()
    st.compare_and_append(append_cmd(st, wid, 0, 5), Inputs(), 100, True)
    before = st.clone()
    cmd = append_cmd(st, wid, 0, 7, 1)  # expects upper 0, the shard's is 5
    with pytest.raises(Stale):
        st.compare_and_append(cmd, Inputs(), 200, False)
    with pytest.raises(UpperMismatch):
        st.compare_and_append(cmd, Inputs(), 200, True)
    assert same(st, before)


def test_compare_and_append_refuses_a_finalized_shard() -> None:
    st = new_state()
    assert st.finalize(100)
    before = st.clone()
    with pytest.raises(InvalidUsage, match="finalized"):
        st.compare_and_append(append_cmd(st, new_writer_id(), 0, 5), Inputs(), 200, True)
    assert same(st, before)


def test_compare_and_append_refuses_an_expired_writer_and_owner() -> None:
    st = new_state()
    wid, owner = new_writer_id(), new_writer_id()
    st.heartbeat_writer(wid, 0, LEASE)
    st.heartbeat_writer(owner, 0, 10)  # runs out at 10
    before = st.clone()
    cmd = append_cmd(st, wid, 0, 5, registered=True, owners=frozenset({wid, owner}))
    with pytest.raises(Stale):
        st.compare_and_append(cmd, Inputs(), 100, False)
    with pytest.raises(LeaseExpired, match="writer of an appended batch"):
        st.compare_and_append(cmd, Inputs(), 100, True)
    assert same(st, before)
    # The writer itself, once registered, must be live too.
    late = append_cmd(st, wid, 0, 5, registered=True)
    with pytest.raises(LeaseExpired, match=wid):
        st.compare_and_append(late, Inputs(), LEASE + 1, True)
    assert same(st, before)


def test_compare_and_append_checks_the_owners_parts_of_its_own_writer_too() -> None:
    """Parts naming the appending writer need it live, registered before or not."""
    st = new_state()
    wid = new_writer_id()
    before = st.clone()
    cmd = append_cmd(st, wid, 0, 5, owners=frozenset({wid}))
    with pytest.raises(Stale):
        st.compare_and_append(cmd, Inputs(), 100, False)
    with pytest.raises(LeaseExpired, match=wid):
        st.compare_and_append(cmd, Inputs(), 100, True)
    assert same(st, before)
    st.heartbeat_writer(wid, 0, LEASE)
    assert st.compare_and_append(cmd, Inputs(), 100, True)[1]


def test_compare_and_append_refuses_a_batch_already_appended() -> None:
    st = new_state()
    wid = new_writer_id()
    first = append_cmd(st, wid, 0, 5)
    st.compare_and_append(first, Inputs(), 100, True)
    before = st.clone()
    key = first.pieces[0].parts[0].key
    assert key is not None
    copy = append_cmd(st, wid, 5, 9, 1, token="other", given=(key,))
    with pytest.raises(BatchAppended, match=st.shard_id):
        st.compare_and_append(copy, Inputs(listed_upper=0), 200, True)
    assert same(st, before)


def test_compare_and_append_asks_for_retired_ids_and_a_listing_then_refuses() -> None:
    st = new_state()
    st.retired_upper = 4
    wid = new_writer_id()
    cmd = append_cmd(st, wid, 0, 5, given=("gone-key",))
    before = st.clone()
    inputs = Inputs()
    with pytest.raises(NeedsInput) as e:
        st.compare_and_append(cmd, inputs, 100, True)
    assert (e.value.what, e.value.retired_upper) == ("retired", 4)
    inputs.retired = (4, frozenset({"gone-key"}))
    with pytest.raises(BatchAppended):  # retired: a copy of a compacted-away part
        st.compare_and_append(cmd, inputs, 100, True)
    inputs.retired = (4, frozenset())
    with pytest.raises(NeedsInput) as e:  # not retired: list the parts at this upper
        st.compare_and_append(cmd, inputs, 100, True)
    assert (e.value.what, e.value.retired_upper) == ("parts", 4)
    assert same(st, before)
    inputs.listed_upper = 4
    assert st.compare_and_append(cmd, inputs, 100, True)[1]
    assert st.upper == ac(5)


def test_compare_and_append_refuses_a_part_of_a_dropped_column_schema() -> None:
    st = new_state()
    st.register_schema(KS, pa.schema([("v", pa.string()), ("w", pa.int64())]))
    st.register_schema(KS, pa.schema([("v", pa.string()), ("x", pa.int8())]), drop=("w",))
    wid = new_writer_id()
    cmd = append_cmd(st, wid, 0, 5)
    old = replace(cmd.pieces[0].parts[0], schema_id=1)
    cmd = replace(cmd, pieces=(replace(cmd.pieces[0], parts=(old,)),))
    with pytest.raises(SchemaMismatch):
        st.compare_and_append(cmd, Inputs(), 100, True)


def test_compare_and_append_settles_hand_offs_and_applies_riding_merges() -> None:
    st = new_state()
    wid, sender = new_writer_id(), new_writer_id()
    st.heartbeat_writer(sender, 0, LEASE)
    assert st.hand_off(sender, 0, LEASE, 2) == (True, True)
    st.compare_and_append(append_cmd(st, wid, 0, 5, handed=((sender, 1),)), Inputs(), 1, True)
    assert st.writers[sender].outstanding == 1
    st.compare_and_append(append_cmd(st, wid, 5, 9, 1, handed=((sender, 1),)), Inputs(), 2, True)
    assert sender not in st.writers  # none outstanding: dropped


# ------------------------------------------------------------- apply_merge_results
def _state_with_batches(n: int) -> tuple[ShardState, str]:
    st = new_state()
    wid = new_writer_id()
    for i in range(n):
        st.compare_and_append(append_cmd(st, wid, i, i + 1, i), Inputs(), 100 + i, True)
    return st, wid


def _merged(st: ShardState, compactor: str) -> FueledMergeRes:
    """The output of the Spine's first merge request, written by ``compactor``."""
    req = st.trace.all_fueled_merge_reqs()[0]
    rows = sum(b.len for b in st.batches() if req.desc.lower <= b.desc.lower < req.desc.upper)
    return FueledMergeRes(HollowBatch(req.desc, (part(st, compactor, 999, rows),), rows))


def test_apply_merge_results_swaps_in_and_retires_the_inputs() -> None:
    st, _ = _state_with_batches(4)
    comp = new_writer_id()
    st.heartbeat_writer(comp, 0, LEASE)
    before = st.referenced_blob_keys()
    res = _merged(st, comp)
    rs, changed = st.apply_merge_results([res], 500, True)
    assert changed and rs[0].applied()
    gone = before - st.referenced_blob_keys()
    assert gone and st.retire_adds == {k: 500 for k in gone}
    # Applied already (an earlier attempt committed): counted as exact, no change.
    again = st.clone()
    assert again.apply_merge_results([res], 600, False) == ([ApplyMergeResult.APPLIED_EXACT], False)


def test_apply_merge_results_of_a_dead_compactor_is_stale_then_refused() -> None:
    st, _ = _state_with_batches(4)
    comp = new_writer_id()  # never registered: its parts may be deleted
    before = st.clone()
    res = _merged(st, comp)
    with pytest.raises(Stale):
        st.apply_merge_results([res], 500, False)
    rs, changed = st.apply_merge_results([res], 500, True)
    assert rs == [ApplyMergeResult.NOT_APPLIED_NO_MATCH] and not changed
    assert same(st, before)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 8), data=st.data())
def test_apply_merge_results_keeps_the_traces_contents(n: int, data: st.DataObject) -> None:
    """Whatever run of batches a result replaces, the trace's rows and bounds stay."""
    st_, _ = _state_with_batches(n)
    comp = new_writer_id()
    st_.heartbeat_writer(comp, 0, LEASE)
    reqs = st_.trace.all_fueled_merge_reqs()
    if not reqs:
        return
    req = data.draw(st.sampled_from(reqs))
    rows = sum(b.len for b in st_.batches() if req.desc.lower <= b.desc.lower < req.desc.upper)
    rows_before = sum(b.len for b in st_.batches())
    since, upper = st_.since, st_.upper
    out = HollowBatch(req.desc, (part(st_, comp, 7, max(rows, 1)),), rows)
    rs, _ = st_.apply_merge_results([FueledMergeRes(out)], 900, True)
    if rs[0].applied():
        assert sum(b.len for b in st_.batches()) == rows_before
    assert (st_.since, st_.upper) == (since, upper)
    st_.trace.validate()


# ------------------------------------------------------------- commit_txn
def txn_cmd(st: ShardState, wid: str, ts: int, **kw: object) -> TxnCmd:
    fields: dict[str, object] = {
        "writer_id": wid,
        "record_id": "x" + wid[1:],
        "token": "txn-token",
        "ts": ts,
        "lease_ms": LEASE,
        "registered": False,
        "owners": frozenset(),  # the writer's own parts: checked once registered
        "handed": (),
        "given": (),
        "timed_lo": None,
        "done": (),
        "pieces": lambda upper: [batch(st, wid, upper.as_option() or 0, ts + 1, ts)],
    }
    fields.update(kw)
    return TxnCmd(**fields)  # type: ignore[arg-type]


def test_commit_txn_commits_then_reports_landed() -> None:
    st = new_state()
    wid = new_writer_id()
    cmd = txn_cmd(st, wid, 4, done=("xold",))
    st.writers["xold"] = WriterState(0, LEASE)  # an acknowledged transaction's record
    (kind, reqs), changed = st.commit_txn(cmd, Inputs(), 100, True)
    assert (kind, changed) == ("ok", True) and st.upper == ac(5)
    assert wid in st.writers and "xold" not in st.writers
    before = st.clone()
    assert st.commit_txn(cmd, Inputs(), 200, False) == (("landed", 4), False)
    assert same(st, before)


def test_commit_txn_reports_a_mismatch_and_changes_nothing() -> None:
    st = new_state()
    wid = new_writer_id()
    st.commit_txn(txn_cmd(st, wid, 9, token="t1"), Inputs(), 100, True)  # upper 10
    before = st.clone()
    (kind, (upper, retryable)), changed = st.commit_txn(
        txn_cmd(st, wid, 4, token="t2"), Inputs(), 200, True
    )
    assert (kind, upper, retryable, changed) == ("mismatch", ac(10), True, False)
    (kind, (_u, retryable)), _ = st.commit_txn(
        txn_cmd(st, wid, 12, token="t3", timed_lo=3), Inputs(), 200, True
    )
    assert (kind, retryable) == ("mismatch", False)  # no later ts fixes timed updates
    assert same(st, before)


def test_commit_txn_refuses_an_expired_owner_stale_first() -> None:
    st = new_state()
    wid, owner = new_writer_id(), new_writer_id()
    st.heartbeat_writer(owner, 0, 10)
    before = st.clone()
    cmd = txn_cmd(st, wid, 4, owners=frozenset({owner}))
    with pytest.raises(Stale):
        st.commit_txn(cmd, Inputs(), 100, False)
    with pytest.raises(LeaseExpired):
        st.commit_txn(cmd, Inputs(), 100, True)
    assert same(st, before)


# ------------------------------------------------------------- readers
def test_reader_commands() -> None:
    st = new_state()
    assert st.open_reader("r1", 0, LEASE, KS, VS, None) == 0
    assert st.open_reader("r2", 0, LEASE, pa.schema([("z", pa.int8())]), VS, None) is None
    assert st.open_reader("r3", 0, LEASE, KS, VS, 7) == 7
    assert st.downgrade_since("r1", ac(3), 10, None, True)
    assert st.reader("r1").since == ac(3)
    # An earlier since only renews the lease.
    st.downgrade_since("r1", ac(1), 20, None, True)
    assert st.reader("r1").since == ac(3) and st.reader("r1").last_heartbeat_ms == 20
    assert st.renew_reader("r1", 30, None, True)
    assert st.detach("r1", 40, 2, True)
    assert st.expire_reader("r2") and not st.expire_reader("r2")


def test_reader_commands_on_an_unknown_reader_are_stale_then_expired() -> None:
    st = new_state()
    before = st.clone()
    for run in (
        lambda f: st.downgrade_since("gone", ac(1), 10, None, f),
        lambda f: st.renew_reader("gone", 10, None, f),
        lambda f: st.detach("gone", 10, None, f),
    ):
        with pytest.raises(Stale):
            run(False)
        with pytest.raises(LeaseExpired):
            run(True)
    assert same(st, before)


def test_register_listen_before_the_since() -> None:
    st = new_state()
    st.open_reader("r", 0, LEASE, KS, VS, None)
    st.downgrade_since("r", ac(5), 1, None, True)
    before = st.clone()
    with pytest.raises(Stale):
        st.register_listen("l", 2, 10, LEASE, False)
    with pytest.raises(SinceViolation):
        st.register_listen("l", 2, 10, LEASE, True)
    assert same(st, before)
    assert st.register_listen("l", 5, 10, LEASE, True) and st.reader("l").since == ac(5)
    st.finalize(20)
    with pytest.raises(InvalidUsage, match="finalized"):
        st.register_listen("l2", 5, 30, LEASE, True)


# ------------------------------------------------------------- writers
def test_writer_commands() -> None:
    st = new_state()
    wid = new_writer_id()
    assert st.register_writer(wid, 0, LEASE, False, True)
    before = st.clone()
    with pytest.raises(Stale):
        st.register_writer(wid, LEASE + 1, LEASE, True, False)
    with pytest.raises(LeaseExpired):
        st.register_writer(wid, LEASE + 1, LEASE, True, True)
    assert same(st, before)
    assert st.renew_writers((wid,), 50) == (True, True)
    assert st.renew_writers((wid, "wgone"), 60) == (False, True)
    assert st.hand_off(wid, 70, 3 * LEASE, 2) == (True, True)
    assert st.settle_handed_off(((wid, 2),))
    assert wid not in st.writers
    assert not st.expire_writer(wid)


def test_register_compactor_draws_a_new_id_once_the_old_ran_out() -> None:
    st = new_state()
    old, fallback = new_writer_id(), new_writer_id()
    assert st.register_compactor(old, fallback, False, 0, LEASE, True) == old
    assert st.register_compactor(old, fallback, True, 100, LEASE, True) == old
    with pytest.raises(Stale):
        st.clone().register_compactor(old, fallback, True, 10 * LEASE, LEASE, False)
    assert st.register_compactor(old, fallback, True, 10 * LEASE, LEASE, True) == fallback


# ------------------------------------------------------------- schema, finalize, GC
def test_register_schema_refusal_changes_nothing() -> None:
    st = new_state()
    before = st.clone()
    with pytest.raises(SchemaMismatch):
        st.register_schema(KS, pa.schema([("v", pa.int64())]))
    with pytest.raises(SchemaMismatch):
        st.register_schema(pa.schema([("k", pa.string())]), VS)
    assert same(st, before)
    assert st.register_schema(KS, pa.schema([("v", pa.string()), ("x", pa.int8())])) == (1, True)


def test_finalize_retires_everything_once() -> None:
    st, _ = _state_with_batches(3)
    keys = st.referenced_blob_keys()
    assert st.finalize(77)
    assert st.tombstone and not st.readers and not st.writers and st.upper == Antichain()
    assert st.retire_adds == {k: 77 for k in keys}
    assert not st.finalize(88)


def test_forget_listed() -> None:
    st = new_state()
    st.retired_upper = 3
    rows = {"a": 1, "b": 2}
    # GC's: only rows still present with the same ms.
    assert st.forget_listed(3, rows, {"a": 1, "b": 9, "c": 3}, False)
    assert st.retire_removes == {"a": 1}
    # Finalize's: every row, but only on a listing of this version's upper.
    st2 = new_state()
    st2.retired_upper = 3
    with pytest.raises(Stale):
        st2.forget_listed(4, rows, None, False)
    assert st2.forget_listed(3, rows, None, False) and st2.retire_removes == rows


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=8))
def test_appends_then_merges_keep_every_row(widths: list[int]) -> None:
    """A run of appends then every merge the Spine asks for: the rows stay."""
    s = new_state()
    wid, comp = new_writer_id(), new_writer_id()
    s.heartbeat_writer(comp, 0, LEASE)
    lo = 0
    for i, w in enumerate(widths):
        s.compare_and_append(append_cmd(s, wid, lo, lo + w, i), Inputs(), 1, True)
        lo += w
    total = Counter(b.len for b in s.batches())
    n = sum(k * v for k, v in total.items())
    for req in s.trace.all_fueled_merge_reqs():
        rows = sum(b.len for b in s.batches() if req.desc.lower <= b.desc.lower < req.desc.upper)
        out = HollowBatch(req.desc, (part(s, comp, 500 + rows, max(rows, 1)),), rows)
        s.apply_merge_results([FueledMergeRes(out)], 2, True)
    assert sum(b.len for b in s.batches()) == n
    assert s.upper == ac(lo)
    s.trace.validate()
