"""Benchmark ranks: spawned processes on one machine, started as ``torchrun`` starts a job's ranks.

``torchrun --nproc-per-node N`` (N > 1) gives every rank ``OMP_NUM_THREADS=1``
unless the environment sets it (``torch/distributed/run.py``), so that N
ranks do not each run torch's intra-op work on every core of the machine.
Spawned without it, each rank's torch ops (a large ``Tensor.copy_``) fork
onto as many threads as the machine has cores and wait at the end for
threads that the other ranks' work keeps off the CPU: on this 2-core
machine, with 4 ranks, a 4 MiB copy took about 6 ms instead of 0.1 ms.
A benchmark that spawns its ranks otherwise measures a job no one runs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import tempfile
import time
from typing import Any, Callable


def spawn_ranks(target: Callable, world_size: int, *args: Any, timeout: float = 3600) -> dict[int, Any]:
    """Run ``target(rank, world_size, init_file, queue, *args)`` in ``world_size`` spawned processes; ``{rank: what it put}``.

    Each rank puts one ``(rank, result)`` on ``queue`` (a ``str`` result
    reports its failure); ``init_file`` is a fresh path for
    ``init_method=f"file://{init_file}"``.  Raises, naming the ranks and what
    they reported, if a rank exits without putting its result, or fails.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(prefix="ranks-"), "init")
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for several ranks a node (see the module docstring)
    try:
        procs = [ctx.Process(target=target, args=(r, world_size, init_file, results, *args)) for r in range(world_size)]
        for p in procs:
            p.start()
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(out) < world_size:
        try:
            rank, result = results.get(timeout=1.0)
        except queue_module.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"ranks {dead or 'all'} failed or timed out before reporting") from None
            continue
        out[rank] = result
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        failures = {r: v for r, v in out.items() if isinstance(v, str)}
        raise RuntimeError(f"ranks failed: exit codes {[p.exitcode for p in procs]}; {failures}")
    return out
