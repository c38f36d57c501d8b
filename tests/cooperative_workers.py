"""Rank functions for the read-once tests: the benchmark's three layouts of one state, saved and loaded by real gloo ranks.

- ``replicated``: every rank holds the whole state (DDP).
- ``hsdp``: a 2 x (W/2) mesh, ``[Replicate(), Shard(0)]`` (two replica groups of sharded ranks).
- ``sharded``: a 1-D mesh of W, ``Shard(0)`` (FSDP).
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dcpstore
from benchmarks.read_once import LAYOUTS, full_state, layout_state, matches


def save_layouts(rank, world_size, root: str, mib: float, layouts=LAYOUTS) -> None:
    full = full_state(mib)
    for layout in layouts:
        writer = dcpstore.ObjectStoreWriter(f"{root}/{layout}")
        dcp.save(layout_state(layout, full, world_size, zeros=False), storage_writer=writer)
        writer.close()


def load_layouts(rank, world_size, root: str, mib: float, read_once: bool, endpoint: str, layouts=LAYOUTS, saved_as: str | None = None) -> dict:
    """Each layout loaded with ``dcp.load`` through ``endpoint``: ``{layout: (bit-exact, seconds)}``.

    ``saved_as``: load every layout from the checkpoint saved in that one (resharding).
    """
    full = full_state(mib)
    out = {}
    for layout in layouts:
        want = layout_state(layout, full, world_size, zeros=False)
        sd = layout_state(layout, full, world_size, zeros=True)
        reader = dcpstore.ObjectStoreReader(f"{root}/{saved_as or layout}", read_once=read_once, endpoint_url=endpoint)
        dist.barrier()
        start = time.perf_counter()
        dcp.load(sd, storage_reader=reader)
        seconds = time.perf_counter() - start
        reader.close()
        out[layout] = (matches(sd, want), seconds)
    return out


def load_corrupt(rank, world_size, url: str, mib: float) -> tuple[str, bool]:
    """Load a replicated checkpoint one of whose items is corrupt: the error, and whether every destination kept its zeros."""
    full = full_state(mib)
    sd = layout_state("replicated", full, world_size, zeros=True)
    try:
        dcp.load(sd, storage_reader=dcpstore.ObjectStoreReader(url, read_once=True))
    except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
        return str(e), all(not v.any() for v in sd.values() if isinstance(v, torch.Tensor))
    return "", False


def save_step(rank, world_size, root: str, mib: float) -> None:
    """Step 1 of a replicated state, saved by ``AsyncCheckpointer``."""
    with dcpstore.AsyncCheckpointer(root) as ckpt:
        ckpt.save(layout_state("replicated", full_state(mib), world_size, zeros=False), step=1).result()


def load_losing_a_peer(rank, world_size, root: str, mib: float, victim: int) -> str:
    """``AsyncCheckpointer.load`` of a replicated step, rank ``victim`` dying in its second point-to-point send: the error."""
    if rank == victim:
        sends = []
        isend = dist.isend

        def dying_isend(*args, **kwargs):
            sends.append(1)
            if len(sends) == 2:
                os._exit(9)
            return isend(*args, **kwargs)

        dist.isend = dying_isend
    sd = layout_state("replicated", full_state(mib), world_size, zeros=True)
    ckpt = dcpstore.AsyncCheckpointer(root, collective_timeout=datetime.timedelta(seconds=30))
    try:
        ckpt.load(sd)
    except dcpstore.CheckpointLoadError as e:
        return str(e)
    return ""


def load_into_cuda(rank, world_size, url: str, mib: float) -> bool:
    """A replicated checkpoint loaded with ``read_once`` into CUDA destinations (one GPU for every rank): bit-exact.

    One destination is a transposed view, so that its bytes go through the pinned ring and a narrow.
    """
    full = full_state(mib)
    sd = {k: torch.zeros_like(v, device="cuda") for k, v in full.items()}
    rows, cols = full["layer0.weight"].shape
    sd["layer0.weight"] = torch.zeros(cols, rows, device="cuda").t()
    sd["step"] = 0
    dcp.load(sd, storage_reader=dcpstore.ObjectStoreReader(url, read_once=True))
    torch.cuda.synchronize()
    return sd["step"] == 41 and all(torch.equal(sd[k].cpu(), v) for k, v in full.items())


def load_over_nccl(rank, world_size, url: str, mib: float) -> bool:
    """A replicated checkpoint loaded with ``read_once`` over an NCCL group, each rank on its own GPU: bit-exact.

    Whole CUDA destinations take the values in place; a transposed one
    goes through the ring; a CPU one through device memory and back.
    """
    torch.cuda.set_device(rank)
    nccl = dist.new_group(backend="nccl")
    full = full_state(mib)
    sd = {k: torch.zeros_like(v, device="cuda") for k, v in full.items()}
    rows, cols = full["layer0.weight"].shape
    sd["layer0.weight"] = torch.zeros(cols, rows, device="cuda").t()
    sd["layer1.weight"] = torch.zeros_like(full["layer1.weight"])
    sd["step"] = 0
    dcp.load(sd, storage_reader=dcpstore.ObjectStoreReader(url, read_once=nccl))
    torch.cuda.synchronize()
    return sd["step"] == 41 and all(torch.equal(sd[k].cpu(), v) for k, v in full.items())


def load_failing_a_delivery(rank, world_size, url: str, mib: float, victim: int) -> str:
    """Rank ``victim``'s planner fails to take the non-tensor item it received (torch.load raises there): every rank's error."""
    if rank == victim:

        def refusing_load(*args, **kwargs):
            raise RuntimeError("the planner refused the item")

        torch.load = refusing_load
    sd = layout_state("replicated", full_state(mib), world_size, zeros=True)
    try:
        dcp.load(sd, storage_reader=dcpstore.ObjectStoreReader(url, read_once=True))
    except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
        return str(e)
    return ""


def load_alone_with_read_once(url: str, mib: float) -> tuple[bool, int]:
    """One process, no process group, ``read_once=True``: bit-exact, and the bytes it asked for."""
    full = full_state(mib)
    want, sd = layout_state("replicated", full, 1, zeros=False), layout_state("replicated", full, 1, zeros=True)
    reader = dcpstore.ObjectStoreReader(url, read_once=True)
    dcp.load(sd, storage_reader=reader, no_dist=True)
    return matches(sd, want), reader.bytes_read
