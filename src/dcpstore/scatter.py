"""Where each byte of a ranged read lands: a tensor's data straight in its destination.

A coalesced range (``stored_items.coalesce``) holds stored items, and each tensor
item is a ``torch.save`` archive: a head (zip headers, ``data.pkl``), the
tensor's bytes, and a tail (a few short records, the central directory).
The store hands over the range's body in the chunks aiohttp read from the
socket (``ObjectStore.get_range_async`` with a sink); ``RangeScatter`` copies
each chunk once, to where its bytes belong: an item's head and tail into
small buffers of its own, its data into the destination tensor's memory
when the reader resolved one that can take the bytes as they are stored (a
CPU, contiguous, whole-item read, see ``destination_bytes``), any other item
into a buffer of its own, and the bytes between items nowhere.  A tensor
loaded into CPU memory thus costs one copy beyond the socket read, where
landing the range in one buffer and copying from there costs two.

Where an item's data starts is known only from its head, which comes first:
until ``tensor_archive.locate_data`` finds it, an item takes its bytes in
order, and pieces that arrive early (from a concurrent part GET further on)
wait, kept without a copy.  That is a guess from bytes not yet checked: once
the whole item is there the reader checks its crc32 over the three places,
and ``tensor_archive.holds_in_place`` decides whether the destination now
holds what ``torch.load`` would return.  When it does not (a transposed
tensor, another writer's layout, a hostile head), the item is put back
together and loaded the ordinary way, which overwrites the destination: a
wrong guess costs copies, never a wrong tensor.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import zlib

import torch

from .storage.body import ViewFile
from .tensor_archive import holds_in_place, locate_data

#: The most of an item read to find where its data starts; a plain tensor's head is under 1 KiB.
HEAD_BYTES = 64 << 10


def destination_bytes(tensor: torch.Tensor | None) -> memoryview | None:
    """``tensor``'s memory as writable bytes, if a stored copy of it can be landed there as it is.

    A contiguous, dense CPU tensor whose bytes are its values (no conjugate
    or negative bit, not quantized) and that has some.
    """
    if (
        tensor is None
        or tensor.device.type != "cpu"
        or tensor.layout != torch.strided
        or tensor.is_quantized
        or tensor.is_conj()
        or tensor.is_neg()
        or tensor.numel() == 0
        or not tensor.is_contiguous()
    ):
        return None
    try:
        array = tensor.detach().reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError):  # a tensor numpy cannot view (a subclass, an odd dtype)
        return None
    return memoryview(array)


class ItemLanding:
    """One stored item's bytes: in a buffer of its own, or over its head, its destination and its tail.

    ``target`` is the tensor the reader resolved for the item before the
    fetch (``None`` for none); its data lands in it when ``destination_bytes``
    allows, and the archive's head locates it within ``HEAD_BYTES``.  Any
    other item lands in ``buffer`` (``length`` writable bytes the reader
    owns, see ``load_buffers``), or in a new ``bytearray``.
    """

    def __init__(self, length: int, target: torch.Tensor | None = None, buffer: memoryview | None = None):
        self.length = length
        self.target = target
        self._destination = destination_bytes(target)
        if self._destination is not None and self._destination.nbytes > length:
            self._destination = None  # an item too short to hold the tensor
        self.head = bytearray()
        self.tail = bytearray()
        self.buffer: bytearray | memoryview | None = None
        if self._destination is None:
            self.buffer = buffer if buffer is not None else bytearray(length)
        self.data_start: int | None = None
        self._early: list[tuple[int, memoryview]] = []

    @property
    def in_destination(self) -> bool:
        """Whether the data went to ``target`` (else the whole item is in ``buffer``)."""
        return self.data_start is not None

    def write(self, offset: int, chunk: memoryview) -> None:
        if self.buffer is not None:
            self.buffer[offset : offset + len(chunk)] = chunk
        elif self.data_start is not None:
            self._place(offset, chunk)
        elif offset > len(self.head):
            self._early.append((offset, chunk))
        else:
            self._read_head(offset, chunk)

    def crc32(self) -> int:
        if self.buffer is not None:
            return zlib.crc32(self.buffer)
        return zlib.crc32(self.tail, zlib.crc32(self._destination, zlib.crc32(self.head)))

    def leftover(self) -> bytes | bytearray | memoryview | None:
        """``None`` when ``target`` holds the item's tensor as ``torch.load`` would read it; else the item's bytes.

        Called once every byte is there (and its crc32 checked): a landing
        in the destination that ``holds_in_place`` does not confirm hands
        back the item put together, for the ordinary load to overwrite the
        destination from.
        """
        if self.buffer is not None:
            return self.buffer
        if holds_in_place(ViewFile(self.head, self._destination, self.tail), self.length, self.data_start, self.target):
            return None
        return b"".join((self.head, self._destination, self.tail))

    def _read_head(self, offset: int, chunk: memoryview) -> None:
        """Take ``chunk``, which starts within the head read so far, and locate the data if it can."""
        known = min(len(chunk), len(self.head) - offset)
        self.head[offset : offset + known] = chunk[:known]  # a retried GET's bytes again
        rest = chunk[known:]
        if not rest:
            return
        at = len(self.head)
        if self.head:  # rare: the head spans pieces
            self.head += rest[: HEAD_BYTES - at]
            probe = bytes(self.head)
        else:  # the first piece: locate in place, copying only the head
            probe = rest[:HEAD_BYTES]
        try:
            start = locate_data(probe)
        except ValueError:
            start = -1
        nbytes = len(self._destination)
        if start is not None and 0 <= start and start + nbytes <= self.length:
            self.head = bytearray(probe[:start])
            self.tail = bytearray(self.length - start - nbytes)
            self.data_start = start
            self._place(at, rest)
        elif start is not None or len(probe) >= min(self.length, HEAD_BYTES):
            head, self.head = bytes(probe), bytearray()
            self.buffer = bytearray(self.length)
            self.buffer[: len(head)] = head
            self.write(at, rest)
        elif not self.head:
            self.head = bytearray(probe)
        early, self._early = self._early, []
        for piece in early:
            self.write(*piece)

    def _place(self, offset: int, chunk: memoryview) -> None:
        end = offset + len(chunk)
        data_end = self.data_start + len(self._destination)
        for place_start, place in ((0, self.head), (self.data_start, self._destination), (data_end, self.tail)):
            lo, hi = max(offset, place_start), min(end, place_start + len(place))
            if lo < hi:
                place[lo - place_start : hi - place_start] = chunk[lo - offset : hi - offset]


class RangeScatter:
    """A store sink over one ranged read: each piece goes to the items it covers, gaps nowhere.

    ``spans`` pairs each item's offset within the range with its landing,
    sorted by offset (items may overlap, as a hostile ``.metadata`` can
    make them: each then gets its own copy).
    """

    def __init__(self, spans: list[tuple[int, ItemLanding]]):
        self._spans = spans
        self._starts = [lo for lo, _ in spans]
        self._reach = list(itertools.accumulate((lo + landing.length for lo, landing in spans), max))
        self._aborted = False

    def abort(self) -> None:
        """Drop every piece from now on: the load failed, and its destinations are the caller's again."""
        self._aborted = True

    def write(self, offset: int, chunk: memoryview) -> None:
        if self._aborted:
            return
        end = offset + len(chunk)
        i = bisect.bisect_right(self._reach, offset)  # the first item that ends after offset
        while i < len(self._spans) and self._starts[i] < end:
            lo, landing = self._spans[i]
            a, b = max(offset, lo), min(end, lo + landing.length)
            if a < b:
                landing.write(a - lo, chunk[a - offset : b - offset])
            i += 1


