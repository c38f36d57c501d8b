"""What dcpstore keeps in ``Metadata.planner_data``, under reserved keys.

``planner_data`` belongs to the planner: ``DefaultSavePlanner`` stores its
flatten mappings there (fqn -> path in the nested state dict), and stock
loaders read them back.  dcpstore adds its own entries beside them:

* ``PLANS_KEY``: every rank's local ``SavePlan`` (as the ranks made them,
  before global dedup) and what the global dedup decided, in a compact,
  versioned form (see ``encode_plans``).  They let a restarted job rebuild
  its plans without any planning collective.
* ``ALL_LOCAL_PLANS_KEY``: the older form, the full list of local
  ``SavePlan``\\ s; still read, and written only when the compact form cannot
  describe the plans exactly.
* ``CRC32_ARRAY_KEY``: the crc32 of every item's stored bytes, so readers
  detect corrupted shards instead of loading garbage: one little-endian
  uint32 per item, in ``storage_data``'s order (``checksum_extras``).  Fixed
  width, and one object in the pickle, where a dict costs a key reference
  and an int per item, and a Python object each when it is read back.
* ``CHECKSUMS_KEY``: the older form, ``MetadataIndex -> crc32``; still read,
  and written only when some item has no crc32.

Only builtins and torch types are stored, so a checkpoint unpickles without
dcpstore.  A ``dict`` from the user's planner is kept and extended.  Anything
else is kept intact under ``USER_PLANNER_DATA_KEY``;
``ObjectStoreReader.read_metadata`` hands that original object back as
``planner_data`` and keeps dcpstore's entries on the side (``DCPSTORE_ATTR``),
where ``read_plans`` finds them.

The compact form
----------------

A rank's ``WriteItem``\\ s are fully determined by ``state_dict_metadata``
(fqn, tensor properties, global size, chunk) plus which chunks the rank held
and whether it held them as a shard (DTensor, ShardedTensor) or a whole
tensor; ``DefaultSavePlanner``'s planner data (the flatten mappings) is the
same on every rank, and usually the same as the metadata's own.  So
``PLANS_KEY`` holds a dict of builtins::

    {"version": 2,
     "world_size": W,
     "fqns_crc32": crc32 of the state_dict_metadata keys, in order,
     "n_fqns": their number,
     "ranks": [bytes] * W,        # zlib(int64 little-endian), one code per local item
     "planner_data": [distinct values],
     "planner_data_index": bytes, # int32 per rank: index into planner_data, -1: the metadata's own
     "torch_version": str,        # the torch that wrote them (named when a restart cannot reuse them)
    }

with ``code = fqn_index << 32 | chunk_index << 2 | is_shard << 1 | kept``:
``fqn_index`` into the key order of ``state_dict_metadata``, ``chunk_index``
into its ``chunks`` (0 for bytes items), ``kept``: the rank writes the item
after the global dedup, which gives each rank's final plan without running
the dedup again.  ``encode_plans`` decodes what it encoded and compares, and
returns ``None`` on any difference, so ``read_plans`` never returns plans other
than the ranks made.
"""

from __future__ import annotations

import dataclasses
import sys
import zlib
from array import array
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from .errors import CorruptCheckpointError

PLANS_KEY = "dcpstore/plans_v2"
ALL_LOCAL_PLANS_KEY = "dcpstore/all_local_plans"  # version 1: full SavePlans; still read
CRC32_ARRAY_KEY = "dcpstore/crc32_array"
CHECKSUMS_KEY = "dcpstore/checksums"  # the older form, a dict; still read
USER_PLANNER_DATA_KEY = "dcpstore/user_planner_data"
COMMIT_KEY = "dcpstore/commit"  # a checkpointer's commit sequence and parent step (see steps)
INDEX_KEY = "dcpstore/index"  # the resume index's directory (see resume_index)
RESERVED_KEYS = (
    PLANS_KEY, ALL_LOCAL_PLANS_KEY, CRC32_ARRAY_KEY, CHECKSUMS_KEY, USER_PLANNER_DATA_KEY, COMMIT_KEY, INDEX_KEY
)
PLANS_VERSION = 2

# Attribute set on Metadata objects returned by ObjectStoreReader when the
# user's planner_data was not a dict and has been handed back unwrapped.
DCPSTORE_ATTR = "_dcpstore_planner_data"

_MISSING = object()
_SAME_AS_METADATA = -1
_MAX_CHUNK = (1 << 30) - 1
_MAX_FQN = (1 << 31) - 1


def strip_plan(plan: SavePlan) -> SavePlan:
    """The plan as the planner made it: storage-specific data removed."""
    return dataclasses.replace(plan, storage_data=None)


