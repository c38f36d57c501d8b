"""Loading many small tensors: dcpstore's coalesced reads vs torch's ``FsspecReader``.

    python -m benchmarks.small_items                 # 3,000 tensors of 1 KiB, 5 rounds
    python -m benchmarks.small_items --tensors 10000 --rounds 3

Optimizer states are many small tensors.  One checkpoint is saved once with
``ObjectStoreWriter`` to a moto server on loopback; both readers then load it,
interleaved A B A B ... for ``--rounds`` rounds.  Prints medians, the ratio
measured in this run, and the HTTP requests each load made; writes
``small_items.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
import warnings

import boto3
import torch

from .run import RequestCounter, _dcpstore_reader, _dcpstore_writer, _fsspec_reader, blank_like

READERS = {"dcpstore ObjectStoreReader": _dcpstore_reader, "torch FsspecReader": _fsspec_reader}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=3000)
    parser.add_argument("--tensor-bytes", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    os.makedirs(args.out, exist_ok=True)
    import torch.distributed.checkpoint as dcp

    from dcpstore.local_s3 import TEST_CREDENTIALS, MotoServer

    os.environ.update(TEST_CREDENTIALS)
    g = torch.Generator().manual_seed(0)
    sd = {f"state.{i}": torch.randn(args.tensor_bytes // 4, generator=g) for i in range(args.tensors)}
    counter = RequestCounter()
    times: dict[str, list[float]] = {name: [] for name in READERS}
    requests: dict[str, int] = {}
    with MotoServer() as server:
        os.environ["AWS_ENDPOINT_URL"] = server.endpoint
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        url = f"s3://{bucket}/small"
        dcp.save(sd, storage_writer=_dcpstore_writer(url), no_dist=True)
        for _ in range(args.rounds):
            for name, reader in READERS.items():  # interleaved
                out = blank_like(sd)
                before = counter.count
                t0 = time.perf_counter()
                dcp.load(out, storage_reader=reader(url), no_dist=True)
                times[name].append(time.perf_counter() - t0)
                requests[name] = counter.count - before
                assert all(torch.equal(out[k], sd[k]) for k in sd), name
    medians = {name: statistics.median(t) for name, t in times.items()}
    ratio = medians["torch FsspecReader"] / medians["dcpstore ObjectStoreReader"]
    label = f"{args.tensors} tensors of {args.tensor_bytes} B, one rank, {args.rounds} rounds, medians"
    print(f"\n{label}\n{'reader':<30}{'load s':>9}{'requests':>10}")
    for name in READERS:
        print(f"{name:<30}{medians[name]:>9.3f}{requests[name]:>10}")
    print(f"dcpstore is {ratio:.1f}x as fast as torch FsspecReader on this checkpoint")
    with open(os.path.join(args.out, "small_items.json"), "w") as f:
        json.dump({"label": label, "load_s": times, "median_s": medians, "requests": requests, "speedup": ratio}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
