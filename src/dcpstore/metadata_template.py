"""A committed ``.metadata``'s bytes as the template of the next commit of the same structure.

torch's ``.metadata`` is one pickled ``Metadata`` that lists every item of
every rank: W x N entries (about 1.4 GB at 4,096 ranks x 2,000 items, see
docs/scale.md).  Building those objects and pickling them costs the
coordinator minutes of Python per save at that scale.  Yet between two saves
of one structure (the plans reused) only a few values change, and dcpstore
lays each of them out so that its pickled width does not change:

* the save's nonce: in every shard name (``__{rank}_{nonce}_{n}.distcp``,
  see ``writer``), in ``storage_meta.save_id`` and in the resume index's
  pointer;
* the step's URL (``storage_meta.checkpoint_id``, while the step keeps its
  number of digits) and the commit record's ints (``steps.CommitRecord``);
* the crc32s: one fixed-width array in ``storage_data``'s order
  (``planner_data.CRC32_ARRAY_KEY``);
* a bytes item's offset and length (bytes items go last in their shard, so
  a step counter whose pickled size changes moves nothing else).

A ``Template`` is the pickled bytes of one save and where each of those
values lies in them (its ``Slot``\\ s).  ``patch`` writes new values over
the old ones in place: O(bytes + slots), no Python object per item, and the
result is byte for byte what ``pickle.dumps`` gives for the same content,
because every slot keeps its width.  A value of another width (an int that
needs another opcode, a step with one more digit) cannot be patched:
``patch`` raises ``Unpatchable`` and that save takes the full path, which
builds a new template.

Finding the slots takes no pickler of our own: ``build`` pickles the
``Metadata`` twice, as it is and with every slot's value changed at the
same width (a str's characters flipped in their low bit, an int's low byte
XORed with a constant of its own, a bytes' bits inverted).  The bytes that
differ are exactly the slots.  They are met in the order the pickler walks
the object (dicts, lists and dataclass states in iteration order), which is
the order ``dcpstore_slots`` lists them in; a str or bytes object reached
from several places is pickled once (memoized) and is one slot.  A template
is kept only if patching it with the changed values reproduces the second
pickle exactly, so a wrong order or a width we did not foresee costs the
template, never a wrong ``.metadata``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pickle
import zlib
from typing import Any, Callable

import numpy
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from . import planner_data
from .layout import generation as shard_generation

PROTOCOL = pickle.HIGHEST_PROTOCOL  # what writer.finish pickles .metadata with
_DIFF_CHUNK = 16 << 20  # bytes compared at a time: the build's memory beyond its two pickles


_KINDS = ("str", "int", "bytes")  # a slot's kind, as a stored map codes it
_MAX_MAP_BYTES = 256 << 20  # a stored map, inflated: 15 bytes a slot
_MAX_MAP_HEADER = 1 << 20  # its JSON header: the hashes, the size and the few role names


class Unpatchable(ValueError):
    """A new value does not fit its slot (another width or type): this save takes the full path."""


@dataclasses.dataclass(frozen=True)
class Slot:
    """A value in the template's bytes: ``kind`` is ``"str"`` (its UTF-8), ``"int"`` (pickle's payload) or ``"bytes"``."""

    role: str  # what the value is, for whoever computes the next one (see dcpstore_slots)
    kind: str
    position: int
    width: int


@dataclasses.dataclass
class _Value:
    """One slot's value as the walk finds it, and how to put another in every place that holds it."""

    role: str
    value: Any
    places: list[tuple[Any, Any]]  # (container, key): a dict or list and its key, or an object and its attribute name

    def set(self, value: Any) -> None:
        for container, key in self.places:
            if isinstance(container, (dict, list)):
                container[key] = value
            else:
                setattr(container, key, value)


class Template:
    """The bytes of one ``.metadata`` and its slots; ``patch`` turns them into the next save's."""

    def __init__(self, raw: bytearray, slots: list[Slot], values: list[Any]):
        self.raw = raw
        self.slots = slots
        self.values = values  # what each slot holds now

    def patch(self, values: list[Any]) -> bytearray:
        """Write ``values`` (one per slot, in order) over the slots, in place; the bytes, now the new ``.metadata``.

        Raises ``Unpatchable`` before writing anything when a value does not
        fit its slot.
        """
        if len(values) != len(self.slots):
            raise Unpatchable(f"{len(values)} values for {len(self.slots)} slots")
        encoded = [_encode(slot, value) for slot, value in zip(self.slots, values)]
        for slot, payload in zip(self.slots, encoded):
            self.raw[slot.position : slot.position + slot.width] = payload
        self.values = list(values)
        return self.raw

    def roles(self, prefix: str) -> list[int]:
        """The indices of the slots whose role starts with ``prefix``, in order."""
        return [i for i, slot in enumerate(self.slots) if slot.role.startswith(prefix)]


