"""The save-plan cache: plan once, then reuse, across saves and across restarts.

DCP planning gathers every rank's local plan on a coordinator, builds the
global plan and metadata there, and scatters the result: two object
collectives whose cost grows with the state dict and the world size.  As long
as the state-dict structure (fqns, shapes, dtypes, shard offsets) stays the
same on every rank, the result is the same too, so the checkpointer keeps it
here and a later save only all-reduces one "my plan is unchanged" flag.

After a restart, ``fill_from_metadata`` rebuilds the cache from the local
plans persisted in the checkpoint's ``planner_data``: every rank holds every
rank's plan, so each can redo the (deterministic, local) global step on its
own, and the first save after the restart needs no planning collective.
"""

from __future__ import annotations

import dataclasses
import logging

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from . import planner_data

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class CachedPlan:
    local_plan: SavePlan  # this rank's local plan, storage_data stripped
    central_plan: SavePlan  # this rank's plan after global planning, with its storage prefix
    world_size: int
    # Known where the global step ran: on the coordinator (central planning)
    # or on every rank (decentralized planning); None elsewhere.
    metadata: Metadata | None = None
    all_local_plans: list[SavePlan] | None = None


def same_plan(a: SavePlan, b: SavePlan) -> bool:
    """Whether two local plans describe the same save (items and planner data)."""
    return a.items == b.items and a.planner_data == b.planner_data


class PlanCache:
    def __init__(self) -> None:
        self._entry: CachedPlan | None = None

    @property
    def entry(self) -> CachedPlan | None:
        return self._entry

    def lookup(self, local_plan: SavePlan, world_size: int) -> CachedPlan | None:
        entry = self._entry
        if entry is None or entry.world_size != world_size:
            return None
        return entry if same_plan(entry.local_plan, planner_data.strip_plan(local_plan)) else None

    def store(self, entry: CachedPlan) -> None:
        entry.local_plan = planner_data.strip_plan(entry.local_plan)
        self._entry = entry

    def clear(self) -> None:
        self._entry = None

    def fill_from_metadata(
        self,
        metadata: Metadata,
        *,
        rank: int,
        world_size: int,
        planner: SavePlanner,
        writer,
    ) -> bool:
        """Prime the cache from a checkpoint's persisted plans; False if it has none usable.

        ``planner`` is a fresh planner of the kind the saves will use, and
        ``writer`` the ``ObjectStoreWriter`` that assigns storage prefixes.
        Falls back (returns False, cache cleared) when the checkpoint was
        written by another tool or with another world size.
        """
        plans = planner_data.read_plans(metadata)
        if plans is None or len(plans) != world_size:
            logger.info(
                "checkpoint has %s persisted plans for world size %d: first save will plan in full",
                "no" if plans is None else len(plans),
                world_size,
            )
            self.clear()
            return False
        global_plans, global_metadata = planner.create_global_plan([writer.attach_local_plan(p) for p in plans])
        central = writer.prepare_global_plan(global_plans)
        self.store(
            CachedPlan(
                local_plan=plans[rank],
                central_plan=central[rank],
                world_size=world_size,
                metadata=global_metadata,
                all_local_plans=list(plans),
            )
        )
        return True
