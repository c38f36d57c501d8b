"""The model's jobs of two real gloo ranks (``dist_utils.run_ranks``): what only ranks together write and read.

A single rank's steps carry no resume index and no commit template, and
its restart reads ``.metadata`` alone; the template, the resume thread and
the ranks' agreement on outcomes exist only from two ranks on.
"""

from __future__ import annotations

import datetime
import threading

import boto3
import botocore.exceptions
import torch

import dcpstore

WORLD_SIZE = 2
STEP_NAMING = dcpstore.StepNaming.TORCHTITAN  # step-N folders: stock torchtitan resumes the model's roots too
RESUME_THREAD_ENDED = ".model-resume-thread-ended"  # a key rank 0 asks for (HEAD) when the resume thread has ended


def _signal_when_the_resume_thread_ends(root: str, endpoint: str) -> None:
    for thread in threading.enumerate():
        if thread.name == "dcpstore-global-plan":
            thread.join()
    bucket, _, prefix = root.removeprefix("s3://").partition("/")
    try:
        boto3.client("s3", endpoint_url=endpoint).head_object(Bucket=bucket, Key=f"{prefix}/{RESUME_THREAD_ENDED}")
    except botocore.exceptions.ClientError:
        pass  # 404: the request itself is the signal


def rank_state(rank: int, version: int, structure: str) -> dict:
    """Rank ``rank``'s state: a tensor of its own, a replicated one, and the replicated training state (bytes items).

    Structure B drops ``state.epoch`` and adds ``state.tokens`` (as many values, another key).
    """
    g = torch.Generator().manual_seed(version)
    model = {f"rank{rank}": torch.arange(8, dtype=torch.float32) + 1000 * version + 100 * rank, "shared": torch.randn(8, 8, generator=g)}
    state = {"epoch": 100 + version, "step": version} if structure == "A" else {"step": version, "tokens": 5_000_000 + version}
    return {"model": model, "state": state}


def job_state(version: int, structure: str) -> dict:
    """Every rank's items of one save in one state dict: what a single process loading the step gets."""
    out: dict = {"model": {}, "state": {}}
    for rank in range(WORLD_SIZE):
        sd = rank_state(rank, version, structure)
        out["model"].update(sd["model"])
        out["state"].update(sd["state"])
    return out


def job(rank, world_size, root, endpoint, transfer, resume: str | None, saves: list[tuple[int, int, str]],
        signal_resume_thread: bool = False):
    """A job: resume the latest step (saved with structure ``resume``) if given, then save ``(step, version, structure)`` each.

    ``signal_resume_thread``: once its last save is staged, rank 0 waits for
    the thread a resume leaves reading the step's ``.metadata``, and then
    asks for ``RESUME_THREAD_ENDED`` under the root (a HEAD the test holds
    a request on until it sees).  Returns ``(resumed, outcomes)``: the step
    and the state it loaded (or the error's class name), and each save's
    outcome as this rank was told.
    """
    ckpt = dcpstore.AsyncCheckpointer(
        root, storage_options={"endpoint_url": endpoint}, transfer=transfer, commit_window=10.0,
        collective_timeout=datetime.timedelta(seconds=60), step_naming=STEP_NAMING,
    )
    resumed = None
    if resume is not None:
        target = rank_state(rank, 0, resume)
        try:
            resumed = (ckpt.load(target), target)
        except dcpstore.CheckpointLoadError as e:
            resumed = (None, type(e.__cause__ or e).__name__)
        except dcpstore.DcpstoreError as e:
            resumed = (None, type(e).__name__)
    outcomes = {}
    for i, (step, version, structure) in enumerate(saves):
        try:
            handle = ckpt.save(rank_state(rank, version, structure), step=step)
            if signal_resume_thread and rank == 0 and i == len(saves) - 1:
                _signal_when_the_resume_thread_ends(root, endpoint)
            handle.result()
            outcomes[step] = "committed"
        except dcpstore.CommitOutcomeUnknownError:
            outcomes[step] = "unknown"
        except dcpstore.CheckpointSaveError as e:
            outcomes[step] = f"failed: {e}"
    ckpt.close()
    return resumed, outcomes
