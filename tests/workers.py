"""Functions that run on each spawned gloo rank (see dist_utils.run_ranks)."""

from __future__ import annotations

import collections
import datetime
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import dcpstore
from dcpstore.planner_data import strip_plan

ROWS = 24  # divisible by world sizes 1, 2, 3, 4


def full_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "sharded": torch.randn(ROWS, 16, generator=g),
        "sharded_int": torch.randint(0, 1000, (ROWS, 3), generator=g),
        "replicated": torch.randn(5, 5, generator=g),
    }


def sharded_state_dict(world_size: int, seed: int, zeros: bool = False) -> dict:
    """A state dict with DTensor shards, plain tensors and bytes items."""
    mesh = init_device_mesh("cpu", (world_size,))
    full = full_tensors(seed)
    if zeros:
        full = {k: torch.zeros_like(v) for k, v in full.items()}
    return {
        "model": {
            "sharded": distribute_tensor(full["sharded"], mesh, [Shard(0)]),
            "sharded_int": distribute_tensor(full["sharded_int"], mesh, [Shard(0)]),
            "replicated": full["replicated"],
        },
        "optim": {"step": 0 if zeros else 1000 + seed},
        "note": b"" if zeros else b"dcpstore",
    }


def gathered(sd: dict) -> dict:
    """Full tensors and values of a sharded state dict (same on every rank)."""
    m = sd["model"]
    return {
        "sharded": m["sharded"].full_tensor(),
        "sharded_int": m["sharded_int"].full_tensor(),
        "replicated": m["replicated"].clone(),
        "step": sd["optim"]["step"],
        "note": sd["note"],
    }


def local_plan_of(sd: dict, rank: int):
    planner = DefaultSavePlanner()
    planner.set_up_planner(sd, is_coordinator=rank == 0)
    return strip_plan(planner.create_local_plan())


# -- ObjectStoreWriter under dcp.save ----------------------------------------------------


def save_sharded(rank, world_size, url, seed):
    sd = sharded_state_dict(world_size, seed)
    dcp.save(sd, storage_writer=dcpstore.ObjectStoreWriter(url, objects_per_rank=2))
    return local_plan_of(sd, rank)


def load_sharded(rank, world_size, url, reader):
    sd = sharded_state_dict(world_size, 0, zeros=True)
    storage_reader = FsspecReader(url) if reader == "fsspec" else dcpstore.ObjectStoreReader(url)
    dcp.load(sd, storage_reader=storage_reader)
    return gathered(sd)


