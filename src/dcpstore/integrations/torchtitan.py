"""torchtitan's checkpoints through dcpstore: one line of job config.

torchtitan (0.3) checkpoints ``s3://`` folders with DCP's stock
``FsspecWriter``/``FsspecReader`` and has no setting for another storage
writer.  This ``CheckpointManager`` is torchtitan's own, with its saves,
loads and retention going through an ``AsyncCheckpointer`` on the folder::

    from dcpstore.integrations.torchtitan import CheckpointManager

    checkpoint=CheckpointManager.Config(
        enable=True, folder="s3://bucket/run", interval=500, keep_latest_k=3, async_mode="async"
    )

What changes against torchtitan's manager:

- **Uploads and commits.**  Each rank uploads its shards (multipart,
  retried, bounded host memory); the step counts only once its
  ``.metadata`` is written, last and conditionally.  A crash, a throttled
  bucket or a zombie job never leaves a step that looks complete.
- **Plans.**  The save plans are persisted in the checkpoint and reused:
  after a resume, the first save runs no planning collective.
- **Which step resumes.**  The newest *committed* step, by commit order
  (``dcpstore.steps``), not the highest folder number with a
  ``.metadata``; ``load_step`` still picks one.  A committed step off the
  lineage of the step a run resumed (neither it nor an ancestor, by the
  parent each commit records) was abandoned by a rollback, in this process
  or before any number of restarts: a load deletes nothing, and a later
  save that reuses the number of such a step deletes that one step first
  (a warning names it), since steps are never overwritten; torchtitan's
  own writer would overwrite it object by object.  ``load_step=0`` (the
  seed checkpoint), ``load_only`` and a job that never saves delete nothing.
- **Retention.**  ``keep_latest_k`` keeps that many committed steps (the
  newest commit and its lineage first, then the newest), and deletes the
  debris of failed saves once nothing under its step changed for
  ``gc_grace`` seconds.  It runs on the coordinator's save thread after each
  commit, with batched deletes.  torchtitan's own purge keeps the k highest
  folders, committed or not, so a run of failed saves deleted every
  committed one; here a failed save never costs a committed step.
- **async_mode.**  All three go through the ``AsyncCheckpointer``:
  ``disabled`` returns once the step is committed; ``async`` and
  ``async_with_pinned_mem`` return once the rank's items are staged into
  reused host memory (pinned where CUDA is), and the upload and commit go
  on in the background.  ``async_with_pinned_mem`` also lets the
  device-to-host copies overlap forward and backward (``overlap_copy``):
  torchtitan's ``maybe_wait_for_staging()``, just before the optimizer
  step, makes the training stream wait for them on the GPU.  An error of a
  background save is raised where torchtitan waits for it (the next save,
  or ``close``).  torchtitan still builds its own stager for
  ``async_with_pinned_mem`` (which needs an accelerator), but nothing is
  staged through it.

Steps keep torchtitan's folder names (``{folder}/step-{N}``): stock
torchtitan resumes from a dcpstore run, and this manager from a stock run's
committed steps.  What stays torchtitan's: ``initial_load_path`` and the
Hugging Face formats (``initial_load_in_hf``, ``last_save_in_hf``), read and
written by torchtitan's own code.  That code, and the check that the folder
exists which precedes an initial load, go through fsspec with the AWS
environment, not ``storage_options``.
"""

from __future__ import annotations

import dataclasses
import posixpath
import time
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torchtitan.components.checkpointer import MODEL, AsyncMode
from torchtitan.components.checkpointer import CheckpointManager as TorchtitanCheckpointManager
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import GarbageCollection

from ..checkpointer import AsyncCheckpointer
from ..layout import StepNaming
from ..storage import TransferConfig
from ..writer import DEFAULT_OBJECTS_PER_RANK

__all__ = ["CheckpointManager"]


