"""How the ranks of a job commit one save, and how every rank learns the outcome storage shows.

Who calls it: the save pipeline (``save_pipeline``), on each rank's
background thread, once a save's upload is done or failed, in the same
order on every rank.  What it may touch: the checkpointer's collectives,
its ``ObjectStoreWriter`` (which writes ``.metadata``, see ``commit``), the
commit order of the root and its retention (``steps``), and the plan cache
(a resumed coordinator's global state, parsed only for a full commit).

What it promises:

- **One way to commit, agreed.**  One all-reduce (MIN) of four int64s a
  rank decides: whether every upload succeeded, and whether every rank's
  write results fit the coordinator's template (the template's id, its
  negation, and the longest row of values; see ``metadata_template``).
  Then either the patched commit (each rank's values as one tensor to the
  coordinator, the verdict back as one int64: no object collective) or the
  full one (write results gathered as objects, ``.metadata`` built by
  ``ObjectStoreWriter.finish``).  A failed upload anywhere: every rank
  hears every failure, and no ``.metadata`` is written.
- **One outcome on every rank, the one storage shows.**  The verdict is
  committed, failed, refused or unknown.  A rank that loses the
  coordinator's answer (a collective broke) settles from storage
  (``_settle_without_coordinator``): the coordinator starts its
  ``.metadata`` PUT no later than its ``put_deadline``, a group timeout
  after it entered the collective that opens the commit's exchange, which
  no peer leaves before every rank entered it; so a peer that stops waiting
  a group timeout after it entered the next collective stops no sooner
  than that deadline.  Ranks may be given different ``collective_timeout``s:
  the deadline keeps the shortest of any rank's, agreed in the all-reduce
  that draws the save's nonce, and each peer waits its own, which is no
  shorter.  The PUT's last attempt starts within
  ``commit_window`` of its first, and an unsettled attempt (no answer, or
  a 5xx) lands within ``landing_margin``; storage's answer after all three
  is final, and the rank returns sooner if the save's ``.metadata`` shows up.
- **Nothing deletes shards a ``.metadata`` may name.**  Each rank deletes
  its own after a failed commit; the coordinator all of them after a
  refused one (once, in ``commit.Destination.commit``); nobody after an
  unknown one, and no rank that settled from storage (gc reclaims).
- **Commits are ordered by storage, not by memory.**  Each commit's
  sequence is read from the root at commit time (``steps.CommitOrder``),
  so another run on the root never makes this one commit below it.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Callable

import numpy
import torch
from torch.distributed.checkpoint.metadata import Metadata

from .collectives import Collectives, describe
from .commit import Outcome, landing_margin, wait_and_settle
from .errors import CheckpointExistsError, CheckpointSaveError, CommitOutcomeUnknownError
from .layout import StepNaming
from .plan_cache import PlanCache, UnparsedMetadata
from .save_job import SaveJob
from .collection import Retention
from .steps import CommitOrder, CommitRecord
from .writer import ObjectStoreWriter

logger = logging.getLogger(__name__)

_FULL = "full"  # the coordinator's verdict that a patched commit cannot be: every rank commits in full
_VERDICTS = (None, Outcome.FAILED, Outcome.REFUSED, Outcome.UNKNOWN, _FULL)  # a verdict as a tensor: its index


def _verdict_code(verdict) -> int:
    """``_VERDICTS``' index of a verdict (``None``, ``_FULL`` or ``(Outcome, failures)``); peers send 0."""
    return _VERDICTS.index(verdict if verdict is None or verdict is _FULL else verdict[0])


