"""The checks every stash transaction makes before its work: that each collection handle
it writes through is this stash's, and that each collection it decodes or encodes with
still records the handle's codecs (``TypedCollection.migrate`` may have changed them).

Invariants kept here: the checks run inside the transaction they guard and before
anything else in it, so a stale or foreign handle's read raises instead of misdecoding
and its write commits nothing; they cost no query of their own (the identity, name and
codec names come from the statement that reads a collection's frontiers or takes its
lock, see :mod:`stash.txn`); a write locks its collections in id order first.

Source: the rules of :class:`stash.base.Stash` (its module docstring lists them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from stash.collection import StashCollection
from stash.errors import FenceError, StashError
from stash.txn import Txn

R = TypeVar("R")


def with_codec_check(
    fn: Callable[[Txn], R],
    codecs: Sequence[StashCollection[Any, Any]],
    write: bool,
    handles: Sequence[StashCollection[Any, Any]],
    check_handles: Callable[[Txn, Sequence[StashCollection[Any, Any]]], None],
) -> Callable[[Txn], R]:
    """``fn`` preceded, in its transaction, by the checks of ``Stash._write`` and
    ``Stash._read``: for a write, the collections of ``codecs`` and ``handles`` locked
    (in id order) and their handles checked (``check_handles``, see
    :func:`check_handles_tx`); then the codecs of ``codecs`` checked
    (:func:`check_codecs_tx`).  Just ``fn`` when there is nothing to check."""
    if not codecs and not (write and handles):
        return fn
    if len(codecs) == 1 and not handles:
        (c,) = codecs

        def one(tx: Txn) -> R:
            if write:
                tx.lock([c.id])
                check_handles(tx, codecs)
            check_codecs_tx(tx, c, write)
            return fn(tx)

        return one
    decoded = list({c.id: c for c in codecs}.values())
    written = [*codecs, *handles]
    ids = sorted({c.id for c in written})

    def many(tx: Txn) -> R:
        if write:
            tx.lock(ids)
            check_handles(tx, written)
        for c in decoded:
            check_codecs_tx(tx, c, write)
        return fn(tx)

    return many


def check_handles_tx(
    tx: Txn,
    handles: Sequence[StashCollection[Any, Any]],
    *,
    savepoint_of: str | None,
    handle_url: str,
) -> None:
    """Refuse a write through a handle another stash made: its collection id would
        name some other collection here (or none).  A handle is this stash's when it
        carries this stash's identity (``tx.stash_id()``, read in the write's transaction
        with its fence check or lock) and its collection here has the handle's name (a
        savepoint handle also takes the handles of the stash it copied, ``savepoint_of``, by
    id and name; ``handle_url`` is this stash's redacted URL, for the message).
        The identity and the name come from the statement that read the collection's
        frontiers or took its lock: no query of their own.

        Raises:
            StashError: naming the collection, both stashes (URLs redacted) and their
                identities, or the name the id has here; nothing was committed.
    """
    for c in handles:
        try:
            here: str | None = tx.collection_name(c.id)
        except FenceError:
            raise
        except StashError:
            here = None  # no collection of this id here
        sid = tx.stash_id()
        if c.stash_id is None:
            why = "its handle carries no stash identity (make handles with Stash.collection)"
        elif c.stash_id not in (sid, savepoint_of):
            why = f"its handle was made by stash {c.stash_url} (stash id {c.stash_id})"
        elif here != c.name:
            why = f"its handle's id {c.id} is " + (
                "no collection here" if here is None else f"collection {here} here"
            )
        else:
            continue
        raise StashError(
            f"write to collection {c.name} (id {c.id}) refused, nothing committed: "
            f"{why}; this stash is {handle_url} (stash id {sid})"
        )


def check_codecs_tx(tx: Txn, c: StashCollection[Any, Any], write: bool) -> None:
    """Refuse a read or write through a handle whose codecs are no longer the
    collection's (``TypedCollection.migrate``, through any handle, recorded others
    since the handle was made): it would decode the new encoding with the old codecs,
    or write entries of the old encoding.  ``tx.codecs`` answers from the statement
    that read the frontiers or took the lock: no query of its own.

    Raises:
        StashError: naming the collection and both codec pairs (for a write: nothing
            was committed).
    """
    found = tx.codecs(c.id)
    mine = c.codec_names
    if found != mine:
        raise StashError(
            f"collection {c.name} now has codecs (key={found[0]}, value={found[1]}) "
            f"(migrated since this handle was opened), but this handle has "
            f"(key={mine[0]}, value={mine[1]}): open it again with its codecs"
            + ("; nothing was committed" if write else "")
        )
