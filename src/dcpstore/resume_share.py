"""Reading the resume index (``resume_index``): the directory, the per-save segments, and one rank's share.

Who calls it: the resume protocol (``resume``: the coordinator reads the
directory and the segments once and scatters each rank its entry; every
rank reads its own block), ``ObjectStoreReader(url, state_dict=...)``
under plain ``dcp.load`` (each rank reads what its block needs), and
``dcpstore verify --deep`` (``check``).  It only reads.

What it promises: every part is bounded before it is parsed (its size,
its inflated size, what ``json.loads`` may build) and checked against the
SHA-256 the part that names it carries, chaining from ``.metadata``'s own
pointer; anything off raises ``IndexUnusable``, which the callers turn
into a fallback to ``.metadata``, never into a wrong load.  A share's
``Metadata`` holds only the rank's own chunks, and only if they cover its
state dict exactly (``covers``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import reprlib
import zlib
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list

from . import planner_data
from .errors import CorruptCheckpointError, ObjectNotFoundError
from .resume_index import (
    MAX_BLOCK_BYTES,
    MAX_BLOCK_JSON,
    MAX_CHUNKS_PER_FQN,
    MAX_DIRECTORY_BYTES,
    MAX_PARSE_MEMORY,
    MAX_VALUES_BYTES,
    VERSION,
    IndexUnusable,
    Layout,
    decode_properties,
    decode_segment,
    decode_value,
    parse_cost,
    pointer_of,
)


def read_directory(store, pointer: dict[str, Any], world_size: int | None) -> dict[str, Any]:
    """The directory ``pointer`` names: one ranged GET, checked against its hash; raises ``IndexUnusable``.

    ``world_size``: the job that will use it (another one reads ``.metadata``:
    a resharded load), or ``None`` to read it whatever it was saved by.
    """
    key = pointer.get("key")
    directory = _read_part(store, key, pointer.get("directory"), MAX_DIRECTORY_BYTES, MAX_DIRECTORY_BYTES, "the directory", compressed=False)
    if directory.get("version") != VERSION:
        raise IndexUnusable(f"the resume index is version {directory.get('version')!r}, this dcpstore reads {VERSION}", damaged=False)
    blocks, segments, needs = directory.get("blocks"), directory.get("segments"), directory.get("needs")
    if not (isinstance(blocks, list) and isinstance(segments, list) and isinstance(needs, list)):
        raise IndexUnusable(f"{store.url_for(key)}: the directory is not one this dcpstore reads")
    if directory.get("save_id") != pointer["save_id"]:
        raise IndexUnusable(f"{store.url_for(key)}: the directory belongs to another save")
    if world_size is not None and directory.get("world_size") != world_size:
        raise IndexUnusable(f"saved by {directory.get('world_size')} ranks, loaded by {world_size}", damaged=False)
    if not len(blocks) == len(segments) == len(needs) == directory.get("world_size"):
        raise IndexUnusable(
            f"{store.url_for(key)}: the directory lists {len(blocks)} blocks, {len(segments)} segments and "
            f"{len(needs)} needs for {directory.get('world_size')} ranks"
        )
    return {**directory, "key": key}


def read_values(store, directory: dict[str, Any]) -> bytes:
    """Every writer's segment of the save (``directory``'s), with one ranged GET checked against its hash; raises ``IndexUnusable``.

    What the coordinator reads once to send each rank the segments it needs
    (``rank_entry``): 4 bytes an item, 32 MB at 4,096 x 2,000.
    """
    return _read_range(store, directory["key"], directory.get("values"), MAX_VALUES_BYTES, "the values")


def read_layout(store, directory: dict[str, Any]) -> Layout:
    """The ``Layout`` of a committed save's index, read back (its blocks and its template's map): what a resumed coordinator writes again.

    One ranged GET of the blocks, each checked against its hash, and one of
    the template's map; raises ``IndexUnusable``, also when it has no map.
    """
    key, bounds = directory["key"], directory.get("template")
    if bounds is None:
        raise IndexUnusable("the resume index holds no commit template (its save committed without one)", damaged=False)
    template = _read_range(store, key, bounds, MAX_BLOCK_BYTES, "the commit template")
    try:
        block_bounds = directory["blocks"]
        end = sum(length for _, length, _ in block_bounds)
        counts = [(_int(items), _int(bytes_items)) for *_, items, bytes_items in directory["segments"]]
        template_of = _int(directory["template_of"])
    except (KeyError, TypeError, ValueError) as e:
        raise IndexUnusable(f"{store.url_for(key)}: the directory is malformed ({e})") from None
    if end > MAX_VALUES_BYTES:
        raise IndexUnusable(f"{store.url_for(key)}: blocks of {end} bytes are more than this dcpstore reads back")
    blocks = store.get_range(key, 0, end) if end else b""
    offset = 0
    for rank, (start, length, digest) in enumerate(block_bounds):
        if start != offset or hashlib.sha256(blocks[start : start + length]).hexdigest() != digest:
            raise IndexUnusable(f"{store.url_for(key)}: the block of rank {rank} does not match its hash")
        offset += length
    return Layout(
        blocks, block_bounds, directory["needs"], counts, directory.get("checksums") is True,
        directory.get("dcp_version"), str(directory.get("torch_version")), template, template_of,
    )


def _read_range(store, key: Any, bounds: Any, max_bytes: int, what: str) -> bytes:
    """The bytes at ``bounds`` (``[offset, length, sha256, ...]``) of ``key``: one ranged GET, checked; raises ``IndexUnusable``."""
    try:
        offset, length, digest = bounds[:3]
        if not (isinstance(key, str) and type(offset) is int and type(length) is int and 0 <= offset and 0 <= length <= max_bytes):
            raise ValueError("bad bounds")
    except (TypeError, ValueError) as e:
        raise IndexUnusable(f"the resume index's entry for {what} is malformed ({e})") from None
    if length == 0:
        raw = b""
    else:
        try:
            raw = store.get_range(key, offset, offset + length)
        except ObjectNotFoundError:
            raise IndexUnusable(f"{store.url_for(key)}: the resume index is missing") from None
        except CorruptCheckpointError as e:
            raise IndexUnusable(f"{store.url_for(key)}: {what}: the resume index is shorter than its directory says ({e})") from None
    if hashlib.sha256(raw).hexdigest() != digest:
        raise IndexUnusable(f"{store.url_for(key)}: {what} does not match its hash")
    return raw


def _read_part(store, key: Any, bounds: Any, max_bytes: int, max_inflated: int, what: str, compressed: bool = True) -> dict[str, Any]:
    """The JSON object (zlib-compressed unless ``compressed`` is false) at ``bounds`` of ``key``: one ranged GET, checked; raises ``IndexUnusable``.

    The directory and each rank's block are read alike: bounds checked
    before the GET (at most ``max_bytes``), the bytes against their hash,
    the inflated text against ``max_inflated``.
    """
    if not (isinstance(bounds, list) and len(bounds) == 3 and type(bounds[1]) is int and bounds[1] > 0):
        raise IndexUnusable(f"the resume index's entry for {what} is malformed ({reprlib.repr(bounds)})")
    raw = _read_range(store, key, bounds, max_bytes, what)
    return _inflate(raw, max_inflated, f"{store.url_for(key)}: {what}", compressed)


def _inflate(raw: bytes, limit: int, what: str, compressed: bool = True) -> dict[str, Any]:
    """A (zlib) JSON object that must inflate to at most ``limit`` bytes; raises ``IndexUnusable``."""
    if not compressed and raw[:1] != b"{":  # an older dcpstore's directory (zlib), or not one at all
        raise IndexUnusable(f"{what} is not in this dcpstore's format (version {VERSION}): an older index", damaged=False)
    try:
        if compressed:
            inflater = zlib.decompressobj()
            text = inflater.decompress(raw, limit)
            if inflater.unconsumed_tail:
                raise ValueError(f"inflates past {limit} bytes")
        else:
            text = raw
        parsed = _parse_bounded(text)
    except (zlib.error, ValueError, RecursionError) as e:
        raise IndexUnusable(f"{what} does not parse ({e})") from None
    if not isinstance(parsed, dict):
        raise IndexUnusable(f"{what} is not an object")
    return parsed


def _parse_bounded(text: bytes) -> Any:
    """``json.loads(text)``, refused first when it could build more than ``MAX_PARSE_MEMORY``.

    ``json.dumps`` writes ASCII (``ensure_ascii``); other text is not an index this dcpstore wrote.
    """
    if not text.isascii():
        raise ValueError("it is not ASCII")
    cost = parse_cost(text)
    if cost > MAX_PARSE_MEMORY:
        raise ValueError(f"parsing it could take {cost >> 20} MiB of memory, more than the {MAX_PARSE_MEMORY >> 20} MiB allowed")
    return json.loads(text)


def rank_entry(directory: dict[str, Any], rank: int, values: bytes | None = None) -> dict[str, Any]:
    """What rank ``rank`` needs of the directory: its block, and the segments of the writers its block reads values of.

    With ``values`` (``read_values``, read once by the coordinator) the
    entry carries those segments' bytes; without, their bounds and hashes,
    for the rank to read (``read_share``).
    """
    try:
        segments = {}
        base = directory["values"][0]
        for first, last in directory["needs"][rank]:
            for writer in range(first, last + 1):
                offset, length, digest, items, bytes_items = directory["segments"][writer]
                segment = {"counts": (_int(items), _int(bytes_items))}
                if values is None:
                    segment["bounds"] = [offset, length, digest]
                else:
                    segment["data"] = values[offset - base : offset - base + length]
                    if len(segment["data"]) != length:
                        raise ValueError(f"the segment of rank {writer} lies outside the values")
                segments[_int(writer)] = segment
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise IndexUnusable(f"{directory.get('key')}: the directory's entry for rank {rank} is malformed ({e})") from None
    return {"key": directory["key"], "save_id": directory["save_id"], "dcp_version": directory.get("dcp_version"),
            "torch_version": directory.get("torch_version"), "rank": rank, "block": directory["blocks"][rank],
            "checksums": directory.get("checksums") is True, "segments": segments,
            "template_of": directory.get("template_of") if type(directory.get("template_of")) is int else None}


def read_block(store, entry: dict[str, Any]) -> dict[str, Any]:
    """The block ``rank_entry`` names: one ranged GET, checked against its hash in the directory; raises ``IndexUnusable``."""
    return _read_part(
        store, entry.get("key"), entry.get("block"), MAX_BLOCK_BYTES, MAX_BLOCK_JSON, f"the block of rank {entry.get('rank')}"
    )


def read_segments(store, entry: dict[str, Any]) -> dict[int, tuple[str, Any, Any]]:
    """The segments ``entry`` names, decoded: ``writer -> (generation, crc32s, extents)``; raises ``IndexUnusable``.

    A segment the entry does not carry is read with a ranged GET of its
    own, checked against its hash.
    """
    out = {}
    for writer, segment in entry["segments"].items():
        data = segment.get("data")
        if data is None:
            data = _read_range(store, entry["key"], segment.get("bounds"), MAX_VALUES_BYTES, f"the segment of rank {writer}")
        out[writer] = decode_segment(data, *segment["counts"], entry["checksums"])
    return out


def check(store, metadata: Metadata, sizes: dict[str, int], deep: bool) -> list[str]:
    """Problems with the resume index ``metadata`` names (for ``dcpstore verify``): a cache, but one that must match."""
    if planner_data.read_index_directory(metadata) is None:
        return []
    try:
        pointer = pointer_of(metadata)
        where = store.url_for(pointer["key"])
        if sizes.get(pointer["key"]) != pointer.get("size"):
            return [f"{where}: resume index is {sizes.get(pointer['key'], 'missing')}, .metadata says {pointer.get('size')} bytes"]
        directory = read_directory(store, pointer, None)
    except (IndexUnusable, TypeError, KeyError) as e:
        return [f"{store.url_for('.metadata')}: resume index: {e}"]
    if not deep:
        return []
    try:
        values = read_values(store, directory)
    except IndexUnusable as e:
        return [str(e)]
    stored = metadata.storage_data
    try:
        checksums = planner_data.read_checksums(metadata)
    except CorruptCheckpointError:
        checksums = {}  # verify reports the array itself
    problems = []
    for rank in range(len(directory["blocks"])):
        try:
            entry = rank_entry(directory, rank, values)
            share = share_metadata(read_block(store, entry), entry, store.url_for(""), read_segments(store, entry)).metadata
        except IndexUnusable as e:
            problems.append(str(e))
            continue
        share_crcs = planner_data.read_checksums(share)
        for index, info in share.storage_data.items():
            if _where(stored.get(index)) != _where(info) or share_crcs.get(index) != checksums.get(index):
                problems.append(f"{where}: the block of rank {rank} says {index.fqn!r} lies elsewhere than .metadata says")
                break
    return problems


def _where(info: Any) -> tuple | None:
    return None if info is None else (info.relative_path, info.offset, info.length, getattr(info, "transform_descriptors", None))


def read_share(store, entry: dict[str, Any], state_dict: dict[str, Any], url: str) -> Share:
    """This rank's share (``entry``: its ``rank_entry``) if it holds exactly what ``state_dict`` loads; raises ``IndexUnusable``.

    ``state_dict``: as ``dcp.load`` gets it (``Stateful`` values already
    turned into their state dicts); flattened here as the load planner will.
    """
    share = share_metadata(read_block(store, entry), entry, url, read_segments(store, entry))
    flat, _ = flatten_state_dict(_flatten_sharded_tensors(state_dict))
    why = covers(share.metadata, flat)
    if why is not None:
        raise IndexUnusable(why, damaged=False)
    return share


@dataclasses.dataclass(frozen=True)
class Share:
    """A rank's share of a checkpoint, as its index block gives it."""

    metadata: Metadata  # only this rank's chunks, and where they lie
    local_plan: SavePlan | None  # for the plan cache; None when its planner_data was not encodable
    final_plan: SavePlan | None
    written: list[tuple] | None = None  # what this rank wrote, as metadata_template.written_layout gives it
    template_of: int | None = None  # the save whose commit template that layout belongs to, if the index holds one


