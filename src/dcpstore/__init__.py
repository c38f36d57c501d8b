"""dcpstore: PyTorch Distributed Checkpoint (DCP) to object storage.

``ObjectStoreWriter`` / ``ObjectStoreReader`` plug into ``dcp.save`` /
``dcp.load``; ``AsyncCheckpointer`` is the training-loop API: it stages
shards, uploads them in the background, commits each step by writing its
``.metadata`` last, and reuses save plans across saves and restarts.
"""

from .checkpointer import AsyncCheckpointer, SaveHandle, SaveStats
from .errors import (
    BucketNotFoundError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CheckpointTimeoutError,
    ConditionalWriteError,
    CorruptCheckpointError,
    DcpstoreError,
    ObjectNotFoundError,
    StateDictMismatchError,
    StorageAccessError,
    TransientStorageError,
    UnsafeCheckpointError,
    UnsupportedByStoreError,
)
from .plan_cache import PlanCache
from .planner_data import ALL_LOCAL_PLANS_KEY, PLANS_KEY, read_checksums, read_plans
from .reader import ObjectStoreReader
from .storage import RetryPolicy, TransferConfig, open_store
from .writer import ObjectStoreWriter

__all__ = [
    "ALL_LOCAL_PLANS_KEY",
    "AsyncCheckpointer",
    "BucketNotFoundError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CheckpointTimeoutError",
    "ConditionalWriteError",
    "CorruptCheckpointError",
    "DcpstoreError",
    "ObjectNotFoundError",
    "ObjectStoreReader",
    "ObjectStoreWriter",
    "PLANS_KEY",
    "PlanCache",
    "RetryPolicy",
    "SaveHandle",
    "SaveStats",
    "StateDictMismatchError",
    "StorageAccessError",
    "TransferConfig",
    "TransientStorageError",
    "UnsafeCheckpointError",
    "UnsupportedByStoreError",
    "open_store",
    "read_checksums",
    "read_plans",
]
