"""Saves under sustained S3 throttling: N writers against a modelled partition, every contender in one run.

    python -m benchmarks.throttle                       # 8 writers x 48 MiB, 4 writes/s, no splits
    python -m benchmarks.throttle --split-after 3       # partitions split after 3 s of sustained throttling

S3 admits about 3,500 writes/s per partition of a bucket's key space and
answers the rest with 503 SlowDown for as long as the load lasts.  Here a
proxy in front of one moto server (``tests/s3server.py``: ``FaultProxy``
with a ``ThrottleModel``, a token bucket per key-range partition) models one
such partition, scaled down to ``--rate`` writes/s so that a 2-core machine
can saturate it.  dcpstore's ``prefix_write_rate`` is set to the same figure,
as its default is set to S3's.

Each contender saves in two modes, one after the other, into a fresh prefix:

- ``job``: N gloo ranks, one plain ``dcp.save`` (each rank writes its own
  tensors, as FSDP shards are): what a torchrun job does;
- ``independent``: N processes, each its own ``dcp.save`` into its own
  checkpoint under one root, no process group (so no writer knows the
  others: each dcpstore writer slow-starts its rate, see
  ``dcpstore.storage.throttle``): the issue's first repro.

Writers start together (a barrier after start-up), as a job's ranks do.

Reported per contender and mode: saves committed, write requests sent per
request admitted (amplification: 1.0 means not one was throttled), admitted
writes over what the model admits from the first request to the last
admitted one (achieved/allowed), and the p99 save time.  Goals (issue 23):
amplification <= 1.5, achieved/allowed >= 0.7.  Writes ``throttle.json`` and
``throttle.png`` into ``--out``.  Ratios only: never compare absolute times
across runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import uuid

import boto3

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))  # the fault proxy and gloo runner

from dist_utils import run_ranks  # noqa: E402
from s3server import FaultProxy, MotoServer, ThrottleModel  # noqa: E402

MiB = 1 << 20


def _state(rank: int, mib: int):
    import torch

    g = torch.Generator().manual_seed(rank)
    n = mib * MiB // 4  # float32
    return {f"r{rank}_a": torch.randn(n, generator=g), f"r{rank}_b": torch.randn(n, generator=g)}


def _writer(contender: str, url: str, rate: float):
    if contender.startswith("dcpstore"):
        import dcpstore

        transfer = dcpstore.TransferConfig(max_concurrency=4, prefix_write_rate=rate)
        spread = 4 if "key_spread" in contender else 1
        return dcpstore.ObjectStoreWriter(url, transfer=transfer, objects_per_rank=2, key_spread=spread)
    if contender == "torch FsspecWriter (s3fs)":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(url, thread_count=2)
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageWriter

    return S3StorageWriter(
        region="us-east-1", path=url, s3client_config=S3ClientConfig(force_path_style=True), thread_count=2
    )


def _save_one(rank, contender, url, mib, rate, writers, endpoint, start):
    """One writer's save; ``(committed, seconds, error)``.  ``start()`` returns once every writer is ready."""
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    distributed = dist.is_initialized()
    state = _state(rank, mib)
    writer = _writer(contender, url if distributed else f"{url}/w{rank}", rate)
    start()  # every writer starts at once, as a job's ranks do, whatever their start-up took
    t0 = time.monotonic()
    try:
        dcp.save(state, storage_writer=writer, no_dist=not distributed)
        return True, time.monotonic() - t0, None
    except BaseException as e:  # noqa: BLE001 - CheckpointException is one; recorded, not raised
        return False, time.monotonic() - t0, f"{type(e).__name__}: {str(e)[-300:]}"


def _job_rank(rank, world_size, *args):
    import torch.distributed as dist

    return _save_one(rank, *args, start=dist.barrier)


def _independent_writer(rank, args, barrier, results):
    results.put((rank, _save_one(rank, *args, start=barrier.wait)))


