"""Staging: the one part of an async save that blocks training.

``StagingPool`` copies the items a rank is about to save into host buffers
that are allocated on the first save and reused by every later save with the
same structure, so steady-state staging is a copy and no allocation.  GPU
tensors are copied into pinned buffers on a dedicated CUDA stream with
``non_blocking=True``; ``stage`` returns once the copies are queued.  The
training stream is then made to wait on the copies' event, so kernels that
update parameters after ``save`` returns cannot overwrite them before they
are copied, and the host thread never blocks on the GPU.  CPU tensors are
copied too, because the trainer mutates them after ``save`` returns.  Bytes
items (non-tensor values) are serialized during staging, which also freezes
their value.

Host memory: one pool holds one copy of the rank's shard of the state dict.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType

from .errors import UnpicklableValueError


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

    def __init__(self, data: dict[MetadataIndex, Any], ready: "torch.cuda.Event | None"):
        self._data = data
        self._ready = ready

    def wait_ready(self) -> None:
        """Block until the device-to-host copies have landed (call off the training thread)."""
        if self._ready is not None:
            self._ready.synchronize()

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


class StagingPool:
    """Reused host buffers for the tensor items of a save.

    Args:
        pin_memory: pin buffers for fast, asynchronous device-to-host copies.
            Defaults to whether CUDA is available.
    """

    def __init__(self, pin_memory: bool | None = None):
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffers: dict[MetadataIndex, torch.Tensor] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of host memory held by the pool."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, items: list[WriteItem], planner: SavePlanner) -> StagedItems:
        staged: dict[MetadataIndex, Any] = {}
        used_streams: dict[torch.device, torch.cuda.Stream] = {}
        for item in items:
            data = resolve_item(planner, item)
            if item.type == WriteItemType.BYTE_IO:
                staged[item.index] = io.BytesIO(data.getvalue())
                continue
            src = data.detach()
            buf = self._buffer(item.index, src)
            if src.is_cuda:
                stream = used_streams.setdefault(src.device, self._side_stream(src.device))
                # Per item: resolve_data may have just launched the kernels
                # that produce src (a DTensor's local shard, a contiguous
                # copy) on the current stream.
                stream.wait_stream(torch.cuda.current_stream(src.device))
                with torch.cuda.stream(stream):
                    buf.copy_(src, non_blocking=True)
                # src may be a temporary: keep its memory from being reused
                # by the current stream before the side stream has read it.
                src.record_stream(stream)
            else:
                buf.copy_(src)
            staged[item.index] = buf
        # Drop buffers of items that are gone (the state dict changed shape).
        for stale in set(self._buffers) - set(staged):
            del self._buffers[stale]
        ready = None
        for device, stream in used_streams.items():
            ready = stream.record_event()
            torch.cuda.current_stream(device).wait_event(ready)
        if len(used_streams) > 1:
            # One event per device would be needed to wait precisely; sync all.
            for stream in used_streams.values():
                stream.synchronize()
            ready = None
        return StagedItems(staged, ready)

    def _buffer(self, index: MetadataIndex, src: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(index)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=self.pin_memory and src.is_cuda)
            self._buffers[index] = buf
        return buf

    def _side_stream(self, device: torch.device) -> "torch.cuda.Stream":
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def clear(self) -> None:
        self._buffers.clear()
