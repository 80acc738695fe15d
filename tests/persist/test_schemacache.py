"""persist.schemacache: caches keyed by schemas tell them apart by their metadata."""

from __future__ import annotations

import pyarrow as pa

from persist.schemacache import exactly_equal, schema_cache
from persist.updates import SchemaHistory

PLAIN = pa.schema([pa.field("k", pa.int64())])
FIELD_META = pa.schema([pa.field("k", pa.int64(), metadata={b"unit": b"m"})])
SCHEMA_META = pa.schema([pa.field("k", pa.int64())], metadata={b"owner": b"x"})


def test_schemas_differing_only_in_metadata_get_their_own_results() -> None:
    calls: list[pa.Schema] = []

    @schema_cache(8)
    def f(s: pa.Schema, pair: tuple[pa.Schema, ...], n: int) -> pa.Schema:
        calls.append(s)
        return s

    assert PLAIN == FIELD_META  # pyarrow's own == ignores metadata: why the cache exists
    for s in (PLAIN, FIELD_META, SCHEMA_META):
        assert f(s, (s,), 1).equals(s, check_metadata=True)
    assert len(calls) == 3
    # An equal schema (metadata included) made anew is a hit.
    again = pa.schema([pa.field("k", pa.int64(), metadata={b"unit": b"m"})])
    assert f(again, (again,), 1) is FIELD_META and len(calls) == 3
    # A tuple differing in one element's metadata is a miss.
    f(PLAIN, (FIELD_META,), 1)
    assert len(calls) == 4
    f.cache_clear()  # type: ignore[attr-defined]
    f(PLAIN, (PLAIN,), 1)
    assert len(calls) == 5


def test_exactly_equal_and_schema_history_see_metadata() -> None:
    assert exactly_equal((PLAIN, 1), (PLAIN, 1))
    assert not exactly_equal((PLAIN,), (FIELD_META,))
    assert not exactly_equal(PLAIN, SCHEMA_META)
    assert SchemaHistory(PLAIN, [PLAIN]) == SchemaHistory(PLAIN, [PLAIN])
    assert SchemaHistory(PLAIN, [PLAIN]) != SchemaHistory(FIELD_META, [PLAIN])
    assert SchemaHistory(PLAIN, [PLAIN]) != SchemaHistory(PLAIN, [SCHEMA_META])