def build(metadata: Any, found: list[_Value], raw: bytes | None = None) -> Template | None:
    """The template of ``metadata`` with the slots ``found`` (in pickling order); ``None`` if they cannot be located exactly.

    Pickles ``metadata`` twice (see the module docstring), or once when
    ``raw`` is its pickle already; ``metadata`` is left as it was.
    """
    if not found or any(_kind(v.value) is None for v in found):
        return None
    first = raw if raw is not None else pickle.dumps(metadata, protocol=PROTOCOL)
    changed = [_changed(v.value, i) for i, v in enumerate(found)]
    try:
        for v, new in zip(found, changed):
            v.set(new)
        second = pickle.dumps(metadata, protocol=PROTOCOL)
    finally:
        for v in found:
            v.set(v.value)
    if len(second) != len(first):
        return None
    runs = _differing_runs(first, second)
    if len(runs) != len(found):
        return None
    slots = []
    for (start, end), v in zip(runs, found):
        slot = _slot(v.role, v.value, first, start, end)
        if slot is None:
            return None
        slots.append(slot)
    template = Template(bytearray(first), slots, [v.value for v in found])
    del first  # at 1.4 GB, the build holds two pickles and the template at most
    try:
        proof = template.patch(changed)
        exact = proof == second
        template.patch([v.value for v in found])
    except Unpatchable:
        return None
    return template if exact else None


def _kind(value: Any) -> str | None:
    if type(value) is int:
        return "int"
    if type(value) is str and value and value.isascii():
        return "str"
    if type(value) is bytes and value:
        return "bytes"
    return None  # None, an empty or non-ASCII str, another type: no fixed width to patch


def _changed(value: Any, i: int) -> Any:
    """``value`` changed in every byte of its pickled payload (an int: in its first), at the same width."""
    if type(value) is int:
        return value ^ (i % 255 + 1)  # a low byte of its own; the opcode and width stay (see _int_payload)
    if type(value) is str:
        return "".join(chr(ord(c) ^ 1) for c in value)
    return (numpy.frombuffer(value, numpy.uint8) ^ 0xFF).tobytes()


def _int_payload(value: int) -> tuple[bytes, bytes]:
    """How pickle (protocol >= 2) writes ``value``: its opcode (with LONG1's length byte) and its little-endian payload."""
    if 0 <= value <= 0xFF:
        return pickle.BININT1, value.to_bytes(1, "little")
    if 0 <= value <= 0xFFFF:
        return pickle.BININT2, value.to_bytes(2, "little")
    if -0x80000000 <= value <= 0x7FFFFFFF:
        return pickle.BININT, value.to_bytes(4, "little", signed=True)
    payload = pickle.encode_long(value)
    if len(payload) > 255:
        return b"", b""  # LONG4: never a slot
    return pickle.LONG1 + bytes([len(payload)]), payload


def _encode(slot: Slot, value: Any) -> bytes:
    if slot.kind == "int":
        if type(value) is not int:
            raise Unpatchable(f"{slot.role}: {type(value).__name__} where an int was")
        _, payload = _int_payload(value)  # a payload's width decides its opcode: 1 K, 2 M, 4 J, n >= 5 LONG1 n
        width_ok = bool(payload) and len(payload) == slot.width
    elif slot.kind == "str":
        if type(value) is not str:
            raise Unpatchable(f"{slot.role}: {type(value).__name__} where a str was")
        payload = value.encode("utf-8", "surrogatepass")
        width_ok = len(payload) == slot.width
    else:
        payload = value if isinstance(value, (bytes, bytearray)) else bytes(value)
        width_ok = len(payload) == slot.width
    if not width_ok:
        raise Unpatchable(f"{slot.role}: {len(payload)} bytes where {slot.width} were")
    return payload


