"""The resume index: each rank's share of a checkpoint, typed and not pickle, beside ``.metadata``.

torch's ``.metadata`` lists every chunk of every rank, so it grows as W x N
(about 1.4 GB at 4,096 ranks x 2,000 items, see docs/scale.md), and every
rank that resumes from it unpickles all of it.  A rank that resumes the same
structure needs only what its own local plan held: its items, where each
was written (by itself, or by whichever rank dedup chose for a replicated
item), and its plan for the next save.

So ``finish()`` also writes, before ``.metadata``, one object in three
parts.  First the blocks, rank-major: block ``r`` is rank ``r``'s share
(its items, which rank wrote each, in which shard and where, and its plans),
JSON compressed with zlib.  A block holds nothing a save of the same
structure changes, so a later save writes the same blocks (``Layout``).
Then the values: one binary segment per writer rank with what each save
changes, at a width that does not change (the generation in its shard
names, its items' crc32s, its bytes items' offsets and lengths).  Last, the
directory (plain JSON): each block's and each segment's offset, length and
SHA-256, the writers whose values each block reads, the save's nonce, the
world size.  ``.metadata`` names the
directory (its offset, length and SHA-256) twice: in its ``planner_data``
under ``planner_data.INDEX_KEY`` (for ``dcpstore verify`` and stores without
user metadata) and as user metadata of the commit's conditional PUT
(``INDEX_TAG``), so the coordinator finds the index with one HEAD of
``.metadata``, never parsing it: it GETs the directory and the values,
checks their hashes, and sends each rank its own entry with the segments its
block reads (``rank_entry``).  Each rank GETs its own block with one ranged
GET, checks its hash, and builds a ``Metadata`` holding only its chunks
(``share_metadata``).  The hashes chain from the commit itself: a block or
a segment that does not match the ``.metadata`` that names it is never used.
``.metadata`` itself stays torch's format: stock readers never see the index.

The index is a cache of what ``.metadata`` says.  Whatever is off (no
index, another world size, a block that does not hash or parse, a state dict
whose items the block does not cover exactly) falls back to ``.metadata``.
JSON, because ``json.loads`` runs at C speed and builds only str-keyed dicts
(whose hashes are seeded per process), lists, strings and numbers: no object
of the bucket's choosing.  A block is bounded before it is parsed (its
compressed and inflated size), and the ``MetadataIndex`` keys built from it,
whose offsets hash predictably, are capped per fqn (``MAX_CHUNKS_PER_FQN``).

This module holds the format (its bounds, its encodings, where
``.metadata`` names it) and its writing (``layout_of``, ``Layout``);
``resume_share`` reads it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import reprlib
import zlib
from typing import Any, Sequence

import numpy

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorProperties

from . import planner_data
from .layout import GENERATION_DIGITS, METADATA_KEY, NONCE_KEY

VERSION = 4  # 4: a save's own values (generation, crc32s, bytes extents) in a segment per writer, apart from the blocks
INDEX_TAG = "dcpstore-index"  # x-amz-meta of .metadata: "<offset>:<length>:<sha256>" of the directory
# Peak memory of reading one part stays under 256 MiB, whatever the bucket
# holds: its bytes (compressed), the inflated text, and what parsing it
# builds, estimated from the text before it is parsed (``_parse_bounded``).
MAX_DIRECTORY_BYTES = 16 << 20  # about 200 bytes a rank
MAX_BLOCK_BYTES = 16 << 20  # compressed; a rank's block is tens of KB at 2,000 items
MAX_BLOCK_JSON = 48 << 20  # inflated: a block that inflates past this is refused before it is parsed
MAX_PARSE_MEMORY = 160 << 20  # what json.loads of one part may build, by the estimate below
MAX_VALUES_BYTES = 1 << 30  # every writer's segment: 4 bytes an item, 32 MB at 4,096 x 2,000
_SHARD_NAME = re.compile(r"__\d+_([0-9a-f]{%d})_\d+\.distcp" % GENERATION_DIGITS)
# Chunks of one fqn in one rank's share: 1 for a DTensor or plain tensor, a
# few for a LocalShardsWrapper.  The offsets of a MetadataIndex key hash
# predictably (ints), so many chunks of one fqn could be made to collide.
MAX_CHUNKS_PER_FQN = 1024
# torch's own value types that a TensorProperties field holds, stored by name; and
# each one's values by name, from an explicit table (no attribute lookup on torch).
_TORCH_ENUMS = {torch.dtype: "dtype", torch.layout: "layout", torch.memory_format: "memory_format"}
_BY_NAME = {
    kind: {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, cls)}
    for cls, kind in _TORCH_ENUMS.items()
}


class IndexUnusable(ValueError):
    """The index cannot stand in for ``.metadata`` here; the message says why (for the fallback's log line).

    ``damaged``: something is wrong (worth a warning), rather than an index
    that is absent or made for another world size (an ordinary fallback).
    """

    def __init__(self, message: str, *, damaged: bool = True):
        super().__init__(message)
        self.damaged = damaged


def index_key(save_id: str) -> str:
    """The index object of the save ``save_id``: one per save, so a refused commit never overwrites the winner's."""
    return f".dcpstore-index-{save_id}"


# -- writing -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a save's index holds that stays the same from save to save of one structure.

    The blocks (each rank's share: its items, who wrote each, in which shard
    and where, and its plans) depend on the structure alone: every value a
    save changes (a shard name's generation, the crc32s, a bytes item's
    offset and length) lives in its writer's segment instead.  So a later
    save of the structure writes the same blocks with new segments
    (``assemble``), without building a block again.
    """

    blocks: bytes  # every rank's block, rank-major
    block_bounds: list[list[Any]]  # [offset, length, sha256] of each in ``blocks``
    needs: list[list[list[int]]]  # per rank: the [first, last] ranges of the writers its block reads values of
    counts: list[tuple[int, int]]  # per writer: (items it wrote, of them bytes items)
    checksums: bool  # whether a segment holds its items' crc32s
    dcp_version: Any
    torch_version: str
    # The commit template's map (``metadata_template.CommitTemplate.stored_map``) and the save it was made
    # from: what a coordinator that resumes needs to patch the next commit.  None without one.
    template: bytes | None = None
    template_of: int | None = None

    def segments(self, metadata: Metadata, results: list[list[Any]]) -> list[bytes] | None:
        """Each writer's segment of a save's write results; ``None`` when they do not have this layout."""
        sdm = metadata.state_dict_metadata
        out = []
        for rank_results, (items, bytes_items) in zip(results, self.counts):
            if len(rank_results) != items:
                return None
            generation = _generation(rank_results[0].storage_data.relative_path) if rank_results else "0" * GENERATION_DIGITS
            crcs = [getattr(wr, "crc32", None) for wr in rank_results] if self.checksums else []
            extents = [
                n for wr in rank_results if isinstance(sdm.get(wr.index.fqn), BytesStorageMetadata)
                for n in (wr.storage_data.offset, wr.storage_data.length)
            ]
            if generation is None or None in crcs or len(extents) != 2 * bytes_items:
                return None
            out.append(encode_segment(generation, crcs, extents))
        return out if len(out) == len(self.counts) else None

    def assemble(self, segments: list[bytes], save_id: str) -> tuple[list[bytes], dict[str, Any]]:
        """The index object (as parts, to send back to back) of a save with these ``segments``, and its pointer.

        The parts: the blocks, the template's map (if any), the values, the directory.
        """
        template = self.template or b""
        offset = len(self.blocks) + len(template)
        values_at = offset
        bounds = []
        for (items, bytes_items), segment in zip(self.counts, segments):
            bounds.append([offset, len(segment), hashlib.sha256(segment).hexdigest(), items, bytes_items])
            offset += len(segment)
        values = b"".join(segments)
        directory = {
            "version": VERSION,
            "save_id": save_id,
            "world_size": len(self.block_bounds),
            "dcp_version": self.dcp_version,
            "torch_version": self.torch_version,
            "checksums": self.checksums,
            "blocks": self.block_bounds,
            "segments": bounds,
            "values": [values_at, len(values), hashlib.sha256(values).hexdigest()],
            "needs": self.needs,
            "template": [len(self.blocks), len(template), hashlib.sha256(template).hexdigest()] if template else None,
            "template_of": self.template_of if template else None,
        }
        raw_directory = json.dumps(directory, separators=(",", ":")).encode()
        pointer = {
            "version": VERSION,
            "key": index_key(save_id),
            "save_id": save_id,
            "size": offset + len(raw_directory),
            "directory": [offset, len(raw_directory), hashlib.sha256(raw_directory).hexdigest()],
        }
        return [self.blocks, template, values, raw_directory], pointer


_POINTER_DIGITS = 15  # a size or an offset in the pointer .metadata stores: a fixed width, so a commit can patch it


def stored_pointer(pointer: dict[str, Any]) -> dict[str, Any]:
    """``pointer`` as ``.metadata`` stores it: every value at a width that does not change from save to save.

    The sizes and offsets as zero-padded decimal strings, so a template
    (``metadata_template``) patches them in place; ``pointer_of`` reads it back.
    """
    offset, length, digest = pointer["directory"]
    return {
        "version": pointer["version"],
        "key": pointer["key"],
        "save_id": pointer["save_id"],
        "size": f"{pointer['size']:0{_POINTER_DIGITS}d}",
        "directory": f"{offset:0{_POINTER_DIGITS}d}:{length:0{_POINTER_DIGITS}d}:{digest}",
    }


def _parse_bounds(value: Any) -> list[Any]:
    """``"<offset>:<length>:<sha256>"`` (a tag, or a stored pointer's) as ``[offset, length, sha256]``; raises ``IndexUnusable``."""
    offset, _, rest = str(value).partition(":")
    length, _, digest = rest.partition(":")
    if not (offset.isdigit() and length.isdigit() and len(digest) == 64 and len(offset) <= 18 and len(length) <= 18):
        raise IndexUnusable(f"the resume index's bounds are malformed ({str(value)[:100]!r})")
    return [int(offset), int(length), digest]


def encode_segment(generation: str, crcs: Sequence[int], extents: Sequence[int]) -> bytes:
    """A writer's segment: its generation (ASCII), its items' crc32s (uint32 LE), its bytes items' offsets and lengths (uint64 LE)."""
    return generation.encode() + numpy.asarray(crcs, "<u4").tobytes() + numpy.asarray(extents, "<u8").tobytes()


def decode_segment(data: bytes, items: int, bytes_items: int, checksums: bool) -> tuple[str, Any, Any]:
    """A writer's ``(generation, crc32s or None, [offset, length] pairs)``; raises ``IndexUnusable`` unless ``data`` is exactly that."""
    expected = GENERATION_DIGITS + 4 * items * checksums + 16 * bytes_items
    generation = data[:GENERATION_DIGITS].decode("ascii", "replace")
    if len(data) != expected or not re.fullmatch("[0-9a-f]{%d}" % GENERATION_DIGITS, generation):
        raise IndexUnusable(f"a segment of {len(data)} bytes is not one of {items} items and {bytes_items} bytes items")
    crc_end = GENERATION_DIGITS + 4 * items * checksums
    crcs = numpy.frombuffer(data, "<u4", count=items, offset=GENERATION_DIGITS).tolist() if checksums else None
    extents = numpy.frombuffer(data, "<u8", count=2 * bytes_items, offset=crc_end).reshape(bytes_items, 2).tolist()
    return generation, crcs, extents


def _generation(path: str) -> str | None:
    match = _SHARD_NAME.fullmatch(path.rpartition("/")[2])
    return match.group(1) if match else None


def layout_of(metadata: Metadata, compact: dict[str, Any], results: list[list[Any]], checksums: bool) -> Layout | None:
    """The ``Layout`` of a save's index; ``None`` if the index cannot hold this save exactly.

    ``compact``: the save's plans (``planner_data.encode_plans``), which say
    what each rank's local plan held; ``results``: every writer's write
    results, in gathered order (``storage_data``'s).  Runs on the first save
    of a structure: O(W x N) dict lookups and one JSON encoding per block.
    """
    sdm = metadata.state_dict_metadata
    fqns = list(sdm)
    written: dict[tuple, tuple[int, int, int | None]] = {}  # key -> (writer, position, bytes position)
    counts = []
    for writer, rank_results in enumerate(results):
        bytes_items = 0
        for position, wr in enumerate(rank_results):
            is_bytes = isinstance(sdm.get(wr.index.fqn), BytesStorageMetadata)
            written[(wr.index.fqn, _key(wr.index.offset))] = (writer, position, bytes_items if is_bytes else None)
            bytes_items += is_bytes
        counts.append((len(rank_results), bytes_items))
    where = {(index.fqn, _key(index.offset)): info for index, info in metadata.storage_data.items()}
    user_pd = planner_data.user_planner_data(metadata)
    fqn_rows: dict[int, list[Any]] = {}
    encoded_pd: dict[int, Any] = {}  # id(planner_data) -> its encoding: ranks share one object
    blocks: list[bytes] = []
    needs: list[list[list[int]]] = []
    starred: dict[str, str] = {}  # a shard's name -> with its generation as "*"
    try:
        for rank in range(len(compact["ranks"])):
            pd = planner_data.rank_planner_data(compact, metadata, rank, user_pd)
            if id(pd) not in encoded_pd:
                encoded_pd[id(pd)] = encode_value(pd)
            slots: dict[int, int] = {}
            block_fqns: list[list[Any]] = []
            rows: list[list[Any]] = []
            writers: set[int] = set()
            for i, j, shard, keep in planner_data.rank_codes(compact, rank):
                slot = slots.get(i)
                if slot is None:
                    slot = slots[i] = len(block_fqns)
                    row = fqn_rows.get(i)
                    if row is None:
                        row = fqn_rows[i] = _fqn_row(fqns[i], sdm[fqns[i]])
                    block_fqns.append(row)
                md = sdm[fqns[i]]
                if isinstance(md, BytesStorageMetadata):
                    key, offsets, sizes = (fqns[i], None), None, None
                else:
                    chunk = md.chunks[j]
                    offsets, sizes = list(chunk.offsets), list(chunk.sizes)
                    key = (fqns[i], tuple(offsets))
                info = where[key]
                writer, position, bytes_position = written[key]
                path = starred.get(info.relative_path)
                if path is None:  # once a shard: W x 4 names, not W x N
                    generation = _generation(info.relative_path)
                    if generation is None:
                        return None  # not a name this writer gives: its generation cannot move to a segment
                    path = starred[info.relative_path] = info.relative_path.replace(f"_{generation}_", "_*_", 1)
                offset, length = (None, None) if bytes_position is not None else (info.offset, info.length)
                transforms = getattr(info, "transform_descriptors", None)
                writers.add(writer)
                rows.append(
                    [
                        slot, j, offsets, sizes, shard << 1 | keep, writer, path, offset, length,
                        list(transforms) if transforms else None, position, bytes_position,
                    ]
                )
            block = {"fqns": block_fqns, "items": rows, "plan_data": encoded_pd[id(pd)]}
            text = json.dumps(block, separators=(",", ":")).encode()
            if len(text) > MAX_BLOCK_JSON or parse_cost(text) > MAX_PARSE_MEMORY:
                return None  # a block its reader would refuse (more items a rank than the bounds allow)
            blocks.append(zlib.compress(text, 1))
            needs.append(_ranges(sorted(writers)))
    except (KeyError, IndexError, TypeError, ValueError, zlib.error):
        return None
    block_bounds, offset = [], 0
    for block in blocks:
        block_bounds.append([offset, len(block), hashlib.sha256(block).hexdigest()])
        offset += len(block)
    return Layout(
        b"".join(blocks), block_bounds, needs, counts, checksums, getattr(metadata, "version", None), str(torch.__version__)
    )


def _ranges(sorted_ints: list[int]) -> list[list[int]]:
    """``[0, 1, 2, 5]`` as ``[[0, 2], [5, 5]]``."""
    out: list[list[int]] = []
    for n in sorted_ints:
        if out and out[-1][1] == n - 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return out


def tags(pointer: dict[str, Any]) -> dict[str, str]:
    """The user metadata that names the index on ``.metadata``'s commit (see ``pointer_from_head``)."""
    offset, length, digest = pointer["directory"]
    return {INDEX_TAG: f"{offset}:{length}:{digest}"}


def _key(offsets: Any) -> tuple[int, ...] | None:
    return tuple(offsets) if offsets is not None else None


def _fqn_row(fqn: str, md: Any) -> list[Any]:
    if isinstance(md, BytesStorageMetadata):
        return [fqn, "bytes"]
    return [fqn, "tensor", list(md.size), encode_properties(md.properties)]


def encode_properties(properties: TensorProperties) -> dict[str, Any]:
    """Every field of ``properties``, by name: whatever fields this torch's ``TensorProperties`` has.

    torch adds fields (2.15: ``strides``); a reader rebuilds exactly the
    fields the writer had, or refuses one it does not know (``decode_properties``).
    """
    encoded = {}
    for field in dataclasses.fields(properties):
        value = getattr(properties, field.name)
        kind = _TORCH_ENUMS.get(type(value))
        node = {kind: str(value).removeprefix("torch.")} if kind is not None else encode_value(value)
        if "unencodable" in node:
            raise ValueError(f"TensorProperties.{field.name} is a {type(value).__name__}, which the index does not encode")
        encoded[field.name] = node
    return encoded


# A plan's planner_data in JSON: str, int, float, bool, None, and lists,
# tuples and str-keyed dicts of them (DefaultSavePlanner's flatten mappings).
# Anything else is not encoded, and that rank's plan is not primed from the index.
_MAX_DEPTH = 32


def encode_value(value: Any, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        return {"unencodable": True}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"v": value}
    if isinstance(value, (list, tuple)):
        parts = [encode_value(v, depth + 1) for v in value]
        if any("unencodable" in p for p in parts):
            return {"unencodable": True}
        return {"tuple" if isinstance(value, tuple) else "list": parts}
    if type(value) is dict and all(isinstance(k, str) for k in value):
        parts = {k: encode_value(v, depth + 1) for k, v in value.items()}
        if any("unencodable" in p for p in parts.values()):
            return {"unencodable": True}
        return {"dict": parts}
    return {"unencodable": True}


def decode_value(node: Any, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH or not isinstance(node, dict) or len(node) != 1:
        raise IndexUnusable("a plan's planner_data is not one the index encodes")
    (kind, body), = node.items()
    if kind == "v" and (body is None or isinstance(body, (bool, int, float, str))):
        return body
    if kind in ("list", "tuple") and isinstance(body, list):
        values = [decode_value(v, depth + 1) for v in body]
        return tuple(values) if kind == "tuple" else values
    if kind == "dict" and isinstance(body, dict):
        return {k: decode_value(v, depth + 1) for k, v in body.items()}
    raise IndexUnusable("a plan's planner_data is not one the index encodes")


# -- reading -----------------------------------------------------------------------------


def decode_properties(encoded: Any, fqn: str, written_by: Any) -> TensorProperties:
    """The ``TensorProperties`` ``encode_properties`` stored; raises ``IndexUnusable`` for a field this torch lacks.

    A field this torch has and the writer's did not keeps its default: the
    plan cache then names it if the plans differ (``plan_cache.plan_difference``).
    """
    if not isinstance(encoded, dict):
        raise ValueError(f"the properties of {fqn!r} are not an object")
    known = {field.name for field in dataclasses.fields(TensorProperties)}
    fields = {}
    for name, node in encoded.items():
        if name not in known:
            raise IndexUnusable(
                f"{fqn!r}: TensorProperties.{name} (written by torch {written_by}) is not a field of torch {torch.__version__}'s"
            )
        try:
            if isinstance(node, dict) and len(node) == 1 and next(iter(node)) in _BY_NAME:
                (kind, value), = node.items()
                fields[name] = _BY_NAME[kind][value]
            else:
                fields[name] = decode_value(node)
        except (KeyError, TypeError, IndexUnusable):
            raise ValueError(f"TensorProperties.{name} of {fqn!r} is malformed ({reprlib.repr(node)})") from None
    return TensorProperties(**fields)


def parse_cost(text: bytes) -> int:
    """An upper bound of the bytes ``json.loads(text)`` builds, from a count of its tokens (C speed, no parse).

    Bytes are what the bounds above are in, but what a parse builds depends
    on what the bytes say: ``[[],[],...]`` builds a 56-byte list for every 3
    bytes of text, ``[{"a":1000},...]`` 230 bytes for every 11.  Measured
    per token on CPython 3.11 (each list, dict, string, element and key;
    the weights are about twice the worst case seen).  The text itself is
    decoded into a ``str`` first (one byte a character: the text is ASCII,
    see ``_parse_bounded``), and its strings take one byte a character, or
    four once an escape (``\\u...``) puts a character beyond the BMP in one.
    A real block costs about 18 bytes of parse a byte of text.
    """
    return (
        len(text) * (5 if b"\\u" in text else 2)
        + 80 * text.count(b"[")
        + 200 * text.count(b"{")
        + 40 * text.count(b'"')
        + 64 * text.count(b",")
        + 72 * text.count(b":")
    )


def key_of(metadata: Metadata) -> str | None:
    """The index object a committed ``.metadata`` names (to delete with its shards), or ``None``."""
    entry = planner_data.read_index_directory(metadata)
    key = entry.get("key") if isinstance(entry, dict) else None
    return key if isinstance(key, str) and key.startswith(".dcpstore-index-") and "/" not in key else None


def pointer_from_head(store) -> dict[str, Any] | None:
    """The index pointer one HEAD of ``.metadata`` shows (its ``INDEX_TAG`` and nonce), or ``None`` if it shows none."""
    tags = store.head(METADATA_KEY).metadata
    value, nonce = tags.get(INDEX_TAG), tags.get(NONCE_KEY)
    if value is None or not nonce:
        return None
    return {"version": VERSION, "key": index_key(nonce), "save_id": nonce, "directory": _parse_bounds(value)}


def pointer_of(metadata: Metadata) -> dict[str, Any]:
    """The index pointer a parsed ``.metadata`` holds (``stored_pointer``, read back); raises ``IndexUnusable``."""
    pointer = planner_data.read_index_directory(metadata)
    if pointer is None:
        raise IndexUnusable("the checkpoint has no resume index", damaged=False)
    save_id = metadata.storage_meta.save_id if metadata.storage_meta is not None else None
    if not isinstance(pointer, dict):
        raise IndexUnusable("the resume index entry in .metadata is malformed")
    if pointer.get("version") != VERSION:
        raise IndexUnusable(f"the resume index is version {pointer.get('version')!r}, this dcpstore reads {VERSION}", damaged=False)
    if pointer.get("save_id") != save_id or pointer.get("key") != index_key(str(save_id)):
        raise IndexUnusable("the resume index belongs to another save than this .metadata")
    size = pointer.get("size")
    if not (isinstance(size, str) and size.isdigit()):
        raise IndexUnusable("the resume index entry in .metadata is malformed")
    return {**pointer, "size": int(size), "directory": _parse_bounds(pointer.get("directory"))}
