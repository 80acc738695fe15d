"""An append's fingerprint is a function of its updates' values, not of their Arrow
buffers.

The defect: ``updates_fingerprint`` hashed the Arrow IPC message of the updates, whose
bytes are not a function of the values: a sliced boolean column keeps its parent's
trailing bits, and the bytes under a null slot are undefined.  Two equal tables
(``a.equals(b)``) then had different fingerprints, and a true retry of an append that
landed was refused as "a different append ... nothing was written", so a caller
believing that wrote the rows again under a fresh token."""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persist import (
    ConsensusError,
    FileBlob,
    InvalidUsage,
    MemoryBlob,
    PersistClient,
    fingerprint,
)
from persist import write as write_module
from persist.fingerprint import updates_fingerprint
from persist.lease_state import TOKEN_SEP
from stash import Antichain, Stash
from tests.persist.arrow_strategies import COLUMN_TYPES, arrow_array, column_values
from tests.support.stash_faults import AckLostStash

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.bool_()), ("n", pa.int64())])
E, N = Antichain.from_elem(0), Antichain.from_elem(1)


def _table(v: pa.Array, n: pa.Array) -> pa.Table:
    return pa.table(
        {
            "k": pa.array([1, 2], pa.int64()),
            "v": v,
            "n": n,
            "_time": pa.array([0, 0], pa.int64()),
            "_diff": pa.array([1, 1], pa.int64()),
        }
    )


def _equal_tables() -> tuple[pa.Table, pa.Table]:
    sliced_bool = pa.array([True, True, True, True]).slice(0, 2)
    with_null = pa.array([1, None], pa.int64())
    # The same values: [1, None], with other bytes under the null slot.
    other_bytes = pa.Array.from_buffers(
        pa.int64(), 2, [with_null.buffers()[0], pa.py_buffer(np.array([1, 7], np.int64).tobytes())]
    )
    a = _table(sliced_bool, with_null)
    b = _table(pa.array([True, True]), other_bytes)
    assert a.equals(b)
    return a, b


def test_equal_updates_have_equal_fingerprints() -> None:
    a, b = _equal_tables()
    assert updates_fingerprint(E, N, a) == updates_fingerprint(E, N, b)


def test_retry_with_equal_updates_is_taken_as_landed(tmp_path: Path) -> None:
    s = Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False)
    c = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off")
    try:
        w, r = c.open("x", KS, VS)
        a, b = _equal_tables()
        w.compare_and_append(a, 0, 1, idempotency_token="job-1-attempt")
        # The retry of that very append (same token, equal updates): writes nothing
        # and succeeds, as compare_and_append promises.
        w.compare_and_append(b, 0, 1, idempotency_token="job-1-attempt")
        assert sum(r.snapshot(0).column("_diff").to_pylist()) == 2
    finally:
        c.close()
        s.close()


def _same(x: Any, y: Any, t: pa.DataType) -> bool:
    """Whether ``x`` and ``y`` are one value of a column of type ``t`` to a shard:
    both null; floats by their bits, every NaN one value; else Arrow's equality."""
    if x is None or y is None:
        return x is None and y is None
    if pa.types.is_floating(t):
        if math.isnan(x) or math.isnan(y):
            return math.isnan(x) and math.isnan(y)
        fmt = "<f" if t.bit_width == 32 else "<d"
        return struct.pack(fmt, x) == struct.pack(fmt, y)
    return bool(arrow_array([x], t).equals(arrow_array([y], t)))


def _updates(v: pa.Array | pa.ChunkedArray, n: int) -> pa.Table:
    return pa.table(
        {
            "v": v,
            "_time": pa.array([0] * n, pa.int64()),
            "_diff": pa.array([1] * n, pa.int64()),
        }
    )


@st.composite
def _columns(draw: st.DrawFn) -> tuple[pa.DataType, list[Any], list[Any], list[Any], int, int]:
    t = draw(st.sampled_from(COLUMN_TYPES))
    values = draw(st.lists(column_values(t), min_size=1, max_size=8))
    # What lies under each null slot (and before the slice) in the other layout.
    under = [draw(column_values(t, nullable=False)) for _ in values]
    prefix = draw(st.lists(column_values(t), max_size=9))
    cut = draw(st.integers(0, len(values)))
    changed = draw(st.integers(0, len(values) - 1))
    return t, values, under, prefix, cut, changed