def _slot(role: str, value: Any, raw: bytes, start: int, end: int) -> Slot | None:
    """The slot of ``value`` whose differing bytes are ``raw[start:end]``, checked against how pickle writes it."""
    kind = _kind(value)
    if kind == "int":
        opcode, payload = _int_payload(value)
        if end - start != 1 or not opcode or raw[start - len(opcode) : start] != opcode:
            return None
        if raw[start : start + len(payload)] != payload:
            return None
        return Slot(role, kind, start, len(payload))
    payload = value.encode("utf-8") if kind == "str" else value
    if end - start != len(payload) or raw[start:end] != payload:
        return None
    return Slot(role, kind, start, len(payload))


def _decode(slot: Slot, raw: bytes | bytearray) -> Any:
    """The value ``slot`` holds in ``raw``: its UTF-8, its little-endian int (pickle's: unsigned in 1 and 2 bytes), or its bytes."""
    payload = bytes(raw[slot.position : slot.position + slot.width])
    if slot.kind == "str":
        return payload.decode("utf-8", "surrogatepass")
    if slot.kind == "int":
        return int.from_bytes(payload, "little", signed=slot.width not in (1, 2))
    return payload


def _names_digest(slots: list[Slot], values: list[Any], generation: str) -> str:
    """SHA-256 of the shard names in ``values``, each with its save's ``generation`` left out: what every patch keeps."""
    digest = hashlib.sha256()
    for slot, value in zip(slots, values):
        if slot.role == "name":
            digest.update(str(value).replace(f"_{generation}_", "_*_", 1).encode("utf-8", "surrogatepass") + b"\n")
    return digest.hexdigest()


def _skeleton_digest(raw: bytes | bytearray, slots: list[Slot]) -> str:
    """SHA-256 of ``raw`` with every slot's bytes zeroed: what patching never changes."""
    digest = hashlib.sha256()
    view = memoryview(raw)
    at = 0
    for slot in slots:
        digest.update(view[at : slot.position])
        digest.update(bytes(slot.width))
        at = slot.position + slot.width
    digest.update(view[at:])
    return digest.hexdigest()


