"""The ``stash`` Spark source reads a collection's consolidated contents at its peek time."""

from __future__ import annotations

from typing import Any

import pytest

from stash import Antichain, Stash

pytestmark = pytest.mark.spark


@pytest.fixture
def catalog(spark_store: Any) -> str:
    """A SQLite stash with a few collections, closed again before Spark reads it."""
    url = spark_store.stash_url
    with Stash.open(url, fenced=False) as s:
        airlines = s.collection("airlines")
        b = airlines.make_batch(s)
        for code, name in [("9E", "Endeavor Air Inc."), ("AA", "American Airlines Inc.")]:
            airlines.append_to_batch(b, {"carrier": code}, {"name": name, "fleet": None}, 1)
        s.append([b])
        # A later correction at time 1: AA renamed, i.e. retract + insert.
        b = airlines.make_batch(s)
        airlines.append_to_batch(
            b, {"carrier": "AA"}, {"name": "American Airlines Inc.", "fleet": None}, -1
        )
        airlines.append_to_batch(b, {"carrier": "AA"}, {"name": "American", "fleet": 900}, 1)
        s.append([b])

        counters = s.collection("counters", key="str", value="int")
        s.update_many(counters, [(("a", 1), 0, 2), (("b", 7), 0, 1), (("c", 3), 1, 1)])
        s.seal(counters, Antichain.from_elem(5))

        weird = s.collection("weird")
        s.update_many(weird, [(("x", [1, 2]), 0, 1), (("y", {"deep": True}), 0, -1)])
        s.seal(weird, Antichain.from_elem(1))

        s.collection("empty")
    return url


def _rows(df: Any) -> list[tuple[Any, ...]]:
    return sorted(tuple(r) for r in df.collect())


def test_json_dicts_become_columns_at_peek_time(spark: Any, catalog: str) -> None:
    df = spark.read.format("stash").option("url", catalog).load("airlines")
    assert df.columns == ["carrier", "fleet", "name"]
    assert dict(df.dtypes) == {"carrier": "string", "fleet": "bigint", "name": "string"}
    assert _rows(df) == [("9E", None, "Endeavor Air Inc."), ("AA", 900, "American")]


def test_time_and_diff_columns_on_request(spark: Any, catalog: str) -> None:
    df = (
        spark.read.format("stash")
        .option("url", catalog)
        .option("time_column", "time")
        .option("diff_column", "diff")
        .load("counters")
    )
    assert df.columns == ["key", "value", "time", "diff"]
    # Peek time is upper - 1 = 4; multiplicity 2 is a diff, not two rows.
    assert _rows(df) == [("a", 1, 4, 2), ("b", 7, 4, 1), ("c", 3, 4, 1)]


def test_multiplicity_repeats_rows_without_diff_column(spark: Any, catalog: str) -> None:
    df = spark.read.format("stash").option("url", catalog).load("counters")
    assert _rows(df) == [("a", 1), ("a", 1), ("b", 7), ("c", 3)]


def test_user_schema_selects_and_casts(spark: Any, catalog: str) -> None:
    df = (
        spark.read.format("stash")
        .schema("carrier string, name string, fleet int")
        .option("url", catalog)
        .load("airlines")
    )
    assert dict(df.dtypes) == {"carrier": "string", "name": "string", "fleet": "int"}
    assert _rows(df) == [("9E", "Endeavor Air Inc.", None), ("AA", "American", 900)]
    df2 = (
        spark.read.format("stash")
        .option("url", catalog)
        .option("schema", "carrier string")
        .load("airlines")
    )
    assert _rows(df2) == [("9E",), ("AA",)]


def test_negative_multiplicity_is_an_error_unless_diffs_are_asked(spark: Any, catalog: str) -> None:
    reader = spark.read.format("stash").option("url", catalog)
    with pytest.raises(Exception, match="negative multiplicity"):
        reader.load("weird").collect()
    df = reader.option("diff_column", "diff").load("weird")
    # A list value is JSON text in ``value``; a dict value spreads into its fields.
    assert df.columns == ["key", "value", "deep", "diff"]
    assert _rows(df) == [("x", "[1,2]", None, 1), ("y", None, True, -1)]


def test_flatten_false_keeps_json_text(spark: Any, catalog: str) -> None:
    df = (
        spark.read.format("stash")
        .option("url", catalog)
        .option("flatten", "false")
        .load("airlines")
    )
    assert df.columns == ["key", "value"]
    assert ('{"carrier":"AA"}', '{"fleet":900,"name":"American"}') in _rows(df)


def test_empty_and_missing_collections(spark: Any, catalog: str) -> None:
    reader = spark.read.format("stash").option("url", catalog)
    assert reader.load("empty").count() == 0
    with pytest.raises(Exception, match="does not exist"):
        reader.load("nope").collect()
    with pytest.raises(Exception, match="option\\('url'"):
        spark.read.format("stash").load("airlines").collect()


