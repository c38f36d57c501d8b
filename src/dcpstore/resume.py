"""The resume protocol: which step, its resume index, each rank's share, and the coordinator's state for the next commit.

Who calls it: ``AsyncCheckpointer.load``, on every rank, with no save in
flight.  What it may touch: the checkpointer's collectives, its store, the
plan cache and the writer (which learns the layout each rank wrote, and
the coordinator's commit template).  It reads; it never writes.

What it promises:

- **One HEAD finds the step's index** (``resume_index``): the coordinator
  finds the step (the newest commit, ``steps``), HEADs its ``.metadata``,
  GETs the index directory and the per-save segments once for the job, and
  scatters to each rank its own entry (a few KB, not W of them).  Every
  rank GETs and checks its own block and builds a ``Metadata`` of its own
  chunks: no rank parses ``.metadata`` on the way to resuming the same
  structure, and each reads about its own share.
- **The same answer on every rank.**  Whether the ranks use the index is
  agreed by one all-reduce; otherwise the coordinator GETs ``.metadata``
  once and broadcasts its bytes (gloo's binomial tree), and every rank
  parses them with its own allow-list.  A failure on any rank raises
  ``CheckpointLoadError`` on every rank, naming the step and the rank.
- **The next save plans nothing.**  The plan cache is primed from the
  share (or from ``.metadata``); the coordinator's global state, and where
  the index holds its map the resumed ``.metadata``'s bytes as its commit
  template, are read on a thread of their own while training goes on
  (``_global_state_later``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils._pytree import tree_leaves

from . import planner_data, resume_index, resume_share
from .collectives import Collectives, describe
from .errors import CheckpointLoadError, CheckpointNotFoundError, DcpstoreError, ObjectNotFoundError
from .layout import METADATA_KEY, StepNaming
from .metadata_reading import check_state_dict, no_metadata_error, parse_metadata, read_metadata_bytes
from .metadata_template import CommitTemplate, Unpatchable
from .plan_cache import PlanCache, UnparsedMetadata, describe_source
from .reader import ObjectStoreReader
from .steps import CommitOrder
from .storage import ObjectStore, TransferConfig
from .writer import ObjectStoreWriter

logger = logging.getLogger(__name__)


class Resume:
    """Loads steps of one ``AsyncCheckpointer``'s root (see the module docstring)."""

    def __init__(
        self,
        coll: Collectives,
        store: ObjectStore,
        order: CommitOrder,
        writer: ObjectStoreWriter,
        plan_cache: PlanCache,
        planner_factory: Callable[[], SavePlanner],
        *,
        root: str,
        naming: StepNaming,
        storage_options: dict[str, Any],
        transfer: TransferConfig,
        read_once: bool = True,
    ):
        self.coll, self.store, self.order, self.writer = coll, store, order, writer
        self.plan_cache, self.planner_factory = plan_cache, planner_factory
        self.root, self.naming, self.storage_options, self.transfer = root, naming, storage_options, transfer
        self.read_once = read_once

    def step_url(self, step: int) -> str:
        return self.naming.url(self.root, step)

    def load(self, state_dict: dict[str, Any], step: int | None, *, allow_globals: tuple, allow_unsafe_pickle: bool) -> int:
        """Load ``step`` (``None``: the latest committed) into ``state_dict`` in place, prime the plan cache; returns the step.

        A failure on any rank raises ``CheckpointLoadError`` on every rank
        (see ``AsyncCheckpointer.load``).
        """
        coordinator = self.coll.is_coordinator
        reader = metadata = raw = share = None
        incremental = False
        try:
            # The coordinator finds the step and the resume index (one HEAD
            # of .metadata), and sends each rank the step and its own
            # directory entry: a few hundred bytes, not W of them.
            shared: Any = self._find_for_load(step) if coordinator else None
            directory = None
            if coordinator and not isinstance(shared, BaseException):
                step, directory, raw = shared
                shared = [(step, self._rank_entry(directory, r)) for r in range(self.coll.world_size)]
            elif coordinator:
                shared = [shared] * self.coll.world_size
            shared = self.coll.scatter(shared)
            if isinstance(shared, BaseException):  # the coordinator's, the same on every rank
                raise self._load_error(shared, self.step_url(step) if step is not None else self.root, step)
            step, entry = shared
            url = self.step_url(step)
            error = None
            try:
                reader = self._reader(step, allow_globals, allow_unsafe_pickle)
                flat_sd = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}
            except Exception as e:  # noqa: BLE001 - agreed on below, before any collective a failed rank would miss
                error = e
            self._all_or_none_failed(error, url, step)
            if self.read_once and self.coll.enabled:
                reader.read_once = self._read_once_group(flat_sd)
            incremental = self.writer.incremental is not None and self.store.server_side_copy
            if incremental:
                reader.stored_digests = {}  # the next save copies what this load finds unchanged (see incremental)
            if entry is not None:
                share = self._read_share(reader, entry, flat_sd, url)
            from_share = entry is not None and self.coll.all_min([int(share is not None)])[0]
            if not from_share:
                # Every rank reads .metadata: the coordinator's one GET, broadcast.
                share = None
                if coordinator and raw is None:
                    raw = self._metadata_bytes(step)
                raw = self.coll.broadcast(raw)
                if isinstance(raw, BaseException):  # the coordinator's, the same on every rank
                    raise self._load_error(raw, url, step)
            try:
                metadata = reader.use_metadata(share.metadata) if from_share else reader.use_metadata_bytes(raw)
                check_state_dict(flat_sd, metadata, url)
            except Exception as e:  # noqa: BLE001 - one rank's mismatch must stop every rank here, not in dcp.load's collectives
                error = e
            self._all_or_none_failed(error, url, step)
            with warnings.catch_warnings():
                # dcp.load warns whenever no_dist is set; a single process is intended here.
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(state_dict, storage_reader=reader, process_group=self.coll.group, no_dist=not self.coll.enabled)
            read_etags = dict(reader.store.read_etags) if incremental else {}
        except CheckpointException as e:
            failures = {rank: wrapped[0] for rank, wrapped in e.failures.items()}
            raise CheckpointLoadError(self.step_url(step), step, failures) from failures[min(failures)]
        except Exception as e:
            if reader is None or reader.failure is None:
                raise
            # A peer died in the cooperative load: torch's closing gather broke on it, this rank's cause is the reader's.
            raise CheckpointLoadError(self.step_url(step), step, {self.coll.rank: reader.failure}) from e
        finally:
            if reader is not None:
                reader.close()
        if incremental:
            prefix = self.naming.prefix(step)
            self.writer.incremental.loaded(
                reader.stored_digests, metadata.storage_data, planner_data.read_checksums(metadata),
                lambda path: self.store.location(f"{prefix}/{path}"), read_etags,
            )
        if share is not None:
            if share.template_of is not None:
                self.writer.builder.remember_written_share(share.template_of, share.written)
            self.plan_cache.fill_from_share(
                share.local_plan, share.final_plan, rank=self.coll.rank, world_size=self.coll.world_size,
                planner=self.planner_factory(),
                global_state=self._global_state_later(step, allow_globals, raw, directory) if coordinator else None,
                source=describe_source(url, entry.get("torch_version")),
            )
            return step
        # The writer only assigns storage prefixes here; it sends no request.
        writer = ObjectStoreWriter(url, storage_options=self.storage_options, transfer=self.transfer)
        try:
            self.plan_cache.fill_from_metadata(
                metadata, rank=self.coll.rank, world_size=self.coll.world_size, planner=self.planner_factory(), writer=writer
            )
        finally:
            writer.close()
        return step

    def _load_error(self, error: BaseException, url: str, step: int | None) -> CheckpointLoadError:
        """The coordinator's ``error``, as every rank raises it: itself if it is a ``CheckpointLoadError`` (a missing checkpoint), else one whose cause it is."""
        if isinstance(error, CheckpointLoadError):
            return error
        wrapped = CheckpointLoadError(url, step, {0: error})
        wrapped.__cause__ = error
        return wrapped

    def _all_or_none_failed(self, error: BaseException | None, url: str, step: int) -> None:
        """Raise ``CheckpointLoadError`` on every rank if a check failed on any, naming the first failing rank and its cause.

        A check one rank runs alone (its state dict against the checkpoint)
        is agreed on before the next collective, which a failed rank would
        never join: the others would wait there for the group's timeout and
        then report gloo's error, not the cause.
        """
        failures = self.coll.failures(error)
        if failures:
            raise CheckpointLoadError(url, step, failures) from failures[min(failures)]

    def _read_once_group(self, state_dict: dict[str, Any]) -> dist.ProcessGroup:
        """The group a cooperative load's items travel over, the same on every rank (one all-reduce).

        The training group (the default one) where every rank's GPU
        destinations are on its current device, that group is NCCL, and its
        ranks are the checkpointer's in the same order (the checkpointer's
        default group is made from it); else the checkpointer's gloo group,
        as host memory.
        """
        leaves = [v for v in tree_leaves(state_dict) if isinstance(v, torch.Tensor)]
        on_gpu = bool(leaves) and all(not v.is_cuda or v.device.index == torch.cuda.current_device() for v in leaves)
        on_gpu = on_gpu and any(v.is_cuda for v in leaves)
        nccl = (
            on_gpu
            and "nccl" in dist.get_backend()
            and dist.get_world_size() == self.coll.world_size
            and dist.get_process_group_ranks(self.coll.group) == list(range(self.coll.world_size))
        )
        return dist.group.WORLD if self.coll.all_min([int(nccl)])[0] else self.coll.group

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
            return resume_share.rank_entry(directory, rank, directory["values_read"])
        except resume_index.IndexUnusable as e:
            logger.warning("rank %d falls back to .metadata: %s", rank, e)
            return None

    def _read_share(self, reader: ObjectStoreReader, entry: dict, flat_sd: dict, url: str) -> resume_share.Share | None:
        """This rank's share of the checkpoint from its index block (``entry``), or ``None`` (logged) to read ``.metadata``."""
        try:
            return resume_share.read_share(reader.store, entry, flat_sd, url)
        except resume_index.IndexUnusable as e:
            (logger.warning if e.damaged else logger.info)("%s: rank %d falls back to .metadata: %s", url, self.coll.rank, e)
        except Exception as e:  # noqa: BLE001 - every rank must reach the all_min that decides the fallback
            logger.warning("%s: rank %d could not use its resume index block (%s); falls back to .metadata", url, self.coll.rank, describe(e))
        return None

    def _metadata_bytes(self, step: int) -> bytes | BaseException:
        """On the coordinator: ``.metadata``'s bytes to broadcast, or the error every rank raises."""
        child = self.store.child(self.naming.prefix(step))
        try:
            return read_metadata_bytes(child)
        except Exception as e:  # noqa: BLE001 - the peers wait in the broadcast: they must hear of it
            return e if isinstance(e, DcpstoreError) else DcpstoreError(f"{self.step_url(step)}: reading .metadata failed: {describe(e)}")
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
            layout = resume_share.read_layout(reader.store, directory)
            body = raw if raw is not None else read_metadata_bytes(reader.store)
            template = CommitTemplate.from_stored(
                body, layout.template, unparsed, layout.counts, layout.checksums, layout, layout.template_of
            )
        except (resume_index.IndexUnusable, Unpatchable) as e:
            logger.info("%s: the next commit is built in full (%s)", reader.checkpoint_id, e)
            return None
        self.writer.builder.use_template(template)
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
                steps = self.order.steps(self.naming)
                if not steps:
                    raise CheckpointNotFoundError(f"{self.root}: no committed checkpoint to load")
                step = steps[-1]
            child = self.store.child(self.naming.prefix(step))
            try:
                return (step, *self._index_directory(child, step))
            finally:
                child.close()
        except DcpstoreError as e:
            return e
        except Exception as e:  # noqa: BLE001 - the peers must not wait for a scatter that never comes
            where = self.step_url(step) if step is not None else self.root
            error = DcpstoreError(f"{where}: finding the checkpoint to load failed: {describe(e)}")
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
            if self.coll.world_size == 1:
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
            directory = resume_share.read_directory(store, pointer, self.coll.world_size)
            return {**directory, "values_read": resume_share.read_values(store, directory)}, raw
        except resume_index.IndexUnusable as e:
            if self.coll.world_size > 1:
                (logger.warning if e.damaged else logger.info)(
                    "%s: not resuming from the resume index (%s); every rank reads .metadata", self.step_url(step), e
                )
            return None, raw if raw is not None else read_metadata_bytes(store)
