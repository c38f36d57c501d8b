"""The bytes of each save's ``.metadata``: built in full, or patched from the last one; and the resume index beside it.

Who calls it: ``ObjectStoreWriter``.  On the coordinator, ``finish``
builds ``.metadata`` in full (``full``) and an ``AsyncCheckpointer``'s
patched commit patches the last one (``patched``); on every rank, the
commit protocol asks whether this save's write results fit the template
(``vote``) and tells it what the rank wrote (``remember_written``).  What
it may touch: the ``Metadata`` it is given (mutated in place, as torch's
writers do: ``dcp.save`` returns it) and nothing in storage; the one write
it needs before the bytes are final, the resume index's PUT, is the
writer's (``put_index``), since whether it landed changes what
``.metadata`` says.

What it promises: the bytes are ``pickle.dumps`` of torch's ``Metadata``
(stock readers load them); a patched one is exactly what a fresh pickle of
the same content would give (``metadata_template`` proves it when it keeps
a template), and it is built only when every rank's values have the widths
the template wrote, so no ``.metadata`` names bytes this save did not write.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from typing import Any, Callable

import numpy
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

from . import metadata_template, planner_data, resume_index
from .layout import generation
from .shard_writing import ChecksummedWriteResult

logger = logging.getLogger(__name__)


def template_id(save_id: str) -> int:
    """A save's id as a positive int64, for the tensor collective of a patched commit (an ``AsyncCheckpointer``'s nonce is 62 bits)."""
    return int(save_id[:15], 16) + 1


class MetadataBuilder:
    """Builds one writer's ``.metadata`` bytes, save after save (see the module docstring).

    It keeps, across saves, the last full commit's ``.metadata`` as a
    template (on the coordinator) and the id and layout of what this rank
    last wrote in full (on every rank).
    """

    def __init__(self, checksums: bool):
        self.checksums = checksums
        self.template: metadata_template.CommitTemplate | None = None
        self.written: tuple[int, list] | None = None
        self.patched_commit = False  # whether the last commit patched the template

    # -- every rank ---------------------------------------------------------------------

    def remember_written(self, results: list[WriteResult], save_id: str) -> None:
        """After a save that took the full path: the layout this rank wrote, which its template was made of."""
        self.written = (template_id(save_id), metadata_template.written_layout(results, generation(save_id)))

    def remember_written_share(self, template_of: int, written: list[tuple]) -> None:
        """On a rank that resumed from its share of a resume index: the layout it wrote for the index's commit template."""
        self.written = (template_of, written)

    def vote(self, results: list[WriteResult] | None, save_id: str) -> tuple[int, numpy.ndarray] | None:
        """This rank's part of a patched commit: the template its write results fit (its id), and its values; ``None`` if they do not.

        The check runs on the rank that wrote, against what it wrote for the
        template: the same items in the same shards, each tensor where it was.
        """
        if self.written is None or results is None:
            return None
        written_id, layout = self.written
        if metadata_template.written_layout(results, generation(save_id)) != layout:
            return None
        return written_id, metadata_template.rank_values(results, self.checksums)

    # -- the coordinator ----------------------------------------------------------------

    def use_template(self, template: metadata_template.CommitTemplate) -> None:
        """Commit the next saves of its structure by patching ``template`` (one read back after a restart)."""
        self.template = template

    def template_id(self, metadata: Metadata | None) -> int:
        """The id of the template a save of ``metadata`` may patch, or 0."""
        template = self.template
        return template.template_id if template is not None and template.metadata is metadata else 0

    def full(
        self,
        metadata: Metadata,
        results: list[list[WriteResult]],
        plans_extras: dict[str, Any],
        *,
        url: str,
        save_id: str,
        commit_record: dict[str, Any] | None,
        storage_meta: StorageMeta,
        patches: bool,
        put_index: Callable[[list[bytes], dict], bool],
    ) -> tuple[bytes, set[str]]:
        """``.metadata`` of this save built in full, and the paths it names; the template of the next save if ``patches``.

        ``plans_extras``: what it stores of the plans (see the writer).
        ``put_index(parts, pointer)`` PUTs the resume index and says whether
        it is there; without it, ``.metadata`` names no index.
        """
        self.patched_commit = False
        storage_data = {}
        checksums = {}
        for rank_results in results:
            for wr in rank_results:
                storage_data[wr.index] = wr.storage_data
                if self.checksums and isinstance(wr, ChecksummedWriteResult):
                    checksums[wr.index] = wr.crc32
        extras: dict[str, Any] = planner_data.checksum_extras(storage_data, checksums)
        if commit_record is not None:
            extras[planner_data.COMMIT_KEY] = commit_record
        extras.update(plans_extras)
        # Mutated in place, as torch's writers do: dcp.save returns this object.
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = storage_data
        metadata.storage_meta = storage_meta
        # A reused (cached) Metadata already carries last save's extras: drop them.
        user_planner_data = planner_data.user_planner_data(metadata)
        metadata.planner_data = planner_data.embed(user_planner_data, extras)
        index = self._resume_index(metadata, extras.get(planner_data.PLANS_KEY), results, url)
        if index is not None:
            layout, segments = index
            parts, pointer = layout.assemble(segments, save_id)
            extras[planner_data.INDEX_KEY] = resume_index.stored_pointer(pointer)
            metadata.planner_data = planner_data.embed(user_planner_data, extras)
        raw = pickle.dumps(metadata, protocol=metadata_template.PROTOCOL)
        template = None
        if patches:  # the next save of this structure may patch this one
            template = metadata_template.CommitTemplate.of_save(
                metadata, raw, results, generation(save_id), index[0] if index else None, template_id(save_id)
            )
        if index is not None:
            if template is not None:
                # The template's map goes in the index, so a coordinator that resumes from this step patches
                # its next commit; the pointer to the index changes in fixed-width slots only.
                mapped = dataclasses.replace(layout, template=template.stored_map(), template_of=template.template_id)
                mapped_parts, mapped_pointer = mapped.assemble(segments, save_id)
                repointed = template.repoint(resume_index.stored_pointer(mapped_pointer))
                if repointed is not None:
                    template.index, parts, pointer, raw = mapped, mapped_parts, mapped_pointer, repointed
                    extras[planner_data.INDEX_KEY] = resume_index.stored_pointer(pointer)
                    metadata.planner_data = planner_data.embed(user_planner_data, extras)
                else:  # raw names the index without a map, as it was pickled
                    template = None
            if not put_index(parts, pointer):  # .metadata names no index: pickled again without it
                del extras[planner_data.INDEX_KEY]
                metadata.planner_data = planner_data.embed(user_planner_data, extras)
                raw = pickle.dumps(metadata, protocol=metadata_template.PROTOCOL)
                template = None
        self.template = template
        # A copy of a template's bytes: they change with the next save, and no body a retry resends may change under it.
        return (raw if isinstance(raw, bytes) else bytes(raw)), {info.relative_path for info in storage_data.values()}

    def patched(
        self,
        values: numpy.ndarray,
        *,
        url: str,
        save_id: str,
        commit_record: dict[str, Any] | None,
        put_index: Callable[[list[bytes], dict], bool],
    ) -> tuple[bytes, set[str]] | None:
        """``.metadata`` of this save as the template patched with every rank's ``values``, and the paths it names; ``None`` to build it in full.

        ``values``: a row per rank, its count of values, then the values
        (``vote``), padded.  The resume index, if the template has one, is
        its blocks with this save's segments, PUT by ``put_index`` first;
        ``None`` after a successful ``put_index`` leaves that index to the
        caller to delete.
        """
        self.patched_commit = False
        template = self.template
        widths = numpy.array([template.width(r) for r in range(len(template.counts))], numpy.int64)
        if values.shape[0] != len(widths) or not numpy.array_equal(values[:, 0], widths):
            self.template = None
            return None
        rows = values[:, 1:]
        save_generation = generation(save_id)
        pointer = None
        if template.index is not None:
            segments = []
            for row, (items, bytes_items) in zip(rows, template.counts):
                k = items * template.checksums
                segments.append(resume_index.encode_segment(save_generation, row[:k], row[k : k + 2 * bytes_items]))
            parts, pointer = template.index.assemble(segments, save_id)
            if not put_index(parts, pointer):  # the template names an index: commit in full
                self.template = None
                return None
        stored = resume_index.stored_pointer(pointer) if pointer is not None else None
        raw = template.patched(rows, save_generation, commit_record, url, save_id, stored)
        if raw is None:
            self.template = None
            return None
        self.patched_commit = True
        # A copy: the template's bytes change with the next save, and no body a retry resends may change under it.
        return bytes(raw), template.names()

    def _resume_index(self, metadata: Metadata, compact: dict | None, results: list[list[WriteResult]], url: str) -> tuple | None:
        """The resume index of this save (see ``resume_index``): its layout and segments, or ``None`` without one.

        Only for jobs of several ranks, with the compact plans, which say what each rank's local plan held.
        """
        if compact is None or len(compact["ranks"]) < 2:
            return None  # a single rank resumes from .metadata, which it reads anyway
        try:
            layout = resume_index.layout_of(metadata, compact, results, self.checksums)
            segments = layout.segments(metadata, results) if layout is not None else None
        except Exception as e:  # noqa: BLE001 - an optional cache: the commit goes on without it
            logger.warning("%s: could not build the resume index (%r); restarts will read .metadata", url, e)
            return None
        if segments is None:
            logger.info("%s: the plans do not index this save's items; no resume index", url)
            return None
        return layout, segments
