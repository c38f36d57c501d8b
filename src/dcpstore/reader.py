"""``ObjectStoreReader``: a DCP ``StorageReader`` with concurrent ranged reads.

It reads only the objects' byte ranges the ``ReadItem``s need, coalesced
(see ``stored_items.coalesce``): items of one object that lie close together are fetched
with one ranged GET, so a shard of 3,000 small optimizer-state tensors costs
one request, not 3,000.  It keeps a bounded window of ranges in flight and
hands items to the planner on the calling thread, because DCP planners are
not required to be thread-safe.  Each fetched byte is copied once, from the
socket's chunks to where it belongs (``scatter``): a tensor's data straight
into its destination when that is a whole CPU tensor, else into the load's
host memory (``load_buffers``, pinned for CUDA destinations), from which
``tensor_archive`` reads it without another copy on its way to the
destination (asynchronously to a GPU).  Items recorded with a crc32 (see
``planner_data``) are checked before they are deserialized, and a buffered
item before it reaches its destination.

With ``read_once``, the items several ranks need are read once for the
job (``cooperative_load`` plans and runs the exchange; ``_SharedItems`` is
this reader's side of it: what each item travels as, where it lands), and
only the rest as above.

Nothing read from the bucket runs code here (see ``safe_pickle``): ``.metadata``
is unpickled with an allow-list (``metadata_reading``), every non-tensor item is validated with
torch's weights-only unpickler before any planner sees it, and every key the
metadata names must lie below the checkpoint prefix.  A checksum does not
authenticate anything: whoever can rewrite an item can rewrite its checksum.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import io
import logging
import math
import os
import uuid
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._extension import ExtensionRegistry
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StorageReaderTransforms
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from . import cooperative_load, planner_data, resume_index, resume_share
from .errors import CorruptCheckpointError, ObjectNotFoundError, StateDictMismatchError
from .incremental import content_digest
from .layout import METADATA_KEY
from .safe_pickle import check_bytes_item
from .metadata_reading import check_storage_data, parse_metadata, read_metadata_bytes
from .load_buffers import LoadBuffers, aligned
from .scatter import DestinationClaims, ItemLanding, RangeScatter, destination_bytes
from .stored_items import coalesce, land_tensor, parse_tensor, undo_transforms
from .storage import (
    ObjectStore, StoreOwner, TransferConfig, check_keywords, check_storage_options, is_store_url,
    warn_if_each_rank_resolves_it_alone,
)

logger = logging.getLogger(__name__)


class ObjectStoreReader(StorageReader, StoreOwner):
    """Read DCP checkpoints from ``url``; any DCP checkpoint, not only dcpstore's.

    Args:
        url: the checkpoint prefix.
        storage_options: passed to fsspec; kept across ``reset``.
        transfer: part size, concurrency, timeouts and retries.
        readahead_bytes: bytes of item data fetched ahead of the one being
            deserialized; bounds the reader's extra host memory.
        coalesce_gap_bytes: items of one object at most this far apart are
            fetched in one ranged GET (the gap is read and dropped).  The
            default, 1 MiB, costs about what one more request's latency
            does on S3 (~10 ms at ~100 MB/s a connection).
        verify_checksums: check each item's crc32 when the checkpoint has them.
            An item whose crc32 fails is fetched once more; if it fails
            again, ``CorruptCheckpointError`` names the item and says whether
            its destination tensor now holds the unverified bytes.
        verify_before_landing: land no tensor's bytes in its destination
            before their crc32 is checked, so a corrupt item leaves the
            destination as it was.  Off by default: each item then takes a
            buffer of its own and one more copy (a tensor loaded in place
            costs one copy beyond the socket read).
        allow_globals: classes and functions (or ``(object, "module.name")``
            pairs) to trust beyond the defaults, in ``.metadata`` (a custom
            ``planner_data`` type) and in non-tensor items.  Globals registered
            with ``torch.serialization.add_safe_globals`` are trusted too.
        _extension_registry: the stream extensions items may have been
            written with (torch's ``ExtensionRegistry``; ``ZStandard`` is in
            the default one), as ``FileSystemReader`` takes it.
        allow_unsafe_pickle: hand non-tensor items to the planner without
            validating them, as torch's readers do.  The default
            ``DefaultLoadPlanner`` then runs ``torch.load(weights_only=False)``
            on them: only for buckets where you trust everyone who can write.
            ``.metadata`` is always read with the allow-list.
        read_once: read each stored item that several ranks load from the
            bucket once, on one of them, and send it to the others
            (``cooperative_load``): under DDP or HSDP a job reads the
            checkpoint once, not once per replica.  ``True``: over the
            default process group; or a group with the members, in order,
            of the group ``dcp.load`` runs on: a gloo group (items travel
            as host memory) or an NCCL one (through the current CUDA
            device, straight into CUDA destinations).  Every rank of the
            load must pass it.  A rank checks the crc32 of what it reads
            before it sends it on; a failed read fails the load on every
            rank, naming the rank that read it.
        state_dict: the state dict this rank loads into, the one passed to
            ``dcp.load``.  With it, ``read_metadata`` reads only this rank's
            share of a dcpstore checkpoint from its resume index (one HEAD
            and two ranged GETs, a cost flat in the world size) when the
            checkpoint was saved by a job of this world size and the share
            holds exactly what the state dict loads; otherwise, and for
            torch's checkpoints, the whole ``.metadata``.  ``dcp.load``
            asks for the metadata before any planner sees the state dict,
            so without this argument every rank reads all of ``.metadata``.

    Like ``FsspecReader``, any other keyword is a storage option (merged into
    ``storage_options``), and the reader pickles (its store is reopened on
    first use after unpickling).
    """

    def __init__(
        self,
        url: str | os.PathLike,
        *,
        storage_options: dict[str, Any] | None = None,
        transfer: TransferConfig | None = None,
        readahead_bytes: int = 512 << 20,
        coalesce_gap_bytes: int = 1 << 20,
        verify_checksums: bool = True,
        verify_before_landing: bool = False,
        allow_globals: Iterable[Any] = (),
        allow_unsafe_pickle: bool = False,
        read_once: bool | dist.ProcessGroup = False,
        state_dict: dict[str, Any] | None = None,
        _extension_registry: ExtensionRegistry | None = None,
        **fsspec_options: Any,
    ):
        super().__init__()
        check_keywords(ObjectStoreReader, url, fsspec_options)
        check_storage_options(ObjectStoreReader, url, storage_options)
        warn_if_each_rank_resolves_it_alone(url)
        self.state_dict = state_dict
        self.transforms = _StorageReaderTransforms(_extension_registry)
        self.storage_options = {**(storage_options or {}), **fsspec_options}
        self.transfer = transfer or TransferConfig()
        self.readahead_bytes = readahead_bytes
        self.coalesce_gap_bytes = coalesce_gap_bytes
        self.verify_checksums = verify_checksums
        self.verify_before_landing = verify_before_landing
        self.allow_globals = list(allow_globals)
        self.allow_unsafe_pickle = allow_unsafe_pickle
        self.read_once = read_once
        #: When a dict (an ``AsyncCheckpointer(incremental=True)`` resuming): each stored tensor this reader
        #: parsed or landed, checked, gets its ``incremental.content_digest`` here, by storage index.
        self.stored_digests: dict[MetadataIndex, bytes] | None = None
        self._store: ObjectStore | None = None
        self.reset(url)

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the store, which ``store`` reopens (an S3 client cannot travel to another process)."""
        state = self.__dict__.copy()
        state["_store"] = None
        return state

    def close(self) -> None:
        """Release the store (its pools go with the last store on them).

        ``dcp.load`` never calls it; a reader nobody closes releases its
        store when it is garbage-collected.
        """
        self.release_store()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.move_store(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self.storage_data: dict = {}
        self._checksums: dict = {}
        self.metadata: Metadata | None = None
        #: Bytes this reader asked the store for since ``reset``: ranges as fetched (gaps and refetches included).
        self.bytes_read = 0
        self._wanted: list[MetadataIndex] = []  # read_once: the storage index of each stored item this rank names
        #: What stopped this rank's part of a cooperative load (``read_once``), kept for the caller: when a
        #: peer died, torch's closing gather fails on it and raises its own error, not this one.
        self.failure: BaseException | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, read once per ``reset``.

        Callers that inspect the metadata before ``dcp.load`` (as
        ``AsyncCheckpointer.load`` does) then cost no second GET of it.
        """
        if self.metadata is not None:
            return self.metadata
        if self.state_dict is not None:
            share = self._share_from_index()
            if share is not None:
                return self.use_metadata(share.metadata)
        return self.use_metadata_bytes(read_metadata_bytes(self.store))

    def _share_from_index(self) -> resume_share.Share | None:
        """This rank's share of the checkpoint from the resume index, or ``None`` (logged) to read ``.metadata``."""
        group = dist.is_available() and dist.is_initialized()
        rank, world_size = (dist.get_rank(), dist.get_world_size()) if group else (0, 1)
        try:
            pointer = resume_index.pointer_from_head(self.store)
            if pointer is None:
                raise resume_index.IndexUnusable("the checkpoint has no resume index", damaged=False)
            directory = resume_share.read_directory(self.store, pointer, world_size)
            state_dict = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in self.state_dict.items()}
            return resume_share.read_share(self.store, resume_share.rank_entry(directory, rank), state_dict, self.checkpoint_id)
        except resume_index.IndexUnusable as e:
            (logger.warning if e.damaged else logger.info)("%s: rank %d reads .metadata: %s", self.checkpoint_id, rank, e)
        except ObjectNotFoundError:
            pass  # no .metadata: reading it says so
        except Exception as e:  # noqa: BLE001 - the index is a cache: .metadata decides
            logger.warning("%s: rank %d could not read its resume index share (%r); reads .metadata", self.checkpoint_id, rank, e)
        return None

    def use_metadata_bytes(self, raw: bytes) -> Metadata:
        """Adopt ``raw``, this checkpoint's ``.metadata`` fetched by someone else, as if read here.

        ``AsyncCheckpointer.load`` GETs ``.metadata`` on one rank and
        broadcasts its bytes; every rank still unpickles them itself, with its
        own allow-list.
        """
        return self.use_metadata(parse_metadata(raw, self.store.url_for(METADATA_KEY), self.allow_globals))

    def use_metadata(self, metadata: Metadata) -> Metadata:
        """Adopt ``metadata`` for this checkpoint, parsed or built elsewhere (a rank's share of the resume index)."""
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self.metadata = metadata
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        where = self.store.url_for(METADATA_KEY)
        if metadata.storage_data is None:
            raise CorruptCheckpointError(f"{where}: metadata has no storage_data")
        check_storage_data(metadata.storage_data, where)
        self.storage_data = metadata.storage_data
        self._checksums = planner_data.read_checksums(metadata, where) if self.verify_checksums else {}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """With ``read_once``: the plan names the stored items it reads (``cooperative_load.Wanted``), for the coordinator."""
        if not self.read_once:
            return plan
        # An item is its bytes and its storage index: two indexes naming the same bytes (a hostile
        # .metadata) are two items, so that every rank that exchanges one reads it the same way.
        places: dict[tuple, MetadataIndex] = {}
        for req in plan.items:
            info = self.storage_data.get(req.storage_index)
            if info is not None:
                index = req.storage_index
                places.setdefault((info.relative_path, info.offset, info.length, index.fqn, tuple(index.offset or ())), index)
        self._wanted = list(places.values())
        return dataclasses.replace(plan, storage_data=cooperative_load.Wanted(tuple(places)))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """With ``read_once``: who reads each stored item that several ranks need, and who receives it (``cooperative_load.plan``)."""
        if not self.read_once:
            return plans
        return cooperative_load.plan(plans, round_bytes=max(self.readahead_bytes // 2, 1))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # Several ReadItems may need the same stored item (resharding): fetch it once.
        needed: dict[Any, list[ReadItem]] = collections.OrderedDict()
        for req in plan.items:
            if req.storage_index not in self.storage_data:
                raise StateDictMismatchError(
                    f"{self.url}: the checkpoint has no stored data for {req.storage_index.fqn!r} "
                    f"(offset {tuple(req.storage_index.offset or ())})"
                )
            needed.setdefault(req.storage_index, []).append(req)
        assignment = plan.storage_data
        if isinstance(assignment, cooperative_load.Assignment):
            shared = assignment.shared()
            self._read_shared(assignment, needed, planner)
            for place in shared:
                needed.pop(self._wanted[place], None)
        self._read_alone(needed, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_shared(self, assignment: cooperative_load.Assignment, needed: dict, planner: LoadPlanner) -> None:
        """The items this rank reads with its peers: each fetched by one owner, checked there, sent to the others."""
        group = self.read_once if isinstance(self.read_once, dist.ProcessGroup) else None
        buffers = LoadBuffers(self.readahead_bytes)
        items = _SharedItems(self, needed, planner, buffers, on_device=cooperative_load.travels_on_device(group))
        try:
            cooperative_load.Exchange(assignment, group, items.describe).run(buffers, items)
        except BaseException as e:
            self.failure = e
            raise
        finally:
            buffers.close()

    def _read_alone(self, needed: dict, planner: LoadPlanner) -> None:
        """The items this rank reads by itself: coalesced ranged reads, a window of them in flight."""
        if not needed:
            return
        ranges = coalesce(
            [(self.storage_data[index], reqs) for index, reqs in needed.items()],
            gap_bytes=self.coalesce_gap_bytes,
            max_bytes=max(self.readahead_bytes // 8, self.transfer.part_size),
        )

        pending: collections.deque = collections.deque()
        claims = DestinationClaims()
        # Room for the read-ahead window, and for two ranges at least so that one is read while one is copied out.
        tensor_bytes = sum(aligned(info.length) for r in ranges for info, reqs in r.items if reqs[0].type == LoadItemType.TENSOR)
        widest = max((r.end - r.start for r in ranges), default=0)
        buffers = LoadBuffers(min(tensor_bytes, max(self.readahead_bytes, 2 * widest)))
        in_flight = 0
        position = 0
        prepared = None  # the next range's items, destinations resolved, waiting for host memory
        try:
            while position < len(ranges) or pending:
                while position < len(ranges) and (not pending or in_flight < self.readahead_bytes):
                    r = ranges[position]
                    if prepared is None:
                        prepared = [self._prepare(info, reqs, planner, claims) for info, reqs in r.items]
                    region = buffers.reserve(
                        [info.length for info, _, _, buffered in prepared if buffered],
                        next((t[0].device for _, _, t, buffered in prepared if buffered and t[0].is_cuda), None),
                    )
                    if region is None:  # the ring is full of ranges not yet delivered
                        break
                    landings = iter(region.buffers)
                    items = [
                        (info, reqs, targets, ItemLanding(info.length, None, next(landings)) if buffered else self._landing(info, reqs, targets))
                        for info, reqs, targets, buffered in prepared
                    ]
                    prepared = None
                    sink = RangeScatter([(info.offset - r.start, landing) for info, _, _, landing in items])
                    pending.append((r, items, region, sink, self.store.get_range_async(r.key, r.start, r.end, sink)))
                    self.bytes_read += r.end - r.start
                    in_flight += r.end - r.start
                    position += 1
                r, items, region, _, fut = pending[0]
                fut.result()
                pending.popleft()
                in_flight -= r.end - r.start
                for info, reqs, targets, landing in items:
                    self._deliver(reqs, info, targets, landing, planner, functools.partial(buffers.copy, region))
                    claims.release(targets)
                region.delivered = True
        except BaseException:
            # Nothing may land in the caller's tensors once this has raised.
            for *_, sink, fut in pending:
                sink.abort()
                fut.cancel()
            concurrent.futures.wait([fut for *_, fut in pending])
            try:
                buffers.close()
            except Exception as e:  # noqa: BLE001 - a broken CUDA context, say: the first error is the one to raise
                logger.warning("%s: could not release the load's host memory: %r", self.url, e)
            raise
        buffers.close()

    def _prepare(self, info: _StorageInfo, reqs: list[ReadItem], planner: LoadPlanner, claims: DestinationClaims):
        """``(info, reqs, targets, buffered)`` for an item about to be fetched.

        A tensor item's destinations are resolved now, before the fetch, so
        that a whole stored tensor read by one ``ReadItem`` with no stream
        transforms can land in its destination as it arrives (a whole CPU
        tensor, ``scatter.destination_bytes``), unless another item in
        flight writes the same memory (``DestinationClaims``).  Any other
        tensor item is ``buffered``: it lands in the load's host memory
        (``load_buffers``), pinned for a CUDA destination, and is checked
        there before it is copied to its destinations.
        """
        if reqs[0].type != LoadItemType.TENSOR:
            return info, reqs, None, False
        targets = [planner.resolve_tensor(req).detach() for req in reqs]
        alone = claims.claim(targets)
        whole = len(reqs) == 1 and not info.transform_descriptors and not any(reqs[0].storage_offsets)
        in_place = alone and whole and not self.verify_before_landing and destination_bytes(targets[0]) is not None
        return info, reqs, targets, not in_place

    @staticmethod
    def _landing(info: _StorageInfo, reqs: list[ReadItem], targets) -> ItemLanding:
        """Where an item that is not buffered lands: a tensor's data in its destination, anything else in a buffer of its own."""
        return ItemLanding(info.length, targets[0] if targets else None)

    def _where(self, info: _StorageInfo, index: MetadataIndex) -> str:
        return f"{self.store.url_for(info.relative_path)} (item {index.fqn!r}, bytes {info.offset}+{info.length})"

    def _checked(self, index: MetadataIndex, info: _StorageInfo, landing: ItemLanding, destination: str = "") -> ItemLanding:
        """``landing``, or a second fetch's when its crc32 fails; ``CorruptCheckpointError`` when that fails too.

        ``destination``: the key of the tensor the item landed in, for the message.
        """
        expected = self._checksums.get(index)
        if expected is None or landing.crc32() == expected:
            return landing
        # Bytes damaged on the way are fetched once more; damaged in storage, they fail again.
        landing = ItemLanding(info.length, landing.target, landing.buffer if landing.target is None else None)
        end = info.offset + info.length
        self.bytes_read += info.length
        self.store.get_range_async(info.relative_path, info.offset, end, RangeScatter([(0, landing)])).result()
        if landing.crc32() != expected:
            fate = (
                f"the tensor {destination!r} now holds these unverified bytes"
                if landing.in_destination
                else "its destination keeps its old contents"
            )
            raise CorruptCheckpointError(f"{self._where(info, index)}: checksum mismatch on two fetches, the shard object is corrupted; {fate}")
        return landing

    def _deliver(
        self, reqs: list[ReadItem], info: _StorageInfo, targets, landing: ItemLanding, planner: LoadPlanner, copy, checked: bool = False
    ) -> None:
        """Check ``landing``'s bytes (unless ``checked`` already) and hand them to the planner; ``copy(target, source)`` moves a tensor to its destination."""
        where = self._where(info, reqs[0].storage_index)
        if not checked:
            landing = self._checked(reqs[0].storage_index, info, landing, reqs[0].dest_index.fqn)
        raw = landing.leftover()
        if raw is None:  # the data landed in the destination, as torch.load would read it
            self._note_stored(reqs[0].storage_index, landing.target)
            planner.commit_tensor(reqs[0], landing.target)
            return
        raw = undo_transforms(raw, info, self.transforms, where)
        if reqs[0].type == LoadItemType.BYTE_IO:
            if not self.allow_unsafe_pickle:
                check_bytes_item(raw, where, self.allow_globals)
            for req in reqs:
                planner.load_bytes(req, io.BytesIO(raw))
            return
        stored = parse_tensor(raw, where)
        self._note_stored(reqs[0].storage_index, stored)
        land_tensor(stored, reqs, targets, planner, copy, where)

    def _note_stored(self, index: MetadataIndex, stored: torch.Tensor) -> None:
        """``stored_digests``: ``stored`` is the whole stored tensor at ``index``, its bytes checked."""
        if self.stored_digests is not None:
            digest = content_digest(stored)
            if digest is not None:
                self.stored_digests[index] = digest

    @property
    def checkpoint_id(self) -> str:
        return self.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_store_url(checkpoint_id)


class _SharedItems:
    """The reader's side of a cooperative load (``cooperative_load.SharedItems``), over this rank's ``Wanted`` items.

    A tensor item stored without stream transforms travels as its values
    (dtype and shape from the metadata, which the owner checks the stored
    tensor against): a receiver whose destination is a whole, contiguous
    tensor of that dtype and shape takes the bytes straight into it, as a
    lone read lands in place (a CPU tensor; over NCCL, ``on_device``, a
    tensor on the current CUDA device); any other receiver takes them into
    the ring and copies out.  Any other item travels as its stored bytes,
    and the receiver undoes transforms and checks pickles as a lone read
    does.
    """

    def __init__(self, reader: ObjectStoreReader, needed: dict, planner: LoadPlanner, buffers: LoadBuffers, on_device: bool = False):
        self.reader, self.needed, self.planner, self.buffers = reader, needed, planner, buffers
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_device else None
        self.claims = DestinationClaims()
        self.targets: dict[int, list] = {}  # item -> each entry's resolved destinations
        self.in_place: dict[int, torch.Tensor] = {}  # received item -> the destination its values land in
        self.values: dict[int, torch.Tensor] = {}  # owned item sent as values -> the stored tensor
        self.views: dict[int, memoryview] = {}  # item -> its ring memory
        self.prepared: dict[int, tuple[int, torch.device | None]] = {}  # item -> its ring bytes, its destinations' device
        self._chunks: dict[str, dict] = {}

    def index(self, item: int) -> tuple[MetadataIndex, _StorageInfo]:
        """The stored item's storage index and ``_StorageInfo`` (what the ranks exchange, whatever this rank's plan reads of it)."""
        index = self.reader._wanted[item]
        return index, self.reader.storage_data[index]

    def entries(self, item: int) -> list[tuple[_StorageInfo, list[ReadItem]]]:
        """``[(its _StorageInfo, this rank's ReadItems of it)]``; empty if the final plan reads none of it (a planner that changed it)."""
        index, info = self.index(item)
        return [(info, self.needed[index])] if index in self.needed else []

    def describe(self, item: int) -> str:
        index, info = self.index(item)
        return self.reader._where(info, index)

    def shape(self, item: int) -> tuple[torch.dtype, tuple[int, ...]] | None:
        """The dtype and size of a tensor item sent as values; ``None`` for an item sent as its stored bytes.

        Decided from the metadata and storage_data alone, so that owner and
        receivers decide alike.  Values never take more bytes than the
        stored archive that holds them.
        """
        index, info = self.index(item)
        md = self.reader.metadata.state_dict_metadata.get(index.fqn) if self.reader.metadata is not None else None
        if not isinstance(md, TensorStorageMetadata) or info.transform_descriptors:
            return None
        if index.fqn not in self._chunks:
            self._chunks[index.fqn] = {tuple(c.offsets): tuple(c.sizes) for c in md.chunks}
        sizes = self._chunks[index.fqn].get(tuple(index.offset or ()))
        dtype = md.properties.dtype
        if sizes is None or dtype.is_complex or dtype in _QUANTIZED or not 0 < math.prod(sizes) * dtype.itemsize <= info.length:
            return None
        return dtype, sizes

    def prepare(self, items: list[int], owned: set[int]) -> tuple[list[int], torch.device | None]:
        for item in items:
            if item not in self.prepared:  # a round whose ring had no room yet is prepared again
                self.prepared[item] = self._prepare(item, item in owned)
        sizes = [self.prepared[item][0] for item in items]
        return sizes, next((self.prepared[item][1] for item in items if self.prepared[item][1] is not None), None)

    def _prepare(self, item: int, owned: bool) -> tuple[int, torch.device | None]:
        """The ring bytes ``item`` needs here, and the CUDA device of its destinations if any."""
        entries = self.entries(item)
        device = None
        if entries and entries[0][1][0].type == LoadItemType.TENSOR:
            self.targets[item] = [[self.planner.resolve_tensor(req).detach() for req in reqs] for _, reqs in entries]
            device = next((t.device for ts in self.targets[item] for t in ts if t.is_cuda), None)
        shape = self.shape(item)
        if owned or shape is None:
            return self.index(item)[1].length, device
        if self._lands_in_place(item, shape):
            return 0, device
        return math.prod(shape[1]) * shape[0].itemsize, device

    def _lands_in_place(self, item: int, shape: tuple[torch.dtype, tuple[int, ...]]) -> bool:
        """Whether a received item's values go straight into its destination (claimed), as a lone read lands in place.

        Not with ``verify_before_landing``: a transfer cut short by a lost
        peer would leave part of the destination overwritten.
        """
        entries = self.entries(item)
        if self.reader.verify_before_landing or len(entries) != 1 or len(entries[0][1]) != 1:
            return False
        req, target = entries[0][1][0], self.targets[item][0][0]
        dtype, sizes = shape
        whole = not any(req.storage_offsets) and tuple(req.lengths) == sizes
        fits = target.dtype == dtype and tuple(target.shape) == sizes and (
            destination_bytes(target) is not None if not target.is_cuda else self._device_takes(target)
        )
        if not (whole and fits and self.claims.claim([target])):
            if whole and fits:
                self.claims.release([target])
            return False
        self.in_place[item] = target
        return True

    def _device_takes(self, target: torch.Tensor) -> bool:
        """Whether NCCL can receive a tensor's values straight into CUDA ``target`` (dense, contiguous, on this rank's device)."""
        return (
            type(target) is torch.Tensor  # a subclass's reshape/view need not share its memory
            and target.device == self.device
            and target.layout == torch.strided
            and target.is_contiguous()
            and target.numel() > 0
            and not (target.is_conj() or target.is_neg() or target.is_quantized)
        )

    def fetch(self, owned: list[tuple[int, memoryview]]) -> "_OwnedFetch":
        self.views.update(owned)
        return _OwnedFetch(self, owned)

    def payload(self, item: int) -> torch.Tensor:
        stored = self.values.get(item)
        if stored is None:
            return cooperative_load._wire(self.views[item])
        return stored.reshape(-1).view(torch.uint8)

    def landing(self, item: int, view: memoryview | None) -> torch.Tensor:
        target = self.in_place.get(item)
        if target is not None:
            return target.reshape(-1).view(torch.uint8)
        self.views[item] = view
        return cooperative_load._wire(view)

    def deliver(self, item: int, region) -> None:
        copy = functools.partial(self.buffers.copy, region)
        target = self.in_place.pop(item, None)
        if target is not None:
            self.claims.release([target])
            self.reader._note_stored(self.index(item)[0], target)
            self.planner.commit_tensor(self.entries(item)[0][1][0], target)
            return
        targets = self.targets.pop(item, None)
        shape = self.shape(item)
        stored = self.values.pop(item, None)
        if shape is not None and stored is None:  # received as values
            stored = cooperative_load._wire(self.views[item]).view(shape[0]).view(shape[1])
        view = self.views.pop(item, None)
        if stored is not None:
            self.reader._note_stored(self.index(item)[0], stored)
        for n, (info, reqs) in enumerate(self.entries(item)):
            where = self.reader._where(info, reqs[0].storage_index)
            if stored is not None:
                land_tensor(stored, reqs, targets[n], self.planner, copy, where)
            else:
                landing = ItemLanding(info.length, None, view)
                self.reader._deliver(reqs, info, targets[n] if targets else None, landing, self.planner, copy, checked=True)


class _OwnedFetch:
    """The GETs of the items this rank reads for its peers in a round of a cooperative load, into the ring's buffers.

    ``wait`` returns once every item is there, its crc32 checked (one
    refetch, as any read) and, for an item sent as values, its tensor
    parsed and found of the dtype and shape the metadata says: receivers
    take those bytes as that tensor without a look of their own.
    """

    def __init__(self, items: _SharedItems, owned: list[tuple[int, memoryview]]):
        self.items = items
        reader = items.reader
        ranges = coalesce(
            [(items.index(item)[1], (item, view)) for item, view in owned],
            gap_bytes=reader.coalesce_gap_bytes,
            max_bytes=max(reader.readahead_bytes // 8, reader.transfer.part_size),
        )
        self.pending = []
        for r in ranges:
            landings = [(info, item, ItemLanding(info.length, None, view)) for info, (item, view) in r.items]
            sink = RangeScatter([(info.offset - r.start, landing) for info, _, landing in landings])
            self.pending.append((landings, sink, reader.store.get_range_async(r.key, r.start, r.end, sink)))
            reader.bytes_read += r.end - r.start

    def wait(self) -> None:
        reader = self.items.reader
        try:
            for _, _, fut in self.pending:
                fut.result()
        except BaseException:
            self.cancel()
            raise
        for landings, _, _ in self.pending:
            for info, item, landing in landings:
                index = self.items.index(item)[0]
                reader._checked(index, info, landing)
                shape = self.items.shape(item)
                if shape is None:
                    continue
                where = reader._where(info, index)
                stored = parse_tensor(landing.buffer, where)
                if stored.dtype != shape[0] or tuple(stored.shape) != shape[1]:
                    raise CorruptCheckpointError(
                        f"{where}: holds a {stored.dtype} tensor of shape {tuple(stored.shape)}, "
                        f"where the metadata says {shape[0]} of {shape[1]}"
                    )
                self.items.values[item] = stored.resolve_conj().resolve_neg().contiguous()

    def cancel(self) -> None:
        for _, sink, fut in self.pending:
            sink.abort()
            fut.cancel()
        concurrent.futures.wait([fut for *_, fut in self.pending])


_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
