"""The adversary: what users and faults do to one bucket, in any order, checked against the oracle after every rule.

A ``hypothesis`` ``RuleBasedStateMachine``.  Each example is a fresh root in
one bucket, reached through the fault proxy (``s3server.FaultProxy``, which
also reports object times as AWS does).  Rules are what a user does (saves
with an ``AsyncCheckpointer``, plain ``dcp.save`` with a fresh or a reused
writer, stock ``FsspecWriter``; restarts; ``dcpstore gc``; ``export-hf``),
what the network does (faults armed for the next operation: lost answers,
5xx that land later, throttling, cut bodies, refusals, a process killed
mid-save) and what a bucket writer does (planted objects, a changed
object).  The oracle (``oracle.py``) records what each was told; the
invariants (``invariants.py``) hold storage and stock readers against it.

World size 1 in this process for most rules.  A rule whose invariant is
about what ranks share (a resume index, a template) starts real gloo ranks.

Open defects: a rule (or a rule's option) that reaches a defect still
open is off while its flag in ``DEFECTS`` is ``False``; the defect's
shortest sequence is a strict ``xfail`` in ``tests/test_model.py``.  The
issue that fixes a defect sets its flag ``True`` and removes the
``xfail``.  ``DCPSTORE_MODEL_DEFECTS=all`` (or a comma-separated list of
names) switches rules on without editing, to look for them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import io
import os
import re
import struct
import threading
import time
import types
import urllib.parse
import uuid

import s3fs

import torch
import torch.distributed.checkpoint as dcp
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torchtitan.components.checkpointer.dcp import CheckpointManager
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException

import dcpstore
from dcpstore import cli
from dcpstore.export.hf import export_hf
from dist_utils import in_environment, rank_context, run_ranks
from helpers import zeros_like_state_dict
from model.invariants import Proven, Storage, Violation, check_all, step_folder
from model.oracle import Oracle, equal_states, flat_tensors
from model.planting import plant_republishable_metadata
from model.ranks import RESUME_THREAD_ENDED, STEP_NAMING, WORLD_SIZE, job, job_state
from s3server import Rule, flip_middle_byte

MiB = 1 << 20

# Each open defect, the issue that tracks it, and whether the rules that reach it are on.
DEFECTS = {
    "REUSED_WRITER_OVERWRITES_SHARDS": True,  # issue 56.1 (fixed): a reused writer's shard names repeated
    "GC_TAKES_A_LONG_UPLOAD": True,  # issue 56.2 (fixed): gc right after a long multipart upload of a dcpstore save
    "GC_TAKES_A_STOCK_SAVE": True,  # issue 56.2 (fixed): gc, then a stock writer's commit over the tombstone
    "GC_TAKES_A_RUNNING_EXPORT": False,  # issue 59.2: gc while an export reads its next tensors
    "COPY_SOURCE_CHANGED": True,  # issue 56.3 (fixed): an incremental copy of a source rewritten after its HEAD
    "TWO_EXPORTS_ONE_FOLDER": False,  # issue 59.1: the losing export deletes the winner's shards
    "EXPORT_OVERWRITE_LEFTOVERS": False,  # issue 59.4: --overwrite with another shard count
    "PLANTED_METADATA_REPUBLISHED": False,  # issue 58.2: a planted .metadata patched into the next step
    "LATE_TEMPLATE": False,  # issue 58.1: the resume thread installs the old structure's template mid-commit
    "ORPHAN_UPLOAD_AFTER_CLOSE": True,  # interactions F x S (fixed): a late 5xx create left an upload open after close()
    "STOCK_RESUME_INTO_TOMBSTONE": True,  # issue 56 ("read", fixed): gc's tombstone was the highest step a stock resume saw
}
_asked = os.environ.get("DCPSTORE_MODEL_DEFECTS", "")
for _name in DEFECTS if _asked == "all" else [n for n in _asked.split(",") if n]:
    DEFECTS[_name] = True


def rules_for(defect: str):
    """A precondition: the rule reaches ``defect``, so it runs only while that defect's flag is on, once an example.

    Such rules race a mechanism against another with holds at the proxy;
    they run with no fault armed (a fault would be their race's, not the
    defect's).  Once an example: hypothesis draws a rule that takes no
    arguments far more often than its share, and these wait out graces
    (before, one took 192 of a campaign's 344 rule runs).
    """

    def decorate(fn):
        name = fn.__name__
        return precondition(lambda self: DEFECTS[defect] and not self.faults and not self.runs[name])(fn)

    return decorate


RULES_RUN: collections.Counter = collections.Counter()  # rule name -> times run, for the campaign's summary line


def counted(fn):
    """Count each run of a rule in ``RULES_RUN`` (under ``@rule``)."""

    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        RULES_RUN[fn.__name__] += 1
        self.runs[fn.__name__] += 1
        return fn(self, *args, **kwargs)

    return run


# Parts of 5 MiB: the 6 MiB frozen tensor goes in a multipart upload of two
# parts, and incremental saves copy it server-side.
TRANSFER = dcpstore.TransferConfig(part_size=5 * MiB, multipart_threshold=5 * MiB)
FROZEN = torch.arange(6 * MiB // 4, dtype=torch.float32)  # never changes: what incremental saves copy
GRACE = 1.0  # seconds, gc's grace in the rules that race it
WAIT = 120.0  # seconds: a bound on waiting for a held request to arrive, not a deadline the test expects to meet
PLAIN_STEP = 900  # the step a reused plain writer saves to, again and again (overwrite=True)


def state(version: int, structure: str = "A") -> dict:
    """A training state: a model, an optimizer's state, a bytes item; structure B drops a key and adds one."""
    g = torch.Generator().manual_seed(version)
    model = {"embed.weight": torch.randn(64, 32, generator=g), "frozen": FROZEN.clone()}
    if structure == "A":
        model["norm.weight"] = torch.randn(32, generator=g).to(torch.bfloat16)
    else:
        model["head.weight"] = torch.randn(16, 32, generator=g, dtype=torch.float64)
    return {
        "model": model,
        "optim": {"exp_avg": torch.randn(64, 32, generator=g), "step": torch.tensor(version)},
        "extra": f"version {version}".encode(),
    }


@dataclasses.dataclass
class World:
    """What the test gives the machine: the bucket, the proxy in front of the server, the server itself."""

    bucket: str
    proxy: object  # s3server.FaultProxy
    endpoint: str  # the server, without the proxy (the invariants read from it)
    tmp: str


WORLD: World | None = None  # set by tests/test_model.py before the machine runs


def _child_save(root: str, endpoint: str, number: int, version: int, structure: str) -> None:
    """A job's process that saves one step (killed mid-save by ``kill_a_save``)."""
    ckpt = dcpstore.AsyncCheckpointer(root, storage_options={"endpoint_url": endpoint}, transfer=TRANSFER, step_naming=STEP_NAMING)
    ckpt.save(state(version, structure), step=number).result()
    ckpt.close()


class CheckpointWorld(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        world = WORLD
        self.bucket, self.proxy, self.tmp = world.bucket, world.proxy, world.tmp
        self.prefix = f"run-{uuid.uuid4().hex[:8]}"
        self.root = f"s3://{self.bucket}/{self.prefix}"
        self.options = {"endpoint_url": self.proxy.endpoint}
        self.storage = Storage(world.endpoint, self.bucket, self.prefix)
        self.proven = Proven()
        self.oracle = Oracle()
        self.sentinel = os.path.join(self.tmp, f"{self.prefix}-planted-call-ran")
        self.job: dcpstore.AsyncCheckpointer | None = None
        self.job_parent: int | None = None  # the step the job continues from
        self.plain_writer: dcpstore.ObjectStoreWriter | None = None
        self.next_number = 1
        self.version = 0
        self.faults: list[str] = []  # armed for the next operation
        self.exports = 0
        self.export_sizes: dict[str, str] = {}  # folder -> the --max-shard-size of its committed export
        self.killed: set[int] = set()  # steps whose saving process was killed: their uploads may stay open
        self.plants = 0
        self.runs: collections.Counter = collections.Counter()  # rule name -> times run in this example
        self.ranked: dict[int, str] = {}  # steps saved by a job of two ranks -> their structure
        self.templated: set[int] = set()  # of those, the steps whose commit had a parent: they carry a template
        self.proxy.clear()

    @initialize(keep_last=st.none() | st.integers(1, 3), incremental=st.booleans())
    def configure(self, keep_last, incremental):
        self.keep_last, self.incremental = keep_last, incremental

    def teardown(self):
        self.proxy.clear()
        for closing in (self.job, self.plain_writer):
            if closing is not None:
                with contextlib.suppress(Exception):
                    closing.close()

    # -- helpers ---------------------------------------------------------------------------------

    def _job(self) -> dcpstore.AsyncCheckpointer:
        if self.job is None:
            self.job = dcpstore.AsyncCheckpointer(
                self.root, storage_options=self.options, keep_last=self.keep_last, incremental=self.incremental,
                transfer=TRANSFER, commit_window=10.0, step_naming=STEP_NAMING,
            )
        return self.job

    def _new(self, structure: str = "A") -> tuple[int, dict]:
        number, self.next_number = self.next_number, self.next_number + 1
        self.version += 1
        return number, state(self.version, structure)

    def _url(self, number: int) -> str:
        return f"s3://{self.bucket}/{self.storage.step_prefix(number)}"

    def _let_late_requests_land(self) -> None:
        """Wait until every request a fault answered early (``lands_after``) reached the server: what a writer's close() can clean up.

        An upload a late create makes after close() is gc's (documented);
        before it, the writer's close must abort it.
        """
        for late in list(self.proxy.rules):
            if late.lands_after is not None and late.hits:
                late.landed.wait(WAIT)

    def _operation_done(self) -> None:
        """Faults last for one operation."""
        self.proxy.rules.clear()
        self.faults = []

    def _stock_writer(self, number: int) -> FsspecWriter:
        """Stock torch's writer over s3fs, through the proxy; botocore's timeouts short, so a lost answer costs seconds."""
        return FsspecWriter(self._url(number), endpoint_url=self.proxy.endpoint, config_kwargs={"read_timeout": 5, "connect_timeout": 5})

    def _committed_numbers(self) -> list[int]:
        return sorted(n for n, s in self.oracle.steps.items() if s.committed and not s.removable and not s.tampered)

    def _fault_hit(self) -> bool:
        """Whether an armed fault met a request of this operation (call before ``_operation_done``)."""
        return any(rule.hits for rule in self.proxy.rules)

    def _failed(self, what: str, error: BaseException, faulted: bool | None = None) -> None:
        """A failure reported to the user: fine where an armed fault met one of its requests (``faulted``), a violation otherwise."""
        if not (self._fault_hit() if faulted is None else faulted):
            raise Violation(f"{what} failed with no fault injected: {error!r}") from error

    def _gc(self, *args: str) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            rc = cli.main(["gc", self.root, *args])
        if rc != 0:
            raise Violation(f"dcpstore gc {' '.join(args)} exited {rc}")

    # -- faults, armed for the next operation ----------------------------------------------------

    FAULTS = {
        # The server took the PUT; its answer is lost.
        "lost_answer": dict(method="PUT", pattern=r"\.distcp", drop_response=True, times=1),
        # 500 now; the same request lands on the server a moment later.
        "late_5xx": dict(method="PUT", pattern=r"\.distcp", status=500, code="InternalError", lands_after=0.2, times=1),
        "throttle": dict(method="PUT", pattern=r"/step-", status=503, code="SlowDown", times=3),
        "cut_body": dict(method="GET", pattern=r"\.distcp", truncate=True, times=1),
        # Every write of a rank's second shard is refused: the save fails after writing its first.
        "refused_shard": dict(method="PUT", pattern=r"_1\.distcp", status=403, code="AccessDenied"),
        "lost_commit_answer": dict(method="PUT", pattern=r"/\.metadata$", drop_response=True, times=1),
    }
    # Faults on a multipart upload's start and completion: uploads the writer may not know it opened.
    UPLOAD_FAULTS = {
        "lost_create_answer": dict(method="POST", pattern=r"\.distcp\?uploads", drop_response=True, times=1),
        "late_5xx_completion": dict(method="POST", pattern=r"\.distcp\?uploadId=", status=500, code="InternalError",
                                    lands_after=0.2, times=1),
        # A gateway's 500 to CreateMultipartUpload that the store completes later: a second upload of the key.
        "late_5xx_create": dict(method="POST", pattern=r"\.distcp\?uploads", status=500, code="InternalError",
                                lands_after=0.2, times=1),
    }

    @precondition(lambda self: not self.faults)  # one kind at a time: the operation after it meets that fault
    @rule(kind=st.sampled_from(sorted(FAULTS) + (sorted(UPLOAD_FAULTS) if DEFECTS["ORPHAN_UPLOAD_AFTER_CLOSE"] else [])))
    @counted
    def arm_fault(self, kind):
        spec = dict({**self.FAULTS, **self.UPLOAD_FAULTS}[kind])
        self.proxy.rules.append(Rule(spec.pop("method"), re.compile(spec.pop("pattern")), **spec))
        self.faults.append(kind)

    # -- saves -------------------------------------------------------------------------------------

    @rule(structure=st.sampled_from("AB"), again=st.booleans())
    @counted
    def save_with_checkpointer(self, structure, again):
        """``AsyncCheckpointer.save``; ``again``: under a number already committed (refused: steps are never overwritten)."""
        job = self._job()
        number, content = self._new(structure)
        committed = self._committed_numbers()
        if again and committed:
            number = committed[-1]
        try:
            job.save(content, step=number).result()
        except dcpstore.CheckpointExistsError:
            if number not in committed:
                raise
        except dcpstore.CommitOutcomeUnknownError:
            self.oracle.unknown(number, content, self.job_parent, sequenced=True)
        except dcpstore.CheckpointSaveError as e:
            if isinstance(e.__cause__, dcpstore.CheckpointExistsError) and number in committed:
                pass
            else:
                self._failed(f"AsyncCheckpointer.save of step {number}", e)
                self.oracle.failed(number)
        else:
            if again and number in committed:
                raise Violation(f"step {number} was committed again over a committed step")
            self.oracle.committed(number, content, self.job_parent, sequenced=True)
            self.job_parent = number
            if self.keep_last is not None:
                self.oracle.keep_last(self.keep_last, just_committed=number)
        finally:
            self._operation_done()

    @rule(reused=st.booleans(), overwrite=st.booleans(), asynchronous=st.booleans())
    @counted
    def save_with_plain_dcp(self, reused, overwrite, asynchronous):
        """Plain ``dcp.save`` (or ``dcp.async_save``, waited for) with a fresh writer, or one writer reused across saves (``overwrite=True``, one step)."""
        reused = reused and DEFECTS["REUSED_WRITER_OVERWRITES_SHARDS"]
        number, content = self._new()
        if reused:
            number = PLAIN_STEP
            if self.plain_writer is None:
                self.plain_writer = dcpstore.ObjectStoreWriter(
                    self._url(number), storage_options=self.options, overwrite=True, transfer=TRANSFER)
            writer = self.plain_writer
        else:
            writer = dcpstore.ObjectStoreWriter(self._url(number), storage_options=self.options, overwrite=overwrite, transfer=TRANSFER)
        try:
            if asynchronous:
                dcp.async_save(content, storage_writer=writer).result()
            else:
                dcp.save(content, storage_writer=writer)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            if isinstance(_cause(e), dcpstore.CommitOutcomeUnknownError):
                self.oracle.unknown(number, content)
            else:
                self._failed(f"dcp.save of step {number}", e)
                self.oracle.failed(number)
        else:
            self.oracle.committed(number, content)
        finally:
            if not reused:
                self._let_late_requests_land()
                writer.close()
            self._operation_done()
        if not reused:
            self._check_no_open_uploads_after_a_clean_close(number)

    @rule(structure=st.sampled_from("AB"))
    @counted
    def save_with_stock_writer(self, structure):
        """Stock ``FsspecWriter`` over s3fs (what stock torchtitan writes with) saves a step under the same root."""
        number, content = self._new(structure)
        try:
            dcp.save(content, storage_writer=self._stock_writer(number))
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - stock torch: whatever it raises is a failed save
            self._failed(f"a stock FsspecWriter save of step {number}", e)
            self.oracle.failed(number)
        else:
            self.oracle.committed(number, content)
        finally:
            self._operation_done()

    @precondition(lambda self: not self.faults)  # a fault could end the save before the request it is killed at
    @rule(at=st.sampled_from(["shard", "commit"]))
    @counted
    def kill_a_save(self, at):
        """A job's process is killed while its save waits on a shard PUT, or on its ``.metadata`` PUT (which then lands)."""
        number, content = self._new()
        pattern = rf"/{step_folder(number)}/" + (r"__" if at == "shard" else r"\.metadata$")
        hold = threading.Event()
        held = Rule("PUT", re.compile(pattern), hold=hold, times=1)
        self.proxy.rules.append(held)
        ctx = rank_context()
        child = ctx.Process(target=in_environment, args=(dict(os.environ), _child_save, self.root, self.proxy.endpoint, number, self.version, "A"))
        child.start()
        try:
            if not held.arrived.wait(WAIT):
                raise AssertionError(f"the killed save's {at} PUT never came")
            child.kill()
            child.join()
        finally:
            hold.set()
            held.answered.wait(WAIT)
            self._operation_done()
        if at == "commit":  # the .metadata PUT landed after the process died: committed, and nobody was told
            self.oracle.unknown(number, content)
        else:
            self.oracle.failed(number)
        self.killed.add(number)

    # -- restarts ------------------------------------------------------------------------------------

    @rule(data=st.data(), stock=st.booleans())
    @counted
    def restart(self, data, stock):
        """The job closes (cleanly) and a new one resumes: the latest step, or an earlier one; or stock torchtitan resumes the root."""
        if stock:
            return self._resume_as_stock_torchtitan_does(after_gc_now=False)
        if self.job is not None:
            self.job.close()
            self.job = None
            self._check_no_open_uploads_after_a_clean_close()
        job = self._job()
        try:
            latest = job.latest_step()
            committed = self._committed_numbers()
            if latest is None:
                if committed:
                    raise Violation(f"latest_step() is None; committed: {committed}")
                self.job_parent = None
                return
            newest = self.oracle.clear_newest()
            if newest is not None and latest != newest.number and not any(t > newest.committed_at for t in self.oracle.planted.values()):
                raise Violation(f"latest_step() is {latest}; the newest commit is step {newest.number}")
            number = data.draw(st.sampled_from([latest, *committed]), label="resume step")
            step = self.oracle.steps.get(number)
            like = step.contents[-1] if step is not None and step.contents[-1] is not None else state(0)
            target = zeros_like_state_dict(like)
            try:
                got = job.load(target, step=number)
            except (dcpstore.DcpstoreError, dcpstore.CheckpointLoadError) as e:
                if number in self.oracle.planted or (step is not None and step.tampered) or self._fault_hit():
                    self.job_parent = None
                    return
                raise Violation(f"a restart could not load step {number}: {e!r}") from e
            if number in self.oracle.planted:
                raise Violation(f"a restart resumed the planted step {number}")
            if got != number:
                raise Violation(f"load(step={number}) loaded step {got}")
            if step is None or not any(c is not None and equal_states(target, c) for c in step.contents):
                raise Violation(f"a restart loaded step {got} with other values than its save was reported to hold")
            self.job_parent = number
        finally:
            self._operation_done()

    @precondition(lambda self: len(self._rollback_points()) > 0)
    @rule(data=st.data())
    @counted
    def roll_back(self, data):
        """A rollback, as torchtitan's ``load_step`` and the README do it: load an earlier step, discard the steps committed after it."""
        number = data.draw(st.sampled_from(self._rollback_points()), label="roll back to")
        job = self._job()
        try:
            job.load(zeros_like_state_dict(self.oracle.steps[number].contents[0]), step=number)
            point = self.oracle.steps[number]
            for later in job.steps_committed_after(number):
                step = self.oracle.steps.get(later)
                if step is not None and step.sequenced and step.sequence is not None and step.sequence < point.sequence:
                    raise Violation(f"steps_committed_after({number}) names step {later}, committed before it")
                job.discard_step(later)
                if step is not None:
                    step.removable = True
        finally:
            self._operation_done()
        self.job_parent = number

    def _rollback_points(self) -> list[int]:
        """Committed steps of this process's job, other than the newest: where a rollback may go."""
        newest = self.oracle.clear_newest()
        mine = [n for n in self._committed_numbers() if n not in self.ranked and self.oracle.steps[n].sequenced]
        return [n for n in mine if newest is not None and n != newest.number]

    def _resume_as_stock_torchtitan_does(self, after_gc_now: bool):
        """Stock torchtitan 0.3's resume: its own ``_find_load_step`` (the highest ``step-N`` folder with a ``.metadata``), then ``FsspecReader``.

        A collection's tombstone stays for up to two graces (dcpstore's
        ``collection``: marked, then swept), and stock torchtitan takes any
        ``.metadata`` for a checkpoint: it meets one only before a collection
        is done, never right after ``dcpstore gc --now`` (``after_gc_now``).
        """
        s3fs.S3FileSystem.clear_instance_cache()  # its listing, as a freshly started job's
        highest = CheckpointManager._find_load_step(types.SimpleNamespace(folder=self.root))
        step = self.oracle.steps.get(highest)
        if highest < 0 or highest in self.oracle.planted or (step is not None and step.tampered):
            return  # planted or rewritten bytes are any stock reader's hazard, not a step dcpstore wrote
        if step is None or not step.committed:
            if not (DEFECTS["STOCK_RESUME_INTO_TOMBSTONE"] and after_gc_now):
                return
            raise Violation(f"stock torchtitan resumes step {highest}, the highest with a .metadata, which is not a checkpoint")
        loaded = zeros_like_state_dict(step.contents[0])
        try:
            dcp.load(loaded, storage_reader=FsspecReader(self._url(highest), endpoint_url=self.proxy.endpoint))
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            if not self._fault_hit():
                raise Violation(f"stock torchtitan's resume of step {highest} failed: {e!r}") from e
        else:
            if not equal_states(loaded, step.contents[0]):
                raise Violation(f"stock torchtitan resumed step {highest} with other values than its save was reported to hold")
        finally:
            self._operation_done()

    def _check_no_open_uploads_after_a_clean_close(self, number: int | None = None) -> None:
        """After a writer's ``close()``: nothing of it left open (under step ``number``, or under the root but killed saves' steps)."""
        killed = tuple(f"{self.storage.step_prefix(n)}/" for n in self.killed)
        prefix = self.prefix if number is None else self.storage.step_prefix(number)
        left = [key for key in self.storage.open_uploads(prefix) if not key.startswith(killed)]
        if left:
            raise Violation(f"uploads left open after a clean close(): {left}")

    # -- gc -------------------------------------------------------------------------------------

    @rule(grace=st.sampled_from([GRACE, 3600.0]), keep_last=st.none() | st.integers(1, 3), aged=st.booleans(), now=st.booleans())
    @counted
    def gc(self, grace, keep_last, aged, now=False):
        """``dcpstore gc`` of the root, while no save runs (the rules below race it with one); ``aged``: once what is there is older than the grace.

        ``now`` (with the short grace): ``--now``, which waits out the grace
        between mark, sweep and unmark; after it, stock torchtitan resumes a
        checkpoint, never a tombstone.
        """
        now = now and grace == GRACE
        if aged and grace == GRACE:
            time.sleep(2 * GRACE)  # objects age on the server's clock: no event stands for that
        try:
            self._gc("--grace", str(grace), *(["--keep-last", str(keep_last)] if keep_last else []), *(["--now"] if now else []))
        finally:
            self._operation_done()
        if keep_last is not None:
            self.oracle.keep_last(keep_last)
        if now:
            self._resume_as_stock_torchtitan_does(after_gc_now=True)

    @rules_for("GC_TAKES_A_LONG_UPLOAD")
    @rule()
    @counted
    def gc_right_after_a_long_upload(self):
        """A save's multipart shard takes longer than the grace; gc runs the moment it completes, before the commit."""
        job = self._job()
        number, content = self._new()
        step = rf"/{step_folder(number)}/"
        last_part, commit = threading.Event(), threading.Event()
        part = Rule("PUT", re.compile(step + r"__.*partNumber=2"), hold=last_part, times=1)
        put = Rule("PUT", re.compile(step + r"\.metadata$"), hold=commit, times=1)
        self.proxy.rules += [part, put]
        handle = job.save(content, step=number)
        try:
            assert part.arrived.wait(WAIT), "the frozen tensor's last part never came"
            time.sleep(2 * GRACE)  # the upload ages past the grace on the server's clock: no event stands for that
            last_part.set()
            assert put.arrived.wait(WAIT), "the commit never came"
            self._gc("--grace", str(GRACE))
        finally:
            last_part.set()
            commit.set()
        self._expect_committed(handle, number, content)

    @rules_for("GC_TAKES_A_STOCK_SAVE")
    @rule()
    @counted
    def gc_while_a_stock_save_commits(self):
        """A stock writer's shards land; its coordinator is slow to commit; gc runs meanwhile, then the commit lands."""
        number, content = self._new()
        commit = threading.Event()
        put = Rule("PUT", re.compile(rf"/{step_folder(number)}/\.metadata$"), hold=commit, times=1)
        self.proxy.rules.append(put)
        saver = _InBackground(lambda: dcp.save(content, storage_writer=self._stock_writer(number)))
        try:
            assert put.arrived.wait(WAIT), "the stock commit never came"
            time.sleep(2 * GRACE)
            self._gc("--grace", str(GRACE))
        finally:
            commit.set()
            saver.join()
            self._operation_done()
        if saver.error is not None:
            self.oracle.failed(number)
            raise Violation(f"gc took a stock save of step {number} whose shards were all written: {saver.error!r}")
        self.oracle.committed(number, content)

    def _expect_committed(self, handle, number: int, content: dict) -> None:
        try:
            handle.result()
        except dcpstore.CheckpointSaveError as e:
            self.oracle.failed(number)
            raise Violation(f"gc took the save of step {number}, which would have committed: {e!r}") from e
        finally:
            self._operation_done()
        self.oracle.committed(number, content, self.job_parent, sequenced=True)
        self.job_parent = number
        if self.keep_last is not None:
            self.oracle.keep_last(self.keep_last, just_committed=number)

    # -- incremental copies ------------------------------------------------------------------------

    @rules_for("COPY_SOURCE_CHANGED")
    @precondition(lambda self: self.incremental and self.job is not None and self.job_parent is not None)
    @rule()
    @counted
    def rewrite_a_copy_source_mid_copy(self):
        """Another writer rewrites the object an incremental save copies from, same length, while the copy is on its way."""
        job = self._job()
        source = self.job_parent
        number, content = self._new()
        release = threading.Event()
        copy = Rule("PUT", re.compile(rf"/{step_folder(number)}/"), header="x-amz-copy-source", hold=release, times=1)
        self.proxy.rules.append(copy)
        handle = job.save(content, step=number)
        try:
            if copy.arrived.wait(WAIT):
                self._rewrite_same_length(source)
        finally:
            release.set()
        self._expect_committed(handle, number, content)

    def _rewrite_same_length(self, number: int) -> None:
        """A bucket writer flips one byte of every shard of step ``number``: its bytes are no longer what it committed."""
        s3, prefix = self.storage.s3, self.storage.step_prefix(number)
        for key in self.storage.keys(prefix):
            if key.endswith(".distcp"):
                s3.put_object(Bucket=self.bucket, Key=key, Body=flip_middle_byte(self.storage.read(key)))
        self.oracle.steps[number].tampered = True

    # -- exports ---------------------------------------------------------------------------------

    @precondition(lambda self: self._committed_numbers())
    @rule(data=st.data(), shard_size=st.sampled_from(["20KB", "5GB"]), again=st.booleans())
    @counted
    def export(self, data, shard_size, again):
        """``export_hf`` of a committed step, into a new folder or over the last one (``overwrite``)."""
        number = data.draw(st.sampled_from(self._committed_numbers()), label="step")
        folder, overwrite = self._export_folder(again)
        if overwrite and not DEFECTS["EXPORT_OVERWRITE_LEFTOVERS"]:
            # Another shard count leaves the old shards (issue 59.4): the same step at the same size, or a new folder.
            last = self.oracle.exports.get(folder)
            if last is not None and last.step in self._committed_numbers():
                number, shard_size = last.step, self.export_sizes[folder]
            else:
                folder, overwrite = self._export_folder(again=False)
        try:
            export_hf(self._url(number), f"s3://{self.bucket}/{folder}", max_shard_size=shard_size,
                      overwrite=overwrite, storage_options=self.options)
        except Exception as e:  # noqa: BLE001
            self._failed(f"export-hf of step {number}", e)
        else:
            self._exported(folder, number, shard_size)
        finally:
            self._operation_done()

    def _export_folder(self, again: bool) -> tuple[str, bool]:
        if again and self.exports:
            return f"{self.prefix}/exports/e{self.exports}", True
        self.exports += 1
        return f"{self.prefix}/exports/e{self.exports}", False

    def _export_in_shards(self, number: int, folder: str) -> None:
        """``export_hf`` of step ``number`` into ``folder``, in shards of 20 KB: a few of them, for rules that race one."""
        export_hf(self._url(number), f"s3://{self.bucket}/{folder}", max_shard_size="20KB", storage_options=self.options)

    def _exported(self, folder: str, number: int, shard_size: str) -> None:
        self.oracle.exported(folder, number, flat_tensors(self.oracle.steps[number].contents[0]))
        self.export_sizes[folder] = shard_size

    @rules_for("TWO_EXPORTS_ONE_FOLDER")
    @precondition(lambda self: self._committed_numbers())
    @rule(data=st.data())
    @counted
    def two_exports_race_for_one_folder(self, data):
        """Two exports of a step into one folder (a retry beside a stuck first attempt): both reach their index PUT."""
        number = data.draw(st.sampled_from(self._committed_numbers()), label="step")
        folder, _ = self._export_folder(again=False)
        first, second = threading.Event(), threading.Event()
        index = re.compile(rf"/{re.escape(folder)}/model\.safetensors\.index\.json$")
        rules = [Rule("PUT", index, hold=first, times=1), Rule("PUT", index, hold=second, times=1)]
        self.proxy.rules += rules
        exports = [_InBackground(lambda: self._export_in_shards(number, folder)) for _ in range(2)]
        try:
            for held in rules:
                held.arrived.wait(WAIT)
        finally:
            first.set()
            second.set()
            for export in exports:
                export.join()
            self._operation_done()
        committed = [export for export in exports if export.error is None]
        if len(committed) > 1:
            raise Violation(f"two exports into {folder} both committed")
        if committed:
            self._exported(folder, number, "20KB")

    @rules_for("GC_TAKES_A_RUNNING_EXPORT")
    @precondition(lambda self: self._committed_numbers())
    @rule(data=st.data())
    @counted
    def gc_while_an_export_runs(self, data):
        """An export writes its first shard, then its source is slow; gc runs past the grace; the export goes on."""
        number = data.draw(st.sampled_from(self._committed_numbers()), label="step")
        folder, _ = self._export_folder(again=False)
        release = threading.Event()
        second = Rule("PUT", re.compile(rf"/{re.escape(folder)}/model-00002-of-"), hold=release, times=1)
        self.proxy.rules.append(second)
        exporter = _InBackground(lambda: self._export_in_shards(number, folder))
        try:
            if second.arrived.wait(WAIT):
                time.sleep(2 * GRACE)
                self._gc("--grace", str(GRACE))
        finally:
            release.set()
            exporter.join()
            self._operation_done()
        if exporter.error is None:
            self._exported(folder, number, "20KB")

    # -- bytes planted in the bucket -----------------------------------------------------------------

    @precondition(lambda self: self.plants < 3)  # a few plants a root: a cheap rule would crowd out the rest
    @rule(kind=st.sampled_from(["foreign_global", "bomb", "truncated", "truncated_export_index"]))
    @counted
    def plant_a_step(self, kind):
        """A bucket writer puts a ``.metadata`` that is not a checkpoint under the next step number (or a broken export index)."""
        self.plants += 1
        if kind == "truncated_export_index":  # an export folder's index cut short: no reader's, gc's or ls's crash
            self.storage.s3.put_object(Bucket=self.bucket, Key=f"{self.prefix}/exports/planted/model.safetensors.index.json",
                                       Body=b'{"metadata": {"total_size": 1}, "weight_map": {"a": "model-0000')
            return
        number, _ = self._new()
        committed = self._committed_numbers()
        if kind == "foreign_global":
            body = _pickle_calling_mkdir(self.sentinel)
        elif kind == "bomb":  # a string that declares a terabyte: bounded before anything is allocated
            body = b"\x80\x04\x8d" + struct.pack("<Q", 1 << 40) + b"x" * 64 + b"."
        else:
            body = self.storage.read(f"{self.storage.step_prefix(committed[-1])}/.metadata")[:-40] if committed else b"\x80\x04"
        self.storage.s3.put_object(Bucket=self.bucket, Key=f"{self.storage.step_prefix(number)}/.metadata", Body=body)
        self.oracle.plant(number)
        reader = dcpstore.ObjectStoreReader(self._url(number), storage_options=self.options)
        try:
            reader.read_metadata()
        except dcpstore.DcpstoreError:
            pass
        else:
            raise Violation(f"dcpstore read the planted .metadata of step {number} ({kind})")
        finally:
            reader.close()

    # -- jobs of two gloo ranks ---------------------------------------------------------------------

    def _resumable(self) -> tuple[int, str] | None:
        """The step a restarted two-rank job resumes, and its structure, when the oracle knows it for sure."""
        newest = self.oracle.clear_newest()
        if newest is None or newest.number not in self.ranked:
            return None
        for number, source in self.oracle.planted_from.items():
            if self.oracle.planted[number] > newest.committed_at:
                return number, self.ranked[source]  # a plant is newer: the restart meets it
        return newest.number, self.ranked[newest.number]

    @rule(structure=st.sampled_from("AB"), resume=st.booleans())
    @counted
    def save_with_two_ranks(self, structure, resume):
        """A job of two gloo ranks resumes the latest step (or starts afresh) and saves two steps.

        A resumed job that changes its structure is issue 58.1's race (the
        resume thread against the next save's template), won only by thread
        timing: while that defect is open, a resumed job keeps its structure.
        """
        resumed = self._resumable() if resume else None
        if resumed is not None and not DEFECTS["LATE_TEMPLATE"]:
            structure = resumed[1]
        self._run_two_rank_job(structure, resumed)

    def _run_two_rank_job(self, structure: str, resume: tuple[int, str] | None, signal_resume_thread: bool = False) -> None:
        saves = []
        for _ in range(2):
            number, _ = self._new()
            saves.append((number, self.version, structure))
        try:
            results = run_ranks(job, WORLD_SIZE, self.root, self.proxy.endpoint, TRANSFER, resume and resume[1], saves,
                                signal_resume_thread, collective_timeout=90)
            faulted = self._fault_hit()
        finally:
            self._operation_done()
        resumed = {rank: r[0] for rank, r in results.items()}
        outcomes = {rank: r[1] for rank, r in results.items()}
        kinds = {rank: {step: o.partition(":")[0] for step, o in told.items()} for rank, told in outcomes.items()}
        if len({repr(k) for k in kinds.values()}) > 1:
            raise Violation(f"the ranks were told different outcomes: {outcomes}")
        if resume is not None:
            self._check_resumed(resume[0], resumed)
        parent = resume[0] if resume is not None and resumed[0][0] is not None else None
        for number, version, structure in saves:
            outcome, content = outcomes[0][number], job_state(version, structure)
            if outcome == "committed":
                self.oracle.committed(number, content, parent, sequenced=True)
                self.ranked[number] = structure
                if parent is not None:
                    self.templated.add(number)
                parent = number
            elif outcome == "unknown":
                self.oracle.unknown(number, content, parent, sequenced=True)
            else:
                self._failed(f"a two-rank save of step {number}", RuntimeError(outcome), faulted)
                self.oracle.failed(number)

    def _check_resumed(self, number: int, resumed: dict) -> None:
        steps = {rank: got[0] for rank, got in resumed.items()}
        if len(set(steps.values())) > 1:
            raise Violation(f"the ranks resumed different steps: {steps}")
        got, state_or_error = resumed[0]
        if number in self.oracle.planted:
            if got is not None:
                raise Violation(f"a restart resumed step {got}, which a bucket writer planted (dcpstore's reader refuses it)")
            return
        if got is None:
            raise Violation(f"a restart could not resume step {number}: {state_or_error}")
        want = self.oracle.steps[got].contents
        for rank, (_, state) in resumed.items():
            if not any(c is not None and equal_states(state, _restricted(c, state)) for c in want):
                raise Violation(f"rank {rank} resumed step {got} with other values than its save was reported to hold")

    @rules_for("PLANTED_METADATA_REPUBLISHED")
    @precondition(lambda self: self._resumable() is not None and self._resumable()[0] in self.templated)
    @rule()
    @counted
    def plant_a_copy_of_the_latest_step(self):
        """A bucket writer copies the latest step under the next number, its ``.metadata`` calling ``os.mkdir``, and recomputes what vouches for it."""
        source = self._resumable()[0]
        number, _ = self._new()
        plant_republishable_metadata(self.storage.s3, self.bucket, self.prefix, source_step=source, planted_step=number,
                                     sentinel_dir=self.sentinel)
        self.oracle.plant(number, source)

    @rules_for("LATE_TEMPLATE")
    @precondition(lambda self: self._resumable() is not None and self._resumable()[0] in self.templated)
    @rule()
    @counted
    def restart_with_a_slow_resume_read(self):
        """A restarted job's read of the resumed ``.metadata`` is slow; it saves a new structure twice meanwhile.

        The resume thread's GET of the step's ``.metadata`` is held until the
        second save lists the root, the one request between its vote for a
        template and the patch; then that listing waits until the thread has
        ended: rank 0 joins it (by its name, the only thing of dcpstore's the
        test knows) and says so with a HEAD of a marker key.  A slow read at a
        restart, a throttled or stalled GET, makes the same order.
        """
        resumed, structure = self._resumable()
        folder = re.escape(self.prefix)
        get = self.proxy.add("GET", rf"/{folder}/{step_folder(resumed)}/\.metadata(\?|$)", hold=threading.Event(), times=1)
        first_commit = self.proxy.add("PUT", rf"/{folder}/{step_folder(self.next_number)}/\.metadata(\?|$)", hold=threading.Event(), times=1)
        thread_ended = self.proxy.add("HEAD", rf"/{folder}/{re.escape(RESUME_THREAD_ENDED)}$")
        listing = {}

        def conduct():
            if first_commit.arrived.wait(WAIT):
                quoted = urllib.parse.quote(f"{self.prefix}/", safe="")
                listing["rule"] = self.proxy.add(
                    "GET", rf"\?(?=.*list-type=2)(?=.*prefix={re.escape(quoted)}(&|$))(?=.*delimiter=%2F)", hold=threading.Event(), times=1)
                first_commit.hold.set()
                if listing["rule"].arrived.wait(WAIT):
                    get.hold.set()
                    thread_ended.arrived.wait(WAIT)
                listing["rule"].hold.set()
            get.hold.set()
            first_commit.hold.set()

        conductor = threading.Thread(target=conduct, daemon=True)
        conductor.start()
        try:
            self._run_two_rank_job("B" if structure == "A" else "A", (resumed, structure), signal_resume_thread=True)
        finally:
            for held in (get, first_commit, listing.get("rule")):
                if held is not None:
                    held.hold.set()
            conductor.join()

    # -- invariants --------------------------------------------------------------------------------

    @invariant()
    def storage_holds_what_users_were_told(self):
        check_all(self.oracle, self.storage, self.proven, self.sentinel)


class _InBackground:
    """``fn()`` on a thread of its own, started now; after ``join()``, ``error`` is what it raised, or ``None``."""

    def __init__(self, fn):
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,))
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            fn()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - the rule judges it
            self.error = e

    def join(self) -> None:
        self._thread.join()


def _cause(error: BaseException) -> BaseException:
    """The writer's own error inside torch's ``CheckpointException`` (the first failing rank's), or ``error``."""
    if isinstance(error, CheckpointException) and error.failures:
        first = next(iter(error.failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return error


def _restricted(content: dict, like: dict) -> dict:
    """The items of ``content`` that a rank's state ``like`` holds (a rank loads its own keys)."""
    return {k: _restricted(content[k], v) if isinstance(v, dict) else content[k] for k, v in like.items() if k in content}


def _pickle_calling_mkdir(path: str) -> bytes:
    """A pickle that calls ``os.mkdir(path)`` when loaded: what no reader of a checkpoint may ever run."""
    encoded = path.encode()
    return b"\x80\x02cos\nmkdir\nX" + struct.pack("<I", len(encoded)) + encoded + b"\x85R."

