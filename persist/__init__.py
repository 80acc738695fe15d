"""Persist: shards of ``((key, value), time, diff)`` updates stored as Parquet parts in a
blob store, their state versions kept in a stash collection.

Public names import from here, as ``from stash import Stash, Antichain`` does::

    from persist import PersistClient, UpperMismatch
    client = PersistClient(stash, "file:///tmp/blob")
    write, read = client.open("orders", key_schema, value_schema)

Invariants are stated by each module: :mod:`persist.state` (shard state and leases),
:mod:`persist.consensus` (versions by compare-and-set), :mod:`persist.write` /
:mod:`persist.read` (handles), :mod:`persist.compactor`, :mod:`persist.gc`,
:mod:`persist.spine` (the Spine), :mod:`persist.parts`, :mod:`persist.blob` and
:mod:`persist.txn` (transactions across shards and stash collections).
"""

from persist.app_txn import AppTransaction, StaleAppVersion
from persist.batch import Batch
from persist.blob import Blob, FileBlob, MemoryBlob, UnreliableBlob, open_blob
from persist.client import CompactionMode, PersistClient, RetryingBlob
from persist.compactor import CompactionReport, Compactor
from persist.consensus import Consensus, VersionedData
from persist.errors import (
    BatchAppended,
    BlobError,
    ConsensusError,
    CorruptPart,
    DiffOverflow,
    InvalidBatchBounds,
    InvalidBounds,
    InvalidKey,
    InvalidRewrite,
    InvalidUsage,
    PartsMissing,
    PersistError,
    SchemaMismatch,
    SinceViolation,
    UnknownShard,
    UpdateBeyondUpper,
    UpdateNotBeyondLower,
    UpperMismatch,
)
from persist.fetch import read_batch, read_batches
from persist.fsck import FsckReport, fsck
from persist.gc import GcReport, collect_garbage
from persist.machine import ShardMachine
from persist.merge_into import MergeBuilder, MergeResult
from persist.read import Listen, ListenEvent, ReadHandle
from persist.rows import ChangeContended, RowChanges
from persist.snapshots import snapshot_many
from persist.spine import ApplyMergeResult, FueledMergeReq, FueledMergeRes, Trace
from persist.state import LeaseExpired, ShardState
from persist.store_identity import StoreMismatch
from persist.table import Table
from persist.txn import Txn
from persist.txn_commit import TxnUpperMismatch
from persist.types import Description, HollowBatch, PartRef
from persist.write import BatchBuilder, WriteHandle

__all__ = [
    "MergeBuilder",
    "MergeResult",
    "ApplyMergeResult",
    "AppTransaction",
    "Batch",
    "ChangeContended",
    "BatchBuilder",
    "Blob",
    "BlobError",
    "CompactionMode",
    "CompactionReport",
    "Compactor",
    "Consensus",
    "ConsensusError",
    "CorruptPart",
    "DiffOverflow",
    "Description",
    "FileBlob",
    "FsckReport",
    "FueledMergeReq",
    "FueledMergeRes",
    "GcReport",
    "HollowBatch",
    "InvalidBatchBounds",
    "InvalidBounds",
    "InvalidKey",
    "InvalidRewrite",
    "InvalidUsage",
    "LeaseExpired",
    "Listen",
    "ListenEvent",
    "MemoryBlob",
    "BatchAppended",
    "PartsMissing",
    "PartRef",
    "PersistClient",
    "PersistError",
    "ReadHandle",
    "RowChanges",
    "RetryingBlob",
    "SchemaMismatch",
    "ShardMachine",
    "ShardState",
    "SinceViolation",
    "StaleAppVersion",
    "StoreMismatch",
    "Table",
    "Trace",
    "Txn",
    "TxnUpperMismatch",
    "UnknownShard",
    "UnreliableBlob",
    "UpdateBeyondUpper",
    "UpdateNotBeyondLower",
    "UpperMismatch",
    "VersionedData",
    "WriteHandle",
    "collect_garbage",
    "fsck",
    "open_blob",
    "read_batch",
    "read_batches",
    "snapshot_many",
]
