"""A table's history: one row per version that changed its contents, schema or
retention, newest first (:func:`history_table`), and time travel by wall-clock
timestamp (:func:`time_at`).

The records are written by the state machine with each version
(:mod:`persist.history_record`) into the shard's history log in the stash
(:meth:`persist.consensus.Consensus.history`), in the same atomic append, so a record
exists exactly for the versions that committed.  Versions that only renew, register or
expire leases have none (they are hidden); versions written before records existed
have none either (a shard created earlier shows its history from its first recorded
version on).

Invariants kept here: rows are newest first and their timestamps never increase going
down (never decrease from one version to the next); a timestamp resolves to the
logical time of the newest version committed at or before it, and a timestamp before
the first recorded commit, or resolving to a time before the since, is refused naming
the since.

Sources: Delta Lake's ``DESCRIBE HISTORY`` / delta-rs ``DeltaTable.history`` (version,
timestamp, operation, operationParameters, operationMetrics) and pyiceberg's snapshot
log (``Table.history()``, time travel by ``snapshot_as_of_timestamp``).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from persist.errors import InvalidUsage, SinceViolation
from stash import Antichain

__all__ = ["HISTORY_SCHEMA", "history_table", "time_at", "timestamp_ms"]

#: The columns of :func:`history_table`.
HISTORY_SCHEMA = pa.schema(
    [
        pa.field("version", pa.int64(), False),
        ("time", pa.int64()),
        pa.field("timestamp", pa.timestamp("ms", tz="UTC"), False),
        pa.field("operation", pa.string(), False),
        pa.field("parameters", pa.string(), False),
        pa.field("metrics", pa.string(), False),
    ]
)


def _json(v: Any) -> str:
    return json.dumps(v, sort_keys=True, separators=(",", ":"))


def history_table(records: Sequence[dict[str, Any]], limit: int | None = None) -> pa.Table:
    """``records`` (oldest first, as consensus returns them) as a table of
    :data:`HISTORY_SCHEMA`, newest first, at most ``limit`` rows.

    Raises:
        InvalidUsage: ``limit`` is not ``None`` or an int >= 0.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise InvalidUsage(f"limit must be None or an int >= 0, got {limit!r}")
    rows = sorted(records, key=lambda r: int(r["seqno"]), reverse=True)
    if limit is not None:
        rows = rows[:limit]
    return pa.table(
        {
            "version": [int(r["seqno"]) for r in rows],
            "time": [r.get("time") for r in rows],
            "timestamp": [int(r["ms"]) for r in rows],
            "operation": [str(r.get("op", "unknown")) for r in rows],
            "parameters": [_json(r.get("params") or {}) for r in rows],
            "metrics": [_json(r.get("metrics") or {}) for r in rows],
        },
        schema=HISTORY_SCHEMA,
    )


def timestamp_ms(when: dt.datetime, what: str) -> int:
    """A timezone-aware ``datetime`` as UTC milliseconds (rounded down).

    Raises:
        InvalidUsage: a naive ``datetime`` (naming ``what``).
    """
    if when.tzinfo is None or when.utcoffset() is None:
        raise InvalidUsage(
            f"{what}: as_of {when.isoformat()} is a naive datetime: give a timezone-aware "
            "one (e.g. datetime.now(timezone.utc))"
        )
    delta = when - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


def time_at(
    records: Sequence[dict[str, Any]], when: dt.datetime, since: Antichain, what: str
) -> int:
    """The logical time of the table as of the instant ``when``: the time of the newest
    recorded version committed at or before it.

    Raises:
        InvalidUsage: ``when`` is naive, or before the first recorded commit (naming
            the since).
        SinceViolation: the time it resolves to is before the since (naming both).
    """
    ms = timestamp_ms(when, what)
    found = None
    for r in records:
        if int(r["ms"]) <= ms and r.get("time") is not None:
            if found is None or int(r["seqno"]) > int(found["seqno"]):
                found = r
    if found is None:
        first = min((int(r["ms"]) for r in records if r.get("time") is not None), default=None)
        at = (
            "nothing was ever committed"
            if first is None
            else f"its first commit was at {_iso(first)}"
        )
        raise InvalidUsage(
            f"{what}: as_of {when.isoformat()} is before the table's first commit ({at}); "
            f"its since is {since}"
        )
    t = int(found["time"])
    if not since.less_equal(t):
        e = SinceViolation(t, since)
        e.args = (
            f"{what}: as_of {when.isoformat()} is time {t}, before the table's since "
            f"{since} (its data there was compacted away)",
        )
        raise e
    return t


def _iso(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat()