def async_save_in_checkpoint_process(rank, world_size, url, timeout):
    """``dcp.async_save`` through torch's checkpoint process; returns that process's pid.

    torch pickles the writer into its checkpoint process with every save,
    and that process joins a gloo group of its own (on ``MASTER_ADDR``).
    """
    from torch.distributed.checkpoint import _async_process_executor
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    sd = sharded_state_dict(world_size, 0)
    writer = dcpstore.ObjectStoreWriter(url, objects_per_rank=2)
    response = dcp.async_save(sd, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    getattr(response, "upload_completion", response).result(timeout=timeout)
    writer.close()
    return _async_process_executor._CHECKPOINT_PROCESS._save_process.pid


def save_with_failing_rank(rank, world_size, url, proxy_endpoint):
    """Rank 1 talks through a proxy that refuses its shard uploads."""
    options = {"endpoint_url": proxy_endpoint} if rank == 1 else None
    sd = sharded_state_dict(world_size, 0)
    try:
        dcp.save(sd, storage_writer=dcpstore.ObjectStoreWriter(url, storage_options=options))
    except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
        return str(e)
    return None


# -- AsyncCheckpointer ----------------------------------------------------------------------


OBJECT_COLLECTIVES = ("gather_object", "scatter_object_list", "all_gather_object", "broadcast_object_list")


def count_collectives() -> collections.Counter:
    """Count the object collectives (and the tensor ones: all_reduce, gather, broadcast) every later call makes."""
    counts: collections.Counter = collections.Counter()
    for name in (*OBJECT_COLLECTIVES, "all_reduce", "gather", "broadcast"):
        original = getattr(dist, name)

        def wrapper(*args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, wrapper)
    return counts


def _save_counted(ckpt, counts, sd, step):
    counts.clear()
    ckpt.save(sd, step=step)
    ckpt.wait()
    return dict(counts), ckpt.last_stats.plan_reused


def checkpointer_three_saves(rank, world_size, root, planning):
    counts = count_collectives()
    ckpt = dcpstore.AsyncCheckpointer(root, planning=planning)
    sd = sharded_state_dict(world_size, 0)
    out, staged = [], []
    for i, step in enumerate((10, 20, 30)):
        sd["optim"]["step"] = 10 ** (3 * i)  # pickled size changes from save to save
        sd["model"]["replicated"].add_(1)
        out.append(_save_counted(ckpt, counts, sd, step))
        staged.append(ckpt.last_stats.staged_items)
    ckpt.close()
    return out, gathered(sd), staged


def checkpointer_resume(rank, world_size, root, change_structure, endpoint=None):
    """A fresh job: load the latest step, then save once more, counting collectives.

    ``change_structure``: a new item in the state dict of every rank (True) or of rank 1 only ("rank 1").
    """
    counts = count_collectives()
    ckpt = dcpstore.AsyncCheckpointer(root, storage_options={"endpoint_url": endpoint} if endpoint else None)
    sd = sharded_state_dict(world_size, 0, zeros=True)
    step = ckpt.load(sd)
    loaded = gathered(sd)
    changed = change_structure is True or (change_structure == "rank 1" and rank == 1)
    if changed:
        sd["model"]["new_param"] = torch.ones(3)
    sd["model"]["replicated"].mul_(2)
    saved_counts, reused = _save_counted(ckpt, counts, sd, step + 1)
    expected = gathered(sd)
    check = sharded_state_dict(world_size, 0, zeros=True)
    if changed:
        check["model"]["new_param"] = torch.zeros(3)
    ckpt.load(check, step=step + 1)
    ckpt.close()
    return step, loaded, saved_counts, reused, expected, gathered(check)


def checkpointer_save_steps(rank, world_size, root, steps, seed):
    ckpt = dcpstore.AsyncCheckpointer(root)
    sd = sharded_state_dict(world_size, seed)
    for step in steps:
        ckpt.save(sd, step=step)
    ckpt.wait()
    ckpt.close()
    return gathered(sd)


def checkpointer_killed_mid_upload(rank, world_size, root, proxy_endpoint):
    """Step 1 commits; during step 2's (slowed) upload, rank 1 is SIGKILLed."""
    ckpt = dcpstore.AsyncCheckpointer(
        root,
        storage_options={"endpoint_url": proxy_endpoint},
        collective_timeout=datetime.timedelta(seconds=30),
    )
    sd = sharded_state_dict(world_size, 0)
    ckpt.save(sd, step=1)
    ckpt.wait()
    sd["model"]["replicated"].add_(5)
    return _save_step_2_and_kill_rank_1(ckpt, rank, sd)


def _save_step_2_and_kill_rank_1(ckpt, rank, sd):
    """Save ``sd`` as step 2 and SIGKILL rank 1 during its (slowed) upload; the survivors' error message."""
    ckpt.save(sd, step=2)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        ckpt.wait(timeout=60)
    except dcpstore.CheckpointSaveError as e:
        return str(e)
    return None


def checkpointer_upload_error(rank, world_size, root, proxy_endpoint):
    """Rank 1's uploads of step 2 are refused; step 3 must work again."""
    options = {"endpoint_url": proxy_endpoint} if rank == 1 else None
    ckpt = dcpstore.AsyncCheckpointer(root, storage_options=options)
    sd = sharded_state_dict(world_size, 0)
    ckpt.save(sd, step=1)
    ckpt.wait()
    ckpt.save(sd, step=2)
    error = None
    try:
        ckpt.wait()
    except dcpstore.CheckpointSaveError as e:
        error = (str(e), e.failures)
    ckpt.save(sd, step=3)
    ckpt.wait()
    latest = ckpt.latest_step()
    ckpt.close()
    return error, latest


def checkpointer_returns_before_upload(rank, world_size, root, proxy_endpoint):
    """Uploads are slowed by the proxy; save() must return while they run."""
    ckpt = dcpstore.AsyncCheckpointer(root, storage_options={"endpoint_url": proxy_endpoint})
    sd = sharded_state_dict(world_size, 0)
    handle = ckpt.save(sd, step=5)
    done_after_save = handle.done()
    committed_early = ckpt.maybe_finalize()
    visible_early = ckpt.store.exists("step_00000005/.metadata")
    ckpt.wait()
    visible_late = ckpt.store.exists("step_00000005/.metadata")
    ckpt.close()
    return done_after_save, committed_early, visible_early, visible_late


def checkpointer_load_errors(rank, world_size, root):
    """Loads that cannot succeed fail on every rank with the coordinator's error, or with rank 1's mismatch; the group stays usable."""
    ckpt = dcpstore.AsyncCheckpointer(root)
    sd = sharded_state_dict(world_size, 0, zeros=True)
    errors = []
    for step in (None, 99):
        try:
            ckpt.load(sd, step=step)
        except dcpstore.CheckpointNotFoundError as e:
            errors.append(str(e))
    ckpt.save(sharded_state_dict(world_size, 0), step=1).result()
    mismatched = sharded_state_dict(world_size, 0, zeros=True)
    if rank == 1:  # one rank's state dict does not match the checkpoint; the others' does
        mismatched["model"]["replicated"] = torch.zeros(4, 4)
    try:
        ckpt.load(mismatched, step=1)
        mismatch = None
    except dcpstore.CheckpointLoadError as e:
        mismatch = (type(e).__name__, str(e), type(e.__cause__).__name__)
    ckpt.load(sd, step=1)
    ckpt.close()
    return errors, mismatch, gathered(sd)


def checkpointer_plan_changes_on_one_rank(rank, world_size, root, rank0_drops_replicated=False):
    """Rank 0's structure changes while rank 1 saves from its cached plan.

    Rank 1 staged only what its cached plan writes (the replicated tensor
    is rank 0's to write); torch's dedup, greedy in item order, would now
    give it to rank 1.  It must go to rank 0, which staged it, and step 3
    commit.  With ``rank0_drops_replicated``, rank 0 no longer holds it:
    no rank staged it, step 3 fails on every rank, and step 4 commits.
    Returns rank 1's staged items under the cached plan, step 3's outcome,
    and whether steps 3 (if committed) and 4 load bit-exact.
    """
    ckpt = dcpstore.AsyncCheckpointer(root)
    replicated = torch.arange(100.0)
    sd = {"replicated": replicated, **({"q1": torch.randn(10)} if rank == 1 else {})}
    ckpt.save(sd, step=1)
    ckpt.save(sd, step=2)
    ckpt.wait()
    staged_cached = ckpt.last_stats.staged_items
    if rank == 0:
        sd = {"a_p0": torch.randn(10_000), **({} if rank0_drops_replicated else {"replicated": replicated})}
    saved3 = {k: v.clone() for k, v in sd.items()}
    try:
        ckpt.save(sd, step=3)
        for v in sd.values():
            v.add_(1)  # training goes on during the upload: step 3 must hold the values it was saved with
        ckpt.wait()
        outcome = "committed"
    except dcpstore.CheckpointSaveError as e:
        outcome = str(e)
    ckpt.save(sd, step=4).result()
    loaded = []
    for step, expected in ((3, saved3), (4, sd)):
        if step == 3 and outcome != "committed":
            continue
        out = {k: torch.zeros_like(v) for k, v in expected.items()}
        ckpt.load(out, step=step)
        loaded.append(all(torch.equal(out[k], expected[k]) for k in expected))
    ckpt.close()
    return staged_cached, outcome, loaded


def checkpointer_keep_last(rank, world_size, root):
    """What each rank lists after every save of a keep_last=2 run."""
    ckpt = dcpstore.AsyncCheckpointer(root, keep_last=2)
    sd = sharded_state_dict(world_size, 0)
    listed = []
    for step in (1, 2, 3, 4):
        ckpt.save(sd, step=step)
        listed.append(ckpt.committed_steps())
    ckpt.close()
    return listed


def rank_tensors(rank: int, mib: int = 6) -> dict[str, torch.Tensor]:
    """Two tensors of ``mib`` MiB that only this rank holds, seeded by its rank."""
    g = torch.Generator().manual_seed(rank)
    n = mib * (1 << 20) // 4
    return {f"r{rank}_a": torch.randn(n, generator=g), f"r{rank}_b": torch.randn(n, generator=g)}


def save_under_throttling(rank, world_size, url, proxy_endpoint, transfer):
    """Plain ``dcp.save`` of this rank's tensors through a throttling proxy; the seconds it took."""
    import time

    t0 = time.monotonic()
    writer = dcpstore.ObjectStoreWriter(
        url, storage_options={"endpoint_url": proxy_endpoint}, transfer=transfer, objects_per_rank=2
    )
    try:
        dcp.save(rank_tensors(rank), storage_writer=writer)
    finally:
        writer.close()
    return time.monotonic() - t0


def save_alone_under_throttling(rank, world_size, root, proxy_endpoint, transfer):
    """``save_under_throttling`` with no process group: each process its own checkpoint, ``{root}/w{rank}``."""
    return save_under_throttling(rank, world_size, f"{root}/w{rank}", proxy_endpoint, transfer)


def checkpointer_one_save(rank, world_size, root, proxy_endpoint, transfer, commit_window, collective_timeout=600.0):
    """Save step 1 through the proxy; ``None`` when committed, else the error's type and text.

    ``collective_timeout``: seconds, or a tuple of each rank's.
    """
    seconds = collective_timeout[rank] if isinstance(collective_timeout, tuple) else collective_timeout
    ckpt = dcpstore.AsyncCheckpointer(
        root, storage_options={"endpoint_url": proxy_endpoint}, transfer=transfer, commit_window=commit_window,
        collective_timeout=datetime.timedelta(seconds=seconds),
    )
    try:
        ckpt.save(sharded_state_dict(world_size, 0), step=1)
        ckpt.wait()
        return None
    except dcpstore.CheckpointSaveError as e:
        return type(e).__name__, str(e)
    finally:
        ckpt.close()


def checkpointer_slow_retention(rank, world_size, root, proxy_endpoint, transfer, collective_timeout):
    """Save steps 1 and 2 with keep_last=1 through the proxy, then ask for the latest step; every outcome in order."""
    ckpt = dcpstore.AsyncCheckpointer(
        root, keep_last=1, storage_options={"endpoint_url": proxy_endpoint}, transfer=transfer, commit_window=1.0,
        collective_timeout=datetime.timedelta(seconds=collective_timeout),
    )
    outcomes = []
    try:
        for step in (1, 2):
            ckpt.save(sharded_state_dict(world_size, step), step=step)
            try:
                ckpt.wait()
                outcomes.append("committed")
            except dcpstore.CheckpointSaveError as e:
                outcomes.append(f"{type(e).__name__}: {e}")
        outcomes.append(ckpt.latest_step())
    finally:
        ckpt.close()
    return outcomes


def checkpointer_coordinator_dies_at_commit(rank, world_size, root, transfer, commit_window, after_put, step=1):
    """Rank 0 dies at its ``.metadata`` PUT of ``step`` (before it is sent, or once it landed); the others report.

    Steps before ``step`` commit first (from the third save of a structure on, a commit is patched).
    Returns ``(outcome, seconds from the save to the outcome, object collectives of that save)`` on the ranks that live.
    """
    import time

    counts = count_collectives()
    ckpt = dcpstore.AsyncCheckpointer(
        root, transfer=transfer, commit_window=commit_window, collective_timeout=datetime.timedelta(seconds=20)
    )
    for earlier in range(1, step):
        ckpt.save(sharded_state_dict(world_size, 0), step=earlier).result()
    counts.clear()
    if rank == 0:
        commit = ckpt._writer.commit

        def commit_then_die(*args, **kwargs):  # the process dies here, as a SIGKILL would take it
            if after_put:
                commit(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        ckpt._writer.commit = commit_then_die
    t0 = time.monotonic()
    handle = ckpt.save(sharded_state_dict(world_size, 0), step=step)
    try:
        handle.result()
        outcome = "committed"
    except dcpstore.CheckpointSaveError as e:
        outcome = f"{type(e).__name__}: {e}"
    return outcome, time.monotonic() - t0, sum(counts.get(name, 0) for name in OBJECT_COLLECTIVES)


def checkpointer_resume_logged(rank, world_size, root, endpoint=None, change_structure=False):
    """``checkpointer_resume``, also returning the dcpstore messages this rank logged."""
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(f"{record.levelname}: {record.getMessage()}")

    handler = Keep(level=logging.INFO)
    logger = logging.getLogger("dcpstore")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        return checkpointer_resume(rank, world_size, root, change_structure, endpoint), records
    finally:
        logger.removeHandler(handler)


def load_with_state_dict(rank, world_size, url, endpoint):
    """Plain ``dcp.load`` through ``ObjectStoreReader(state_dict=...)``: this rank's share of the resume index."""
    sd = sharded_state_dict(world_size, 0, zeros=True)
    reader = dcpstore.ObjectStoreReader(url, storage_options={"endpoint_url": endpoint}, state_dict=sd)
    dcp.load(sd, storage_reader=reader)
    reader.close()
    return gathered(sd)


def checkpointer_resume_then_save(rank, world_size, root, endpoint):
    """Resume from the latest step, then save once: when ``save()`` returned (``time.time()``), and whether the plan was reused."""
    ckpt = dcpstore.AsyncCheckpointer(root, storage_options={"endpoint_url": endpoint})
    sd = sharded_state_dict(world_size, 0, zeros=True)
    step = ckpt.load(sd)
    ckpt.save(sd, step=step + 1)
    returned = time.time()
    ckpt.wait()
    reused = ckpt.last_stats.plan_reused
    ckpt.close()
    return returned, reused


def save_losing_the_commit(rank, world_size, url, endpoint):
    """Plain ``dcp.save`` whose ``.metadata`` another job commits first (rank 0 plants it mid-upload); the error each rank sees."""
    import boto3

    class Losing(dcpstore.ObjectStoreWriter):
        def write_data(self, plan, planner):
            if rank == 0:
                bucket, _, prefix = url.removeprefix("s3://").partition("/")
                boto3.client("s3").put_object(Bucket=bucket, Key=f"{prefix}/.metadata", Body=b"another job's commit")
            return super().write_data(plan, planner)

    writer = Losing(url, storage_options={"endpoint_url": endpoint})
    try:
        dcp.save(sharded_state_dict(world_size, 0), storage_writer=writer)
    except BaseException as e:  # noqa: BLE001 - CheckpointException is one
        return str(e)
    finally:
        writer.close()
    return None


def latest_step_when_the_coordinators_listing_fails(rank, world_size, root, proxy_endpoint):
    """Rank 0 lists through a proxy that refuses listings; every rank must hear of it, not wait for the group timeout."""
    options = {"endpoint_url": proxy_endpoint} if rank == 0 else None
    ckpt = dcpstore.AsyncCheckpointer(root, storage_options=options)
    try:
        ckpt.latest_step()
    except dcpstore.DcpstoreError as e:
        return str(e)
    finally:
        ckpt.close()
    return None


def many_items_state_dict(world_size: int, rank: int, items: int, step: int, wider_rank: int | None = None,
                          big: bool = False) -> dict:
    """``items`` DTensor shards a rank (FSDP's many parameters), a tensor of the rank's own, a replicated tensor, and
    bytes items: one whose pickled size changes every save, and a note of 100 bytes, or 70,000 with ``big``.

    ``wider_rank``: that rank's own tensor has one more row (a new shape: planned anew).
    """
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(step * 1000 + rank)
    params = {
        f"layer{i}.weight": DTensor.from_local(torch.randn(2, 3, generator=g), mesh, [Shard(0)], run_check=False)
        for i in range(items)
    }
    return {
        "model": params,
        f"rank{rank}": torch.randn(3 if rank == wider_rank else 2, 5, generator=g),
        "replicated": torch.full((4,), float(step)),
        "optim": {"step": 7 ** step},  # a pickled size of its own every save
        "note": b"n" * (70_000 if big else 100),  # its length past 65,535: no longer the width of its slot
    }


def checkpointer_patched_saves(rank, world_size, root, items, steps, wider_from, big_from):
    """Save ``steps`` with ``items`` DTensors a rank, counting each save's collectives.

    Rank 1 widens a tensor of its own from step ``wider_from``; the note grows past 65,535 bytes from ``big_from``.

    Returns per step: (object collectives of the save, plan reused, .metadata patched (coordinator), what every rank loads
    back with stock ``FsspecReader`` equals what it saved).
    """
    counts = count_collectives()
    out = {}
    with dcpstore.AsyncCheckpointer(root) as ckpt:
        for step in steps:
            shape = {"wider_rank": 1 if step >= wider_from else None, "big": step >= big_from}
            sd = many_items_state_dict(world_size, rank, items, step, **shape)
            counts.clear()
            ckpt.save(sd, step=step)
            ckpt.wait()
            objects = sum(counts.get(name, 0) for name in OBJECT_COLLECTIVES)
            stats = ckpt.last_stats
            back = many_items_state_dict(world_size, rank, items, 0, **shape)
            dcp.load(back, storage_reader=FsspecReader(ckpt.step_url(step)))
            same = all(torch.equal(back["model"][k].to_local(), v.to_local()) for k, v in sd["model"].items())
            same = same and all(torch.equal(back[k], sd[k]) for k in (f"rank{rank}", "replicated"))
            same = same and back["optim"] == sd["optim"] and back["note"] == sd["note"]
            out[step] = (objects, stats.plan_reused, stats.metadata_patched, same)
    return out


def _incremental_state(mesh, step):
    """A frozen weight (8 MiB a rank) and a trained one (256 KiB a rank, its value the step), sharded (Shard(0)), and the step."""
    world_size = mesh.size()
    frozen = torch.randn(2 * world_size * 1024, 1024, generator=torch.Generator().manual_seed(7))
    return {
        "frozen": distribute_tensor(frozen, mesh, [Shard(0)]),
        "trained": distribute_tensor(torch.full((world_size * 64, 1024), float(step)), mesh, [Shard(0)]),
        "step": step,
    }


def _incremental_checkpointer(root, **kwargs):
    return dcpstore.AsyncCheckpointer(root, transfer=dcpstore.TransferConfig(part_size=5 << 20), incremental=True, **kwargs)


def _resume_and_save(mesh, root, resumed_step, step):
    """A restarted job: load the latest step (it must be ``resumed_step``, bit-exact), save ``step``; the bytes it copied."""
    with _incremental_checkpointer(root) as ckpt:
        loaded = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in _incremental_state(mesh, 0).items()}
        assert ckpt.load(loaded) == resumed_step
        want = _incremental_state(mesh, resumed_step)
        for key in ("frozen", "trained"):
            assert torch.equal(loaded[key].to_local(), want[key].to_local()), key
        ckpt.save(_incremental_state(mesh, step), step=step)
        ckpt.wait()
        copied = ckpt.last_stats.copied_bytes
    got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in _incremental_state(mesh, 0).items()}
    dcp.load(got, storage_reader=FsspecReader(f"{root}/step_{step:08d}"))  # torch's reader: the step is whole
    for key in ("frozen", "trained"):
        assert torch.equal(got[key].to_local(), _incremental_state(mesh, step)[key].to_local()), key
    return copied


