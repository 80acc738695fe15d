"""Persist's error types.

Every error persist raises on purpose is a :class:`PersistError`.  Invariants kept here:

* an operation that raised one of these committed nothing (the shard's state is the one
  before the call) unless the error says ``is_indeterminate()``;
* messages name the shard, blob key or bound that broke the rule.

Names follow Materialize's persist-client (``src/persist-client/src/batch.rs``): ``InvalidUsage``
and its cases (``UpdateNotBeyondLower``, ``UpdateBeyondUpper``, ``InvalidBounds``,
``InvalidBatchBounds``, ``InvalidRewrite``), plus ``UpperMismatch`` and
``SinceViolation``.
"""

from __future__ import annotations

from stash import Antichain


class PersistError(Exception):
    """Base class of every error persist raises on purpose.

    Attributes:
        idempotency_token: set on an indeterminate error of ``compare_and_append`` /
            ``compare_and_append_batch``: pass it back as ``idempotency_token=`` to retry
            the same append idempotently (``None`` otherwise).
    """

    idempotency_token: str | None = None

    def is_indeterminate(self) -> bool:
        """True when the outcome of a commit cannot be known."""
        return False


class InvalidUsage(PersistError):
    """The caller broke a rule of the API (bad bounds, bad schema, bad time)."""


class UnknownShard(InvalidUsage):
    """No shard has the name given.  The message offers the registered names closest to
    it (``difflib.get_close_matches``), if any: ``no shard named 'ordrs' — did you mean
    'orders'?``.

    Attributes: ``name`` (the name looked up), ``close`` (the close names, best first).
    """

    def __init__(self, name: str, close: list[str]) -> None:
        self.name = name
        self.close = close
        hint = f" — did you mean {' or '.join(map(repr, close))}?" if close else ""
        super().__init__(f"no shard named {name!r}{hint}")


class SchemaMismatch(InvalidUsage):
    """A shard was opened with a schema that is not a compatible evolution of its
    newest registered one, or a value read under an older
    reader's schema does not fit it.  Nothing was committed.

    Compatible: adding a nullable value column, dropping a value column, widening a
    value column's type (int8 -> int16 -> int32 -> int64, float32 -> float64,
    ``string`` <-> ``large_string``), making a value column nullable; the key schema
    never changes and kept value columns keep their relative order.

    Attributes: ``shard`` (the shard's name or id), ``column`` (the column that broke
    the rule), ``rule`` (the rule broken, in words).
    """

    def __init__(self, shard: str, column: str, rule: str, detail: str = "") -> None:
        self.shard = shard
        self.column = column
        self.rule = rule
        super().__init__(
            f"schema of shard {shard}: column {column!r}: {rule}"
            + (f"; {detail}" if detail else "")
        )


class UpdateNotBeyondLower(InvalidUsage):
    """An update's time is less than the batch's lower.

    Attributes: ``time`` (int), ``lower`` (Antichain).
    """

    def __init__(self, time: int, lower: Antichain) -> None:
        self.time = time
        self.lower = lower
        super().__init__(f"update time {time} is not beyond the batch lower {lower}")


class UpdateBeyondUpper(InvalidUsage):
    """An update's time is not less than the batch's upper.

    Attributes: ``time`` (int), ``upper`` (Antichain).
    """

    def __init__(self, time: int, upper: Antichain) -> None:
        self.time = time
        self.upper = upper
        super().__init__(f"update time {time} is not less than the batch upper {upper}")


class InvalidBounds(InvalidUsage):
    """``lower`` is not ``<=`` ``upper``."""

    def __init__(self, lower: Antichain, upper: Antichain) -> None:
        self.lower = lower
        self.upper = upper
        super().__init__(f"invalid bounds: lower {lower} is not <= upper {upper}")


class InvalidBatchBounds(InvalidUsage):
    """A batch's bounds do not fit the append (e.g. batches not contiguous)."""


class InvalidRewrite(InvalidUsage):
    """``Batch.rewrite_ts`` was asked for a frontier/upper it cannot honour."""


