"""``AsyncCheckpointer``: what a training loop calls, as a facade over the modules that do the work.

``save(state_dict, step)`` blocks only while the rank's items are staged
into reused host buffers (``staging``).  Everything else runs on one
background thread per checkpointer, in the same order on every rank:
plan, upload, commit (``save_pipeline``, then ``commit_protocol``).  A
failure anywhere leaves no ``.metadata``, and every rank raises
``CheckpointSaveError`` from ``maybe_finalize``/``wait``
(``CommitOutcomeUnknownError`` when storage could not be read back).
``load`` runs the resume protocol (``resume``); the listing calls read the
commit order (``steps``), and retention runs after each commit there too.

Collectives run on a gloo group of the checkpointer's own (created from the
default group, or passed in; ``collectives``), so they never interleave
with the training job's NCCL or gloo collectives.  That group's timeout
bounds every wait on a peer: a rank that dies mid-save becomes an error on
the others, not a hang.  Storage requests are bounded by connect/read
timeouts and the retry policy.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import time
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.stateful import Stateful

from .collectives import Collectives
from .commit_protocol import CommitProtocol
from .errors import CheckpointTimeoutError
from .layout import StepNaming, delete_committed_step
from .plan_cache import PlanCache
from .resume import Resume
from .save_job import SaveJob, SaveStats
from .save_pipeline import PLANNING_MODES, SavePipeline, usable_local_plan
from .staging import StagedItems, StagingPool
from .collection import Retention, check_grace
from .steps import CommitOrder
from .storage import TransferConfig, check_storage_options, normalize_url, open_store, warn_if_each_rank_resolves_it_alone
from .writer import ObjectStoreWriter

__all__ = ["AsyncCheckpointer", "SaveHandle", "SaveStats"]


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
        read_once: ``load`` reads each stored item that several ranks load
            (every rank under DDP, every replica group under HSDP) from the
            bucket once, on one of them, and sends it to the others over
            the checkpointer's group (see ``cooperative_load``).  ``False``
            reads each rank's items from the bucket, as a lone rank would.
        incremental: a save does not send again the tensor items whose bytes
            did not change since this checkpointer's last committed save:
            on S3 the bucket copies them from that step into the new one
            (see ``incremental``), so every step stays whole.  After a
            restart, ``load`` hashes what it reads, and the first save
            copies what did not change since.  Off by default: each save
            and load then hashes every tensor byte (0.03 CPU s/GiB) and
            looks at each object it copies from (a HEAD), for a gain only
            where much of the state does not change between saves.
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
        read_once: bool = True,
        incremental: bool = False,
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
        check_storage_options(AsyncCheckpointer, self.root, storage_options)
        warn_if_each_rank_resolves_it_alone(self.root)
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
        self.overlap_copy = overlap_copy
        self.store = open_store(self.root, self.storage_options, self.transfer)
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.new_group(backend="gloo", timeout=collective_timeout)
        self._coll = Collectives(process_group)
        self.plan_cache = PlanCache()
        self._order = CommitOrder(self.store)
        self._writer = ObjectStoreWriter(
            self.root,
            storage_options=self.storage_options,
            transfer=self.transfer,
            objects_per_rank=objects_per_rank,
            key_spread=key_spread,
            commit_window=commit_window,
            incremental=incremental,
        )
        if gc_grace is not None:  # its own collections must find its running saves live (see lease)
            self._writer.lease_period = min(self._writer.lease_period, gc_grace / 4)
        self._retention = Retention(
            self.store, keep_last, gc_grace, self.step_naming, self._order, self._coll.timeout_s(collective_timeout)
        )
        self._commits = CommitProtocol(
            self._coll, self._writer, self.plan_cache, self._order, self._retention,
            root=self.root, naming=self.step_naming, collective_timeout=collective_timeout, commit_window=commit_window,
        )
        self._pipeline = SavePipeline(self._coll, self._writer, self.plan_cache, self._commits, planning)
        self._resume = Resume(
            self._coll, self.store, self._order, self._writer, self.plan_cache, planner_factory,
            root=self.root, naming=self.step_naming, storage_options=self.storage_options, transfer=self.transfer,
            read_once=read_once,
        )
        self._pools = [StagingPool(pin_memory) for _ in range(max_in_flight)]
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcpstore-save")
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
        return self.step_naming.url(self.root, step)

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
            local_plan = usable_local_plan(planner)
            # With a cached plan, stage only the items this rank writes: a
            # replicated item is copied to host by the one rank the plan's
            # dedup gave it to, not by every rank that holds it.
            cached = self.plan_cache.lookup(local_plan, self.world_size, wait=False)
            items = list((cached.central_plan if cached else local_plan).items)
            staged = pool.stage(items, planner, training_waits=not self.overlap_copy)
        except Exception as e:
            self._executor.submit(self._pipeline.run, SaveJob(step, url, None, None, None, stats, error=e))
            raise
        stats.staged_bytes = staged.nbytes
        stats.staged_items = len(staged)
        stats.host_bytes, stats.pinned_bytes = pool.nbytes, pool.pinned_bytes
        job = SaveJob(step, url, planner, local_plan, staged, stats)
        future = self._executor.submit(self._pipeline.run, job)
        stats.blocking_s = time.perf_counter() - t0
        handle = SaveHandle(step, url, future, stats, pool, staged)
        self._pending.append(handle)
        return handle

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

    # -- reading ------------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """Committed steps under the root, oldest commit first (not by number), after waiting for pending saves.

        Every rank lists the same steps: a save completes on a rank only
        after the coordinator has committed it and pruned beyond
        ``keep_last`` (unless the deletes outlast what the peers wait for:
        then they finish in the background, logged; see ``collection.Retention``).
        """
        self.wait()
        return self._order.steps(self.step_naming)

    def latest_step(self) -> int | None:
        """The most recently committed step under the root (by commit order, not number), or ``None``; agreed on by all ranks.

        Waits for pending saves first (raising their errors): their
        collectives must not interleave with this one.
        """
        self.wait()
        steps = self._coll.agreed(lambda: self._order.steps(self.step_naming), self.root, "listing the committed steps")
        return steps[-1] if steps else None

    def steps_committed_after(self, step: int) -> list[int]:
        """The committed steps whose commits came after ``step``'s, oldest first (commit order, not number); agreed on by all ranks.

        ``[]`` when ``step`` is not committed.  Call it on every rank.  What
        a rollback to ``step`` abandons (``discard_step``).  Waits for
        pending saves first (raising their errors).
        """
        self.wait()

        def after() -> list[int]:
            order = self._order.steps(self.step_naming)
            return order[order.index(step) + 1 :] if step in order else []

        return self._coll.agreed(after, self.root, f"listing the steps committed after step {step}")

    def steps_off_lineage(self, step: int) -> list[int]:
        """The committed steps that are neither ``step`` nor one of its ancestors (the parent each commit records), oldest commit first; agreed on by all ranks.

        What a run that resumed ``step`` has abandoned, whichever process
        rolled back and however many restarts ago: a step committed on
        another trajectory (before a rollback to ``step`` or one of its
        ancestors).  Steps other tools wrote record no parent: only
        ``step`` itself, if it is one.  Call it on every rank.  Waits for
        pending saves first (raising their errors).
        """
        self.wait()

        def off() -> list[int]:
            records = self._order.committed(self.step_naming)
            by_step = {r.step: r for r in records}
            lineage, record = set(), by_step.get(step)
            while record is not None and record.step not in lineage:
                lineage.add(record.step)
                record = by_step.get(record.parent) if record.parent is not None else None
            return [r.step for r in records if r.step not in lineage]

        # Tensor collectives only: it runs at the first save after a resume, which runs no object collective.
        return self._coll.agreed_ints(off, self.root, f"listing the steps off step {step}'s lineage")

    def discard_step(self, step: int) -> None:
        """Delete committed step ``step``'s checkpoint (``.metadata`` first; your files in its folder stay).  Call it on every rank.

        For a rollback that saves a step it abandoned again under the same
        number (torchtitan saves every ``interval`` steps): steps are never
        overwritten.  Waits for pending saves first (raising their errors).
        """
        self.wait()
        prefix = self.step_prefix(step)
        self._coll.agreed(lambda: delete_committed_step(self.store, prefix), self.root, f"deleting step {step}")
        self._order.forget(prefix)

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
        step = self._resume.load(state_dict, step, allow_globals=allow_globals, allow_unsafe_pickle=allow_unsafe_pickle)
        self._commits.parent = step
        return step

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
            self._retention.close()  # deletions that outlasted their commit finish first
            self._writer.close()
            self.store.close()
            for pool in self._pools:
                pool.clear()

    def __enter__(self) -> "AsyncCheckpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
