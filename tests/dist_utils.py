"""Run a function on N real gloo ranks, each a process of its own.

The ranks are forked from a forkserver that imported torch and dcpstore
once (``rank_context``), so a rank starts in milliseconds instead of paying
torch's import (about 3.5 CPU seconds) every time: the suite starts a
few hundred ranks.  Each rank then takes the environment the caller had
when it called ``run_ranks``, as a spawned process would.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import sys
import tempfile
import traceback


# What every rank imports anyway; the forkserver imports it once, before it forks any rank.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "dcpstore.checkpointer", "dcpstore.reader", "s3fs", "boto3"]
_ctx = None


def rank_context():
    """The multiprocessing context that starts ranks: a forkserver with ``_PRELOAD`` imported (one per test process)."""
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(_PRELOAD)
        _start_forkserver_on_this_path()
    return _ctx


def _start_forkserver_on_this_path() -> None:
    """Start the forkserver with this process's ``sys.path``, so that it preloads the dcpstore under test.

    Python 3.11's forkserver is told the parent's ``sys.path`` and ignores
    it: it imports ``_PRELOAD`` from the interpreter's own path, where the
    installed (editable) dcpstore is.  Run from a worktree of another
    commit, every rank would then test that install, not the checkout.
    ``PYTHONPATH`` is the one setting the forkserver's start does read.
    """
    from multiprocessing import forkserver

    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p or os.curdir) for p in sys.path)
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def in_environment(environ: dict, fn, *args):
    """Run ``fn(*args)`` in the environment ``environ``: a rank's start, with the caller's environment.

    The forkserver's own environment is from when it started; a test may
    have changed the caller's since (``monkeypatch.setenv``).
    """
    os.environ.clear()
    os.environ.update(environ)
    return fn(*args)


def _entry(fn, rank, world_size, init_file, results, args, collective_timeout, start):
    import torch.distributed as dist

    try:
        if start is None:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{init_file}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=collective_timeout),
            )
        else:
            start.wait()  # no process group: only a start together, as a job's processes would
        out = fn(rank, world_size, *args)
        # Plain pickle: tensors travel by value, not as shared-memory handles
        # that die with this process.
        results.put((rank, "ok", pickle.dumps(out)))
        if start is None:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))


def deadline_scale() -> float:
    """How much longer than on an idle machine to wait: the load per core (at least 1).

    ``DCPSTORE_TEST_TIMEOUT_SCALE`` overrides it.  A busy 2-core CI box runs
    spawned ranks several times slower; a fixed deadline would fail there
    while every assertion of the test still holds.
    """
    override = os.environ.get("DCPSTORE_TEST_TIMEOUT_SCALE")
    if override:
        return float(override)
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def run_ranks(
    fn,
    world_size: int,
    *args,
    timeout: float = 180,
    expect_killed: tuple[int, ...] = (),
    collective_timeout: float = 60,
    process_group: bool = True,
):
    """``fn(rank, world_size, *args)`` on every rank; returns ``{rank: result}``.

    A rank whose ``fn`` raises fails the call with its traceback; ranks in
    ``expect_killed`` may die without a result (their entry is ``None``).
    ``timeout`` is for an idle machine and is scaled by ``deadline_scale()``.
    ``process_group=False``: independent processes, no process group; they
    start ``fn`` together (a barrier), as launchers start them.
    """
    timeout *= deadline_scale()
    ctx = rank_context()
    results = ctx.Queue()
    start = None if process_group else ctx.Barrier(world_size)
    fd, init_file = tempfile.mkstemp(prefix="gloo-")
    os.close(fd)
    os.unlink(init_file)
    procs = [
        ctx.Process(
            target=in_environment,
            args=(dict(os.environ), _entry, fn, r, world_size, init_file, results, args, collective_timeout, start),
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    errors = {}
    try:
        want = world_size - len(expect_killed)
        import time

        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < want:
            try:
                rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish in {timeout}s; got {sorted(out)}")
                continue
            if status == "ok":
                out[rank] = pickle.loads(value)
            else:
                errors[rank] = value
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if os.path.exists(init_file):
            os.unlink(init_file)
    if errors:
        raise AssertionError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in sorted(errors.items())))
    for r in expect_killed:
        out.setdefault(r, None)
    return out
