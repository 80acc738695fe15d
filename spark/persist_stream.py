"""The streaming reader of the ``persist`` Spark source (``spark.readStream``).

Invariants kept here: the first micro-batch is the snapshot at the start offset, later ones
the updates committed after it; offsets are ``{"as_of": t}`` and everything at times
``<= t`` has been delivered; the reader's lease holds the shard's since at the last
committed offset.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.types import StructType

from spark.persist_common import (
    DIFF,
    HEARTBEAT_SECONDS,
    TIME,
    PersistSourceError,
    ReadSettings,
    persist_client,
)
from spark.persist_planning import resolve_as_of
from spark.persist_reader import _to_output

log = logging.getLogger(__name__)


@dataclass
class StreamPartition(InputPartition):
    """A micro-batch range: the snapshot at ``as_of`` (``snapshot``) or the updates at
    times in ``(start, end]`` read through ``listen(start)``."""

    kind: str
    start: int
    end: int

    def __init__(self, kind: str, start: int, end: int) -> None:
        self.kind = kind
        self.start = start
        self.end = end


class PersistStreamReader(DataSourceStreamReader):
    """Micro-batches of a shard: its snapshot at ``as_of`` first, then what ``listen``
    sees. Lives in Spark's long-running driver-side Python process; holds a read lease
    whose since follows the committed offset."""

    def __init__(self, settings: ReadSettings, schema: StructType) -> None:
        self.settings = settings
        self.schema = schema
        self._handles: contextlib.ExitStack | None = None
        self._read: Any = None
        self._client: Any = None
        self._last_heartbeat = 0.0

    def _reader(self) -> Any:
        if self._read is None:
            s = self.settings
            if s.readonly:
                raise PersistSourceError(
                    f"persist shard {s.target.shard}: option readonly=true is for batch "
                    "reads; a stream holds a reader lease, which needs a writable stash"
                )
            stack = contextlib.ExitStack()
            client = stack.enter_context(persist_client(s.target))
            self._client = client
            read = stack.enter_context(
                client.open_reader(s.target.shard, s.key_schema, s.value_schema)
            )
            self._handles, self._read = stack, read
        return self._read

    def _upper(self) -> int | None:
        read = self._reader()
        now = time.monotonic()
        if now - self._last_heartbeat > HEARTBEAT_SECONDS:
            read.heartbeat()  # keep the lease (and its since hold) alive between batches
            self._last_heartbeat = now
        return read.fetch_recent_upper().as_option()  # type: ignore[no-any-return]

    def initialOffset(self) -> dict[str, Any]:
        self._reader()  # its since hold first: the since cannot pass the time decided on
        assert self._client is not None
        shard = self.settings.target.shard
        state = self._client.inspect(shard)
        as_of = resolve_as_of(state, self.settings.as_of, shard, self._client.blob)
        return {"as_of": -1 if as_of is None else as_of, "initial": True}

    def latestOffset(self, start: dict[str, Any], limit: Any = None) -> dict[str, Any]:
        upper = self._upper()
        latest = start["as_of"] if upper is None else max(upper - 1, start["as_of"])
        return {"as_of": latest, "initial": False}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        out: list[InputPartition] = []
        if start.get("initial") and start["as_of"] >= 0:
            out.append(StreamPartition("snapshot", start["as_of"], start["as_of"]))
        if end["as_of"] > start["as_of"]:
            out.append(StreamPartition("listen", start["as_of"], end["as_of"]))
        return out

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, StreamPartition)
        s = self.settings
        with (
            persist_client(s.target) as client,
            client.open_reader(s.target.shard, s.key_schema, s.value_schema) as read,
        ):
            if partition.kind == "snapshot":
                table = read.snapshot(partition.start)
                tables = [table]
            else:
                tables = list(_listen_between(read, partition.start, partition.end))
        cols = [*s.data_columns, TIME, DIFF]
        tables = [t.select(cols) for t in tables if t.num_rows]
        if not tables:
            return
        table = pa.concat_tables(tables)
        out = _to_output(table, self.schema, s.time_column, s.diff_column, s.target.shard)
        yield from out.to_batches(max_chunksize=64 * 1024)

    def commit(self, end: dict[str, Any]) -> None:
        """Everything up to ``end`` is processed: let the shard's since follow."""
        if end["as_of"] >= 0:
            read = self._reader()
            if read.since.less_than(end["as_of"]):
                read.downgrade_since(end["as_of"])
            self._last_heartbeat = time.monotonic()

    def stop(self) -> None:
        if self._handles is not None:
            self._handles.close()
        self._handles, self._read, self._client = None, None, None


def _listen_between(read: Any, start: int, end: int) -> Iterator[pa.Table]:
    """Updates at times in ``(start, end]`` from ``read.listen(start)``; stops once the
    listen's progress passes ``end`` (which planning guaranteed is already committed)."""
    with read.listen(start) as listen:
        for event in listen:
            if event.kind == "updates" and event.updates is not None:
                t = event.updates
                yield t.filter(pc.less_equal(t.column(TIME), end))
            elif event.kind == "progress":
                upper = event.progress.as_option() if event.progress is not None else None
                if upper is None or upper > end:
                    return


# ---------------------------------------------------------------- writing