# ------------------------------------------------------------- layout, types, options
@pytest.fixture
def tricky(spark_store: Any) -> str:
    """Collections whose key and value fields share names, and mixed JSON types."""
    url = spark_store.stash_url
    with Stash.open(url, fenced=False) as s:
        settings = s.collection("settings")
        s.update_many(settings, [(("retention", {"key": "abc", "n": 1}), 0, 1)])
        s.seal(settings, Antichain.from_elem(1))

        crossed = s.collection("crossed")
        s.update_many(
            crossed,
            [(({"a": 1}, {"b": 99}), 0, 1), (({"c": 2}, {"a": 5}), 0, 1)],
        )
        s.seal(crossed, Antichain.from_elem(1))

        mixed = s.collection("mixed")
        s.update_many(
            mixed,
            [
                (("i", {"x": 1, "big": 2**60, "huge": 2**70}), 0, 1),
                (("s", {"x": "1", "big": 1.5, "huge": 0.5}), 0, 1),
            ],
        )
        s.seal(mixed, Antichain.from_elem(1))

        huge = s.collection("huge")
        s.update_many(huge, [(("h", {"n": 2**70}), 0, 1), (("l", {"n": 5}), 0, 1)])
        s.seal(huge, Antichain.from_elem(1))
    return url


def test_a_value_field_never_takes_the_place_of_the_key(spark: Any, tricky: str) -> None:
    df = spark.read.format("stash").option("url", tricky).load("settings")
    assert df.columns == ["key", "value_key", "n"]
    assert _rows(df) == [("retention", "abc", 1)]


def test_key_columns_read_only_keys(spark: Any, tricky: str) -> None:
    df = spark.read.format("stash").option("url", tricky).load("crossed")
    assert df.columns == ["a", "c", "b", "value_a"]
    got = sorted((tuple(r) for r in df.collect()), key=str)
    assert got == sorted([(1, None, 99, None), (None, 2, None, 5)], key=str)


def test_mixed_json_types_read_exactly(spark: Any, tricky: str) -> None:
    df = spark.read.format("stash").option("url", tricky).load("mixed")
    assert dict(df.dtypes) == {"key": "string", "x": "string", "big": "string", "huge": "string"}
    rows = {r["key"]: r for r in df.collect()}
    # An int and a string stay apart (JSON text), and no integer is rounded.
    assert (rows["i"]["x"], rows["s"]["x"]) == ("1", '"1"')
    assert (rows["i"]["big"], rows["s"]["big"]) == (str(2**60), "1.5")
    assert (rows["i"]["huge"], rows["s"]["huge"]) == (str(2**70), "0.5")
    assert df.schema["x"].metadata == {"stash.json": True}


def test_integers_beyond_64_bits_are_exact_or_a_named_error(spark: Any, tricky: str) -> None:
    from decimal import Decimal

    df = spark.read.format("stash").option("url", tricky).load("huge")
    assert dict(df.dtypes)["n"] == "decimal(38,0)"
    assert sorted(r["n"] for r in df.collect()) == [Decimal(5), Decimal(2**70)]
    forced = spark.read.format("stash").schema("key string, n bigint").option("url", tricky)
    with pytest.raises(Exception, match=r"column 'n'.*1180591620717411303424.*bigint"):
        forced.load("huge").collect()


def test_stash_source_options_are_checked(spark: Any, catalog: str) -> None:
    # ``stash`` is another name for ``url`` (the persist source's name for it).
    df = spark.read.format("stash").option("stash", catalog).load("counters")
    assert _rows(df) == [("a", 1), ("a", 1), ("b", 7), ("c", 3)]
    reader = spark.read.format("stash").option("url", catalog)
    with pytest.raises(Exception, match=r"'diff_colum'.*did you mean 'diff_column'"):
        reader.option("diff_colum", "d").load("counters").collect()
    with pytest.raises(Exception, match=r"flatten.*must be true or false"):
        spark.read.format("stash").option("url", catalog).option("flatten", "ture").load(
            "airlines"
        ).collect()


def test_names_differing_only_in_case_never_collide(spark: Any, spark_store: Any) -> None:
    """Spark resolves column names ignoring case (``spark.sql.caseSensitive`` is false
    by default): a key field ``id`` and a value field ``ID`` made two columns no query
    could select (``AMBIGUOUS_REFERENCE``); the value column is now prefixed.  A time or
    diff column named like a field in another case is refused like an exact clash."""
    url = spark_store.stash_url
    with Stash.open(url, fenced=False) as s:
        c = s.collection("case")
        s.update_many(c, [(({"id": 1, "k": 5}, {"ID": 2}), 0, 1)])
        s.seal(c, Antichain.from_elem(5))
    df = spark.read.format("stash").option("url", url).load("case")
    assert sorted(df.columns) == ["id", "k", "value_ID"]
    assert [tuple(r) for r in df.select("id", "value_ID").collect()] == [(1, 2)]
    with pytest.raises(Exception, match="already names a key or value field"):
        spark.read.format("stash").option("url", url).option("diff_column", "K").load(
            "case"
        ).collect()
