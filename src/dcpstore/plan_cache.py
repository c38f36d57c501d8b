"""The save-plan cache: plan once, then reuse, across saves and across restarts.

DCP planning gathers every rank's local plan on a coordinator, builds the
global plan and metadata there, and scatters the result: two object
collectives whose cost grows with the state dict and the world size.  As long
as the state-dict structure (fqns, shapes, dtypes, shard offsets) stays the
same on every rank, the result is the same too, so the checkpointer keeps it
here and a later save only all-reduces one "my plan is unchanged" flag.

After a restart, ``fill_from_metadata`` rebuilds the cache from the plans
persisted in the checkpoint's ``planner_data``, and the first save after the
restart needs no planning collective.  With the compact form (see
``planner_data.encode_plans``) rank r decodes only its own local plan and its
final plan (the persisted dedup decision says which of its items it writes):
O(items of rank r), whatever the world size.  Only the coordinator keeps a
global ``Metadata`` (the checkpoint's own, without dcpstore's entries), since
only it commits.  Older checkpoints (full plans) and planners whose global step
differs from ``DefaultSavePlanner``'s still redo the global step over all plans.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from typing import Callable

import torch

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from . import planner_data
from .persisted_plans import attach_local_plan

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class CachedPlan:
    local_plan: SavePlan  # this rank's local plan, storage_data stripped
    central_plan: SavePlan  # this rank's plan after global planning, with its storage prefix
    world_size: int
    # Known where the global step ran: on the coordinator (central planning)
    # or on every rank (decentralized planning); None elsewhere.
    metadata: Metadata | None = None
    # What the coordinator's writer persists: the full local plans, or their
    # compact form (after a restart); None elsewhere.
    all_local_plans: list[SavePlan] | dict | None = None
    # On a coordinator resumed from its share of the resume index: the
    # (metadata, all_local_plans) above, still being read from .metadata off
    # the training thread (see PlanCache.fill_from_share).
    pending: concurrent.futures.Future | None = None
    # Where a cache primed from a checkpoint got its plans, and which torch
    # wrote them (for the warning when the first save cannot reuse them);
    # None for plans this process made.
    source: str | None = None


def describe_source(url: str, written_by: str | None) -> str:
    """How the warnings name plans persisted in the checkpoint at ``url`` by torch ``written_by``."""
    return f"the plans persisted in {url} (written by torch {written_by or 'of an unknown version'}, read by torch {torch.__version__})"


_GLOBAL_STEP = ("create_global_plan", "_create_global_plan", "_dedup_save_plans", "_create_global_plan_with_caching")


def default_global_step(planner: SavePlanner) -> bool:
    """Whether ``planner``'s global step is ``DefaultSavePlanner``'s (so the persisted dedup applies)."""
    return isinstance(planner, DefaultSavePlanner) and all(
        getattr(type(planner), name, None) is getattr(DefaultSavePlanner, name) for name in _GLOBAL_STEP
    )


def same_plan(a: SavePlan, b: SavePlan) -> bool:
    """Whether two local plans describe the same save (items and planner data)."""
    return a.items == b.items and a.planner_data == b.planner_data


def plan_difference(cached: SavePlan, local: SavePlan) -> str | None:
    """The first thing in which ``local`` differs from ``cached``, by item and field, or ``None`` if it does not.

    Fields are compared generically (``dataclasses.fields``), so a field a
    newer torch adds to ``WriteItem`` or ``TensorProperties`` is named too.
    """
    by_index = {item.index: item for item in cached.items}
    for new in local.items:
        old = by_index.pop(new.index, None)
        if old is None:
            return f"item {new.index.fqn!r} (offsets {new.index.offset}) is not in them"
        if old != new:
            return f"item {new.index.fqn!r}: {_differing_field(old, new, type(new).__name__)}"
    if by_index:
        gone = next(iter(by_index))
        return f"item {gone.fqn!r} (offsets {gone.offset}) is no longer in the state dict"
    if cached.items != local.items:
        return "the state dict holds its items in another order"
    if cached.planner_data != local.planner_data:
        return "the planner's planner_data differs"
    return None


def _differing_field(old, new, path: str) -> str:
    if dataclasses.is_dataclass(old) and type(old) is type(new):
        for field in dataclasses.fields(old):
            a, b = getattr(old, field.name), getattr(new, field.name)
            if a != b:
                return _differing_field(a, b, f"{path}.{field.name}")
    return f"{path} is {new!r}, cached {old!r}"


class UnparsedMetadata:
    """A resumed coordinator's global ``Metadata``, left unparsed in the bytes of its commit template.

    A coordinator that resumed from the index commits the next saves by
    patching the resumed ``.metadata`` (``metadata_template``), which needs
    no ``Metadata`` object: this stands for the structure in the plan cache
    (the template knows it by identity).  A save that must commit in full
    parses the template's bytes (``resolve``): at 4,096 x 2,000, minutes
    and gigabytes (docs/scale.md), paid only then.
    """

    def __init__(self, parse: Callable[[], tuple[Metadata, dict]]):
        self._parse = parse

    def resolve(self) -> tuple[Metadata, dict]:
        """The global ``Metadata`` and the compact plans (``PlanCache.coordinator_state``)."""
        return self._parse()


class PlanCache:
    def __init__(self) -> None:
        self._entry: CachedPlan | None = None

    @property
    def entry(self) -> CachedPlan | None:
        return self._entry

    def lookup(self, local_plan: SavePlan, world_size: int, *, wait: bool = True) -> CachedPlan | None:
        """The cached plan for ``local_plan``, or ``None``.

        With ``wait``, a coordinator's pending global state is waited for
        (on the save's background thread: a coordinator that resumed from
        the index and still reads ``.metadata`` delays its first commit, not
        training).  Without it (staging, on the training thread) the entry's
        own plans are all it gives.
        """
        entry = self._entry
        if entry is None or entry.world_size != world_size:
            return None
        if not same_plan(entry.local_plan, planner_data.strip_plan(local_plan)):
            return None
        if entry.pending is not None and wait:
            try:
                entry.metadata, entry.all_local_plans = entry.pending.result()
            except Exception as e:  # noqa: BLE001 - the save plans in full instead
                logger.warning("%s cannot be reused: reading the checkpoint's global plan failed (%s); this save plans in full",
                               entry.source, e)
                self.clear()
                return None
            entry.pending = None
        return entry

    def primed_miss(self, local_plan: SavePlan) -> str | None:
        """Why plans primed from a checkpoint cannot serve ``local_plan``, or ``None`` (they can, or none were primed).

        Runs only after ``lookup`` missed: it names the item and field.
        """
        entry = self._entry
        if entry is None or entry.source is None:
            return None
        why = plan_difference(entry.local_plan, planner_data.strip_plan(local_plan))
        return None if why is None else f"{entry.source} cannot be reused: {why}"

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
        written by another tool or with another world size; rank 0 warns
        when it has plans that cannot be used.
        """
        compact = planner_data.read_compact(metadata)
        url = metadata.storage_meta.checkpoint_id if metadata.storage_meta is not None else None
        source = describe_source(str(url or "the checkpoint"), compact.get("torch_version") if compact else None)
        if compact is not None and len(compact["ranks"]) == world_size and default_global_step(planner):
            decoded = planner_data.decode_rank(compact, metadata, rank)
            if decoded is not None:
                local, final = decoded
                coordinator = rank == 0
                self.store(
                    CachedPlan(
                        local_plan=local,
                        central_plan=dataclasses.replace(final, storage_data=_StoragePrefix(f"__{rank}_")),
                        world_size=world_size,
                        metadata=self.global_metadata(metadata) if coordinator else None,
                        all_local_plans=compact if coordinator else None,
                        source=source,
                    )
                )
                return True
        plans = planner_data.read_plans(metadata)
        if plans is None or len(plans) != world_size:
            if plans is None:
                logger.info("%s has no persisted plans: the first save plans in full", url or "the checkpoint")
            elif rank == 0:
                logger.warning("%s cannot be reused: saved by %d ranks, loaded by %d; the first save plans in full",
                               source, len(plans), world_size)
            self.clear()
            return False
        # Full plans (older checkpoints) or a planner with its own global step: redo it.
        global_plans, global_metadata = planner.create_global_plan([attach_local_plan(p) for p in plans])
        central = writer.prepare_global_plan(global_plans)
        self.store(
            CachedPlan(
                local_plan=plans[rank],
                central_plan=central[rank],
                world_size=world_size,
                metadata=global_metadata,
                all_local_plans=list(plans),
                source=source,
            )
        )
        return True

    def fill_from_share(
        self,
        local: SavePlan | None,
        final: SavePlan | None,
        *,
        rank: int,
        world_size: int,
        planner: SavePlanner,
        global_state: concurrent.futures.Future | None = None,
        source: str | None = None,
    ) -> bool:
        """Prime the cache from this rank's share of the resume index: its own plans, nothing of the job's.

        The coordinator also needs what it commits with (the global
        ``Metadata`` and the compact plans, O(W x N)): ``global_state``, a
        future of ``(metadata, compact)`` that ``lookup`` waits for.
        ``source``: ``describe_source`` of the checkpoint, for the warning if the plans cannot be reused.
        """
        coordinator = rank == 0
        if local is None or final is None or (coordinator and global_state is None) or not default_global_step(planner):
            self.clear()
            return False
        self.store(
            CachedPlan(
                local_plan=local,
                central_plan=dataclasses.replace(final, storage_data=_StoragePrefix(f"__{rank}_")),
                world_size=world_size,
                pending=global_state if coordinator else None,
                source=source,
            )
        )
        return True

    @staticmethod
    def coordinator_state(metadata: Metadata) -> tuple[Metadata, dict]:
        """What a coordinator resumed from its share still needs of ``metadata``: the global ``Metadata`` and the compact plans."""
        compact = planner_data.read_compact(metadata)
        if compact is None:
            raise ValueError("the checkpoint holds no compact plans")
        return PlanCache.global_metadata(metadata), compact

    @staticmethod
    def global_metadata(metadata: Metadata) -> Metadata:
        """The ``Metadata`` ``DefaultSavePlanner``'s global step gives for the checkpoint's plans.

        Its ``state_dict_metadata`` and the planner's own ``planner_data``; what
        ``finish()`` adds (storage data, dcpstore's entries) is left out.
        """
        return Metadata(
            state_dict_metadata=metadata.state_dict_metadata,
            planner_data=planner_data.user_planner_data(metadata),
        )