def checkpointer_incremental_saves(rank, world_size, root):
    """Incremental saves of steps 1 and 2, then a restart that saves step 3: the bytes each save copied."""
    mesh = init_device_mesh("cpu", (world_size,))
    copied = []
    with _incremental_checkpointer(root) as ckpt:
        for step in (1, 2):
            ckpt.save(_incremental_state(mesh, step), step=step)
            ckpt.wait()
            copied.append(ckpt.last_stats.copied_bytes)
    return [*copied, _resume_and_save(mesh, root, 2, 3)]


def checkpointer_incremental_killed(rank, world_size, root, proxy_endpoint):
    """Step 1 commits; during step 2's (slowed) incremental upload, rank 1 is SIGKILLed."""
    mesh = init_device_mesh("cpu", (world_size,))
    ckpt = _incremental_checkpointer(
        root, storage_options={"endpoint_url": proxy_endpoint}, collective_timeout=datetime.timedelta(seconds=30)
    )
    ckpt.save(_incremental_state(mesh, 1), step=1)
    ckpt.wait()
    return _save_step_2_and_kill_rank_1(ckpt, rank, _incremental_state(mesh, 2))


def checkpointer_incremental_resume(rank, world_size, root):
    """A job restarted after ``checkpointer_incremental_killed``: resumes step 1 and saves step 3; the bytes it copied."""
    return _resume_and_save(init_device_mesh("cpu", (world_size,)), root, 1, 3)


