"""The shard's landed records (persist/landed.py): pure checks of the record keeping,
its codec, and states written before the records existed.

* the newest ``TOKENS_KEPT`` records are kept, the horizon is the highest pruned seqno,
  and the verdict is "not landed" only when no record after ``lo`` was pruned;
* both JSON forms round-trip the records;
* a state stored before the records existed still decodes: its writers' tokens count
  as landed, and its horizon is its own seqno (any earlier record may have left with a
  writer's lease), so a token of unknown age is "unknown", never "not landed".
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

import persist.landed as landed
from persist.ids import new_shard_id
from persist.landed import LANDED, NO_HORIZON, NOT_LANDED, UNKNOWN, record, verdict
from persist.lease_state import TOKEN_LANDED, TOKEN_NOT_LANDED, TOKEN_SEP, TOKEN_UNKNOWN
from persist.state import ShardState, WriterState
from persist.state_base import token_verdict

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])


def new_state() -> ShardState:
    return ShardState(new_shard_id(), "t", KS, VS, seqno=0)


def test_the_newest_are_kept_and_the_horizon_is_the_highest_pruned_seqno(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(landed, "TOKENS_KEPT", 3)
    recs: dict[str, Any] = {}
    horizon = NO_HORIZON
    for seqno in range(1, 6):
        horizon = record(recs, horizon, f"tok{seqno}{TOKEN_SEP}fp", seqno, 0)
    assert list(recs) == ["tok3", "tok4", "tok5"] and horizon == 2
    assert verdict(recs, horizon, "tok4", None) == (LANDED, f"tok4{TOKEN_SEP}fp")
    assert verdict(recs, horizon, "tok1", None) == (UNKNOWN, None)  # maybe pruned
    assert verdict(recs, horizon, "tok1", 1) == (UNKNOWN, None)  # landed after 1? pruned?
    assert verdict(recs, horizon, "tokX", 2) == (NOT_LANDED, None)  # nothing after 2 pruned
    assert verdict({}, NO_HORIZON, "tokX", None) == (NOT_LANDED, None)


def test_records_round_trip_in_both_json_forms() -> None:
    st = new_state()
    st.record_landed(f"tok-a{TOKEN_SEP}Vabc", 1_000)
    st.seqno = 1
    st.record_landed(f"tok-b{TOKEN_SEP}t7", 2_000)
    st.seqno = 2
    st.landed_horizon = 0
    for back in (
        ShardState.from_entries(st.to_entries()),
        ShardState.from_json(st.to_json()),
    ):
        assert back.landed == st.landed and back.landed_horizon == 0
        assert list(back.landed) == ["tok-a", "tok-b"]  # oldest first
        assert [r.seqno for r in back.landed.values()] == [1, 2]


def test_a_state_stored_before_the_records_existed_still_decodes() -> None:
    st = new_state()
    wid = "w" + "1" * 32
    st.writers[wid] = WriterState(5, 60_000, f"old-tok{TOKEN_SEP}Vfp", ())
    st.seqno = 9
    entries = st.to_entries()
    entries["meta"] = {k: v for k, v in entries["meta"].items() if k != "landed_horizon"}
    old = ShardState.from_entries(entries)
    assert old.landed == {} and old.landed_horizon == 9
    assert token_verdict(old, "old-tok", None) == (TOKEN_LANDED, f"old-tok{TOKEN_SEP}Vfp")
    assert token_verdict(old, "gone-tok", None) == (TOKEN_UNKNOWN, None)
    assert token_verdict(old, "new-tok", 9) == (TOKEN_NOT_LANDED, None)
    doc = st.to_json()
    del doc["landed"], doc["landed_horizon"]
    assert ShardState.from_json(doc).landed_horizon == 9
