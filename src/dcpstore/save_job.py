"""One save as the background pipeline carries it: what it is (``SaveJob``) and what it cost (``SaveStats``).

``AsyncCheckpointer.save`` makes both on the training thread; the save
pipeline and the commit protocol fill them in on the background thread.
``SaveStats`` is public (``SaveHandle.stats``, ``result()``).
"""

from __future__ import annotations

import dataclasses

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from .staging import StagedItems


@dataclasses.dataclass
class SaveStats:
    """What one save cost; filled in as the save progresses."""

    step: int
    blocking_s: float = 0.0  # time save() held the training thread
    exists_check_s: float = 0.0  # waiting for staged copies, and the HEAD that refuses a committed step early
    planning_s: float = 0.0  # flag all-reduce, plus plan exchange when not cached
    plan_reused: bool = False
    metadata_patched: bool = False  # the coordinator wrote .metadata over the last one's bytes (metadata_template)
    upload_s: float = 0.0
    commit_s: float = 0.0
    staged_bytes: int = 0
    staged_items: int = 0  # with a cached plan, only the items this rank writes
    host_bytes: int = 0  # host memory the staging pool holds, as allocated
    pinned_bytes: int = 0  # of it, pinned
    device_stall_s: float = 0.0  # how long a training stream waited for the device-to-host copies (CUDA events)
    copied_bytes: int = 0  # incremental: stored bytes the bucket copied from the last commit instead of this rank sending them
    copy_requests: int = 0  # the UploadPartCopy requests that did it


@dataclasses.dataclass
class SaveJob:
    step: int
    url: str
    planner: SavePlanner | None
    local_plan: SavePlan | None
    staged: StagedItems | None
    stats: SaveStats
    error: BaseException | None = None  # staging failed: the job only tells the peers
    nonce: str = ""  # agreed by every rank before the upload; .metadata carries it
    # The shortest collective timeout any rank of the job was given, agreed with the nonce: how soon a
    # peer may stop waiting for the coordinator, so what the coordinator's put_deadline keeps (commit_protocol).
    group_timeout_s: float | None = None
