"""``AsyncCheckpointer``: what a training loop calls.

``save(state_dict, step)`` blocks only while the rank's items are staged into
reused host buffers (see ``staging``).  Everything else runs on one
background thread per checkpointer, in the same order on every rank:

1. plan: one all-reduce of a "my local plan is unchanged" flag; only if some
   rank's plan changed (or nothing is cached) do the plans travel
   (gather + scatter for central planning, one all-gather for decentralized
   planning);
2. upload: the rank's shard objects, through the store's multipart path;
3. commit: one all-reduce says whether every rank succeeded and whether
   every rank wrote exactly what it wrote for the coordinator's commit
   template (see ``metadata_template``).  If so, each rank's per-save values
   (crc32s, bytes items' extents) go to the coordinator as one tensor, and
   it patches the last ``.metadata``'s bytes: no object collective, nothing
   per item in Python.  Otherwise the write results are gathered as objects
   and ``.metadata`` is built in full.  Either way the coordinator writes
   ``.metadata`` as the last object (conditionally, see ``commit``) only if
   every rank succeeded, then tells every rank the outcome storage shows.
   A failure anywhere leaves no ``.metadata``, and every rank raises
   ``CheckpointSaveError`` from ``maybe_finalize``/``wait``
   (``CommitOutcomeUnknownError`` when storage could not be read back).

One outcome on every rank: when a collective of the commit fails (a peer
died or timed out), the coordinator may or may not have written
``.metadata``, so each surviving rank asks storage instead: HEADs of
``.metadata``, looking for the save's nonce (agreed by all ranks before
the upload), until the last moment the coordinator may start its PUT, plus
its ``commit_window``, plus the time an unsettled PUT (no answer, or a 5xx)
may take to land, have passed; then storage's answer is final (the
argument is in ``commit``'s docstring).  Committed means a warning that a peer died; anything else raises.
Errors that happen
before the first collective (staging, a storage check) travel through the
same all-reduced failure flag as planning does, so peers raise within
seconds and the group's collectives stay in step for the next save.

Collectives run on a gloo group of the checkpointer's own (created from the
default group, or passed in), so they never interleave with the training
job's NCCL or gloo collectives.  That group's timeout bounds every wait on a
peer: a rank that dies mid-save becomes an error on the others, not a hang.
Storage requests are bounded by connect/read timeouts and the retry policy.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import logging
import random
import threading
import time
import warnings
from typing import Any, Callable

import numpy
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.stateful import Stateful

from . import resume_index
from .commit import Outcome, landing_margin, wait_and_settle
from .errors import (
    CheckpointExistsError,
    CheckpointLoadError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CheckpointTimeoutError,
    CommitOutcomeUnknownError,
    DcpstoreError,
    ObjectNotFoundError,
)
from .layout import METADATA_KEY, StepNaming, committed_steps, delete_committed_step
from .metadata_template import CommitTemplate, Unpatchable
from .plan_cache import CachedPlan, PlanCache, UnparsedMetadata, describe_source
from .reader import ObjectStoreReader, check_state_dict, no_metadata_error, parse_metadata, read_metadata_bytes
from .staging import StagedItems, StagingPool
from .steps import CommitOrder, CommitRecord, check_grace, plan_gc
from .storage import TransferConfig, normalize_url, open_store
from .writer import ObjectStoreWriter, carried_plan

logger = logging.getLogger(__name__)

PLANNING_MODES = ("central", "decentralized")


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


class SaveHandle:
    """A pending save.  ``result()`` blocks until committed and returns its stats.

    A failed save's error reaches the caller once: through whichever of
    ``result()``, ``AsyncCheckpointer.maybe_finalize()``, ``wait()``,
    ``save()`` (waiting for a slot) or ``close()`` sees it first.  The
    checkpointer's calls then pass over it, so a loop that caught it goes on
    saving.  ``result()`` itself, asked again, raises it again, as a
    future's does.
    """

    def __init__(
        self,
        step: int,
        url: str,
        future: concurrent.futures.Future,
        stats: SaveStats,
        pool: StagingPool | None = None,
        staged: StagedItems | None = None,
    ):
        self.step, self.url, self._future, self.stats = step, url, future, stats
        self._pool = pool  # the staging pool the save reads from until it is done
        self._staged = staged
        self.failure_delivered = False  # its error has been raised to the caller

    def done(self) -> bool:
        return self._future.done()

    def wait_staged(self) -> None:
        """Make the training streams wait, on the GPU, for this save's device-to-host copies (see ``overlap_copy``).

        The host does not block.  Call it before the first kernel that
        modifies a saved tensor: the optimizer step.  A no-op when the
        checkpointer already did it in ``save`` (the default), or without CUDA.
        """
        if self._staged is not None:
            self._staged.make_streams_wait()

    @property
    def future(self) -> concurrent.futures.Future:
        """The save as a plain future, for APIs that want one (torchtitan's ``save_future``).

        Its ``result()`` does not count as delivering a failure: the
        checkpointer's ``wait()`` still raises it.
        """
        return self._future

    def result(self, timeout: float | None = None) -> SaveStats:
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise CheckpointTimeoutError(f"{self.url}: save of step {self.step} not committed after {timeout}s") from None
        except BaseException:
            self.failure_delivered = True
            raise


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class _Collectives:
    """Object collectives on the checkpointer's group; no-ops in a single process."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.enabled = group is not None
        self.rank = dist.get_rank(group) if self.enabled else 0
        self.world_size = dist.get_world_size(group) if self.enabled else 1
        self.coordinator = dist.get_global_rank(group, 0) if self.enabled else 0

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def timeout_s(self, default: datetime.timedelta) -> float:
        """Seconds a rank waits in a collective of the group before it breaks: the gloo group's own timeout, else ``default``."""
        try:
            return self.group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):
            return default.total_seconds()

    def all_min(self, values: list[int]) -> list[int]:
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return t.tolist()

    def gather_tensor(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """``tensor`` of every rank (one length), stacked on the coordinator: W rows; ``None`` elsewhere."""
        if not self.enabled:
            return tensor.unsqueeze(0)
        out = torch.empty((self.world_size, tensor.numel()), dtype=tensor.dtype) if self.is_coordinator else None
        dist.gather(tensor, list(out.unbind(0)) if out is not None else None, dst=self.coordinator, group=self.group)
        return out

    def broadcast_code(self, code: int) -> int:
        """The coordinator's ``code``, on every rank: one int64."""
        if not self.enabled:
            return code
        t = torch.tensor([code], dtype=torch.int64)
        dist.broadcast(t, src=self.coordinator, group=self.group)
        return int(t.item())

    def gather(self, obj: Any) -> list[Any] | None:
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size if self.is_coordinator else None
        dist.gather_object(obj, out, dst=self.coordinator, group=self.group)
        return out

    def scatter(self, objs: list[Any] | None) -> Any:
        if not self.enabled:
            return objs[0]
        out = [None]
        dist.scatter_object_list(out, objs if self.is_coordinator else None, src=self.coordinator, group=self.group)
        return out[0]

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.coordinator, group=self.group)
        return box[0]