def _differing_runs(a: bytes, b: bytes) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges where ``a`` and ``b`` (of one length) differ, compared a chunk at a time."""
    x, y = numpy.frombuffer(a, numpy.uint8), numpy.frombuffer(b, numpy.uint8)
    starts: list[int] = []
    ends: list[int] = []
    previous = numpy.zeros(1, numpy.int8)
    for lo in range(0, len(x), _DIFF_CHUNK):
        differs = (x[lo : lo + _DIFF_CHUNK] != y[lo : lo + _DIFF_CHUNK]).view(numpy.int8)
        edges = numpy.diff(differs, prepend=previous)
        starts.extend((numpy.flatnonzero(edges == 1) + lo).tolist())
        ends.extend((numpy.flatnonzero(edges == -1) + lo).tolist())
        previous = differs[-1:]
    if previous[0]:
        ends.append(len(x))
    return list(zip(starts, ends))


# -- dcpstore's slots -----------------------------------------------------------------


class _Walk:
    """Collects slots in pickling order; a str or bytes object met again is the same slot (pickle memoizes it)."""

    def __init__(self):
        self.found: list[_Value] = []
        self._by_id: dict[int, _Value] = {}

    def add(self, role: str, container: Any, key: Any) -> None:
        value = container[key] if isinstance(container, (dict, list)) else getattr(container, key)
        if type(value) in (str, bytes):
            seen = self._by_id.get(id(value))
            if seen is not None:
                seen.places.append((container, key))
                return
        entry = _Value(role, value, [(container, key)])
        if type(value) in (str, bytes):
            self._by_id[id(value)] = entry
        self.found.append(entry)


def dcpstore_slots(metadata: Any) -> list[_Value]:
    """The values of a dcpstore ``.metadata`` that change from save to save of one structure, in pickling order.

    A bytes item's offset and length are among them (they may change).
    ``metadata``'s fields are pickled in the order of
    its ``__dict__``: ``planner_data`` (dcpstore's entries: the commit
    record, the crc32 array, the resume index's pointer) before
    ``storage_data`` (each shard name where first met, then a bytes item's
    offset and length) before ``storage_meta``.
    """
    walk = _Walk()
    fields = {
        "planner_data": lambda: _planner_data_slots(walk, metadata.planner_data),
        "storage_data": lambda: _storage_data_slots(walk, metadata.storage_data, _bytes_item_test(metadata)),
        "storage_meta": lambda: _storage_meta_slots(walk, metadata.storage_meta),
    }
    for name in vars(metadata):
        if name in fields:
            fields[name]()
    return walk.found


def _planner_data_slots(walk: _Walk, pd: Any) -> None:
    if not isinstance(pd, dict):
        return
    for key, value in pd.items():
        if key == planner_data.COMMIT_KEY and isinstance(value, dict):
            for field in value:
                walk.add(f"commit.{field}", value, field)
        elif key == planner_data.CRC32_ARRAY_KEY:
            walk.add("crc32", pd, key)
        elif key == planner_data.INDEX_KEY and isinstance(value, dict):
            _nested(walk, "index", value)


def _nested(walk: _Walk, role: str, value: dict | list) -> None:
    for key in value if isinstance(value, dict) else range(len(value)):
        item = value[key]
        if isinstance(item, (dict, list)):
            _nested(walk, f"{role}.{key}", item)
        else:
            walk.add(f"{role}.{key}", value, key)


def _storage_data_slots(walk: _Walk, storage_data: dict, bytes_items: Callable[[Any], bool]) -> None:
    for index, info in storage_data.items():
        walk.add("name", info, "relative_path")
        if bytes_items(index):
            walk.add("bytes.offset", info, "offset")
            walk.add("bytes.length", info, "length")


def _storage_meta_slots(walk: _Walk, meta: Any) -> None:
    if meta is not None:
        walk.add("checkpoint_id", meta, "checkpoint_id")
        walk.add("save_id", meta, "save_id")


# -- a commit's template --------------------------------------------------------------


class CommitTemplate:
    """The last full commit's ``.metadata`` template, and what a later save sends to be patched into it.

    A later save of the structure is patched only when every rank wrote
    exactly what it wrote for the template: the same items, in the same
    shards, every tensor at the same offset and length.  Each rank checks
    that itself against its own write results (``written_layout``) and says
    so in a tensor collective, with its values: its items' crc32s (with
    ``checksums``) then its bytes items' offsets and lengths, in the order of
    its write results (``rank_values``).  The coordinator needs nothing per
    item: ``counts`` says how many values each rank sends.  So a patched
    ``.metadata`` names no byte that save did not write and misses none it
    did; a bytes item may change its offset and length (it is last in its
    shard), within their pickled widths.
    """

    def __init__(self, template: Template, metadata: Any, counts: list[tuple[int, int]], generation: str,
                 checksums: bool, index: Any, template_id: int):
        self.template = template
        self.metadata = metadata  # the Metadata object the template pickles: a save of another one is another structure
        self.counts = counts  # per rank: (items it wrote, of them bytes items)
        self.generation = generation
        self.checksums = checksums  # whether the ranks send crc32s
        self.index = index  # the resume index's resume_index.Layout, or None
        self.template_id = template_id  # the save that made it (its nonce): what the ranks' layouts must come from

    @classmethod
    def of_save(cls, metadata: Any, raw: bytes, results: list, generation: str, index: Any, template_id: int) -> "CommitTemplate | None":
        """The template of a save just pickled as ``raw`` by the full path; ``None`` if it cannot be patched later."""
        template = build(metadata, dcpstore_slots(metadata), raw)
        if template is None:
            return None
        if bool(template.roles("index.")) != (index is not None):
            return None  # an index the template cannot write, or a pointer it cannot fill
        is_bytes = _bytes_item_test(metadata)
        counts = [(len(rank_results), sum(1 for wr in rank_results if is_bytes(wr.index))) for rank_results in results]
        checksums = bool(template.roles("crc32"))
        return cls(template, metadata, counts, generation, checksums, index, template_id)

    def width(self, rank: int) -> int:
        """How many values rank ``rank`` sends (``rank_values``)."""
        items, bytes_items = self.counts[rank]
        return items * self.checksums + 2 * bytes_items

    def patched(self, values: numpy.ndarray, generation: str, record: dict, url: str, save_id: str,
                pointer: dict | None) -> bytearray | None:
        """The ``.metadata`` of a save of the same structure, patched in place; ``None`` when it must take the full path.

        ``values``: one row per rank, each rank's ``rank_values`` (padded);
        ``record``: the save's commit record (``planner_data.COMMIT_KEY``);
        ``url`` and ``save_id``: its ``storage_meta``; ``pointer``: its
        resume index's.  Once this returns bytes, the template holds them.
        """
        crcs, extents = self.split(values)
        moved = iter(extents.reshape(-1).tolist())
        out = []
        for slot, old in zip(self.template.slots, self.template.values):
            role = slot.role
            if role == "name":
                if f"_{self.generation}_" not in old:
                    return None  # a shard not named by this writer's generations
                out.append(old.replace(f"_{self.generation}_", f"_{generation}_", 1))
            elif role == "crc32":
                out.append(crcs.astype("<u4").tobytes())
            elif role in ("bytes.offset", "bytes.length"):
                out.append(next(moved, None))  # None (no such item): Unpatchable below
            elif role.startswith("commit.") and role[len("commit."):] in record:
                out.append(record[role[len("commit."):]])
            elif role == "checkpoint_id":
                out.append(url)
            elif role == "save_id":
                out.append(save_id)
            elif role.startswith("index.") and pointer is not None:
                out.append(_field(pointer, role[len("index."):]))
            else:
                return None
        try:
            raw = self.template.patch(out)
        except Unpatchable:
            return None
        self.generation = generation
        return raw

    def repoint(self, pointer: dict) -> bytearray | None:
        """The template's bytes with the resume index's (stored) ``pointer`` in its slots; ``None`` if a value does not fit."""
        values = [
            _field(pointer, slot.role[len("index."):]) if slot.role.startswith("index.") else old
            for slot, old in zip(self.template.slots, self.template.values)
        ]
        try:
            return self.template.patch(values)
        except Unpatchable:
            return None

    def split(self, values: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
        """``values``' crc32s (``storage_data``'s order) and bytes items' ``[offset, length]`` rows, every rank's in turn."""
        items = {n for n, _ in self.counts}
        bytes_items = {b for _, b in self.counts}
        if len(items) == 1 and len(bytes_items) == 1:  # the usual: every rank writes as many (no Python per rank)
            k, b = next(iter(items)) * self.checksums, next(iter(bytes_items))
            return values[:, :k].reshape(-1), values[:, k : k + 2 * b].reshape(-1, 2)
        crcs, extents = [], []
        for row, (n, b) in zip(values, self.counts):
            k = n * self.checksums
            crcs.append(row[:k])
            extents.append(row[k : k + 2 * b])
        return numpy.concatenate(crcs), numpy.concatenate(extents).reshape(-1, 2)

    def stored_map(self) -> bytes:
        """The template's map, to keep beside the ``.metadata`` it was made from (in the resume index): ``from_stored`` reads it.

        Where each slot lies and what it holds, and the SHA-256 of the bytes
        with every slot zeroed (the skeleton, which no patch changes): a
        ``.metadata`` whose skeleton hashes the same is this template patched.
        """
        slots = self.template.slots
        roles = sorted({slot.role for slot in slots})
        code = {role: i for i, role in enumerate(roles)}
        header = json.dumps(
            {"skeleton": _skeleton_digest(self.template.raw, slots), "size": len(self.template.raw), "roles": roles,
             "slots": len(slots), "names": _names_digest(slots, self.template.values, self.generation)},
            separators=(",", ":"),
        ).encode()
        arrays = b"".join(
            numpy.asarray(column, dtype).tobytes()
            for column, dtype in (
                ([slot.position for slot in slots], "<u8"),
                ([slot.width for slot in slots], "<u4"),
                ([_KINDS.index(slot.kind) for slot in slots], "<u1"),
                ([code[slot.role] for slot in slots], "<u2"),
            )
        )
        return zlib.compress(len(header).to_bytes(4, "little") + header + arrays, 1)

    @classmethod
    def from_stored(cls, raw: bytes, stored: bytes, metadata: Any, counts: list[tuple[int, int]], checksums: bool,
                    index: Any, template_id: int) -> "CommitTemplate":
        """The template of a committed ``.metadata`` (``raw``) from its map (``stored_map``); raises ``Unpatchable`` unless it is exactly that.

        ``metadata`` stands for the structure (what the plan cache hands
        later saves); ``counts``, ``checksums``, ``index`` and
        ``template_id`` as the save that made the map had them (its resume
        index says).  No ``Metadata`` is built: memory is the bytes.  Every
        byte is checked: those outside the slots by the skeleton's hash, the
        shard names (the only slots whose values a patch carries on) by a
        hash of their own; the other slots are written anew by every patch.
        """
        try:
            inflater = zlib.decompressobj()
            text = inflater.decompress(stored, _MAX_MAP_BYTES)
            if inflater.unconsumed_tail:
                raise ValueError(f"it inflates past {_MAX_MAP_BYTES} bytes")
            if not inflater.eof:
                raise ValueError("it is cut short")
            size = int.from_bytes(text[:4], "little")
            if size > _MAX_MAP_HEADER:
                raise ValueError(f"its header is {size} bytes")
            header = json.loads(text[4 : 4 + size])
            n, roles = header["slots"], header["roles"]
            body = memoryview(text)[4 + size :]
            if not (isinstance(n, int) and 0 < n and len(body) == 15 * n and isinstance(roles, list)):
                raise ValueError("its arrays do not hold its slots")
            positions = numpy.frombuffer(body, "<u8", n, 0)
            widths = numpy.frombuffer(body, "<u4", n, 8 * n)
            kinds = numpy.frombuffer(body, "<u1", n, 12 * n)
            codes = numpy.frombuffer(body, "<u2", n, 13 * n)
            ends = positions + widths
            if header["size"] != len(raw) or (widths == 0).any() or ends[-1] > len(raw) or (positions[1:] < ends[:-1]).any():
                raise ValueError("its slots do not lie in this .metadata, one after the other")
            if (kinds >= len(_KINDS)).any() or (codes >= len(roles)).any() or not all(isinstance(r, str) for r in roles):
                raise ValueError("a slot's kind or role is unknown")
            slots = [
                Slot(roles[c], _KINDS[k], p, w)
                for c, k, p, w in zip(codes.tolist(), kinds.tolist(), positions.tolist(), widths.tolist())
            ]
        except (ValueError, KeyError, TypeError, IndexError, zlib.error) as e:
            raise Unpatchable(f"the commit template's map is malformed ({e})") from None
        if _skeleton_digest(raw, slots) != header["skeleton"]:
            raise Unpatchable("this .metadata is not the commit template's: its bytes outside the slots differ")
        owned = bytearray(raw)
        try:
            values = [_decode(slot, owned) for slot in slots]
        except UnicodeDecodeError as e:
            raise Unpatchable(f"a slot of this .metadata does not hold what the map says ({e})") from None
        save_ids = [value for slot, value in zip(slots, values) if slot.role in ("save_id", "index.save_id")]
        if len(save_ids) != 1 or not isinstance(save_ids[0], str):
            raise Unpatchable("the commit template's map has no save id: its shard names' generation is unknown")
        generation = shard_generation(save_ids[0])
        if _names_digest(slots, values, generation) != header.get("names"):
            raise Unpatchable("this .metadata names other shards than the commit template's")
        return cls(Template(owned, slots, values), metadata, counts, generation, checksums, index, template_id)

    def names(self) -> set[str]:
        """The shard objects the template's ``.metadata`` names now."""
        return {value for slot, value in zip(self.template.slots, self.template.values) if slot.role == "name"}


