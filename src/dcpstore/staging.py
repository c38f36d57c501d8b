"""Staging: the one part of an async save that blocks training.

``StagingPool`` copies the items a rank is about to save into host memory
that is allocated on the first save and reused by every later save, so
steady-state staging is a copy and no allocation.

Host memory is one slab per pool, carved into one view per tensor item (at
64-byte offsets), sized to the items exactly: what is pinned is what is
reported (``nbytes``), not the power of two torch's caching host allocator
would round each buffer up to, and ``clear()`` gives it back.  The slab is
pinned by registering exactly its pages with CUDA (under the first CUDA
item's device) when the pool pins; a save whose items need more than the
slab holds replaces it, one that needs less reuses it, so memory stays flat
while shapes change.

GPU tensors are copied on a side stream per device with
``non_blocking=True``, all CUDA work under the tensor's own device (a rank
that never called ``set_device`` must not create a context on GPU 0).
``stage`` returns once the copies are queued.  Then, by default, each
device's current (training) stream waits on that device's copy event, so
kernels that update parameters after ``save`` returns cannot overwrite them
before they are copied, and the host never blocks on the GPU.  With
``training_waits=False`` that wait is left to the caller
(``StagedItems.make_streams_wait``, just before the optimizer step): the
copy then overlaps forward and backward.  Each wait is timed with CUDA
events on the training stream (``stall_s``).  CPU tensors are copied too,
because the trainer mutates them after ``save`` returns.  Bytes items
(non-tensor values) are serialized during staging, which also freezes their
value.
"""

from __future__ import annotations

import copy
import io
import time
import weakref
from collections.abc import Hashable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType

from .errors import UnpicklableValueError

ALIGNMENT = 64  # bytes between the slab's views: any dtype's alignment, and a cache line


def resolve_item(planner: SavePlanner, item: WriteItem) -> Any:
    """``planner.resolve_data(item)``, naming the state-dict key when a non-tensor value cannot be pickled.

    The planner pickles non-tensor values here; pickle's own error (a lambda,
    a lock, a local class) says what failed but not where in the state dict.
    """
    try:
        return planner.resolve_data(item)
    except Exception as e:
        if item.type != WriteItemType.BYTE_IO:
            raise
        raise UnpicklableValueError(
            f"state dict key {item.index.fqn!r}: its value cannot be saved ({type(e).__name__}: {e})"
        ) from e


class StagedItems:
    """Staged data of one save; quacks like a planner for ``ObjectStoreWriter.write_data``."""

    def __init__(self, data: dict[MetadataIndex, Any], copies: "dict[torch.device, torch.cuda.Event]"):
        self._data = data
        self._copies = copies  # per device: the event the last queued copy records
        self._stalls: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._streams_wait = False

    def make_streams_wait(self) -> None:
        """Make each device's current stream wait for the copies, on the GPU (the host does not block); once.

        Called by ``stage`` by default, or by the training loop just before
        the first kernel that modifies a saved tensor.
        """
        if self._streams_wait:
            return
        self._streams_wait = True
        for device, copied in self._copies.items():
            with torch.cuda.device(device):
                stream = torch.cuda.current_stream(device)
                before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                before.record(stream)
                stream.wait_event(copied)
                after.record(stream)
                self._stalls.append((before, after))

    def wait_ready(self) -> None:
        """Block until the device-to-host copies have landed (off the training thread; the host sleeps)."""
        for copied in self._copies.values():
            copied.synchronize()

    def stall_s(self, patience: float = 1.0) -> float:
        """How long a training stream waited for the copies, as its CUDA events saw it (the longest device's).

        Off the training thread, once the copies landed.  A training stream
        that has not passed its wait within ``patience`` seconds (queued
        work ahead of it) is not waited for: this thread must never depend
        on how far the training loop got.
        """
        longest, deadline = 0.0, time.monotonic() + patience
        for before, after in list(self._stalls):
            while not after.query() and time.monotonic() < deadline:
                time.sleep(0.001)
            if after.query():
                longest = max(longest, before.elapsed_time(after) / 1000)
        return longest

    def resolve_data(self, item: WriteItem) -> Any:
        return self._data[item.index]

    def missing(self, items: list[WriteItem]) -> list[WriteItem]:
        """The ``items`` that were not staged."""
        return [item for item in items if item.index not in self._data]

    def __len__(self) -> int:
        return len(self._data)

    @property
    def nbytes(self) -> int:
        return sum(
            v.numel() * v.element_size() if isinstance(v, torch.Tensor) else len(v.getbuffer())
            for v in self._data.values()
        )


