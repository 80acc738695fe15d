"""The codec of a shard's state: a :class:`~persist.state.ShardState` to and from its
stash entries (one JSON value per component, so that consensus stores a new version as
the few entries that changed) and one readable JSON document, and Arrow schemas to and
from JSON.

Invariants kept here: both forms round-trip exactly (``from_entries(to_entries(s))``
rebuilds ``s``; likewise for the document); unchanged components encode to the very
same objects (memoized), so that consensus compares them by identity; a malformed entry
or document raises :class:`~persist.errors.PersistError` naming what is wrong, never a
half-built state.  The functions take the state's fields (:class:`StateFields`) and give
back the state constructor's keyword arguments, so this module never imports
:mod:`persist.state`.

Source: Materialize's persist-client ``internal/state_serde.rs`` (a state's readable
serialization) and its rollups of ``internal/state_diff.rs``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

import pyarrow as pa

from persist.errors import PersistError
from persist.landed import Landed
from persist.lease_state import ReaderState, WriterState
from persist.schemacache import schema_cache
from persist.spine import Trace
from persist.tracked import noted_keys
from stash import Antichain

__all__ = [
    "StateFields",
    "copy_entries",
    "from_entries",
    "from_entries_delta",
    "from_json",
    "schema_from_json",
    "schema_to_json",
    "schemas_entry",
    "to_entries",
    "to_entries_delta",
    "to_json",
]


class StateFields(Protocol):
    """The fields of a shard state the codec reads (see :class:`persist.state.ShardState`)."""

    shard_id: str
    name: str
    key_schema: pa.Schema
    value_schema: pa.Schema
    seqno: int
    trace: Trace
    readers: dict[str, ReaderState]
    writers: dict[str, WriterState]
    retired_upper: int
    tombstone: bool
    schema_history: tuple[pa.Schema, ...]
    landed: dict[str, Landed]
    landed_horizon: int
    history_upper: int
    history_ms: int
    retention_ms: int | None
    retention_marks: tuple[tuple[int, int], ...]
    retention_hold: int | None
    store_id: str | None
    store_name: str | None
    landed_notes: tuple[Mapping[str, Landed], set[str]] | None

    @property
    def since(self) -> Antichain: ...

    @property
    def upper(self) -> Antichain: ...


# Entry keys of the flattened state (see ShardState.to_entries).
_SHARD = "shard"
_META = "meta"
_TRACE_MAPS = ("hollow_batches", "spine_batches")
_READER = "reader/"
_SCHEMAS = "schemas"
_WRITER = "writer/"
_LANDED = "landed/"
# The table's entries (absent from states that never had them, so those decode and
# encode as before): the history log's length and newest timestamp, and the
# retention and blob store identity.
_HISTORY = "history"
_TABLE = "table"


@schema_cache(256)
def _schema_json_cached(schema: pa.Schema) -> str:
    return json.dumps(_schema_to_json(schema))


# The last ``shard`` entries made, by the identity of their arguments (the schema objects
# are kept alive by the values, so their ids are not reused while listed): hashing a
# ``pa.Schema`` for the lru_cache below costs tens of microseconds per version.
_SHARD_ENTRIES: dict[tuple[int, int, str, str], tuple[pa.Schema, pa.Schema, dict[str, Any]]] = {}


def _shard_entry(
    shard_id: str, name: str, key_schema: pa.Schema, value_schema: pa.Schema
) -> dict[str, Any]:
    """The ``shard`` entry of :meth:`ShardState.to_entries` (the same dict for the same
    shard, so that versions compare it cheaply; do not mutate it)."""
    ident = (id(key_schema), id(value_schema), shard_id, name)
    hit = _SHARD_ENTRIES.get(ident)
    if hit is not None and hit[0] is key_schema and hit[1] is value_schema:
        return hit[2]
    entry = _shard_entry_cached(shard_id, name, key_schema, value_schema)
    if len(_SHARD_ENTRIES) >= 256:
        _SHARD_ENTRIES.clear()
    _SHARD_ENTRIES[ident] = (key_schema, value_schema, entry)
    return entry


@schema_cache(256)
def _shard_entry_cached(
    shard_id: str, name: str, key_schema: pa.Schema, value_schema: pa.Schema
) -> dict[str, Any]:
    """:func:`_shard_entry` by value."""
    return {
        "shard_id": shard_id,
        "name": name,
        "key_schema": schema_to_json(key_schema),
        "value_schema": schema_to_json(value_schema),
    }


def schema_to_json(schema: pa.Schema) -> dict[str, Any]:
    """A readable and exact JSON form of an Arrow schema: ``{"fields": ["name: type", ...],
    "ipc": base64 of the Arrow IPC schema message}`` (``fields`` is informational)."""
    out: dict[str, Any] = json.loads(_schema_json_cached(schema))
    return out


def _schema_to_json(schema: pa.Schema) -> dict[str, Any]:
    return {
        "fields": [f"{f.name}: {f.type}{'' if f.nullable else ' not null'}" for f in schema],
        "ipc": base64.b64encode(schema.serialize().to_pybytes()).decode("ascii"),
    }


def schema_from_json(d: Mapping[str, Any]) -> pa.Schema:
    """Inverse of :func:`schema_to_json`.

    Raises:
        PersistError: the IPC bytes are not an Arrow schema.
    """
    try:
        return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(d["ipc"])))
    except (KeyError, TypeError, ValueError, pa.ArrowException) as e:
        raise PersistError(f"stored schema is not a valid Arrow IPC schema: {e}") from e


@schema_cache(64)
def schemas_entry(versions: tuple[pa.Schema, ...]) -> list[dict[str, Any]]:
    """The ``schemas`` entry: every value schema version, by id (the same list for the
    same versions, so that versions compare it cheaply; do not mutate it)."""
    return [{"id": i, **schema_to_json(v)} for i, v in enumerate(versions)]


def _schemas_from(entry: Any) -> tuple[pa.Schema, ...]:
    """Inverse of :func:`schemas_entry` (``None``: a state of one version)."""
    if entry is None:
        return ()
    versions = []
    for i, d in enumerate(entry):
        if int(d["id"]) != i:
            raise ValueError(f"schema versions out of order: id {d['id']} at position {i}")
        versions.append(schema_from_json(d))
    return tuple(versions)


def to_entries(self: StateFields) -> dict[str, Any]:
    """The state flattened into one JSON value per component, keyed by a path:

    ``meta`` (``seqno``, ``since``, ``upper``, the trace's ``next_id`` and
    ``fueling_merges``: what changes with every version, kept in one entry),
    ``shard`` (id, name, schemas; ``value_schema`` the newest version),
    ``schemas`` (only once there is more than one version: every value schema
    version, by id), ``trace/hollow_batches/<id>``,
    ``trace/spine_batches/<id>``, ``reader/<id>``, ``writer/<id>``,
    ``landed/<seqno>`` (:meth:`persist.landed.Landed.entry_json`; states written
    before hold ``landed/<digest of a token>`` entries of the readable form, kept under
    their key; ``meta`` holds their ``landed_horizon``), (retired keys live in their own collection).  A new version differs from the
    previous one in
    ``meta`` and the few components that changed, so consensus writes little.
    """
    t = self.trace.to_json()
    out = _other_entries(self, {k: v for k, v in t.items() if k not in _TRACE_MAPS})
    for m in _TRACE_MAPS:
        for k, v in t[m].items():
            out[f"trace/{m}/{k}"] = v
    return out


_SPINE_PREFIX = "trace/spine_batches/"
_HOLLOW_PREFIX = "trace/hollow_batches/"


def _other_entries(self: StateFields, meta: dict[str, Any]) -> dict[str, Any]:
    """Every entry of :func:`to_entries` but the trace's batches (``meta`` holds the
    trace's other fields, :meth:`Trace.meta_json`; completed here)."""
    out = _fixed_entries(self, meta)
    for rid, r in self.readers.items():
        out[_READER + rid] = r.to_json()
    for wid, w in self.writers.items():
        out[_WRITER + wid] = w.to_json()
    for rec in self.landed.values():
        out[rec.key] = rec.entry_json()
    return out


