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

Failed saves leave debris: an incomplete step (shards, no ``.metadata``) and
open multipart uploads.  Debris is only deleted once nothing under its step,
no object and no upload's newest part, changed within a grace period, on the
server's clock (``plan_gc``): until then it may be a save still running
(another job's, or a commit whose outcome is not known yet).

A save can still look dead while it commits: its shards are done, and the
gather, the resume index or a throttled ``.metadata`` PUT outlast the grace.
**A collection and a commit cannot both succeed on one step**, because both
are conditional writes of the same ``.metadata`` key, and storage lets only
one of them create it:

- the collection writes a tombstone there (``layout.lay_tombstone``: only
  where no ``.metadata`` exists, or in place of an earlier tombstone by its
  ETag) *before* it deletes a shard, and deletes nothing if that fails;
- the commit's PUT is conditional on no ``.metadata`` existing (or on the
  tombstone its save found as it began), so once the tombstone is there it
  is refused, whenever it lands: a late attempt, a 504 that lands later
  (the tombstone is never deleted);
- and before the PUT the commit lists its step and sends nothing if a
  shard it would name is gone (``commit.check_still_stored``),
  whoever deleted it.

So either the commit lands first, the tombstone is refused and nothing is
deleted; or the tombstone lands first and the commit is refused (the save
fails: "took this step for a failed save's debris").  Listings, ``latest``
and resume read a tombstone as "not committed", and a later save of that
step replaces the one it found as it began.  Nothing of dcpstore deletes a
tombstone: a DELETE is not conditional, so it could remove the ``.metadata``
of a save that replaced the tombstone meanwhile.  The argument needs the
store to enforce both conditions: S3 does; ``file://`` creates atomically
(``os.link``) but replaces by check-then-rename, exact within one process;
Ceph RGW ignores conditions on a multipart completion, so a ``.metadata``
above ``multipart_threshold`` is checked by a HEAD just before (docs/development.md).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time

from .commit import PARENT_KEY, SEQUENCE_KEY, tags_in_object
from .layout import (
    HF_INDEX_KEY,
    HF_SHARD_NAME,
    METADATA_KEY,
    StepInfo,
    StepNaming,
    committed_steps,
    delete_committed_step,
    delete_incomplete_step,
    holds_only_a_tombstone,
    is_tombstone,
    list_steps,
    open_uploads,
    parse_step,
    not_written_by_dcp,
)
from .errors import ObjectNotFoundError
from .storage import MultipartUploadInfo, ObjectStore

logger = logging.getLogger(__name__)


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

    def steps(self, naming: StepNaming) -> list[int]:
        """The committed steps under the root named ``naming``'s way, oldest commit first (not by number)."""
        return [r.step for r in self.records(committed_steps(self.store, naming))]

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


@dataclasses.dataclass
class GcPlan:
    """What a collection deletes under a root (see ``plan_gc``)."""

    incomplete: list[StepInfo]  # failed saves' steps: shards without .metadata
    uploads: list[MultipartUploadInfo]  # open multipart uploads
    pruned: list[StepInfo]  # committed steps beyond keep_last
    exports: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # failed Hugging Face exports: folder -> shard keys

    def run(self, store: ObjectStore, progress=lambda items, desc, unit: items) -> int:
        """Delete what was planned; returns how many incomplete steps were deleted.

        ``progress(items, desc, unit)`` wraps each loop (the CLI's bars).
        """
        for upload in progress(self.uploads, "abort uploads", "upload"):
            store.abort_upload(upload.key, upload.upload_id)
        deleted = sum(delete_incomplete_step(store, s) for s in progress(self.incomplete, "delete incomplete steps", "step"))
        for s in progress(self.pruned, "delete steps", "step"):
            delete_committed_step(store, s.prefix)
        for keys in progress(list(self.exports.values()), "delete failed exports", "export"):
            store.delete(keys)
        return deleted


