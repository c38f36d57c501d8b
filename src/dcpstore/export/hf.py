"""Hugging Face export: a committed DCP step to safetensors shards and their index, from bucket to bucket.

``export_hf(src, dst)`` (and ``dcpstore export-hf SRC DST``) writes what
``transformers``, vLLM and ``safetensors`` load: ``model-0000K-of-0000N.safetensors``
files and ``model.safetensors.index.json``.  No process ever holds the whole
model:

* **Read** with the checkpoint's own reader (``ObjectStoreReader``), one
  output shard at a time: ``dcp.load`` into that shard's full tensors
  assembles each from its stored chunks in any sharding (FSDP, 2-D meshes,
  resharded saves) with coalesced ranged reads, and checks every chunk's
  crc32 where the step has them.  Steps written by stock torch load too.
* **Write** each shard as it is assembled: the safetensors header (whose
  size and offsets are known before any data) and then each tensor's bytes,
  lent to the store's multipart writer without a copy, while the next
  read-ahead window of tensors is read.  ``safetensors.torch.save`` would
  first make the whole shard one more ``bytes``.  Each body goes with its CRC32,
  which S3 checks and keeps with the object (``open_writer(crc32=True)``;
  ``crc32=False`` for servers that refuse the header): no ``.metadata``
  crc32 covers a shard once it leaves the step.
* **Commit** by the index, written last and conditionally, like
  ``.metadata``: until it is there, ``DST`` holds no model that any loader
  opens.  A new export refuses a folder that holds an index, unless
  ``overwrite``; an overwrite first removes the old index, so a failed
  overwrite leaves no index rather than an index naming shards half
  replaced.  A failed export deletes the shards it wrote; a killed one
  leaves them, with no index, for ``dcpstore gc``.

Peak memory is one output shard in the stored dtypes (plus one tensor's cast,
with ``dtype``) and the reader's read-ahead window.  Shards follow
``huggingface_hub``'s rule: tensors in the step's order fill a shard up to
``max_shard_size``, and a tensor larger than that gets a shard of its own.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import struct
import warnings
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..commit import delete_quietly
from ..errors import CheckpointExistsError
from ..layout import HF_INDEX_KEY
from ..reader import ObjectStoreReader
from ..storage import ObjectStore, open_store

logger = logging.getLogger(__name__)

INDEX_NAME = HF_INDEX_KEY
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # huggingface_hub's default, "5GB"

#: safetensors' names of the dtypes it stores.
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
#: What ``--dtype`` takes.
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes in ``"5GB"`` (10^9 each, as huggingface_hub reads it), ``"500MiB"`` or a plain number."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(f"{text!r} is not a size such as 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


@dataclasses.dataclass(frozen=True)
class _Tensor:
    fqn: str  # in the step
    name: str  # in the export
    dtype: torch.dtype  # stored
    shape: tuple[int, ...]
    out_dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """In the export."""
        return torch.Size(self.shape).numel() * self.out_dtype.itemsize

    @property
    def stored_nbytes(self) -> int:
        """As the step stores it, before any cast."""
        return torch.Size(self.shape).numel() * self.dtype.itemsize


@dataclasses.dataclass
class ExportResult:
    """What an export wrote."""

    index_url: str
    shards: list[str]  # file names, in the index's order
    tensors: int
    total_size: int  # bytes of tensor data, as the index's metadata says
    skipped: list[str]  # items of the step that are not tensors


def plan_shards(tensors: list[_Tensor], max_shard_size: int) -> list[list[_Tensor]]:
    """``huggingface_hub``'s rule: fill a shard up to ``max_shard_size``; a larger tensor gets a shard of its own."""
    shards: list[list[_Tensor]] = []
    current: list[_Tensor] = []
    size = 0
    for tensor in tensors:
        if tensor.nbytes > max_shard_size:
            shards.append([tensor])
            continue
        if current and size + tensor.nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(tensor)
        size += tensor.nbytes
    if current:
        shards.append(current)
    return shards