class CheckpointManager(TorchtitanCheckpointManager):
    """torchtitan's ``CheckpointManager``, saving and loading through ``dcpstore.AsyncCheckpointer``.

    Takes the same arguments as torchtitan's (it is built from
    ``Config.build``); see the module docstring for what differs.
    ``checkpointer`` is the ``AsyncCheckpointer`` (``last_stats``,
    ``committed_steps()``).
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(TorchtitanCheckpointManager.Config):
        storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)
        """Options of the store (``endpoint_url``, ``key``/``secret``, ...), as for fsspec's ``s3fs``."""

        transfer: TransferConfig | None = None
        """Part size, concurrency, retries, timeouts (``dcpstore.TransferConfig``); ``None``: the defaults."""

        objects_per_rank: int = DEFAULT_OBJECTS_PER_RANK
        """Shard objects each rank writes per step: the uploads it runs in parallel."""

        gc_grace: float = 3600.0
        """Seconds (positive) nothing under a failed save's step may change before retention deletes its debris (a save may still be running).

        With ``keep_latest_k=0`` nothing is deleted, debris included."""

    def __init__(self, config: Config, **components: Any) -> None:
        # torchtitan's own purge and async machinery stay off; the checkpointer does both.
        super().__init__(dataclasses.replace(config, keep_latest_k=0, async_mode="disabled"), **components)
        if not self.enable:
            return
        self.async_mode = AsyncMode(config.async_mode)
        self.keep_latest_k = config.keep_latest_k
        # The step this run resumed, while its saves may reuse the numbers of steps off its lineage:
        self._resumed: int | None = None
        self._abandoned: set[int] | None = None  # those steps (off the resumed step's lineage), read at the first save
        self.checkpointer = AsyncCheckpointer(
            self.folder,
            storage_options=config.storage_options,
            keep_last=config.keep_latest_k or None,
            gc_grace=config.gc_grace if config.keep_latest_k else None,
            transfer=config.transfer,
            objects_per_rank=config.objects_per_rank,
            step_naming=StepNaming.TORCHTITAN,
            overlap_copy=self.async_mode is AsyncMode.ASYNC_WITH_PINNED_MEM,
        )
        self._staging: Any = None  # the SaveHandle whose copies the optimizer step must wait for

    def _step_of(self, checkpoint_id: str) -> int | None:
        """The step ``checkpoint_id`` names in this manager's folder, or ``None`` for any other path."""
        parent, name = posixpath.split(str(checkpoint_id).rstrip("/"))
        if parent.rstrip("/") != str(self.folder).rstrip("/"):
            return None
        return StepNaming.TORCHTITAN.parse(name)

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future | AsyncSaveResponse | None:
        """Save a step of the folder through the checkpointer; anything else (Hugging Face) as torchtitan does.

        Returns what torchtitan's ``_save`` expects of ``async_mode``:
        ``None`` once committed, the upload's future, or an
        ``AsyncSaveResponse`` whose staging is already done (``save``
        returns once the rank's items are on the host).
        """
        step = self._step_of(checkpoint_id)
        if to_hf or step is None:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        self._make_room_after_a_rollback(step)
        handle = self.checkpointer.save(state_dict, step)
        result: Future | AsyncSaveResponse | None = None
        if async_mode is AsyncMode.DISABLED:
            self.checkpointer.wait()
        elif async_mode is AsyncMode.ASYNC:
            result = handle.future
        else:
            # torchtitan waits on staging through _maybe_wait_for_staging, on the GPU.
            staged: Future = Future()
            staged.set_result(None)
            self._staging = handle
            result = AsyncSaveResponse(staging_completion=staged, upload_completion=handle.future)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def _make_room_after_a_rollback(self, step: int) -> None:
        """Before saving ``step`` after a load: delete the committed step of that number if it lies off the resumed step's lineage.

        Off the lineage means neither the step loaded nor one of its
        ancestors (the parent each commit records): a step committed on a
        trajectory a rollback abandoned, in this process or in one that
        ran before a restart (storage records the lineage; no process
        has to remember the rollback).  A step numbered like it on the
        lineage is history the run continued from, and is never deleted.
        The set is read once, at the first save after the load (all ranks
        agree on it), and is done with once the run saves above it.
        """
        if self._resumed is None:
            return
        if self._abandoned is None:
            off = self.checkpointer.steps_off_lineage(self._resumed)  # on every rank
            self._abandoned = {s for s in off if s > self._resumed}
        if step in self._abandoned:
            logger.warning(
                f"Resumed step {self._resumed}: deleting the committed step {step}, which is off its lineage "
                f"(a rollback abandoned it), to save step {step} again."
            )
            self.checkpointer.discard_step(step)  # on every rank
        if step >= max(self._abandoned, default=-1):  # no later save reuses an abandoned number
            self._resumed = self._abandoned = None

    def _maybe_wait_for_staging(self) -> None:
        """Make the training streams wait for the last save's copies, on the GPU (torchtitan calls it before the optimizer step)."""
        if self._staging is not None:
            self._staging.wait_staged()
            self._staging = None
        self.staging_future = None

    def _wait_for_saving(self) -> None:
        """Wait for the background save; its failure is raised here once (``AsyncCheckpointer.wait``)."""
        self.save_future = None
        self.checkpointer.wait()

    def _purge_stale_checkpoints(self) -> None:
        """Nothing: retention runs after each commit, on the coordinator's save thread (``AsyncCheckpointer(keep_last=)``)."""

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Load ``step``, or the newest committed step by commit order; with none, torchtitan's own initial load."""
        if step == -1:
            latest = self.checkpointer.latest_step()  # agreed by every rank
            if latest is None:
                if self.initial_load_path or self.initial_load_in_hf:
                    return super()._load(step)
                logger.info("No checkpoint was provided, this is a fresh start.")
                return False
            step = latest
        if not self.load_only and step != 0:  # step 0 is the seed checkpoint: its run continues from no lineage
            self._resumed, self._abandoned = step, None
        checkpoint_id = self._create_checkpoint_id(step)
        logger.info(f"Loading the checkpoint from {checkpoint_id}.")
        begin = time.monotonic()
        self.dcp_load(
            self._states_to_load(model_only=step == 0), checkpoint_id=checkpoint_id, from_hf=False, from_quantized=False
        )
        GarbageCollection.collect("GC collection for checkpoint loading.")
        logger.info(f"Finished loading the checkpoint in {time.monotonic() - begin:.2f} seconds.")
        return True

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """Load a step of the folder through the checkpointer (which primes its plan cache); anything else as torchtitan does."""
        step = self._step_of(checkpoint_id)
        if from_hf or step is None:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        self.checkpointer.load(state_dict, step=step)
        # As torchtitan's: the model's states are flattened into state_dict.
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    def _close(self) -> None:
        """Wait for the last save to commit (raising its error), then release torchtitan's resources and the checkpointer's."""
        try:
            if hasattr(self, "checkpointer"):  # not when __init__ raised before making it (close() runs from __del__)
                self.checkpointer.close()
        finally:
            super()._close()
