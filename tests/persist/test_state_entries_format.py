"""The layout of a shard state's entries in its log rows, kept lean, and states written
in the earlier layout still read.

A one-row append's diff row leaves out what the reader can rebuild: an inline part's
``bytes`` and ``sha256`` (computed from its bytes), a batch's empty ``runs``, a writer's unset
``last_token``; its landed record is ``landed/<seqno>: [token, fingerprint, seqno,
ms]`` instead of ``landed/<digest>: {"entry", "ms", "seqno"}``.  Each rollup holds the
same records and parts, so it shrinks too (``bench/bench_commit.py``'s Postgres WAL).

``data/state_entries_r48.json`` holds the rows of a stash the code before wrote
(``data/make_state_entries_r48.py``: a shard past a rollup, inline parts, eleven landed
records) and what reading it gave then.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import sqlalchemy as sa

import persist.landed as landed
from persist import PersistClient
from persist.fingerprint import UPDATES
from persist.landed import Landed, entry_key, record
from persist.lease_state import TOKEN_LANDED, TOKEN_SEP
from persist.state import ShardState
from persist.state_base import token_verdict
from persist.types import PartRef
from stash import Stash, logs
from stash.migrate import upgrade

FIXTURE = Path(__file__).parent / "data" / "state_entries_r48.json"
KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])


def _load(tmp_path: Path) -> tuple[str, str, dict[str, Any]]:
    """The fixture's stash (SQLite, brought to the head revision) and blob store."""
    fx = json.loads(FIXTURE.read_text())
    url = f"sqlite:///{tmp_path}/old.db"
    engine = sa.create_engine(url)
    try:
        upgrade(engine, fx["revision"])
        with engine.begin() as conn:
            for table in ("collections", "sinces", "uppers", "data", "logs"):
                cols = fx["tables"][table]["columns"]
                rows = [dict(zip(cols, r, strict=True)) for r in fx["tables"][table]["rows"]]
                marks = ", ".join(f":{c}" for c in cols)
                conn.execute(
                    sa.text(f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({marks})"),  # noqa: S608
                    rows,
                )
        upgrade(engine)
    finally:
        engine.dispose()
    for rel, b64 in fx["blob_files"].items():
        path = tmp_path / "blob" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(b64))
    return url, f"file://{tmp_path}/blob", fx


def _rows(client: PersistClient, upper: int) -> list[str]:
    w, r = client.open("old", KS, VS)
    try:
        return sorted(map(json.dumps, r.snapshot(upper - 1).to_pylist()))
    finally:
        r.expire()
        w.expire()


