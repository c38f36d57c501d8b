"""One save's pipeline on the background thread: staged, planned, uploaded, committed.

Who calls it: ``AsyncCheckpointer.save`` submits each ``SaveJob`` to its
one background thread, which runs ``SavePipeline.run``: saves run one after
another, in the same order on every rank.  What it may touch: the
checkpointer's collectives, its writer, its plan cache and its commit
protocol.  The training thread only staged the job's items.

What it promises, for each save:

1. **plan**: one all-reduce (MIN) of four int64s a rank: "my local plan is
   unchanged" (the plan cache holds it, or it was primed from the
   checkpoint this job resumed from), "staging and the early checks
   succeeded", the save's nonce (the largest of the ranks' random draws),
   and the lowest rank that could not reuse primed plans.  Only if some
   rank's plan changed do the plans travel (gather and scatter for central
   planning, one all-gather for decentralized planning), and the result
   fills the cache;
2. **upload**: the rank's shards, through the writer's multipart path;
3. **commit**: ``commit_protocol``.

An error before the first collective (staging, the HEAD that refuses a
committed step) travels in that all-reduce's flag, so every rank raises
``CheckpointSaveError`` within seconds and the group stays in step for the
next save.  Any other error is raised as ``CheckpointSaveError`` naming the
rank.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from .collectives import Collectives, describe
from .commit_protocol import CommitProtocol
from .errors import CheckpointExistsError, CheckpointSaveError
from .plan_cache import CachedPlan, PlanCache
from .save_job import SaveJob, SaveStats
from .persisted_plans import attach_local_plan, carried_plan
from .writer import ObjectStoreWriter

logger = logging.getLogger(__name__)

PLANNING_MODES = ("central", "decentralized")





def usable_local_plan(planner: SavePlanner) -> SavePlan:
    """The planner's local plan, also from a planner with torch's own plan caching.

    ``DefaultSavePlanner(enable_plan_caching=True)`` returns an empty,
    ``usable=False`` plan when nothing changed and keeps the real one in
    ``planner.plan``; the checkpointer caches plans itself and needs it.
    """
    plan = planner.create_local_plan()
    if not getattr(plan, "usable", True):
        plan = planner.plan
    return plan


class _Failure:
    """An exception's description, sent to peers in place of a result."""

    def __init__(self, message: str):
        self.message = message


def _check_every_item_offered(plans: list[SavePlan], metadata: Metadata) -> None:
    """Raise if an item a rank holds is in no rank's offer (see ``SavePipeline._plan``): the step would lack it.

    That happens only when the ranks holding a replicated item left it to a
    rank that no longer holds it.  The next save, planned afresh, stages it.
    """
    for rank, plan in enumerate(plans):
        held = carried_plan(plan)
        if held is None or len(held.items) == len(plan.items):
            continue  # it offered all it holds: the usual case costs nothing
        offered = {item.index for item in plan.items}
        for item in held.items:
            if item.index in offered:
                continue
            md = metadata.state_dict_metadata.get(item.index.fqn)
            chunks = getattr(md, "chunks", None)
            if md is None or (chunks is not None and not any(tuple(c.offsets) == tuple(item.index.offset or ()) for c in chunks)):
                raise RuntimeError(
                    f"item {item.index.fqn!r} of rank {rank} was staged by no rank: the ranks that hold it left it to "
                    "another under their cached plans, and that rank no longer holds it; the next save stages it"
                )


