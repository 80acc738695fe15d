"""Typed collections do their codec work once per type, and their one-key writes are
one transaction each (the figures against SQLAlchemy Core are in
``bench/bench_stash_typed.py``)."""

from __future__ import annotations

import threading
import typing
from dataclasses import dataclass, field
from typing import Any

import pytest

from stash import TypedCollection
from stash.codec import RecordCodec, decode_all
from tests.stash.conftest import OpenStash


@dataclass(frozen=True)
class Inner:
    xs: tuple[int, ...]


@dataclass
class Row:
    name: str
    inner: Inner | None = None
    tags: list[str] = field(default_factory=list)


def test_type_hints_are_resolved_once_per_type_not_per_row(
    monkeypatch: pytest.MonkeyPatch, open_stash: OpenStash
) -> None:
    calls: list[Any] = []
    real = typing.get_type_hints

    def counting(obj: Any, *a: Any, **kw: Any) -> Any:
        calls.append(obj)
        return real(obj, *a, **kw)

    monkeypatch.setattr(typing, "get_type_hints", counting)

    @dataclass
    class Fresh:  # a type no earlier test decoded
        name: str
        inner: Inner | None = None

    codec = RecordCodec(Fresh)
    texts = [codec.encode(Fresh(f"r{i}", Inner((i, i + 1)))) for i in range(200)]
    assert [codec.decode(t) for t in texts] == decode_all(codec, texts)
    s = open_stash()
    tc: TypedCollection[int, Fresh] = TypedCollection("rows", int, Fresh)
    tc.upsert(s, ((i, Fresh(f"r{i}", Inner((i,)))) for i in range(200)))
    assert tc.peek_one(s)[7] == Fresh("r7", Inner((7,)))
    # Once for Fresh (Inner's plan may be made here too, once): never per row.
    assert calls.count(Fresh) == 1 and calls.count(Inner) <= 1


def test_the_bulk_decode_equals_one_decode_per_text() -> None:
    codec = RecordCodec(Row)
    texts = [
        codec.encode(Row("a", Inner((1, 2)), ["t"])),
        '{"name":"b"}',  # fields with defaults left out
        '{"name":"c","gone":1,"inner":{"xs":[3]}}',  # an unknown field
    ]
    one = [codec.decode(t) for t in texts]
    assert decode_all(codec, texts) == one
    assert one[1] == Row("b") and one[2] == Row("c", Inner((3,)))
    assert isinstance(one[2].inner, Inner) and one[2].inner.xs == (3,)


def test_one_key_writes_of_two_handles_never_conflict(open_stash: OpenStash) -> None:
    """``upsert_key`` and ``insert_without_overwrite`` read and write in one
    transaction under the collection's lock: writers of other handles wait their turn
    instead of failing with ``AppendLowerMismatch`` (the read-then-append helpers did)."""
    a, b = open_stash(), open_stash()
    tc: TypedCollection[str, int] = TypedCollection("c", "str", "int")
    tc.upsert_key(a, "seed", 0)
    errors: list[BaseException] = []

    def writer(s: Any, tag: str) -> None:
        try:
            for i in range(15):
                tc.upsert_key(s, f"{tag}{i}", i)
                tc.upsert_key(s, f"{tag}{i}", i + 100)
                assert tc.insert_without_overwrite(s, f"{tag}{i}", -1) == i + 100
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(s, t)) for s, t in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    got = tc.peek_one(a)
    assert got == {"seed": 0, **{f"{t}{i}": i + 100 for t in "ab" for i in range(15)}}
