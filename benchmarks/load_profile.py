"""Where a load's CPU goes: dcpstore's ``dcp.load`` of a state dict from a moto server, sampled by py-spy.

    python -m benchmarks.load_profile --size-mib 1024 --loads 3 --py-spy load.txt

Saves the state dict once, loads it once to warm the client, then loads it
``--loads`` times into preallocated CPU tensors (the destinations and the
connections warm, as ``benchmarks.run`` measures loads) and prints the
process's CPU seconds per GiB over those loads (``getrusage``; the server is
another process), and per thread (``/proc``).  With ``--py-spy``, py-spy (in the ``bench`` extra; it
needs to read this process's memory) samples every thread of this process
during exactly those loads, only while a thread is on a CPU, and the samples
are summed into the stages ``docs/performance.md`` accounts for, by the
innermost frame that names one, as shares of the measured CPU seconds per
GiB.  ``--summarize FILE --cpu-s-per-gib X`` sums an earlier profile again.
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import warnings

MiB, GiB = 1 << 20, 1 << 30

# Per sample, from the innermost frame out, the first stage one of whose patterns the frame contains.
STAGES = (
    ("crc32 of each item", ("crc32",)),
    ("copy into the destination (scatter)", ("ItemLanding._place", "ItemLanding.write", "ItemLanding._read_head", "RangeScatter.write")),
    ("socket receive into aiohttp's buffers", ("_read_ready", "SocketIO.readinto", "recv")),
    ("aiohttp response parsing and body stream", ("aiohttp/",)),
    ("botocore/aiobotocore request building and signing", ("botocore/",)),
    ("asyncio event loop and thread hand-offs", ("asyncio/", "concurrent/futures", "threading.py")),
    ("tensor archive checks (holds_in_place, locate_data)", ("tensor_archive.py",)),
    ("DCP planning and metadata", ("torch/distributed/checkpoint", "safe_pickle.py", "planner_data.py")),
)


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread of this process, by thread name, from ``/proc`` (Linux)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except FileNotFoundError:  # ended meanwhile
            continue
        out[names.get(int(tid), "other threads")] += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def measured_loads(sd, url, loads: int) -> float:
    """CPU seconds of this process over ``loads`` loads of ``url`` into preallocated tensors."""
    import torch.distributed.checkpoint as dcp

    import dcpstore

    from benchmarks.run import load_destination

    dest = load_destination(sd)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    before = usage.ru_utime + usage.ru_stime
    for _ in range(loads):
        dcp.load(dest, storage_reader=dcpstore.ObjectStoreReader(url), no_dist=True)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime - before


def run(size_mib: int, loads: int, py_spy: str | None) -> int:
    import boto3
    import torch.distributed.checkpoint as dcp

    import dcpstore
    from benchmarks.run import make_state_dict, nbytes
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
        sampler = _start_py_spy(py_spy) if py_spy else None
        t0, threads = time.perf_counter(), thread_cpu()
        cpu = measured_loads(sd, url, loads)
        wall, threads = time.perf_counter() - t0, collections.Counter(thread_cpu()) - collections.Counter(threads)
        if sampler is not None:
            sampler.send_signal(signal.SIGINT)
            sampler.wait(timeout=120)
        size = nbytes(sd) * loads / GiB
        print(f"{loads} loads of {size_mib} MiB: {cpu / size:.2f} CPU s/GiB, {wall / size:.2f} wall s/GiB")
        threads = {name: seconds / size for name, seconds in threads.items()}
        for name, value in sorted(threads.items(), key=lambda kv: -kv[1]):
            print(f"  thread {name}: {value:.2f} CPU s/GiB")
    finally:
        server.stop()
    if py_spy:
        summarize(py_spy, cpu / size, threads)
    reference = reference_costs(max(64 * MiB, size_mib * MiB))
    print(f"for reference, on this machine: one crc32 pass {reference['crc32']:.2f} CPU s/GiB, "
          f"one copy into a reused buffer {reference['copy']:.2f} CPU s/GiB")
    return 0


def _start_py_spy(path: str) -> subprocess.Popen:
    """py-spy recording this process, every thread, while on a CPU; returns once its first sample is written."""
    proc = subprocess.Popen(
        ["py-spy", "record", "--pid", str(os.getpid()), "--threads", "--rate", "250", "--format", "raw", "-o", path],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    for line in proc.stdout:  # "Sampling process 250 times a second. Press Control-C to exit."
        if "Sampling process" in line:
            return proc
    raise RuntimeError(f"py-spy could not sample this process (exit {proc.wait()})")


def summarize(path: str, cpu_s_per_gib: float | None, threads: dict[str, float] | None = None) -> int:
    """Sum py-spy's raw (collapsed) samples into ``STAGES``, as shares of ``cpu_s_per_gib``.

    py-spy counts a thread as on a CPU while it waits for the GIL or returns
    from a wait, so its sample counts overstate threads that mostly wait (the
    default executor's worker, the event loop in ``select``).  With
    ``threads`` (each thread's CPU seconds per GiB, from ``/proc``), each
    thread's measured CPU is split by its own samples instead.
    """
    per_thread: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            thread = frames[0].partition(": ")[2] or "other threads"
            for frame in reversed(frames):
                stage = next((name for name, patterns in STAGES if any(p in frame for p in patterns)), None)
                if stage is not None:
                    break
            per_thread[thread][stage or "other (the reader's loop, Python glue)"] += int(count)
    per_stage: collections.Counter = collections.Counter()
    for thread, stages in per_thread.items():
        samples = sum(stages.values())
        weight = threads.get(thread, 0.0) / samples if threads is not None else (cpu_s_per_gib or 0.0) / max(1, sum(sum(c.values()) for c in per_thread.values()))
        for stage, count in stages.items():
            per_stage[stage] += count * weight
    total = sum(per_stage.values()) or 1.0
    how = "each thread's /proc CPU split by its samples" if threads is not None else "all samples alike"
    print(f"CPU s/GiB by stage ({how}):")
    for stage, value in per_stage.most_common():
        print(f"{value / total:6.1%}  {value:5.2f}  {stage}")
    return 0


def reference_costs(nbytes: int) -> dict[str, float]:
    """This machine's CPU seconds per GiB for one crc32 pass and one copy into a reused buffer, over ``nbytes``."""
    import zlib

    import torch

    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # pages in
    view = memoryview(src.numpy())
    out = {}
    for name, work in (("crc32", lambda: zlib.crc32(view)), ("copy", lambda: dst.copy_(src))):
        t0 = time.process_time()  # every thread: torch's copy runs on its intra-op threads
        work()
        out[name] = (time.process_time() - t0) * GiB / nbytes
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--loads", type=int, default=3)
    parser.add_argument("--py-spy", metavar="OUT", help="sample the measured loads with py-spy into OUT (raw format)")
    parser.add_argument("--summarize", metavar="PY_SPY_RAW", help="summarize an earlier profile")
    parser.add_argument("--cpu-s-per-gib", type=float, help="with --summarize: the measured total, to split")
    args = parser.parse_args(argv)
    if args.summarize:
        return summarize(args.summarize, args.cpu_s_per_gib)
    return run(args.size_mib, args.loads, args.py_spy)


if __name__ == "__main__":
    sys.exit(main())
