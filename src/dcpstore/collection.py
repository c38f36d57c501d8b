"""What a collection (``dcpstore gc``, a checkpointer's ``gc_grace`` and ``keep_last``) deletes, and why it never takes a checkpoint someone still needs.

Failed saves leave debris: an incomplete step (shards, no ``.metadata``) and
open multipart uploads.  A step is **dead** when nothing under it, no object
and no open upload's newest part, changed within a grace period on the
server's clock (``live_steps``); until then it may be a save still running
(another job's, or a commit whose outcome is not known yet).

But a dead-looking step may still commit.  S3 stamps a multipart object with
the time its upload *began*, and a completed upload is no longer listed: the
moment a shard that took longer than the grace lands, nothing under its step
looks recent, though its save is about to commit.  So a collection never
deletes a step the first time it finds it dead.  It **marks, then sweeps**,
each judged on the server's clock, and every delete holds each object to the
ETag it was listed with (``ObjectStore.delete_if_unchanged``):

1. **Mark.** A dead incomplete step gets a mark as its ``.metadata``
   (``Tombstone.MARKED``), written only where there is none (or in place of
   a sweep's tombstone, by its ETag, when new debris came after a sweep).
   Nothing is deleted.  A save that is still alive finds the mark when it
   commits and replaces exactly it (``If-Match`` on its ETag; see
   ``commit.Destination``); a stock writer's unconditional ``.metadata``
   PUT replaces it too.  Either way the step is committed and no
   collection touches it again.
2. **Sweep**, at a later run, once the mark is older than the grace and the
   step is still dead: the sweep's tombstone (``Tombstone.SWEPT``) replaces
   the mark by its ETag, and only then do the objects listed go, each while
   its ETag is the one listed.  Of a commit and a sweep, exactly one
   replaces the mark: a commit that lands first makes the sweep's write
   fail, and the sweep deletes nothing; a sweep that lands first refuses the
   commit, which no longer matches the mark (the save fails, truthfully:
   "took this step for a failed save's debris").  No commit ever replaces a
   sweep's tombstone it did not find as its save began.
3. **Unmark**, at a later run, once a step holds nothing but the sweep's
   tombstone and that is older than the grace: the tombstone is deleted by
   its ETag.  It stayed a grace after the sweep so that a commit PUT still in
   flight (a 504 that lands later) meets it and is refused; after that, stock
   torchtitan and stock ``FsspecReader``, which take any ``.metadata`` for a
   checkpoint, resume the newest step that is one.

A run may do all three to different steps; periodic runs (a checkpointer's
``gc_grace`` after each commit, a cron job) need no waiting, and ``dcpstore
gc --now`` waits out the grace between the phases (twice) to finish in one
call.  A dcpstore save is safe at any gc grace whenever it commits within one
grace of being marked; a stock writer's save, whenever each of its shard
uploads is shorter than the grace (its ``.metadata`` follows its last shard
within seconds, and replaces the mark).

The argument needs the store to enforce the conditions: S3 does (on
``PutObject``, ``CompleteMultipartUpload`` and each object of
``DeleteObjects``); ``file://`` creates atomically (``os.link``) but
replaces and deletes by check-then-act, exact within one process; Ceph RGW
16.2 ignores conditions on a multipart completion (a ``.metadata`` above
``multipart_threshold`` is checked by a HEAD just before; see
docs/development.md).

Committed steps beyond ``keep_last`` go by commit order and lineage
(``steps.retained``), ``.metadata`` first (``layout.delete_committed_step``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time

from .errors import ConditionalWriteError
from .layout import (
    HF_INDEX_KEY,
    HF_SHARD_NAME,
    METADATA_KEY,
    StepInfo,
    StepNaming,
    Tombstone,
    delete_committed_step,
    holds_only_a_tombstone,
    list_steps,
    metadata_state,
    not_written_by_dcp,
    open_uploads,
    parse_step,
)
from .steps import CommitOrder, retained
from .storage import MultipartUploadInfo, ObjectStore

logger = logging.getLogger(__name__)


def check_grace(grace: float) -> None:
    """A grace must be a positive number of seconds: at zero or below, a save that is running is debris."""
    if not grace > 0:
        raise ValueError(f"the grace period must be positive (seconds a running save may go without any change), got {grace}")


# -- the three phases, one step at a time ---------------------------------------------------------


def mark(store: ObjectStore, step: StepInfo) -> bool:
    """Phase 1: lay a mark as the dead step's ``.metadata``; whether it is there now (see the module docstring).

    Created only where no ``.metadata`` exists, or in place of the sweep's
    tombstone listed there (new debris after a sweep), by its ETag.
    """
    child = store.child(step.prefix)
    try:
        swept = _tombstone_tag(child, Tombstone.SWEPT) if step.tombstone is Tombstone.SWEPT else None
        try:
            if step.tombstone is Tombstone.SWEPT and swept is None:
                raise ConditionalWriteError("the sweep's tombstone listed there is gone or replaced")
            child.put(METADATA_KEY, Tombstone.MARKED.new(), if_none_match=swept is None, if_match=swept)
            return True
        except ConditionalWriteError:
            logger.info("%s: not marked: its .metadata changed since it was listed", child.url)
            return False
    finally:
        child.close()


def _tombstone_tag(child: ObjectStore, kind: Tombstone) -> str | None:
    """The tag ``put(..., if_match=)`` expects of the step's ``.metadata`` if it is still a tombstone of ``kind``; else ``None``.

    Read now (one HEAD; a read of 64 bytes where the store has no ETags),
    not taken from the listing: a filesystem lists no ETags, and a
    tombstone's bytes are unique, so the one read now is the one listed
    unless a commit replaced it, which the kind read here tells.
    """
    _, found, tag = metadata_state(child)
    return tag if found is kind else None


def sweep(store: ObjectStore, step: StepInfo) -> bool:
    """Phase 2: replace the step's mark (by the ETag listed) with the sweep's tombstone, then delete what was listed; whether it swept.

    Each object goes only while its ETag is the one listed: nothing written
    or rewritten since the listing is touched.
    """
    child = store.child(step.prefix)
    try:
        listed = step.listed()
        mark = _tombstone_tag(child, Tombstone.MARKED)
        try:
            if mark is None:
                raise ConditionalWriteError("the mark is gone or replaced")
            child.put(METADATA_KEY, Tombstone.SWEPT.new(), if_match=mark)
        except ConditionalWriteError:
            logger.warning("%s: not deleted: it was committed after it was marked as a failed save's debris", child.url)
            return False
        changed = child.delete_if_unchanged({k: e for k, e in listed.items() if k != METADATA_KEY})
        if changed:
            logger.warning("%s: left %d object(s) written since they were listed (%s)", child.url, len(changed), ", ".join(changed[:5]))
        return True
    finally:
        child.close()


def unmark(store: ObjectStore, step: StepInfo) -> bool:
    """Phase 3: delete the sweep's tombstone, held to the tag listed (a filesystem's: size and time); whether it went."""
    child = store.child(step.prefix)
    try:
        return not child.delete_if_unchanged(step.listed([METADATA_KEY]))
    finally:
        child.close()


# -- planning ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class GcPlan:
    """What a collection does under a root (see ``plan_gc``)."""

    marks: list[StepInfo]  # dead incomplete steps: marked now, swept at a later run
    sweeps: list[StepInfo]  # marked steps still dead a grace later: their objects go
    unmarks: list[StepInfo]  # swept steps a grace later: their tombstones go
    uploads: list[MultipartUploadInfo]  # open multipart uploads in dead steps
    pruned: list[StepInfo]  # committed steps beyond keep_last
    exports: dict[str, dict[str, str | None]] = dataclasses.field(default_factory=dict)  # failed Hugging Face exports: folder -> shards

    @property
    def empty(self) -> bool:
        return not (self.marks or self.sweeps or self.unmarks or self.uploads or self.pruned or self.exports)

    def run(self, store: ObjectStore, progress=lambda items, desc, unit: items) -> int:
        """Do what was planned; returns how many incomplete steps were swept.

        ``progress(items, desc, unit)`` wraps each loop (the CLI's bars).
        """
        for upload in progress(self.uploads, "abort uploads", "upload"):
            store.abort_upload(upload.key, upload.upload_id)
        for s in progress(self.marks, "mark incomplete steps", "step"):
            mark(store, s)
        swept = sum(sweep(store, s) for s in progress(self.sweeps, "delete incomplete steps", "step"))
        for s in progress(self.unmarks, "remove tombstones", "step"):
            unmark(store, s)
        for s in progress(self.pruned, "delete steps", "step"):
            delete_committed_step(store, s.prefix, s.listed([METADATA_KEY]).get(METADATA_KEY))
        for shards in progress(list(self.exports.values()), "delete failed exports", "export"):
            store.delete_if_unchanged(shards)
        return swept


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
    """What a collection of ``store``'s root does: only to steps (named in ``naming``'s form, if given).

    Debris is only touched in a dead step (``live_steps``): one where
    nothing, neither an object nor an open multipart upload, changed within
    ``grace`` seconds of the server's clock (``now``, read from the server if
    not given).  A dead incomplete step is marked, a marked one swept, a
    swept one unmarked (the module docstring).  An incomplete step must also
    hold nothing but what DCP writers write (shards, ``.metadata*``,
    dcpstore's ``.dcpstore-*``): a folder with other files (a Hugging Face
    export) is someone's, and is left alone with a warning.  Committed
    steps beyond ``keep_last`` go by commit order and lineage
    (``retained``), except the steps in ``keep``, as are incomplete steps
    in ``keep``; each naming's steps apart, as its checkpointer keeps them
    (``naming=None``: both namings, as ``dcpstore gc`` sees a root); of a
    pruned step only its checkpoint goes, other files stay
    (``delete_committed_step``).  ``grace=None`` plans nothing for debris.
    ``order`` (records already read) saves requests.
    """
    plan = GcPlan([], [], [], [], [])
    if grace is not None:
        check_grace(grace)
        # The clock first, then uploads, then objects: a shard that completes
        # between the listings shows as an upload gone (live), not in neither.
        now = store.server_time() if now is None else now
        every_upload = open_uploads(store)
        step_uploads = [u for u in every_upload if parse_step(_step_of(u), naming) is not None]
    objects = store.list()
    steps = list_steps(store, naming, objects)
    if grace is not None:
        live = live_steps(store, steps, step_uploads, now - grace)
        for s in steps:
            if s.committed or s.step in keep or s.prefix in live:
                continue
            foreign = not_written_by_dcp(s.keys)
            if foreign:
                logger.warning("%s: not deleted as a failed save's debris: it holds %s, which no DCP writer wrote",
                               store.url_for(s.prefix), foreign[0])
                continue
            if s.tombstone is Tombstone.MARKED:
                plan.sweeps.append(s)
            elif holds_only_a_tombstone(s):
                plan.unmarks.append(s)
            else:
                plan.marks.append(s)
        plan.uploads = [u for u in step_uploads if _step_of(u) not in live]
        if naming is None:  # a collection of the whole root (dcpstore gc), not a checkpointer's of its own steps
            export_uploads = [u for u in every_upload if HF_SHARD_NAME.fullmatch(u.key.rpartition("/")[2])]
            plan.exports = abandoned_exports(store, objects, export_uploads, now - grace)
            plan.uploads += [u for u in export_uploads if u.key.rpartition("/")[0] in plan.exports]
    if keep_last is not None:
        committed = [s for s in steps if s.committed]
        order = order or CommitOrder(store)
        # Each naming's checkpointer numbers its commits among its own steps:
        # ordered together, two runs' sequences would collide.
        for form in StepNaming if naming is None else (naming,):
            mine = [s for s in committed if form.parse(s.prefix) is not None]
            if len(mine) > keep_last:
                kept = retained(order.records(mine), keep_last) | keep
                plan.pruned += [s for s in mine if s.step not in kept]
        plan.pruned.sort(key=lambda s: (s.step, s.prefix))
    return plan


def abandoned_exports(store: ObjectStore, objects: list, uploads: list[MultipartUploadInfo], since: float) -> dict[str, dict[str, str | None]]:
    """Failed Hugging Face exports under the root: each folder's shards (key -> ETag as listed), where it has shards, no index, and nothing changed since ``since``.

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
        folder: {obj.key: obj.etag for _, obj in found}
        for folder, found in folders.items()
        if folder not in live
        and all(name != HF_INDEX_KEY for name, _ in found)
        and all(_older(obj.last_modified, since) for _, obj in found)
    }


