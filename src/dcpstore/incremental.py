"""Incremental saves: an item whose bytes did not change since the job's last committed save is not sent again.

Many saves are mostly bytes that did not change: a frozen base model under
LoRA, frozen embeddings, the optimizer state of frozen parameters.  With
``AsyncCheckpointer(incremental=True)`` each rank hashes every tensor item
it writes and compares the hash with the one the same item had in the last
save this checkpointer committed.  A run of unchanged items that lie back to
back in one of that save's shard objects is appended to the new shard object
by the server (``ObjectWriter.copy_range``: S3's ``UploadPartCopy``), so its
bytes never leave the bucket, and every step stays a whole checkpoint: its
objects hold all their bytes, stock readers load it, and pruning the step
the copies came from breaks nothing.

"Unchanged" is decided by a 128-bit xxh3 of the item's dtype, shape and
bytes, taken on the upload thread from the staged copy (the pass that reads
every byte anyway; the training thread only queued the copy), at 0.03 CPU
s/GiB here (blake2b: 0.76).  Two different tensors collide with
probability about 2^-128 per pair; xxh3 is not built against an adversary,
and the tensors hashed are the job's own.  An unchanged item keeps the
stored length, crc32 and stream-transform descriptors recorded for it, so
``.metadata`` names exactly what the copy holds, and a load or ``dcpstore
verify --deep`` checks it like any other item.

The base is only ever a commit: what a save writes becomes the base when
every rank learned that its commit succeeded (``committed``), never a save
that failed or whose outcome is unknown.  After a restart, the step the job
loads is the base (``loaded``): the reader hashes each stored tensor it
parses, once its crc32 is checked, so the hash is of exactly what that step
stores, whatever the job's ``load_state_dict`` did with the values since;
nothing is added to the checkpoint for it.  If the base's object is gone (a
gc, another run's retention) or changed (its ETag), or a copy fails after
its retries, the bytes are sent.  A copy must form whole parts of at least
5 MiB, so shorter runs, and runs behind fewer than 5 MiB of sent bytes in
the part being filled, are sent too; so are a store without server-side
copies (``file://``, ``memory://``) and a job's first save unless it
loaded a step.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import torch
import xxhash
from torch.distributed.checkpoint.metadata import MetadataIndex


def content_digest(tensor: torch.Tensor) -> bytes | None:
    """A 128-bit hash of a tensor's dtype, shape and bytes (contiguous, on the CPU).

    ``None`` (never copied) for anything but a plain dense tensor: a
    quantized tensor's archive also holds its scale and zero point, which
    its bytes do not show; a sparse or subclassed one is more than its bytes.
    """
    if type(tensor) is not torch.Tensor or tensor.is_quantized or tensor.layout != torch.strided:
        return None
    try:
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError):
        return None
    digest = xxhash.xxh3_128(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    digest.update(raw)
    return digest.digest()


@dataclasses.dataclass(frozen=True)
class StoredItem:
    """Where a committed save stored an item, and the hash of what it held."""

    digest: bytes
    source: str  # the shard object, as ``ObjectStore.location`` names it
    etag: str | None  # that object's when it was written or read; None: not known (taken from the first HEAD, see ``loaded``)
    offset: int
    length: int
    crc32: int
    descriptors: list[str] | None  # its stream transforms (torch's ``transform_descriptors``)

    def precedes(self, other: StoredItem) -> bool:
        """Whether ``other`` lies right after this item in the same object."""
        return other.source == self.source and self.offset + self.length == other.offset


@dataclasses.dataclass(frozen=True)
class Run:
    """Items of a shard object that lay back to back in one committed object, unchanged: one copy request."""

    items: list[int]  # their places in the object's item list
    stored: list[StoredItem]  # where each lay

    @property
    def first(self) -> StoredItem:
        return self.stored[0]

    @property
    def length(self) -> int:
        return self.stored[-1].offset + self.stored[-1].length - self.stored[0].offset


class ObjectPlan:
    """For one shard object of a save: each item's hash, and the order to write its items in.

    The unchanged items come first, as runs of what lay back to back in a
    committed object, longest first, so that the first run starts the object
    (the part being filled is empty, and the run, if it holds 5 MiB, is one
    whole copied part) and each copy leaves the next part empty again; then
    the items to send, in their order (bytes items last).  A save whose
    unchanged items are those of the last one writes its objects exactly as
    that one did.
    """

    def __init__(self, state: IncrementalState, digests: list[bytes | None], base: list[StoredItem | None]):
        self._state = state
        self.digests = digests
        unchanged = sorted((i for i, stored in enumerate(base) if stored is not None), key=lambda i: (base[i].source, base[i].offset))
        runs: list[list[int]] = []
        for i in unchanged:
            if runs and base[runs[-1][-1]].precedes(base[i]):
                runs[-1].append(i)
            else:
                runs.append([i])
        self.runs = sorted((Run(run, [base[i] for i in run]) for run in runs), key=lambda run: -run.length)
        self.to_send = [i for i, stored in enumerate(base) if stored is None]

    def copied(self, run: Run, requests: int) -> None:
        """``run`` was copied by the server, in ``requests`` requests."""
        self._state.copied(run, requests)


class IncrementalState:
    """One rank's items of the last committed save, and what the current save writes; thread-safe.

    A save calls ``begin``, then, on its upload threads, ``plan`` before
    and ``wrote`` after each shard object; ``committed`` once every rank
    knows the save committed makes what it wrote the base of the next.
    """

    def __init__(self) -> None:
        self._base: dict[MetadataIndex, StoredItem] = {}
        self._written: dict[MetadataIndex, StoredItem] = {}
        self._lock = threading.Lock()
        self.bytes_copied = 0  # by the current save: appended by the server instead of sent
        self.copies = 0  # the copy requests (UploadPartCopy) that did it

    def begin(self) -> None:
        """A new save: nothing written, nothing copied yet."""
        with self._lock:
            self._written = {}
            self.bytes_copied = self.copies = 0

    def plan(self, indexes: Sequence[MetadataIndex], digests: list[bytes | None]) -> ObjectPlan:
        """Which of one object's items (``indexes``, hashed as ``digests``; ``None``: not a tensor) are unchanged since the base."""
        base = []
        for index, digest in zip(indexes, digests):
            stored = self._base.get(index) if digest is not None else None
            base.append(stored if stored is not None and stored.digest == digest else None)
        return ObjectPlan(self, digests, base)

    def copied(self, run: Run, requests: int) -> None:
        with self._lock:
            self.bytes_copied += run.length
            self.copies += requests

    def wrote(self, source: str, etag: str | None, results: Sequence, plan: ObjectPlan) -> None:
        """A finished shard object (``source``, ``etag``), its write results (``shard_writing.ChecksummedWriteResult``) in ``plan``'s order.

        ``etag``: ``None`` where the store has no ETags (a copy from it
        then takes the one its first HEAD reports).
        """
        items = {
            r.index: StoredItem(
                digest, source, etag, r.storage_data.offset, r.storage_data.length, r.crc32,
                r.storage_data.transform_descriptors,
            )
            for r, digest in zip(results, plan.digests)
            if digest is not None
        }
        with self._lock:
            self._written.update(items)

    def loaded(
        self, digests: dict[MetadataIndex, bytes], storage_data: dict, checksums: dict[MetadataIndex, int], location, etags: dict[str, str]
    ) -> None:
        """After a load of a committed step (a restart): its items this rank read become the base of the next save.

        ``digests``: the hash of each stored tensor as the reader parsed
        it, after its crc32 was checked (``ObjectStoreReader.stored_digests``),
        so a tensor the next save stages unchanged is known to be exactly
        what that step stores, whatever the state dict did with it since.
        ``location``: a shard's relative path to ``ObjectStore.location``.
        ``etags``: each shard's ETag as the load's reads saw it
        (``ObjectStore.read_etags``), so a source changed since the load is
        not copied from; a shard this rank did not read (a peer read it
        for it, ``read_once``) is taken as its first HEAD finds it.
        """
        base = {}
        for index, digest in digests.items():
            info, crc32 = storage_data.get(index), checksums.get(index)
            if info is not None and crc32 is not None:
                base[index] = StoredItem(
                    digest, location(info.relative_path), etags.get(info.relative_path), info.offset, info.length, crc32,
                    info.transform_descriptors,
                )
        with self._lock:
            self._base, self._written = base, {}

    @property
    def unsettled(self) -> bool:
        """Whether the current save wrote items that no ``committed`` has made the base yet."""
        with self._lock:
            return bool(self._written)

    def committed(self) -> None:
        """The current save committed: what it wrote is the base of the next save."""
        with self._lock:
            self._base, self._written = self._written, {}
