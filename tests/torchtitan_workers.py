"""Training-loop workers for the torchtitan tests: torchtitan 0.3's real ``CheckpointManager`` on FSDP2 over gloo.

Each rank trains a ``TrainingJob`` (the benchmark's: a small FSDP2 model,
torchtitan's AdamW and LR scheduler containers, and a checkpoint manager,
torchtitan's own or dcpstore's, from the same ``Config`` fields).
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

from benchmarks.torchtitan import TrainingJob as Job


# -- workers (run_ranks) -------------------------------------------------------------------------


def train_then_die(rank, world_size, root, expected_path, async_mode, keep, proxy_endpoint):
    """Save steps 1-6 (interval 2), keep each step's full state in ``expected_path``, then SIGKILL in step 8's (slowed) upload."""
    job = Job(root, interval=2, keep_latest_k=keep, async_mode=async_mode, storage_options={"endpoint_url": proxy_endpoint})
    saved = {}
    for _ in range(3):
        job.train_and_save(2)
        saved[job.train_state.step] = job.full_state()
    job.manager.maybe_wait_for_saving()
    if rank == 0:
        torch.save(saved, expected_path)
    dist.barrier()
    job.train_and_save(2)  # step 8's save starts (async: it is uploading)
    os.kill(os.getpid(), signal.SIGKILL)


def resume_then_save(rank, world_size, root, async_mode, keep):
    """A restarted job: load the newest committed step, then train to the next save, counting its planning collectives."""
    from workers import count_collectives

    job = Job(root, interval=2, keep_latest_k=keep, async_mode=async_mode)
    assert job.manager.load()
    resumed = job.train_state.step, job.full_state()
    counts = count_collectives()
    job.train_and_save(2)
    job.manager.maybe_wait_for_saving()
    reused = job.manager.checkpointer.last_stats.plan_reused
    after = job.full_state()
    committed = job.manager.checkpointer.committed_steps()
    job.close()
    return resumed, dict(counts), reused, after, committed


def load_latest(rank, world_size, root, dcpstore):
    """Load the newest step into a fresh job (dcpstore's manager or torchtitan's) and return its full state."""
    job = Job(root, dcpstore=dcpstore, keep_latest_k=0)
    assert job.manager.load()
    state = job.full_state()
    job.close()
    return state


def save_steps(rank, world_size, root, dcpstore, steps, async_mode="disabled", keep=0):
    """Train and save ``steps`` steps with dcpstore's manager or torchtitan's; the full state after each."""
    job = Job(root, dcpstore=dcpstore, keep_latest_k=keep, async_mode=async_mode)
    states = {}
    for _ in range(steps):
        job.train_and_save(1)
        states[job.train_state.step] = job.full_state()
    job.close()
    return states


def interop(rank, world_size, root):
    """Stock torchtitan saves, dcpstore's manager resumes and saves on, stock torchtitan resumes that: one process.

    One process on purpose: torchtitan finds steps through fsspec's cached
    filesystem, which must see what dcpstore wrote.
    """
    stock = Job(root, dcpstore=False, keep_latest_k=0)
    stock.train_and_save(2)
    stock_state = stock.full_state()
    stock.close()

    ours = Job(root, keep_latest_k=0)
    assert ours.manager.load()
    resumed_stock = ours.full_state()
    ours.train_and_save(2)
    ours_state = ours.full_state()
    ours.close()

    stock = Job(root, dcpstore=False, keep_latest_k=0)
    assert stock.manager.load()
    resumed_ours = stock.full_state()
    stock.train_and_save(2)  # stock steps 5 and 6: no commit sequence, ordered by time among dcpstore's
    stock_state_2 = stock.full_state()
    stock.close()

    ours = Job(root, keep_latest_k=0)
    assert ours.manager.load()
    resumed_stock_2 = ours.full_state()
    ours.close()
    return stock_state, resumed_stock, ours_state, resumed_ours, stock_state_2, resumed_stock_2


def rollback(rank, world_size, root):
    """Steps 1-4, then a rollback to 2 (load_step) on another trajectory saves 3 and 4 again; a fresh job resumes the new 4."""
    job = Job(root, keep_latest_k=0)
    job.train_and_save(4)
    abandoned = job.full_state()
    job.close()

    job = Job(root, keep_latest_k=0)
    assert job.manager.load(step=2)
    with torch.no_grad():
        for p in job.model.parameters():
            p.add_(1.0)  # a different trajectory from step 2 on (a loss spike skipped, other data)
    job.train_and_save(2)
    redone = job.full_state()
    committed = job.manager.checkpointer.committed_steps()
    job.close()

    job = Job(root, keep_latest_k=0)
    assert job.manager.load()
    resumed = job.full_state()
    job.close()
    return abandoned, redone, committed, resumed


def rollback_then_restarts(rank, world_size, root):
    """Steps 1-4; roll back to 2 and save 3; a restart (the latest: the new 3) saves 4-6; another restart: committed steps and the step resumed each time.

    Issue 57.2: before, the first restart resumed the new 3 and died saving
    4 (``step 4 is already committed``), at every restart: only the process
    that rolled back knew 4 was abandoned.
    """
    job = Job(root, keep_latest_k=0)
    job.train_and_save(4)
    job.close()
    job = Job(root, keep_latest_k=0)
    assert job.manager.load(step=2)
    job.train_and_save(1)
    job.close()
    job = Job(root, keep_latest_k=0)
    assert job.manager.load()
    first = job.train_state.step
    job.train_and_save(3)
    committed = job.manager.checkpointer.committed_steps()
    job.close()
    job = Job(root, keep_latest_k=0)
    assert job.manager.load()
    second = job.train_state.step
    job.close()
    return first, committed, second


def rollbacks_delete_only_reused_abandoned_steps(rank, world_size, root):
    """Steps 0-4; load 4 and save 5; roll back to 2 and save 3 only; load 0 (a seed) and save 1: committed steps after each."""

    def committed(job):
        return job.manager.checkpointer.committed_steps()

    job = Job(root, keep_latest_k=0)
    job.manager.save(0)
    job.train_and_save(4)
    job.close()

    job = Job(root, keep_latest_k=0)  # an explicit load_step that is the newest step: no rollback
    assert job.manager.load(step=4)
    job.train_and_save(1)
    after_newest = committed(job)
    job.close()

    job = Job(root, keep_latest_k=0)  # a rollback that saves one step: only that number is reused
    assert job.manager.load(step=2)
    job.train_and_save(1)
    after_rollback = committed(job)
    job.close()

    job = Job(root, keep_latest_k=0)  # the seed checkpoint: its save of step 1 collides, and deletes nothing
    assert job.manager.load(step=0)
    try:
        job.train_and_save(1)
        seed_error = None
    except Exception as e:  # noqa: BLE001 - returned to the test
        seed_error = str(e)
    after_seed = committed(job)
    job.close()
    return after_newest, after_rollback, seed_error, after_seed


def failed_saves(rank, world_size, root, proxy_endpoint):
    """keep_latest_k=2: steps 1-2 commit, the proxy fails steps 3-4, step 5 commits; committed steps after each phase.

    Retention with ``gc_grace`` marks the killed save's debris at one
    commit and sweeps it at a later one, each once it is a grace old: the
    waits make steps 1 and 5 those commits, on a busy box or an idle one.
    """
    import dcpstore
    from conftest import wait_until_older_than

    store = dcpstore.storage.open_store(root, storage_options={"endpoint_url": proxy_endpoint})
    wait_until_older_than(store, 1)  # the debris is dead at step 1's commit: marked
    job = Job(root, keep_latest_k=2, gc_grace=1, storage_options={"endpoint_url": proxy_endpoint})
    job.train_and_save(2)
    errors = []
    for _ in range(2):
        job.train_step()
        try:
            job.manager.save(job.train_state.step)
        except dcpstore.CheckpointSaveError as e:
            errors.append(str(e))
    after_failures = job.manager.checkpointer.committed_steps()
    wait_until_older_than(store, 1)  # the mark is a grace old at step 5's commit: swept
    job.train_and_save(1)
    after_commit = job.manager.checkpointer.committed_steps()
    job.close()
    store.close()
    return errors, after_failures, after_commit


def pinned_round_trip(rank, world_size, root):
    """async_with_pinned_mem on CUDA: save steps 1-2, then a fresh job resumes step 2; both full states."""
    job = Job(root, device="cuda", keep_latest_k=0, async_mode="async_with_pinned_mem")
    job.train_and_save(2)
    saved = job.full_state()
    job.close()
    job = Job(root, device="cuda", keep_latest_k=0, async_mode="async_with_pinned_mem")
    assert job.manager.load()
    resumed = job.full_state()
    job.close()
    return saved, resumed
