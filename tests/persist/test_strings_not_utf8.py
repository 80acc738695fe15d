"""Protects: updates whose string column holds bytes that are not UTF-8 are refused
with an error naming the column and the row, and nothing is written.

Arrow does not check the bytes of a string array it did not build itself
(``Array.from_buffers``, IPC or Parquet written elsewhere).  Such updates were taken
when kept inline (and read back as values no Python, Spark or DuckDB string holds),
failed with ``UnicodeDecodeError`` from a part's statistics when written to blob parts,
and, between 2 and 32 rows, from the few-row consolidation path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from persist import FileBlob, InvalidUsage, PersistClient
from stash import Stash

KS = pa.schema([("k", pa.int64())])
VS = pa.schema([("v", pa.string()), ("w", pa.large_string())])


def _strings(values: list[bytes], t: pa.DataType) -> pa.Array:
    width = np.int64 if t == pa.large_string() else np.int32
    offsets = np.cumsum([0, *map(len, values)]).astype(width)
    return pa.Array.from_buffers(
        t, len(values), [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"".join(values))]
    )


def _updates(n: int, bad_row: int, column: str) -> pa.Table:
    good = ["é€😀", "a", ""]
    vals = {c: [good[i % 3].encode() for i in range(n)] for c in ("v", "w")}
    vals[column][bad_row] = b"ok\xff"
    return pa.table(
        {
            "k": pa.array(range(n), pa.int64()),
            "v": _strings(vals["v"], pa.string()),
            "w": _strings(vals["w"], pa.large_string()),
            "_time": pa.array([0] * n, pa.int64()),
            "_diff": pa.array([1] * n, pa.int64()),
        }
    )


@pytest.mark.parametrize(
    ("n", "inline", "column", "reorder"),
    [
        (1, True, "v", False),
        (5, True, "w", False),
        (5, False, "v", True),  # columns in another order: to_updates_table's path
        (300, False, "w", False),
    ],
)
def test_strings_that_are_not_utf8_are_refused_and_nothing_is_written(
    tmp_path: Path, n: int, inline: bool, column: str, reorder: bool
) -> None:
    with Stash.open(f"sqlite:///{tmp_path / 's.db'}", fenced=False) as s:
        c = PersistClient(
            s, FileBlob(tmp_path / "blob"), inline_max_bytes=(1 << 20) if inline else 0
        )
        try:
            w = c.open_writer("x", KS, VS)
            bad_row = n // 2
            t = _updates(n, bad_row, column)
            if reorder:
                t = t.select(["_diff", "w", "v", "k", "_time"])
            with pytest.raises(
                InvalidUsage, match=rf"column '{column}' .* not UTF-8 at row {bad_row}"
            ):
                w.compare_and_append(t, 0, 1)
            assert c.inspect("x").upper.as_option() == 0
            assert not list((tmp_path / "blob").rglob("*.parquet"))  # no part left
            good = t.set_column(
                t.schema.get_field_index(column),
                column,
                pa.array(["fine"] * n, t.schema.field(column).type),
            )
            w.compare_and_append(good, 0, 1)  # valid UTF-8, non-ASCII included
            r = c.open_reader("x", KS, VS)
            got = r.snapshot(0)
            other = "w" if column == "v" else "v"
            assert sorted(got.column(other).to_pylist()) == sorted(good.column(other).to_pylist())
        finally:
            c.close()


def test_a_part_holding_strings_that_are_not_utf8_has_no_string_statistics() -> None:
    """Parts written before such strings were refused are still merged by compaction:
    their string columns' least or greatest value that is not UTF-8 gives no statistics
    (no pruning) rather than failing the merge's part writing with UnicodeDecodeError."""
    from persist.stats import column_stats, table_stats

    col = _strings([b"\xff", b"a", b"b"], pa.string())
    assert column_stats("v", col) is None
    assert column_stats("w", _strings([b"a", b"\xfe"], pa.large_string())) is None
    assert [s[0] for s in table_stats(pa.table({"v": col, "k": [1, 2, 3]}))] == ["k"]


@pytest.mark.parametrize("inline", [False, True])
def test_parts_keyed_by_strings_that_are_not_utf8_are_written_without_samples(
    inline: bool,
) -> None:
    """Compaction rewrites the rows of such older parts (``write_parts`` takes what it
    is given): a part whose key strings are not UTF-8 is written, and read back,
    without key samples (key-range reads treat it as one range) instead of failing
    with UnicodeDecodeError; so is an inline part's sampling when a plan asks for it."""
    from persist import MemoryBlob
    from persist.merge import part_key_samples
    from persist.parts import read_parts, write_parts

    n = 200
    t = pa.table(
        {
            "k": _strings([b"a\xff%03d" % i for i in range(n)], pa.string()),
            "_time": pa.array([0] * n, pa.int64()),
            "_diff": pa.array([1] * n, pa.int64()),
        }
    )
    blob = MemoryBlob()
    refs = write_parts(blob, t, "s/b", inline_max_bytes=(1 << 20) if inline else 0, key_names=["k"])
    assert [r.key_samples for r in refs] == [None]
    assert part_key_samples(refs[0], ["k"], t.schema) is None
    assert (
        read_parts(blob, refs).column("k").cast(pa.binary()).equals(t.column("k").cast(pa.binary()))
    )
