"""The order steps committed in, and which of them retention keeps.

A step's number does not say when it committed: a rollback (``load(step=200)``
after step 300 committed, then saving 250), a restart that resets the step
counter, or two runs on one root all commit a lower number after a higher
one.  So every commit of an ``AsyncCheckpointer`` records two things in its
``.metadata``:

- its **sequence**: the highest sequence committed under the root, plus one;
- its **parent**: the step the job continued from, the last one it saved or
  loaded (``None`` for a job that started fresh).

Both go in the object's user metadata (``x-amz-meta-dcpstore-seq`` and
``-parent``), so one HEAD per step orders them, and in
``planner_data["dcpstore/commit"]``, for stores without user metadata
(``file://``, ``memory://``).  S3's LastModified cannot order them: it has
one-second resolution and is the start time of a multipart upload.  Steps
other tools wrote carry neither, and order before every sequenced step, by
step number.

The latest step is the newest commit.  Retention (``keep_last``) keeps the
newest commit and its lineage first (its parent, the parent's parent, ...),
then the newest of the rest: after a rollback to 200 and a save of 250, a
window of two keeps 200 and 250 and drops the abandoned 300.  The step just
committed is always the newest, so it is never pruned.
"""

from __future__ import annotations

import dataclasses

from .commit import PARENT_KEY, SEQUENCE_KEY, tags_in_object
from .layout import METADATA_KEY, step_prefix
from .storage import ObjectStore


@dataclasses.dataclass(frozen=True)
class CommitRecord:
    step: int
    sequence: int | None  # None: written by another tool (or an older dcpstore)
    parent: int | None = None

    @property
    def order(self) -> tuple[int, int]:
        """Sort key, oldest first: unsequenced steps by number, then sequenced ones by sequence."""
        return (0, self.step) if self.sequence is None else (1, self.sequence)

    def tags(self) -> dict[str, str]:
        """The ``.metadata`` user metadata that records this commit."""
        tags = {SEQUENCE_KEY: str(self.sequence)}
        if self.parent is not None:
            tags[PARENT_KEY] = str(self.parent)
        return tags

    def planner_data(self) -> dict[str, int | None]:
        return {"sequence": self.sequence, "parent": self.parent}


class CommitOrder:
    """The commit records of a root's steps, each read once: a committed step never changes."""

    def __init__(self, store: ObjectStore):
        self.store = store
        self._records: dict[int, CommitRecord] = {}

    def records(self, steps: list[int]) -> list[CommitRecord]:
        """The records of the committed ``steps``, oldest commit first."""
        out = []
        for step in steps:
            if step not in self._records:
                self._records[step] = self._read(step)
            out.append(self._records[step])
        return sorted(out, key=lambda r: (r.order, r.step))

    def remember(self, record: CommitRecord) -> None:
        self._records[record.step] = record

    def next_sequence(self, records: list[CommitRecord]) -> int:
        return 1 + max((r.sequence for r in records if r.sequence is not None), default=0)

    def _read(self, step: int) -> CommitRecord:
        child = self.store.child(step_prefix(step))
        try:
            tags = child.head(METADATA_KEY).metadata
            if SEQUENCE_KEY not in tags and not child.has_user_metadata:
                tags = tags_in_object(child)[0]
        finally:
            child.close()
        return CommitRecord(step, _int(tags.get(SEQUENCE_KEY)), _int(tags.get(PARENT_KEY)))


def _int(value) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None  # not a record dcpstore wrote: order it by step number


def retained(records: list[CommitRecord], keep_last: int) -> set[int]:
    """The steps ``keep_last`` keeps: the newest commit and its lineage first, then the newest of the rest."""
    if not records:
        return set()
    by_step = {r.step: r for r in records}
    keep: list[int] = []
    record: CommitRecord | None = records[-1]
    while record is not None and record.step not in keep and len(keep) < keep_last:
        keep.append(record.step)
        record = by_step.get(record.parent) if record.parent is not None else None
    for record in reversed(records):
        if len(keep) >= keep_last:
            break
        if record.step not in keep:
            keep.append(record.step)
    return set(keep)