#: The keys of :func:`_fixed_entries` (the optional ones may be absent).
_FIXED = (_META, _SHARD, _SCHEMAS, _HISTORY, _TABLE)


def _fixed_entries(self: StateFields, meta: dict[str, Any]) -> dict[str, Any]:
    """The entries of :func:`to_entries` that are not batches, leases or landed records."""
    meta["seqno"] = self.seqno
    meta["retired_upper"] = self.retired_upper
    meta["landed_horizon"] = self.landed_horizon
    if self.tombstone:
        meta["tombstone"] = True
    out: dict[str, Any] = {
        _META: meta,
        _SHARD: _shard_entry(self.shard_id, self.name, self.key_schema, self.value_schema),
    }
    if len(self.schema_history) > 1:
        out[_SCHEMAS] = schemas_entry(self.schema_history)
    if self.history_upper:
        out[_HISTORY] = {"ms": self.history_ms, "upper": self.history_upper}
    table = _table_entry(self)
    if table:
        out[_TABLE] = table
    return out


def _delta_of_records(
    data: dict[str, Any],
    touched: set[str],
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    key: Callable[[str, Any], str],
    value: Callable[[Any], Any] = lambda r: r.to_json(),
    notes: tuple[Mapping[str, Any], set[str]] | None = None,
) -> None:
    """Update ``data`` from the records ``old`` to ``new`` (frozen objects by id, so an
    unchanged record is the very same object): ``key(id, record)`` is its entry key.
    Only the ids ``new`` reports changed are looked at (:func:`persist.tracked.changed_keys`:
    a command's clone of the records notes what it set or removed; or ``notes``, see
    :func:`persist.tracked.noted_keys`)."""
    for i in noted_keys(old, new, notes):
        o = old.get(i)
        r = new.get(i)
        if o is r:
            continue
        if o is not None:
            k = key(i, o)
            data.pop(k, None)
            touched.add(k)
        if r is not None:
            k = key(i, r)
            data[k] = value(r)
            touched.add(k)