def _field(pointer: dict, path: str) -> Any:
    """``pointer["directory"][2]`` for ``"directory.2"``: the value a role names."""
    value: Any = pointer
    for key in path.split("."):
        value = value[int(key)] if isinstance(value, list) else value.get(key)
    return value


def written_layout(results: list, generation: str) -> list[tuple]:
    """What a rank's write results fix for a template: each item, its shard (without the generation) and, for a tensor, where.

    ``results``: ``ChecksummedWriteResult``\\ s (their ``bytes_item`` says
    which items may move within their shard).
    """
    out = []
    for wr in results:
        info = wr.storage_data
        shard = info.relative_path.replace(f"_{generation}_", "_", 1)
        bytes_item = getattr(wr, "bytes_item", False)
        out.append((wr.index, shard, bytes_item) if bytes_item else (wr.index, shard, info.offset, info.length))
    return out


def rank_values(results: list, checksums: bool) -> numpy.ndarray:
    """What a rank sends of a patched save: its items' crc32s (with ``checksums``), then its bytes items' offsets and lengths."""
    crcs = [wr.crc32 for wr in results] if checksums else []
    extents = [n for wr in results if getattr(wr, "bytes_item", False) for n in (wr.storage_data.offset, wr.storage_data.length)]
    return numpy.asarray(crcs + extents, numpy.int64)


def _bytes_item_test(metadata: Any) -> Callable[[Any], bool]:
    sdm = metadata.state_dict_metadata
    return lambda index: isinstance(sdm.get(index.fqn), BytesStorageMetadata)
