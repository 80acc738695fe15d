"""Consensus: a linearizable log of each shard's state versions, kept in a stash.

Each shard has one compare-and-set log of the stash (:mod:`stash.logs`, table ``logs``,
readable through the view ``stash_logs``), named ``persist.shard.<shard_id>``, whose
rows are a rollup and the diffs after it (after persist-client's consensus):

* a **rollup** row (``rollup`` true) at version ``r``: the state of version ``r`` as a
  canonical JSON object of entries, one per component of the state (see
  :meth:`persist.state.ShardState.to_entries`); the entry ``meta`` is an object holding
  that version's ``seqno``;
* one **diff** row per later version ``n`` (``r < n <= head``), at seqno ``n``, whose
  data ``{"del": [...], "seqno": n, "set": {...}}`` names the entries version ``n``
  removed and the texts of those it added or changed.

A new version is written by :meth:`Consensus.compare_and_set` as ONE conditional
``INSERT`` of its row at seqno ``expected + 1`` (no frontier rows, no consolidation):
a diff row (whatever the state's size), except for the first version and a diff
alone longer than :data:`MAX_DIFF_CHARS`.  Once the diffs after the rollup pass the
bound (:meth:`Consensus.rollup_due`: :attr:`Consensus.max_diffs` diffs adding up to
:data:`ROLLUP_SHARE` of the rollup's length, or diffs outweighing both the rollup and
:data:`MAX_DIFF_CHARS`), maintenance writes a rollup as a version of its own: the
head's state with the next seqno, as a rollup row, by its own compare-and-set
(:meth:`persist.machine.ShardMachine.write_rollup`, after Materialize's
``internal/state_versions.rs``), never inside a command's version, so a user's append
never pays for rewriting the whole state.  With no maintenance running the diffs stop
at twice the bound: the next version is written as a rollup itself, so a head read
stays bounded.  Two writers racing on the same seqno cannot both win: the loser gets
the stash's :class:`~stash.LogRaceLost` and nothing of its write is committed; it
catches up by reading only the rows after the version it had
(:meth:`Consensus.catch_up`).  The head is read from the latest rollup row on; the
rows before it are deleted by :meth:`Consensus.truncate`, its own transaction (after a
rollup commits, and from GC), never inside an append.

Blob keys retired by compaction (waiting for GC's grace period) live in a second
collection per shard, ``persist.retired.<shard_id>`` (key: blob key, value: retirement
ms), written in the same atomic stash ``append`` as the version that retired (or, for GC,
forgot) them; its upper is recorded in the state (``retired_upper``), so the version's
compare-and-set also orders the retired collection's changes.  Keeping them out of the
state keeps every version small however many parts wait for their grace period.

A registry collection, ``persist.shards`` (key: shard name, value ``{"shard_id": ...}``),
maps names to :class:`ShardId` strings; registering races resolve the same way.

The state machine of one shard in one process, which applies commands to a copy of the
cached state and publishes the next version here by compare-and-set, is
:class:`persist.machine.ShardMachine`; a transaction over several shards
(:mod:`persist.txn_commit`) builds the log entry and stash batches of each shard's staged
version with :meth:`Consensus.version_batches` and sends them, with any other stash
batches, as one :meth:`Consensus.append_atomic` (one database transaction): every shard's
seqno check and every other batch's lower check pass together or nothing is committed.

Invariants kept here: a version is only ever published on top of the version it was
computed from; the rows from the latest rollup on are exactly that rollup and the diffs
of the versions after it, contiguous (anything else reads as a corrupt log, never as a
state); a
caller is told "committed" only if the version is durable, "not committed" only if it
is not, and otherwise gets a :class:`ConsensusError` whose
``is_indeterminate()`` is true.

Sources: Materialize's Postgres consensus (``src/persist/src/postgres.rs``), its rollups
and diffs (``src/persist-client/src/internal/state_versions.rs``) and the stash's
``Append`` (``src/stash/src/lib.rs``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, TypeVar

from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)

from persist.errors import ConsensusError, InvalidUsage
from persist.ids import validate_shard_id
from persist.log_text import diff_text as _diff_text
from persist.log_text import entry_text
from persist.log_text import rollup_members as _rollup_members
from persist.log_text import rollup_text as _rollup_text
from persist.retired_keys import (
    RetiredChange,
    RetiredKey,
    parse_retired,
    retired_entry,
    retired_ids,
)
from persist.shard_registry import REGISTRY_COLLECTION, ShardRegistry
from stash import (
    AppendBatch,
    AppendLowerMismatch,
    LogRaceLost,
    Stash,
    StashCollection,
    StashError,
    logs,
)
from stash.antichain import Antichain
from stash.codec import canonical_json
from stash.logs import LogEntry, LogRow

__all__ = [
    "APP_TXN_COLLECTION_PREFIX",
    "REGISTRY_COLLECTION",
    "HISTORY_LOG_PREFIX",
    "HistoryAppend",
    "RETIRED_COLLECTION_PREFIX",
    "SHARD_COLLECTION_PREFIX",
    "RetiredChange",
    "RetiredKey",
    "Consensus",
    "DEFAULT_MAX_DIFFS",
    "Stored",
    "VersionPlan",
    "VersionedData",
    "diff_key",
    "retired_entry",
]

log = logging.getLogger(__name__)

SHARD_COLLECTION_PREFIX = "persist.shard."
RETIRED_COLLECTION_PREFIX = "persist.retired."
#: The prefix of a table's application transaction records (then the shard id;
#: :mod:`persist.app_txn`), written by persist alone.
APP_TXN_COLLECTION_PREFIX = "persist.app_txns."
#: A shard's history records are the entries of the log ``persist.history.<shard_id>``
#: (entry seqno: the record's index, the state's ``history_upper`` before it).
HISTORY_LOG_PREFIX = "persist.history."
META_KEY = "meta"
DIFF_PREFIX = "diff/"
#: A version whose diff entry would be longer than this (characters) is written as a
#: rollup instead (the diff of a big compaction or a large inline part).
MAX_DIFF_CHARS = 1 << 20
#: Past :attr:`Consensus.max_diffs` diffs, a version is still a diff while the diffs
#: add up to less than this share of the rollup's length.
ROLLUP_SHARE = 1 / 8
#: Diffs after a rollup before maintenance owes the next one (the default of
#: Materialize's ``persist_rollup_threshold``, the seqnos between rollups).  Each
#: rollup rewrites the whole state (tens of KB for a shard of a few hundred small
#: batches) while a diff is a few hundred bytes to a few KB: at 32, rollups were more
#: than half of the Postgres WAL a one-row append costs (``bench/bench_commit.py``'s
#: WAL-by-source table); at 128 a fresh process's head read decodes up to 128 diffs more
#: (see ``docs/scaling.md``).
DEFAULT_MAX_DIFFS = 128


T = TypeVar("T")
_MISSING = object()


@dataclass(frozen=True)
class Stored:
    """How a version is stored in its shard's collection (see the module docstring).

    Attributes:
        base: the rollup's entry texts by key (as stored: what a rollup retracts).
        diffs: the diff entries after the rollup, oldest first, as ``(key, text)``.
        diff_chars: the summed length of the diffs' texts.
        base_chars: the summed length of the rollup's texts (computed when omitted).
    """

    base: Mapping[str, str]
    diffs: tuple[tuple[str, str], ...] = ()
    diff_chars: int = 0
    base_chars: int = -1

    def __post_init__(self) -> None:
        if self.base_chars < 0:  # the summed length of the rollup's texts
            object.__setattr__(self, "base_chars", sum(len(t) for t in self.base.values()))


class VersionedData(NamedTuple):
    """One state version as stored: ``seqno``, the entries' JSON values by key, the
    entries' canonical JSON texts by key, and how the version is ``stored`` (``None``
    when unknown, e.g. a version a caller made: :meth:`Consensus.plan` then reads the
    layout from the head)."""

    seqno: int
    data: dict[str, Any]
    texts: dict[str, str]
    stored: Stored | None = None


@dataclass(frozen=True)
class VersionPlan:
    """The log entry that publishes version ``seqno`` of a shard
    (:meth:`Consensus.plan`), and how that version is stored once it commits.

    Attributes:
        seqno: the new version's seqno.
        entry: the row of the shard's log: a diff, or a rollup (``entry.rollup``).
        stored: the new version's :class:`Stored` layout.
    """

    seqno: int
    entry: LogEntry
    stored: Stored


@dataclass(frozen=True)
class HistoryAppend:
    """The history record written with one version: its index ``lower`` (the state's
    ``history_upper`` before the version: the seqno of its entry in the shard's history
    log), the record's key (its version's seqno, 20 digits) and value."""

    lower: int
    key: str
    record: Mapping[str, Any]


#: The log names of the shards seen (shard id -> its versions' and its history's log
#: names), their ids validated once (a regular expression match per command, else).
_LOG_NAMES: dict[str, tuple[str, str]] = {}


def _log_names(shard_id: str) -> tuple[str, str]:
    """``shard_id``'s versions' and history's log names.

    Raises:
        InvalidUsage: ``shard_id`` is not a ShardId.
    """
    names = _LOG_NAMES.get(shard_id) if type(shard_id) is str else None
    if names is None:
        validate_shard_id(shard_id)
        names = (SHARD_COLLECTION_PREFIX + shard_id, HISTORY_LOG_PREFIX + shard_id)
        if len(_LOG_NAMES) >= 4096:
            _LOG_NAMES.clear()
        _LOG_NAMES[shard_id] = names
    return names


def _wrap(e: StashError, what: str) -> ConsensusError:
    return ConsensusError(
        f"consensus {what} failed: {e.message}", indeterminate=e.is_indeterminate()
    )


class Consensus(ShardRegistry):
    """Shard state versions in a stash (see the module docstring).

    Args:
        stash: an open, writable :class:`stash.Stash` (``fenced=False`` so that several
            processes can share it; readonly works for reads).
        retries: attempts for a consensus call that fails with a transient (determinate)
            stash error, with exponential backoff; ``1`` means no retry.
        max_diffs: how many diff entries may follow a rollup before maintenance owes
            one (see the module docstring), once they add up to :data:`ROLLUP_SHARE`
            of the rollup's length (default :data:`DEFAULT_MAX_DIFFS`).  ``0`` writes
            every version as a rollup.

    Thread-safe.
    """

    def __init__(
        self, stash: Stash, *, retries: int = 4, max_diffs: int = DEFAULT_MAX_DIFFS
    ) -> None:
        if max_diffs < 0:
            raise InvalidUsage(f"max_diffs must be >= 0, got {max_diffs}")
        self.stash = stash
        self.retries = max(1, retries)
        self.max_diffs = max_diffs
        self._retired_colls: dict[str, StashCollection[Any, Any]] = {}
        self._lock = threading.Lock()
        self._registry: StashCollection[Any, Any] | None = None

    # ----------------------------------------------------------------- helpers
    @staticmethod
    def _retryable(e: BaseException) -> bool:
        return (
            isinstance(e, StashError)
            and not isinstance(e, AppendLowerMismatch)
            and not e.is_indeterminate()
            and not e.is_unrecoverable()
        )

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            try:
                return fn()  # the common case, without building a retry loop
            except StashError as e:
                if self.retries == 1 or not self._retryable(e):
                    raise
            r = Retrying(
                stop=stop_after_attempt(self.retries - 1),
                wait=wait_exponential_jitter(multiplier=0.005, max=0.5, jitter=0.005),
                retry=retry_if_exception(self._retryable),
                reraise=True,
            )
            return r(fn)
        except AppendLowerMismatch:
            raise
        except StashError as e:
            raise _wrap(e, what) from e

    def _cached_collection(
        self,
        cache: dict[str, StashCollection[Any, Any]],
        shard_id: str,
        name: str,
        value_codec: str,
        what: str,
    ) -> StashCollection[Any, Any]:
        validate_shard_id(shard_id)
        with self._lock:
            c = cache.get(shard_id)
        if c is None:
            c = self._call(
                f"opening {what} of shard {shard_id}",
                lambda: self.stash.collection(name, key="str", value=value_codec),
            )
            with self._lock:
                cache[shard_id] = c
        return c

    @staticmethod
    def log_name(shard_id: str) -> str:
        """The name of the stash log holding ``shard_id``'s versions."""
        return _log_names(shard_id)[0]

    def retired_collection(self, shard_id: str) -> StashCollection[Any, Any]:
        """The stash collection holding ``shard_id``'s retired blob keys."""
        return self._cached_collection(
            self._retired_colls,
            shard_id,
            RETIRED_COLLECTION_PREFIX + shard_id,
            "int",
            "the retired collection",
        )

    @staticmethod
    def history_log_name(shard_id: str) -> str:
        """The name of the stash log holding ``shard_id``'s history records (entry
        ``i``: the ``i``-th record, as canonical JSON; see :mod:`persist.history`)."""
        return _log_names(shard_id)[1]

    def history(self, shard_id: str) -> list[dict[str, Any]]:
        """The shard's history records, oldest first (``[]`` when it has none; reads
        write nothing, so a readonly stash works).

        Raises:
            ConsensusError: the stash failed.
        """
        name = self.history_log_name(shard_id)
        rows = self._call(
            f"reading the history of shard {shard_id}", lambda: logs.scan(self.stash, name)
        )
        return [dict(json.loads(r.data)) for r in rows]

    def _history_entry(self, shard_id: str, h: HistoryAppend) -> LogEntry:
        """The history log entry that writes ``h``, on top of the record before it, in
        the same transaction as its version (whose compare-and-set orders it)."""
        return LogEntry(
            self.history_log_name(shard_id),
            h.lower - 1 if h.lower else None,
            h.lower,
            canonical_json(dict(h.record)),
        )

    def retired(self, shard_id: str) -> dict[str, int]:
        """The shard's retired blob keys: key -> wall-clock ms of retirement."""
        _upper, rows = self.retired_entries(shard_id)
        return {k: r.ms for k, r in rows.items()}

    def retired_entries(self, shard_id: str) -> tuple[int, dict[str, RetiredKey]]:
        """The retired collection's upper and its rows by blob key or inline part id
        (the ids of one row each map to that row: :func:`persist.retired_keys.retired_ids`).  The upper is read
        first: if a state version whose ``retired_upper`` equals it is still the head
        when a transition commits, the rows were exactly these (what makes GC's
        "forget" idempotent)."""
        if shard_id not in self._retired_colls and self.stash.mode == "readonly":
            name = RETIRED_COLLECTION_PREFIX + shard_id
            if name not in self._call("listing collections", self.stash.collections):
                return 0, {}  # never written: nothing retired
        c = self.retired_collection(shard_id)
        up = self._call(f"upper of retired keys of shard {shard_id}", lambda: self.stash.upper(c))
        rows = self._call(f"reading retired keys of shard {shard_id}", lambda: self.stash.iter(c))
        acc: dict[tuple[str, int], int] = {}
        for (k, v), _t, d in rows:
            acc[(str(k), int(v))] = acc.get((str(k), int(v)), 0) + d
        out: dict[str, RetiredKey] = {}
        for (k, v), n in acc.items():
            if n > 0:
                r = parse_retired(k, v)
                for key in retired_ids(r):  # a row may hold several inline part ids
                    out[key] = r
        t = up.as_option()
        return (0 if t is None else t), out

    @staticmethod
    def encode(value: Any) -> str:
        """The canonical JSON text of a state entry (what the stash stores):
        :func:`persist.log_text.entry_text`, ``canonical_json``'s text in one call of
        the C encoder for an entry without floats."""
        return entry_text(value)

    # ---------------------------------------------------------------- versions
    def head(self, shard_id: str) -> VersionedData | None:
        """The latest version of the shard's state, or ``None`` if it has none.

        Raises:
            ConsensusError: the stash failed (after retries) or holds malformed entries.
        """
        name = self.log_name(shard_id)
        rows = self._call(f"head of shard {shard_id}", lambda: logs.head(self.stash, name))
        return self._assemble(shard_id, rows)

    def _assemble(self, shard_id: str, rows: list[LogRow]) -> VersionedData | None:
        """The version of the log rows ``rows`` (a rollup row and the diff rows after
        it), or ``None`` for no row."""
        if not rows:
            return None
        first = rows[0]
        if not first.rollup:
            raise _corrupt(shard_id, "it holds diff rows but no rollup")
        try:
            data = json.loads(first.data)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise _corrupt(shard_id, f"the rollup at seqno {first.seqno} is not a JSON object")
        texts = {k: canonical_json(v) for k, v in data.items()}
        seqno = _meta_seqno(shard_id, data)
        if seqno != first.seqno:
            raise _corrupt(shard_id, f"the rollup at seqno {first.seqno} holds version {seqno}")
        stored = Stored(dict(texts))
        if len(rows) > 1:
            diffs: dict[str, tuple[str, Any]] = {}
            for r in rows[1:]:
                try:
                    value = json.loads(r.data)
                except ValueError:
                    value = None
                diffs[diff_key(r.seqno)] = (r.data, value)
            stored = self._apply_diffs(shard_id, seqno, diffs, data, texts)
            seqno = _meta_seqno(shard_id, data)
        return VersionedData(seqno, data, texts, stored)

    @staticmethod
    def _apply_diffs(
        shard_id: str,
        seqno: int,
        diffs: dict[str, tuple[str, Any]],
        data: dict[str, Any],
        texts: dict[str, str],
        prior: Stored | None = None,
        changed: set[str] | None = None,
    ) -> Stored:
        """Apply the diff entries (key -> (text, value)) to version ``seqno`` (``data``
        and ``texts``, changed in place): its rollup, or a version stored as ``prior``
        (whose diffs the new ones extend); return the layout.  ``changed`` gets every
        entry key a diff set or removed.

        Raises:
            ConsensusError: the diffs are not exactly versions ``seqno + 1, ...`` in a
                row, or one is malformed (the log is corrupt)."""
        base = dict(texts) if prior is None else prior.base
        order = sorted(diffs)
        chars = 0
        for i, key in enumerate(order, start=1):
            text, value = diffs[key]
            want = seqno + i
            if key != diff_key(want):
                raise _corrupt(shard_id, f"diff entry {key!r} does not follow version {want - 1}")
            if (
                not isinstance(value, dict)
                or set(value) != {"del", "seqno", "set"}
                or value["seqno"] != want
                or isinstance(value["seqno"], bool)
                or not isinstance(value["set"], dict)
                or not isinstance(value["del"], list)
                or not all(isinstance(d, str) for d in value["del"])
                or META_KEY not in value["set"]
            ):
                raise _corrupt(shard_id, f"diff entry {key!r} is malformed")
            for d in value["del"]:
                if data.pop(d, _MISSING) is _MISSING:
                    raise _corrupt(shard_id, f"diff entry {key!r} removes a missing entry {d!r}")
                del texts[d]
            for k, v in value["set"].items():
                if k.startswith(DIFF_PREFIX):
                    raise _corrupt(shard_id, f"diff entry {key!r} sets entry {k!r}")
                data[k] = v
                texts[k] = canonical_json(v)
            if changed is not None:
                changed.update(value["del"])
                changed.update(value["set"])
            if _meta_seqno(shard_id, data) != want:
                raise _corrupt(shard_id, f"diff entry {key!r} sets another meta.seqno")
            chars += len(text)
        new = tuple((k, diffs[k][0]) for k in order)
        if prior is None:
            return Stored(base, new, chars)
        return Stored(base, prior.diffs + new, prior.diff_chars + chars, prior.base_chars)

    def catch_up(self, shard_id: str, prev: VersionedData) -> tuple[VersionedData, set[str]] | None:
        """The head, made from ``prev`` (a version as :meth:`head` or a plan stored it)
        and only the log rows after it, with the entry keys whose values differ from
        ``prev``'s (``prev`` itself and no key when there is no newer row).  What a
        writer that lost a race needs (Materialize's persist-client
        ``internal/apply.rs`` fetches only the diffs after its cached seqno).

        Newer rows that are all diffs are applied to ``prev``.  When they hold a rollup
        (at seqno ``r``; the last one if several), the rollup is version ``r`` in full:
        its entries are split from the row's text without decoding the state
        (:func:`_rollup_members`), an entry whose text equals ``prev``'s is unchanged,
        and the diffs after ``r`` are applied to it; the rows before ``r`` (truncated
        or not) are superseded and not read.  The layout is then the rollup's.

        ``None`` when the rows are not that (newer diffs not exactly the versions after
        ``prev`` or after the rollup in a row: a gap, or a log truncated past ``prev``
        with no rollup; a malformed row): the caller then reads the whole head
        (:meth:`head`), which tells a corrupt log apart.

        Raises:
            ConsensusError: the stash failed (after retries).
        """
        if prev.stored is None:
            return None
        name = self.log_name(shard_id)
        rows = self._call(
            f"diffs of shard {shard_id} after seqno {prev.seqno}",
            lambda: logs.scan(self.stash, name, prev.seqno + 1),
        )
        if not rows:
            return prev, set()  # a head never moves back: ``prev`` is still the head
        last = max((i for i, r in enumerate(rows) if r.rollup), default=-1)
        if last < 0 and rows[0].seqno != prev.seqno + 1:
            return None
        diffs: dict[str, tuple[str, Any]] = {}
        for r in rows[last + 1 :]:
            try:
                diffs[diff_key(r.seqno)] = (r.data, json.loads(r.data))
            except ValueError:
                return None
        changed: set[str] = set()
        if last < 0:
            # dict.copy clones the table in C (dict(d) re-inserts every key).
            data = prev.data.copy() if type(prev.data) is dict else dict(prev.data)
            texts = prev.texts.copy() if type(prev.texts) is dict else dict(prev.texts)
            seqno, prior = prev.seqno, prev.stored
        else:
            rollup = rows[last]
            got = _rollup_members(rollup.data, prev.texts, prev.data)
            if got is None:
                return None
            data, texts, changed = got
            seqno, prior = rollup.seqno, None
            try:
                if _meta_seqno(shard_id, data) != seqno:
                    return None
            except ConsensusError:
                return None
            if not diffs:
                return VersionedData(seqno, data, texts, Stored(dict(texts))), changed
        try:
            stored = self._apply_diffs(shard_id, seqno, diffs, data, texts, prior, changed)
        except ConsensusError:
            return None
        return VersionedData(rows[-1].seqno, data, texts, stored), changed

    def head_seqno(self, shard_id: str) -> int | None:
        """The latest seqno (cheap: one indexed read of the log), or ``None``."""
        name = self.log_name(shard_id)
        return self._call(
            f"head seqno of shard {shard_id}", lambda: logs.head_seqno(self.stash, name)
        )

    def plan(
        self,
        shard_id: str,
        expected: int | None,
        new: Mapping[str, str],
        prev: VersionedData | Mapping[str, str] | None = None,
        touched: Collection[str] | None = None,
    ) -> VersionPlan:
        """The stash updates that publish version ``expected + 1`` (``0`` when
        ``expected`` is ``None``) on top of ``prev``, and how it will be stored: one diff
        entry, or a rollup: for the first version, when the diffs after ``prev``'s
        rollup would pass twice the bound of :meth:`rollup_due` (nobody wrote the
        rollup that maintenance owed: a head read stays bounded), or when the diff
        alone would be longer than
        :data:`MAX_DIFF_CHARS`.  A rollup is only ever built on the stored layout of
        ``prev``: when ``prev`` is given without it (texts alone, a
        :class:`VersionedData` without ``stored``), the layout is read from the head
        (if the head is not ``expected``, no plan is made: one made now could commit later,
        once the head reached ``expected``, on a layout it never saw).

        Args:
            shard_id: the shard.
            expected: the seqno ``new`` was computed from, ``None`` for the first.
            new: the new version's entries as canonical JSON texts by key; ``new["meta"]``
                must be an object whose ``seqno`` is ``expected + 1``.
            prev: the ``expected`` version as :meth:`head` returned it (or as a previous
                plan stored it), or its entry texts (required unless ``expected`` is
                ``None``).
            touched: the keys that may differ between ``prev`` and ``new`` (every key
                changed, added or removed is among them), if the caller knows them
                (:meth:`persist.state.ShardState.to_entries_delta`): only those are
                compared, so a diff costs what changed, not the state's size.

        Raises:
            InvalidUsage: ``new`` has no ``meta`` entry, or an entry key in the diffs'
                namespace (``diff/``), or ``prev`` comes without its layout while the
                head is not ``expected``.
            ConsensusError: reading the head failed.
        """
        if META_KEY not in new:
            raise InvalidUsage(f"a consensus version needs a {META_KEY!r} entry with its seqno")
        for k in new if touched is None else touched:
            if k.startswith(DIFF_PREFIX):
                raise InvalidUsage(f"state entry {k!r} is in the diffs' namespace")
        seqno = 0 if expected is None else expected + 1
        if expected is None:
            texts: Mapping[str, str] = {}
            stored = Stored({})
        elif isinstance(prev, VersionedData) and prev.stored is not None:
            texts, stored = prev.texts, prev.stored
        else:
            # The layout of the expected version is not known (texts alone, or a
            # version made without it): learn it from the head, which must be it.
            head = self.head(shard_id)
            if head is None or head.seqno != expected or head.stored is None:
                raise _NotAtHead(
                    f"cannot plan version {seqno} of shard {shard_id} without the stored "
                    f"layout of version {expected}: the head is "
                    f"{'empty' if head is None else f'version {head.seqno}'}"
                )
            texts, stored = head.texts, head.stored
        name = self.log_name(shard_id)
        if expected is not None and self.max_diffs > 0:
            text = _diff_text(texts, new, seqno, touched)
            chars = stored.diff_chars + len(text)
            n = len(stored.diffs) + 1
            if len(text) <= MAX_DIFF_CHARS and not self._past(n, chars, stored.base_chars, 2):
                dk = diff_key(seqno)
                return VersionPlan(
                    seqno,
                    LogEntry(name, expected, seqno, text, False),
                    Stored(stored.base, (*stored.diffs, (dk, text)), chars, stored.base_chars),
                )
        return self.plan_rollup(shard_id, expected, new)

    def plan_rollup(
        self, shard_id: str, expected: int | None, new: Mapping[str, str]
    ) -> VersionPlan:
        """The plan that publishes version ``expected + 1`` (entry texts ``new``) as a
        rollup row (see :meth:`plan`; maintenance writes one with a version that
        changes nothing but the seqno, :meth:`persist.machine.ShardMachine.write_rollup`)."""
        seqno = 0 if expected is None else expected + 1
        rollup = LogEntry(self.log_name(shard_id), expected, seqno, _rollup_text(new), True)
        return VersionPlan(seqno, rollup, Stored(dict(new)))

    def _past(self, n: int, chars: int, base_chars: int, k: int) -> bool:
        """Whether ``n`` diffs of ``chars`` characters after a rollup of ``base_chars``
        pass ``k`` times the bound: :attr:`max_diffs` diffs adding up to
        :data:`ROLLUP_SHARE` of the rollup, or more than the rollup and
        :data:`MAX_DIFF_CHARS` (what a head read costs beyond the state)."""
        return (
            n > k * self.max_diffs and chars >= k * base_chars * ROLLUP_SHARE
        ) or chars > k * max(base_chars, MAX_DIFF_CHARS)

    def rollup_due(self, stored: Stored) -> bool:
        """Whether the diffs of a version stored as ``stored`` passed the bound, so
        maintenance should write a rollup (a version that changes nothing but its
        seqno, as its own compare-and-set; Materialize's ``RoutineMaintenance``
        ``write_rollup``).  Past twice the bound :meth:`plan` writes the next
        version as a rollup itself, so a head read stays bounded when no maintenance
        runs."""
        if self.max_diffs == 0 or not stored.diffs:
            return False
        return self._past(len(stored.diffs), stored.diff_chars, stored.base_chars, 1)

    def compare_and_set(
        self,
        shard_id: str,
        expected: int | None,
        new: Mapping[str, str],
        prev: VersionedData | Mapping[str, str] | None = None,
        retired: RetiredChange | None = None,
        *,
        plan: VersionPlan | None = None,
        history: HistoryAppend | None = None,
    ) -> bool:
        """Publish the version ``expected + 1`` (``0`` when ``expected`` is ``None``) if the
        head is still ``expected``.

        Args:
            shard_id: the shard.
            expected: the seqno the new version was computed from, ``None`` for the first.
            new: the new version's entries as canonical JSON texts by key; ``new["meta"]``
                must be an object whose ``seqno`` is ``expected + 1`` (``0`` for the first).
            prev: the ``expected`` version (required unless ``expected`` is ``None``), as
                :meth:`head` returned it, or its entry texts (see :meth:`plan`).
            retired: changes to the retired collection committed atomically with the
                version (``new`` must record the collection's new upper, ``lower + 1``).
            plan: :meth:`plan`'s result for these arguments, if the caller made it
                already (it learns how the version is stored from it).
            history: the version's history record, written atomically with it
                (``new`` must record the history log's new length).

        Returns: ``True`` if committed, ``False`` if the head was not ``expected`` (a lost
            race: nothing was committed).

        Raises:
            InvalidUsage: as :meth:`plan` (a ``prev`` without its layout that is not the
                head is a lost race instead: ``False``).
            ConsensusError: the stash failed (after retries); ``is_indeterminate()`` tells
                whether the version may nevertheless have been committed.
        """
        if plan is None:
            try:
                plan = self.plan(shard_id, expected, new, prev)
            except _NotAtHead:
                return False  # the head is not ``expected``: nothing to commit
        batches: list[AppendBatch] = []
        if retired is not None:
            batches.append(self._retired_batch(shard_id, retired))
        entry = plan.entry
        entries = [entry]  # the version first: its race is the one reported
        if history is not None:
            entries.append(self._history_entry(shard_id, history))
        try:
            self._call(
                f"compare_and_set of shard {shard_id} at seqno {plan.seqno}",
                lambda: logs.write(self.stash, entries, batches),
            )
        except LogRaceLost as e:
            if e.collection == entry.name:
                return False
            raise ConsensusError(
                f"the history log of shard {shard_id} is out of step with its state: {e}"
            ) from e
        except AppendLowerMismatch as e:
            raise ConsensusError(
                f"the retired collection of shard {shard_id} is out of step with its state: {e}"
            ) from e
        self._after_commit([entry])
        return True

    def _after_commit(self, entries: list[LogEntry]) -> None:
        """Maintenance after a commit, in transactions of their own: the rows before a
        rollup just written are deleted (a failure is logged: GC truncates again)."""
        for e in entries:
            if e.rollup and e.seqno > 0:
                try:
                    self._call(
                        f"truncate of {e.name}",
                        partial(logs.truncate, self.stash, e.name, e.seqno),
                    )
                except ConsensusError as err:
                    log.warning("truncate of %s below seqno %d failed: %s", e.name, e.seqno, err)

    def version_batches(
        self,
        shard_id: str,
        expected: int,
        new: Mapping[str, str],
        prev: VersionedData | Mapping[str, str],
        retired: RetiredChange | None = None,
        *,
        plan: VersionPlan | None = None,
        history: HistoryAppend | None = None,
    ) -> list[AppendBatch | LogEntry]:
        """The log entry and stash batches that publish version ``expected + 1`` of
        ``shard_id`` on top of ``expected`` (what :meth:`compare_and_set` writes),
        without writing them: a multi-shard transaction (:mod:`persist.txn_commit`)
        sends several shards' entries, and batches of other collections, in one
        :meth:`append_atomic`.

        Args: as :meth:`compare_and_set` (``expected`` is never ``None`` here).
        """
        if plan is None:
            plan = self.plan(shard_id, expected, new, prev)
        out: list[AppendBatch | LogEntry] = [plan.entry]
        if retired is not None:
            out.append(self._retired_batch(shard_id, retired))
        if history is not None:
            out.append(self._history_entry(shard_id, history))
        return out

    def _retired_batch(self, shard_id: str, retired: RetiredChange) -> AppendBatch:
        """The stash batch that records ``retired``'s changes to the shard's retired
        blob keys (additions and removals at ``retired.lower``), appended in the same
        stash transaction as the version that retired them."""
        rc = self.retired_collection(shard_id)
        rb = AppendBatch(
            collection=rc,
            lower=Antichain.from_elem(retired.lower),
            upper=Antichain.from_elem(retired.lower + 1),
            compact=Antichain.from_elem(retired.lower),
            timestamp=retired.lower,
        )
        for k, ms in retired.adds.items():
            rc.append_to_batch(rb, k, ms, 1)
        for k, ms in retired.removes.items():
            rc.append_to_batch(rb, k, ms, -1)
        return rb

    def append_atomic(self, batches: Sequence[AppendBatch | LogEntry], what: str) -> str | None:
        """Write ``batches`` (several shards' versions from :meth:`version_batches`, and
        any other stash batches) in ONE stash transaction (:func:`stash.logs.write`):
        all commit or none does.

        Returns: ``None`` if committed, else the name of the shard log
            (``persist.shard.<id>``) whose head check or of the collection whose lower
            check failed (nothing was committed).

        Raises:
            ConsensusError: the stash failed (after retries of transient, determinate
                errors); ``is_indeterminate()`` tells whether it may have committed.
        """
        entries = [b for b in batches if isinstance(b, LogEntry)]
        stash_batches = [b for b in batches if isinstance(b, AppendBatch)]
        try:
            self._call(what, lambda: logs.write(self.stash, entries, stash_batches))
        except AppendLowerMismatch as e:
            return str(e.collection)
        self._after_commit(entries)
        return None

    def scan(self, shard_id: str, from_seqno: int = 0) -> list[VersionedData]:
        """Versions with seqno ``>= from_seqno`` that can be read.  Only the head can:
        the versions between the rollup and the head are kept only as the diffs that
        lead to it, and a rollup truncates every version before it; so this is the head
        alone (or nothing)."""
        h = self.head(shard_id)
        return [] if h is None or h.seqno < from_seqno else [h]

    def versions(self, shard_id: str) -> list[VersionedData]:
        """Every version from the latest rollup on, oldest first: the rollup and one per
        diff row after it (versions before the rollup are gone), each assembled as
        :meth:`head` assembles the latest; ``[]`` for a shard with no state.

        Raises:
            ConsensusError: the stash failed or holds malformed entries.
        """
        name = self.log_name(shard_id)
        rows = self._call(f"versions of shard {shard_id}", lambda: logs.head(self.stash, name))
        out: list[VersionedData] = []
        for n in range(1, len(rows) + 1):
            v = self._assemble(shard_id, rows[:n])
            if v is not None:
                out.append(v)
        return out

    def truncate(self, shard_id: str) -> None:
        """Delete the rows of versions before the head's rollup (its own transaction,
        never part of an append); the rollup and the diffs after it stay."""
        name = self.log_name(shard_id)
        rows = self._call(f"head of shard {shard_id}", lambda: logs.head(self.stash, name))
        if rows and rows[0].rollup and rows[0].seqno > 0:
            below = rows[0].seqno
            self._call(
                f"truncate of shard {shard_id}", lambda: logs.truncate(self.stash, name, below)
            )


class _NotAtHead(InvalidUsage):
    """:meth:`Consensus.plan` was given a version without its layout that is not the
    head (``compare_and_set`` reports that as a lost race)."""


def diff_key(seqno: int) -> str:
    """The key of version ``seqno``'s diff entry (zero-padded: keys sort as seqnos)."""
    return f"{DIFF_PREFIX}{seqno:020d}"


def _corrupt(shard_id: str, what: str) -> ConsensusError:
    return ConsensusError(f"consensus log of shard {shard_id} is corrupt: {what}")


def _meta_seqno(shard_id: str, data: Mapping[str, Any]) -> int:
    meta = data.get(META_KEY)
    seqno = meta.get("seqno") if isinstance(meta, dict) else None
    if isinstance(seqno, bool) or not isinstance(seqno, int):
        raise _corrupt(shard_id, "no meta.seqno entry")
    return seqno
