"""Record value types evolve additively without a migration (fields with defaults added
or removed; unknown fields ignored), on every backend: a rolling deploy where the old
and the new release read and write one collection.  Any other change still needs
``TypedCollection.migrate``; collections recorded under the old-style codec name
(``record:module.Qualname``) keep opening."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest

from stash import StashError, TypedCollection
from stash.codec import JsonCodec, RecordCodec, resolve_codec
from tests.stash.conftest import OpenStash


@dataclass(frozen=True)
class TableOld:
    """The value type of the old release."""

    __stash_name__ = "catalog.Table"
    name: str
    owner: str = ""
    retired: bool = False  # the new release drops it


@dataclass(frozen=True)
class TableNew:
    """The new release: gained ``description``, lost ``retired`` (both defaulted)."""

    __stash_name__ = "catalog.Table"
    name: str
    owner: str = ""
    description: str = ""


@dataclass(frozen=True)
class TableNeedsSchema:
    """Gained a field without a default: a migration."""

    __stash_name__ = "catalog.Table"
    name: str
    schema: str


def test_the_identity_is_the_name_and_the_required_fields() -> None:
    old, new = resolve_codec(TableOld), resolve_codec(TableNew)
    assert str(old.name) == str(new.name) == "record:catalog.Table(name)"
    assert resolve_codec(TableNeedsSchema).name == "record:catalog.Table(name,schema)"
    assert RecordCodec(TableNew, name="v2.Table").name == "record:v2.Table(name)"
    with pytest.raises(StashError, match="record codec name 'a b'"):
        RecordCodec(TableNew, name="a b")
    with pytest.raises(StashError, match="names no importable type"):
        resolve_codec("record:catalog.Table(name)")


def test_rolling_deploy_old_and_new_read_each_others_rows(open_stash: OpenStash) -> None:
    a, b = open_stash(), open_stash()  # a runs the old release, b the new one
    old: TypedCollection[str, TableOld] = TypedCollection("tables", "str", TableOld)
    new: TypedCollection[str, TableNew] = TypedCollection("tables", "str", TableNew)
    old.upsert(a, [("t1", TableOld("t1", "ada", retired=True)), ("t2", TableOld("t2"))])
    # The new release reads the old rows: the added field takes its default, the
    # dropped one is ignored.
    assert new.peek_one(b) == {"t1": TableNew("t1", "ada"), "t2": TableNew("t2")}
    new.upsert_key(b, "t3", TableNew("t3", "bob", "orders"))
    new.upsert_key(b, "t1", TableNew("t1", "ada", "renamed"))  # retracts an old row
    # The old release reads the new rows (ignoring ``description``)...
    assert old.peek_one(a) == {
        "t1": TableOld("t1", "ada"),
        "t2": TableOld("t2"),
        "t3": TableOld("t3", "bob"),
    }
    # ...and overwrites one: the retraction is of the stored row, so each key keeps
    # exactly one value on both sides.
    old.upsert_key(a, "t3", TableOld("t3", "cy"))
    assert old.insert_without_overwrite(a, "t1", TableOld("t1", "zed")) == TableOld("t1", "ada")
    assert new.peek_one(b)["t3"] == TableNew("t3", "cy")
    assert len(b.peek(new.get(b))) == 3  # one value per key, multiplicity 1
    # The new release rewriting an old row stores its own encoding (a change of the
    # stored text); writing the same again writes nothing.
    c = new.get(b)
    new.upsert_key(b, "t3", TableNew("t3", "cy"))
    upper = b.upper(c)
    new.upsert_key(b, "t3", TableNew("t3", "cy"))
    assert b.upper(c) == upper


def test_other_changes_still_need_a_migration(open_stash: OpenStash) -> None:
    s = open_stash()
    old: TypedCollection[str, TableOld] = TypedCollection("tables", "str", TableOld)
    old.upsert(s, [("t1", TableOld("t1", "ada"))])
    needs: TypedCollection[str, Any] = TypedCollection("tables", "str", TableNeedsSchema)
    with pytest.raises(StashError, match=r"created with codecs .*record:catalog\.Table\(name\)"):
        needs.peek_one(s)
    with pytest.raises(StashError, match=r"created with codecs"):
        needs.upsert_key(s, "t2", TableNeedsSchema("t2", "public"))
    migrated = old.migrate(
        s, "str", TableNeedsSchema, lambda k, v: (k, TableNeedsSchema(v.name, "public"))
    )
    assert migrated.peek_one(s) == {"t1": TableNeedsSchema("t1", "public")}
    with pytest.raises(StashError, match="now has codecs|created with codecs"):
        old.peek_one(s)


def test_a_row_lacking_a_field_without_default_names_the_field() -> None:
    with pytest.raises(StashError, match=r"lacks the fields \['schema'\].*migration"):
        RecordCodec(TableNeedsSchema).decode('{"name":"t1"}')


class LegacyPoint(NamedTuple):
    x: int
    y: int = 0


def test_collections_recorded_under_the_old_style_name_keep_opening(
    open_stash: OpenStash,
) -> None:
    s = open_stash()
    legacy_name = f"record:{__name__}.LegacyPoint"

    class Legacy(JsonCodec):  # what an earlier release recorded for LegacyPoint
        name = legacy_name

    c = s.collection("points", key="str", value=Legacy())
    batch = c.make_batch(s)
    c.append_to_batch(batch, "p", {"x": 1, "y": 2}, 1)
    s.append([batch])
    tc: TypedCollection[str, LegacyPoint] = TypedCollection("points", "str", LegacyPoint)
    assert tc.peek_one(s) == {"p": LegacyPoint(1, 2)}
    tc.upsert_key(s, "q", LegacyPoint(3))
    assert tc.peek_one(open_stash()) == {"p": LegacyPoint(1, 2), "q": LegacyPoint(3, 0)}
    # Listed with the record codec the old name imports.
    listed = s.collections()["points"]
    assert listed.value_codec.cls is LegacyPoint
    assert s.peek_one(listed) == {"p": LegacyPoint(1, 2), "q": LegacyPoint(3, 0)}


def test_retracting_a_record_read_from_an_old_row_retracts_the_stored_row(
    open_stash: OpenStash,
) -> None:
    """A record read from an evolved row encodes as the row it was read from while it is
    unchanged, so a retraction built from it (what a table transaction's commit
    appends) cancels the stored row instead of leaving a -1 beside it."""
    s = open_stash()
    TypedCollection("tables", "str", TableOld).upsert(
        s, [("t1", TableOld("t1", "ada")), ("t2", TableOld("t2", "bob"))]
    )
    new: TypedCollection[str, TableNew] = TypedCollection("tables", "str", TableNew)
    c = new.get(s)
    prev = new.peek_one(s)["t1"]
    batch = c.make_batch(s)
    c.append_to_batch(batch, "t1", prev, -1)
    c.append_to_batch(batch, "t1", TableNew("t1", "ada", "orders"), 1)
    s.append([batch])
    assert new.peek_one(s)["t1"] == TableNew("t1", "ada", "orders")
    # Through a table transaction and its pending changes.
    t = new.table(s)
    t.update(lambda k, v: TableNew(v.name, "cy", v.description) if k == "t2" else None)
    batch = c.make_batch(s)
    for k, v, d in t.pending():
        c.append_to_batch(batch, k, v, d)
    s.append([batch])
    assert new.peek_one(s) == {"t1": TableNew("t1", "ada", "orders"), "t2": TableNew("t2", "cy")}
    assert all(d == 1 for _, _, d in s.peek(c))


@dataclass
class Mutable:
    name: str
    tags: list[str] | None = None


def test_a_changed_record_read_from_an_old_row_encodes_anew() -> None:
    codec = RecordCodec(Mutable)
    old = '{"gone":1,"name":"a"}'
    m = codec.decode(old)
    assert codec.encode(m) == old  # unchanged: the stored row
    m.name = "b"
    assert codec.encode(m) == '{"name":"b","tags":null}'
    fresh = codec.decode('{"name":"a","tags":null}')
    assert codec.encode(fresh) == '{"name":"a","tags":null}'
