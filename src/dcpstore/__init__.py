"""dcpstore: PyTorch Distributed Checkpoint (DCP) to object storage.

``ObjectStoreWriter`` / ``ObjectStoreReader`` plug into ``dcp.save`` /
``dcp.load``; ``AsyncCheckpointer`` is the training-loop API: it stages
shards, uploads them in the background, commits each step by writing its
``.metadata`` last, and reuses save plans across saves and restarts.
"""

import importlib
from typing import TYPE_CHECKING

# Imported on first use (PEP 562), so that ``dcpstore ls`` and ``--help``
# do not pay for torch's start-up: name -> the submodule that defines it.
_EXPORTS = {
    **dict.fromkeys(("AsyncCheckpointer", "SaveHandle", "SaveStats"), "checkpointer"),
    **dict.fromkeys(
        (
            "BucketNotFoundError", "CheckpointExistsError", "CheckpointLoadError", "CheckpointNotFoundError",
            "CheckpointSaveError", "CheckpointTimeoutError", "CommitOutcomeUnknownError", "ConditionalWriteError",
            "CorruptCheckpointError", "DcpstoreError",
            "ObjectNotFoundError", "StateDictMismatchError", "StorageAccessError", "ThrottledError",
            "TransientStorageError", "UnpicklableValueError", "UnsafeCheckpointError", "UnsupportedByStoreError",
        ),
        "errors",
    ),
    "StepNaming": "layout",
    "PlanCache": "plan_cache",
    **dict.fromkeys(("ALL_LOCAL_PLANS_KEY", "PLANS_KEY", "read_checksums", "read_plans"), "planner_data"),
    "ObjectStoreReader": "reader",
    **dict.fromkeys(("RetryPolicy", "TransferConfig", "open_store"), "storage"),
    "ObjectStoreWriter": "writer",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dcpstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from .checkpointer import AsyncCheckpointer, SaveHandle, SaveStats
    from .errors import (
        BucketNotFoundError,
        CheckpointExistsError,
        CheckpointLoadError,
        CheckpointNotFoundError,
        CheckpointSaveError,
        CheckpointTimeoutError,
        CommitOutcomeUnknownError,
        ConditionalWriteError,
        CorruptCheckpointError,
        DcpstoreError,
        ObjectNotFoundError,
        StateDictMismatchError,
        StorageAccessError,
        ThrottledError,
        TransientStorageError,
        UnpicklableValueError,
        UnsafeCheckpointError,
        UnsupportedByStoreError,
    )
    from .layout import StepNaming
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
    "CheckpointLoadError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "CheckpointTimeoutError",
    "CommitOutcomeUnknownError",
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
    "StepNaming",
    "StorageAccessError",
    "ThrottledError",
    "TransferConfig",
    "TransientStorageError",
    "UnpicklableValueError",
    "UnsafeCheckpointError",
    "UnsupportedByStoreError",
    "open_store",
    "read_checksums",
    "read_plans",
]
