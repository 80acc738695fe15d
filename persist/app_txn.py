"""Application transactions of a table: exactly-once appends across retries, processes
and writer leases, as Delta Lake's ``SetTransaction`` action gives them.

A writer that feeds a table from a source with its own progress (a stream's batch id, a
queue's offset) names each write with an :class:`AppTransaction` ``(app_id, version)``.
The table keeps, per app id, the record of the newest version committed
(:class:`AppTxnRecord`: the version, the time the rows were committed at, their count and
fingerprint), and the append that writes the rows writes the record in the same atomic
step.  A write whose version is not above the app id's committed one writes nothing:

* the same version is a retry of a write that landed (after an indeterminate error, from
  another process, after the writer's lease ran out): it returns the time recorded,
  without writing again.  Its rows must be the ones recorded, in any order (their
  fingerprint as a multiset, :func:`rows_fingerprint`, as conformed to the table's
  schema; after another writer evolved the schema, as conformed back to the version
  the write was recorded under, :func:`earlier_fingerprints`), else
  :class:`~persist.errors.InvalidUsage`: an ``(app_id, version)`` names one write;
* a lower version is refused with :class:`StaleAppVersion` (naming the app id, the
  version and the committed one; nothing is written).  Delta's writers skip it
  silently; here it is refused, since its result (the time its rows were committed at)
  is no longer kept: only the newest version per app id is, as Delta keeps only the
  newest ``SetTransaction`` per ``appId``.  Catch it to skip.

Only ``append`` takes an app transaction.  The row changes (``upsert``, ``delete``,
``update``, ``merge``) plan on the version they commit on: an upsert of the same rows
or a delete of the same filter, run again after it landed, changes nothing more (unless
another writer changed those rows meanwhile) and so writes nothing; an ``update`` or
``merge`` whose values are expressions of the old row is not idempotent (read
:meth:`persist.table.Table.history` before running it again).

Where the records live: a stash collection of the shard's own,
``persist.app_txns.<shard id>`` (key: the app id; value: the record's JSON), written in
the same stash append as the shard's version (:meth:`persist.txn.Txn.stash_append`).
So the records are kept apart from every writer lease and from the shard's landed
records (which are pruned): a writer's expiry, a hand-off or GC never drop them.  An
append of no rows records its version alone (a stash append of the record; no shard
version, as a change that changes nothing writes none).  A dropped table's records
stay behind in its collection (a table made again under the name has another shard id,
so other records).

Invariants kept here:

* decided against committed state: the decision (write, retry, stale) is made on the
  collection read at its upper ``U`` (the upper read first, then the app id's record),
  and the write's batch has lower ``U``: if any write of the table recorded an app
  transaction since, the stash append commits nothing (its lower check fails) and the
  decision is made again on the collection as it is then.  So two writers with one
  ``(app_id, version)`` never both land, whichever of them retries, and an attempt left
  in flight by a lost acknowledgement cannot land beside its retry;
* one live record per app id; a record names a version >= 0 and the time (int) its
  rows were committed at; a record that is not so raises
  :class:`~persist.errors.ConsensusError` naming the collection, the app id and the
  rule broken (never a bare ``KeyError``).

Sources of the idea: the Delta Lake protocol's transaction identifiers (the
``txn`` action: ``appId``, ``version``, ``lastUpdated``); delta-spark's idempotent
writes (the ``txnAppId`` / ``txnVersion`` writer options: a write whose version is not
above the committed one is skipped); delta-rs's ``CommitProperties(app_transactions=
[Transaction(app_id, version)])`` and ``DeltaTable.transaction_version(app_id)``
(``python/deltalake/transaction.py``, ``python/deltalake/table.py``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa

from persist.consensus import APP_TXN_COLLECTION_PREFIX
from persist.errors import ConsensusError, InvalidUsage
from persist.fingerprint import updates_fingerprint
from stash import Antichain, AppendBatch, AppendLowerMismatch, StashCollection

if TYPE_CHECKING:
    from persist.context import PersistContext
    from persist.updates import SchemaHistory

__all__ = [
    "APP_TXN_COLLECTION_PREFIX",
    "AppTransaction",
    "AppTxnLog",
    "AppTxnRecord",
    "Seen",
    "StaleAppVersion",
    "check_app_id",
    "earlier_fingerprints",
    "rows_fingerprint",
]

_T = TypeVar("_T")

#: The largest app id, in characters.
APP_ID_MAX = 255


@dataclass(frozen=True)
class AppTransaction:
    """The name of one write of an application: ``app_id`` (a printable str of 1 to 255
    characters, e.g. a streaming query's id) and ``version`` (an int >= 0 that grows
    with every write of that app, e.g. a batch id or an offset).  delta-rs's
    ``Transaction(app_id, version)``; delta-spark's ``txnAppId`` / ``txnVersion``.

    Raises:
        InvalidUsage: ``app_id`` or ``version`` breaks those rules.
    """

    app_id: str
    version: int

    def __post_init__(self) -> None:
        a, v = check_app_id(self.app_id), self.version
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**63:
            raise InvalidUsage(
                f"app transaction {a!r}: version must be an int in [0, 2**63), got {v!r}"
            )


def check_app_id(app_id: Any) -> str:
    """``app_id`` if it is an app id: a printable str of 1 to :data:`APP_ID_MAX`
    characters (the one rule of :class:`AppTransaction` and
    :meth:`persist.table.Table.transaction_version`).

    Raises:
        InvalidUsage: naming the value and the rule.
    """
    a = app_id
    if not isinstance(a, str) or not 1 <= len(a) <= APP_ID_MAX or not a.isprintable():
        shown = repr(a) if len(repr(a)) <= 80 else repr(a)[:77] + "..."
        raise InvalidUsage(
            f"app transaction: app_id must be a printable str of 1 to {APP_ID_MAX} "
            f"characters, got {shown}"
        )
    return a


class StaleAppVersion(InvalidUsage):
    """A write named ``(app_id, version)`` whose version is below the newest one
    committed for ``app_id`` (``committed``): nothing was written.  Delta's writers skip
    such a write; catch this to do the same."""

    def __init__(self, table: str, app_id: str, version: int, committed: int) -> None:
        super().__init__(
            f"table {table!r}: app transaction {app_id!r} version {version} is below the "
            f"version committed for it, {committed}: that write was committed before or "
            "superseded (nothing was written; only the newest version of an app id is "
            "kept, so its result is not known)"
        )
        self.app_id, self.version, self.committed = app_id, version, committed


@dataclass(frozen=True)
class AppTxnRecord:
    """The newest committed write of one app id.

    Attributes:
        app_id: the app id.
        version: its version (int >= 0).
        time: the time the write's rows were committed at (int).
        rows: how many rows it wrote.
        fingerprint: the fingerprint of its rows (:func:`rows_fingerprint`).
        ms: the writing process's clock when it committed (ms since the epoch;
            informational, Delta's ``lastUpdated``).
    """

    app_id: str
    version: int
    time: int
    rows: int
    fingerprint: str
    ms: int

    def to_json(self) -> dict[str, Any]:
        """The collection value: ``{"version", "time", "rows", "fingerprint", "ms"}``."""
        return {
            "version": self.version,
            "time": self.time,
            "rows": self.rows,
            "fingerprint": self.fingerprint,
            "ms": self.ms,
        }

    @classmethod
    def from_json(cls, app_id: str, value: Any, where: str) -> AppTxnRecord:
        """The record of ``app_id`` stored as ``value`` in collection ``where``.

        Raises:
            ConsensusError: ``value`` is not :meth:`to_json`'s form (naming the
                collection, the app id and the rule broken).
        """

        def ok_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if (
            not isinstance(value, dict)
            or not ok_int(value.get("version"))
            or value["version"] < 0
            or not ok_int(value.get("time"))
            or not ok_int(value.get("rows"))
            or not isinstance(value.get("fingerprint"), str)
            or not ok_int(value.get("ms"))
        ):
            raise ConsensusError(
                f"stash collection {where!r}: the record of app id {app_id!r} is "
                f"{_show(value)}, not an object with int 'version' >= 0, int 'time', int "
                "'rows', str 'fingerprint' and int 'ms' (it was not written by persist)"
            )
        return cls(
            app_id,
            value["version"],
            value["time"],
            value["rows"],
            value["fingerprint"],
            value["ms"],
        )


def _show(value: Any) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 200 else text[:197] + "..."


def rows_fingerprint(rows: pa.Table) -> str:
    """The fingerprint of a write's rows as a multiset (the table's key and value
    columns, as conformed to its schema): the rows sorted by every column, then
    :func:`persist.fingerprint.updates_fingerprint` with no bounds (32 hex digits after
    a version letter).  So a retry that makes the same rows in another order (a
    source read again, a parallel job's output) names the same write.  Rows equal
    but for the sign of a zero or a NaN's payload may sort either way: a retry of such
    rows in another order is refused, never taken for other rows."""
    if rows.num_rows > 1:
        with contextlib.suppress(pa.ArrowNotImplementedError, pa.ArrowTypeError):
            rows = rows.sort_by([(n, "ascending") for n in rows.column_names])
    return updates_fingerprint(Antichain(), Antichain(), rows)


def earlier_fingerprints(rows: pa.Table, history: SchemaHistory, schema_id: int) -> Iterator[str]:
    """The fingerprints (:func:`rows_fingerprint`) ``rows``, conformed to schema version
    ``schema_id`` of ``history``, had as a write of each earlier version: the same
    rows as a writer of that version made them, the columns added since left out and
    each column cast back to its type then.  A version is passed over when a column of
    its was dropped since (its values cannot be told), when ``rows`` hold a value in a
    column added since (no write of that version made it), or when a value does not
    cast back exactly.  So a retry after the schema evolved finds the write recorded
    under an earlier version (newest first)."""
    versions = history.versions
    for i in range(schema_id - 1, -1, -1):
        if history.dropped_after(i):
            continue
        kept = set(versions[i].names)
        added = [n for n in versions[schema_id].names if n not in kept]
        if any(rows.column(n).null_count != rows.num_rows for n in added):
            continue
        schema = pa.schema([*history.key_schema, *versions[i]])
        try:
            old = rows.select(schema.names).cast(schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, ValueError):
            continue  # ValueError: a null in a column not nullable then
        yield rows_fingerprint(old)


@dataclass(frozen=True)
class Seen:
    """An app id's record as read at the collection's upper (``batch.lower``), and the
    batch that writes its next record under that lower check."""

    record: AppTxnRecord | None
    raw: Any  # the stored value of ``record`` (retracted by the next record)
    collection: StashCollection[Any, Any]
    lower: Antichain
    upper: Antichain
    compact: Antichain
    timestamp: int

    def batch(self, app: AppTransaction, time: int, rows: int, fp: str, ms: int) -> AppendBatch:
        """The batch that records ``app`` as committed at ``time`` (retracting the
        record read), appended under the lower check of the read."""
        b = AppendBatch(
            collection=self.collection,
            lower=self.lower,
            upper=self.upper,
            compact=self.compact,
            timestamp=self.timestamp,
        )
        if self.record is not None:
            self.collection.append_to_batch(b, app.app_id, self.raw, -1)
        rec = AppTxnRecord(app.app_id, app.version, time, rows, fp, ms)
        self.collection.append_to_batch(b, app.app_id, rec.to_json(), 1)
        return b


class AppTxnLog:
    """The app transaction records of one table (see the module docstring).

    Args:
        ctx: the client's context (its stash and consensus' retrying calls).
        shard_id: the table's shard id.
        table: the table's name (for messages).
    """

    def __init__(self, ctx: PersistContext, shard_id: str, table: str) -> None:
        self._ctx = ctx
        self.table = table
        self.name = APP_TXN_COLLECTION_PREFIX + shard_id

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        return self._ctx.consensus._call(f"table {self.table!r}: {what}", fn)

    def _collection(self, create: bool) -> StashCollection[Any, Any] | None:
        stash = self._ctx.stash
        if not create or stash.mode == "readonly":
            listed = self._call("listing collections", stash.collections)
            if self.name not in listed:
                if create:
                    raise InvalidUsage(
                        f"table {self.table!r}: an app transaction needs a writable "
                        "stash (this one is readonly)"
                    )
                return None
        return self._call(
            "opening its app transactions",
            lambda: stash.collection(self.name, key="str", value="json"),
        )

    def _record(
        self, coll: StashCollection[Any, Any], app_id: str
    ) -> tuple[AppTxnRecord | None, Any]:
        """``(record, stored value)`` of ``app_id`` (``(None, None)``: none): what its
        rows sum to, whatever times they are kept at (a retention on the collection
        keeps a replaced record and its retraction apart)."""
        rows = self._call(
            f"reading app transaction {app_id!r}",
            lambda: self._ctx.stash.iter_key(coll, app_id),
        )
        sums: dict[str, tuple[Any, int]] = {}
        for v, _t, d in rows:
            text = json.dumps(v, sort_keys=True)
            sums[text] = (v, sums.get(text, (v, 0))[1] + d)
        live = [(v, d) for v, d in sums.values() if d != 0]
        if not live:
            return None, None
        if len(live) > 1 or live[0][1] != 1:
            raise ConsensusError(
                f"stash collection {self.name!r}: app id {app_id!r} has "
                f"{[(_show(v), d) for v, d in live]} (value, multiplicity); it must have "
                "one record of multiplicity 1 (it was not written by persist)"
            )
        raw = live[0][0]
        return AppTxnRecord.from_json(app_id, raw, self.name), raw

    def committed(self, app_id: str) -> AppTxnRecord | None:
        """The record of ``app_id``'s newest committed write, or ``None`` (read now;
        writes nothing).

        Raises:
            ConsensusError: the stash failed, or the record is malformed.
        """
        coll = self._collection(create=False)
        if coll is None:
            return None
        return self._record(coll, app_id)[0]

    def read(self, app_id: str) -> Seen:
        """``app_id``'s record read at the collection's upper (read first), and what
        the batch writing its next record needs (the collection is made if missing).

        Raises:
            InvalidUsage: the stash is not writable.  ConsensusError: the stash failed,
                or the record is malformed.
        """
        coll = self._collection(create=True)
        assert coll is not None
        probe = self._call(
            "reading its app transactions' upper", lambda: coll.make_batch(self._ctx.stash)
        )
        record, raw = self._record(coll, app_id)
        return Seen(record, raw, coll, probe.lower, probe.upper, probe.compact, probe.timestamp)

    def settle(
        self,
        app: AppTransaction,
        record: AppTxnRecord,
        fp: str,
        earlier: Callable[[], Iterable[str]] = tuple,
    ) -> int:
        """The result of a write of ``app`` when ``record`` (of ``app.app_id``) is at or
        beyond its version: the time recorded (the same write, retried: its
        fingerprint ``fp``, or one of ``earlier()``, the fingerprints of its rows under
        the table's earlier schema versions, :func:`earlier_fingerprints`).

        Raises:
            StaleAppVersion: ``app.version`` is below the record's.
            InvalidUsage: the same version with other rows (another fingerprint).
        """
        if app.version < record.version:
            raise StaleAppVersion(self.table, app.app_id, app.version, record.version)
        if fp != record.fingerprint and record.fingerprint not in earlier():
            raise InvalidUsage(
                f"table {self.table!r}: app transaction {app.app_id!r} version "
                f"{app.version} was committed at time {record.time} with other rows "
                f"({record.rows} rows, fingerprint {record.fingerprint}; these are "
                f"fingerprint {fp}): an (app_id, version) names one write, retried with "
                "the same rows (nothing was written)"
            )
        return record.time

    def record_alone(
        self, seen: Seen, app: AppTransaction, time: int, fp: str, now_ms: Callable[[], int]
    ) -> int:
        """Record ``app`` (read in ``seen``) as committed at ``time`` with no rows, in a
        stash append of its own (the shard is not written: a write of no rows changes
        nothing); a lost race decides again on the records as they are then.  Returns
        the time recorded.

        Raises:
            StaleAppVersion, InvalidUsage: as :meth:`settle`.  ConsensusError: the stash
                failed (``is_indeterminate()``: call again, the record tells).
        """
        while True:
            batch = seen.batch(app, time, 0, fp, now_ms())
            try:
                self._call(
                    f"recording app transaction {app.app_id!r}",
                    partial(self._ctx.stash.append, [batch]),
                )
                return time
            except AppendLowerMismatch:
                seen = self.read(app.app_id)
                if seen.record is not None and seen.record.version >= app.version:
                    return self.settle(app, seen.record, fp)
