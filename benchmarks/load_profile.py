"""Where a load's CPU goes: dcpstore's ``dcp.load`` of a state dict from a moto server, sampled by py-spy.

    py-spy record --format raw --rate 250 --threads --idle -o load.txt -- \\
        python -m benchmarks.load_profile --size-mib 1024 --loads 3
    python -m benchmarks.load_profile --summarize load.txt

The first command saves the state dict once, loads it once to warm the
client, then loads it ``--loads`` times into preallocated CPU tensors (the
page cache and the destinations warm, as ``benchmarks.run`` measures loads)
and prints the process's CPU seconds per GiB over those loads (``getrusage``;
the server is another process).  py-spy samples every thread.  The second
sums the samples of the metered loads (those under ``measured_loads``) into
the stages ``docs/performance.md`` accounts for, by the innermost frame that
names one, as CPU seconds per GiB.  A sample of a thread that is waiting
(py-spy's ``--idle``: the event loop in ``select``, a worker on a lock) is
not CPU and is left out.
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import sys
import time
import warnings

MiB, GiB = 1 << 20, 1 << 30

# Innermost frame first: the first stage whose pattern a sample's stack contains, leaf to root.
STAGES = (
    ("socket receive (kernel copy into aiohttp's chunks)", ("recv_into", "sock_recv", "_read_ready", "recv (")),
    ("crc32 of each item", ("crc32",)),
    ("copy into the destination (scatter)", ("_place", "RangeScatter.write", "ItemLanding.write", "_read_head")),
    ("aiohttp response parsing and body stream", ("aiohttp",)),
    ("botocore/aiobotocore request building and signing", ("botocore",)),
    ("asyncio event loop", ("asyncio", "selectors")),
    ("tensor archive checks (holds_in_place, locate_data)", ("tensor_archive",)),
    ("DCP planning and metadata", ("torch/distributed/checkpoint",)),
)
IDLE = ("select (", "epoll", "wait (threading", "_wait_for_tstate_lock", "acquire (", "sleep (", "poll (")


def measured_loads(sd, url, loads: int) -> float:
    """CPU seconds of this process over ``loads`` loads of ``url`` into preallocated tensors."""
    import torch.distributed.checkpoint as dcp

    import dcpstore

    dest = {k: v.clone() for k, v in sd.items()}
    usage = resource.getrusage(resource.RUSAGE_SELF)
    before = usage.ru_utime + usage.ru_stime
    for _ in range(loads):
        dcp.load(dest, storage_reader=dcpstore.ObjectStoreReader(url), no_dist=True)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime - before


def run(size_mib: int, loads: int) -> int:
    import boto3
    import torch.distributed.checkpoint as dcp

    import dcpstore
    from benchmarks.run import make_state_dict
    from dcpstore.local_s3 import TEST_CREDENTIALS, MotoServer

    warnings.simplefilter("ignore")
    os.environ.update(TEST_CREDENTIALS)
    server = MotoServer()
    os.environ["AWS_ENDPOINT_URL"] = server.endpoint
    try:
        boto3.client("s3").create_bucket(Bucket="profile")
        sd = make_state_dict(size_mib * MiB)
        url = "s3://profile/ckpt"
        dcp.save(sd, storage_writer=dcpstore.ObjectStoreWriter(url), no_dist=True)
        measured_loads(sd, url, 1)  # the client, the connections
        t0 = time.perf_counter()
        cpu = measured_loads(sd, url, loads)
        wall = time.perf_counter() - t0
        size = sum(v.numel() * v.element_size() for v in sd.values()) * loads / GiB
        print(f"{loads} loads of {size_mib} MiB: {cpu / size:.2f} CPU s/GiB, {wall / size:.2f} wall s/GiB")
    finally:
        server.stop()
    return 0


def summarize(path: str, gib: float | None) -> int:
    """Sum py-spy's raw (collapsed) samples of the metered loads into ``STAGES``."""
    per_stage: collections.Counter = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if "measured_loads" not in stack:
                continue
            frames = stack.split(";")
            if any(pattern in frames[-1] for pattern in IDLE):
                continue
            total += int(count)
            for frame in reversed(frames):
                stage = next((name for name, patterns in STAGES if any(p in frame for p in patterns)), None)
                if stage is not None:
                    break
            per_stage[stage or "other (Python glue: reader loop, futures, threads)"] += int(count)
    print(f"{total} CPU samples in the metered loads")
    for stage, count in per_stage.most_common():
        share = count / total
        extra = f"  {share * gib:.2f} CPU s/GiB" if gib else ""
        print(f"{share:6.1%}  {stage}{extra}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--loads", type=int, default=3)
    parser.add_argument("--summarize", metavar="PY_SPY_RAW", help="summarize a py-spy --format raw profile")
    parser.add_argument("--cpu-s-per-gib", type=float, help="with --summarize: the measured total, to split")
    args = parser.parse_args(argv)
    if args.summarize:
        return summarize(args.summarize, args.cpu_s_per_gib)
    return run(args.size_mib, args.loads)


if __name__ == "__main__":
    sys.exit(main())
