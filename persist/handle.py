"""What a shard's write and read handles have in common: the shard, its schemas, the
handle's id in the shard state, its lease length and whether it was expired.

Invariant kept here: once a handle is expired, every call that checks it raises
:class:`~persist.errors.InvalidUsage` naming the handle and the shard.
Source of the idea: persist-client's ``WriteHandle`` / ``ReadHandle`` (Materialize's
``src/persist-client/src/batch.rs``).
"""

from __future__ import annotations

from typing import ClassVar

import pyarrow as pa

from persist.context import PersistContext
from persist.errors import InvalidUsage
from persist.machine import ShardMachine
from persist.parts import updates_schema
from stash import Antichain


class ShardHandle:
    """Base of :class:`~persist.write.WriteHandle` and :class:`~persist.read.ReadHandle`.

    Attributes:
        shard_id: the shard's id.  name: its registered name.
        key_schema, value_schema: the schemas this handle was opened with
            (``pyarrow.Schema``; a registered version of the shard's, ``schema_id``);
            ``schema`` the updates schema (key columns, value columns, ``_time``,
            ``_diff``).
    """

    role: ClassVar[str] = "handle"
    #: The id of the value schema version this handle writes and reads with (set by
    #: the client when it opens the handle).
    schema_id: int = 0

    def __init__(
        self,
        ctx: PersistContext,
        machine: ShardMachine,
        name: str,
        handle_id: str,
        key_schema: pa.Schema,
        value_schema: pa.Schema,
        lease_seconds: float,
    ) -> None:
        self._ctx = ctx
        self._machine = machine
        self.shard_id = machine.shard_id
        self.name = name
        self._handle_id = handle_id
        self.key_schema = key_schema
        self.value_schema = value_schema
        self.schema = updates_schema(key_schema, value_schema)
        self._lease_ms = int(lease_seconds * 1000)
        self._expired = False

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(shard={self.name!r} {self.shard_id}, "
            f"{self.role}={self._handle_id})"
        )

    def _check(self) -> None:
        if self._expired:
            raise InvalidUsage(
                f"{self.role} {self._handle_id} of shard {self.shard_id} was expired"
            )

    def fetch_recent_upper(self) -> Antichain:
        """The shard's upper, freshly read from consensus."""
        return self._machine.recent().upper
