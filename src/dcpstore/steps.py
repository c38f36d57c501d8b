"""The order steps committed in, and which of them retention keeps.

A step's number does not say when it committed: a rollback (``load(step=200)``
after step 300 committed, then saving 250), a restart that resets the step
counter, or two runs on one root all commit a lower number after a higher
one.  So every commit of an ``AsyncCheckpointer`` records two things in its
``.metadata``:

- its **sequence**: the highest sequence committed under the root, plus one,
  read from storage at each commit (another run on the root may have
  committed since this one last looked);
- its **parent**: the step the job continued from, the last one it saved or
  loaded (``None`` for a job that started fresh).

Both go in the object's user metadata (``x-amz-meta-dcpstore-seq`` and
``-parent``), so one HEAD per step orders them, and in
``planner_data["dcpstore/commit"]``, for stores without user metadata
(``file://``, ``memory://``).  S3's LastModified cannot order them: it has
one-second resolution and is the start time of a multipart upload.  Steps
other tools wrote (stock torchtitan, ``FsspecWriter``) carry neither; they
go among the sequenced ones by when their ``.metadata`` was written
(LastModified, as listed), and by number among themselves at equal times.
So a run that goes dcpstore, then stock torchtitan, then dcpstore again,
resumes the stock run's last step.

The latest step is the newest commit.  Retention (``keep_last``) keeps the
newest commit and its lineage first (its parent, the parent's parent, ...),
then the newest of the rest: after a rollback to 200 and a save of 250, a
window of two keeps 200 and 250 and drops the abandoned 300.  The step just
committed is the newest, and its own retention keeps it even when another
run committed with the same sequence in between: it is never pruned by the
save that reported it committed.

What a collection of failed saves' debris deletes, and why it never takes a
checkpoint someone still needs, is ``collection``'s.
"""

from __future__ import annotations

import dataclasses

from .commit import PARENT_KEY, SEQUENCE_KEY, tags_in_object
from .layout import METADATA_KEY, StepInfo, StepNaming, committed_steps, is_tombstone, parse_step
from .errors import ObjectNotFoundError
from .storage import ObjectStore


@dataclasses.dataclass(frozen=True)
class CommitRecord:
    step: int
    sequence: int | None  # None: written by another tool (or an older dcpstore)
    parent: int | None = None
    committed_at: float | None = None  # the .metadata's LastModified as listed; None: just committed here

    def tags(self) -> dict[str, str]:
        """The ``.metadata`` user metadata that records this commit."""
        tags = {SEQUENCE_KEY: str(self.sequence)}
        if self.parent is not None:
            tags[PARENT_KEY] = str(self.parent)
        return tags

    def planner_data(self) -> dict[str, int | None]:
        return {"sequence": self.sequence, "parent": self.parent}


class CommitOrder:
    """The commit records of a root's steps, each read once (by prefix): a committed step never changes."""

    def __init__(self, store: ObjectStore):
        self.store = store
        self._records: dict[str, CommitRecord] = {}

    def records(self, steps: list[StepInfo]) -> list[CommitRecord]:
        """The records of the committed ``steps``, oldest commit first."""
        out = []
        for info in steps:
            record = self._records.get(info.prefix)
            if record is None:
                record = self._records[info.prefix] = self._read(info.prefix, info.step, info.committed_at)
            elif record.committed_at is None and info.committed_at is not None:
                record = self._records[info.prefix] = dataclasses.replace(record, committed_at=info.committed_at)
            out.append(record)
        return in_commit_order(out)

    def committed(self, naming: StepNaming) -> list[CommitRecord]:
        """The records of the committed steps under the root named ``naming``'s way, oldest commit first (not by number)."""
        return self.records(committed_steps(self.store, naming))

    def steps(self, naming: StepNaming) -> list[int]:
        """The committed steps under the root named ``naming``'s way, oldest commit first (not by number)."""
        return [r.step for r in self.committed(naming)]

    def newest(self, naming: StepNaming | None) -> tuple[int, int | None]:
        """The highest sequence committed under the root now, and the highest committed step number.

        What a commit must stand above, read from storage, not counted
        locally: one listing of the root's step folders (not of every
        object in them) and a HEAD of ``.metadata`` in each folder not
        known to be committed.  A folder without one (a save in flight,
        debris, a step just pruned) is passed over.
        """
        sequence, highest = 0, None
        for prefix in self.store.list_folders():
            step = parse_step(prefix, naming)
            if step is None:
                continue
            record = self._records.get(prefix)
            if record is None:
                try:
                    record = self._records[prefix] = self._read(prefix, step, None)
                except ObjectNotFoundError:
                    continue
            sequence = max(sequence, record.sequence or 0)
            highest = step if highest is None else max(highest, step)
        return sequence, highest

    def remember(self, prefix: str, record: CommitRecord) -> None:
        self._records[prefix] = record

    def forget(self, prefix: str) -> None:
        """``prefix`` was deleted: a step committed there later is another commit."""
        self._records.pop(prefix, None)

    def _read(self, prefix: str, step: int, committed_at: float | None) -> CommitRecord:
        child = self.store.child(prefix)
        try:
            head = child.head(METADATA_KEY)
            if is_tombstone(head.size):
                raise ObjectNotFoundError(f"{child.url_for(METADATA_KEY)}: a collection's tombstone, not a checkpoint")
            tags = head.metadata
            if SEQUENCE_KEY not in tags and not child.has_user_metadata:
                tags = tags_in_object(child)[0]
        finally:
            child.close()
        return CommitRecord(step, _int(tags.get(SEQUENCE_KEY)), _int(tags.get(PARENT_KEY)), committed_at)


def in_commit_order(records: list[CommitRecord]) -> list[CommitRecord]:
    """``records``, oldest commit first: sequenced ones by sequence, the others among them by time (see above)."""
    sequenced = sorted((r for r in records if r.sequence is not None), key=lambda r: r.sequence)
    others = sorted((r for r in records if r.sequence is None), key=lambda r: (r.committed_at or 0.0, r.step))
    out, i = [], 0
    for record in sequenced:
        at = record.committed_at if record.committed_at is not None else float("inf")
        while i < len(others) and (others[i].committed_at or 0.0) < at:
            out.append(others[i])
            i += 1
        out.append(record)
    return out + others[i:]


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
