"""Where a checkpointer's steps live under its root, and how to list them.

Each step is a DCP checkpoint at ``{root}/step_{step:08d}/``; zero-padding
keeps lexical and numeric order the same in any object-store listing.
torchtitan names its steps ``{root}/step-{step}/``; a checkpointer can write
that form (``StepNaming.TORCHTITAN``), so that stock torchtitan resumes from
its steps and it from torchtitan's.  Listing recognizes both forms.  A step
counts as committed exactly when its ``.metadata`` object exists and is not
a collection's tombstone (``TOMBSTONE_SIZE``).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import re
import uuid

from .errors import ConditionalWriteError, ObjectNotFoundError, UnsupportedByStoreError
from .storage import MultipartUploadInfo, ObjectStore

logger = logging.getLogger(__name__)

METADATA_KEY = ".metadata"  # a DCP checkpoint exists exactly when this object does
# A Hugging Face export (export/hf.py) exists exactly when its index does; shards without one are a failed export's.
HF_INDEX_KEY = "model.safetensors.index.json"
HF_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# User metadata (x-amz-meta-*) of a committed .metadata: the nonce of the save
# that wrote it (= StorageMeta.save_id inside it; see commit).
NONCE_KEY = "dcpstore-save"
GENERATION_DIGITS = 16  # a shard name's generation: the first hex digits of its save's id, one length every save

# What a collection writes as a failed save's .metadata before it deletes the
# shards, so that a commit still in flight cannot land (see steps).  Unique
# per write (its ETag is), and of a fixed size far below any pickled Metadata
# (156 bytes at the least), so a listing tells it from a checkpoint.  It is
# never deleted by dcpstore: only a conditional write can replace a
# .metadata without racing a commit (a later save of the step replaces it).
TOMBSTONE_PREFIX = b"dcpstore gc: no checkpoint here "
TOMBSTONE_SIZE = len(TOMBSTONE_PREFIX) + 32


def generation(save_id: str) -> str:
    """The generation a save's shard names carry (``__{rank}_{generation}_{n}.distcp``): its id's first ``GENERATION_DIGITS`` hex digits."""
    return save_id[:GENERATION_DIGITS]


class StepNaming(enum.Enum):
    """How a step's prefix under the root is named."""

    DCPSTORE = "dcpstore"  # step_00001000: listings come back in step order
    TORCHTITAN = "torchtitan"  # step-1000: torchtitan's CheckpointManager's folders

    def prefix(self, step: int) -> str:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return f"step_{step:08d}" if self is StepNaming.DCPSTORE else f"step-{step}"

    def url(self, root: str, step: int) -> str:
        """Step ``step``'s URL under ``root``."""
        return f"{root}/{self.prefix(step)}"

    def parse(self, prefix: str) -> int | None:
        """The step that ``prefix`` names in this form, or ``None``."""
        match = _STEP_RES[self].match(prefix.strip("/"))
        return int(match.group(1)) if match else None


_STEP_RES = {StepNaming.DCPSTORE: re.compile(r"^step_(\d{8,})$"), StepNaming.TORCHTITAN: re.compile(r"^step-(\d+)$")}


def parse_step(prefix: str, naming: StepNaming | None = None) -> int | None:
    """The step that ``prefix`` names in ``naming``'s form (default: either form), or ``None``."""
    for form in StepNaming if naming is None else (naming,):
        step = form.parse(prefix)
        if step is not None:
            return step
    return None


@dataclasses.dataclass(frozen=True)
class StepInfo:
    step: int
    prefix: str
    committed: bool
    size: int  # bytes in all objects of the step
    objects: int
    last_modified: float | None  # newest object's time
    keys: tuple[str, ...] = ()  # the step's objects as listed, relative to its prefix
    committed_at: float | None = None  # its .metadata's time, if committed


def list_steps(store: ObjectStore, naming: StepNaming | None = None, objects: list | None = None) -> list[StepInfo]:
    """Every step under ``store``'s root (named in ``naming``'s form, if given), committed or not, oldest first.

    ``objects``: the root's listing, if the caller has it already.
    """
    grouped: dict[str, list] = {}
    for obj in store.list() if objects is None else objects:
        head, _, rest = obj.key.partition("/")
        if rest and parse_step(head, naming) is not None:
            grouped.setdefault(head, []).append((rest, obj))
    steps = []
    for prefix, objects in grouped.items():
        times = [o.last_modified for _, o in objects if o.last_modified is not None]
        metadata = next((o for name, o in objects if name == METADATA_KEY and not is_tombstone(o.size)), None)
        steps.append(
            StepInfo(
                step=parse_step(prefix),
                prefix=prefix,
                committed=metadata is not None,
                size=sum(o.size for _, o in objects),
                objects=len(objects),
                last_modified=max(times) if times else None,
                keys=tuple(name for name, _ in objects),
                committed_at=metadata.last_modified if metadata is not None else None,
            )
        )
    return sorted(steps, key=lambda s: (s.step, s.prefix))


def is_tombstone(size: int | None) -> bool:
    """Whether a ``.metadata`` of ``size`` bytes is a collection's tombstone, not a checkpoint."""
    return size == TOMBSTONE_SIZE


def holds_tombstone(raw) -> bool:
    """Whether the bytes of a ``.metadata`` are a collection's tombstone: its size and its prefix, where the bytes are at hand."""
    return is_tombstone(len(raw)) and bytes(raw[: len(TOMBSTONE_PREFIX)]) == TOMBSTONE_PREFIX