class UpperMismatch(PersistError):
    """``compare_and_append`` lost a race: the shard's upper is not the expected one.

    Attributes: ``expected`` and ``current`` (Antichain). Nothing was committed.
    """

    def __init__(self, expected: Antichain, current: Antichain) -> None:
        self.expected = expected
        self.current = current
        super().__init__(f"upper mismatch: expected {expected}, current upper is {current}")


class SinceViolation(PersistError):
    """A read ``as_of`` a time that the shard's since has already passed.

    Attributes: ``as_of`` (int), ``since`` (Antichain).
    """

    def __init__(self, as_of: int, since: Antichain) -> None:
        self.as_of = as_of
        self.since = since
        super().__init__(f"as_of {as_of} is not beyond the shard's since {since}")


class CorruptPart(PersistError):
    """A part's bytes do not match its checksum or are not valid Parquet.

    Attributes: ``key`` (the blob key, or ``"<inline>"``); ``missing`` (True when the
    blob store has no object at the key, as opposed to bad bytes).
    """

    def __init__(self, key: str, reason: str, missing: bool = False) -> None:
        self.key = key
        self.missing = missing
        super().__init__(f"corrupt part {key}: {reason}")


class PartsMissing(PersistError):
    """A batch cannot be appended: some of its parts are not in the blob store (deleted
    by hand, or by GC after its writer's lease ran out).  Nothing was committed.

    Attributes: ``keys`` (the missing blob keys).
    """

    def __init__(self, shard_id: str, keys: list[str]) -> None:
        self.keys = keys
        shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        super().__init__(
            f"cannot append to shard {shard_id}: the batch's part(s) {shown} are missing "
            "from the blob store; nothing was committed (write the batch again)"
        )


class DiffOverflow(InvalidUsage):
    """The diffs of one row (equal key, value and time) sum beyond the int64 range, so
    it has no count to report.  Raised by a read (and a compaction) that consolidates
    them; each update's diff fits, their sum does not.  Nothing is changed.

    Attributes: ``row`` (the row's key and value columns and ``_time``, as Python
    values), ``shard`` (the shard's name and id, once known; else ``None``).
    """

    def __init__(self, row: dict[str, object], shard: str | None = None) -> None:
        self.row = row
        self.shard = shard
        where = f"shard {shard}: " if shard else ""
        super().__init__(
            f"{where}the diffs of the row {row} sum beyond the int64 range "
            f"[-2**63, 2**63 - 1]: the updates written for it cannot be counted; "
            "retract what was written in error"
        )

    def in_shard(self, shard: str) -> DiffOverflow:
        """The same error naming ``shard``."""
        return DiffOverflow(self.row, shard)


class BatchAppended(InvalidUsage):
    """A batch cannot be appended: the shard already references some of its parts (or
    did, before a compaction), so it is a copy of a batch already appended (e.g. its
    transmittable bytes decoded twice) and its updates would count twice.  Nothing was
    committed; the copy is marked consumed (deleting it would delete parts the shard
    references).

    Attributes: ``keys`` (the parts already appended: blob keys, or ``inline:`` and
    the nonce of an inline part, see :attr:`persist.types.PartRef.part_id`).
    """

    def __init__(self, shard_id: str, keys: list[str]) -> None:
        self.keys = keys
        super().__init__(
            f"a batch appended to shard {shard_id} was already appended: its part "
            f"{keys[0]} is referenced by the shard (or was, before a compaction); a "
            "batch (or each decoding of its transmittable bytes) may be appended once: "
            "nothing was committed"
        )


class BlobError(PersistError):
    """A blob store call failed (I/O error, injected fault, invalid key)."""


class InvalidKey(BlobError, ValueError):
    """A blob key or shard name breaks the naming rules (would escape the blob root)."""


class ConsensusError(PersistError):
    """A consensus (stash) call failed; ``is_indeterminate()`` follows the stash error."""

    def __init__(self, message: str, indeterminate: bool = False) -> None:
        self._indeterminate = indeterminate
        super().__init__(message)

    def is_indeterminate(self) -> bool:
        return self._indeterminate
