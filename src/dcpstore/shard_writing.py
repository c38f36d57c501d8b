"""Writing one shard object: a rank's items back to back, as torch's ``FileSystemWriter`` lays them out, checksummed as they stream.

Who calls it: ``ObjectStoreWriter.write_data``, on its upload threads, one
shard object per call (``write_items``).  What it promises: the bytes are
torch's layout (tensors as ``torch.save`` archives through torch's stream
transforms, bytes items raw), so stock readers load them; each item's crc32
covers its stored bytes and travels in its ``ChecksummedWriteResult``; a
tensor's bytes go to the object writer without a copy (lent: the staged
memory does not change before the upload ends); CUDA work queued on the
caller's streams is ordered before the device-to-host copies
(``caller_streams``, ``on_streams``).  What it may touch: the object
writer it is given, nothing else of the store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib

import numpy
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StorageWriterTransforms
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from .incremental import IncrementalState, ObjectPlan, content_digest
from .staging import resolve_item
from .storage import ObjectWriter
from .tensor_archive import save_tensor


@dataclasses.dataclass(frozen=True)
class ChecksummedWriteResult(WriteResult):
    """A ``WriteResult`` that also carries the crc32 of the item's stored bytes.

    It only travels between ranks; ``.metadata`` stores plain torch types.
    """

    crc32: int = 0
    bytes_item: bool = False  # a bytes item: its offset and length may change from save to save (metadata_template)


class _ChecksummingStream:
    """Counts and checksums what ``torch.save`` writes, item by item, and lends a tensor's bytes.

    ``torch.save`` writes a tensor's storage in one ``write`` of a view of
    its memory.  That tensor (``lend``) is not changed before the upload
    ends: ``write_data`` returns only then, and ``AsyncCheckpointer``'s
    staged memory is reused only by a later save.  So its bytes are lent to
    the object writer (``ObjectWriter.write_lent``), which sends them from
    where they lie instead of copying them into a part buffer; the headers
    and records around them are copied.

    ``torch.save`` reports a failed ``write`` only as "unexpected pos", so
    the stream keeps the real error (a missing bucket, a refused upload) for
    ``write_items`` to raise instead.
    """

    def __init__(self, inner: ObjectWriter):
        self._inner = inner
        self.crc = 0
        self.error: BaseException | None = None
        self._lent: torch.Tensor | None = None

    def lend(self, tensor: torch.Tensor | None) -> None:
        """The CPU tensor whose storage ``torch.save`` is about to write (owning exactly its bytes), or ``None``."""
        self._lent = tensor

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)  # releases the GIL on large buffers
        try:
            if self._lent is not None and _is_storage_of(data, self._lent):
                return self._inner.write_lent(data, self._lent)
            return self._inner.write(data)
        except BaseException as e:
            self.error = e
            raise

    def tell(self) -> int:
        return self._inner.tell()

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        pass


def _is_storage_of(data, tensor: torch.Tensor) -> bool:
    """Whether ``data`` is a view of exactly ``tensor``'s memory (checked by length first: most writes are headers)."""
    view = memoryview(data)
    nbytes = tensor.numel() * tensor.element_size()
    return nbytes > 0 and view.nbytes == nbytes and numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data == tensor.data_ptr()