@settings(max_examples=60, deadline=None)
@given(_columns(), st.data())
def test_fingerprints_are_equal_exactly_for_equal_values(
    drawn: tuple[pa.DataType, list[Any], list[Any], list[Any], int, int], data: st.DataObject
) -> None:
    """Updates of equal values have equal fingerprints whatever their layout (a slice
    of a longer array, several chunks, other bytes under null slots, of every column
    type a shard holds); updates differing in any one value have different ones."""
    t, values, under, prefix, cut, i = drawn
    n = len(values)
    plain = arrow_array(values, t)
    fp = updates_fingerprint(E, N, _updates(plain, n))
    # The same values laid out otherwise: other bytes under the null slots, inside a
    # longer array (a slice at an offset, the parent's bits around it), in two chunks.
    filled = arrow_array(
        prefix + [u if v is None else v for v, u in zip(values, under, strict=True)], t
    )
    validity = arrow_array(prefix + values, t).buffers()[0]
    garbage = pa.Array.from_buffers(
        t, len(prefix) + n, [validity, *filled.buffers()[1:]], null_count=-1
    ).slice(len(prefix))
    assert garbage.equals(plain) or pa.types.is_floating(t)  # NaN != NaN to Arrow
    chunked = pa.chunked_array([garbage.slice(0, cut), garbage.slice(cut)], t)
    assert updates_fingerprint(E, N, _updates(garbage, n)) == fp
    assert updates_fingerprint(E, N, _updates(chunked, n)) == fp
    # One value otherwise (or null): another fingerprint.
    other = data.draw(column_values(t))
    changed = [*values[:i], other, *values[i + 1 :]]
    same = _same(values[i], other, t)
    assert (updates_fingerprint(E, N, _updates(arrow_array(changed, t), n)) == fp) == same


@settings(max_examples=60, deadline=None)
@given(_columns())
def test_few_row_path_matches_numpy_path(
    drawn: tuple[pa.DataType, list[Any], list[Any], list[Any], int, int],
) -> None:
    """The Python reading of a few values (NaN search, string offsets) gives the
    fingerprint numpy's reading gives, on slices of every column type a shard holds."""
    t, values, _, prefix, _, _ = drawn
    n = len(values)
    arr = arrow_array(prefix + values, t).slice(len(prefix))
    table = _updates(arr, n)
    few = updates_fingerprint(E, N, table)
    saved = fingerprint._FEW
    fingerprint._FEW = -1  # numpy for every size
    try:
        assert updates_fingerprint(E, N, table) == few
    finally:
        fingerprint._FEW = saved


def _golden() -> pa.Table:
    return pa.table(
        {
            "k": pa.array([3, None, 1], pa.int64()),
            "s": pa.array(["a", "", None], pa.string()),
            "b": pa.array([True, None, False], pa.bool_()),
            "f": pa.array([math.nan, -0.0, 1.5], pa.float64()),
            "g": pa.array([1.0, None, -math.nan], pa.float32()),
            "l": pa.array([b"x", b"yz", None], pa.large_binary()),
            "d": pa.array([1, 2, 3], pa.timestamp("us", "UTC")),
            "_time": pa.array([5, 5, 6], pa.int64()),
            "_diff": pa.array([1, -1, 2], pa.int64()),
        }
    )


def test_fingerprints_recorded_by_the_sha256_format_stay_the_same() -> None:
    """The ``V`` fingerprints shards recorded before the ``X`` form (SHA-256) are still
    computed the same way: a retry of an append recorded before an upgrade is checked
    against them.  The expected values were computed by the version that introduced
    the ``V`` form."""
    t = _golden()
    e, n = Antichain.from_elem(5), Antichain.from_elem(7)
    assert updates_fingerprint(e, n, t, "V") == "V5b03bbe288949efb7620915b11529342"
    assert updates_fingerprint(e, n, t.slice(1, 1), "V") == "Vbf518e93b31489118678bee2b80d71a6"
    assert updates_fingerprint(e, n, t.slice(0, 0), "V") == "Vf885bf241f8862ce0af1d425559fb953"