def _run_independent(writers: int, args: tuple, timeout: float) -> dict:
    """``writers`` processes with no process group (none knows the others), started together."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(writers), ctx.Queue()
    procs = [ctx.Process(target=_independent_writer, args=(r, args, barrier, results)) for r in range(writers)]
    for p in procs:
        p.start()
    try:
        return dict(results.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


def measure(contender: str, mode: str, args, proxy: FaultProxy, s3) -> dict:
    bucket = f"throttle-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(Bucket=bucket)
    model = proxy.throttle = ThrottleModel(rate=args.rate, burst=args.rate, split_after=args.split_after)
    save_args = (contender, f"s3://{bucket}/root", args.mib, args.rate, args.writers, proxy.endpoint)
    if mode == "job":
        results = run_ranks(_job_rank, args.writers, *save_args, timeout=args.timeout, collective_timeout=args.timeout)
    else:
        results = _run_independent(args.writers, save_args, args.timeout)
    proxy.throttle = None
    saves = [r for r in results.values()]
    end = model.last or model.started or time.monotonic()
    allowed = model.allowed(model.started, end) if model.started else 0.0
    out = {
        "committed": sum(ok for ok, _, _ in saves) if mode == "independent" else int(all(ok for ok, _, _ in saves)),
        "saves": len(saves) if mode == "independent" else 1,
        "write_requests_sent": model.sent,
        "write_requests_admitted": model.admitted,
        "amplification": model.amplification,
        "achieved_over_allowed": model.admitted / allowed if allowed else 0.0,
        "p99_save_s": _p99([t for _, t, _ in saves]),
        "partitions_at_end": len(model.partitions),
        "errors": sorted({e for _, _, e in saves if e})[:3],
    }
    print(
        f"{contender:<36} {mode:<11} {out['committed']:>3}/{out['saves']:<3} {out['amplification']:>6.2f}x "
        f"{out['achieved_over_allowed']:>9.2f} {out['p99_save_s']:>8.1f}s {out['partitions_at_end']:>5}",
        flush=True,
    )
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"{c} [{m}]", r) for c, modes in results["contenders"].items() for m, r in modes.items() if "amplification" in r]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.5 * len(rows) + 2))
    y = range(len(rows))
    ax1.barh(y, [r["amplification"] for _, r in rows], color="tab:red")
    ax1.axvline(1.5, color="k", linestyle="--", linewidth=1, label="goal: <= 1.5")
    ax1.set_yticks(list(y), [n for n, _ in rows], fontsize=8)
    ax1.invert_yaxis()
    ax1.set_xlabel("write requests sent per request admitted")
    ax1.legend(fontsize=8)
    ax2.barh(y, [r["achieved_over_allowed"] for _, r in rows], color="tab:green")
    ax2.axvline(0.7, color="k", linestyle="--", linewidth=1, label="goal: >= 0.7")
    ax2.set_yticks(list(y), ["" for _ in rows])
    ax2.invert_yaxis()
    ax2.set_xlabel("admitted writes / what the model admits")
    ax2.legend(fontsize=8)
    fig.suptitle(results["label"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--mib", type=int, default=24, help="MiB per tensor; each writer saves two")
    parser.add_argument("--rate", type=float, default=4.0, help="writes/s one modelled partition admits")
    parser.add_argument("--split-after", type=float, default=None, help="seconds of sustained throttling before a partition splits")
    parser.add_argument("--modes", default="job,independent")
    parser.add_argument("--only", default=None, help="run only contenders whose name contains this")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--no-s3torchconnector", action="store_true")
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args(argv)
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)
    contenders = [
        "dcpstore ObjectStoreWriter",
        "dcpstore ObjectStoreWriter key_spread=4",
        "torch FsspecWriter (s3fs)",
    ]
    if not args.no_s3torchconnector:
        try:
            import s3torchconnector.dcp  # noqa: F401

            contenders.append("s3torchconnector")
        except ImportError:
            print("s3torchconnector not installed: skipped (pip install s3torchconnector)")
    if args.only:
        contenders = [c for c in contenders if args.only in c]
    server = MotoServer()
    proxy = FaultProxy(server.endpoint)
    s3 = boto3.client("s3", endpoint_url=server.endpoint)
    label = (
        f"{args.writers} writers x 2 x {args.mib} MiB, one partition of {args.rate:g} writes/s"
        + (f", splits after {args.split_after:g} s" if args.split_after else "")
    )
    results = {
        "label": label,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "date": datetime.date.today().isoformat(),
        "args": vars(args),
        "contenders": {},
    }
    print(label)
    print(f"{'contender':<36} {'mode':<11} {'ok':>7} {'ampl.':>7} {'ach/allow':>9} {'p99':>9} {'parts':>5}")
    try:
        for contender in contenders:
            for mode in args.modes.split(","):
                try:
                    r = measure(contender, mode, args, proxy, s3)
                except Exception as e:  # noqa: BLE001 - a contender that cannot run is recorded
                    r = {"error": f"{type(e).__name__}: {e}"[:500]}
                    print(f"{contender:<36} {mode:<11} failed: {r['error'][:120]}", flush=True)
                results["contenders"].setdefault(contender, {})[mode] = r
    finally:
        proxy.stop()
        server.stop()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "throttle.json"), "w") as f:
        json.dump(results, f, indent=2)
    plot(results, os.path.join(args.out, "throttle.png"))
    print(f"wrote {args.out}/throttle.json and throttle.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
