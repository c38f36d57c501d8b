"""Read once, restore everywhere: what a job reads from the bucket to load one state, with and without ``read_once``.

    python -m benchmarks.read_once                      # 4 gloo ranks, 64 MiB, 3 rounds
    python -m benchmarks.read_once --size-mib 8 --rounds 1   # quick
    python -m benchmarks.read_once --plan 8x512x2000    # the coordinator's planning at 4,096 ranks, simulated

One moto server subprocess on loopback; W gloo ranks (spawned as torchrun
starts them: ``benchmarks.ranks``) save one state
in three layouts (``replicated``: DDP, every rank holds it all; ``hsdp``: a
2 x W/2 mesh, ``[Replicate(), Shard(0)]``; ``sharded``: a 1-D mesh,
``Shard(0)``), then load each with ``dcp.load`` and ``ObjectStoreReader``,
``read_once`` off and on, interleaved A B A B for ``--rounds`` rounds, into
preallocated destinations.  Per load: the bytes the whole job asked the
bucket for (each rank's ``ObjectStoreReader.bytes_read``, summed) against the
stored shard bytes, the wall time (from a barrier to the slowest rank's
return), the ranks' CPU and the server's (moto is a process of this machine
too: what the job stops asking of it shows there).  Medians; ratios are of
this run only.  Every load is checked
bit-exact on every rank.  Writes ``read_once.json`` and ``read_once.png``
into ``--out``.

On one machine the "links between ranks" are loopback, as is the bucket:
the wall time shows the cost of the exchange, not the bandwidth a real
restore gains (docs/scale.md models that at 4,096 ranks).

``--plan RxSxN`` simulates the coordinator's side in one process: R replica
groups of S shards, N stored items of 1.1 MB a rank, as local plans naming
their items; it prints the CPU ``cooperative_load.plan`` takes and the
pickled bytes each rank sends the coordinator and gets back.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid

import torch

from benchmarks.ranks import spawn_ranks
from benchmarks.report import write_report

LAYOUTS = ("replicated", "hsdp", "sharded")
MODES = ("alone", "read_once")


def full_state(mib: float, seed: int = 0) -> dict:
    """Eight float32 tensors of different sizes, about ``mib`` MiB in all, rows a multiple of 4."""
    g = torch.Generator().manual_seed(seed)
    weights = [1, 1, 2, 2, 3, 4, 6, 9]
    unit = mib * (1 << 20) / sum(weights) / 4 / 256  # rows per weight
    return {f"layer{i}.weight": torch.randn(max(4, int(w * unit) // 4 * 4), 256, generator=g) for i, w in enumerate(weights)}


_meshes: dict = {}


def layout_state(layout: str, full: dict, world_size: int, zeros: bool) -> dict:
    """This rank's state dict of ``full`` in ``layout`` (zeros to load into), plus a replicated non-tensor item."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    values = {k: torch.zeros_like(v) if zeros else v.clone() for k, v in full.items()}
    if layout == "replicated":
        sd = values
    else:
        shape, placements = ((2, world_size // 2), [Replicate(), Shard(0)]) if layout == "hsdp" else ((world_size,), [Shard(0)])
        if shape not in _meshes:
            _meshes[shape] = init_device_mesh("cpu", shape)
        sd = {k: distribute_tensor(v, _meshes[shape], placements) for k, v in values.items()}
    sd["step"] = 0 if zeros else 41
    return sd


def matches(sd: dict, want: dict) -> bool:
    """Whether this rank's ``sd`` holds ``want``'s values, shard by shard."""
    for k, v in want.items():
        got = sd[k]
        if isinstance(v, torch.Tensor):
            local = (got.to_local() if hasattr(got, "to_local") else got, v.to_local() if hasattr(v, "to_local") else v)
            if not torch.equal(*local):
                return False
        elif got != v:
            return False
    return True


def _rank_main(rank, world_size, init_file, queue, endpoint, root, args, server_pid) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import psutil

    import dcpstore

    server = psutil.Process(server_pid)
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        full = full_state(args.size_mib)
        for layout in LAYOUTS:
            writer = dcpstore.ObjectStoreWriter(f"{root}/{layout}")
            dcp.save(layout_state(layout, full, world_size, zeros=False), storage_writer=writer)
            writer.close()
        wants = {layout: layout_state(layout, full, world_size, zeros=False) for layout in LAYOUTS}
        dests = {layout: layout_state(layout, full, world_size, zeros=True) for layout in LAYOUTS}
        rows = []
        for round_ in range(args.rounds + 1):  # round 0 warms the connections and is not reported
            for layout in LAYOUTS:
                for mode in MODES:
                    for v in dests[layout].values():
                        if isinstance(v, torch.Tensor):
                            (v.to_local() if hasattr(v, "to_local") else v).zero_()
                    reader = dcpstore.ObjectStoreReader(f"{root}/{layout}", read_once=mode == "read_once")
                    dist.barrier()
                    server_cpu = sum(server.cpu_times()[:2])
                    start, cpu = time.perf_counter(), time.process_time()
                    dcp.load(dests[layout], storage_reader=reader)
                    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
                    dist.barrier()  # every rank's load is over: the server's CPU since is this load's
                    server_cpu = sum(server.cpu_times()[:2]) - server_cpu
                    ok = matches(dests[layout], wants[layout])
                    rows.append((round_, layout, mode, seconds, reader.bytes_read, ok, cpu, server_cpu))
                    reader.close()
        queue.put((rank, rows))
    finally:
        dist.destroy_process_group()


def simulate_plan(replicas: int, shards: int, items: int, item_bytes: int = 1_100_000, round_bytes: int = 256 << 20) -> dict:
    """``cooperative_load.plan`` over R x S simulated local plans (rank r needs shard r % S of every item): its CPU and message sizes."""
    import pickle

    from torch.distributed.checkpoint.planner import LoadPlan

    from dcpstore import cooperative_load

    plans = []
    for rank in range(replicas * shards):
        shard = rank % shards
        wanted = tuple(
            (f"__{shard}_0123456789abcdef_{i % 4}.distcp", (i // 4) * item_bytes, item_bytes, f"model.layers.{i // 25}.w{i % 25}.weight", (shard * 512, 0))
            for i in range(items)
        )
        plans.append(LoadPlan([], storage_data=cooperative_load.Wanted(wanted)))
    cpu = time.process_time()
    out = cooperative_load.plan(plans, round_bytes=round_bytes)
    cpu = time.process_time() - cpu
    return {
        "ranks": replicas * shards,
        "items_per_rank": items,
        "plan_cpu_s": round(cpu, 2),
        "rounds": out[0].storage_data.rounds,
        "sent_per_rank_bytes": len(pickle.dumps(plans[0].storage_data)),
        "received_per_rank_bytes": len(pickle.dumps(out[0].storage_data)),
    }


def stored_bytes(root: str) -> dict[str, int]:
    """The shard bytes each layout's checkpoint holds."""
    from dcpstore.storage import open_store

    out = {}
    for layout in LAYOUTS:
        store = open_store(f"{root}/{layout}")
        try:
            out[layout] = sum(o.size for o in store.list("") if o.key.endswith(".distcp"))
        finally:
            store.close()
    return out


def summarize(gathered: list, stored: dict[str, int], rounds: int) -> dict:
    summary: dict = {}
    for layout in LAYOUTS:
        row: dict = {"stored_shard_bytes": stored[layout]}
        for mode in MODES:
            walls, ratios, cpus, server_cpus, exact = [], [], [], [], True
            for r in range(1, rounds + 1):
                per_rank = [[x for x in rows if x[0] == r and x[1] == layout and x[2] == mode][0] for rows in gathered]
                walls.append(max(x[3] for x in per_rank))
                ratios.append(sum(x[4] for x in per_rank) / stored[layout])
                cpus.append(sum(x[6] for x in per_rank))
                server_cpus.append(per_rank[0][7])
                exact = exact and all(x[5] for x in per_rank)
            row[mode] = {
                "load_s": statistics.median(walls),
                "bytes_read_vs_stored": statistics.median(ratios),
                "ranks_cpu_s": statistics.median(cpus),
                "server_cpu_s": statistics.median(server_cpus),
                "bit_exact": exact,
            }
        row["load_s_read_once_vs_alone"] = row["read_once"]["load_s"] / row["alone"]["load_s"]
        summary[layout] = row
    return summary


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(LAYOUTS))
    for i, mode in enumerate(MODES):
        left.bar([p + 0.4 * i for p in x], [summary[l][mode]["bytes_read_vs_stored"] for l in LAYOUTS], 0.4, label=mode)
        right.bar([p + 0.4 * i for p in x], [summary[l][mode]["load_s"] for l in LAYOUTS], 0.4, label=mode)
    for ax, title in ((left, "bytes the job read / stored shard bytes"), (right, "load wall time, s (median)")):
        ax.set_xticks([p + 0.2 for p in x], LAYOUTS)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=float, default=64)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--plan", metavar="RxSxN", help="only simulate the coordinator's planning: R replicas x S shards, N items a rank")
    args = parser.parse_args(argv)
    if args.plan:
        print(json.dumps(simulate_plan(*map(int, args.plan.split("x"))), indent=2))
        return 0
    if args.world_size < 2 or args.world_size % 2:
        parser.error("--world-size must be even (the hsdp layout is a 2 x W/2 mesh)")
    import boto3

    from dcpstore.local_s3 import TEST_CREDENTIALS, MotoServer

    os.environ.update({k: os.environ.get(k, v) for k, v in TEST_CREDENTIALS.items()})
    os.makedirs(args.out, exist_ok=True)
    with MotoServer() as server:
        bucket = f"read-once-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=server.endpoint).create_bucket(Bucket=bucket)
        root = f"s3://{bucket}/state"
        os.environ["AWS_ENDPOINT_URL"] = server.endpoint
        per_rank = spawn_ranks(_rank_main, args.world_size, server.endpoint, root, args, server.pid)
        summary = summarize([per_rank[r] for r in range(args.world_size)], stored_bytes(root), args.rounds)
    write_report(args.out, "read_once", argv, {"world_size": args.world_size, "size_mib": args.size_mib, "rounds": args.rounds}, summary, plot)
    for layout, row in summary.items():
        print(
            f"{layout:>10}: bytes read / stored  alone {row['alone']['bytes_read_vs_stored']:.2f}x  read_once {row['read_once']['bytes_read_vs_stored']:.2f}x;"
            f"  load  alone {row['alone']['load_s']:.3f} s  read_once {row['read_once']['load_s']:.3f} s"
            f"  ({row['load_s_read_once_vs_alone']:.2f}x);  CPU ranks + server  alone {row['alone']['ranks_cpu_s']:.2f} + {row['alone']['server_cpu_s']:.2f} s"
            f"  read_once {row['read_once']['ranks_cpu_s']:.2f} + {row['read_once']['server_cpu_s']:.2f} s;  bit-exact {row['alone']['bit_exact'] and row['read_once']['bit_exact']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