def to_entries_delta(
    old: StateFields, old_entries: Mapping[str, Any], new: StateFields
) -> tuple[dict[str, Any], set[str]]:
    """:func:`to_entries` of ``new``, computed from ``old_entries`` (what
    :func:`to_entries` gives ``old``, e.g. as read back from consensus), and the keys
    that may differ between the two (every changed, added or removed key is among them).

    Proportional to what changed, not to the state's size (Materialize's
    ``internal/state_diff.rs`` diffs states the same way): spine batches are immutable
    and shared between versions (:meth:`Trace.copy`), so only the entries of the spine
    batches that are not the same object at the same level in both traces are
    removed or made; leases and landed records are frozen, so only those that are not
    the same object in both are; ``meta``, ``shard`` and the few other fixed entries are
    made again.  The rest is C-level copying.
    Equal to :func:`to_entries` (``new``) as a mapping (key order may differ); checked
    in the test suite (:mod:`persist.state_check`).
    """
    data = copy_entries(old_entries)
    touched: set[str] = set()
    fixed = _fixed_entries(new, new.trace.meta_json())
    for k in _FIXED:
        if k not in fixed and data.pop(k, _ABSENT) is not _ABSENT:
            touched.add(k)
    for k, v in fixed.items():
        if data.get(k, _ABSENT) is not v:  # the shard entry is mostly the very same
            data[k] = v
            touched.add(k)
    # Leases and landed records are frozen: an unchanged one is the same object.
    _delta_of_records(data, touched, old.readers, new.readers, lambda i, _r: _READER + i)
    _delta_of_records(data, touched, old.writers, new.writers, lambda i, _r: _WRITER + i)
    _delta_of_records(
        data,
        touched,
        old.landed,
        new.landed,
        lambda _i, r: r.key,
        lambda r: r.entry_json(),
        new.landed_notes,
    )
    olds = old.trace.spine_index()
    news = new.trace.spine_index()
    # The hollow batch entries of the spine batches that went: most come back, the very
    # same objects, in the spine batch a merge made of them (not touched then).
    gone: dict[str, Any] = {}
    for key, (b, i) in olds.items():
        hit = news.get(key)
        if hit is not None and hit[1] == i:
            continue
        k = _SPINE_PREFIX + str(b.id)
        data.pop(k, None)
        touched.add(k)
        for p in b.parts:
            k = _HOLLOW_PREFIX + str(p.id)
            gone[k] = data.get(k, _ABSENT)
    for key, (b, i) in news.items():
        hit = olds.get(key)
        if hit is not None and hit[1] == i:
            continue
        name, entry, parts = new.trace.flat_batch(b, i)
        k = _SPINE_PREFIX + name
        data[k] = entry
        touched.add(k)
        for n, v in parts:
            k = _HOLLOW_PREFIX + n
            if gone.pop(k, _ABSENT) is v:
                continue  # the old entry's very object: unchanged
            data[k] = v
            touched.add(k)
    for k in gone:
        data.pop(k, None)
        touched.add(k)
    return data, touched