class DestinationClaims:
    """The memory that the tensor items in flight will write, so that none lands where another writes.

    Two items whose destinations share bytes (tied weights under two keys)
    would each find the other's bytes there when checked.  An item lands in
    its destination only if no other item in flight claims any of those
    bytes; ranges are delivered in the order they were issued, so an item
    that claims them later writes them (by ``copy_``, at its delivery) after
    the landing was checked.  Claims are kept per storage, so the search is
    over the views of one storage in flight.
    """

    def __init__(self):
        self._live: dict[tuple, list[tuple[int, int]]] = collections.defaultdict(list)

    def claim(self, tensors: list[torch.Tensor]) -> bool:
        """Claim ``tensors``' memory; whether none of it was claimed already."""
        alone = True
        for key, span in map(_span, tensors):
            live = self._live[key]
            alone = alone and all(span[0] >= hi or span[1] <= lo for lo, hi in live)
            live.append(span)
        return alone

    def release(self, tensors: list[torch.Tensor] | None) -> None:
        for key, span in map(_span, tensors or ()):
            live = self._live[key]
            live.remove(span)
            if not live:
                del self._live[key]


def _span(tensor: torch.Tensor) -> tuple[tuple, tuple[int, int]]:
    """``tensor``'s storage and the bytes of it that the tensor covers (its extent, for a strided view)."""
    start = tensor.data_ptr()
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride())) if tensor.numel() else 0
    return (tensor.device, tensor.untyped_storage().data_ptr()), (start, start + extent * tensor.element_size())