class CommitProtocol:
    """The commit of each save of one ``AsyncCheckpointer``, on every rank (see the module docstring).

    ``parent`` is the step the next save continues from (the last one
    committed or loaded): each commit records it, and retention keeps it.
    """

    def __init__(
        self,
        coll: Collectives,
        writer: ObjectStoreWriter,
        plan_cache: PlanCache,
        order: CommitOrder,
        retention: Retention,
        *,
        root: str,
        naming: StepNaming,
        collective_timeout: datetime.timedelta,
        commit_window: float,
    ):
        self.coll, self.writer, self.plan_cache, self.order, self.retention = coll, writer, plan_cache, order, retention
        self.root, self.naming = root, naming
        self.collective_timeout, self.commit_window = collective_timeout, commit_window
        self.parent: int | None = None
        self._last_sequence = 0  # the highest sequence this checkpointer committed with, or may have (coordinator)
        self._unsettled: set[int] = set()  # steps whose commit outcome was unknown: never pruned here

    def commit(self, job: SaveJob, metadata, results, error) -> None:
        """Agree on how to commit, commit on the coordinator, and give every rank the outcome storage shows.

        One all-reduce decides the way: whether every upload succeeded, and
        whether every rank's write results fit the coordinator's template
        (the same template id, and on each rank the layout it wrote for it;
        see ``metadata_template``).  Then either a patched commit (each
        rank's values in one tensor to the coordinator, the verdict back as
        a tensor: no object collective, nothing per item on the coordinator
        but bytes), or the full one (write results gathered as objects,
        ``.metadata`` built and pickled).  A failed upload anywhere: every
        rank hears every failure, and no ``.metadata`` is written.

        Shards are deleted only when no ``.metadata`` can name them: each
        rank its own after a failed commit, the coordinator all of them after
        a refused one (once, in ``commit.Destination.commit``), nobody after
        an unknown one.
        """
        writer = self.writer
        vote = writer.builder.vote(results, writer.save_id) if error is None else None
        template_id, values = vote if vote is not None else (0, numpy.zeros(0, numpy.int64))
        if self.coll.is_coordinator and template_id != writer.builder.template_id(metadata):
            template_id = 0  # this rank wrote as the template says, but the template is of another save
        if self.coll.is_coordinator and self.coll.enabled:
            # The coordinator's last moment to start a patched .metadata PUT: no
            # peer leaves this all-reduce before every rank entered it, so a peer
            # stops waiting (in the gather or the verdict after it) no sooner
            # than a group timeout from now.  The full path sets its own.
            writer.put_deadline = time.monotonic() + self._shortest_timeout(job)
        try:
            all_ok, lowest, neg_highest, neg_width = self.coll.all_min(
                [int(error is None), template_id, -template_id, -len(values)]
            )
        except Exception as e:  # noqa: BLE001 - this rank sent nothing a commit needs: none can happen
            if results:
                writer.delete_shards(results)
            raise CheckpointSaveError(job.url, {self.coll.rank: f"agreeing on the commit failed: {describe(e)}"}) from (error or e)
        if not all_ok:
            if results:
                writer.delete_shards(results)  # no rank sends its results: nothing is committed
            self.raise_everywhere(job.url, error)
        verdict, settled = None, False
        patch = lowest == -neg_highest > 0
        if patch:
            verdict, settled = self._commit_patched(job, values, 1 - neg_width)
        if not patch or verdict is _FULL:
            verdict, settled = self._commit_full(job, metadata, results)
        if verdict is None:
            self.parent = job.step
            if writer.incremental is not None:
                writer.incremental.committed()  # this save's items are what the next one may copy
            return
        if settled:
            results = None  # storage's answer is final, but a rank that settled deletes nothing: gc reclaims
        outcome, failures = verdict
        if outcome is Outcome.UNKNOWN:
            raise CommitOutcomeUnknownError(job.url, failures) from error
        if outcome is Outcome.FAILED and results:
            writer.delete_shards(results)  # this rank's own: no .metadata names them
        raise CheckpointSaveError(job.url, failures) from error

    def _commit_patched(self, job: SaveJob, values: numpy.ndarray, width: int):
        """A patched commit: each rank's values to the coordinator as one tensor, the verdict back as one; ``_FULL`` to commit in full instead.

        Every rank pads its row to ``width`` (the longest, from the
        all-reduce); the coordinator receives W rows.  Only a verdict other
        than committed travels with its messages, as an object.
        """
        writer = self.writer
        row = numpy.zeros(width, numpy.int64)
        row[0] = len(values)
        row[1 : 1 + len(values)] = values
        entered = time.monotonic()
        gathered = gather_error = verdict = None
        try:
            gathered = self.coll.gather_tensor(torch.from_numpy(row))
        except Exception as e:  # noqa: BLE001 - a peer died; the verdict below still tells the rest
            gather_error = e
        if self.coll.is_coordinator:
            verdict = self._decide(job, gather_error, lambda: writer.commit_patched(gathered.numpy()))
        try:
            kind = _VERDICTS[self.coll.broadcast_code(_verdict_code(verdict))]
        except Exception as e:  # noqa: BLE001 - storage decides, unless this rank decided
            if self.coll.is_coordinator:
                why = f"sending the verdict failed: {describe(e)}"
                return (verdict if verdict is not _FULL else (Outcome.FAILED, {self.coll.rank: why})), False
            return self._settle_without_coordinator(job, e, entered), True
        if kind is None or kind is _FULL:
            return kind, False
        try:  # a verdict other than committed: its messages, once
            return self.coll.broadcast(verdict), False
        except Exception:  # noqa: BLE001 - the outcome is known; only the coordinator's words are lost
            return (verdict if self.coll.is_coordinator else (kind, {0: f"the commit of .metadata: {kind.value}"})), False

    def _commit_full(self, job: SaveJob, metadata, results):
        """The full commit: the write results gathered as objects, ``.metadata`` built by ``finish``, the verdict broadcast.

        The coordinator's verdict travels as ``None`` (committed) or
        ``(Outcome, failures)``.
        """
        writer = self.writer
        writer.builder.remember_written(results, writer.save_id)  # what the coordinator's template of this save, if any, is made of
        if isinstance(metadata, UnparsedMetadata) and self.coll.is_coordinator:
            metadata = self._parse_global_state(metadata)
        verdict = None
        gather_error = None
        if self.coll.is_coordinator and self.coll.enabled:
            # The coordinator's last moment to start the .metadata PUT.  A peer
            # stops waiting for the verdict a group timeout after it entered the
            # broadcast, which is after it left the gather; no rank leaves the
            # gather before every rank entered it (gather_object begins with an
            # all_gather of the sizes), so not before now.  Its PUT then lands
            # before the peer's settling ends (see _settle_without_coordinator).
            writer.put_deadline = time.monotonic() + self._shortest_timeout(job)
        gathered = None
        try:
            gathered = self.coll.gather(results)
        except Exception as e:  # noqa: BLE001 - a peer died; the broadcast below still tells the rest
            gather_error = e
        if self.coll.is_coordinator:
            verdict = self._decide(job, gather_error, lambda: writer.finish(metadata, gathered) or True)
        entered = time.monotonic()
        try:
            return self.coll.broadcast(verdict), False
        except Exception as e:  # noqa: BLE001 - storage decides, unless this rank decided
            if self.coll.is_coordinator:
                return verdict, False
            return self._settle_without_coordinator(job, e, entered), True

    def _parse_global_state(self, unparsed: UnparsedMetadata) -> Metadata | None:
        """A resumed coordinator's global ``Metadata``, parsed for a full commit, and kept in the plan cache; ``None`` if it cannot be."""
        try:
            metadata, plans = unparsed.resolve()
        except Exception as e:  # noqa: BLE001 - finish() fails on None: the save fails, the next one plans in full
            logger.warning("%s: parsing the resumed .metadata for a full commit failed: %s", self.root, e)
            self.plan_cache.clear()
            return None
        self.writer.plans.remember(plans)
        entry = self.plan_cache.entry
        if entry is not None and entry.metadata is unparsed:
            entry.metadata, entry.all_local_plans = metadata, plans
        return metadata

    def _decide(self, job: SaveJob, gather_error, commit: Callable[[], bool]):
        """On the coordinator: run ``commit`` (``False``: it cannot, commit in full); the verdict for ``CommitProtocol.commit``, or ``_FULL``."""
        writer = self.writer
        if gather_error is not None:
            return Outcome.FAILED, {self.coll.rank: f"collecting the ranks' write results failed: {describe(gather_error)}"}
        try:
            record = self._next_commit(job)
            writer.commit_tags, writer.commit_record = record.tags(), record.planner_data()
            try:
                if not commit():
                    return _FULL
            finally:
                job.stats.metadata_patched = writer.builder.patched_commit
        except CommitOutcomeUnknownError as e:
            self._last_sequence = record.sequence  # it may have committed with it
            self._unsettled.add(job.step)
            return Outcome.UNKNOWN, e.failures
        except CheckpointExistsError as e:
            return Outcome.REFUSED, {self.coll.rank: f"writing .metadata was refused: {describe(e)}"}
        except Exception as e:  # noqa: BLE001
            return Outcome.FAILED, {self.coll.rank: f"writing .metadata failed: {describe(e)}"}
        self.order.remember(self.naming.prefix(job.step), record)
        self._last_sequence = record.sequence
        if self.retention.enabled:
            self.retention.after_commit(job.step, frozenset(self._unsettled), writer.put_deadline)
        return None

    def _next_commit(self, job: SaveJob) -> CommitRecord:
        """This save's commit record: the next sequence above what storage holds now, and the step the job continued from.

        Read from storage at every commit (``CommitOrder.newest``: one
        listing of the step folders, a HEAD for each step not seen before),
        never counted on locally: another run on the root (a zombie, a
        restart while the old job still saves, a mistyped name) commits
        meanwhile, and a commit below its newest sequence would lose to it,
        and be pruned by this very save's retention.
        """
        newest, highest = self.order.newest(self.naming)
        sequence = max(newest, self._last_sequence) + 1
        if highest is not None and job.step < highest:
            logger.warning(
                "%s: saving step %d below the highest committed step %d; steps are ordered by when "
                "they committed, so step %d becomes the latest",
                self.root, job.step, highest, job.step,
            )
        return CommitRecord(job.step, sequence, self.parent)

    def _shortest_timeout(self, job: SaveJob) -> float:
        """The group timeout the coordinator's ``put_deadline`` keeps: the shortest of any rank's, agreed with the save's nonce.

        Ranks may be given different ``collective_timeout``s, and each
        peer stops waiting after its own: the coordinator's deadline must
        come before the soonest (a peer that waits longer only settles later).
        """
        own = self.coll.timeout_s(self.collective_timeout)
        return min(own, job.group_timeout_s) if job.group_timeout_s else own

    def _settle_without_coordinator(self, job: SaveJob, broken: BaseException, entered: float):
        """The verdict of a rank that lost the coordinator's answer: what storage shows, once it is final.

        The coordinator starts its ``.metadata`` PUT, if at all, no later
        than a group timeout after it entered the gather (``put_deadline``),
        which is no later than this rank's collective broke; it sends its
        last attempt within ``commit_window`` of starting it, and an
        unsettled attempt lands within ``landing_margin`` of being sent.
        Storage's answer after all three is final, however slow the
        coordinator's work before the PUT (the resume index, the root's
        listing).  ``entered``: when this rank entered the broadcast; a
        collective that broke sooner than the group timeout (a peer's socket
        closed) is settled as if it had timed out, since the coordinator
        may still be working.  This rank returns sooner when the
        ``.metadata`` shows up.
        """
        writer = self.writer
        why = f"the commit's collective broke ({describe(broken)})"
        broke = max(time.monotonic(), entered + self.coll.timeout_s(self.collective_timeout))
        until = broke + self.commit_window + landing_margin(writer.store)
        outcome = wait_and_settle(writer.store, job.nonce, until)
        if outcome is Outcome.COMMITTED:
            logger.warning("%s: step %d is committed, but a peer rank failed around the commit (%s)", job.url, job.step, broken)
            return None
        if outcome is Outcome.UNKNOWN:
            return outcome, {self.coll.rank: f"{why}, and storage could not be read back"}
        return outcome, {self.coll.rank: f"{why}, and storage shows no .metadata of this save ({outcome.value})"}

    def raise_everywhere(self, url: str, error: BaseException | None) -> None:
        messages = self.coll.all_gather(describe(error) if error is not None else None)
        raise CheckpointSaveError(url, {r: m for r, m in enumerate(messages) if m is not None}) from error