def plan_gc(
    store: ObjectStore,
    keep_last: int | None,
    grace: float | None,
    now: float | None = None,
    *,
    naming: StepNaming | None = None,
    order: CommitOrder | None = None,
    keep: frozenset[int] = frozenset(),
) -> GcPlan:
    """What a collection of ``store``'s root deletes: only steps (named in ``naming``'s form, if given).

    Debris goes only from a dead step (``live_steps``): one where nothing,
    neither an object nor an open multipart upload, changed within
    ``grace`` seconds of the server's clock (``now``, read from the server
    if not given).  A live step loses nothing: none of its uploads is
    aborted, none of its objects deleted.  An incomplete step must also
    hold nothing but what DCP writers write (shards, ``.metadata*``,
    dcpstore's ``.dcpstore-*``): a folder with other files (a Hugging Face
    export) is someone's, and is left alone with a warning.  Committed
    steps beyond ``keep_last`` go by commit order and lineage
    (``retained``), except the steps in ``keep``, as are incomplete steps
    in ``keep``; each naming's steps apart, as its checkpointer keeps them
    (``naming=None``: both namings, as ``dcpstore gc`` sees a root); of a
    pruned step only its checkpoint goes, other files stay
    (``delete_committed_step``).  ``grace=None`` plans no debris at all.
    ``order`` (records already read) saves requests.
    """
    incomplete, uploads, pruned, exports = [], [], [], {}
    if grace is not None:
        check_grace(grace)
        # The clock first, then uploads, then objects: a shard that completes
        # between the listings shows as an upload gone (live), not in neither.
        now = store.server_time() if now is None else now
        every_upload = open_uploads(store)
        step_uploads = [u for u in every_upload if parse_step(_step_of(u), naming) is not None]
    objects = store.list()
    steps = list_steps(store, naming, objects)
    committed = [s for s in steps if s.committed]
    if grace is not None:
        live = live_steps(store, steps, step_uploads, now - grace)
        for s in steps:
            if s.committed or s.step in keep or s.prefix in live:
                continue
            if holds_only_a_tombstone(s):
                continue  # cleaned already; its tombstone stays, refusing a late commit
            foreign = not_written_by_dcp(s.keys)
            if foreign:
                logger.warning("%s: not deleted as a failed save's debris: it holds %s, which no DCP writer wrote",
                               store.url_for(s.prefix), foreign[0])
                continue
            incomplete.append(s)
        uploads = [u for u in step_uploads if _step_of(u) not in live]
        if naming is None:  # a collection of the whole root (dcpstore gc), not a checkpointer's of its own steps
            export_uploads = [u for u in every_upload if HF_SHARD_NAME.fullmatch(u.key.rpartition("/")[2])]
            exports = abandoned_exports(store, objects, export_uploads, now - grace)
            uploads += [u for u in export_uploads if u.key.rpartition("/")[0] in exports]
    if keep_last is not None:
        order = order or CommitOrder(store)
        # Each naming's checkpointer numbers its commits among its own steps:
        # ordered together, two runs' sequences would collide.
        for form in StepNaming if naming is None else (naming,):
            mine = [s for s in committed if form.parse(s.prefix) is not None]
            if len(mine) > keep_last:
                kept = retained(order.records(mine), keep_last) | keep
                pruned += [s for s in mine if s.step not in kept]
    return GcPlan(incomplete, uploads, sorted(pruned, key=lambda s: (s.step, s.prefix)), exports)


def abandoned_exports(store: ObjectStore, objects: list, uploads: list[MultipartUploadInfo], since: float) -> dict[str, list[str]]:
    """Failed Hugging Face exports under the root: each folder's shard keys, where it has shards, no index, and nothing changed since ``since``.

    An export commits by its index (``export/hf.py``), so a folder with one
    is never touched; without one, its shards (``model-0000K-of-0000N.safetensors``)
    are a failed or killed export's, once no shard and no open upload of one
    there changed for the grace period (an export may still be writing).
    """
    folders: dict[str, list] = {}
    for obj in objects:
        folder, _, name = obj.key.rpartition("/")
        if name == HF_INDEX_KEY or HF_SHARD_NAME.fullmatch(name):
            folders.setdefault(folder, []).append((name, obj))
    live = {u.key.rpartition("/")[0] for u in uploads if not (_older(u.initiated, since) and _older(store.upload_last_active(u), since))}
    return {
        folder: [obj.key for _, obj in found]
        for folder, found in folders.items()
        if folder not in live
        and all(name != HF_INDEX_KEY for name, _ in found)
        and all(_older(obj.last_modified, since) for _, obj in found)
    }


def check_grace(grace: float) -> None:
    """A grace must be a positive number of seconds: at zero or below, a save that is running is debris."""
    if not grace > 0:
        raise ValueError(f"the grace period must be positive (seconds a running save may go without any change), got {grace}")