class HostSlab:
    """``nbytes`` of host memory in one allocation; ``pin`` registers exactly its pages with CUDA."""

    def __init__(self, nbytes: int):
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self._unpin: weakref.finalize | None = None

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    @property
    def pinned(self) -> bool:
        return self._unpin is not None

    def pin(self, device: torch.device) -> None:
        """Pin it, once, under ``device``'s context: pinning under the current device would create a context on GPU 0."""
        if self._unpin is not None or self.nbytes == 0:
            return
        with torch.cuda.device(device):
            _pin_memory_utils().pin_memory(self.tensor.data_ptr(), self.nbytes)
        # Unregistered before the memory goes back, also when nobody called release().
        self._unpin = weakref.finalize(self, _unpin, self.tensor.data_ptr(), device)

    def view(self, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor over ``offset`` whose storage is exactly its bytes, not the slab: ``torch.save`` writes only those."""
        nbytes = _nbytes(shape, dtype)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.bytes(offset, nbytes), dtype=torch.uint8).view(dtype).view(shape)

    def bytes(self, offset: int, nbytes: int) -> memoryview:
        """``nbytes`` at ``offset``, writable, for code that fills memory from Python (a socket's chunks)."""
        return memoryview(self.tensor[offset : offset + nbytes].numpy())

    def release(self) -> None:
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        self.tensor = torch.empty(0, dtype=torch.uint8)


def _pin_memory_utils():
    from torch.cuda import _pin_memory_utils  # torch's cudaHostRegister/Unregister, as DefaultStager uses them

    return _pin_memory_utils


def _unpin(data_ptr: int, device: torch.device) -> None:
    with torch.cuda.device(device):
        _pin_memory_utils().unpin_memory(data_ptr)


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return shape.numel() * dtype.itemsize


_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}


def _carvable(dtype: torch.dtype) -> bool:
    """Whether a view of raw bytes can take ``dtype`` (quantized dtypes cannot)."""
    return dtype not in _QUANTIZED


class StagingPool:
    """Reused host memory for the tensor items of a save.

    Args:
        pin_memory: pin the memory for fast, asynchronous device-to-host
            copies.  Defaults to whether CUDA is available.
    """

    def __init__(self, pin_memory: bool | None = None):
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._slab: HostSlab | None = None
        self._layout: dict[MetadataIndex, tuple[int, torch.Size, torch.dtype]] = {}
        self._views: dict[MetadataIndex, torch.Tensor] = {}  # of the slab, by the layout: made once, reused
        # Items the slab cannot hold (a quantized dtype, a planner's other shape): a buffer each, and whether pinned.
        self._own: dict[MetadataIndex, tuple[torch.Tensor, bool]] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the pool holds, as allocated."""
        slab = self._slab.nbytes if self._slab is not None else 0
        return slab + sum(b.numel() * b.element_size() for b, _ in self._own.values())

    @property
    def pinned_bytes(self) -> int:
        """Of ``nbytes``, those pinned (the slab's exactly; a buffer of its own as torch allocated it)."""
        slab = self._slab.nbytes if self._slab is not None and self._slab.pinned else 0
        return slab + sum(b.numel() * b.element_size() for b, pinned in self._own.values() if pinned)

    def stage(self, items: list[WriteItem], planner: SavePlanner, *, training_waits: bool = True) -> StagedItems:
        """Copy ``items`` to host; see the module docstring for ``training_waits``."""
        self._lay_out({
            item.index: (torch.Size(item.tensor_data.chunk.sizes), item.tensor_data.properties.dtype)
            for item in items
            if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None
        })
        staged: dict[MetadataIndex, Any] = {}
        copies: dict[torch.device, torch.cuda.Event] = {}
        for item in items:
            data = resolve_item(planner, item)
            if item.type == WriteItemType.BYTE_IO:
                staged[item.index] = io.BytesIO(data.getvalue())
            else:
                staged[item.index] = self._copy(item.index, data.detach(), copies)
        result = StagedItems(staged, copies)
        if training_waits:
            result.make_streams_wait()
        return result

    def copy_state_dict(self, state_dict: dict) -> dict:
        """A copy of ``state_dict`` for ``dcp.async_save`` (``ObjectStoreWriter.stage``), its tensors in this pool.

        The same structure: a tensor becomes a host tensor in the slab, a
        ``DTensor`` keeps its mesh and placements around a host copy of its
        local shard, and any other value is deep-copied, so that nothing the
        trainer does after this returns reaches the checkpoint.  CUDA
        copies have landed when it returns (``dcp.async_save``'s upload
        thread reads the copy at once), as with torch's blocking stager.
        """
        from torch.distributed.tensor import DTensor

        def local(value):
            return value._local_tensor if isinstance(value, DTensor) else value

        def tensors(obj, path=()):  # (path, tensor) for every tensor leaf, in order
            if isinstance(obj, dict):
                for k, v in obj.items():
                    yield from tensors(v, (*path, k))
            elif type(obj) in (list, tuple):
                for i, v in enumerate(obj):
                    yield from tensors(v, (*path, i))
            elif type(obj) is torch.Tensor or isinstance(obj, DTensor):
                yield path, local(obj).detach()

        sources = dict(tensors(state_dict))
        self._lay_out({path: (t.shape, t.dtype) for path, t in sources.items()})
        copies: dict[torch.device, torch.cuda.Event] = {}

        def rebuild(obj, path=()):
            if path in sources:
                buf = self._copy(path, sources[path], copies)
                if isinstance(obj, DTensor):
                    return DTensor.from_local(
                        buf, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape, stride=obj.stride()
                    )
                return buf
            if isinstance(obj, dict):  # an OrderedDict too: DCP reads any mapping by its keys
                return {k: rebuild(v, (*path, k)) for k, v in obj.items()}
            if type(obj) in (list, tuple):
                return type(obj)(rebuild(v, (*path, i)) for i, v in enumerate(obj))
            return copy.deepcopy(obj)

        out = rebuild(state_dict)
        for copied in copies.values():
            copied.synchronize()
        return out

    def _copy(self, key: Hashable, src: torch.Tensor, copies: "dict[torch.device, torch.cuda.Event]") -> torch.Tensor:
        """``src`` copied into its host buffer; a CUDA tensor on the device's side stream (``copies``: its event)."""
        buf = self._buffer(key, src)
        if not src.is_cuda:
            buf.copy_(src)
            return buf
        with torch.cuda.device(src.device):
            stream = self._side_stream(src.device)
            # Per item: resolve_data may have just launched the kernels
            # that produce src (a DTensor's local shard, a contiguous
            # copy) on the current stream.
            stream.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(stream):
                buf.copy_(src, non_blocking=True)
            # src may be a temporary: keep its memory from being reused
            # by the current stream before the side stream has read it.
            src.record_stream(stream)
            copies[src.device] = stream.record_event(torch.cuda.Event(blocking=True))
        return buf

    def _lay_out(self, tensors: dict[Hashable, tuple[torch.Size, torch.dtype]]) -> None:
        """Offsets in the slab for the tensors (by key: shape, dtype); a new slab only if they need more than it holds."""
        layout, end = {}, 0
        for key, (shape, dtype) in tensors.items():
            if not _carvable(dtype):
                continue
            layout[key] = (end, shape, dtype)
            end += -(-_nbytes(shape, dtype) // ALIGNMENT) * ALIGNMENT
        if self._slab is None or self._slab.nbytes < end:
            if self._slab is not None:
                self._slab.release()
            self._slab = HostSlab(end)
            self._views = {}
        elif layout != self._layout:
            self._views = {}
        self._layout = layout
        self._own = {k: v for k, v in self._own.items() if k in tensors}

    def _buffer(self, index: Hashable, src: torch.Tensor) -> torch.Tensor:
        place = self._layout.get(index)
        if place is not None and place[1] == src.shape and place[2] == src.dtype:
            self._own.pop(index, None)
            if self.pin_memory and src.is_cuda:
                self._slab.pin(src.device)  # on the first CUDA item: a CPU-only state dict pins nothing
            view = self._views.get(index)
            if view is None:
                view = self._views[index] = self._slab.view(*place)
            return view
        pin = self.pin_memory and src.is_cuda
        buf, pinned = self._own.get(index, (None, False))
        # Also anew when pinnedness changed: a pageable buffer would make the "non-blocking" copy block.
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype or pinned != pin:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
            self._own[index] = (buf, pin)
        return buf

    def _side_stream(self, device: torch.device) -> "torch.cuda.Stream":
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def clear(self) -> None:
        """Give the memory back (pinned pages unregistered first)."""
        if self._slab is not None:
            self._slab.release()
        self._slab = None
        self._layout = {}
        self._views = {}
        self._own.clear()