def share_metadata(block: dict[str, Any], entry: dict[str, Any], url: str, segments: dict[int, tuple[str, Any, Any]]) -> Share:
    """The ``Metadata`` of one rank's share, and its plans; raises ``IndexUnusable`` on anything malformed.

    ``segments``: the save's values of the writers the block reads (``read_segments``).
    """
    try:
        fqn_mds: list[tuple[str, Any]] = [_fqn_metadata(row, entry.get("torch_version")) for row in block["fqns"]]
        sdm: dict[str, Any] = dict(fqn_mds)
        storage_data: dict[MetadataIndex, _StorageInfo] = {}
        checksums: dict[MetadataIndex, int] = {}
        local_items: list[WriteItem] = []
        final_items: list[WriteItem] = []
        written: list[tuple[int, tuple]] = []
        for row in block["items"]:
            slot, position, offsets, sizes, flags, writer, path, offset, length, transforms, at, bytes_at = row
            fqn, md = fqn_mds[slot]
            generation, crcs, extents = segments[writer]
            if isinstance(md, BytesStorageMetadata):
                index = MetadataIndex(fqn)
                item = WriteItem(index=index, type=WriteItemType.BYTE_IO)
                kept = item
                offset, length = extents[_int(bytes_at)]
            else:
                chunk = ChunkStorageMetadata(offsets=torch.Size(_ints(offsets)), sizes=torch.Size(_ints(sizes)))
                if len(chunk.offsets) != len(md.size) or len(chunk.sizes) != len(md.size):
                    raise ValueError(f"chunk of {fqn!r} has the wrong rank")
                if len(md.chunks) >= MAX_CHUNKS_PER_FQN:
                    raise ValueError(f"more than {MAX_CHUNKS_PER_FQN} chunks of {fqn!r} in one rank's share")
                md.chunks.append(chunk)
                index = MetadataIndex(fqn, chunk.offsets, _int(position))
                kind = WriteItemType.SHARD if flags & 2 else WriteItemType.TENSOR
                data = TensorWriteData(chunk=chunk, properties=md.properties, size=md.size)
                item = WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=kind, tensor_data=data)
                kept = WriteItem(index=index, type=kind, tensor_data=data)
            if not (isinstance(path, str) and path.count("*") == 1) or not (transforms is None or all(isinstance(t, str) for t in transforms)):
                raise ValueError(f"storage of {fqn!r} is malformed")
            info = _StorageInfo(path.replace("*", generation), _int(offset), _int(length))
            if transforms:
                info.transform_descriptors = list(transforms)
            storage_data[index] = info
            if crcs is not None:
                checksums[index] = crcs[_int(at)]
            if writer == entry.get("rank"):  # what this rank writes, as its write results will say
                shard = path.replace("_*_", "_", 1)
                written.append((_int(at), (index, shard, True) if bytes_at is not None else (index, shard, info.offset, info.length)))
            local_items.append(item)
            if flags & 1:
                final_items.append(kept)
        plan_data = block.get("plan_data")
        local_plan = final_plan = None
        if isinstance(plan_data, dict) and "unencodable" not in plan_data:
            pd = decode_value(plan_data)
            local_plan, final_plan = SavePlan(local_items, planner_data=pd), SavePlan(final_items, planner_data=pd)
    except IndexUnusable:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a malformed block raises, .metadata is the fallback
        raise IndexUnusable(f"{url}: an index block is malformed ({type(e).__name__}: {e})") from None
    extras: dict[str, Any] = {planner_data.CHECKSUMS_KEY: checksums} if checksums else {}
    metadata = Metadata(
        state_dict_metadata=sdm,
        planner_data=planner_data.embed(None, extras) if extras else None,
        storage_data=storage_data,
        storage_meta=StorageMeta(checkpoint_id=url, save_id=entry.get("save_id")),
    )
    if entry.get("dcp_version") is not None and hasattr(metadata, "version"):
        metadata.version = entry["dcp_version"]
    written.sort(key=lambda entry: entry[0])
    return Share(metadata, local_plan, final_plan, [layout for _, layout in written], entry.get("template_of"))


