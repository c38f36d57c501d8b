"""Staging and loading against the host-device rooflines, on a CUDA machine.

    python -m benchmarks.staging               # 1 GiB in 64 tensors, best of 5
    python -m benchmarks.staging --gib 4 --tensors 256

Staging: the roofline is one ``non_blocking`` copy of the same bytes from
device memory into one pinned host buffer, timed to its completion.  Staging
is what ``AsyncCheckpointer.save`` blocks on plus the copies it queues:
``StagingPool.stage`` of the state dict's items in steady state (the pool's
pinned buffers already exist, as from the second save on), timed until
``wait_ready`` returns.  Goal: <= 1.2x.

Loading: ``dcp.load`` with ``ObjectStoreReader`` into CUDA tensors from a
``file://`` checkpoint of the same state dict (in the page cache after the
first round), timed until the device has the bytes, against one
``non_blocking`` copy of the same bytes from one pinned host buffer to the
device.  The load also reads the files, checks every item's crc32 in the
pinned buffers and parses the archives, so the ratio says what those cost
beyond the copy.  Prints the figures and their ratios; writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcpstore import ObjectStoreReader, ObjectStoreWriter
from dcpstore.staging import StagingPool


def best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.staging: no CUDA device; nothing to measure", file=sys.stderr)
        return 2
    total = int(args.gib * (1 << 30))
    per = total // args.tensors // 4
    sd = {f"layer{i}.weight": torch.randn(per, device="cuda") for i in range(args.tensors)}
    nbytes = per * 4 * args.tensors

    flat = torch.empty(nbytes // 4, device="cuda")
    pinned = torch.empty(nbytes // 4, pin_memory=True)

    def roofline():
        pinned.copy_(flat, non_blocking=True)
        torch.cuda.synchronize()

    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict=sd, storage_meta=None, is_coordinator=True)
    items = list(planner.create_local_plan().items)
    pool = StagingPool(pin_memory=True)
    pool.stage(items, planner).wait_ready()  # allocate the pool's buffers once
    blocking = []

    def staging():
        t0 = time.perf_counter()
        staged = pool.stage(items, planner)
        blocking.append(time.perf_counter() - t0)
        staged.wait_ready()

    roof_s = best_of(roofline, args.repeat)
    stage_s = best_of(staging, args.repeat)
    staged = pool.stage(items, planner)
    staged.wait_ready()
    assert all(torch.equal(staged.resolve_data(item).cuda(), sd[item.index.fqn]) for item in items)
    pool.clear()

    def h2d_roofline():
        flat.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()

    with tempfile.TemporaryDirectory(prefix="dcpstore-bench-") as root:
        url = f"file://{root}/ckpt"
        dcp.save(sd, storage_writer=ObjectStoreWriter(url), no_dist=True)
        dest = {k: torch.empty_like(v) for k, v in sd.items()}

        def loading():
            dcp.load(dest, storage_reader=ObjectStoreReader(url), no_dist=True)
            torch.cuda.synchronize()

        h2d_s = best_of(h2d_roofline, args.repeat)
        load_s = best_of(loading, args.repeat)
        assert all(torch.equal(dest[k], v) for k, v in sd.items())
    figures = {
        "device": torch.cuda.get_device_name(0),
        "bytes": nbytes,
        "tensors": args.tensors,
        "roofline_s": roof_s,
        "roofline_GBps": nbytes / roof_s / 1e9,
        "staging_s": stage_s,
        "staging_blocking_s": min(blocking),
        "ratio": stage_s / roof_s,
        "h2d_roofline_s": h2d_s,
        "h2d_roofline_GBps": nbytes / h2d_s / 1e9,
        "load_s": load_s,
        "load_GBps": nbytes / load_s / 1e9,
        "load_ratio": load_s / h2d_s,
    }
    print(
        f"{figures['device']}: {nbytes / 2**30:.2f} GiB in {args.tensors} tensors; "
        f"D2H roofline {roof_s * 1e3:.1f} ms ({figures['roofline_GBps']:.1f} GB/s); "
        f"staging {stage_s * 1e3:.1f} ms (save() blocks {figures['staging_blocking_s'] * 1e3:.1f} ms); "
        f"staging / roofline = {figures['ratio']:.2f} (goal <= 1.2)"
    )
    print(
        f"load into CUDA tensors {load_s * 1e3:.1f} ms ({figures['load_GBps']:.1f} GB/s) from a file:// checkpoint; "
        f"H2D roofline {h2d_s * 1e3:.1f} ms ({figures['h2d_roofline_GBps']:.1f} GB/s); "
        f"load / roofline = {figures['load_ratio']:.2f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
