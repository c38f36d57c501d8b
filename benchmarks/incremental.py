"""Incremental saves: what a second save sends, costs and asks of the server, with 0 %, 12.5 % and 100 % of the state changed.

    python -m benchmarks.incremental                          # 256 MiB: 16 tensors of 16 MiB, 3 rounds
    python -m benchmarks.incremental --size-mib 64 --rounds 1 # quick
    eval "$(bash scripts/ceph_rgw.sh env)" && python -m benchmarks.incremental --endpoint "$AWS_ENDPOINT_URL"  # a real server

One process (a lone rank) saves through ``AsyncCheckpointer`` to a moto
server on loopback (``--endpoint URL``: an external S3 server, such as the
Ceph RGW of scripts/ceph_rgw.sh, whose CPU is then not measured): a first
save (not measured), then the measured second
save, in which the first ``k`` of the 16 tensors changed (k = 0, 2, 16).
Each case runs with ``incremental`` off (a full save) and on, interleaved,
each round into a fresh root; medians of ``--rounds``.  Per second save:

* bytes sent: the shard bytes the step stores, less those the bucket
  copied from the first save (``SaveStats.copied_bytes``), against the state;
* wall time from ``save`` until ``wait`` returns, and the CPU of this
  process and of the server over the same span;
* requests this process sent (every botocore/aiobotocore HTTP request).

Also the CPU cost of the content hash per GiB (``incremental.content_digest``).
Writes ``incremental.json`` and ``incremental.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid

import psutil
import torch

from benchmarks.run import RequestCounter

from benchmarks.report import write_report

MiB = 1 << 20
TENSORS = 16
CASES = {"0 %": 0, "12.5 %": 2, "100 %": TENSORS}


def state(size_mib: float, changed: int, step: int) -> dict:
    """``TENSORS`` float32 tensors of ``size_mib`` in all; the first ``changed`` depend on ``step``, the rest are frozen."""
    numel = int(size_mib * MiB) // TENSORS // 4
    out = {}
    for i in range(TENSORS):
        g = torch.Generator().manual_seed(i + (1000 * step if i < changed else 0))
        out[f"layer{i:02d}.weight"] = torch.randn(numel, generator=g)
    out["step"] = step
    return out


def second_save(root: str, size_mib: float, changed: int, incremental: bool, counter: RequestCounter, server: psutil.Process | None) -> dict:
    import dcpstore
    from dcpstore.storage import open_store

    first, second = state(size_mib, changed, 1), state(size_mib, changed, 2)  # built outside the meter
    with dcpstore.AsyncCheckpointer(root, incremental=incremental) as ckpt:
        ckpt.save(first, step=1)
        ckpt.wait()
        requests, cpu, server_cpu = counter.count, time.process_time(), server_seconds(server)
        t0 = time.perf_counter()
        ckpt.save(second, step=2)
        ckpt.wait()
        wall = time.perf_counter() - t0
        cpu, server_cpu = time.process_time() - cpu, server_seconds(server) - server_cpu
        requests = counter.count - requests
        stats = ckpt.last_stats
    store = open_store(root)
    try:
        stored = sum(o.size for o in store.list("step_00000002/") if o.key.endswith(".distcp"))
        store.delete([o.key for o in store.list("")])  # a server's disk holds a few rounds, not all of them
    finally:
        store.close()
    return {
        "sent_bytes": stored - stats.copied_bytes,
        "copied_bytes": stats.copied_bytes,
        "copy_requests": stats.copy_requests,
        "save_s": wall,
        "client_cpu_s": cpu,
        "server_cpu_s": server_cpu,
        "requests": requests,
    }


def server_seconds(server: psutil.Process | None) -> float:
    """CPU seconds the local server has used (0 for an external one)."""
    return sum(server.cpu_times()[:2]) if server is not None else 0.0


def hash_cost(size_mib: float) -> float:
    """CPU seconds per GiB of ``content_digest``."""
    from dcpstore.incremental import content_digest

    tensor = torch.randn(int(size_mib * MiB) // 4)
    t0 = time.process_time()
    content_digest(tensor)
    return (time.process_time() - t0) / (tensor.numel() * 4 / (1 << 30))


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(summary["cases"])
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, (key, label) in zip(axes, [("sent_vs_state", "bytes sent / state"), ("save_s", "second save (s)"), ("client_cpu_s", "client CPU (s)")]):
        x = range(len(cases))
        ax.bar([i - 0.2 for i in x], [summary["cases"][c]["full"][key] for c in cases], 0.4, label="full")
        ax.bar([i + 0.2 for i in x], [summary["cases"][c]["incremental"][key] for c in cases], 0.4, label="incremental")
        ax.set_xticks(list(x), [f"{c} changed" for c in cases])
        ax.set_title(label)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=float, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--endpoint", help="an S3 server to use instead of a local moto (credentials from the AWS environment)")
    args = parser.parse_args(argv)
    import contextlib

    import boto3

    from dcpstore.local_s3 import TEST_CREDENTIALS, MotoServer

    os.environ.update({k: os.environ.get(k, v) for k, v in TEST_CREDENTIALS.items()})
    os.makedirs(args.out, exist_ok=True)
    counter = RequestCounter()
    runs: dict = {case: {"full": [], "incremental": []} for case in CASES}
    with contextlib.nullcontext() if args.endpoint else MotoServer() as server:
        endpoint = args.endpoint or server.endpoint
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        bucket = f"incremental-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        server_process = psutil.Process(server.pid) if server is not None else None
        for r in range(args.rounds):
            for case, changed in CASES.items():
                for mode in ("full", "incremental"):
                    root = f"s3://{bucket}/{mode}-{changed}-{r}"
                    runs[case][mode].append(second_save(root, args.size_mib, changed, mode == "incremental", counter, server_process))
    state_bytes = int(args.size_mib * MiB) // TENSORS // 4 * 4 * TENSORS
    cases = {}
    for case, modes in runs.items():
        row = {}
        for mode, samples in modes.items():
            row[mode] = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
            row[mode]["sent_vs_state"] = row[mode]["sent_bytes"] / state_bytes
        row["save_s_incremental_vs_full"] = row["incremental"]["save_s"] / row["full"]["save_s"]
        row["client_cpu_incremental_vs_full"] = row["incremental"]["client_cpu_s"] / row["full"]["client_cpu_s"]
        cases[case] = row
    summary = {"cases": cases, "hash_cpu_s_per_gib": hash_cost(min(args.size_mib, 256))}
    write_report(args.out, "incremental", argv, {"size_mib": args.size_mib, "rounds": args.rounds, "server": args.endpoint or "moto (local)"}, summary, plot)
    for case, row in cases.items():
        full, inc = row["full"], row["incremental"]
        print(
            f"{case:>7} changed: sent {full['sent_vs_state']:.3f}x -> {inc['sent_vs_state']:.3f}x the state;"
            f"  save {full['save_s']:.3f} -> {inc['save_s']:.3f} s ({row['save_s_incremental_vs_full']:.2f}x);"
            f"  client CPU {full['client_cpu_s']:.2f} -> {inc['client_cpu_s']:.2f} s ({row['client_cpu_incremental_vs_full']:.2f}x);"
            f"  server CPU {full['server_cpu_s']:.2f} -> {inc['server_cpu_s']:.2f} s;"
            f"  requests {full['requests']:.0f} -> {inc['requests']:.0f} ({inc['copy_requests']:.0f} copies)"
        )
    print(f"content hash: {summary['hash_cpu_s_per_gib']:.3f} CPU s/GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
