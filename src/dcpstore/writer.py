"""``ObjectStoreWriter``: a DCP ``StorageWriter`` for any fsspec URL, S3 first.

Layout is torch's standard one, so stock ``FsspecReader`` loads it: each rank
writes shard objects holding its items back to back (tensors as
``torch.save`` archives, bytes items raw), ``storage_data`` maps every
``MetadataIndex`` to a ``_StorageInfo(relative_path, offset, length)``, and
the coordinator writes the pickled ``Metadata`` as ``.metadata``.

Shard names are new on every save: ``__{rank}_{generation}_{n}.distcp``,
where the generation is the first 16 hex digits of the save's random
``save_id`` (drawn by each rank's writer as every ``dcp.save`` begins,
whether or not torch calls ``reset``; for an ``AsyncCheckpointer``, the
save's nonce, the same on every rank, so the coordinator knows every shard's
name without being told, and every name has the same length on every save).
Every shard and resume index is written with ``If-None-Match: *``: a name
used twice fails that save loudly and overwrites nothing.  No save ever
writes over bytes that a committed ``.metadata`` references, whether the
writer is reused, the prefix is overwritten, or another job (a zombie, a
mistyped run name) saves to the same prefix at the same time.

Commit protocol: ``.metadata`` is written by ``finish()`` only, as one
conditional PUT, and DCP calls ``finish()`` only after every rank's
``write_data`` succeeded.  A prefix without ``.metadata`` is not a
checkpoint, so a crash at any moment leaves either the previous state or the
new, complete one.  A new checkpoint is committed with ``If-None-Match: *``:
of two jobs racing for one prefix exactly one commits, the other gets
``CheckpointExistsError`` and deletes the shards it wrote.  An overwrite is
committed with ``If-Match`` on the ETag of the ``.metadata`` read at planning
time, so it never replaces a commit it has not seen, and afterwards deletes
exactly the shards the replaced ``.metadata`` referenced: it never lists.
That storage side of the commit is ``commit.Destination``.

While a save runs, its coordinator holds a lease under the step (``lease``),
so that a collection does not take it for a failed save's debris.

Plans: every rank's local plan rides to the coordinator inside its
``SavePlan.storage_data``, and ``finish()`` persists them in the compact
form of ``planner_data.encode_plans`` (``persisted_plans``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import uuid
import weakref
import zlib
from typing import Any, Sequence

import numpy
import torch.distributed as dist
from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    SerializationFormat,
    _split_by_size_and_type,
    _StoragePrefix,
    _StorageWriterTransforms,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from . import resume_index
from .commit import Destination, Outcome, delete_quietly, settle
from .errors import DcpstoreError
from .incremental import IncrementalState
from .layout import generation
from .lease import DEFAULT_PERIOD as DEFAULT_LEASE_PERIOD, Lease
from .staging import StagedItems, StagingPool
from .metadata_builder import MetadataBuilder
from .persisted_plans import PersistedPlans, attach_local_plan
from .shard_writing import ChecksummedWriteResult, caller_streams, on_streams, plan_object, write_items
from .storage import (
    CopyInterrupted, ObjectStore, StoreOwner, ThrottleClock, TransferConfig, check_keywords, check_storage_options,
    is_store_url, warn_if_each_rank_resolves_it_alone,
)

logger = logging.getLogger(__name__)

DEFAULT_OBJECTS_PER_RANK = 4  # shard objects a rank writes at once

@dataclasses.dataclass
class _CommitPrefix(_StoragePrefix):
    """A rank's storage prefix, and the nonce its coordinator commits the save with (what ``reset`` looks for, see ``incremental``).

    Under plain ``dcp.save`` every rank's writer draws its own ``save_id``;
    only the coordinator's tags ``.metadata``.
    """

    nonce: str = ""
    save: int = 0  # the coordinator's count of saves begun: a rank takes the nonce only if it counts the same


class _StagedStateDict(dict):
    """What ``ObjectStoreWriter.stage`` returns: a plain dict that can carry a finalizer (its pool's way back)."""


class ObjectStoreWriter(StorageWriter, AsyncStager, StoreOwner):
    """Write DCP checkpoints to ``url`` (``s3://bucket/prefix``, ``file://...``, ``memory://...``).

    Args:
        url: the checkpoint prefix.  ``reset(checkpoint_id)`` may change it.
        storage_options: passed to fsspec (for S3: s3fs options such as
            ``endpoint_url``, ``key``, ``secret``, ``profile``).  Kept across
            ``reset``.  The endpoint also comes from ``AWS_ENDPOINT_URL``.
        overwrite: allow saving over a committed checkpoint.  The old shards
            are deleted only after the new ``.metadata`` is committed, so a
            failed overwrite loses nothing.
        objects_per_rank: shard objects per rank, uploaded concurrently
            (``DEFAULT_OBJECTS_PER_RANK``, 4, when neither it nor
            ``thread_count`` is given).
        key_spread: place shard objects under this many hashed sub-prefixes
            of the checkpoint (``3f/__0_....distcp``), spread evenly over the
            key space, so that S3 can split the partition a save throttles
            and the client paces each sub-prefix on its own (see
            ``storage.throttle``).  1 (the default): directly under it.
            ``storage_data`` records the relative paths, so torch's own
            readers load such checkpoints too.
        transfer: part size, concurrency, timeouts and retries.
        commit_window: seconds the ``.metadata`` PUT may keep trying
            (throttled, or failing) before the commit is settled by reading
            storage back (see ``commit``).
        checksums: record a crc32 per item, checked on load.
        incremental: do not send again the tensor items whose bytes did not
            change since this writer's last committed save: on S3 the bucket
            copies them into the new checkpoint (see ``incremental``).  With
            plain ``dcp.save``, a rank learns that a save committed only by
            one HEAD of its ``.metadata`` when the next save starts (an
            ``AsyncCheckpointer`` tells every rank instead).  Not carried to
            a checkpoint process (``async_checkpointer_type=PROCESS``).
        _extensions: torch's stream extensions applied to every item, as
            ``FileSystemWriter(_extensions=...)`` takes them (EXPERIMENTAL
            in torch, hence the underscore), e.g. ``[ZStandard()]``.

    ``FsspecWriter``'s arguments are accepted too, so code written for it
    runs unchanged (``FsspecWriter(path, thread_count=8, sync_files=False,
    key=..., secret=...)``):

    * ``thread_count``: files each rank writes at once, each from a thread
      of its own: here ``objects_per_rank`` (give one or the other);
    * ``single_file_per_rank``: no effect.  A rank's items always go into
      ``objects_per_rank`` objects; ``False`` (a file per item) would be
      2,000 objects a rank in a real job.
    * ``sync_files``: no effect.  A PUT is durable when it is answered;
      on ``file://`` shards and ``.metadata`` are always fsynced.
    * ``per_thread_copy_ahead``: no effect.  Staging copies a rank's items
      into a bounded pool of host buffers before the upload starts.
    * ``overwrite``: as above, but **False by default** (``FsspecWriter``:
      True), so that a rerun cannot replace a committed checkpoint by
      accident.
    * ``serialization_format``: only ``SerializationFormat.TORCH_SAVE``, the
      default; others raise ``ValueError``.
    * ``cache_staged_state_dict``: no need.  ``dcp.async_save`` stages
      through the writer (an ``AsyncStager``, as ``FileSystemWriter`` is)
      into host memory it allocates on the first save and reuses while the
      writer lives (pinned when CUDA is available), so keep one writer
      across saves.  Like torch's writers, a writer serves one save at a
      time: wait for a save's future before the next ``async_save`` with it.
    * any other keyword: a storage option, as ``FsspecWriter`` passes its
      ``**kwargs`` to fsspec (merged into ``storage_options``); one that the
      URL's filesystem does not take (a typo) raises ``TypeError`` listing
      the valid ones.
    """

    def __init__(
        self,
        url: str | os.PathLike,
        *,
        storage_options: dict[str, Any] | None = None,
        overwrite: bool = False,
        objects_per_rank: int | None = None,
        key_spread: int = 1,
        transfer: TransferConfig | None = None,
        checksums: bool = True,
        incremental: bool = False,
        commit_window: float = 60.0,
        _extensions: Sequence[StreamTransformExtension] | None = None,
        thread_count: int | None = None,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        per_thread_copy_ahead: int | None = None,
        serialization_format: SerializationFormat = SerializationFormat.TORCH_SAVE,
        **fsspec_options: Any,
    ):
        super().__init__()
        check_keywords(ObjectStoreWriter, url, fsspec_options)
        check_storage_options(ObjectStoreWriter, url, storage_options)
        warn_if_each_rank_resolves_it_alone(url)
        if thread_count is not None and objects_per_rank is not None:
            raise ValueError("give objects_per_rank or FsspecWriter's thread_count, not both")
        objects_per_rank = next((n for n in (thread_count, objects_per_rank) if n is not None), DEFAULT_OBJECTS_PER_RANK)
        if serialization_format != SerializationFormat.TORCH_SAVE:
            raise ValueError(f"dcpstore writes items with torch.save only, not {serialization_format}")
        if objects_per_rank < 1:
            raise ValueError("objects_per_rank must be >= 1")
        if not 1 <= key_spread <= 256:
            raise ValueError("key_spread must be between 1 and 256")
        self.transforms = _StorageWriterTransforms(_extensions)
        self.storage_options = {**(storage_options or {}), **fsspec_options}
        self.transfer = transfer or TransferConfig()
        self.overwrite = overwrite
        self.objects_per_rank = objects_per_rank
        self.key_spread = key_spread
        self.checksums = checksums
        self.commit_window = commit_window
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._store: ObjectStore | None = None
        self._saves = 0  # saves begun: the same count on every rank (see _CommitPrefix)
        self._free_staging: list[StagingPool] = []  # for dcp.async_save: pools no staged copy holds now
        # The coordinator's lease while a save runs: its release, also called if the writer is dropped
        # after a save that failed before its commit (torch tells a writer nothing of that).
        self._lease: weakref.finalize | None = None
        # Seconds between renewals of a save's lease: a quarter of the shortest grace any collection of
        # this root runs with (an AsyncCheckpointer sets it from its gc_grace; see lease).
        self.lease_period = DEFAULT_LEASE_PERIOD
        # Builds .metadata (in full, or patched from the last one) and the resume index; kept across saves.
        self.builder = MetadataBuilder(checksums)
        # What the next save may copy (see ``incremental``); an AsyncCheckpointer tells it each commit.
        self.incremental = IncrementalState() if incremental else None
        self.reset(url)

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the store and the thread pool, which ``store`` and ``write_data`` rebuild.

        ``dcp.async_save(..., async_checkpointer_type=PROCESS)`` sends the
        writer to its checkpoint process with every save; locks, thread
        pools and the S3 client cannot travel and are remade there.
        """
        state = self.__dict__.copy()
        state["_store"] = state["_executor"] = state["_lease"] = None
        # torch sends a copy for each save and calls reset() only with a checkpoint_id:
        # the copy's set_up_storage_writer begins a save of its own, under a fresh save_id.
        state["_begun"] = True
        state["builder"] = MetadataBuilder(self.checksums)  # no template travels: the first save there commits in full
        state["_free_staging"] = []  # host memory stays in this process
        state["incremental"] = None  # a checkpointer's, in this process
        return state

    # -- AsyncStager (dcp.async_save) ---------------------------------------------

    _synchronize_after_execute = False  # stage() returns once the copy is complete

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The copy of ``state_dict`` that ``dcp.async_save`` uploads, in reused host memory (see ``StagingPool.copy_state_dict``).

        A pool serves one staged copy at a time: it goes back to the free
        list when nothing holds that copy any more (the save that uploaded
        it returned), so a copy still held (by a failed save's traceback)
        is never overwritten: the next save gets another pool.
        """
        pool = self._free_staging.pop() if self._free_staging else StagingPool()
        staged = _StagedStateDict(pool.copy_state_dict(state_dict))
        weakref.finalize(staged, self._free_staging.append, pool)
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once the copy is complete."""

    # -- StorageWriter ----------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Begin a save, at ``checkpoint_id`` if given (else where the last one went).

        torch calls it only when ``dcp.save`` is given a ``checkpoint_id``;
        a writer reused without one begins its next save in
        ``set_up_storage_writer``, which every save calls, so no two saves
        share a ``save_id``, and so a shard name (see ``_begin_save``).
        """
        self._settle_last_save()
        if checkpoint_id is not None:
            self.move_store(checkpoint_id)
        self._begin_save()

    def _settle_last_save(self) -> None:
        """``incremental``: the last save's items are the next one's base only if its ``.metadata`` is there (a HEAD where it went).

        Committed under this writer's nonce (an AsyncCheckpointer's are the
        same on every rank) or the coordinator's.
        """
        if self.incremental is not None and self.incremental.unsettled and self._store is not None:
            if any(settle(self._store, nonce) is Outcome.COMMITTED for nonce in dict.fromkeys((self.save_id, self._commit_nonce))):
                self.incremental.committed()

    def _begin_save(self) -> None:
        """Draw this save's ``save_id`` (its shards' generation) and forget the last save's state."""
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self.is_coordinator = True
        self.plans = PersistedPlans()  # the ranks' local plans finish() persists
        self.destination = Destination()  # what this save's commit replaces (see commit.Destination)
        # What an AsyncCheckpointer's commit records (see steps.CommitRecord): user metadata and planner_data.
        self.commit_tags: dict[str, str] = {}
        self.commit_record: dict[str, Any] | None = None
        # When set (``time.monotonic()``): no .metadata PUT starts after it; the
        # bound an AsyncCheckpointer's peers settle by (see ``commit``).
        self.put_deadline: float | None = None
        self._index_key: str | None = None  # the resume index finish() wrote, deleted with the shards if not committed
        self._index_tags: dict[str, str] = {}  # what names that index on the commit (x-amz-meta)
        self._saves += 1
        self._commit_nonce = self.save_id  # the coordinator's, from the plan (see _CommitPrefix)
        self._begun = False  # set_up_storage_writer has not started this save yet
        self.release_lease()  # the last save's, if it ended before its commit
        if self.incremental is not None:
            self.incremental.begin()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._begun:  # no reset() since the last save: this is a new one all the same
            self._settle_last_save()
            self._begin_save()
        self._begun = True
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank") or 0
        if not kwargs.get("use_collectives", True):
            raise ValueError(
                f"{self.url}: dcp.save(use_collectives=False) writes no global .metadata, "
                "and dcpstore commits a checkpoint by that object; save with collectives"
            )
        if is_coordinator:  # held until the commit, a failure, the next save, close(), or the writer's end (see lease)
            self._lease = weakref.finalize(self, Lease(self.store, self.save_id, self.lease_period).release)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.check_destination()
        return attach_local_plan(plan)

    def check_destination(self) -> bool:
        """Refuse to save over a committed checkpoint unless ``overwrite``; True if one is there."""
        return self.destination.check(self.store, self.overwrite)

    def destination_committed(self) -> bool:
        """Whether a checkpoint is committed where this save goes (see ``commit.Destination.committed``)."""
        return self.destination.committed(self.store)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.plans.from_global_step(plans)
        if self.overwrite:
            self.destination.read_replaced(self.store)
        return [
            dataclasses.replace(plan, storage_data=_CommitPrefix(f"__{rank}_", self.save_id, self._saves))
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self.is_coordinator:
            self.plans.from_planner_if_missing(planner)
        # A cached final plan (torch's plan caching) may carry any earlier
        # prefix; only the rank part of it is used.
        prefix = plan.storage_data.prefix if isinstance(plan.storage_data, _StoragePrefix) else f"__{self.rank}_"
        if isinstance(plan.storage_data, _CommitPrefix) and plan.storage_data.save == self._saves:
            # This save's: a plan torch cached carries the nonce of the save that made it.
            self._commit_nonce = plan.storage_data.nonce
        shard_generation = generation(self.save_id)
        # Bytes items last in each shard: one whose pickled size changes moves no tensor's offset.
        buckets = [
            sorted(b, key=lambda item: item.type == WriteItemType.BYTE_IO)
            for b in _split_by_size_and_type(self.objects_per_rank, list(plan.items)) if b
        ]
        names = [self._shard_name(prefix, n, shard_generation) for n in range(len(buckets))]
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world_size > 1:  # alone, a writer cannot know who else writes the range: it slow-starts (see storage.throttle)
            self.store.share_write_rate(world_size * len({name.rpartition("/")[0] for name in names}))
        # One budget for the save's throttling, shards and .metadata alike (see RetryPolicy).
        self.store.save_throttle = ThrottleClock(self.transfer.retry.throttle_budget)

        # Staged items are host memory already; on the checkpointer's thread there is no caller's stream to follow.
        cuda_streams = {} if isinstance(planner, StagedItems) else caller_streams()

        def upload(name: str, items: list[WriteItem]) -> list[ChecksummedWriteResult]:
            with on_streams(cuda_streams):
                copies = self.incremental is not None and self.store.server_side_copy
                plan = plan_object(items, planner, self.incremental) if copies else None
                try:
                    with self.store.open_writer(name, create_only=True) as stream:
                        results = write_items(stream, name, items, planner, self.transforms, plan)
                except CopyInterrupted as e:  # aborted with its upload: written again, every byte sent
                    logger.warning("%s; writing the object again without copies", e)
                    with self.store.open_writer(name, create_only=True) as stream:
                        results = write_items(stream, name, items, planner, self.transforms)
            if plan is not None:
                self.incremental.wrote(self.store.location(name), self._etag_of(name, stream), results, plan)
            return results

        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.objects_per_rank, thread_name_prefix="dcpstore-shard"
            )
        futures = [self._executor.submit(upload, n, b) for n, b in zip(names, buckets)]
        results: list[WriteResult] = []
        errors = []
        for name, fut in zip(names, futures):
            try:
                results.extend(fut.result())
            except Exception as e:  # noqa: BLE001 - collected, first one raised
                errors.append((name, e))
        if errors:
            self.release_lease()  # this save will not commit: its step is debris once it ends
            name, first = errors[0]
            if isinstance(first, (OSError, DcpstoreError)):  # ours name the object or the key already
                raise first
            raise RuntimeError(f"{self.store.url_for(name)}: could not serialize: {first!r}") from first
        out: Future[list[WriteResult]] = Future()
        out.set_result(results)
        return out

    def _etag_of(self, name: str, stream) -> str | None:
        """The ETag of the shard ``stream`` wrote (``incremental``); ``None`` if it cannot be known, and its items are not copied from.

        Ceph RGW 16.2 completes an upload with an empty ETag: then one HEAD,
        whose failure costs the next save its copies from this object, not
        this save.
        """
        if stream.etag is not None:
            return stream.etag
        try:
            return self.store.head(name).etag
        except Exception as e:  # noqa: BLE001 - bookkeeping for the next save only
            logger.info("%s: its ETag could not be read (%s); the next save sends its items", self.store.url_for(name), e)
            return None

    def _shard_name(self, prefix: str, n: int, generation: str) -> str:
        """Shard ``n`` of the rank whose names start with ``prefix``, under its hashed sub-prefix when ``key_spread`` > 1.

        The ``key_spread`` two-hex-digit sub-prefixes spread evenly over
        00-ff; the hash leaves out the generation, so from one save to the
        next a shard's name differs by the generation alone.
        """
        name = f"{prefix}{generation}_{n}{DEFAULT_SUFFIX}"
        if self.key_spread == 1:
            return name
        slot = zlib.crc32(f"{prefix}{n}".encode()) % self.key_spread
        return f"{slot * 256 // self.key_spread:02x}/{name}"

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Build ``.metadata`` in full (and the resume index beside it, see ``metadata_builder``) and commit it."""
        self._index_key, self._index_tags = None, {}
        raw, paths = self.builder.full(
            metadata, results, self.plans.extras(metadata, results, self.url),
            url=self.url, save_id=self.save_id, commit_record=self.commit_record,
            storage_meta=self.storage_meta(), patches=self._patches_commits, put_index=self._put_resume_index,
        )
        self.commit(raw, paths)

    def commit_patched(self, values: numpy.ndarray) -> bool:
        """On the coordinator: commit this save as the template patched with every rank's ``values``; ``False`` to take the full path.

        ``values``: a row per rank (see ``MetadataBuilder.patched``).  Raises as ``commit``.
        """
        self._index_key, self._index_tags = None, {}
        built = self.builder.patched(
            values, url=self.url, save_id=self.save_id, commit_record=self.commit_record, put_index=self._put_resume_index
        )
        if built is None:
            if self._index_key is not None:  # written for a commit that is not made: nothing will name it
                delete_quietly(self.store, {self._index_key}, "resume index")
            self._index_key, self._index_tags = None, {}
            return False
        self.commit(*built)
        return True

    @property
    def _patches_commits(self) -> bool:
        """Whether commits may patch the last one: an ``AsyncCheckpointer``'s (it sets the commit record), never an overwrite."""
        return self.commit_record is not None and not self.overwrite

    def _put_resume_index(self, parts: list[bytes], pointer: dict) -> bool:
        """PUT the resume index before ``.metadata``; whether it is there.

        The index is a cache: a save whose index PUT fails still commits
        (without it), and its restarts read ``.metadata``.
        """
        try:
            self.store.put(pointer["key"], b"".join(parts), if_none_match=True)
        except Exception as e:  # noqa: BLE001 - an optional cache: the commit goes on without it
            logger.warning("%s: could not write the resume index (%s); restarts will read .metadata", self.url, e)
            delete_quietly(self.store, {pointer["key"]}, "resume index")
            return False
        self._index_key, self._index_tags = pointer["key"], resume_index.tags(pointer)
        return True

    def commit(self, raw_metadata: bytes | bytearray, paths: set[str]) -> None:
        """Write ``.metadata`` naming ``paths`` and this save's resume index (see ``commit.Destination.commit``); the save's lease ends with it."""
        try:
            self.destination.commit(
                self.store, raw_metadata, paths | ({self._index_key} if self._index_key else set()),
                nonce=self.save_id, overwrite=self.overwrite, tags={**self.commit_tags, **self._index_tags}, window=self.commit_window,
                put_deadline=self.put_deadline, rank=self.rank,
            )
        finally:
            self.release_lease()

    def release_lease(self) -> None:
        """End this save's lease (see ``lease``): after its commit, when it failed, or as the next save begins."""
        if self._lease is not None:
            self._lease()  # a finalizer: runs once, and no longer at the writer's end
            self._lease = None

    def delete_shards(self, results: list[WriteResult]) -> None:
        """Delete the shard objects of a save that was not committed (best effort)."""
        own = {r.storage_data.relative_path for r in results} | ({self._index_key} if self._index_key else set())
        delete_quietly(self.store, own, "shards of an uncommitted save")

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.url, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_store_url(checkpoint_id)

    def close(self) -> None:
        """Stop the upload threads, finish failed aborts, and release the store (its pools go with the last store on them)."""
        self.release_lease()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._store is not None:
            self._store.settle_aborts()
        self.release_store()
        while self._free_staging:  # a pool still held by a staged copy goes when that copy does
            self._free_staging.pop().clear()