class SavePipeline:
    """Runs each save of one ``AsyncCheckpointer`` on its background thread (see the module docstring)."""

    def __init__(
        self, coll: Collectives, writer: ObjectStoreWriter, plan_cache: PlanCache, commits: CommitProtocol, planning: str
    ):
        self.coll, self.writer, self.plan_cache, self.commits, self.planning = coll, writer, plan_cache, commits, planning

    def run(self, job: SaveJob) -> SaveStats:
        try:
            return self._run_phases(job)
        except CheckpointSaveError:
            raise
        except Exception as e:  # noqa: BLE001
            # A collective failed (a peer died or timed out) or staging broke.
            # Nothing was committed; say so in the one error type callers handle.
            raise CheckpointSaveError(job.url, {self.coll.rank: describe(e)}) from e
        finally:
            self.writer.release_lease()  # the coordinator's: a failed save's step may be collected

    def _run_phases(self, job: SaveJob) -> SaveStats:
        writer = self.writer
        t0 = time.perf_counter()
        error = job.error
        if error is None:
            try:
                job.staged.wait_ready()
                writer.reset(job.url)
                writer.set_up_storage_writer(self.coll.is_coordinator, rank=self.coll.rank)
                # An early, friendly refusal; the conditional commit is what guarantees it.
                if writer.destination_committed():
                    raise CheckpointExistsError(
                        f"{job.url}: Checkpoint already exists: step {job.step} is already committed; steps are never overwritten"
                    )
            except Exception as e:  # noqa: BLE001 - must still join the collective below
                error = e
        job.stats.exists_check_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        cached = self.plan_cache.lookup(job.local_plan, self.coll.world_size) if error is None else None
        primed_miss = self.plan_cache.primed_miss(job.local_plan) if cached is None and error is None else None
        # The save's nonce rides along: the largest of the ranks' random draws;
        # the lowest rank that could not use plans primed from a checkpoint; and
        # the shortest collective timeout of any rank (ranks may be given others).
        reuse, all_ok, neg_nonce, first_miss, group_timeout_ms = self.coll.all_min(
            [int(cached is not None), int(error is None), -random.getrandbits(62),
             self.coll.rank if primed_miss is not None else self.coll.world_size,
             int(self.coll.timeout_s(self.commits.collective_timeout) * 1000)]
        )
        job.nonce = f"{-neg_nonce:016x}"
        job.group_timeout_s = group_timeout_ms / 1000
        writer.save_id = job.nonce  # what .metadata carries; a peer that loses the coordinator looks for it
        if not all_ok:
            self.commits.raise_everywhere(job.url, error)
        if first_miss < self.coll.world_size:
            self._warn_plans_not_reused(first_miss, primed_miss)
        if reuse:
            cached.source = None  # reused: from now on, these are plans this job made
            central_plan, metadata = cached.central_plan, cached.metadata
            if cached.all_local_plans is not None:
                writer.plans.remember(cached.all_local_plans)
        else:
            central_plan, metadata = self._plan(job)
        job.stats.plan_reused = bool(reuse)
        job.stats.planning_s = time.perf_counter() - t0

        t1 = time.perf_counter()
        results, error = None, None
        try:
            final_plan = job.planner.finish_plan(central_plan)
            unstaged = job.staged.missing(final_plan.items)
            if unstaged:  # no rank staged them: a rank that left them to another no longer holds them
                raise RuntimeError(
                    f"{len(unstaged)} items this rank must write were not staged (e.g. {unstaged[0].index.fqn!r}): "
                    "it left them to another rank under its cached plan, and no rank that staged them has them now; "
                    "the next save stages them"
                )
            results = writer.write_data(final_plan, job.staged).value()
        except Exception as e:  # noqa: BLE001 - reported to the coordinator
            error = e
        job.stats.upload_s = time.perf_counter() - t1
        if writer.incremental is not None:
            job.stats.copied_bytes, job.stats.copy_requests = writer.incremental.bytes_copied, writer.incremental.copies
        if job.staged is not None:
            job.stats.device_stall_s = job.staged.stall_s()  # the waits made so far (overlap_copy: the loop's)

        t2 = time.perf_counter()
        self.commits.commit(job, metadata, results, error)
        job.stats.commit_s = time.perf_counter() - t2
        return job.stats

    def _warn_plans_not_reused(self, first_miss: int, primed_miss: str | None) -> None:
        """One warning when the first save after a resume cannot reuse the plans it was primed with.

        The coordinator says so, with the reason if it is the lowest rank that
        missed; that rank, if another, logs its own (which item, which field).
        """
        if first_miss == self.coll.rank:
            logger.warning("rank %d: %s; this save plans in full", self.coll.rank, primed_miss)
        elif self.coll.is_coordinator:
            logger.warning(
                "the plans persisted in the checkpoint this job resumed from cannot be reused: rank %d's local plan "
                "differs (its log says which item and field); this save plans in full", first_miss
            )

    def _plan(self, job: SaveJob) -> tuple[SavePlan, Metadata | None]:
        """Full planning; fills the plan cache.

        A rank that staged from its cached plan (while another rank's
        structure changed) offers global planning only the items it
        staged: the replicated items it had left to another rank go to a
        rank that staged them, not to this one (staging them now would mix
        steps: the live tensors have moved on).  Its whole local plan is
        still what the cache and the persisted plans key on.
        """
        writer = self.writer
        unstaged = {item.index for item in job.staged.missing(job.local_plan.items)}
        offered = dataclasses.replace(job.local_plan, items=[i for i in job.local_plan.items if i.index not in unstaged])
        local = attach_local_plan(offered, carried=job.local_plan)
        if self.planning == "decentralized":
            all_local = self.coll.all_gather(local)
            try:
                global_plans, metadata = job.planner.create_global_plan(all_local)
                _check_every_item_offered(all_local, metadata)
            except Exception:
                self.plan_cache.clear()  # every rank fails here alike; the next save stages all and plans afresh
                raise
            central_plan = writer.prepare_global_plan(global_plans)[self.coll.rank]
            self.plan_cache.store(
                CachedPlan(job.local_plan, central_plan, self.coll.world_size, metadata, writer.plans.plans)
            )
            return central_plan, metadata

        gathered = self.coll.gather(local)
        metadata = None
        payload = None
        if self.coll.is_coordinator:
            try:
                global_plans, metadata = job.planner.create_global_plan(gathered)
                _check_every_item_offered(gathered, metadata)
                payload = writer.prepare_global_plan(global_plans)
            except Exception as e:  # noqa: BLE001 - sent to every rank
                payload = [_Failure(describe(e))] * self.coll.world_size
        central_plan = self.coll.scatter(payload)
        if isinstance(central_plan, _Failure):
            self.plan_cache.clear()  # the next save stages all it holds and plans afresh
            raise CheckpointSaveError(job.url, {0: f"global planning failed: {central_plan.message}"})
        self.plan_cache.store(CachedPlan(job.local_plan, central_plan, self.coll.world_size, metadata, writer.plans.plans))
        return central_plan, metadata
