"""The paths a row-level change can take, as interchangeable functions, for tests that
run one change through each and compare (differential tests).

A path is a function ``(client, writer, op) -> RowChanges`` applying one change to the
shard of ``writer`` (a :class:`persist.WriteHandle` of ``client``); an op is
``("upsert", rows)``, ``("delete", filter)`` or ``("update", filter, set)``.  A path
may refuse a change by raising, as the handle does (``InvalidUsage``...).

:data:`PATHS` lists them by name: the handle (:meth:`persist.WriteHandle.upsert` ...)
and a transaction (:meth:`persist.Txn.upsert` ..., one change per transaction).  Other
layers add theirs (e.g. Spark's ``PersistTable``) by appending to a copy of the list.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from persist import PersistClient, RowChanges
from persist.write import WriteHandle

Op = tuple[Any, ...]
Path = Callable[[PersistClient, WriteHandle, Op], RowChanges]


def handle_path(client: PersistClient, w: WriteHandle, op: Op) -> RowChanges:
    """The change through the write handle."""
    kind = op[0]
    if kind == "upsert":
        return w.upsert(op[1])
    if kind == "delete":
        return w.delete(op[1])
    return w.update(op[1], op[2])


def txn_path(client: PersistClient, w: WriteHandle, op: Op) -> RowChanges:
    """The change in a transaction of its own, by the handle (committed at the
    smallest valid time)."""
    kind = op[0]
    with client.begin() as txn:
        if kind == "upsert":
            txn.upsert(w, op[1])
        elif kind == "delete":
            txn.delete(w, op[1])
        else:
            txn.update(w, op[1], op[2])
    (changes,) = txn.row_changes()
    return changes


#: The paths, by name (``pytest.mark.parametrize`` over it, or loop).
PATHS: list[tuple[str, Path]] = [("handle", handle_path), ("txn", txn_path)]