def test_fingerprints_recorded_by_this_format_stay_the_same() -> None:
    """The fingerprints this version records (``X`` and 32 hex digits, XXH3-128) are
    computed the same way by later ones: a retry after an upgrade is still recognised.
    The expected values were computed by the version that introduced the ``X`` form
    (and ``test_both_versions_hash_the_same_stream`` ties them to the ``V`` ones)."""
    t = _golden()
    e, n = Antichain.from_elem(5), Antichain.from_elem(7)
    assert updates_fingerprint(e, n, t) == "X53061438bba95049c2d6b026d73bb146"
    assert updates_fingerprint(e, n, t.slice(1, 1)) == "X5606dcce7bdb53656110584b716f88fa"
    assert updates_fingerprint(e, n, t.slice(0, 0)) == "X7940bfa5191a94b68658c7b2054558d7"


def _many_rows(n: int = 5000) -> pa.Table:
    """Updates of every kind of column, with nulls, NaNs and signed zeros, long enough
    for the numpy reading of every column and for an append's background fingerprint."""
    i = np.arange(n)
    return pa.table(
        {
            "k": pa.array(np.where(i % 7 == 0, None, i * 3 - 4000).tolist(), pa.int64()),
            "s": pa.array(
                [None if j % 11 == 0 else f"s{j % 97}" * (j % 5) for j in range(n)], pa.string()
            ),
            "b": pa.array([None if j % 13 == 0 else j % 3 == 0 for j in range(n)], pa.bool_()),
            "f": pa.array(
                [math.nan if j % 17 == 0 else (-0.0 if j % 19 == 0 else j / 8) for j in range(n)],
                pa.float64(),
            ),
            "g": pa.array(
                [
                    None if j % 5 == 0 else (-math.nan if j % 23 == 0 else j * 0.25)
                    for j in range(n)
                ],
                pa.float32(),
            ),
            "l": pa.array(
                [None if j % 29 == 0 else bytes([j % 256]) * (j % 4) for j in range(n)],
                pa.large_binary(),
            ),
            "d": pa.array(i * 1000, pa.timestamp("us", "UTC")),
            "_time": pa.array(5 + i % 2, pa.int64()),
            "_diff": pa.array(1 - 2 * (i % 3 == 0), pa.int64()),
        }
    )


@pytest.mark.parametrize(
    ("version", "whole", "part"),
    [
        # Computed by the version that introduced the ``V`` form.
        ("V", "V55bf2cab7131492d89a145d79b84703a", "V5cafdbb77ec3fb207e9dbe0bc93bd549"),
        # Computed by the version that introduced the ``X`` form.
        ("X", "Xc1fd6f9827ebef05e73fd36962843b39", "X7d3f8d18b8c531e03a1aba5af2ca25ba"),
    ],
)
def test_fingerprints_of_many_rows_stay_the_same(version: str, whole: str, part: str) -> None:
    """The numpy reading of the columns (more than ``_FEW`` rows) gives the fingerprints
    recorded before, in either version."""
    t = _many_rows()
    e, n = Antichain.from_elem(5), Antichain.from_elem(7)
    assert updates_fingerprint(e, n, t, version) == whole
    assert updates_fingerprint(e, n, t.slice(1000, 3000), version) == part
    chunked = pa.concat_tables([t.slice(0, 1234), t.slice(1234)])
    assert updates_fingerprint(e, n, chunked, version) == whole


def _recorded(c: PersistClient, shard: str) -> list[str]:
    """The landed records (``token + TOKEN_SEP + fingerprint``) of a shard's state."""
    return [rec.entry for rec in c.inspect(shard).landed.values()]


_MANY_KS = pa.schema([("k", pa.int64()), ("s", pa.string())])
_MANY_VS = pa.schema(
    [
        ("b", pa.bool_()),
        ("f", pa.float64()),
        ("g", pa.float32()),
        ("l", pa.large_binary()),
        ("d", pa.timestamp("us", "UTC")),
    ]
)