_FULL = "full"  # the coordinator's verdict that a patched commit cannot be: every rank commits in full
_VERDICTS = (None, Outcome.FAILED, Outcome.REFUSED, Outcome.UNKNOWN, _FULL)  # a verdict as a tensor: its index


def _verdict_code(verdict) -> int:
    """``_VERDICTS``' index of a verdict (``None``, ``_FULL`` or ``(Outcome, failures)``); peers send 0."""
    return _VERDICTS.index(verdict if verdict is None or verdict is _FULL else verdict[0])


class _Failure:
    """An exception's description, sent to peers in place of a result."""

    def __init__(self, message: str):
        self.message = message


def _check_every_item_offered(plans: list[SavePlan], metadata: Metadata) -> None:
    """Raise if an item a rank holds is in no rank's offer (see ``AsyncCheckpointer._plan``): the step would lack it.

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


@dataclasses.dataclass
class _SaveJob:
    step: int
    url: str
    planner: SavePlanner | None
    local_plan: SavePlan | None
    staged: StagedItems | None
    stats: SaveStats
    error: BaseException | None = None  # staging failed: the job only tells the peers
    nonce: str = ""  # agreed by every rank before the upload; .metadata carries it


class AsyncCheckpointer:
    """Asynchronous, plan-caching DCP checkpoints of a training job, one step per prefix.

    Args:
        root: where steps go: ``{root}/step_{step:08d}/`` (``s3://bucket/run-7``),
            or ``{root}/step-{step}/`` with ``step_naming=StepNaming.TORCHTITAN``.
        process_group: a gloo group for the checkpointer's collectives.  By
            default one is created from the default group (a collective call:
            construct the checkpointer on every rank).
        storage_options: passed to fsspec (see ``ObjectStoreWriter``).
        keep_last: after each commit, keep ``keep_last`` committed steps:
            the one just committed and its lineage (the steps it continued
            from, through ``load``) first, then the most recently committed
            (see ``steps``); delete the rest's checkpoints (files of
            yours in their folders stay, with a warning).  ``None`` keeps all.
        gc_grace: after each commit, also delete the debris of failed saves
            (incomplete steps and open multipart uploads) once nothing
            under their step, no object and no upload's newest part, changed
            for ``gc_grace`` seconds of the server's clock, as ``dcpstore gc
            --grace`` does (positive).  ``None`` (the default) leaves debris to ``gc``.
        planning: ``"central"`` (torch's gather/scatter through a
            coordinator) or ``"decentralized"`` (one all-gather; every rank
            builds the global plan itself).
        planner_factory: makes the ``SavePlanner`` of each save
            (``DefaultSavePlanner`` by default).
        max_in_flight: saves that may be uploading at once.  ``save`` while
            that many are pending first waits for the oldest to commit (and
            raises if it failed).  Each in-flight save holds its own pool.
        collective_timeout: bound on every wait for a peer rank.
        commit_window: how long the coordinator's ``.metadata`` PUT may keep
            trying (throttled, or failing) before the commit is settled by
            reading storage back (see ``commit``).  It also bounds how long a
            rank that lost the coordinator mid-commit waits before storage's
            answer is final: the collective timeout, plus ``commit_window``,
            plus ``landing_margin`` (connect + read timeout, the send time of
            the largest single PUT, 1 s).  It returns as soon as the
            ``.metadata`` shows up.
        transfer, objects_per_rank, key_spread: see ``ObjectStoreWriter``.
        pin_memory: pin the staging memory (default: when CUDA is available).
        overlap_copy: let the device-to-host copies of CUDA tensors overlap
            training.  By default ``save`` makes each device's current stream
            wait for them, so the next kernels (forward, backward) queue
            behind the copy, and nothing more is asked of the loop.  With
            ``True`` that wait is the loop's: call ``wait_staged()`` (or the
            handle's) before the first kernel that modifies a saved tensor,
            the optimizer step.  Nothing else may write a saved tensor
            before then: not a buffer that forward updates (BatchNorm's
            running statistics), not an in-place op on a parameter.
        step_naming: how step prefixes are named (``layout.StepNaming``).
            The checkpointer sees only the steps named its way.
    """

    def __init__(
        self,
        root: str,
        process_group: dist.ProcessGroup | None = None,
        storage_options: dict[str, Any] | None = None,
        keep_last: int | None = None,
        *,
        planning: str = "central",
        planner_factory: Callable[[], SavePlanner] = DefaultSavePlanner,
        max_in_flight: int = 1,
        collective_timeout: datetime.timedelta = datetime.timedelta(minutes=10),
        commit_window: float = 60.0,
        transfer: TransferConfig | None = None,
        objects_per_rank: int = 4,
        key_spread: int = 1,
        pin_memory: bool | None = None,
        overlap_copy: bool = False,
        gc_grace: float | None = None,
        step_naming: StepNaming = StepNaming.DCPSTORE,
    ):
        if planning not in PLANNING_MODES:
            raise ValueError(f"planning must be one of {PLANNING_MODES}, got {planning!r}")
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be >= 1 or None")
        if gc_grace is not None:
            check_grace(gc_grace)
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.root = normalize_url(root)
        self.storage_options = dict(storage_options or {})
        self.keep_last = keep_last
        self.gc_grace = gc_grace
        self.step_naming = StepNaming(step_naming)
        self.planning = planning
        self.planner_factory = planner_factory
        self.max_in_flight = max_in_flight
        self.commit_window = commit_window
        self.collective_timeout = collective_timeout
        self.transfer = transfer or TransferConfig()
        self.store = open_store(self.root, self.storage_options, self.transfer)
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.new_group(backend="gloo", timeout=collective_timeout)
        self._coll = _Collectives(process_group)
        self.plan_cache = PlanCache()
        self._order = CommitOrder(self.store)
        self._last_sequence = 0  # the highest sequence this checkpointer committed with, or may have (coordinator)
        self._parent: int | None = None  # the step the next save continues from: last saved or loaded
        self._unsettled: set[int] = set()  # steps whose commit outcome was unknown: never pruned here
        self._writer = ObjectStoreWriter(
            self.root,
            storage_options=self.storage_options,
            transfer=self.transfer,
            objects_per_rank=objects_per_rank,
            key_spread=key_spread,
            commit_window=commit_window,
        )
        self.overlap_copy = overlap_copy
        self._pools = [StagingPool(pin_memory) for _ in range(max_in_flight)]
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcpstore-save")
        self._collector = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcpstore-retention")
        self._collecting: concurrent.futures.Future | None = None  # the last commit's retention (coordinator)
        self._pending: list[SaveHandle] = []
        self.last_stats: SaveStats | None = None
        self._closed = False

    @property
    def rank(self) -> int:
        return self._coll.rank

    @property
    def world_size(self) -> int:
        return self._coll.world_size

    def step_prefix(self, step: int) -> str:
        return self.step_naming.prefix(step)

    def step_url(self, step: int) -> str:
        return f"{self.root}/{self.step_prefix(step)}"

    # -- saving ---------------------------------------------------------------------

    def save(self, state_dict: dict[str, Any], step: int) -> SaveHandle:
        """Stage ``state_dict`` and return; upload and commit continue in the background.

        If staging fails here, the error is raised on this rank and the
        peers' saves of this step fail within seconds (``CheckpointSaveError``
        naming this rank), so every rank stays in step for the next save.
        """
        if self._closed:
            raise RuntimeError("AsyncCheckpointer is closed")
        while len(self._pending) >= self.max_in_flight:
            self._finalize(self._pending[0], timeout=None)
        t0 = time.perf_counter()
        stats = SaveStats(step=step)
        url = self.step_url(step)
        # A pool no pending save still uploads from (there is one: see the wait above).
        busy = [h._pool for h in self._pending]
        pool = next(p for p in self._pools if all(p is not b for b in busy))
        try:
            state_dict = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}
            planner = self.planner_factory()
            planner.set_up_planner(state_dict=state_dict, storage_meta=None, is_coordinator=self._coll.is_coordinator)
            local_plan = self._usable_local_plan(planner)
            # With a cached plan, stage only the items this rank writes: a
            # replicated item is copied to host by the one rank the plan's
            # dedup gave it to, not by every rank that holds it.
            cached = self.plan_cache.lookup(local_plan, self.world_size, wait=False)
            items = list((cached.central_plan if cached else local_plan).items)
            staged = pool.stage(items, planner, training_waits=not self.overlap_copy)
        except Exception as e:
            self._executor.submit(self._run, _SaveJob(step, url, None, None, None, stats, error=e))
            raise
        stats.staged_bytes = staged.nbytes
        stats.staged_items = len(staged)
        stats.host_bytes, stats.pinned_bytes = pool.nbytes, pool.pinned_bytes
        job = _SaveJob(step, url, planner, local_plan, staged, stats)
        future = self._executor.submit(self._run, job)
        stats.blocking_s = time.perf_counter() - t0
        handle = SaveHandle(step, url, future, stats, pool, staged)
        self._pending.append(handle)
        return handle

    @staticmethod
    def _usable_local_plan(planner: SavePlanner) -> SavePlan:
        """The planner's local plan, also from a planner with torch's own plan caching.

        ``DefaultSavePlanner(enable_plan_caching=True)`` returns an empty,
        ``usable=False`` plan when nothing changed and keeps the real one in
        ``planner.plan``; the checkpointer caches plans itself and needs it.
        """
        plan = planner.create_local_plan()
        if not getattr(plan, "usable", True):
            plan = planner.plan
        return plan

    def wait_staged(self) -> None:
        """``SaveHandle.wait_staged`` for every pending save: call it before the optimizer step with ``overlap_copy``."""
        for handle in self._pending:
            handle.wait_staged()

    def maybe_finalize(self) -> list[int]:
        """Collect saves that finished, without blocking; returns the steps committed.

        Raises ``CheckpointSaveError`` (on every rank) for a save that failed.
        """
        committed = []
        while self._pending and self._pending[0].done():
            stats = self._finalize(self._pending[0], timeout=0)
            if stats is not None:
                committed.append(stats.step)
        return committed

    def wait(self, timeout: float | None = None) -> list[int]:
        """Block until every pending save is committed; raise on the first failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        committed = []
        while self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            stats = self._finalize(self._pending[0], timeout=left)
            if stats is not None:
                committed.append(stats.step)
        return committed

    def _finalize(self, handle: SaveHandle, timeout: float | None) -> SaveStats | None:
        """``handle``'s stats once it is done, and off the pending list; ``None`` for a failure already delivered."""
        delivered = handle.failure_delivered
        try:
            stats = handle.result(timeout)
        except CheckpointTimeoutError:
            raise
        except BaseException:
            self._pending.remove(handle)
            if delivered:
                return None  # the caller has had it (from handle.result()): pass over it
            raise
        self._pending.remove(handle)
        self.last_stats = stats
        return stats

    # -- the background pipeline -------------------------------------------------------

    def _run(self, job: _SaveJob) -> SaveStats:
        try:
            return self._run_phases(job)
        except CheckpointSaveError:
            raise
        except Exception as e:  # noqa: BLE001
            # A collective failed (a peer died or timed out) or staging broke.
            # Nothing was committed; say so in the one error type callers handle.
            raise CheckpointSaveError(job.url, {self.rank: _describe(e)}) from e

    def _run_phases(self, job: _SaveJob) -> SaveStats:
        writer = self._writer
        t0 = time.perf_counter()
        error = job.error
        if error is None:
            try:
                job.staged.wait_ready()
                writer.reset(job.url)
                writer.set_up_storage_writer(self._coll.is_coordinator, rank=self.rank)
                # An early, friendly refusal; the conditional commit is what guarantees it.
                if writer.destination_committed():
                    raise CheckpointExistsError(
                        f"{job.url}: Checkpoint already exists: step {job.step} is already committed; steps are never overwritten"
                    )
            except Exception as e:  # noqa: BLE001 - must still join the collective below
                error = e
        job.stats.exists_check_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        cached = self.plan_cache.lookup(job.local_plan, self.world_size) if error is None else None
        primed_miss = self.plan_cache.primed_miss(job.local_plan) if cached is None and error is None else None
        # The save's nonce rides along: the largest of the ranks' random draws;
        # and the lowest rank that could not use plans primed from a checkpoint.
        reuse, all_ok, neg_nonce, first_miss = self._coll.all_min(
            [int(cached is not None), int(error is None), -random.getrandbits(62),
             self.rank if primed_miss is not None else self.world_size]
        )
        job.nonce = f"{-neg_nonce:016x}"
        writer.save_id = job.nonce  # what .metadata carries; a peer that loses the coordinator looks for it
        if not all_ok:
            self._raise_everywhere(job.url, error)
        if first_miss < self.world_size:
            self._warn_plans_not_reused(first_miss, primed_miss)
        if reuse:
            cached.source = None  # reused: from now on, these are plans this job made
            central_plan, metadata = cached.central_plan, cached.metadata
            if cached.all_local_plans is not None:
                writer.remember_local_plans(cached.all_local_plans)
        else:
            central_plan, metadata = self._plan(job, writer)
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
        if job.staged is not None:
            job.stats.device_stall_s = job.staged.stall_s()  # the waits made so far (overlap_copy: the loop's)

        t2 = time.perf_counter()
        self._commit(job, writer, metadata, results, error)
        job.stats.commit_s = time.perf_counter() - t2
        return job.stats

    def _warn_plans_not_reused(self, first_miss: int, primed_miss: str | None) -> None:
        """One warning when the first save after a resume cannot reuse the plans it was primed with.

        The coordinator says so, with the reason if it is the lowest rank that
        missed; that rank, if another, logs its own (which item, which field).
        """
        if first_miss == self.rank:
            logger.warning("rank %d: %s; this save plans in full", self.rank, primed_miss)
        elif self._coll.is_coordinator:
            logger.warning(
                "the plans persisted in the checkpoint this job resumed from cannot be reused: rank %d's local plan "
                "differs (its log says which item and field); this save plans in full", first_miss
            )

    def _plan(self, job: _SaveJob, writer: ObjectStoreWriter) -> tuple[SavePlan, Metadata | None]:
        """Full planning; fills the plan cache.

        A rank that staged from its cached plan (while another rank's
        structure changed) offers global planning only the items it
        staged: the replicated items it had left to another rank go to a
        rank that staged them, not to this one (staging them now would mix
        steps: the live tensors have moved on).  Its whole local plan is
        still what the cache and the persisted plans key on.
        """
        unstaged = {item.index for item in job.staged.missing(job.local_plan.items)}
        offered = dataclasses.replace(job.local_plan, items=[i for i in job.local_plan.items if i.index not in unstaged])
        local = writer.attach_local_plan(offered, carried=job.local_plan)
        if self.planning == "decentralized":
            all_local = self._coll.all_gather(local)
            try:
                global_plans, metadata = job.planner.create_global_plan(all_local)
                _check_every_item_offered(all_local, metadata)
            except Exception:
                self.plan_cache.clear()  # every rank fails here alike; the next save stages all and plans afresh
                raise
            central_plan = writer.prepare_global_plan(global_plans)[self.rank]
            self.plan_cache.store(
                CachedPlan(job.local_plan, central_plan, self.world_size, metadata, writer.all_local_plans)
            )
            return central_plan, metadata

        gathered = self._coll.gather(local)
        metadata = None
        payload = None
        if self._coll.is_coordinator:
            try:
                global_plans, metadata = job.planner.create_global_plan(gathered)
                _check_every_item_offered(gathered, metadata)
                payload = writer.prepare_global_plan(global_plans)
            except Exception as e:  # noqa: BLE001 - sent to every rank
                payload = [_Failure(_describe(e))] * self.world_size
        central_plan = self._coll.scatter(payload)
        if isinstance(central_plan, _Failure):
            self.plan_cache.clear()  # the next save stages all it holds and plans afresh
            raise CheckpointSaveError(job.url, {0: f"global planning failed: {central_plan.message}"})
        self.plan_cache.store(CachedPlan(job.local_plan, central_plan, self.world_size, metadata, writer.all_local_plans))
        return central_plan, metadata

    def _commit(self, job: _SaveJob, writer: ObjectStoreWriter, metadata, results, error) -> None:
        """Agree on how to commit, commit on the coordinator, and give every rank the outcome storage shows.

        One all-reduce decides the way: whether every upload succeeded, and
        whether every rank's write results fit the coordinator's template
        (the same template id, and on each rank the layout it wrote for it;
        see ``metadata_template``).  Then either a patched commit (each
        rank's values in one tensor to the coordinator, the verdict back as
        a tensor: no object collective, nothing per item on the coordinator
        but bytes), or the full one (write results gathered as objects,
        ``.metadata`` built and pickled).  A failed upload anywhere: every
        rank hears every failure, and no ``.metadata`` is written.

        Shards are deleted only when no ``.metadata`` can name them: each
        rank its own after a failed commit, the coordinator all of them after
        a refused one (once, in ``ObjectStoreWriter.commit``), nobody after
        an unknown one.
        """
        vote = writer.patch_vote(results) if error is None else None
        template_id, values = vote if vote is not None else (0, numpy.zeros(0, numpy.int64))
        if self._coll.is_coordinator and template_id != writer.template_id(metadata):
            template_id = 0  # this rank wrote as the template says, but the template is of another save
        if self._coll.is_coordinator and self._coll.enabled:
            # The coordinator's last moment to start a patched .metadata PUT: no
            # peer leaves this all-reduce before every rank entered it, so a peer
            # stops waiting (in the gather or the verdict after it) no sooner
            # than a group timeout from now.  The full path sets its own.
            writer.put_deadline = time.monotonic() + self._coll.timeout_s(self.collective_timeout)
        try:
            all_ok, lowest, neg_highest, neg_width = self._coll.all_min(
                [int(error is None), template_id, -template_id, -len(values)]
            )
        except Exception as e:  # noqa: BLE001 - this rank sent nothing a commit needs: none can happen
            if results:
                writer.delete_shards(results)
            raise CheckpointSaveError(job.url, {self.rank: f"agreeing on the commit failed: {_describe(e)}"}) from (error or e)
        if not all_ok:
            if results:
                writer.delete_shards(results)  # no rank sends its results: nothing is committed
            self._raise_everywhere(job.url, error)
        verdict, settled = None, False
        patch = lowest == -neg_highest > 0
        if patch:
            verdict, settled = self._commit_patched(job, writer, values, 1 - neg_width)
        if not patch or verdict is _FULL:
            verdict, settled = self._commit_full(job, writer, metadata, results)
        if verdict is None:
            self._parent = job.step
            return
        if settled:
            results = None  # storage's answer is final, but a rank that settled deletes nothing: gc reclaims
        outcome, failures = verdict
        if outcome is Outcome.UNKNOWN:
            raise CommitOutcomeUnknownError(job.url, failures) from error
        if outcome is Outcome.FAILED and results:
            writer.delete_shards(results)  # this rank's own: no .metadata names them
        raise CheckpointSaveError(job.url, failures) from error

    def _commit_patched(self, job: _SaveJob, writer: ObjectStoreWriter, values: numpy.ndarray, width: int):
        """A patched commit: each rank's values to the coordinator as one tensor, the verdict back as one; ``_FULL`` to commit in full instead.

        Every rank pads its row to ``width`` (the longest, from the
        all-reduce); the coordinator receives W rows.  Only a verdict other
        than committed travels with its messages, as an object.
        """
        row = numpy.zeros(width, numpy.int64)
        row[0] = len(values)
        row[1 : 1 + len(values)] = values
        entered = time.monotonic()
        gathered = gather_error = verdict = None
        try:
            gathered = self._coll.gather_tensor(torch.from_numpy(row))
        except Exception as e:  # noqa: BLE001 - a peer died; the verdict below still tells the rest
            gather_error = e
        if self._coll.is_coordinator:
            verdict = self._decide(job, writer, gather_error, lambda: writer.commit_patched(gathered.numpy()))
        try:
            kind = _VERDICTS[self._coll.broadcast_code(_verdict_code(verdict))]
        except Exception as e:  # noqa: BLE001 - storage decides, unless this rank decided
            if self._coll.is_coordinator:
                why = f"sending the verdict failed: {_describe(e)}"
                return (verdict if verdict is not _FULL else (Outcome.FAILED, {self.rank: why})), False
            return self._settle_without_coordinator(job, writer, e, entered), True
        if kind is None or kind is _FULL:
            return kind, False
        try:  # a verdict other than committed: its messages, once
            return self._coll.broadcast(verdict), False
        except Exception:  # noqa: BLE001 - the outcome is known; only the coordinator's words are lost
            return (verdict if self._coll.is_coordinator else (kind, {0: f"the commit of .metadata: {kind.value}"})), False

    def _commit_full(self, job: _SaveJob, writer: ObjectStoreWriter, metadata, results):
        """The full commit: the write results gathered as objects, ``.metadata`` built by ``finish``, the verdict broadcast.

        The coordinator's verdict travels as ``None`` (committed) or
        ``(Outcome, failures)``.
        """
        writer.remember_written(results)  # what the coordinator's template of this save, if any, is made of
        if isinstance(metadata, UnparsedMetadata) and self._coll.is_coordinator:
            metadata = self._parse_global_state(metadata)
        verdict = None
        gather_error = None
        if self._coll.is_coordinator and self._coll.enabled:
            # The coordinator's last moment to start the .metadata PUT.  A peer
            # stops waiting for the verdict a group timeout after it entered the
            # broadcast, which is after it left the gather; no rank leaves the
            # gather before every rank entered it (gather_object begins with an
            # all_gather of the sizes), so not before now.  Its PUT then lands
            # before the peer's settling ends (see _settle_without_coordinator).
            writer.put_deadline = time.monotonic() + self._coll.timeout_s(self.collective_timeout)
        gathered = None
        try:
            gathered = self._coll.gather(results)
        except Exception as e:  # noqa: BLE001 - a peer died; the broadcast below still tells the rest
            gather_error = e
        if self._coll.is_coordinator:
            verdict = self._decide(job, writer, gather_error, lambda: writer.finish(metadata, gathered) or True)
        entered = time.monotonic()
        try:
            return self._coll.broadcast(verdict), False
        except Exception as e:  # noqa: BLE001 - storage decides, unless this rank decided
            if self._coll.is_coordinator:
                return verdict, False
            return self._settle_without_coordinator(job, writer, e, entered), True

    def _parse_global_state(self, unparsed: UnparsedMetadata) -> Metadata | None:
        """A resumed coordinator's global ``Metadata``, parsed for a full commit, and kept in the plan cache; ``None`` if it cannot be."""
        try:
            metadata, plans = unparsed.resolve()
        except Exception as e:  # noqa: BLE001 - finish() fails on None: the save fails, the next one plans in full
            logger.warning("%s: parsing the resumed .metadata for a full commit failed: %s", self.root, e)
            self.plan_cache.clear()
            return None
        self._writer.remember_local_plans(plans)
        entry = self.plan_cache.entry
        if entry is not None and entry.metadata is unparsed:
            entry.metadata, entry.all_local_plans = metadata, plans
        return metadata

    def _decide(self, job: _SaveJob, writer: ObjectStoreWriter, gather_error, commit: Callable[[], bool]):
        """On the coordinator: run ``commit`` (``False``: it cannot, commit in full); the verdict for ``_commit``, or ``_FULL``."""
        if gather_error is not None:
            return Outcome.FAILED, {self.rank: f"collecting the ranks' write results failed: {_describe(gather_error)}"}
        try:
            record = self._next_commit(job)
            writer.commit_tags, writer.commit_record = record.tags(), record.planner_data()
            try:
                if not commit():
                    return _FULL
            finally:
                job.stats.metadata_patched = writer.patched_commit
        except CommitOutcomeUnknownError as e:
            self._last_sequence = record.sequence  # it may have committed with it
            self._unsettled.add(job.step)
            return Outcome.UNKNOWN, e.failures
        except CheckpointExistsError as e:
            return Outcome.REFUSED, {self.rank: f"writing .metadata was refused: {_describe(e)}"}
        except Exception as e:  # noqa: BLE001
            return Outcome.FAILED, {self.rank: f"writing .metadata failed: {_describe(e)}"}
        self._order.remember(self.step_prefix(job.step), record)
        self._last_sequence = record.sequence
        if self.keep_last is not None or self.gc_grace is not None:
            self._collect_before(job.step, writer.put_deadline)
        return None

    def _next_commit(self, job: _SaveJob) -> CommitRecord:
        """This save's commit record: the next sequence above what storage holds now, and the step the job continued from.

        Read from storage at every commit (``CommitOrder.newest``: one
        listing of the step folders, a HEAD for each step not seen before),
        never counted on locally: another run on the root (a zombie, a
        restart while the old job still saves, a mistyped name) commits
        meanwhile, and a commit below its newest sequence would lose to it,
        and be pruned by this very save's retention.
        """
        newest, highest = self._order.newest(self.step_naming)
        sequence = max(newest, self._last_sequence) + 1
        if highest is not None and job.step < highest:
            logger.warning(
                "%s: saving step %d below the highest committed step %d; steps are ordered by when "
                "they committed, so step %d becomes the latest",
                self.root, job.step, highest, job.step,
            )
        return CommitRecord(job.step, sequence, self._parent)

    def _settle_without_coordinator(self, job: _SaveJob, writer: ObjectStoreWriter, broken: BaseException, entered: float):
        """The verdict of a rank that lost the coordinator's answer: what storage shows, once it is final.

        The coordinator starts its ``.metadata`` PUT, if at all, no later
        than a group timeout after it entered the gather (``put_deadline``),
        which is no later than this rank's collective broke; it sends its
        last attempt within ``commit_window`` of starting it, and an
        unsettled attempt lands within ``landing_margin`` of being sent.
        Storage's answer after all three is final, however slow the
        coordinator's work before the PUT (the resume index, the root's
        listing).  ``entered``: when this rank entered the broadcast; a
        collective that broke sooner than the group timeout (a peer's socket
        closed) is settled as if it had timed out, since the coordinator
        may still be working.  This rank returns sooner when the
        ``.metadata`` shows up.
        """
        why = f"the commit's collective broke ({_describe(broken)})"
        broke = max(time.monotonic(), entered + self._coll.timeout_s(self.collective_timeout))
        until = broke + self.commit_window + landing_margin(writer.store)
        outcome = wait_and_settle(writer.store, job.nonce, until)
        if outcome is Outcome.COMMITTED:
            logger.warning("%s: step %d is committed, but a peer rank failed around the commit (%s)", job.url, job.step, broken)
            return None
        if outcome is Outcome.UNKNOWN:
            return outcome, {self.rank: f"{why}, and storage could not be read back"}
        return outcome, {self.rank: f"{why}, and storage shows no .metadata of this save ({outcome.value})"}

    def _raise_everywhere(self, url: str, error: BaseException | None) -> None:
        messages = self._coll.all_gather(_describe(error) if error is not None else None)
        raise CheckpointSaveError(url, {r: m for r, m in enumerate(messages) if m is not None}) from error

    def _collect_before(self, just_committed: int, peers_wait_until: float | None) -> None:
        """Run retention (``_collect``) on its own thread, and wait for it while the peers still wait for the verdict.

        Waiting means that once a save is done on any rank, every rank's
        ``committed_steps()`` lists what is kept.  But a throttled or
        stalled DELETE can retry for a whole throttle budget, and a peer
        stops waiting for the verdict a group timeout after it entered the
        broadcast (``peers_wait_until``, the coordinator's ``put_deadline``:
        no peer gives up before it).  So the wait ends a tenth of the group
        timeout before that; the deletes then go on in the background
        (logged), and a commit that finds the last round still running
        skips its own round: the next one deletes what is left.
        """
        if self._collecting is not None and not self._collecting.done():
            logger.warning("%s: the last commit's deletions are still running; this commit deletes nothing", self.root)
            return
        self._collecting = self._collector.submit(self._collect, just_committed)
        if peers_wait_until is None:  # no peers: wait it out
            self._collecting.result()
            return
        margin = self._coll.timeout_s(self.collective_timeout) / 10
        concurrent.futures.wait([self._collecting], timeout=max(0.0, peers_wait_until - margin - time.monotonic()))
        if not self._collecting.done():
            logger.warning(
                "%s: deleting old steps (keep_last=%s, gc_grace=%s) outlasts what the peers wait for; it goes on in "
                "the background, and the ranks may list steps it is deleting", self.root, self.keep_last, self.gc_grace,
            )

    def _collect(self, just_committed: int) -> None:
        """Delete committed steps beyond ``keep_last`` and, with ``gc_grace``, failed saves' debris (coordinator only); best effort.

        Kept: the newest commit and its lineage, then the newest of the rest
        (see ``steps.retained``), and the step just committed whatever
        another run committed meanwhile, and steps whose commit outcome this
        job could not learn.  Runs on
        the save's background thread: one listing, batched deletes.  A
        failure here is logged.
        """
        try:
            plan = plan_gc(
                self.store, self.keep_last, self.gc_grace,
                naming=self.step_naming, order=self._order, keep=frozenset({just_committed, *self._unsettled}),
            )
            plan.run(self.store)
            for info in plan.pruned:
                self._order.forget(info.prefix)
        except Exception as e:  # noqa: BLE001
            logger.warning("%s: deleting old steps (keep_last=%s, gc_grace=%s) failed: %s", self.root, self.keep_last, self.gc_grace, e)

    def _ordered_steps(self) -> list[int]:
        """Committed steps under the root, oldest commit first (see ``steps``)."""
        return [r.step for r in self._order.records(committed_steps(self.store, self.step_naming))]

    # -- reading ------------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """Committed steps under the root, oldest commit first (not by number), after waiting for pending saves.

        Every rank lists the same steps: a save completes on a rank only
        after the coordinator has committed it and pruned beyond
        ``keep_last`` (unless the deletes outlast what the peers wait for:
        then they finish in the background, logged; see ``_collect_before``).
        """
        self.wait()
        return self._ordered_steps()

    def latest_step(self) -> int | None:
        """The most recently committed step under the root (by commit order, not number), or ``None``; agreed on by all ranks.

        Waits for pending saves first (raising their errors): their
        collectives must not interleave with this one.
        """
        self.wait()
        steps = self._agreed(self._ordered_steps, "listing the committed steps")
        return steps[-1] if steps else None

    def steps_committed_after(self, step: int) -> list[int]:
        """The committed steps whose commits came after ``step``'s, oldest first (commit order, not number); agreed on by all ranks.

        ``[]`` when ``step`` is not committed.  Call it on every rank.  What
        a rollback to ``step`` abandons (``discard_step``).  Waits for
        pending saves first (raising their errors).
        """
        self.wait()

        def after() -> list[int]:
            order = self._ordered_steps()
            return order[order.index(step) + 1 :] if step in order else []

        return self._agreed(after, f"listing the steps committed after step {step}")

    def discard_step(self, step: int) -> None:
        """Delete committed step ``step``'s checkpoint (``.metadata`` first; your files in its folder stay).  Call it on every rank.

        For a rollback that saves a step it abandoned again under the same
        number (torchtitan saves every ``interval`` steps): steps are never
        overwritten.  Waits for pending saves first (raising their errors).
        """
        self.wait()
        prefix = self.step_prefix(step)
        self._agreed(lambda: delete_committed_step(self.store, prefix), f"deleting step {step}")
        self._order.forget(prefix)

    def _agreed(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()``, run on the coordinator, on every rank; its error raised on every rank (not a peer left waiting)."""
        result = None
        if self._coll.is_coordinator:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - the peers wait in the broadcast: they must hear of it
                result = e if isinstance(e, DcpstoreError) else DcpstoreError(f"{self.root}: {what} failed: {_describe(e)}")
        result = self._coll.broadcast(result)
        if isinstance(result, BaseException):
            raise result
        return result

    def load(
        self,
        state_dict: dict[str, Any],
        step: int | None = None,
        *,
        allow_globals: tuple = (),
        allow_unsafe_pickle: bool = False,
    ) -> int:
        """Load ``step`` (default: the latest committed, see ``latest_step``) into ``state_dict`` in place.

        The next save continues from ``step``: it is that commit's parent,
        which retention keeps (see ``steps``).

        Also primes the plan cache from the checkpoint, so the next ``save``
        of the same structure runs no planning collective.  Returns the step.
        A failure on any rank raises ``CheckpointLoadError`` on every rank
        (an ``Exception``, unlike torch's ``CheckpointException``), naming the
        step and the first failing rank's error, which is its ``__cause__``.
        Waits for pending saves first (raising their errors).
        ``allow_globals`` and ``allow_unsafe_pickle``: see ``ObjectStoreReader``.
        """
        self.wait()
        coordinator = self._coll.is_coordinator
        reader = metadata = raw = share = None
        try:
            # The coordinator finds the step and the resume index (one HEAD
            # of .metadata), and sends each rank the step and its own
            # directory entry: a few hundred bytes, not W of them.
            shared: Any = self._find_for_load(step) if coordinator else None
            directory = None
            if coordinator and not isinstance(shared, BaseException):
                step, directory, raw = shared
                shared = [(step, self._rank_entry(directory, r)) for r in range(self.world_size)]
            elif coordinator:
                shared = [shared] * self.world_size
            shared = self._coll.scatter(shared)
            if isinstance(shared, BaseException):
                raise shared
            step, entry = shared
            url = self.step_url(step)
            reader = self._reader(step, allow_globals, allow_unsafe_pickle)
            flat_sd = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}
            if entry is not None:
                share = self._read_share(reader, entry, flat_sd, url)
            if entry is not None and self._coll.all_min([int(share is not None)])[0]:
                metadata = reader.use_metadata(share.metadata)
            else:
                # Every rank reads .metadata: the coordinator's one GET, broadcast.
                share = None
                if coordinator and raw is None:
                    raw = self._metadata_bytes(step)
                raw = self._coll.broadcast(raw)
                if isinstance(raw, BaseException):
                    raise raw
                metadata = reader.use_metadata_bytes(raw)
            check_state_dict(flat_sd, metadata, url)
            with warnings.catch_warnings():
                # dcp.load warns whenever no_dist is set; a single process is intended here.
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(state_dict, storage_reader=reader, process_group=self._coll.group, no_dist=not self._coll.enabled)
        except CheckpointException as e:
            failures = {rank: wrapped[0] for rank, wrapped in e.failures.items()}
            raise CheckpointLoadError(self.step_url(step), step, failures) from failures[min(failures)]
        finally:
            if reader is not None:
                reader.close()
        self._parent = step
        if share is not None:
            if share.template_of is not None:
                self._writer.remember_written_share(share.template_of, share.written)
            self.plan_cache.fill_from_share(
                share.local_plan, share.final_plan, rank=self.rank, world_size=self.world_size,
                planner=self.planner_factory(),
                global_state=self._global_state_later(step, allow_globals, raw, directory) if coordinator else None,
                source=describe_source(url, entry.get("torch_version")),
            )
            return step
        # The writer only assigns storage prefixes here; it sends no request.
        writer = ObjectStoreWriter(url, storage_options=self.storage_options, transfer=self.transfer)
        try:
            self.plan_cache.fill_from_metadata(
                metadata, rank=self.rank, world_size=self.world_size, planner=self.planner_factory(), writer=writer
            )
        finally:
            writer.close()
        return step

    def _reader(self, step: int, allow_globals: tuple, allow_unsafe_pickle: bool) -> ObjectStoreReader:
        return ObjectStoreReader(
            self.step_url(step),
            storage_options=self.storage_options,
            transfer=self.transfer,
            allow_globals=allow_globals,
            allow_unsafe_pickle=allow_unsafe_pickle,
        )

    @staticmethod
    def _rank_entry(directory: dict | None, rank: int) -> dict | None:
        """Rank ``rank``'s entry of the directory, with the values its block reads (the coordinator read them once)."""
        if directory is None:
            return None
        try:
            return resume_index.rank_entry(directory, rank, directory["values_read"])
        except resume_index.IndexUnusable as e:
            logger.warning("rank %d falls back to .metadata: %s", rank, e)
            return None

    def _read_share(self, reader: ObjectStoreReader, entry: dict, flat_sd: dict, url: str) -> resume_index.Share | None:
        """This rank's share of the checkpoint from its index block (``entry``), or ``None`` (logged) to read ``.metadata``."""
        try:
            return resume_index.read_share(reader.store, entry, flat_sd, url)
        except resume_index.IndexUnusable as e:
            (logger.warning if e.damaged else logger.info)("%s: rank %d falls back to .metadata: %s", url, self.rank, e)
        except Exception as e:  # noqa: BLE001 - every rank must reach the all_min that decides the fallback
            logger.warning("%s: rank %d could not use its resume index block (%s); falls back to .metadata", url, self.rank, _describe(e))
        return None

    def _metadata_bytes(self, step: int) -> bytes | BaseException:
        """On the coordinator: ``.metadata``'s bytes to broadcast, or the error every rank raises."""
        child = self.store.child(self.step_prefix(step))
        try:
            return read_metadata_bytes(child)
        except Exception as e:  # noqa: BLE001 - the peers wait in the broadcast: they must hear of it
            return e if isinstance(e, DcpstoreError) else DcpstoreError(f"{self.step_url(step)}: reading .metadata failed: {_describe(e)}")
        finally:
            child.close()

    def _global_state_later(self, step: int, allow_globals: tuple, raw: bytes | None, directory: dict | None) -> concurrent.futures.Future:
        """What the coordinator commits the next save with, made off the training thread.

        A coordinator that resumed from its share has only its own plans.
        Where the resume index holds the commit template's map, the next
        saves patch the resumed ``.metadata`` (``_commit_template``): its
        bytes are read, not parsed, and the global ``Metadata`` stays
        unparsed in them (``UnparsedMetadata``) unless a save must commit in
        full.  Otherwise ``.metadata`` (O(W x N): 22 MB at 64 x 2,000, about
        1.4 GB at 4,096 x 2,000) is read and parsed here.  Either runs in a
        thread of its own while training goes on; the first save waits for
        it on its background thread (``PlanCache.lookup``).
        """
        future: concurrent.futures.Future = concurrent.futures.Future()

        def read() -> None:
            reader = self._reader(step, allow_globals, allow_unsafe_pickle=False)
            try:
                state = self._commit_template(reader, directory, raw) if directory is not None else None
                if state is None:
                    metadata = reader.read_metadata() if raw is None else reader.use_metadata_bytes(raw)
                    state = PlanCache.coordinator_state(metadata)
                future.set_result(state)
            except BaseException as e:  # noqa: BLE001 - lookup logs it and the save plans in full
                future.set_exception(e)
            finally:
                reader.close()

        threading.Thread(target=read, name="dcpstore-global-plan", daemon=True).start()
        return future

    def _commit_template(self, reader: ObjectStoreReader, directory: dict, raw: bytes | None) -> tuple | None:
        """On a resumed coordinator: the resumed ``.metadata`` as the writer's commit template, and what stands for the structure.

        ``None`` (logged) when the index holds no map or the bytes are not
        the map's: the caller parses ``.metadata`` instead.  Memory: the
        bytes of ``.metadata`` and of the index's blocks, no object per item.
        """
        template = None
        where, allowed = reader.store.url_for(METADATA_KEY), reader.allow_globals

        def parse() -> tuple:  # the template's bytes: the last .metadata it committed, of this structure
            return PlanCache.coordinator_state(parse_metadata(bytes(template.template.raw), where, allowed))

        unparsed = UnparsedMetadata(parse)
        try:
            layout = resume_index.read_layout(reader.store, directory)
            body = raw if raw is not None else read_metadata_bytes(reader.store)
            template = CommitTemplate.from_stored(
                body, layout.template, unparsed, layout.counts, layout.checksums, layout, layout.template_of
            )
        except (resume_index.IndexUnusable, Unpatchable) as e:
            logger.info("%s: the next commit is built in full (%s)", reader.checkpoint_id, e)
            return None
        self._writer.use_template(template)
        return unparsed, None

    def _find_for_load(self, step: int | None) -> tuple[int, dict | None, bytes | None] | BaseException:
        """On the coordinator: the step to load, its resume index directory and/or ``.metadata`` bytes, or the error for every rank.

        The index is found with one HEAD of ``.metadata`` (``resume_index``):
        no rank parses ``.metadata`` on the way to resuming the same
        structure.  Without a usable index (a single rank, another world
        size, an older checkpoint or torch's, a store without user
        metadata, a damaged index), ``.metadata`` is read here, once per job,
        and broadcast: at 4,096 ranks and a 42 MB ``.metadata`` (see
        docs/scale.md) W GETs would be 172 GB out of the bucket and 4,096
        requests on one key in the same second, where S3 serves about 5,500
        GETs/s per prefix.  gloo's broadcast is a binomial tree: each rank
        receives the bytes once and forwards them at most log2(W) times.
        Every rank still unpickles the bytes itself, with its own allow-list.
        """
        try:
            if step is None:
                steps = self._ordered_steps()
                if not steps:
                    raise CheckpointNotFoundError(f"{self.root}: no committed checkpoint to load")
                step = steps[-1]
            child = self.store.child(self.step_prefix(step))
            try:
                return (step, *self._index_directory(child, step))
            finally:
                child.close()
        except DcpstoreError as e:
            return e
        except Exception as e:  # noqa: BLE001 - the peers must not wait for a scatter that never comes
            where = self.step_url(step) if step is not None else self.root
            error = DcpstoreError(f"{where}: finding the checkpoint to load failed: {_describe(e)}")
            error.__cause__ = e
            return error

    def _index_directory(self, store, step: int) -> tuple[dict | None, bytes | None]:
        """The resume index directory of ``step`` (``None``, logged, when every rank is to read ``.metadata``), and ``.metadata``'s bytes if read.

        A store without user metadata (``file://``) names the index only
        inside ``.metadata``: the coordinator reads it, and its bytes serve
        the plan cache later (``_global_state_later``).
        """
        raw = None
        try:
            if self.world_size == 1:
                raise resume_index.IndexUnusable("a single rank reads .metadata", damaged=False)
            try:
                pointer = resume_index.pointer_from_head(store)
            except ObjectNotFoundError:
                raise no_metadata_error(store) from None
            if pointer is None and not store.has_user_metadata:
                raw = read_metadata_bytes(store)
                pointer = resume_index.pointer_of(parse_metadata(raw, store.url_for(METADATA_KEY)))
            if pointer is None:
                raise resume_index.IndexUnusable("the checkpoint has no resume index", damaged=False)
            directory = resume_index.read_directory(store, pointer, self.world_size)
            return {**directory, "values_read": resume_index.read_values(store, directory)}, raw
        except resume_index.IndexUnusable as e:
            if self.world_size > 1:
                (logger.warning if e.damaged else logger.info)(
                    "%s: not resuming from the resume index (%s); every rank reads .metadata", self.step_url(step), e
                )
            return None, raw if raw is not None else read_metadata_bytes(store)

    # -- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Wait for pending saves (raising their errors), then release threads and buffers."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)
            self._collector.shutdown(wait=True)  # deletions that outlasted their commit finish first
            self._writer.close()
            self.store.close()
            for pool in self._pools:
                pool.clear()

    def __enter__(self) -> "AsyncCheckpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
