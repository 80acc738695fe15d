"""The state of one shard: what a version in consensus holds, and its transitions.

A :class:`ShardState` is one version of a shard's metadata (Materialize's persist-client
``State``): its identity and Arrow schemas, the flattened Spine :class:`~persist.spine.Trace`
(which carries the shard's ``since`` and ``upper``), the leased readers with their since
holds, the writers, and the counter of the shard's *retired* collection (blob keys a
compaction stopped referencing, waiting for GC, kept by consensus beside the state so that
the state stays small however many parts wait for their grace period).  Versions
are numbered by ``seqno``; consensus (:mod:`persist.consensus`) stores them.

Invariants kept here (every transition keeps them or raises before changing anything):

* ``since`` and ``upper`` are the trace's; ``upper`` only advances (the trace only takes
  the batch starting at its upper) and ``since`` only advances;
* while at least one reader is registered, the shard's ``since`` is ``<=`` the meet
  (the earliest) of the live readers' since holds: a reader's hold is never passed; a
  reader's hold only advances; a new reader's hold starts at the shard's since;
* a reader or writer whose last heartbeat is older than its lease duration is expired and
  dropped by :meth:`ShardState.expire_leases` (its hold stops holding the since back);
* a reader also holds a *seqno*: the oldest version it may still be reading; it only
  advances, never past the version it is written in, so GC never deletes a blob key a
  version at or after a live reader's seqno hold references; a *seqno-only* lease
  (:meth:`ShardState.detach_reader`) keeps its seqno hold but holds no since;
* a writer id is registered over one contiguous interval: a handle whose lease ran out
  is never registered again (GC may have deleted its parts), and an output of a
  compactor that is no longer live is never applied;
* a ``tombstone`` state (a finalized shard) is final: no handle may use the shard;
* a transition that stops referencing blob keys lists them in ``retire_adds`` (blob key
  -> wall-clock ms; consensus records them with the seqno of the new version), one that
  lets GC forget deleted ones in ``retire_removes`` (row key -> ms); consensus
  writes them to the retired collection in the same atomic append as the new version and
  bumps ``retired_upper`` (that collection's upper) in it; these two maps are transient
  (never serialised, empty in every published version);
* the value schema is versioned: ``schema_history`` only grows, a
  version's id (its index) never changes, the newest is ``value_schema``, each version
  is a compatible evolution of the one before (:meth:`ShardState.register_schema`
  checks it and changes nothing when it raises), the key schema never changes; a part
  records the id it was written with (states without versions read as schema 0);
* the readable JSON forms round-trip exactly: :meth:`ShardState.to_entries` /
  :meth:`ShardState.from_entries` (one JSON value per component, so that consensus can
  store a new version as the few entries that changed) and :meth:`ShardState.to_json` /
  :meth:`ShardState.from_json` (one document, for ``persist inspect --json``).

Sources of the ideas: Materialize's early persist engine's ``AppliedState`` (``src/persist/src/indexed/``), the
Spine's flattened trace (``src/persist-client/src/internal/trace.rs``), the persist-client batch and lease handling (``src/persist-client/src/batch.rs``).
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa

from persist.errors import InvalidUsage, PersistError, SchemaMismatch
from persist.keys import key_writer_id
from persist.schemacache import schema_cache
from persist.spine import ApplyMergeResult, FueledMergeReq, FueledMergeRes, Trace
from persist.types import HollowBatch
from persist.updates import SchemaHistory, check_schema_evolution
from stash import Antichain

__all__ = [
    "SEQNO_ONLY",
    "LeaseExpired",
    "ReaderState",
    "ShardState",
    "Stale",
    "WriterState",
    "schema_from_json",
    "schema_to_json",
]

# Entry keys of the flattened state (see ShardState.to_entries).
_SHARD = "shard"
_META = "meta"
_TRACE_MAPS = ("hollow_batches", "spine_batches")
_READER = "reader/"
_SCHEMAS = "schemas"
_WRITER = "writer/"


#: The purpose of a reader lease that holds a seqno but no since (see
#: :meth:`ShardState.detach_reader`).
SEQNO_ONLY = "seqno hold"


#: Separates an idempotency token from the fingerprint of its append in a writer's
#: recorded tokens (a control character: never part of a valid token).
TOKEN_SEP = "\x1f"


class Stale(Exception):
    """Raised by a command that would fail on a cached state (``fresh`` false): the
    machine re-reads the head and runs it again on the fresh state, where failing is then
    real (Materialize's persist-client returns the same "retry on a fresh state" from
    its ``internal/state.rs`` commands)."""


class LeaseExpired(InvalidUsage):
    """A reader or writer handle was used after its lease expired (it was dropped from the
    shard state because it did not heartbeat within its lease duration).

    Attributes: ``shard_id`` (str), ``handle_id`` (str).
    """

    def __init__(self, shard_id: str, handle_id: str, what: str = "reader") -> None:
        self.shard_id = shard_id
        self.handle_id = handle_id
        super().__init__(
            f"{what} {handle_id} of shard {shard_id} is not registered: its lease expired "
            "(no heartbeat within the lease duration) or it was expired"
        )


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


@schema_cache(256)
def _history(key_schema: pa.Schema, versions: tuple[pa.Schema, ...]) -> SchemaHistory:
    return SchemaHistory(key_schema, versions)


@schema_cache(64)
def _schemas_entry(versions: tuple[pa.Schema, ...]) -> list[dict[str, Any]]:
    """The ``schemas`` entry: every value schema version, by id (the same list for the
    same versions, so that versions compare it cheaply; do not mutate it)."""
    return [{"id": i, **schema_to_json(v)} for i, v in enumerate(versions)]


def _schemas_from(entry: Any) -> tuple[pa.Schema, ...]:
    """Inverse of :func:`_schemas_entry` (``None``: a state of one version)."""
    if entry is None:
        return ()
    versions = []
    for i, d in enumerate(entry):
        if int(d["id"]) != i:
            raise ValueError(f"schema versions out of order: id {d['id']} at position {i}")
        versions.append(schema_from_json(d))
    return tuple(versions)


@dataclass(frozen=True)
class ReaderState:
    """A leased reader (Materialize's ``LeasedReaderState``).

    Attributes:
        since: the reader's since hold: the shard's since never passes it.
        last_heartbeat_ms: wall-clock time (ms since the epoch) of its last heartbeat.
        lease_duration_ms: the reader is expired once ``now > last_heartbeat_ms +
            lease_duration_ms``.
        purpose: a free-form description (``"read handle"``, ``"listen"``, ...).
        seqno: the reader's seqno hold: it may still read any version from this seqno
            on, so GC keeps every blob key that such a version references (a key retired
            at seqno ``R`` is deleted only once every live reader holds ``>= R``).  It
            only advances.  Versions written before seqno holds existed read as ``0``.
    """

    since: Antichain
    last_heartbeat_ms: int
    lease_duration_ms: int
    purpose: str = ""
    seqno: int = 0

    def expired(self, now_ms: int) -> bool:
        """True when the lease ran out at ``now_ms``."""
        return now_ms > self.last_heartbeat_ms + self.lease_duration_ms

    def to_json(self) -> dict[str, Any]:
        return {
            "since": self.since.to_json(),
            "last_heartbeat_ms": self.last_heartbeat_ms,
            "lease_duration_ms": self.lease_duration_ms,
            "purpose": self.purpose,
            "seqno": self.seqno,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ReaderState:
        return cls(
            Antichain.from_json(d["since"]),
            int(d["last_heartbeat_ms"]),
            int(d["lease_duration_ms"]),
            str(d.get("purpose", "")),
            int(d.get("seqno", 0)),
        )


@dataclass(frozen=True)
class WriterState:
    """A writer (Materialize's ``WriterState``).

    Attributes:
        last_heartbeat_ms: wall-clock time (ms) of its last append or heartbeat.
        lease_duration_ms: the writer is dropped once its lease runs out.
        last_token: the idempotency token of the writer's last committed append, used to
            learn the outcome of an append whose commit was indeterminate.
        tokens: the tokens of its earlier recent appends (oldest first, at most
            :data:`WRITER_TOKENS_KEPT` with ``last_token``), so that a retry with a token
            stays idempotent even after the same writer appended again.  States written
            before this field existed load with ``()``.
        handed_off: batches with parts of this writer that its handle had handed out
            (e.g. transmitted to another process,
            :meth:`persist.batch.Batch.into_transmittable`) and not appended itself
            when it expired; ``0`` (omitted from the JSON) while the handle is in use.
            A handed-off writer is kept (for its hand-off lease, see
            :meth:`ShardState.hand_off_writer`) while some of them are outstanding, so
            that GC keeps their parts.
        settled: batches with parts of this writer that other writers appended (or
            whose decoded copies they deleted), before or after the hand-off; the
            writer is dropped once it is handed off and ``settled >= handed_off``.
            ``0`` (omitted from the JSON) at first.
    """

    last_heartbeat_ms: int
    lease_duration_ms: int
    last_token: str | None = None
    tokens: tuple[str, ...] = ()
    handed_off: int = 0
    settled: int = 0

    @property
    def outstanding(self) -> int:
        """Handed-off batches neither appended nor deleted yet (``0`` while in use)."""
        return max(0, self.handed_off - self.settled) if self.handed_off else 0

    def expired(self, now_ms: int) -> bool:
        """True when the lease ran out at ``now_ms``."""
        return now_ms > self.last_heartbeat_ms + self.lease_duration_ms

    def token_entry(self, token: str) -> str | None:
        """The recorded entry of an append with ``token`` by this writer
        (``token``, or ``token + TOKEN_SEP + fingerprint``), or ``None``."""
        for entry in (self.last_token, *self.tokens):
            if entry is not None and entry.split(TOKEN_SEP, 1)[0] == token:
                return entry
        return None

    def has_token(self, token: str) -> bool:
        """Whether an append with ``token`` by this writer is recorded."""
        return self.token_entry(token) is not None

    def with_token(self, now_ms: int, lease_ms: int, token: str) -> WriterState:
        """This writer after an append with ``token`` (heartbeat renewed)."""
        older = self.tokens if self.last_token is None else (*self.tokens, self.last_token)
        older = older[-(WRITER_TOKENS_KEPT - 1) :] if WRITER_TOKENS_KEPT > 1 else ()
        return replace(
            self,
            last_heartbeat_ms=max(self.last_heartbeat_ms, now_ms),
            lease_duration_ms=lease_ms,
            last_token=token,
            tokens=older,
        )

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "last_heartbeat_ms": self.last_heartbeat_ms,
            "lease_duration_ms": self.lease_duration_ms,
            "last_token": self.last_token,
        }
        if self.tokens:
            d["tokens"] = list(self.tokens)
        if self.handed_off:
            d["handed_off"] = self.handed_off
        if self.settled:
            d["settled"] = self.settled
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> WriterState:
        tok = d.get("last_token")
        return cls(
            int(d["last_heartbeat_ms"]),
            int(d["lease_duration_ms"]),
            None if tok is None else str(tok),
            tuple(str(t) for t in d.get("tokens", ())),
            int(d.get("handed_off", 0)),
            int(d.get("settled", 0)),
        )


#: How many idempotency tokens of recent appends a writer's state keeps.
WRITER_TOKENS_KEPT = 8

#: A token persist made (:func:`token_for`): 16 hex digits of the writer's id, 8 of the
#: drawing process, an 8-digit counter, dot-separated (a form no uuid or plain hex token
#: of a caller's has).
_TOKEN_RE = re.compile(r"[0-9a-f]{16}\.[0-9a-f]{8}\.[0-9a-f]{8}")
#: :func:`token_verdict`'s answers.
TOKEN_LANDED, TOKEN_NOT_LANDED, TOKEN_UNKNOWN, TOKEN_FOREIGN = (
    "landed",
    "not landed",
    "unknown",
    "foreign",
)


def token_for(writer_id: str, process: str, count: int) -> str:
    """The idempotency token ``count`` drawn by a process (8 hex digits ``process``) for
    ``writer_id`` (``w`` and 32 hex digits)."""
    return f"{writer_id[1:17]}.{process}.{count:08x}"


def token_verdict(st: ShardState, token: str) -> tuple[str, str | None]:
    """What ``st`` (a head) says of an append with ``token``: ``(TOKEN_LANDED, entry)``
    when a writer records it; for a token persist made (:func:`token_for`),
    ``(TOKEN_NOT_LANDED, None)`` when its writer is registered and every token it still
    records from the same process was drawn before it (had it landed, nothing drawn
    before it could have pushed it out of the writer's recent tokens without a token
    drawn after it being kept too), else ``(TOKEN_UNKNOWN, None)`` (its writer is gone,
    or later tokens of it are kept); ``(TOKEN_FOREIGN, None)`` for a token of another
    form (a caller's own), of which nothing more can be told."""
    for w in st.writers.values():
        entry = w.token_entry(token)
        if entry is not None:
            return TOKEN_LANDED, entry
    if _TOKEN_RE.fullmatch(token) is None:
        return TOKEN_FOREIGN, None
    writer = next((w for wid, w in st.writers.items() if wid[1:17] == token[:16]), None)
    if writer is None:
        return TOKEN_UNKNOWN, None
    drawn = int(token[26:], 16)
    for entry in (writer.last_token, *writer.tokens):
        if entry is None:
            continue
        t = entry.split(TOKEN_SEP, 1)[0]
        if _TOKEN_RE.fullmatch(t) and t[:25] == token[:25] and int(t[26:], 16) > drawn:
            return TOKEN_UNKNOWN, None
    return TOKEN_NOT_LANDED, None


@dataclass
class ShardState:
    """One version of a shard's state.  Mutable: transitions change it in place, so callers
    work on a :meth:`clone` and publish it by compare-and-set.

    Attributes:
        shard_id: ``"s"`` + a UUID.
        name: the shard's registered name.
        key_schema, value_schema: the Arrow schemas of the key and the value columns
            (``value_schema`` is the newest registered version).
        schema_history: the value schema versions, ``schema_history[i]`` being schema
            id ``i``; its last one is ``value_schema``; empty on
            construction means ``(value_schema,)`` (states written before schemas were
            versioned load so: every part of theirs has schema id 0).
        seqno: the version number in consensus (``-1`` before the first version).
        trace: the Spine holding the batches, ``since`` and ``upper``.
        readers: reader id -> :class:`ReaderState`.
        writers: writer id -> :class:`WriterState`.
        retired_upper: the upper of the shard's retired collection (see the module
            docstring).
        tombstone: the shard was finalized (dropped): no handle may use it again.
        retire_adds, retire_removes: transient (not serialised) changes to the retired
            collection made by this transition: blob key -> retirement ms.
    """

    shard_id: str
    name: str
    key_schema: pa.Schema
    value_schema: pa.Schema
    seqno: int = -1
    trace: Trace = field(default_factory=Trace)
    readers: dict[str, ReaderState] = field(default_factory=dict)
    writers: dict[str, WriterState] = field(default_factory=dict)
    retired_upper: int = 0
    tombstone: bool = False
    retire_adds: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    retire_removes: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    schema_history: tuple[pa.Schema, ...] = ()

    def __post_init__(self) -> None:
        if not self.schema_history:
            self.schema_history = (self.value_schema,)
        elif self.schema_history[-1] is not self.value_schema and not self.schema_history[
            -1
        ].equals(self.value_schema):
            raise PersistError(
                f"shard {self.shard_id}: the newest schema version is not the value schema"
            )

    # ----------------------------------------------------------------- schemas
    def schemas(self) -> SchemaHistory:
        """The shard's :class:`~persist.updates.SchemaHistory` (key schema and value
        schema versions)."""
        return _history(self.key_schema, self.schema_history)

    def register_schema(
        self, key_schema: pa.Schema, value_schema: pa.Schema, drop: Collection[str] = ()
    ) -> tuple[int, bool]:
        """The schema id of a handle opened with these schemas, registering
        ``value_schema`` as a new newest version if it is a compatible evolution of
        the newest one dropping no column but those ``drop``
        names.  Returns ``(schema id, registered)``.

        A value schema equal to a registered version gets that version's id (the
        newest such): a handle opened with an older schema keeps its view.

        Raises:
            SchemaMismatch: the key schema differs, or ``value_schema`` is not a
                compatible evolution of the newest version (naming column and rule; a
                column it lacks that ``drop`` does not name is one); nothing changes.
            InvalidUsage: ``drop`` names a column no version has, or one the schemas
                keep.
        """
        if isinstance(drop, str):
            raise InvalidUsage(f"drop must be a collection of column names, not the str {drop!r}")
        unknown = sorted(set(drop) - {n for v in self.schema_history for n in v.names})
        if unknown:
            raise InvalidUsage(
                f"shard {self.name!r} ({self.shard_id}): drop names {unknown}, which no "
                "version of its value schema has"
            )
        if not key_schema.equals(self.key_schema):
            check_schema_evolution(
                f"{self.name!r} ({self.shard_id})",
                self.key_schema,
                self.value_schema,
                key_schema,
                value_schema,
            )
        known = self.schemas().id_of(value_schema)
        if known is not None:
            return known, False
        check_schema_evolution(
            f"{self.name!r} ({self.shard_id})",
            self.key_schema,
            self.value_schema,
            key_schema,
            value_schema,
            drop,
        )
        self.schema_history = (*self.schema_history, value_schema)
        self.value_schema = value_schema
        return len(self.schema_history) - 1, True

    # ----------------------------------------------------------------- reading
    @property
    def since(self) -> Antichain:
        """The shard's since (the trace's)."""
        return self.trace.since

    @property
    def upper(self) -> Antichain:
        """The shard's upper (the trace's)."""
        return self.trace.upper

    def clone(self) -> ShardState:
        """An independent copy (batches and frontiers are immutable and shared)."""
        return replace(
            self,
            trace=self.trace.copy(),
            readers=dict(self.readers),
            writers=dict(self.writers),
            retire_adds={},
            retire_removes={},
        )

    def batches(self) -> list[HollowBatch]:
        """The trace's hollow batches, oldest first."""
        return list(self.trace.batches())

    def referenced_blob_keys(self) -> set[str]:
        """Blob keys of every part the trace references (inline parts have none)."""
        return {p.key for b in self.trace.batches() for p in b.parts if p.key is not None}

    def referenced_part_ids(self) -> set[str]:
        """:attr:`~persist.types.PartRef.part_id` of every part the trace references
        (blob keys, ``inline:`` nonces)."""
        return {i for b in self.trace.batches() for p in b.parts if (i := p.part_id) is not None}

    def inline_bytes(self) -> int:
        """Total size (bytes) of the inline parts held in this state."""
        return sum(b.inline_bytes for b in self.trace.batches())

    def blob_bytes(self) -> int:
        """Total size (bytes) of the blob parts the trace references."""
        return sum(
            p.encoded_size_bytes for b in self.trace.batches() for p in b.parts if p.key is not None
        )

    def num_parts(self) -> int:
        """Number of parts (inline and blob) the trace references."""
        return sum(len(b.parts) for b in self.trace.batches())

    # ------------------------------------------------------------ transitions
    def register_reader(
        self,
        reader_id: str,
        now_ms: int,
        lease_ms: int,
        purpose: str = "",
        since: Antichain | None = None,
    ) -> Antichain:
        """Add a reader holding ``since`` (default: the shard's current since); returns
        its hold.

        Raises:
            InvalidUsage: ``since`` is before the shard's since.
        """
        hold = self.since if since is None else since
        if not self.since <= hold:
            raise InvalidUsage(
                f"reader {reader_id} of shard {self.shard_id} cannot hold since {hold}: "
                f"the shard's since is already {self.since}"
            )
        self.readers[reader_id] = ReaderState(hold, now_ms, lease_ms, purpose, max(self.seqno, 0))
        return hold

    def check_not_finalized(self) -> None:
        """Raise if the shard was finalized (dropped), so handles opened before the drop
        say so instead of reporting a lost lease or an upper race.

        Raises:
            InvalidUsage: the state is a tombstone.
        """
        if self.tombstone:
            raise InvalidUsage(
                f"shard {self.shard_id} was finalized (dropped by finalize_shard or "
                "`persist drop`): it can be neither read nor written"
            )

    def reader(self, reader_id: str) -> ReaderState:
        """The reader's state.

        Raises:
            LeaseExpired: the reader is not registered (expired or never registered).
        """
        r = self.readers.get(reader_id)
        if r is None:
            raise LeaseExpired(self.shard_id, reader_id)
        return r

    def _seqno_hold(self, r: ReaderState, seqno: int | None) -> int:
        """The reader's new seqno hold: ``seqno`` (default: this version's seqno, for a
        reader with no read in progress), capped at this version's, never backwards."""
        cur = max(self.seqno, 0)
        want = cur if seqno is None else min(seqno, cur)
        return max(r.seqno, want)

    def heartbeat_reader(self, reader_id: str, now_ms: int, seqno: int | None = None) -> None:
        """Renew the reader's lease and advance its seqno hold to ``seqno`` (the oldest
        version it may still be reading; ``None``: it reads none older than this one).

        Raises:
            LeaseExpired: the reader is not registered.
        """
        r = self.reader(reader_id)
        self.readers[reader_id] = replace(
            r,
            last_heartbeat_ms=max(now_ms, r.last_heartbeat_ms),
            seqno=self._seqno_hold(r, seqno),
        )

    def downgrade_reader_since(
        self, reader_id: str, since: Antichain, now_ms: int, seqno: int | None = None
    ) -> bool:
        """Advance the reader's since hold to ``since`` (and heartbeat, advancing its
        seqno hold as :meth:`heartbeat_reader`); the shard's since follows the meet of
        the holds.  Returns whether anything changed.

        Raises:
            LeaseExpired: the reader is not registered.
            InvalidUsage: ``since`` is earlier than the reader's current hold.
        """
        r = self.reader(reader_id)
        if not r.since <= since:
            raise InvalidUsage(
                f"reader {reader_id} of shard {self.shard_id} cannot move its since "
                f"backwards from {r.since} to {since}"
            )
        hold = self._seqno_hold(r, seqno)
        changed = since != r.since or now_ms > r.last_heartbeat_ms or hold != r.seqno
        self.readers[reader_id] = replace(
            r, since=since, last_heartbeat_ms=max(now_ms, r.last_heartbeat_ms), seqno=hold
        )
        return self._recompute_since() or changed

    def min_seqno_hold(self, now_ms: int) -> int | None:
        """The earliest seqno hold of the readers live at ``now_ms`` (``None``: none)."""
        holds = [r.seqno for r in self.readers.values() if not r.expired(now_ms)]
        return min(holds) if holds else None

    def live_writers(self, now_ms: int) -> set[str]:
        """Ids of the writers registered and not expired at ``now_ms``."""
        return {wid for wid, w in self.writers.items() if not w.expired(now_ms)}

    def check_writer_live(self, writer_id: str, now_ms: int) -> None:
        """Raise unless ``writer_id`` is registered and its lease has not run out at
        ``now_ms`` (GC may have deleted the keys of a writer that is not live).

        Raises:
            LeaseExpired: naming the writer and the shard.
        """
        w = self.writers.get(writer_id)
        if w is None or w.expired(now_ms):
            raise LeaseExpired(self.shard_id, writer_id, "writer")

    def expire_reader(self, reader_id: str) -> bool:
        """Drop the reader (its hold is released).  Returns whether it was registered."""
        if self.readers.pop(reader_id, None) is None:
            return False
        self._recompute_since()
        return True

    def expire_writer(self, writer_id: str) -> bool:
        """Drop the writer.  Returns whether it was registered."""
        return self.writers.pop(writer_id, None) is not None

    def expire_leases(self, now_ms: int, keep: Iterable[str] = ()) -> bool:
        """Drop readers and writers whose lease ran out at ``now_ms`` (except the ids in
        ``keep``, the caller's own handles).  Returns whether anything changed."""
        keep_set = set(keep)
        dead_r = [
            rid for rid, r in self.readers.items() if r.expired(now_ms) and rid not in keep_set
        ]
        dead_w = [
            wid for wid, w in self.writers.items() if w.expired(now_ms) and wid not in keep_set
        ]
        for rid in dead_r:
            del self.readers[rid]
        for wid in dead_w:
            del self.writers[wid]
        if dead_r:
            self._recompute_since()
        return bool(dead_r or dead_w)

    def detach_reader(self, reader_id: str, now_ms: int, seqno: int | None) -> None:
        """Turn the reader into a *seqno-only* lease (purpose :data:`SEQNO_ONLY`): it
        keeps its seqno hold (advanced to ``seqno``, see :meth:`heartbeat_reader`) until
        its lease runs out, but no longer holds the since back (for a planner whose
        listed parts others read after it is gone: the parts stay, whatever compaction
        does meanwhile).

        Raises:
            LeaseExpired: the reader is not registered.
        """
        self.heartbeat_reader(reader_id, now_ms, seqno)
        self.readers[reader_id] = replace(self.readers[reader_id], purpose=SEQNO_ONLY)
        self._recompute_since()

    def _recompute_since(self) -> bool:
        """Advance the trace's since to the meet of the readers' holds (never backwards;
        with no reader the since stays where it is; seqno-only leases hold no since).
        Returns whether it moved."""
        holders = [r for r in self.readers.values() if r.purpose != SEQNO_ONLY]
        if not holders:
            return False
        holds = iter(holders)
        meet = next(holds).since
        for r in holds:
            meet = meet.meet(r.since)
        if self.trace.since < meet:
            self.trace.downgrade_since(meet)
            return True
        return False

    def append_batch(
        self, batch: HollowBatch, writer_id: str, token: str, now_ms: int, lease_ms: int
    ) -> list[FueledMergeReq]:
        """Push ``batch`` (which must start at the upper) into the trace and record the
        writer's heartbeat and idempotency ``token``.  Returns the Spine's merge requests.

        Raises:
            InvalidUsage: the batch does not start at the upper, or is empty in time
                (nothing changes).
            SchemaMismatch: a part was written under a schema version a later version
                dropped a column of (its values there would read as null for every
                reader); nothing changes.
        """
        if len(self.schema_history) > 1:
            history = self.schemas()
            for sid in sorted({p.schema_id for p in batch.parts}):
                if 0 <= sid < len(history.versions) and (lost := history.dropped_after(sid)):
                    raise SchemaMismatch(
                        f"{self.name!r} ({self.shard_id})",
                        lost[0],
                        f"this writer's schema version {sid} has the column, but version "
                        f"{history.newest} (or one between) dropped it, so its values "
                        "would read as null for every reader: open the shard again with "
                        "the newest schema (adding the column back makes a new column); "
                        "nothing was committed",
                    )
        try:
            reqs = self.trace.push_batch(batch)
        except ValueError as e:
            raise InvalidUsage(f"cannot append to shard {self.shard_id}: {e}") from e
        w = self.writers.get(writer_id) or WriterState(now_ms, lease_ms)
        self.writers[writer_id] = w.with_token(now_ms, lease_ms, token)
        return reqs

    def heartbeat_writer(self, writer_id: str, now_ms: int, lease_ms: int) -> None:
        """Register or renew a writer, keeping its last token.  The heartbeat time never
        moves back (``max(old, now_ms)``, as the reader's heartbeat): a clock behind the
        one that last renewed it never shortens the lease.  (A handle that was
        registered before must check :meth:`check_writer_live` first: a writer id is
        registered over one contiguous interval, never again after its lease ran out.)"""
        w = self.writers.get(writer_id)
        if w is None:
            self.writers[writer_id] = WriterState(now_ms, lease_ms)
        else:
            self.writers[writer_id] = replace(
                w, last_heartbeat_ms=max(w.last_heartbeat_ms, now_ms), lease_duration_ms=lease_ms
            )

    def hand_off_writer(self, writer_id: str, now_ms: int, lease_ms: int, batches: int) -> bool:
        """Record that the live writer ``writer_id``, whose handle is going away, handed
        out ``batches`` batches it did not append (see :attr:`WriterState.handed_off`).
        If some are still outstanding (not yet settled by others' appends or
        deletions), its lease is renewed at ``now_ms`` and lengthened to at least
        ``lease_ms`` (the client's hand-off lease), so GC keeps their parts while they
        travel to whoever appends them (the receiver's
        :meth:`persist.write.WriteHandle.hold` renews it further while it holds them);
        if none is, the writer is dropped at once.  A writer that is gone or whose lease
        ran out is never brought back.  Returns whether the state changed."""
        w = self.writers.get(writer_id)
        if w is None or w.expired(now_ms) or batches <= 0:
            return False
        handed = replace(w, handed_off=w.handed_off + batches)
        if handed.settled >= handed.handed_off:
            del self.writers[writer_id]
            return True
        self.writers[writer_id] = replace(
            handed,
            last_heartbeat_ms=max(w.last_heartbeat_ms, now_ms),
            lease_duration_ms=max(w.lease_duration_ms, lease_ms),
        )
        return True

    def release_handed_off(self, writer_id: str, batches: int = 1) -> bool:
        """Count ``batches`` batches with parts of ``writer_id`` that another writer
        appended (or whose decoded copies it deleted) as settled (see
        :attr:`WriterState.settled`); a handed-off writer is dropped once none is
        outstanding.  Returns whether anything changed."""
        w = self.writers.get(writer_id)
        if w is None or batches <= 0:
            return False
        w = replace(w, settled=w.settled + batches)
        if w.handed_off and w.settled >= w.handed_off:
            del self.writers[writer_id]
        else:
            self.writers[writer_id] = w
        return True

    def renew_writer(self, writer_id: str, now_ms: int) -> bool:
        """Renew the lease of a writer that is live at ``now_ms`` (keeping its lease
        duration), on behalf of whoever holds a batch of its parts.  A writer that is
        gone or whose lease ran out is never brought back (GC may have deleted its
        parts).  The heartbeat time never moves back (``max(old, now_ms)``).  Returns
        whether it was renewed (live at ``now_ms``)."""
        w = self.writers.get(writer_id)
        if w is None or w.expired(now_ms):
            return False
        self.writers[writer_id] = replace(w, last_heartbeat_ms=max(w.last_heartbeat_ms, now_ms))
        return True

    def apply_merge_res(self, res: FueledMergeRes, now_ms: int) -> ApplyMergeResult:
        """Swap a compaction result into the trace; blob keys it stops referencing are
        retired at ``now_ms`` (listed in ``retire_adds``, for GC after its grace period),
        and so are the ids of inline parts it merged away (``inline:`` and a nonce, see
        :attr:`~persist.types.PartRef.part_id`: an append refuses a copy of them until
        GC forgets them).

        An output whose parts name a writer (the compactor that wrote them) that is not
        live at ``now_ms`` is not applied (``NOT_APPLIED_NO_MATCH``): GC may already have
        deleted its parts."""
        for p in res.output.parts:
            wid = None if p.key is None else key_writer_id(p.key)
            if wid is not None and wid not in self.live_writers(now_ms):
                return ApplyMergeResult.NOT_APPLIED_NO_MATCH
        before = self.referenced_part_ids()
        result = self.trace.apply_merge_res(res)
        if result.applied():
            after = self.referenced_part_ids()
            for key in before - after:
                self.retire_adds[key] = now_ms
        return result

    def contains_batch(self, batch: HollowBatch) -> bool:
        """Whether the trace holds exactly this hollow batch (e.g. a merge result that
        an earlier attempt already applied)."""
        return any(b == batch for b in self.trace.batches())

    def forget_retired(self, retired: Mapping[str, int]) -> bool:
        """Remove rows (row key -> retirement ms, exactly as stored: see
        :class:`persist.consensus.RetiredKey`) from the retired collection, after GC
        deleted their blobs.  The caller must pass only rows present in the collection
        as of this version (GC checks ``retired_upper``); returns whether anything
        changed."""
        self.retire_removes.update(retired)
        return bool(retired)

    # ------------------------------------------------------------------- JSON
    def to_entries(self) -> dict[str, Any]:
        """The state flattened into one JSON value per component, keyed by a path:

        ``meta`` (``seqno``, ``since``, ``upper``, the trace's ``next_id`` and
        ``fueling_merges``: what changes with every version, kept in one entry),
        ``shard`` (id, name, schemas; ``value_schema`` the newest version),
        ``schemas`` (only once there is more than one version: every value schema
        version, by id), ``trace/hollow_batches/<id>``,
        ``trace/spine_batches/<id>``, ``reader/<id>``, ``writer/<id>``,
        (retired keys live in their own collection).  A new version differs from the
        previous one in
        ``meta`` and the few components that changed, so consensus writes little.
        """
        t = self.trace.to_json()
        meta = {k: v for k, v in t.items() if k not in _TRACE_MAPS}
        meta["seqno"] = self.seqno
        meta["retired_upper"] = self.retired_upper
        if self.tombstone:
            meta["tombstone"] = True
        out: dict[str, Any] = {
            _META: meta,
            _SHARD: _shard_entry(self.shard_id, self.name, self.key_schema, self.value_schema),
        }
        if len(self.schema_history) > 1:
            out[_SCHEMAS] = _schemas_entry(self.schema_history)
        for m in _TRACE_MAPS:
            for k, v in t[m].items():
                out[f"trace/{m}/{k}"] = v
        for rid, r in self.readers.items():
            out[_READER + rid] = r.to_json()
        for wid, w in self.writers.items():
            out[_WRITER + wid] = w.to_json()
        return out

    @classmethod
    def from_entries(cls, entries: Mapping[str, Any]) -> ShardState:
        """Inverse of :meth:`to_entries`.

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
                elif k not in (_SHARD, _META, _SCHEMAS):
                    raise ValueError(f"unknown state entry {k!r}")
            trace_json.update(maps)
            if isinstance(seqno, bool) or not isinstance(seqno, int):
                raise ValueError(f"seqno {seqno!r} is not an int")
            return cls(
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
            )
        except PersistError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PersistError(f"malformed shard state at seqno {seqno}: {e}") from e

    def to_json(self) -> dict[str, Any]:
        """One readable JSON document of this version (for inspection)."""
        return {
            "seqno": self.seqno,
            "shard_id": self.shard_id,
            "name": self.name,
            "since": self.since.to_json(),
            "upper": self.upper.to_json(),
            "key_schema": schema_to_json(self.key_schema),
            "value_schema": schema_to_json(self.value_schema),
            "schemas": list(_schemas_entry(self.schema_history)),
            "trace": self.trace.to_json(),
            "readers": {k: v.to_json() for k, v in sorted(self.readers.items())},
            "writers": {k: v.to_json() for k, v in sorted(self.writers.items())},
            "retired_upper": self.retired_upper,
            "tombstone": self.tombstone,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ShardState:
        """Inverse of :meth:`to_json`.

        Raises:
            PersistError: the document is malformed.
        """
        try:
            return cls(
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
            )
        except PersistError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PersistError(f"malformed shard state document: {e}") from e