def _new_tombstone() -> bytes:
    """A tombstone's bytes: unique, so its ETag is (a collection replaces one by it)."""
    return TOMBSTONE_PREFIX + uuid.uuid4().hex.encode()


def destination(store: ObjectStore) -> tuple[bool, str | None]:
    """Whether a checkpoint is committed at ``store``'s ``.metadata``, and the ETag of the tombstone there if it holds one.

    What a save reads before it writes its shards: its commit replaces
    exactly that tombstone (``put(..., if_match=)``), so a collection that
    buries the step again meanwhile (a new tombstone) refuses it.  Where a
    HEAD shows no ETag (``memory://``, ``file://``), size and tag come from
    one read of the object, so they describe the same object.
    """
    try:
        head = store.head(METADATA_KEY)
        if head.etag is not None:
            return (False, head.etag) if is_tombstone(head.size) else (True, None)
        if not is_tombstone(head.size):
            return True, None
        raw, etag = store.get_with_etag(METADATA_KEY)
    except ObjectNotFoundError:
        return False, None
    if holds_tombstone(raw):
        return False, etag
    return True, None


def lay_tombstone(store: ObjectStore) -> bool:
    """Write a tombstone as ``store``'s ``.metadata`` unless a checkpoint is there; whether one is there now.

    Conditional both ways: created only where no ``.metadata`` exists, or
    in place of an earlier tombstone, by its ETag.  Either way a commit
    that has not landed yet is refused from now on: its PUT is conditional
    on no ``.metadata`` (or on the tombstone it read before its shards).
    """
    try:
        store.put(METADATA_KEY, _new_tombstone(), if_none_match=True)
        return True
    except ConditionalWriteError:
        pass
    etag = destination(store)[1]
    if etag is None:
        return False  # a checkpoint committed there (or the object went meanwhile: left to the next collection)
    try:
        store.put(METADATA_KEY, _new_tombstone(), if_match=etag)
        return True
    except ConditionalWriteError:
        return False  # replaced meanwhile: by a commit, or by another collection that deletes the step itself


def written_by_dcp(key: str) -> bool:
    """Whether ``key`` (relative to its step) is what a DCP writer leaves: shards, ``.metadata*``, dcpstore's own objects.

    By name, not by the ``storage_data`` of ``.metadata``: torch's writers
    and dcpstore's name every shard ``*.distcp``, and reading ``.metadata``
    to delete a step would cost a whole parse of it (minutes at thousands
    of ranks).  A shard another writer named otherwise is left in place,
    with the user's files: never deleted by mistake.
    """
    name = key.rpartition("/")[2]
    return name.endswith(".distcp") or name.startswith((METADATA_KEY, ".dcpstore-"))


def not_written_by_dcp(keys) -> list[str]:
    """Those of ``keys`` that no DCP writer wrote (``written_by_dcp``): the user's files, which dcpstore never deletes."""
    return [k for k in keys if not written_by_dcp(k)]


def delete_committed_step(store: ObjectStore, prefix: str) -> list[str]:
    """Delete a committed step's checkpoint: ``.metadata`` first, so it stops being one before its shards go.

    Only what a DCP writer writes goes (``written_by_dcp``): a Hugging Face
    export or an evaluation's results saved into the step's folder stay,
    with a warning naming them.  Returns their keys, relative to the step.
    """
    child = store.child(prefix)
    try:
        child.delete([METADATA_KEY])
        keys = [o.key for o in child.list()]
        child.delete([k for k in keys if written_by_dcp(k)])
        others = not_written_by_dcp(keys)
        if others:
            logger.warning(
                "%s: deleted the checkpoint; left %d object(s) no DCP writer wrote (%s); delete the folder to remove them",
                child.url, len(others), ", ".join(others[:5]) + (", ..." if len(others) > 5 else ""),
            )
        return others
    finally:
        child.close()


def open_uploads(store: ObjectStore) -> list[MultipartUploadInfo]:
    """Open multipart uploads under ``store``; empty, with a warning, where the server cannot list them."""
    try:
        return store.list_multipart_uploads()
    except UnsupportedByStoreError as e:
        logger.warning("%s: open multipart uploads could not be listed (%s)", store.url, e)
        return []


def delete_incomplete_step(store: ObjectStore, step: StepInfo) -> bool:
    """Delete the objects ``plan_gc`` listed for an incomplete step, unless it has committed since.

    A tombstone goes in place of ``.metadata`` first (``lay_tombstone``), and
    only then do the shards go: a commit that listed its shards before they
    were deleted still cannot land, and one that lands first keeps the
    collection from deleting anything.  The tombstone stays (see
    ``TOMBSTONE_PREFIX``).  Only the listed objects go: shards a new save
    wrote after the listing are left alone.
    """
    child = store.child(step.prefix)
    try:
        if not lay_tombstone(child):
            logger.warning("%s: not deleted: it was committed after it was listed as incomplete", child.url)
            return False
        child.delete([k for k in step.keys if k != METADATA_KEY])
        return True
    finally:
        child.close()


def holds_only_a_tombstone(step: StepInfo) -> bool:
    """Whether ``step`` is a failed save a collection cleaned: nothing left but its tombstone."""
    return not step.committed and step.keys == (METADATA_KEY,)


def committed_steps(store: ObjectStore, naming: StepNaming | None = None) -> list[StepInfo]:
    """The committed steps under ``store``'s root (only those named in ``naming``'s form, if given), lowest first."""
    return [s for s in list_steps(store, naming) if s.committed]