def safetensors_header(tensors: list[_Tensor]) -> bytes:
    """The 8-byte length and the JSON header of a safetensors file holding ``tensors`` in order (padded to 8 bytes)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in tensors:
        if tensor.out_dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{tensor.fqn!r}: safetensors cannot store {tensor.out_dtype}")
        header[tensor.name] = {"dtype": SAFETENSORS_DTYPES[tensor.out_dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def export_hf(
    src: str,
    dst: str,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | str | None = None,
    prefix: str = "",
    overwrite: bool = False,
    crc32: bool = True,
    storage_options: dict[str, Any] | None = None,
    dst_storage_options: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> ExportResult:
    """Export the committed DCP step ``src`` to Hugging Face safetensors shards and index at ``dst`` (see the module docstring).

    Args:
        max_shard_size: bytes a shard holds at most (``"5GB"``, ``"500MiB"``).
        dtype: cast floating-point tensors to it (``"bf16"``, ``"fp16"``,
            ``"fp32"`` or a ``torch.dtype``); other tensors keep theirs.
        prefix: stripped from the names that start with it (``"model."``).
        overwrite: replace an export already at ``dst``.
        crc32: send each shard body's CRC32 for the server to check
            (``ObjectStore.open_writer``); ``False`` for S3-compatible
            servers that refuse the header.
        storage_options: for ``src``; ``dst_storage_options`` for ``dst``
            (default: the same).
        progress: called with each shard's file name once it is written.
    """
    max_shard_size = parse_size(max_shard_size)
    if max_shard_size < 1:
        raise ValueError("max_shard_size must be positive")
    out_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    reader = ObjectStoreReader(src, storage_options=storage_options)
    dst_store = open_store(dst, storage_options=dst_storage_options if dst_storage_options is not None else storage_options)
    # One process writes the folder: it starts at the key range's whole rate, not in a lone writer's slow start (storage.throttle).
    dst_store.share_write_rate(1)
    try:
        metadata = reader.read_metadata()
        tensors, skipped = [], []
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                skipped.append(fqn)
                continue
            cast = out_dtype if out_dtype is not None and md.properties.dtype.is_floating_point else md.properties.dtype
            name = fqn[len(prefix):] if prefix and fqn.startswith(prefix) else fqn
            tensors.append(_Tensor(fqn, name, md.properties.dtype, tuple(md.size), cast))
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"{src}: stripping {prefix!r} makes two tensors share a name")
        shards = plan_shards(tensors, max_shard_size)
        files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
        _claim(dst_store, overwrite)
        written: list[str] = []
        try:
            for file, shard in zip(files, shards):
                _write_shard(reader, dst_store, file, shard, crc32)
                written.append(file)
                if progress is not None:
                    progress(file)
            total = sum(t.nbytes for t in tensors)
            index = {"metadata": {"total_size": total}, "weight_map": {t.name: f for f, shard in zip(files, shards) for t in shard}}
            body = json.dumps(index, indent=2, sort_keys=True).encode() + b"\n"
            dst_store.put(INDEX_NAME, body, if_none_match=True)
        except BaseException:
            # Best effort: what is left has no index beside it, and `dcpstore gc` reclaims it.
            delete_quietly(dst_store, set(written), "shards of a failed export")
            raise
        return ExportResult(dst_store.url_for(INDEX_NAME), files, len(tensors), total, skipped)
    finally:
        reader.close()
        dst_store.close()


def _claim(store: ObjectStore, overwrite: bool) -> None:
    """Refuse a folder that holds an index, unless ``overwrite``: then remove that index first (see the module docstring).

    The new index is written with ``If-None-Match``, so of two exports
    racing for one folder at most one commits.
    """
    if not store.exists(INDEX_NAME):
        return
    if not overwrite:
        raise CheckpointExistsError(f"{store.url_for(INDEX_NAME)}: an export is already there; pass --overwrite to replace it")
    logger.warning("%s: removing the old export's index before writing the new one", store.url_for(INDEX_NAME))
    store.delete([INDEX_NAME])


def _write_shard(reader: ObjectStoreReader, store: ObjectStore, file: str, shard: list[_Tensor], crc32: bool) -> None:
    """Stream ``shard`` into ``file``: its header, then its tensors, each group read from the step (checked) while the last one uploads.

    Groups hold up to the reader's read-ahead window (a tensor larger than
    it, alone); a tensor's bytes go to the writer lent, so its memory is
    freed once its parts are uploaded.
    """
    with store.open_writer(file, crc32=crc32) as out:
        out.write(safetensors_header(shard))
        for group in _groups(shard, reader.readahead_bytes // 4):
            state = {t.fqn: torch.empty(t.shape, dtype=t.dtype) for t in group}
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    dcp.load(state, storage_reader=reader, no_dist=True)
            except CheckpointException as e:  # the reader's own error names the object and the cause
                raise e.failures[min(e.failures)][0] from None
            for t in group:
                tensor = state.pop(t.fqn).to(t.out_dtype).contiguous()
                if tensor.numel():
                    out.write_lent(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()), tensor)


def _groups(shard: list[_Tensor], max_bytes: int) -> list[list[_Tensor]]:
    """``shard``'s tensors in order, in runs of at most ``max_bytes`` (stored), a larger tensor alone."""
    groups: list[list[_Tensor]] = []
    size = max_bytes
    for t in shard:
        if groups and size + t.stored_nbytes <= max_bytes:
            groups[-1].append(t)
            size += t.stored_nbytes
        else:
            groups.append([t])
            size = t.stored_nbytes
    return groups
