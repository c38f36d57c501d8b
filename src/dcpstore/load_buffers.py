"""Host memory for the tensor items of a load that do not land straight in their destination.

An item lands in its destination as it arrives only when that is a whole,
contiguous CPU tensor (``scatter``).  Every other tensor item (a CUDA
destination, a resharded read, ``verify_before_landing``) lands first in
host memory, its crc32 is checked there, and only then is it copied to its
destination: a corrupt item never reaches it.  ``LoadBuffers`` is that
memory: one slab (``staging.HostSlab``) per load, carved into regions in the
order the reader issues its ranges and freed in the order it delivers them,
so a load holds about its read-ahead window, allocated once, however many
items it reads.

For a CUDA destination the slab is pinned (under that destination's
device), and the copy is ``non_blocking`` on a side stream of that device,
so it overlaps the reads of the next ranges; a region is reused only once
the event its copies recorded has passed.  Before each copy the side stream
waits for the caller's current stream (the destination may still be in use
there, or freshly allocated on it), and after it the current stream waits
for the copy, on the GPU, so whatever the caller or its planner
(``commit_tensor``) queues next sees the bytes, and the host never blocks on
the GPU except to reuse memory.  Every CUDA call runs under the
destination's own device: a rank must not create a context on GPU 0.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from .staging import ALIGNMENT, HostSlab


def aligned(nbytes: int) -> int:
    """The bytes ``nbytes`` take in the slab (each buffer starts ``ALIGNMENT``-aligned)."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


@dataclasses.dataclass
class Region:
    """The memory of one range's buffered items: ``buffers[i]`` for the i-th size asked for."""

    start: int
    end: int
    buffers: list[memoryview]
    copies: list["torch.cuda.Event"] = dataclasses.field(default_factory=list)
    delivered: bool = False

    def wait(self) -> None:
        """Block until the copies out of this region have run (the host sleeps: blocking events)."""
        for event in self.copies:
            event.synchronize()


class LoadBuffers:
    """A ring of host memory over one slab; see the module docstring.

    Args:
        capacity: the slab's size, grown when one range alone needs more.
            The reader passes its read-ahead window (or the load's tensor
            bytes, when fewer), so ranges keep flowing while earlier ones
            are copied out.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._slab: HostSlab | None = None
        self._regions: collections.deque[Region] = collections.deque()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of host memory held, as allocated."""
        return self._slab.nbytes if self._slab is not None else 0

    def reserve(self, sizes: list[int], device: torch.device | None = None) -> Region | None:
        """A region with a buffer of each of ``sizes``, or ``None`` while undelivered regions fill the ring.

        Regions already delivered are waited for as needed (their copies
        to the device); ``None`` tells the reader to deliver the range it
        issued first.  ``device``: the CUDA device of a destination these
        buffers feed, whose context pins the slab.
        """
        need = sum(aligned(n) for n in sizes)
        if need == 0:
            return Region(0, 0, [memoryview(b"")[:0] for _ in sizes], delivered=True)
        while True:
            start = self._fit(need)
            if start is not None:
                break
            if self._regions and not self._regions[0].delivered:
                return None
            if self._regions:
                self._regions.popleft().wait()
                continue
            # Empty and still too small: one range needs more than the whole slab.
            if self._slab is not None:
                self._slab.release()
                self._slab = None
            self.capacity = need
        if self._slab is None:
            self._slab = HostSlab(max(self.capacity, need))
        if device is not None and device.type == "cuda":
            self._slab.pin(device)
        buffers, at = [], start
        for n in sizes:
            buffers.append(self._slab.bytes(at, n))
            at += aligned(n)
        region = Region(start, start + need, buffers)
        self._regions.append(region)
        return region

    def _fit(self, need: int) -> int | None:
        """Where a region of ``need`` bytes fits now, if it does."""
        capacity = self._slab.nbytes if self._slab is not None else self.capacity
        if not self._regions:
            return 0 if need <= capacity else None
        first, last = self._regions[0], self._regions[-1]
        if last.start >= first.start:  # not wrapped: [first.start, last.end) in use
            if last.end + need <= capacity:
                return last.end
            return 0 if need <= first.start else None
        return last.end if last.end + need <= first.start else None  # wrapped: [last.end, first.start) free

    def copy(self, region: Region, target: torch.Tensor, source: torch.Tensor) -> None:
        """``target.copy_(source)``, ``source`` being a view of ``region``'s memory; asynchronous to a CUDA target."""
        if not target.is_cuda:
            target.copy_(source)
            return
        device = target.device
        with torch.cuda.device(device):
            current = torch.cuda.current_stream(device)
            side = self._side_stream(device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                target.copy_(source, non_blocking=True)
            target.record_stream(side)  # a target the planner made on another stream stays until the copy ran
            copied = side.record_event(torch.cuda.Event(blocking=True))
            current.wait_event(copied)
        region.copies.append(copied)

    def _side_stream(self, device: torch.device) -> "torch.cuda.Stream":
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def close(self) -> None:
        """Wait for every copy out of the slab, then give it back (pinned pages unregistered first)."""
        while self._regions:
            self._regions.popleft().wait()
        if self._slab is not None:
            self._slab.release()
            self._slab = None