def _int(value: Any) -> int:
    if type(value) is not int or not 0 <= value < 1 << 63:
        raise ValueError(f"{reprlib.repr(value)} is not a non-negative 64-bit int")
    return value


def _ints(values: Any) -> list[int]:
    if not isinstance(values, list):
        raise ValueError(f"{reprlib.repr(values)} is not a list")
    return [_int(v) for v in values]


def _fqn_metadata(row: list[Any], written_by: Any) -> tuple[str, Any]:
    fqn, kind = row[0], row[1]
    if not isinstance(fqn, str):
        raise ValueError("an fqn is not a string")
    if kind == "bytes":
        return fqn, BytesStorageMetadata()
    if kind != "tensor":
        raise ValueError(f"{fqn!r} has kind {kind!r}")
    _, _, size, properties = row
    return fqn, TensorStorageMetadata(
        properties=decode_properties(properties, fqn, written_by), size=torch.Size(_ints(size)), chunks=[]
    )


def covers(metadata: Metadata, flat_state_dict: dict[str, Any]) -> str | None:
    """Why ``metadata`` (a share) does not hold exactly what ``flat_state_dict`` loads, or ``None`` if it does.

    A rank's share covers a load of the same structure: every key, and for
    each tensor every chunk this rank holds (torch's ``_create_chunk_list``,
    as the load planner sees them: a whole tensor, a DTensor shard, the
    shards of a ``LocalShardsWrapper``), each saved as that very chunk.  A
    resharded load needs chunks of other ranks: ``.metadata``.
    """
    sdm = metadata.state_dict_metadata
    for key, value in flat_state_dict.items():
        md = sdm.get(key)
        if md is None:
            return f"{key!r} is not in this rank's share"
        if not isinstance(value, torch.Tensor):
            if not isinstance(md, BytesStorageMetadata):
                return f"{key!r} is a tensor in the checkpoint"
            continue
        if not isinstance(md, TensorStorageMetadata) or md.size != value.size():
            return f"{key!r} differs in size or kind"
        saved = {(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks}
        for chunk in _create_chunk_list(value):
            if (tuple(chunk.offsets), tuple(chunk.sizes)) not in saved:
                return f"{key!r}: a chunk of this rank was saved by another rank (a resharded load)"
    return None