def live_steps(store: ObjectStore, steps: list[StepInfo], uploads: list[MultipartUploadInfo], since: float) -> set[str]:
    """The prefixes of the steps where something changed at or after ``since`` (server time): a save may run there.

    A step is live when any object under it, or any open upload's newest
    part (``upload_last_active``), is that recent, or of unknown age (an
    upload gone since it was listed just completed or was aborted).  Not
    by an upload's start: S3 stamps a multipart object, and lists an open
    upload, with the time its upload *began*, so a long upload's finished
    shard looks old the moment it lands.  ``ListParts`` is asked only for
    uploads that began before ``since`` in steps not already known live:
    one request per old upload, none in the steady state of a running save.
    """
    live = {s.prefix for s in steps if not _older(s.last_modified, since)}
    for upload in sorted(uploads, key=lambda u: u.initiated or 0.0, reverse=True):
        prefix = _step_of(upload)
        if prefix not in live and not (_older(upload.initiated, since) and _older(store.upload_last_active(upload), since)):
            live.add(prefix)
    return live


def _older(t: float | None, than: float) -> bool:
    return t is not None and t < than


def _step_of(upload: MultipartUploadInfo) -> str:
    return upload.key.split("/", 1)[0]


class Retention:
    """An ``AsyncCheckpointer``'s retention, run by its coordinator after each commit: ``keep_last`` and ``gc_grace``.

    ``after_commit`` runs ``plan_gc`` on a thread of its own and waits for
    it while the peers still wait for the commit's verdict, so that once a
    save is done on any rank every rank's ``committed_steps()`` lists what
    is kept.  But a throttled or stalled DELETE can retry for a whole
    throttle budget, and a peer stops waiting for the verdict a group
    timeout after it entered the broadcast (``peers_wait_until``, the
    coordinator's ``put_deadline``: no peer gives up before it).  So the
    wait ends a tenth of the group timeout before that; the deletes then go
    on in the background (logged), and a commit that finds the last round
    still running skips its own round: the next one deletes what is left.
    """

    def __init__(
        self, store: ObjectStore, keep_last: int | None, gc_grace: float | None,
        naming: StepNaming, order: CommitOrder, group_timeout_s: float,
    ):
        self.store, self.keep_last, self.gc_grace = store, keep_last, gc_grace
        self.naming, self.order, self.group_timeout_s = naming, order, group_timeout_s
        self._collector = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcpstore-retention")
        self._collecting: concurrent.futures.Future | None = None  # the last commit's round

    @property
    def enabled(self) -> bool:
        return self.keep_last is not None or self.gc_grace is not None

    def after_commit(self, just_committed: int, unsettled: frozenset[int], peers_wait_until: float | None) -> None:
        """Delete what retention drops now that ``just_committed`` committed, waiting at most until shortly before ``peers_wait_until``.

        ``unsettled``: steps whose commit outcome the job could not learn;
        never pruned here.  ``peers_wait_until`` ``None``: no peers, wait it out.
        """
        if self._collecting is not None and not self._collecting.done():
            logger.warning("%s: the last commit's deletions are still running; this commit deletes nothing", self.store.url)
            return
        self._collecting = self._collector.submit(self._collect, frozenset({just_committed, *unsettled}))
        if peers_wait_until is None:
            self._collecting.result()
            return
        margin = self.group_timeout_s / 10
        concurrent.futures.wait([self._collecting], timeout=max(0.0, peers_wait_until - margin - time.monotonic()))
        if not self._collecting.done():
            logger.warning(
                "%s: deleting old steps (keep_last=%s, gc_grace=%s) outlasts what the peers wait for; it goes on in "
                "the background, and the ranks may list steps it is deleting", self.store.url, self.keep_last, self.gc_grace,
            )

    def _collect(self, keep: frozenset[int]) -> None:
        """Delete committed steps beyond ``keep_last`` and, with ``gc_grace``, failed saves' debris; best effort.

        Kept: the newest commit and its lineage, then the newest of the rest
        (see ``retained``), and ``keep``: the step just committed, whatever
        another run committed meanwhile, and the unsettled ones.  One
        listing, batched deletes.  A failure here is logged.
        """
        try:
            plan = plan_gc(self.store, self.keep_last, self.gc_grace, naming=self.naming, order=self.order, keep=keep)
            plan.run(self.store)
            for info in plan.pruned:
                self.order.forget(info.prefix)
        except Exception as e:  # noqa: BLE001
            logger.warning("%s: deleting old steps (keep_last=%s, gc_grace=%s) failed: %s", self.store.url, self.keep_last, self.gc_grace, e)

    def close(self) -> None:
        """Wait for deletions that outlasted their commit."""
        self._collector.shutdown(wait=True)