def dcp_save_incremental(rank, world_size, root):
    """Plain ``dcp.save`` with one ``ObjectStoreWriter(incremental=True)`` for two checkpoints: the bytes the second copied."""
    mesh = init_device_mesh("cpu", (world_size,))
    writer = dcpstore.ObjectStoreWriter(root, incremental=True, transfer=dcpstore.TransferConfig(part_size=5 << 20))
    for step in (1, 2):
        dcp.save(_incremental_state(mesh, step), storage_writer=writer, checkpoint_id=f"{root}/ckpt-{step}")
    copied = writer.incremental.bytes_copied
    writer.close()
    got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in _incremental_state(mesh, 0).items()}
    dcp.load(got, storage_reader=FsspecReader(f"{root}/ckpt-2"))
    for key in ("frozen", "trained"):
        assert torch.equal(got[key].to_local(), _incremental_state(mesh, 2)[key].to_local()), key
    return copied


def hf_model_tensors() -> dict[str, torch.Tensor]:
    """A small model's full tensors, of mixed dtypes (what an HF export must reproduce)."""
    g = torch.Generator().manual_seed(11)
    return {
        "model.embed.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.attn.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.weight": torch.randn(48, 32, generator=g).to(torch.float16),
        "model.layers.0.norm.weight": torch.randn(32, generator=g),
        "model.positions": torch.arange(64, dtype=torch.int64),
        "lm_head.weight": torch.randn(64, 32, generator=g),
    }