_ABSENT = object()


def copy_entries(d: Mapping[str, Any]) -> dict[str, Any]:
    """A shallow copy of ``d``: ``dict.copy`` clones a dict's table in C even after
    deletions (up to a third of it deleted), where ``dict(d)`` re-inserts every key."""
    return d.copy() if type(d) is dict else dict(d)


def _landed_from(records: list[Landed]) -> dict[str, Landed]:
    """The landed records by token, oldest first (by seqno)."""
    return {r.token: r for r in sorted(records, key=lambda r: r.seqno)}


def from_entries(entries: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`to_entries`: the :class:`~persist.state.ShardState`
    constructor's keyword arguments.

    Raises:
        PersistError: an entry is missing or malformed.
    """
    seqno: object = "?"
    try:
        shard = entries[_SHARD]
        trace_json: dict[str, Any] = dict(entries[_META])
        seqno = trace_json.pop("seqno")
        retired_upper = int(trace_json.pop("retired_upper", 0))
        tombstone = bool(trace_json.pop("tombstone", False))
        # A state written before the shard kept its landed records: any earlier
        # append's record may have left with its writer (see persist.landed).
        horizon = int(trace_json.pop("landed_horizon", seqno))
        landed: list[Landed] = []
        maps: dict[str, dict[str, Any]] = {m: {} for m in _TRACE_MAPS}
        readers: dict[str, ReaderState] = {}
        writers: dict[str, WriterState] = {}
        for k, v in entries.items():
            if k.startswith("trace/"):
                _, m, ident = k.split("/", 2)
                maps[m][ident] = v
            elif k.startswith(_READER):
                readers[k[len(_READER) :]] = ReaderState.from_json(v)
            elif k.startswith(_WRITER):
                writers[k[len(_WRITER) :]] = WriterState.from_json(v)
            elif k.startswith(_LANDED):
                landed.append(Landed.from_entry(k, v))
            elif k not in (_SHARD, _META, _SCHEMAS, _HISTORY, _TABLE):
                raise ValueError(f"unknown state entry {k!r}")
        trace_json.update(maps)
        if isinstance(seqno, bool) or not isinstance(seqno, int):
            raise ValueError(f"seqno {seqno!r} is not an int")
        return dict(
            shard_id=str(shard["shard_id"]),
            name=str(shard["name"]),
            key_schema=schema_from_json(shard["key_schema"]),
            value_schema=schema_from_json(shard["value_schema"]),
            seqno=seqno,
            trace=Trace.from_json(trace_json),
            readers=readers,
            writers=writers,
            retired_upper=retired_upper,
            tombstone=tombstone,
            schema_history=_schemas_from(entries.get(_SCHEMAS)),
            landed=_landed_from(landed),
            landed_horizon=horizon,
            **_table_fields(entries.get(_HISTORY), entries.get(_TABLE)),
        )
    except PersistError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PersistError(f"malformed shard state at seqno {seqno}: {e}") from e


_HOLLOW = "trace/hollow_batches/"
_SPINE = "trace/spine_batches/"


def from_entries_delta(
    prev: StateFields, entries: Mapping[str, Any], changed: Collection[str]
) -> dict[str, Any]:
    """:func:`from_entries` of ``entries``, a newer version of ``prev``'s entries that
    differs from them only at the keys ``changed`` (set, changed or removed), decoding
    only those (and the small ``meta``): every other component is ``prev``'s very
    object (batches, leases, landed records and schemas are immutable and shared, as
    between the versions a command makes).  What a machine that lost a race does with
    the diffs it missed (Materialize's persist-client ``internal/apply.rs`` applies
    only the diffs after its cached seqno).  Equal to :func:`from_entries` (checked
    in the test suite, :mod:`persist.state_check`).

    Raises:
        PersistError: an entry is missing or malformed, or the changes do not fit
            ``prev``.
    """
    seqno: object = "?"
    try:
        meta: dict[str, Any] = dict(entries[_META])
        seqno = meta.pop("seqno")
        retired_upper = int(meta.pop("retired_upper", 0))
        tombstone = bool(meta.pop("tombstone", False))
        horizon = int(meta.pop("landed_horizon", seqno))
        readers = dict(prev.readers)
        writers = dict(prev.writers)
        landed_gone: set[str] = set()
        landed_new: list[Landed] = []
        spine: dict[str, Any] = {}
        hollow: dict[str, Any] = {}
        for k in changed:
            v = entries.get(k)
            if k.startswith(_HOLLOW):
                hollow[k[len(_HOLLOW) :]] = v
            elif k.startswith(_SPINE):
                spine[k[len(_SPINE) :]] = v
            elif k.startswith(_READER):
                rid = k[len(_READER) :]
                if v is None:
                    readers.pop(rid, None)
                else:
                    readers[rid] = ReaderState.from_json(v)
            elif k.startswith(_WRITER):
                wid = k[len(_WRITER) :]
                if v is None:
                    writers.pop(wid, None)
                else:
                    writers[wid] = WriterState.from_json(v)
            elif k.startswith(_LANDED):
                landed_gone.add(k)
                if v is not None:
                    landed_new.append(Landed.from_entry(k, v))
            elif k not in _FIXED:
                raise ValueError(f"unknown state entry {k!r}")
        if isinstance(seqno, bool) or not isinstance(seqno, int):
            raise ValueError(f"seqno {seqno!r} is not an int")
        if landed_gone:
            kept = [r for r in prev.landed.values() if r.key not in landed_gone]
            landed = _landed_from(kept + landed_new)
        else:
            landed = dict(prev.landed)
        trace = Trace.from_json_delta(
            prev.trace, meta, lambda name: entries[_SPINE + name], spine, hollow
        )
        if _SHARD in changed:
            shard = entries[_SHARD]
            ident: dict[str, Any] = dict(
                shard_id=str(shard["shard_id"]),
                name=str(shard["name"]),
                key_schema=schema_from_json(shard["key_schema"]),
                value_schema=schema_from_json(shard["value_schema"]),
            )
        else:
            ident = dict(
                shard_id=prev.shard_id,
                name=prev.name,
                key_schema=prev.key_schema,
                value_schema=prev.value_schema,
            )
        schemas = (
            _schemas_from(entries.get(_SCHEMAS)) if _SCHEMAS in changed else prev.schema_history
        )
        return dict(
            **ident,
            seqno=seqno,
            trace=trace,
            readers=readers,
            writers=writers,
            retired_upper=retired_upper,
            tombstone=tombstone,
            schema_history=schemas,
            landed=landed,
            landed_horizon=horizon,
            **_table_fields(entries.get(_HISTORY), entries.get(_TABLE)),
        )
    except PersistError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PersistError(f"malformed shard state at seqno {seqno}: {e}") from e


def _table_entry(self: StateFields) -> dict[str, Any]:
    """The ``table`` entry: the retention and the blob store's identity, if set."""
    out: dict[str, Any] = {}
    if self.retention_ms is not None:
        out["retention_ms"] = self.retention_ms
    if self.retention_marks:
        out["retention_marks"] = [list(m) for m in self.retention_marks]
    if self.retention_hold is not None:
        out["retention_hold"] = self.retention_hold
    if self.store_id is not None:
        out["store_id"] = self.store_id
    if self.store_name is not None:
        out["store_name"] = self.store_name
    return out


def _table_fields(history: Any, table: Any) -> dict[str, Any]:
    """The constructor's keyword arguments of the ``history`` and ``table`` entries
    (either may be absent)."""
    h = history or {}
    t = table or {}
    retention = t.get("retention_ms")
    store = t.get("store_id")
    return {
        "history_upper": int(h.get("upper", 0)),
        "history_ms": int(h.get("ms", 0)),
        "retention_ms": None if retention is None else int(retention),
        "retention_marks": tuple((int(a), int(b)) for a, b in t.get("retention_marks", ())),
        "retention_hold": None if t.get("retention_hold") is None else int(t["retention_hold"]),
        "store_id": None if store is None else str(store),
        "store_name": None if t.get("store_name") is None else str(t["store_name"]),
    }


def to_json(self: StateFields) -> dict[str, Any]:
    """One readable JSON document of this version (for inspection)."""
    return {
        "seqno": self.seqno,
        "shard_id": self.shard_id,
        "name": self.name,
        "since": self.since.to_json(),
        "upper": self.upper.to_json(),
        "key_schema": schema_to_json(self.key_schema),
        "value_schema": schema_to_json(self.value_schema),
        "schemas": list(schemas_entry(self.schema_history)),
        "trace": self.trace.to_json(),
        "readers": {k: v.to_json() for k, v in sorted(self.readers.items())},
        "writers": {k: v.to_json() for k, v in sorted(self.writers.items())},
        "retired_upper": self.retired_upper,
        "tombstone": self.tombstone,
        "landed": [r.to_json() for r in self.landed.values()],
        "landed_horizon": self.landed_horizon,
        "history": {"ms": self.history_ms, "upper": self.history_upper},
        "table": _table_entry(self),
    }


def from_json(d: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`to_json`: the :class:`~persist.state.ShardState`
    constructor's keyword arguments.

    Raises:
        PersistError: the document is malformed.
    """
    try:
        return dict(
            shard_id=str(d["shard_id"]),
            name=str(d["name"]),
            key_schema=schema_from_json(d["key_schema"]),
            value_schema=schema_from_json(d["value_schema"]),
            seqno=int(d["seqno"]),
            trace=Trace.from_json(d["trace"]),
            readers={k: ReaderState.from_json(v) for k, v in d["readers"].items()},
            writers={k: WriterState.from_json(v) for k, v in d["writers"].items()},
            retired_upper=int(d.get("retired_upper", 0)),
            tombstone=bool(d.get("tombstone", False)),
            schema_history=_schemas_from(d.get("schemas")),
            landed=_landed_from([Landed.from_json(r) for r in d.get("landed", ())]),
            landed_horizon=int(d.get("landed_horizon", d["seqno"])),
            **_table_fields(d.get("history"), d.get("table")),
        )
    except PersistError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PersistError(f"malformed shard state document: {e}") from e