def test_large_append_records_its_fingerprint_and_its_token_names_it(tmp_path: Path) -> None:
    """An append of many rows (fingerprinted in the background while its parts are
    written) records the fingerprint of its updates; a retry with its token and equal
    updates writes nothing, one with other updates is refused."""
    t = _many_rows().select([*_MANY_KS.names, *_MANY_VS.names, "_time", "_diff"])
    assert t.num_rows >= write_module._BACKGROUND_FINGERPRINT_ROWS
    s = Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False)
    c = PersistClient(s, FileBlob(tmp_path / "blob"), compaction="off")
    try:
        w, r = c.open("many", _MANY_KS, _MANY_VS)
        w.compare_and_append(t, 0, 7, idempotency_token="bulk-job-1")
        want = updates_fingerprint(Antichain.from_elem(0), Antichain.from_elem(7), w._normalize(t))
        recorded = {
            x.split(TOKEN_SEP)[1] for x in _recorded(c, "many") if x.startswith("bulk-job-1")
        }
        assert recorded == {want}
        # A fresh token (no retry): recorded with the same fingerprint.
        t2 = t.set_column(
            t.schema.get_field_index("_time"), "_time", pa.array([7] * t.num_rows, pa.int64())
        )
        w.compare_and_append(t2, 7, 8)
        want2 = updates_fingerprint(
            Antichain.from_elem(7), Antichain.from_elem(8), w._normalize(t2)
        )
        assert any(x.endswith(TOKEN_SEP + want2) for x in _recorded(c, "many"))
        rows = sum(r.snapshot(7).column("_diff").to_pylist())
        w.compare_and_append(t.slice(0, t.num_rows), 0, 7, idempotency_token="bulk-job-1")
        assert sum(r.snapshot(7).column("_diff").to_pylist()) == rows
        with pytest.raises(InvalidUsage, match="different append"):
            w.compare_and_append(t.slice(1), 0, 7, idempotency_token="bulk-job-1")
    finally:
        c.close()
        s.close()


def test_large_append_whose_fingerprint_fails_commits_nothing_and_leaves_no_part(
    tmp_path: Path, monkeypatch: Any
) -> None:
    def broken(*args: Any) -> str:
        raise RuntimeError("fingerprint failed")

    t = _many_rows().select([*_MANY_KS.names, *_MANY_VS.names, "_time", "_diff"])
    s = Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False)
    blob_dir = tmp_path / "blob"
    c = PersistClient(s, FileBlob(blob_dir), compaction="off")
    try:
        w, _r = c.open("many", _MANY_KS, _MANY_VS)
        monkeypatch.setattr(write_module, "updates_fingerprint", broken)
        with pytest.raises(RuntimeError, match="fingerprint failed"):
            w.compare_and_append(t, 0, 7)
        assert w.fetch_recent_upper() == Antichain.from_elem(0)
        assert list(blob_dir.rglob("*.parquet")) == []
    finally:
        c.close()
        s.close()


def test_large_append_of_unknown_outcome_is_recognised_by_its_retry() -> None:
    """The fingerprint hashed in the background by a large append whose commit landed
    unacknowledged is the one its retry computes in the caller's thread: the retry
    writes nothing again; the token on other updates is refused."""
    inner = Stash.open("memory://", fenced=False)
    flaky = AckLostStash(inner)
    blob = MemoryBlob()
    c = PersistClient(
        flaky,  # type: ignore[arg-type]
        blob,
        compaction="off",
        consensus_retries=1,
        inline_max_bytes=0,
    )
    try:
        w, r = c.open("many", _MANY_KS, _MANY_VS)
        w.resolve_max_wait = 0.001
        w.resolve_attempts = 2
        w.heartbeat()  # registered: the lost acknowledgement is the append's own commit
        t = _many_rows().select([*_MANY_KS.names, *_MANY_VS.names, "_time", "_diff"])
        flaky.arm(reads=50)  # consensus stays unreadable longer than the append tries
        with pytest.raises(ConsensusError) as e:
            w.compare_and_append(t, 0, 7)
        token = e.value.idempotency_token
        assert e.value.is_indeterminate() and token
        flaky.reads_to_fail = 0
        sets = blob.metrics.snapshot().sets
        w.compare_and_append(t, 0, 7, idempotency_token=token)  # landed: nothing again
        with pytest.raises(InvalidUsage, match="names a different append"):
            w.compare_and_append(t.slice(1), 0, 7, idempotency_token=token)
        assert blob.metrics.snapshot().sets == sets
        assert w.fetch_recent_upper() == Antichain.from_elem(7)
        diffs = t.column("_diff").to_pylist()
        assert sum(r.snapshot(6).column("_diff").to_pylist()) == sum(diffs)  # written once
    finally:
        c.close()
        inner.close()


