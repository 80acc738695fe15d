"""Bad-input campaign, persist side: hypothesis-generated garbage for persist's
public entry points (shard names, schemas, frontiers, times outside the bounds, wrong
types, wrong columns and column types, transmitted batches, rewrite frontiers), Parquet
parts truncated or corrupted in the blob store, and corrupted state JSON in the shard's
stash collection.

Each call either succeeds or raises a :class:`PersistError` (or, for the stash itself, a
:class:`StashError`) with a non-empty message -- never another exception type, never a
hang (each call runs in a thread with a time limit) -- and a failed call changes nothing
(the shard's upper, since and contents are the ones before the call).  Corruption is
reported as :class:`CorruptPart` naming the blob key, or as a :class:`PersistError`
naming the shard, and the shard recovers once the damage is repaired.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist import CorruptPart, FileBlob, PersistClient, PersistError, fsck
from stash import Antichain, Stash, StashError, logs
from stash.codec import canonical_json
from tests.reliability.campaign import record, runs

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string())])
CALL_LIMIT_SECONDS = 20.0

text = st.text(
    st.characters(exclude_characters="\x00", exclude_categories=("Cs",)), max_size=8
)  # JSON the stash stores
json_garbage = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        text,
    ),
    lambda s: st.one_of(st.lists(s, max_size=3), st.dictionaries(text, s, max_size=3)),
    max_leaves=10,
)
times = st.one_of(
    st.integers(-5, 60),
    st.integers(min_value=2**63, max_value=2**70),
    st.integers(min_value=-(2**70), max_value=-(2**63) - 1),
)
frontiers = st.one_of(
    times,
    st.builds(Antichain.from_elem, st.integers(-(2**63), 2**63 - 1)),
    st.builds(Antichain.from_elem, st.integers(-3, 60)),
    st.just(Antichain()),
)
garbage = st.one_of(
    json_garbage,
    frontiers,
    st.binary(max_size=20),
    st.builds(object),
    st.just(float("nan")),
    st.just("\x00"),
    st.just(True),
    st.recursive(st.integers(), lambda s: st.lists(s, min_size=1, max_size=1), max_leaves=200),
)
arrow_types = st.sampled_from(
    [pa.int64(), pa.int32(), pa.string(), pa.float64(), pa.bool_(), pa.binary(), pa.null(),
     pa.list_(pa.int64()), pa.timestamp("us"), pa.uint64()]
)  # fmt: skip
schemas = st.one_of(
    st.just(KS),
    st.just(VS),
    st.builds(
        lambda names, tys: pa.schema(list(zip(names, tys, strict=False))),
        st.lists(st.sampled_from(["k", "v", "_time", "_diff", "x", ""]), max_size=3, unique=True),
        st.lists(arrow_types, min_size=3, max_size=3),
    ),
    garbage,
)


def _column(ty: pa.DataType, n: int, values: list[Any]) -> pa.Array:
    try:
        return pa.array(values[:n], type=ty)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return pa.nulls(n, type=ty)


@st.composite
def update_tables(draw: st.DrawFn) -> Any:
    """Tables with the right, missing, extra or wrongly typed columns and any values."""
    n = draw(st.integers(0, 4))
    cols: dict[str, pa.Array] = {}
    for name, good in (("k", pa.int64()), ("v", pa.string()), ("_time", pa.int64()),
                       ("_diff", pa.int64())):  # fmt: skip
        if draw(st.integers(0, 9)) == 0:
            continue  # missing column
        ty = draw(arrow_types) if draw(st.integers(0, 3)) == 0 else good
        values = draw(st.lists(st.one_of(st.none(), st.integers(-3, 60), st.text(max_size=3)),
                               min_size=n, max_size=n))  # fmt: skip
        cols[name] = _column(ty, n, values)
    if draw(st.booleans()) and draw(st.integers(0, 5)) == 0:
        cols["extra"] = pa.nulls(n)
    return pa.table(cols) if cols else pa.table({})


update_lists = st.lists(
    st.one_of(
        st.tuples(
            st.tuples(st.tuples(st.integers(-5, 5)), st.tuples(st.text(max_size=3))),
            times,
            st.integers(-2, 2),
        ),  # fmt: skip
        garbage,
    ),
    max_size=4,
)
updates = st.one_of(update_tables(), update_lists, garbage)

OPS = [
    "open",
    "compare_and_append",
    "append_in_bounds_garbage_rows",
    "builder",
    "batch_from_transmittable",
    "mutated_transmittable",
    "rewrite_ts",
    "snapshot",
    "downgrade_since",
    "listen",
    "client",
]


class Leak(Exception):
    """A call raised something other than PersistError/StashError, or hung."""


def _guarded(fn: Callable[[], Any]) -> str:
    """Run ``fn`` in a thread with a time limit: ``"ok"`` or ``"error: <message>"`` (a
    PersistError/StashError with a message); raises :class:`Leak` otherwise."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            fn()
            box["r"] = "ok"
        except (PersistError, StashError) as e:
            box["r"] = f"error: {e}"
            box["msg"] = str(e)
        except BaseException as e:  # noqa: BLE001 - that is what the campaign looks for
            box["leak"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(CALL_LIMIT_SECONDS)
    if t.is_alive():
        raise Leak(f"call did not return within {CALL_LIMIT_SECONDS} s")
    if "leak" in box:
        e = box["leak"]
        raise Leak(f"{type(e).__name__}: {e}") from e
    if "msg" in box and not box["msg"].strip():
        raise Leak("an error with an empty message")
    return str(box["r"])


def _observe(client: PersistClient, name: str) -> Any:
    """What a failed call must leave unchanged: upper, since, contents at upper - 1."""
    st_ = client.inspect(name)
    upper = st_.upper.as_option()
    assert upper is not None
    r = client.open_reader(name, KS, VS)
    since = st_.since.as_option()
    try:
        rows = r.snapshot(upper - 1).to_pylist() if since is not None and upper > since else None
    finally:
        r.expire()
    return st_.upper, st_.since, rows


@pytest.mark.campaign
def test_garbage_never_crashes_or_half_writes(tmp_path: Path) -> None:
    stash = Stash.open(f"sqlite:///{tmp_path}/bad.db", fenced=False)
    client = PersistClient(
        stash, FileBlob(tmp_path / "blob"), compaction="inline", inline_max_bytes=64
    )
    w, r = client.open("target", KS, VS)
    holder = client.open_reader("target", KS, VS)  # keeps the shard readable (since {0})
    w.compare_and_append([(((1,), ("seed",)), 0, 1)], 0, 1)
    good = w.batch([(((2,), ("b" * 100,)), 1, 1)], 1, 2)
    wire = good.into_transmittable()
    counts = {"calls": 0, "errors": 0, "leaks": 0}
    leaks: list[str] = []

    @settings(max_examples=runs(300, 3000), deadline=None, suppress_health_check=list(HealthCheck))
    @given(op=st.sampled_from(OPS), a=garbage, b=garbage, u=updates, sch=schemas,
           sch2=schemas, data=st.data())  # fmt: skip
    def run(op: str, a: Any, b: Any, u: Any, sch: Any, sch2: Any, data: st.DataObject) -> None:
        upper = w.fetch_recent_upper().as_option()
        assert upper is not None
        before = _observe(client, "target")
        # Draw everything here: hypothesis cannot draw inside the guard's thread.
        name = data.draw(st.one_of(st.just("target"), st.just("other"), garbage))
        raw = data.draw(st.binary(max_size=64))
        mutated = _mutate(wire, data)
        calls: dict[str, Callable[[], Any]] = {
            "open": lambda: client.open(name, sch, sch2),
            "compare_and_append": lambda: w.compare_and_append(u, a, b),
            "append_in_bounds_garbage_rows": lambda: w.compare_and_append(u, upper, upper + 1),
            "builder": lambda: w.builder(a).add(u) or None,
            "batch_from_transmittable": lambda: w.batch_from_transmittable(raw),
            "mutated_transmittable": lambda: w.compare_and_append_batch(
                [w.batch_from_transmittable(mutated)], 1, 2
            ),
            "rewrite_ts": lambda: w.batch([], upper, upper + 2).rewrite_ts(a, b),
            "snapshot": lambda: r.snapshot(a),
            "downgrade_since": lambda: r.downgrade_since(a),
            "listen": lambda: r.listen(a).close(),
            "client": lambda: PersistClient(stash, a, compaction=b).close(),
        }
        counts["calls"] += 1
        try:
            outcome = _guarded(calls[op])
        except Leak as e:
            counts["leaks"] += 1
            leaks.append(f"{op}({a!r:.60}, {b!r:.60}): {e}")
            return
        if outcome != "ok":
            counts["errors"] += 1
            assert _observe(client, "target") == before, f"{op} failed but changed the shard"

    run()
    # The well-formed batch is still appendable: garbage consumed nothing.
    if w.fetch_recent_upper() == Antichain.from_elem(1):
        w.compare_and_append_batch([w.batch_from_transmittable(wire)], 1, 2)
    client.inspect("target").trace.validate()
    assert fsck(client, "target").ok
    holder.expire()
    client.close()
    stash.close()
    record(
        "bad input: persist entry points",
        runs=counts["calls"],
        faults=counts["errors"],
        acknowledged=counts["calls"] - counts["errors"] - counts["leaks"],
        lost=0,
        duplicated=0,
        partial=0,
        unclear=counts["leaks"],
    )
    assert not leaks, "\n".join(leaks[:20])
    assert counts["errors"] > 0


def _mutate(data: bytes, draw: st.DataObject) -> bytes:
    """A random byte flip, truncation or splice of ``data``."""
    kind = draw.draw(st.sampled_from(["flip", "truncate", "splice"]))
    i = draw.draw(st.integers(0, len(data) - 1))
    if kind == "flip":
        return data[:i] + bytes([data[i] ^ draw.draw(st.integers(1, 255))]) + data[i + 1 :]
    if kind == "truncate":
        return data[:i]
    return data[:i] + draw.draw(st.binary(min_size=1, max_size=8)) + data[i:]


@pytest.mark.campaign
def test_corrupt_parts_are_named_and_recoverable(tmp_path: Path) -> None:
    """Truncated, bit-flipped, emptied, replaced or missing Parquet parts: a snapshot and
    a compaction raise CorruptPart naming the part's key (never another error, never
    wrong data); after the part is restored everything reads again."""
    stash = Stash.open("memory://", fenced=False)
    root = tmp_path / "blob"
    client = PersistClient(stash, FileBlob(root), compaction="off", inline_max_bytes=0)
    w, r = client.open("parts", KS, VS)
    for t in range(4):
        w.compare_and_append([(((t * 10 + j,), (f"v{j}",)), t, 1) for j in range(20)], t, t + 1)
    expected = r.snapshot(3).to_pylist()
    keys = sorted(client.inspect("parts").referenced_blob_keys())
    assert keys
    counts = {"corruptions": 0, "named": 0}

    @settings(max_examples=runs(60, 400), deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data(), which=st.integers(0, len(keys) - 1),
           kind=st.sampled_from(["flip", "truncate", "splice", "empty", "missing", "swap"]))  # fmt: skip
    def run(data: st.DataObject, which: int, kind: str) -> None:
        key = keys[which]
        path = root / key
        original = path.read_bytes()
        if kind == "empty":
            bad: bytes | None = b""
        elif kind == "missing":
            bad = None
        elif kind == "swap":  # another valid part under this key
            bad = (root / keys[(which + 1) % len(keys)]).read_bytes()
        else:
            bad = _mutate(original, data)
        if bad == original:
            return
        counts["corruptions"] += 1
        if bad is None:
            path.unlink()
        else:
            path.write_bytes(bad)
        try:
            try:
                r.snapshot(3)
            except CorruptPart as e:
                assert key in str(e), f"CorruptPart does not name {key}: {e}"
                counts["named"] += 1
            except PersistError as e:
                raise AssertionError(f"corruption reported as {type(e).__name__}: {e}") from e
        finally:
            path.write_bytes(original)
            os.chmod(path, 0o600)
        assert r.snapshot(3).to_pylist() == expected

    run()
    # A merge over a corrupt part fails (reported, logged with the key), applies nothing,
    # and succeeds once the part is repaired.
    st0 = client.inspect("parts")
    path = root / keys[0]
    original = path.read_bytes()
    path.write_bytes(original[: len(original) // 2])
    rep = client.compactor.compact_once("parts")
    assert rep.failed >= 1 and rep.applied == 0
    assert client.inspect("parts").batches() == st0.batches()
    path.write_bytes(original)
    rep = client.compactor.compact_once("parts")
    assert rep.applied >= 1 and rep.failed == 0
    assert r.snapshot(3).to_pylist() == expected
    assert fsck(client, "parts").ok
    client.close()
    stash.close()
    assert counts["named"] == counts["corruptions"]
    record(
        "bad input: corrupted Parquet parts",
        runs=counts["corruptions"],
        faults=counts["corruptions"],
        acknowledged=0,
        lost=0,
        duplicated=0,
        partial=0,
        unclear=0,
    )


class _ShardLog:
    """A shard's consensus log (``persist.shard.<id>``, every version a rollup row), read
    and written as the head's entries."""

    def __init__(self, stash: Stash, shard_id: str) -> None:
        self.stash, self.name = stash, f"persist.shard.{shard_id}"

    def entries(self) -> dict[str, Any]:
        """The entries of the head row (a rollup), as stored, however malformed."""
        return dict(json.loads(logs.scan(self.stash, self.name)[-1].data))

    def upper(self) -> Antichain:
        """The head seqno's successor (what a next version is written at)."""
        h = logs.head_seqno(self.stash, self.name)
        return Antichain.from_elem(0 if h is None else h + 1)


def _publish(stash: Stash, coll: _ShardLog, changes: list[tuple[str, Any, int]]) -> None:
    """Write raw entries into a shard's consensus log as the next version, a rollup row
    on top of the head, the way consensus does: ``changes`` retract (``-1``) and add
    (``+1``) entries of the head's."""
    entries = coll.entries()
    for k, _v, d in changes:
        if d < 0:
            entries.pop(k, None)
    for k, v, d in changes:
        if d > 0:
            entries[k] = v
    head = logs.head_seqno(stash, coll.name)
    assert head is not None
    text = canonical_json(entries)
    logs.write(stash, [logs.LogEntry(coll.name, head, head + 1, text, True)])


@pytest.mark.campaign
def test_corrupt_state_json(tmp_path: Path) -> None:
    """Entries of the shard's state in the stash replaced by garbage JSON (or removed):
    reading the shard raises a PersistError naming the shard, writing it commits nothing,
    no other exception escapes; repairing the entry makes the shard work again."""
    stash = Stash.open(f"sqlite:///{tmp_path}/state.db", fenced=False)
    client = PersistClient(stash, "memory://", compaction="inline", inline_max_bytes=4096)
    # Every version a rollup, so that the entries corrupted below are the head's
    # (damaged diff entries: tests/persist/test_consensus.py).
    client.consensus.max_diffs = 0
    w, r = client.open("state", KS, VS)
    for t in range(6):
        w.compare_and_append([(((t,), ("x",)), t, 1)], t, t + 1)
    shard_id = client.shard_id("state")
    coll = _ShardLog(stash, shard_id)
    counts = {"corruptions": 0, "rejected": 0, "accepted": 0}
    leaks: list[str] = []

    @settings(max_examples=runs(120, 1000), deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data(), junk=json_garbage, remove=st.booleans())
    def run(data: st.DataObject, junk: Any, remove: bool) -> None:
        entries = dict(coll.entries())
        key = data.draw(st.sampled_from(sorted(entries)))
        old = entries[key]
        meta = entries["meta"]
        if key == "meta":
            new_meta = junk
            changes = [("meta", meta, -1)] + ([] if remove else [("meta", junk, 1)])
        else:
            new_meta = {**meta, "seqno": meta["seqno"] + 1}
            changes = [(key, old, -1), ("meta", meta, -1), ("meta", new_meta, 1)]
            if not remove:
                changes.append((key, _inner_mutation(old, junk, data), 1))
        if any(v == old for k, v, d in changes if d == 1 and k == key):
            return
        _publish(stash, coll, changes)
        counts["corruptions"] += 1
        upper_before = coll.upper()
        fresh = PersistClient(stash, client.raw_blob, compaction="off")
        try:
            outcome = _guarded(lambda: fresh.inspect("state").trace.validate())
            if outcome == "ok":
                counts["accepted"] += 1
            else:
                counts["rejected"] += 1
                assert shard_id in outcome or "'state'" in outcome, outcome
                # Opening and writing a corrupt shard fail too, and write nothing.
                for fn in (
                    lambda: fresh.open("state", KS, VS),
                    lambda: fresh.open_writer("state", KS, VS).compare_and_append(
                        [(((9,), ("y",)), 6, 1)], 6, 7
                    ),
                ):
                    assert _guarded(fn) != "ok", "a corrupt shard was opened"
                assert coll.upper() == upper_before, "a rejected call wrote"
        except Leak as e:
            leaks.append(f"{key} -> {junk!r:.80}: {e}")
        finally:
            fresh.close()
            # Repair: the original entry and a fresh seqno on top of whatever is there.
            now = dict(coll.entries())
            repaired_meta = {**meta, "seqno": coll.upper().as_option()}
            fix = [(k, v, -1) for k, v in now.items() if k in (key, "meta")]
            fix += [(key, old, 1)] if key != "meta" else []
            fix += [("meta", repaired_meta, 1)]
            _publish(stash, coll, fix)
        client.machine(shard_id).fetch()
        assert client.inspect("state").upper == Antichain.from_elem(6)

    run()
    assert r.snapshot(5).num_rows == 6
    assert fsck(client, "state").ok
    client.close()
    stash.close()
    record(
        "bad input: corrupted state JSON",
        runs=counts["corruptions"],
        faults=counts["corruptions"],
        acknowledged=counts["accepted"],
        lost=0,
        duplicated=0,
        partial=0,
        unclear=len(leaks),
        rejected=counts["rejected"],
    )
    assert not leaks, "\n".join(leaks[:20])


def _inner_mutation(old: Any, junk: Any, data: st.DataObject) -> Any:
    """Replace the whole value, or one field of it, by ``junk``."""
    if isinstance(old, dict) and old and data.draw(st.booleans()):
        field = data.draw(st.sampled_from(sorted(old)))
        return {**old, field: junk}
    return junk


@pytest.mark.parametrize("bad", ["{not json", "[1, 2", '"\\ud800"'])
def test_unreadable_transmitted_batches(bad: str, tmp_path: Path) -> None:
    """Bytes that are not even JSON are an InvalidUsage naming the problem."""
    with Stash.open("memory://", fenced=False) as stash:
        client = PersistClient(stash, "memory://", compaction="off")
        w, _ = client.open("t", KS, VS)
        with pytest.raises(PersistError, match="transmittable"):
            w.batch_from_transmittable(bad.encode())
        client.close()


# ------------------------------------------------------------------------------ regressions


@pytest.mark.parametrize("t", [2**63, 2**70, -(2**63) - 1])
def test_regression_times_outside_i64_are_invalid_usage(t: int) -> None:
    """Found by the campaign: a frontier given as an int outside i64 leaked the
    Antichain's ValueError from ``builder``, ``compare_and_append``, ``downgrade_since``
    and ``listen``; it is an InvalidUsage naming the bound, and nothing changes."""
    with Stash.open("memory://", fenced=False) as stash:
        client = PersistClient(stash, "memory://", compaction="off")
        w, r = client.open("t", KS, VS)
        before = client.inspect("t")
        for fn in (
            lambda: w.builder(t),
            lambda: w.compare_and_append([], t, t),
            lambda: w.compare_and_append([], 0, t),
            lambda: r.downgrade_since(t),
            lambda: r.listen(t),
            lambda: r.snapshot(t),
        ):
            with pytest.raises(PersistError, match="outside the i64 range|upper|since"):
                fn()
        after = client.inspect("t")
        assert (after.upper, after.since) == (before.upper, before.since)
        client.close()


def test_regression_corrupt_state_error_names_the_shard(tmp_path: Path) -> None:
    """Found by the campaign: a state whose ``shard`` entry was removed failed with
    "malformed shard state at seqno ?: 'shard'", naming no shard; the error now names
    the shard id, and a state naming another shard is refused."""
    stash = Stash.open(f"sqlite:///{tmp_path}/s.db", fenced=False)
    client = PersistClient(stash, "memory://", compaction="off")
    client.consensus.max_diffs = 0  # every version a rollup: the entries edited below
    client.open("named", KS, VS)
    sid = client.shard_id("named")
    coll = _ShardLog(stash, sid)
    entries = coll.entries()
    meta = entries["meta"]
    _publish(stash, coll, [("shard", entries["shard"], -1), ("meta", meta, -1),
                           ("meta", {**meta, "seqno": meta["seqno"] + 1}, 1)])  # fmt: skip
    fresh = PersistClient(stash, "memory://", compaction="off")
    with pytest.raises(PersistError, match=sid):
        fresh.inspect("named")
    other = {**entries["shard"], "shard_id": "s" + "0" * 8 + "-0000-4000-8000-" + "0" * 12}
    meta2 = {**meta, "seqno": meta["seqno"] + 2}
    _publish(stash, coll, [("shard", other, 1), ("meta", {**meta, "seqno": meta["seqno"] + 1}, -1),
                           ("meta", meta2, 1)])  # fmt: skip
    fresh2 = PersistClient(stash, "memory://", compaction="off")
    with pytest.raises(PersistError, match="names shard"):
        fresh2.inspect("named")
    for c in (client, fresh, fresh2):
        c.close()
    stash.close()


def test_regression_damaged_transmitted_batch_is_refused() -> None:
    """Found by the campaign: a transmitted batch with one character of a part key
    flipped was appended, and the shard then referenced a part that does not exist
    (every later snapshot failed).  Transmitted bytes now carry a SHA-256 digest and a
    damaged batch is refused with InvalidUsage before anything is appended."""
    with Stash.open("memory://", fenced=False) as stash:
        client = PersistClient(stash, "memory://", compaction="off", inline_max_bytes=0)
        w, r = client.open("t", KS, VS)
        wire = w.batch([(((1,), ("x" * 50,)), 0, 1)], 0, 1).into_transmittable()
        key = json.loads(wire)["batch"]["parts"][0]["key"]
        i = wire.index(key.encode()) + len(key) - 12
        damaged = wire[:i] + (b"0" if wire[i : i + 1] != b"0" else b"1") + wire[i + 1 :]
        with pytest.raises(PersistError, match="digest"):
            w.compare_and_append_batch([w.batch_from_transmittable(damaged)], 0, 1)
        assert w.fetch_recent_upper() == Antichain.from_elem(0)
        w.compare_and_append_batch([w.batch_from_transmittable(wire)], 0, 1)
        assert r.snapshot(0).column("k").to_pylist() == [1]
        client.close()


def test_regression_a_huge_spine_level_is_refused_without_allocating_it() -> None:
    """Found by the long bad-input campaign: a spine batch's ``level`` corrupted to
    6.7e16 (written back as an integer) made decoding the trace allocate that many merge
    levels, exhausting memory; it is now refused as corrupt before any allocation."""
    from persist.spine import Trace

    t = Trace()
    d = t.to_json()
    d["spine_batches"] = {"0-4": {"level": 66954526683632730, "desc": {}, "parts": []}}
    with pytest.raises(ValueError, match="level"):
        Trace.from_json(d)