def embed(planner_data: Any, extras: dict[str, Any]) -> dict[str, Any]:
    """``planner_data`` with dcpstore's ``extras`` added; the original is not mutated."""
    if planner_data is None:
        return dict(extras)
    if isinstance(planner_data, dict) and USER_PLANNER_DATA_KEY not in planner_data:
        return {**planner_data, **extras}
    return {USER_PLANNER_DATA_KEY: planner_data, **extras}


def split(planner_data: Any) -> tuple[Any, dict[str, Any]]:
    """Undo ``embed`` for non-dict user data: ``(user_planner_data, dcpstore_extras)``.

    Dict planner data stays as it is (extended); only a wrapped non-dict object
    is unwrapped.
    """
    if isinstance(planner_data, dict):
        extras = {k: planner_data[k] for k in RESERVED_KEYS if k in planner_data}
        user = planner_data.get(USER_PLANNER_DATA_KEY, _MISSING)
        if user is not _MISSING:
            return user, extras
        return planner_data, extras
    return planner_data, {}


def user_planner_data(metadata: Metadata) -> Any:
    """``metadata.planner_data`` as the planner made it: dcpstore's entries removed.

    A dict that held only dcpstore's entries gives ``None`` (what a planner
    without planner data leaves).
    """
    pd = metadata.planner_data
    if getattr(metadata, DCPSTORE_ATTR, None) is not None:
        return pd  # already unwrapped by the reader
    user, _ = split(pd)
    if user is not pd or not isinstance(pd, dict) or not any(k in pd for k in RESERVED_KEYS):
        return user
    stripped = {k: v for k, v in pd.items() if k not in RESERVED_KEYS}
    return stripped or None


def _extras(metadata: Metadata) -> dict[str, Any]:
    attached = getattr(metadata, DCPSTORE_ATTR, None)
    if attached is not None:
        return attached
    return split(metadata.planner_data)[1]


# -- the compact form ---------------------------------------------------------------------


def fqns_fingerprint(state_dict_metadata: dict) -> tuple[int, int]:
    """``(number, crc32)`` of the fqns in key order: the frame the codes index into."""
    crc = 0
    for fqn in state_dict_metadata:
        crc = zlib.crc32(fqn.encode("utf-8", "surrogatepass") + b"\0", crc)
    return len(state_dict_metadata), crc


def _pack(values: array) -> bytes:
    if sys.byteorder == "big":
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()


def _unpack(typecode: str, raw: bytes) -> array:
    values = array(typecode)
    values.frombytes(raw)
    if sys.byteorder == "big":
        values.byteswap()
    return values


def encode_plans(
    plans: Sequence[SavePlan],
    metadata: Metadata,
    written: Sequence[set[MetadataIndex]],
) -> dict[str, Any] | None:
    """The compact form of the ranks' local ``plans``; ``None`` if it cannot hold them exactly.

    ``metadata`` is the global metadata of the save (its ``state_dict_metadata``
    and the planner's own ``planner_data``); ``written[r]``: the indices rank
    ``r`` wrote (its final plan, after dedup), from its write results.
    """
    sdm = metadata.state_dict_metadata
    if len(plans) != len(written):
        return None
    user_pd = user_planner_data(metadata)
    positions = {fqn: i for i, fqn in enumerate(sdm)}
    chunk_positions: dict[int, dict[tuple, int]] = {}
    ranks: list[bytes] = []
    pd_values: list[Any] = []
    pd_index = array("i")
    try:
        for plan, kept in zip(plans, written):
            if plan.usable is not True:
                return None
            codes = array("q")
            kept_here = set()
            for item in plan.items:
                fqn = item.index.fqn
                i = positions[fqn]
                md = sdm[fqn]
                if item.type == WriteItemType.BYTE_IO:
                    j, shard = 0, 0
                else:
                    table = chunk_positions.get(i)
                    if table is None:
                        table = chunk_positions[i] = {tuple(c.offsets): n for n, c in enumerate(md.chunks)}
                    j = table[tuple(item.tensor_data.chunk.offsets)]
                    shard = int(item.type == WriteItemType.SHARD)
                if not _decodes_to(item, md, j) or i > _MAX_FQN or j > _MAX_CHUNK:
                    return None
                keep = item.index in kept
                if keep:
                    kept_here.add(item.index)
                codes.append((i << 32) | (j << 2) | (shard << 1) | int(keep))
            if kept_here != kept:
                return None  # a rank wrote what its local plan does not hold: not the default dedup
            ranks.append(zlib.compress(_pack(codes), 1))
            pd_index.append(_planner_data_slot(plan.planner_data, user_pd, pd_values))
    except (KeyError, AttributeError, TypeError):
        return None
    n_fqns, crc = fqns_fingerprint(sdm)
    compact = {
        "version": PLANS_VERSION,
        "world_size": len(plans),
        "n_fqns": n_fqns,
        "fqns_crc32": crc,
        "ranks": ranks,
        "planner_data": pd_values,
        "planner_data_index": _pack(pd_index),
        "torch_version": str(torch.__version__),  # a str: stock unpicklers refuse torch's TorchVersion
    }
    return compact