def test_column_kinds_follow_each_schema() -> None:
    """The reading of each column is looked up once per schema (by its names and
    types): tables of schemas differing only in a column's type (same bytes under it)
    get different fingerprints, each the one computed without the lookup, and a type a
    shard does not hold is refused every time."""
    from persist import fingerprint

    ints = pa.table({"k": pa.array([1, 2], pa.int64()), "_time": [0, 0], "_diff": [1, 1]})
    stamps = ints.set_column(0, "k", ints.column("k").cast(pa.timestamp("us")))
    fps = set()
    for t in (ints, stamps, ints, stamps):
        fp = updates_fingerprint(E, N, t)
        fingerprint._KINDS, fingerprint._LAST_SCHEMA = {}, None  # the lookup made again
        assert updates_fingerprint(E, N, t) == fp
        fps.add(fp)
    assert len(fps) == 2
    nested = pa.table({"k": pa.array([[1]], pa.list_(pa.int64())), "_time": [0], "_diff": [1]})
    for _ in range(2):
        with pytest.raises(TypeError, match="list<item: int64>"):
            updates_fingerprint(E, N, nested)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=80), st.integers(0, 40), st.integers(0, 40))
def test_validity_bytes_are_those_of_is_valid(valid: list[bool], start: int, cut: int) -> None:
    """The validity bytes hashed for a column with nulls (unpacked from its bitmap by
    numpy) are those of ``pyarrow.compute.is_valid`` as numpy booleans, for slices at
    any bit offset."""
    arr = pa.array([i if v else None for i, v in enumerate(valid)], pa.int64())
    arr = arr.slice(min(start, len(valid) - 1), cut)
    if arr.null_count == 0:
        return
    want = pc.is_valid(arr).to_numpy(zero_copy_only=False).tobytes()
    assert fingerprint._validity_bytes(arr) == want


def test_column_kinds_of_schemas_with_the_same_text_are_each_their_own() -> None:
    """Column names are data: a name may hold a newline and ``": "``, so two schemas of
    different column types can print the same text (``p: int64\\nq: string\\nr: int64``
    is both ``p``, ``q: string\\nr`` of int64 and ``p: int64\\nq`` of string, ``r``).
    Each table's fingerprint is the one computed without any lookup made before: the
    string column is hashed as strings even after the other schema was seen (the lookup
    by the text alone hashed its offsets as 8-byte integers)."""
    from persist import fingerprint

    ints = pa.table(
        {
            "p": pa.array([1, 2], pa.int64()),
            "q: string\nr": pa.array([3, 4], pa.int64()),
            "_time": pa.array([0, 0], pa.int64()),
            "_diff": pa.array([1, 1], pa.int64()),
        }
    )
    strs = pa.table(
        {
            "p: int64\nq": pa.array(["a", "bc"], pa.string()),
            "r": pa.array([3, 4], pa.int64()),
            "_time": pa.array([0, 0], pa.int64()),
            "_diff": pa.array([1, 1], pa.int64()),
        }
    )
    fresh = {}
    for t in (ints, strs):
        fingerprint._KINDS, fingerprint._LAST_SCHEMA = {}, None
        fresh[t.column_names[0]] = updates_fingerprint(E, N, t)
    for first, then in ((ints, strs), (strs, ints)):
        fingerprint._KINDS, fingerprint._LAST_SCHEMA = {}, None
        updates_fingerprint(E, N, first)
        assert updates_fingerprint(E, N, then) == fresh[then.column_names[0]]


def test_the_last_schema_is_taken_again_only_when_equal() -> None:
    """The text and kinds of the last schema seen are reused for an equal schema (its
    metadata aside, which the text does not print), never for one differing in a type
    or a column's nullability (which it prints): each fingerprint is the one computed
    with nothing seen before."""
    from persist import fingerprint

    t = _golden()
    tagged = t.replace_schema_metadata({"origin": "elsewhere"})
    strict = t.cast(
        pa.schema([f.with_nullable(False) if f.name == "_time" else f for f in t.schema])
    )
    stamps = t.set_column(0, "k", t.column("k").cast(pa.timestamp("us")))
    fresh = {}
    for name, table in (("t", t), ("tagged", tagged), ("strict", strict), ("stamps", stamps)):
        fingerprint._KINDS, fingerprint._LAST_SCHEMA = {}, None
        fresh[name] = updates_fingerprint(E, N, table)
    assert fresh["t"] == fresh["tagged"]
    assert len({fresh["t"], fresh["strict"], fresh["stamps"]}) == 3
    order = ["t", "tagged", "t", "strict", "strict", "stamps", "t", "stamps"]
    tables = {"t": t, "tagged": tagged, "strict": strict, "stamps": stamps}
    for name in order:
        assert updates_fingerprint(E, N, tables[name]) == fresh[name]