def save_hf_model(rank, world_size, root, mesh_shape):
    """Save ``hf_model_tensors`` sharded over a mesh (1-D: Shard(0); 2-D: Shard(0) x Shard(1)), with non-tensor items."""
    mesh = init_device_mesh("cpu", mesh_shape)
    placements = [Shard(0)] if len(mesh_shape) == 1 else [Shard(0), Shard(1)]
    state = {
        name: (distribute_tensor(t, mesh, placements) if t.dim() >= len(mesh_shape) else t)
        for name, t in hf_model_tensors().items()
    }
    state["train_step"] = 7
    state["config"] = {"lr": 1e-3}
    with dcpstore.AsyncCheckpointer(root) as ckpt:
        ckpt.save(state, step=1)
        ckpt.wait()


def export_hf_killed_after_first_shard(rank, world_size, src, dst):
    """``export_hf`` that is SIGKILLed once its first shard is written: shards, no index."""
    from dcpstore.export.hf import export_hf

    export_hf(src, dst, max_shard_size="4KiB", progress=lambda file: os.kill(os.getpid(), signal.SIGKILL))


def report_intra_op_threads(rank, world_size, init_file, queue, exit_code_of_rank_1=None):
    """A benchmark rank (``benchmarks.ranks.spawn_ranks``) that reports the intra-op threads torch gives it, or dies first."""
    if rank == 1 and exit_code_of_rank_1 is not None:
        os._exit(exit_code_of_rank_1)
    queue.put((rank, (os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads())))


def imported_dcpstore(rank, world_size):
    """Where this rank's dcpstore came from (``dist_utils`` must start ranks on the code under test)."""
    return dcpstore.__file__


def relative_path_warnings(rank, world_size, directory):
    """The warnings a writer, a reader and a checkpointer of a relative path give under a process group of two."""
    import warnings

    os.chdir(directory)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcpstore.ObjectStoreWriter("ckpt/run")
        dcpstore.ObjectStoreReader("file://ckpt/run")
        dcpstore.AsyncCheckpointer(f"{directory}/absolute").close()  # absolute: no warning
    return [str(w.message) for w in caught if "relative local path" in str(w.message)]
