"""Hugging Face export: ``dcpstore export-hf`` against the route a user scripts today, bucket to bucket.

    python -m benchmarks.hf_export                           # 1 GiB model, 5 GB shards, 3 rounds
    python -m benchmarks.hf_export --size-mib 128 --max-shard-size 40MB --rounds 1   # quick
    eval "$(bash scripts/ceph_rgw.sh env)" && python -m benchmarks.hf_export --endpoint "$AWS_ENDPOINT_URL"  # a real server

A moto server on loopback (``--endpoint URL``: an external S3 server, such
as the Ceph RGW of scripts/ceph_rgw.sh) holds one committed step of a model of
``--size-mib`` (float32 and bfloat16 matrices, written by one process with
``ObjectStoreWriter``).  Each contender then runs in a fresh Python process
that has imported dcpstore and torch and nothing more, interleaved, for
``--rounds`` rounds (medians):

* ``export-hf``: ``dcpstore.export.hf.export_hf(step, s3://.../hf)``;
* ``load, save_file, upload``: what a user scripts today: ``dcp.load`` of
  the whole model into full tensors (dcpstore's reader, so the reads are
  as fast as ours), ``safetensors.torch.save_file`` of each shard (the same
  shards) into a local folder, then boto3's ``upload_file`` of each file
  and of the index.

For each: wall time, CPU seconds of the process (all threads), and peak
resident memory above the process's own after its imports (``VmHWM``, reset
at the start).  Writes ``hf_export.json`` and ``hf_export.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import uuid

from benchmarks.report import write_report

MiB = 1 << 20

# Run in a fresh process: argv[1] is a JSON job; prints one JSON line of measurements.
_CHILD = r"""
import json, os, resource, sys, tempfile, time
import torch, dcpstore
from benchmarks.run import PeakRSS

job = json.loads(sys.argv[1])

def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime

with PeakRSS() as peak:
    t0, c0 = time.perf_counter(), cpu()
    if job["route"] == "export-hf":
        from dcpstore.export.hf import export_hf
        export_hf(job["src"], job["dst"], max_shard_size=job["max_shard_size"])
    else:
        from benchmarks.hf_export import load_save_upload
        load_save_upload(job["src"], job["dst"], job["max_shard_size"])
    wall, used = time.perf_counter() - t0, cpu() - c0
print(json.dumps({"wall_s": wall, "cpu_s": used, "peak_rss_mib": peak.peak_extra / (1 << 20)}))
"""


def make_model(size_mib: float) -> dict:
    """Square-ish float32 and bfloat16 matrices (as a transformer's), about ``size_mib`` in all."""
    import torch

    g = torch.Generator().manual_seed(0)
    out, total, i = {}, 0, 0
    while total < size_mib * MiB:
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        rows = 1024
        cols = max(1, min(4096, int((size_mib * MiB - total) // (rows * dtype.itemsize))))
        out[f"model.layers.{i}.weight"] = torch.randn(rows, cols, generator=g).to(dtype)
        total += rows * cols * dtype.itemsize
        i += 1
    return out


def load_save_upload(src: str, dst: str, max_shard_size: str) -> None:
    """The route without dcpstore's export: the whole model in memory, safetensors files on local disk, then uploaded."""
    import tempfile

    import boto3
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dcpstore import ObjectStoreReader
    from dcpstore.export.hf import _Tensor, parse_size, plan_shards

    reader = ObjectStoreReader(src)
    md = reader.read_metadata()
    state = {fqn: torch.empty(m.size, dtype=m.properties.dtype) for fqn, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    shards = plan_shards([_Tensor(k, k, v.dtype, tuple(v.shape), v.dtype) for k, v in state.items()], parse_size(max_shard_size))
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    bucket, _, prefix = dst.removeprefix("s3://").partition("/")
    weight_map = {}
    with tempfile.TemporaryDirectory() as folder:
        for k, shard in enumerate(shards):
            name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            path = os.path.join(folder, name)
            save_file({t.fqn: state[t.fqn] for t in shard}, path, metadata={"format": "pt"})
            s3.upload_file(path, bucket, f"{prefix}/{name}")
            weight_map.update({t.fqn: name for t in shard})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in state.values())}, "weight_map": weight_map}
    s3.put_object(Bucket=bucket, Key=f"{prefix}/model.safetensors.index.json", Body=json.dumps(index).encode())


def run_child(route: str, src: str, dst: str, max_shard_size: str) -> dict:
    """One export in a fresh process; its measurements."""
    job = json.dumps({"route": route, "src": src, "dst": dst, "max_shard_size": max_shard_size})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _CHILD, job], capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{route} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def save_step(url: str, size_mib: float) -> None:
    import torch.distributed.checkpoint as dcp

    import dcpstore

    writer = dcpstore.ObjectStoreWriter(url)
    dcp.save(make_model(size_mib), storage_writer=writer, no_dist=True)
    writer.close()


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routes = list(summary["routes"])
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for ax, (key, label) in zip(axes, [("wall_s", "wall time (s)"), ("cpu_s", "CPU (s)"), ("peak_rss_mib", "peak RSS above imports (MiB)")]):
        ax.bar(routes, [summary["routes"][r][key] for r in routes])
        ax.set_title(label)
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=float, default=1024)
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--endpoint", help="an S3 server to use instead of a local moto (credentials from the AWS environment)")
    args = parser.parse_args(argv)
    import contextlib
    import warnings

    import boto3

    from dcpstore.local_s3 import TEST_CREDENTIALS, MotoServer

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    os.environ.update({k: os.environ.get(k, v) for k, v in TEST_CREDENTIALS.items()})
    os.makedirs(args.out, exist_ok=True)
    samples: dict[str, list[dict]] = {"export-hf": [], "load, save_file, upload": []}
    with contextlib.nullcontext() if args.endpoint else MotoServer() as server:
        endpoint = args.endpoint or server.endpoint
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        bucket = f"hf-export-{uuid.uuid4().hex[:8]}"
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket=bucket)
        src = f"s3://{bucket}/run/step_00000001"
        save_step(src, args.size_mib)
        for r in range(args.rounds):
            for route in samples:
                dst = f"s3://{bucket}/hf-{r}-{len(samples[route])}-{route.split(',')[0]}"
                samples[route].append(run_child(route, src, dst, args.max_shard_size))
                for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=dst.split("/", 3)[3]):
                    for obj in page.get("Contents", []):  # the server's memory holds a round, not all of them
                        s3.delete_object(Bucket=bucket, Key=obj["Key"])
    routes = {route: {key: statistics.median(s[key] for s in runs) for key in runs[0]} for route, runs in samples.items()}
    ours, theirs = routes["export-hf"], routes["load, save_file, upload"]
    summary = {
        "routes": routes,
        "ratios_export_vs_alternative": {key: ours[key] / theirs[key] for key in ours if theirs[key]},
    }
    write_report(args.out, "hf_export", argv, {"size_mib": args.size_mib, "max_shard_size": args.max_shard_size, "rounds": args.rounds, "server": args.endpoint or "moto (local)"}, summary, plot)
    for route, row in routes.items():
        print(f"{route:>24}: wall {row['wall_s']:.2f} s  CPU {row['cpu_s']:.2f} s  peak RSS +{row['peak_rss_mib']:.0f} MiB")
    ratios = summary["ratios_export_vs_alternative"]
    print(f"export-hf vs the alternative: wall {ratios['wall_s']:.2f}x  CPU {ratios['cpu_s']:.2f}x  peak RSS {ratios['peak_rss_mib']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
