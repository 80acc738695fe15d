"""The stash's error type.

Every failure the stash reports is a :class:`StashError` (or a subclass), whose ``str()``
starts with ``stash error: ``.  Invariants kept here:

* ``is_unrecoverable()`` is true only for fencing (:class:`FenceError`): retrying with the
  same handle can never succeed;
* ``is_indeterminate()`` is true only when the outcome of a commit cannot be known
  (:class:`IndeterminateError`); such an error is never reported as success or as a plain
  failure;
* no message ever carries a password (URLs are rendered with the password hidden).

Source of the idea: Materialize's stash's ``StashError`` (``src/stash/src/lib.rs``).
"""

from __future__ import annotations

PREFIX = "stash error: "


class StashError(Exception):
    """A stash operation failed; ``str()`` is ``"stash error: <message>"``.

    Attributes:
        message: the message without the ``stash error: `` prefix.
    """

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(PREFIX + message)

    def __str__(self) -> str:
        return PREFIX + self.message

    def is_unrecoverable(self) -> bool:
        """True only for fencing errors: this handle can never succeed again."""
        return False

    def is_indeterminate(self) -> bool:
        """True when the outcome of the operation (a COMMIT) cannot be known."""
        return False


class FenceError(StashError):
    """This handle was fenced by a newer leader (a later epoch); unrecoverable."""

    def is_unrecoverable(self) -> bool:
        return True


class IndeterminateError(StashError):
    """The connection was lost during COMMIT: the change may or may not be durable."""

    def is_indeterminate(self) -> bool:
        return True


class PeekSinceUpperError(StashError):
    """A peek was asked of a collection whose since is not less than its upper.

    Attributes:
        since: the collection's since in the state version the peek read (an
            ``Antichain``; ``None`` when not known).
        upper: the collection's upper in that same version (an ``Antichain``):
            ``{0}`` means nothing was ever appended.  Decide on these, not on a second
            read, which may see another writer's later append.
    """

    def __init__(self, message: str, since: object = None, upper: object = None) -> None:
        super().__init__(message)
        self.since = since
        self.upper = upper

    def never_written(self) -> bool:
        """Whether the peek read a collection nothing was ever appended to (upper
        ``{0}``)."""
        as_option = getattr(self.upper, "as_option", None)
        return as_option is not None and as_option() == 0


class AppendLowerMismatch(StashError):
    """An ``append`` batch's lower did not match the collection's upper (a lost race).

    Attributes:
        collection: the collection's name.
        expected: the batch's lower (an ``Antichain``).
        current: the collection's current upper (an ``Antichain``).
    """

    def __init__(self, message: str, collection: str, expected: object, current: object) -> None:
        super().__init__(message)
        self.collection = collection
        self.expected = expected
        self.current = current


class LogRaceLost(AppendLowerMismatch):
    """A compare-and-set log's head was not the expected one (a lost race; nothing of the
    write was committed); see :mod:`stash.logs`.

    Attributes:
        collection: the log's name (as :class:`AppendLowerMismatch` names a collection).
        expected: the head seqno the write expected (``None``: an empty log).
        current: ``None`` (the head is not read again; :func:`stash.logs.head` tells).
    """

    def __init__(self, name: str, expected: int | None) -> None:
        super().__init__(
            f"log {name}: the head is not the expected seqno "
            f"{'(an empty log)' if expected is None else expected}; another writer won",
            name,
            expected,
            None,
        )


class UniquenessViolation(StashError):
    """A :class:`~stash.table.TableTransaction` change would leave two rows whose values
    break the uniqueness rule, or insert a key that is there already (``str()`` starts
    ``stash error: uniqueness violation``).

    Attributes:
        collection: the collection's name (``None`` for a transaction over plain data).
        key: the key of the row being written.
        existing_key: the key of the row it collides with (``key`` itself when the key
            exists already).
    """

    def __init__(self, collection: str | None, key: object, existing_key: object, why: str) -> None:
        where = f"collection {collection}" if collection is not None else "table transaction"
        super().__init__(
            f"uniqueness violation: {why} ({where}: key {key!r}, existing key {existing_key!r});"
            " nothing was changed"
        )
        self.collection = collection
        self.key = key
        self.existing_key = existing_key


class ReadOnlyError(StashError):
    """A mutation was attempted through a handle opened with ``mode="readonly"``."""


class MigrationRequired(StashError):
    """The database's schema is behind the code's alembic head."""