def test_a_state_written_in_the_earlier_layout_reads_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old rows read as the state and rows they read as then; the landed records
    under their digest keys still answer a retry; appends on top write the lean layout
    (pruning old records by their digest keys: few are kept here), and a fresh process
    reads the mix, past a rollup written the new way.  (The test suite checks every
    version against its full encoding and decoding, ``PERSIST_CHECK_INCREMENTAL``.)"""
    monkeypatch.setattr(landed, "TOKENS_KEPT", 8)
    url, blob, fx = _load(tmp_path)
    want = fx["expected"]
    with Stash.open(url, fenced=False) as s:
        client = PersistClient(s, blob, compaction="off", gc_interval_seconds=None)
        try:
            st = client.inspect("old")
            assert st == ShardState.from_json(json.loads(want["state"]))
            assert st.upper.as_option() == want["upper"] == 11
            assert _rows(client, 11) == want["rows"]
            for entry in want["tokens"]:
                token = entry.split(TOKEN_SEP, 1)[0]
                assert token_verdict(st, token, None) == (TOKEN_LANDED, entry)
            assert all(r.key == entry_key(r.token) for r in st.landed.values())
            client.consensus.max_diffs = 4
            w, _r = client.open("old", KS, VS)
            for t in range(11, 25):
                w.compare_and_append([(((t,), (f"v{t}",)), t, 1)], t, t + 1)
            mine = client.inspect("old")
            assert len(mine.landed) == 8
            assert [r.key for r in mine.landed.values()] == [
                f"landed/{r.seqno}" for r in mine.landed.values()
            ]
            w.expire()
            _r.expire()
            mine = client.inspect("old")
        finally:
            client.close()
        name = f"persist.shard.{want['shard_id']}"
        rows = logs.head(s, name)
        assert rows[0].rollup and rows[0].seqno > 12  # a rollup written since
        rollup = json.loads(rows[0].data)
        for k, v in rollup.items():
            if k.startswith("trace/hollow_batches/"):
                # Batches read in the earlier layout are kept as stored; new ones lean.
                old = int(k.rsplit("/", 1)[1].split("-")[0]) < 11
                assert ("sha256" in v["parts"][0]) == old and ("runs" in v) == old, k
        recs = {k: v for k, v in rollup.items() if k.startswith("landed/")}
        assert len(recs) == 8
        assert all(k == f"landed/{v[2]}" for k, v in recs.items())
    with Stash.open(url, fenced=False) as s:
        fresh = PersistClient(s, blob, compaction="off", gc_interval_seconds=None)
        try:
            again = fresh.inspect("old")
            assert again == mine
            got = [json.loads(x) for x in _rows(fresh, 25)]
            assert sorted((r["k"], r["v"], r["_diff"]) for r in got) == [
                (t, f"v{t}", 1) for t in range(25)
            ]
        finally:
            fresh.close()


def test_a_one_row_diff_holds_the_lean_entries(tmp_path: Path) -> None:
    """Failed on the old code: the diff row held the part's ``sha256``, ``"runs":
    []``, ``"last_token": null`` and the landed record as ``{"entry", "ms", "seqno"}``
    under ``landed/<digest>``."""
    with Stash.open(f"sqlite:///{tmp_path}/s.db", fenced=False) as s:
        client = PersistClient(
            s, f"file://{tmp_path}/blob", compaction="off", gc_interval_seconds=None
        )
        try:
            w, r = client.open("t", KS, VS)
            w.compare_and_append([(((1,), ("one",)), 0, 1)], 0, 1)
            w.compare_and_append([(((2,), ("two",)), 1, 1)], 1, 2)
            diff = json.loads(logs.head(s, f"persist.shard.{client.shard_id('t')}")[-1].data)
            seqno = diff["seqno"]
            sets = diff["set"]
            (part,) = sets["trace/hollow_batches/1-2"]["parts"]
            assert set(part) == {"inline", "nonce", "rows"}
            assert "runs" not in sets["trace/hollow_batches/1-2"]
            (writer,) = (v for k, v in sets.items() if k.startswith("writer/"))
            lease_fields = {"last_heartbeat_ms", "lease_duration_ms"}  # a lease, as stored
            assert set(writer) == lease_fields
            token, fp, at, ms = sets[f"landed/{seqno}"]
            assert at == seqno and fp.startswith(UPDATES) and isinstance(ms, int)
            assert token_verdict(client.inspect("t"), token, None)[0] == TOKEN_LANDED
            assert r.snapshot(1).num_rows == 2
            w.expire()
            r.expire()
        finally:
            client.close()


def test_an_inline_part_size_and_checksum_are_its_bytes() -> None:
    """Left out of an inline part's JSON, read back from its bytes; stored ones (older
    states) are kept, and written again when they are not the bytes' (a damaged part is
    still caught by them); a blob part needs them."""
    data = b"PZS1 some bytes"
    sha = hashlib.sha256(data).hexdigest()
    ref = PartRef(None, 1, len(data), sha, inline=data, nonce="ab" * 16)
    d = ref.to_json()
    assert "sha256" not in d and "bytes" not in d
    assert PartRef.from_json(d) == ref
    damaged = PartRef.from_json({**d, "sha256": "0" * 64})
    assert damaged.checksum == "0" * 64 and PartRef.from_json(damaged.to_json()) == damaged
    short = PartRef.from_json({**d, "bytes": 3})
    assert short.encoded_size_bytes == 3 and PartRef.from_json(short.to_json()) == short
    blob = PartRef("s/k", 1, 2, sha)
    assert blob.to_json()["sha256"] == sha and PartRef.from_json(blob.to_json()) == blob
    with pytest.raises(KeyError):
        PartRef.from_json({"key": "s/k", "rows": 1, "bytes": 2})


def test_landed_entries_round_trip_in_both_forms() -> None:
    """The short form, the earlier form under its digest key, and a second record of one
    version (never made by one command, kept apart all the same)."""
    recs: dict[str, Landed] = {}
    record(recs, -1, f"a{TOKEN_SEP}Vfp", 5, 1)
    record(recs, -1, f"b{TOKEN_SEP}t9", 5, 2)
    a, b = recs["a"], recs["b"]
    assert a.key == "landed/5" and b.key == entry_key("b")
    assert a.entry_json() == ["a", "Vfp", 5, 1]
    for rec in (a, b):
        back = Landed.from_entry(rec.key, json.loads(json.dumps(rec.entry_json())))
        assert back == rec and back.key == rec.key
    old = Landed.from_entry(entry_key("a"), a.to_json())
    assert old == a and old.key == entry_key("a") and old.entry_json() == a.to_json()
    plain = Landed("no-separator", 3, 0)
    assert plain.entry_json() == plain.to_json()
    assert Landed.from_entry(plain.key, plain.entry_json()) == plain