def live_steps(store: ObjectStore, steps: list[StepInfo], uploads: list[MultipartUploadInfo], since: float) -> set[str]:
    """The prefixes of the steps where something changed at or after ``since`` (server time): a save may run there.

    A step is live when any object under it (its mark included: a marked
    step is swept only once the mark is a grace old), or any open upload's
    newest part (``upload_last_active``), is that recent, or of unknown age
    (an upload gone since it was listed just completed or was aborted).  Not
    by an upload's start: S3 lists an open upload with the time it *began*.
    ``ListParts`` is asked only for uploads that began before ``since`` in
    steps not already known live: one request per old upload, none in the
    steady state of a running save.
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


def collect_now(store: ObjectStore, grace: float, plan: GcPlan, progress=lambda items, desc, unit: items,
                waiting=lambda seconds: None) -> list[tuple[GcPlan, int]]:
    """``dcpstore gc --now``: run ``plan``, then, while a step holds a collection's tombstone, wait out the grace and sweep or unmark it.

    Each round's plan and the steps it swept.  At most two waits: what the
    first run marks, the second sweeps, and the third unmarks.  The later
    rounds mark nothing new: a step that was live when the command began
    (a save that just failed, or one still running) is left as it is, with
    no tombstone a stock reader could take for its ``.metadata``.  Each
    wait is the grace plus a second (object times have one-second
    resolution), on this machine's clock, announced by ``waiting(seconds)``;
    a phase whose step is not dead yet on the server's clock is left to a
    later run.
    """
    rounds = [(plan, plan.run(store, progress))]
    for _ in range(2):
        if not any(s.tombstone is not None for s in list_steps(store)):
            break
        waiting(grace + 1.0)
        time.sleep(grace + 1.0)
        plan = plan_gc(store, None, grace)
        plan.marks = []
        rounds.append((plan, plan.run(store, progress)))
    return rounds


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
    Debris is marked by one commit's round and swept by a later one's.
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
        """Delete committed steps beyond ``keep_last`` and, with ``gc_grace``, collect failed saves' debris; best effort.

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
