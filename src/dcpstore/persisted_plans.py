"""Which local plans a save persists, and how each rank's plan reaches the coordinator's ``finish()``.

Plans ride to the coordinator inside each rank's ``SavePlan.storage_data``
(``attach_local_plan``; ``carried_plan`` takes them back out): torch's
global step keeps ``storage_data``, so the coordinator's
``prepare_global_plan`` sees every rank's local plan exactly as the rank
made it, before dedup, whatever planner ``dcp.save`` uses.
``PersistedPlans`` is one save's record of them (or of the compact form the
plan cache kept, or of why they are unknown), and ``extras`` is what
``finish()`` stores: the compact form of ``planner_data.encode_plans``, the
full list where that form does not fit, or nothing.  With torch's own plan
caching (``DefaultSavePlanner(enable_plan_caching=True)``) unchanged ranks
send empty delta plans: the plans are then taken from the coordinator
planner's full ``global_plan``, or the compact form this process computed
for the same ``Metadata`` object is reused (torch hands the cached one
back when nothing changed).

Who calls it: ``ObjectStoreWriter`` (its planning hooks and ``finish``),
the save pipeline (attaching a rank's plan; the plans of a cached save),
the plan cache.  It touches no storage.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections import OrderedDict
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from . import planner_data

logger = logging.getLogger(__name__)

# Compact plans this process persisted, by identity of the Metadata object they
# describe: (weakref to it, the local plans they encode or None, compact form).
_RECENT_COMPACT: "OrderedDict[int, tuple[weakref.ref, object, dict]]" = OrderedDict()
_RECENT_LOCK = threading.Lock()
_RECENT_MAX = 8


def _remember_compact(metadata: Metadata, source: object, compact: dict) -> None:
    with _RECENT_LOCK:
        _RECENT_COMPACT.pop(id(metadata), None)
        _RECENT_COMPACT[id(metadata)] = (weakref.ref(metadata), source, compact)
        while len(_RECENT_COMPACT) > _RECENT_MAX:
            _RECENT_COMPACT.popitem(last=False)


def _recall_compact(metadata: Metadata, source: object = None) -> dict | None:
    """The compact form computed earlier for this very ``metadata`` (and ``source``, if given)."""
    with _RECENT_LOCK:
        entry = _RECENT_COMPACT.get(id(metadata))
    if entry is None or entry[0]() is not metadata or (source is not None and entry[1] is not source):
        return None
    compact = entry[2]
    return compact if planner_data.compact_matches(compact, metadata) else None


@dataclasses.dataclass(frozen=True)
class _LocalPlanCarrier:
    """Carries a rank's own local plan through DCP's gather in ``storage_data``."""

    plan: SavePlan


def attach_local_plan(plan: SavePlan, carried: SavePlan | None = None) -> SavePlan:
    """``plan`` carrying a copy of itself (or of ``carried``: the plan persisted for this rank) to ``prepare_global_plan``."""
    return dataclasses.replace(plan, storage_data=_LocalPlanCarrier(planner_data.strip_plan(carried or plan)))


def carried_plan(plan: SavePlan) -> SavePlan | None:
    """The local plan a global-step plan carries, or ``None`` (dropped, or torch's unusable delta)."""
    carrier = getattr(plan, "storage_data", None)
    if not isinstance(carrier, _LocalPlanCarrier) or not getattr(carrier.plan, "usable", True):
        return None
    return carrier.plan


class PersistedPlans:
    """The ranks' local plans one save's ``finish()`` persists (see the module docstring)."""

    def __init__(self) -> None:
        self.plans: list[SavePlan] | dict | None = None  # a list of plans, the compact form, or None (unknown)
        self.missing: str | None = None  # why they are unknown: "dropped", or "cached" (torch's delta plans)
        self.from_planner = False  # taken from the coordinator planner's full global plan

    def remember(self, plans: list[SavePlan | None] | dict | None) -> None:
        """The local plans ``finish()`` persists.

        A list of plans (``None`` entries: unknown), or the compact form of
        ``planner_data.encode_plans`` as the plan cache keeps it.
        """
        if planner_data.is_compact(plans):
            self.plans = plans
            self.missing = None
        elif plans and all(p is not None for p in plans):
            if all(p.storage_data is None for p in plans):
                self.plans = plans  # kept as is: finish() recognizes a list it encoded before
            else:
                self.plans = [planner_data.strip_plan(p) for p in plans]
            self.missing = None
        else:
            self.plans = None
            self.missing = "dropped"

    def from_global_step(self, plans: list[SavePlan]) -> None:
        """The plans of the global step's input, as ``prepare_global_plan`` receives them."""
        self.remember([carried_plan(p) for p in plans])
        if self.plans is None and not all(getattr(p, "usable", True) for p in plans):
            self.missing = "cached"  # torch's plan caching sent deltas; see from_planner_if_missing/extras

    def from_planner_if_missing(self, planner: SavePlanner) -> None:
        """On the coordinator, with torch's plan caching: its planner's full global plan still carries every rank's local plan."""
        if self.plans is not None:
            return
        full = getattr(planner, "global_plan", None)
        if isinstance(full, list) and full:
            carried = [carried_plan(p) for p in full]
            if all(p is not None for p in carried):
                self.plans = [planner_data.strip_plan(p) for p in carried]
                self.from_planner = True

    def extras(self, metadata: Metadata, results: list[list[WriteResult]], url: str) -> dict[str, Any]:
        """What ``finish()`` stores about the plans: the compact form, the full list, or nothing."""
        plans = self.plans
        if planner_data.is_compact(plans):
            if planner_data.compact_matches(plans, metadata) and len(plans["ranks"]) == len(results):
                plans = planner_data.as_written_here(plans)  # primed from a checkpoint another torch wrote
                _remember_compact(metadata, None, plans)
                return {planner_data.PLANS_KEY: plans}
            plans = None  # not this structure: treat as unknown
        if plans is None:
            compact = _recall_compact(metadata)
            if compact is not None and len(compact["ranks"]) == len(results):
                logger.info("%s: reusing the compact plans of the previous save of this structure", url)
                return {planner_data.PLANS_KEY: compact}
            if self.missing == "cached":
                logger.info("%s: torch's plan caching left no local plans to persist; a restart will plan in full", url)
            else:
                logger.warning(
                    "%s: the planner dropped SavePlan.storage_data, so the local plans "
                    "cannot be persisted; a restart will plan in full",
                    url,
                )
            return {}
        compact = _recall_compact(metadata, plans)
        if compact is None:
            compact = planner_data.encode_plans(plans, metadata, [{wr.index for wr in rr} for rr in results])
        if compact is not None:
            _remember_compact(metadata, plans, compact)
            return {planner_data.PLANS_KEY: compact}
        if self.from_planner:
            logger.info("%s: the planner's cached plans do not match this save; not persisting plans", url)
            return {}
        logger.info("%s: plans do not fit the compact form; persisting them in full", url)
        return {planner_data.ALL_LOCAL_PLANS_KEY: plans}
