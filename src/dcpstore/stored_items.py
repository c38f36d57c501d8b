"""A stored item's bytes, from the ranged reads that fetch them to the tensor they hold.

Readers fetch items of one object that lie close together with one ranged
GET (``coalesce``); an item's stored bytes are its ``torch.save`` archive
once its stream transforms are undone (``undo_transforms``, only with
extensions registered in this process: nothing from the bucket runs);
``parse_tensor`` reads the archive's tensor as a view of those bytes, and
``land_tensor`` copies each ``ReadItem``'s part of it into its destination.
``ObjectStoreReader`` (alone and in a cooperative load) and the CLI's deep
verify share them.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StorageReaderTransforms
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from .errors import CorruptCheckpointError, StateDictMismatchError
from .tensor_archive import load_tensor


def parse_tensor(raw: bytes | memoryview | bytearray, where: str) -> torch.Tensor:
    """The tensor of an item's ``torch.save`` bytes, a view of them; ``CorruptCheckpointError`` naming ``where`` if they are not one."""
    try:
        return load_tensor(raw)
    except Exception as e:  # noqa: BLE001 - any failure here means bad bytes
        raise CorruptCheckpointError(f"{where}: cannot deserialize the tensor ({e})") from e


def land_tensor(stored: torch.Tensor, reqs: list[ReadItem], targets, planner: LoadPlanner, copy, where: str) -> None:
    """Copy each ``ReadItem``'s part of the stored tensor into its destination (``copy(target, source)``) and commit it."""
    for req, target in zip(reqs, targets):
        tensor = narrow_tensor_by_index(stored, req.storage_offsets, req.lengths)
        if target.size() != tensor.size():
            raise StateDictMismatchError(
                f"{where}: shape {tuple(tensor.size())} in the checkpoint does not fit "
                f"{tuple(target.size())} in the state dict"
            )
        copy(target, tensor)
        planner.commit_tensor(req, target)


def undo_transforms(raw: bytes | memoryview, info: _StorageInfo, transforms: _StorageReaderTransforms, where: str):
    """The item's ``torch.save`` bytes from its stored bytes: undo its stream extensions, if any.

    The descriptors come from the bucket but only name extensions registered
    in this process (``ExtensionRegistry``); nothing from the bucket runs.
    """
    if not info.transform_descriptors:
        return raw
    try:
        return transforms.transform_load_stream(None, info.transform_descriptors, io.BytesIO(raw)).read(-1)
    except Exception as e:  # noqa: BLE001 - an unknown extension, or bytes it cannot decode
        raise CorruptCheckpointError(
            f"{where}: cannot undo the stream transforms {list(info.transform_descriptors)} ({e})"
        ) from e


@dataclasses.dataclass
class ByteRange:
    """``[start, end)`` of object ``key``, and the stored items that lie in it."""

    key: str
    start: int
    end: int
    items: list[tuple[_StorageInfo, Any]]


def coalesce(items: list[tuple[_StorageInfo, Any]], *, gap_bytes: int, max_bytes: int) -> list[ByteRange]:
    """Group stored items into as few ranged reads as bounded memory allows.

    Per object, items sorted by offset join the range before them when the
    gap between them is at most ``gap_bytes``, or at most the bytes the range
    already needs (so an object of which most is needed is fetched whole),
    and the range stays within ``max_bytes`` (an item larger than that is a
    range of its own; the store splits large ranges into concurrent part
    GETs).  Ranges come in the order their objects first appear in
    ``items``; ``items`` pairs each ``_StorageInfo`` with what the caller
    wants back beside it.
    """
    by_object: dict[str, list[tuple[_StorageInfo, Any]]] = {}
    for info, extra in items:
        by_object.setdefault(info.relative_path, []).append((info, extra))
    ranges: list[ByteRange] = []
    for key, members in by_object.items():
        members.sort(key=lambda m: m[0].offset)
        current: ByteRange | None = None
        needed = 0
        for info, extra in members:
            end = info.offset + info.length
            if current is not None:
                gap = info.offset - current.end
                if gap <= max(gap_bytes, needed) and max(end, current.end) - current.start <= max_bytes:
                    current.end = max(end, current.end)
                    current.items.append((info, extra))
                    needed += info.length
                    continue
            current = ByteRange(key, info.offset, end, [(info, extra)])
            needed = info.length
            ranges.append(current)
    return ranges