def as_written_here(compact: dict[str, Any]) -> dict[str, Any]:
    """``compact``, naming this process's torch as the one that wrote it (the plans held here, so they are this torch's too)."""
    here = str(torch.__version__)
    return compact if compact.get("torch_version") == here else {**compact, "torch_version": here}


def _decodes_to(item: WriteItem, md: Any, j: int) -> bool:
    """Whether ``decode_rank`` gives ``item`` back, equal field by field, from its code (fqn, chunk ``j``, kind).

    The code carries no more than that: everything else decoding takes
    from ``md`` (the fqn's global metadata) or assumes, so it must already
    be so.  This is the exact round trip, checked without building the
    decoded plans (that cost a third of the coordinator's ``finish()``).
    """
    if getattr(item, "bytes_io_data", None) is not None:
        return False
    if item.type == WriteItemType.BYTE_IO:
        return isinstance(md, BytesStorageMetadata) and item.index.offset is None and item.tensor_data is None
    if not isinstance(md, TensorStorageMetadata) or item.type not in (WriteItemType.SHARD, WriteItemType.TENSOR):
        return False
    chunk, data = md.chunks[j], item.tensor_data
    return (
        item.index.offset == chunk.offsets
        and data.chunk == chunk
        and data.properties == md.properties
        and data.size == md.size
    )


def _planner_data_slot(value: Any, user_pd: Any, values: list[Any]) -> int:
    if value is user_pd or (value is not None and _equal(value, user_pd)):
        return _SAME_AS_METADATA
    for n, known in enumerate(values):
        if known is value or _equal(known, value):
            return n
    values.append(value)
    return len(values) - 1


def _equal(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - an odd planner_data that cannot compare is just distinct
        return False


def is_compact(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and value.get("version") == PLANS_VERSION
        and isinstance(value.get("ranks"), list)
        and isinstance(value.get("planner_data"), list)
        and isinstance(value.get("planner_data_index"), bytes)
    )


def compact_matches(compact: dict[str, Any], metadata: Metadata) -> bool:
    """Whether ``compact`` indexes into this ``metadata``'s fqns, in this order."""
    return is_compact(compact) and (compact.get("n_fqns"), compact.get("fqns_crc32")) == fqns_fingerprint(
        metadata.state_dict_metadata
    )


def decode_rank(
    compact: dict[str, Any],
    metadata: Metadata,
    rank: int,
    *,
    user_pd: Any = _MISSING,
    fqns: list[str] | None = None,
) -> tuple[SavePlan, SavePlan] | None:
    """Rank ``rank``'s ``(local plan, final plan)``; O(items of that rank) after the fqn list.

    The final plan is what ``DefaultSavePlanner.create_global_plan`` gives
    that rank (its kept items, index hints set to the chunk's position),
    without ``storage_data``.  ``None`` when ``compact`` does not decode.
    """
    sdm = metadata.state_dict_metadata
    try:
        if fqns is None:
            fqns = list(sdm)
        pd = rank_planner_data(compact, metadata, rank, user_pd)
        items: list[WriteItem] = []
        final: list[WriteItem] = []
        for i, j, shard, keep in rank_codes(compact, rank):
            fqn = fqns[i]
            md = sdm[fqn]
            if isinstance(md, BytesStorageMetadata):
                item = WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)
                kept = item
            elif isinstance(md, TensorStorageMetadata):
                chunk = md.chunks[j]
                kind = WriteItemType.SHARD if shard else WriteItemType.TENSOR
                data = TensorWriteData(chunk=chunk, properties=md.properties, size=md.size)
                item = WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=kind, tensor_data=data)
                kept = WriteItem(index=MetadataIndex(fqn, chunk.offsets, j), type=kind, tensor_data=data) if keep else None
            else:
                return None
            items.append(item)
            if keep:
                final.append(kept)
    except (KeyError, IndexError, TypeError, ValueError, zlib.error):
        return None
    return SavePlan(items, planner_data=pd), SavePlan(final, planner_data=pd)


def rank_codes(compact: dict[str, Any], rank: int) -> list[tuple[int, int, bool, bool]]:
    """Rank ``rank``'s items as ``(fqn position, chunk position, is a shard, kept by dedup)``, in plan order."""
    return [
        (code >> 32, (code >> 2) & _MAX_CHUNK, bool(code & 2), bool(code & 1))
        for code in _unpack("q", zlib.decompress(compact["ranks"][rank]))
    ]


