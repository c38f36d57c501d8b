"""Where a checkpointer's steps live under its root, and how to list them.

Each step is a DCP checkpoint at ``{root}/step_{step:08d}/``; zero-padding
keeps lexical and numeric order the same in any object-store listing.
torchtitan names its steps ``{root}/step-{step}/``; a checkpointer can write
that form (``StepNaming.TORCHTITAN``), so that stock torchtitan resumes from
its steps and it from torchtitan's.  Listing recognizes both forms.  A step
counts as committed exactly when its ``.metadata`` object exists and is not
a collection's tombstone (``Tombstone``).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import re
import uuid

from .errors import ObjectNotFoundError, UnsupportedByStoreError
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

# What a collection writes as a failed save's .metadata (see collection): a
# mark, laid before anything of the step is deleted, so that a commit still
# in flight cannot land unless it replaces exactly that mark; then, as the
# step's objects go, the sweep's tombstone in place of the mark, which no
# commit replaces.  Unique per write (its ETag is), and of fixed sizes far
# below any pickled Metadata (156 bytes at the least), so a listing tells
# each from the other and from a checkpoint.
TOMBSTONE_PREFIX = b"dcpstore gc: no checkpoint here "
TOMBSTONE_SIZE = len(TOMBSTONE_PREFIX) + 32  # a mark
SWEPT_PREFIX = b"dcpstore gc: swept; no checkpoint here "
SWEPT_SIZE = len(SWEPT_PREFIX) + 32


class Tombstone(enum.Enum):
    """What a collection left as a step's ``.metadata``."""

    MARKED = TOMBSTONE_PREFIX  # a failed save's debris, to be swept a grace later; a save that finds it may replace it
    SWEPT = SWEPT_PREFIX  # its objects deleted (or being deleted); removed a grace later

    @classmethod
    def of_size(cls, size: int | None) -> "Tombstone | None":
        """The tombstone a ``.metadata`` of ``size`` bytes is, if any."""
        return {TOMBSTONE_SIZE: cls.MARKED, SWEPT_SIZE: cls.SWEPT}.get(size)

    @classmethod
    def of_bytes(cls, raw) -> "Tombstone | None":
        """The tombstone the bytes of a ``.metadata`` are, if any: its size and its prefix."""
        kind = cls.of_size(len(raw))
        return kind if kind is not None and bytes(raw[: len(kind.value)]) == kind.value else None

    def new(self) -> bytes:
        """Its bytes: unique, so its ETag is (a collection replaces one by its ETag)."""
        return self.value + uuid.uuid4().hex.encode()


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
    etags: tuple[str | None, ...] = ()  # each listed object's ETag, in the order of ``keys``
    tombstone: "Tombstone | None" = None  # what a collection left as its .metadata, if anything

    def listed(self, keys=None) -> dict[str, str | None]:
        """The step's objects as listed (of ``keys`` only, if given): key -> ETag, what a deciding delete holds each to."""
        found = dict(zip(self.keys, self.etags or (None,) * len(self.keys)))
        return found if keys is None else {k: found[k] for k in keys if k in found}


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
        listed_metadata = next((o for name, o in objects if name == METADATA_KEY), None)
        tombstone = Tombstone.of_size(listed_metadata.size) if listed_metadata is not None else None
        metadata = listed_metadata if tombstone is None else None
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
                etags=tuple(o.etag for _, o in objects),
                tombstone=tombstone,
            )
        )
    return sorted(steps, key=lambda s: (s.step, s.prefix))


def is_tombstone(size: int | None) -> bool:
    """Whether a ``.metadata`` of ``size`` bytes is a collection's tombstone (either kind), not a checkpoint."""
    return Tombstone.of_size(size) is not None


def holds_tombstone(raw) -> bool:
    """Whether the bytes of a ``.metadata`` are a collection's tombstone, where the bytes are at hand."""
    return Tombstone.of_bytes(raw) is not None


def metadata_state(store: ObjectStore) -> tuple[bool, Tombstone | None, str | None]:
    """What ``store``'s ``.metadata`` is: whether a checkpoint is committed there, the tombstone there if any, and that tombstone's ETag.

    One HEAD.  Where a HEAD shows no ETag (``memory://``, ``file://``),
    size and tag come from one read of the object, so they describe the
    same object.
    """
    try:
        head = store.head(METADATA_KEY)
        kind = Tombstone.of_size(head.size)
        if kind is None:
            return True, None, None
        if head.etag is not None:
            return False, kind, head.etag
        raw, etag = store.get_with_etag(METADATA_KEY)
    except ObjectNotFoundError:
        return False, None, None
    kind = Tombstone.of_bytes(raw)
    return (False, kind, etag) if kind is not None else (True, None, None)


def destination(store: ObjectStore) -> tuple[bool, str | None]:
    """Whether a checkpoint is committed at ``store``'s ``.metadata``, and the ETag of the tombstone there if it holds one.

    What a save reads before it writes its shards: its commit replaces
    exactly that tombstone (``put(..., if_match=)``), so a collection that
    buries the step again meanwhile (a new tombstone) refuses it.
    """
    committed, _, etag = metadata_state(store)
    return committed, etag


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


def delete_committed_step(store: ObjectStore, prefix: str, metadata_etag: str | None = None) -> list[str]:
    """Delete a committed step's checkpoint: ``.metadata`` first, so it stops being one before its shards go.

    Each object goes only while it is what was decided on
    (``ObjectStore.delete_if_unchanged``): ``.metadata`` with
    ``metadata_etag`` (the ETag retention listed it with; by default, the
    one listed here), the shards with the ETags listed here, after which
    nothing written later is touched.  A ``.metadata`` that changed (a
    checkpoint committed there anew) keeps the whole step.  Only what a DCP
    writer writes goes (``written_by_dcp``): a Hugging Face export or an
    evaluation's results saved into the step's folder stay, with a warning
    naming them.  Returns their keys, relative to the step.
    """
    child = store.child(prefix)
    try:
        listed = {o.key: o.etag for o in child.list()}
        if METADATA_KEY in listed and child.delete_if_unchanged({METADATA_KEY: metadata_etag or listed[METADATA_KEY]}):
            logger.warning("%s: not deleted: its .metadata changed since it was listed (committed there anew)", child.url)
            return []
        changed = child.delete_if_unchanged({k: e for k, e in listed.items() if written_by_dcp(k) and k != METADATA_KEY})
        if changed:
            logger.warning("%s: left %d object(s) rewritten since they were listed (%s)", child.url, len(changed), ", ".join(changed[:5]))
        others = not_written_by_dcp(listed)
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


def holds_only_a_tombstone(step: StepInfo) -> bool:
    """Whether ``step`` is a failed save a collection swept: nothing left but its tombstone."""
    return step.tombstone is not None and step.keys == (METADATA_KEY,)


def committed_steps(store: ObjectStore, naming: StepNaming | None = None) -> list[StepInfo]:
    """The committed steps under ``store``'s root (only those named in ``naming``'s form, if given), lowest first."""
    return [s for s in list_steps(store, naming) if s.committed]