def _cpu_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What ``torch.save`` must see: a CPU tensor that owns exactly its bytes.

    ``torch.save`` writes a tensor's whole storage, so a view into a larger
    buffer is cloned, as torch's ``FileSystemWriter`` does.
    """
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size() or not tensor.is_contiguous():
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def caller_streams() -> dict[int, "torch.cuda.Stream"]:
    """The calling thread's current CUDA stream on each device that has a context.

    ``dcp.save`` calls ``write_data`` on the training thread, but the items
    are resolved and copied to host on upload threads, whose current stream
    is each device's default stream: the work that produced a tensor on the
    caller's stream (a non-default one, with kernels still queued) would not
    be ordered before the copy.  A device without a primary context holds
    none of the caller's tensors.
    """
    if not torch.cuda.is_initialized():
        return {}
    return {
        i: torch.cuda.current_stream(i)
        for i in range(torch.cuda.device_count())
        if torch._C._cuda_hasPrimaryContext(i)
    }


@contextlib.contextmanager
def on_streams(streams: dict[int, "torch.cuda.Stream"]):
    """Make ``streams`` (see ``caller_streams``) this thread's current ones, as they were on the caller's thread.

    Each under its own device: a stream context entered elsewhere restores
    the previous device's stream on exit, which sets that device and, on a
    fresh thread (device 0), would create a context on GPU 0.
    """
    with contextlib.ExitStack() as stack:
        for index, stream in streams.items():
            stack.enter_context(torch.cuda.device(index))
            stack.enter_context(torch.cuda.stream(stream))
        yield


def write_items(
    stream: ObjectWriter,
    relative_path: str,
    items: list[WriteItem],
    planner: SavePlanner,
    transforms: _StorageWriterTransforms,
    plan: ObjectPlan | None = None,
) -> list[ChecksummedWriteResult]:
    """Serialize ``items`` back to back into ``stream``, as torch's FileSystemWriter lays them out.

    Each item goes through ``transforms`` (torch's stream extensions, e.g.
    ``ZStandard``) and is recorded with their descriptors, as torch's
    writer records them; the crc32 covers the stored (transformed) bytes.
    With a ``plan`` (``plan_object``), the items are written in its order,
    and a run of items unchanged since the last committed save is copied by
    the server instead, where the stream can (``ObjectWriter.copy_range``).
    The results are in ``items``' order either way.
    """
    checked = _ChecksummingStream(stream)
    if plan is None:
        return [_write_item(checked, stream, relative_path, item, planner, transforms) for item in items]
    results: list[ChecksummedWriteResult | None] = [None] * len(items)  # in ``items``' order, whatever the order written
    for run in plan.runs:
        at = stream.tell()
        requests = stream.copy_range(run.first.source, run.first.offset, run.length, run.first.etag)
        if requests:
            plan.copied(run, requests)
            for i, stored in zip(run.items, run.stored):
                results[i] = ChecksummedWriteResult(
                    index=items[i].index,
                    size_in_bytes=stored.length,
                    storage_data=_StorageInfo(
                        relative_path, at + stored.offset - run.first.offset, stored.length,
                        transform_descriptors=stored.descriptors,
                    ),
                    crc32=stored.crc32,
                )
            continue
        for i in run.items:
            results[i] = _write_item(checked, stream, relative_path, items[i], planner, transforms)
    for i in plan.to_send:
        results[i] = _write_item(checked, stream, relative_path, items[i], planner, transforms)
    return results


def plan_object(items: list[WriteItem], planner: SavePlanner, incremental: IncrementalState) -> ObjectPlan:
    """Hash each tensor item of one shard object (on the upload thread: the staged copy) and find the runs it may copy."""
    digests = [None if item.type == WriteItemType.BYTE_IO else content_digest(resolve_item(planner, item)) for item in items]
    return incremental.plan([item.index for item in items], digests)


def _write_item(
    checked: _ChecksummingStream, stream: ObjectWriter, relative_path: str, item: WriteItem,
    planner: SavePlanner, transforms: _StorageWriterTransforms,
) -> ChecksummedWriteResult:
    """Serialize one item at the stream's end."""
    data = resolve_item(planner, item)
    offset = stream.tell()
    checked.crc = 0
    try:
        transform_to, descriptors = transforms.transform_save_stream(item, checked)
        if item.type == WriteItemType.BYTE_IO:
            transform_to.write(data.getbuffer())
        else:
            tensor = _cpu_tensor(data)
            checked.lend(tensor)
            save_tensor(tensor, transform_to)
            checked.lend(None)
        transform_to.close()
    except Exception:
        if checked.error is not None:
            raise checked.error from None
        raise
    length = stream.tell() - offset
    return ChecksummedWriteResult(
        index=item.index,
        size_in_bytes=length,
        storage_data=_StorageInfo(relative_path, offset, length, transform_descriptors=descriptors or None),
        crc32=checked.crc,
        bytes_item=item.type == WriteItemType.BYTE_IO,
    )