def rank_planner_data(compact: dict[str, Any], metadata: Metadata, rank: int, user_pd: Any = _MISSING) -> Any:
    """The ``planner_data`` of rank ``rank``'s local plan (often the very object of the metadata's)."""
    slot = _unpack("i", compact["planner_data_index"])[rank]
    if slot == _SAME_AS_METADATA:
        return user_planner_data(metadata) if user_pd is _MISSING else user_pd
    return compact["planner_data"][slot]


def read_plans(metadata: Metadata) -> list[SavePlan] | None:
    """The local save plans persisted by dcpstore, one per rank, or ``None``.

    Reads both the compact form (``PLANS_KEY``) and the older full list
    (``ALL_LOCAL_PLANS_KEY``).  ``None`` means the checkpoint was written by
    another tool (or by a planner path that persisted no plans), and a
    restarted job must plan in full.
    """
    extras = _extras(metadata)
    compact = extras.get(PLANS_KEY)
    if compact is not None:
        if not compact_matches(compact, metadata):
            return None
        user_pd = user_planner_data(metadata)
        fqns = list(metadata.state_dict_metadata)
        plans = []
        for rank in range(len(compact["ranks"])):
            decoded = decode_rank(compact, metadata, rank, user_pd=user_pd, fqns=fqns)
            if decoded is None:
                return None
            plans.append(decoded[0])
        return plans
    plans = extras.get(ALL_LOCAL_PLANS_KEY)
    if not isinstance(plans, list) or not all(isinstance(p, SavePlan) for p in plans):
        return None
    return plans


def persisted_plan_ranks(metadata: Metadata) -> int | None:
    """How many ranks' plans ``metadata`` carries, without decoding them; ``None`` if none."""
    compact = read_compact(metadata)
    if compact is not None:
        return len(compact["ranks"])
    plans = _extras(metadata).get(ALL_LOCAL_PLANS_KEY)
    return len(plans) if isinstance(plans, list) else None


def read_compact(metadata: Metadata) -> dict[str, Any] | None:
    """The compact plans of ``metadata``, if it has them and they index into it."""
    compact = _extras(metadata).get(PLANS_KEY)
    return compact if compact is not None and compact_matches(compact, metadata) else None


def checksum_extras(storage_data: dict, checksums: dict[MetadataIndex, int]) -> dict[str, Any]:
    """What ``planner_data`` stores of ``checksums``: the crc32 array when every stored item has one, else the dict."""
    if not checksums:
        return {}
    ordered = [checksums.get(index) for index in storage_data]
    if None in ordered:
        return {CHECKSUMS_KEY: checksums}
    return {CRC32_ARRAY_KEY: pack_crc32s(ordered)}


def pack_crc32s(crcs: Sequence[int]) -> bytes:
    """``CRC32_ARRAY_KEY``'s bytes for ``crcs``, in ``storage_data``'s order."""
    return _pack(array("I", crcs))


def read_checksums(metadata: Metadata, where: str = ".metadata") -> dict[MetadataIndex, int]:
    """``MetadataIndex -> crc32`` of each stored item; empty for other tools' checkpoints.

    Raises ``CorruptCheckpointError`` (naming ``where``) when the crc32 array
    does not hold exactly one crc32 per item of ``storage_data``.
    """
    extras = _extras(metadata)
    packed = extras.get(CRC32_ARRAY_KEY)
    if packed is None:
        checksums = extras.get(CHECKSUMS_KEY)
        return checksums if isinstance(checksums, dict) else {}
    storage_data = metadata.storage_data
    if not isinstance(packed, bytes) or not isinstance(storage_data, dict) or len(packed) != 4 * len(storage_data):
        items = len(storage_data) if isinstance(storage_data, dict) else "no"
        size = f"{len(packed)} bytes" if isinstance(packed, bytes) else f"a {type(packed).__name__}"
        raise CorruptCheckpointError(
            f"{where}: its crc32 array ({size}) does not hold one crc32 for each of its {items} stored items"
        )
    return dict(zip(storage_data, _unpack("I", packed)))


def read_index_directory(metadata: Metadata) -> Any:
    """The resume index directory ``finish()`` stored (unchecked: see ``resume_index.directory``), or ``None``."""
    return _extras(metadata).get(INDEX_KEY)


def read_commit(metadata: Metadata) -> dict[str, Any] | None:
    """The commit record (``{"sequence": int, "parent": int | None}``) an ``AsyncCheckpointer`` stored, or ``None``."""
    record = _extras(metadata).get(COMMIT_KEY)
    return record if isinstance(record, dict) else None
