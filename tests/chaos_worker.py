"""One rank of a chaos-test job (see test_chaos.py): save some steps, report every outcome.

Runs in a spawned process on a real gloo group.  The state dict is derived
from (job seed, step) alone, so the parent can check any committed step
bit-exact without knowing which rank wrote what.
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import dcpstore

ROWS = 24  # divisible by world sizes 1, 2, 3, 4
BIG = (6 << 20) // 4  # a replicated 6 MiB tensor: a multipart upload of two 5 MiB parts
TRANSFER = dcpstore.TransferConfig(
    part_size=5 << 20,
    max_concurrency=4,
    connect_timeout=5,
    read_timeout=4,
    min_send_rate=16 << 20,  # the largest single .metadata PUT counts 4 s in a dead coordinator's landing time
    retry=dcpstore.RetryPolicy(max_attempts=5, initial_backoff=0.05, max_backoff=0.5),
)


def full_state(seed: int, step: int) -> dict:
    """The unsharded values of the state dict a job with ``seed`` saves at ``step``."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    return {
        "sharded": torch.randn(ROWS, 64, generator=g),
        "sharded_int": torch.randint(0, 1 << 30, (ROWS, 5), generator=g),
        "big": torch.randn(BIG, generator=torch.Generator().manual_seed(seed)),  # frozen: the job's incremental saves copy it
        "meta": {"step": step, "seed": seed},
    }


_mesh = None


def state_dict(world_size: int, seed: int, step: int) -> dict:
    """DTensor shards built locally: no collective, so a dead peer cannot break building it."""
    global _mesh
    if _mesh is None:
        _mesh = init_device_mesh("cpu", (world_size,))
    full = full_state(seed, step)
    rank = dist.get_rank()

    def shard(t):
        return DTensor.from_local(t.chunk(world_size)[rank].clone(), _mesh, [Shard(0)], run_check=False)

    return {
        "model": {"sharded": shard(full["sharded"]), "sharded_int": shard(full["sharded_int"]), "big": full["big"]},
        "extra": dict(full["meta"]),
    }


def as_full(sd: dict) -> dict:
    m = sd["model"]
    local = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    return {"sharded": local(m["sharded"]), "sharded_int": local(m["sharded_int"]), "big": m["big"], "meta": sd["extra"]}


def rank_main(rank: int, world_size: int, init_file: str, job: dict, results) -> None:
    """Report ``(job, rank, kind, payload)`` tuples to ``results``; never raises."""

    def report(kind, payload=None):
        results.put((job["name"], rank, kind, payload))

    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=job["collective_timeout"]),
        )
        ckpt = dcpstore.AsyncCheckpointer(
            job["root"],
            storage_options={"endpoint_url": job["endpoint"]},
            keep_last=job.get("keep_last"),
            collective_timeout=datetime.timedelta(seconds=job["collective_timeout"]),
            commit_window=job["commit_window"],
            transfer=TRANSFER,
            objects_per_rank=2,
            incremental=job.get("incremental", False),
        )
        if job.get("resume"):
            sd = state_dict(world_size, 0, 0)
            try:
                step = ckpt.load(sd)
                report("loaded", (step, as_full(sd)))
            except dcpstore.CheckpointNotFoundError:
                report("loaded", None)
        report("ready")
        for step in job["steps"]:
            sd = state_dict(world_size, job["seed"], step)
            if job.get("kill") == ("staging", rank, step):
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.monotonic()
            try:
                handle = ckpt.save(sd, step=step)
                report("saving", step)
                if job.get("kill") == ("upload", rank, step):
                    os.kill(os.getpid(), signal.SIGKILL)
                handle.result()
                report("outcome", (step, "ok", None, time.monotonic() - t0))
            except Exception as e:  # noqa: BLE001 - every outcome is data here
                report("outcome", (step, "error", f"{type(e).__name__}: {e}"[:2000], time.monotonic() - t0))
                break  # after a failure the job stops, as a training job would restart
        try:
            ckpt.close()
            report("closed")
        except Exception as e:  # noqa: BLE001
            report("close_error", f"{type(e).__name__}: {e}"[:500])
    except BaseException:  # noqa: BLE001 - reported to the parent
        import traceback

        report("crash", traceback.format_exc()[-3000:])
    finally:
        report("exit")
        results.close()
        results.join_thread()  # flush the queue's feeder thread: os._exit would drop what it holds
        os._exit(0)  # a dead peer can make destroy_process_group hang; nothing is left to flush
