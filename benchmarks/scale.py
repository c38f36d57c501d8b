"""What persisted plans cost as the world size grows, simulated in one process.

    python -m benchmarks.scale                          # W = 8 64 256 1024 4096, N = 64 items/rank
    python -m benchmarks.scale --world-sizes 8 64 --items-per-rank 32 --out /tmp/s   # quick

No process group, no storage: W ranks' local plans are made directly, as
``DefaultSavePlanner`` makes them for an FSDP-style state dict (per rank
``N`` items: most of them ``Shard(0)`` chunks of a parameter, one chunk per
rank; a few plain tensors and a few bytes items that every rank holds and the
dedup gives to one rank).  The coordinator's global step runs once with
torch's ``DefaultSavePlanner``, write results are made up for the final plans,
and ``ObjectStoreWriter.finish`` runs with ``commit`` captured.  Per W it
reports:

* ``.metadata`` bytes: torch's own for the same state (``FileSystemWriter``'s:
  storage data and flatten mappings), dcpstore without persisted plans
  (checksums only), with the compact plans (this version) and with the full
  plans of the previous format;
* ``finish_s``: coordinator time in ``finish()`` (encode + pickle), compact
  form, beside ``finish_no_plans_s`` (pickle only);
* ``prime_s``: ``PlanCache.fill_from_metadata`` on one rank (rank W-1), from
  the unpickled metadata; ``prime_v1_s``: the same from full plans, which
  redoes the global step over all W plans (run up to ``--v1-max-world``);
* ``read_bytes``: what each rank reads at resume (the whole ``.metadata``),
  and ``unpickle_s``: ``pickle.loads`` of it (C unpickler; dcpstore's
  allow-list unpickler is 2.5-3.5x slower, see ``safe_pickle``).

Writes ``scale.json``, ``scale.txt`` and (with matplotlib) ``scale.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import io
import json
import logging
import os
import pickle
import platform
import time
import zlib

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from dcpstore import planner_data
from dcpstore.plan_cache import PlanCache
from dcpstore.writer import ChecksummedWriteResult, ObjectStoreWriter

REPLICATED = 4  # plain tensors every rank holds (norms, scalars)
BYTES_ITEMS = 2  # bytes items every rank holds (step, rng state)


def simulate_plans(world_size: int, items_per_rank: int) -> list[SavePlan]:
    """The local plans ``DefaultSavePlanner`` makes on each of ``world_size`` FSDP ranks."""
    n_shard = max(1, items_per_rank - REPLICATED - BYTES_ITEMS)
    props = TensorProperties(dtype=torch.bfloat16)
    shard_fqns = [f"model.layers.{i // 4}.{('wq', 'wk', 'wv', 'wo')[i % 4]}.weight" for i in range(n_shard)]
    rep_fqns = [f"model.norm{i}.weight" for i in range(REPLICATED)]
    bytes_fqns = [f"extra.item{i}" for i in range(BYTES_ITEMS)]
    rows, cols = 64 * world_size, 64
    plans = []
    for rank in range(world_size):
        items = []
        for fqn in shard_fqns:
            offsets, sizes = torch.Size([64 * rank, 0]), torch.Size([64, cols])
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, sizes), props, torch.Size([rows, cols])),
                )
            )
        for fqn in rep_fqns:
            offsets, size = torch.Size([0]), torch.Size([cols])
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, offsets),
                    type=WriteItemType.TENSOR,
                    tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, size), props, size),
                )
            )
        for fqn in bytes_fqns:
            items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
        # The flatten mappings: the same on every rank, one dict per rank (as gathered).
        mappings = {fqn: tuple(fqn.split(".", 1)) for fqn in shard_fqns + rep_fqns + bytes_fqns}
        plans.append(SavePlan(items, planner_data=mappings))
    return plans


def global_step(plans: list[SavePlan]) -> tuple[ObjectStoreWriter, list[SavePlan], Metadata]:
    """The coordinator's global step, as ``dcp.save`` runs it with an ``ObjectStoreWriter``."""
    writer = ObjectStoreWriter("memory://dcpstore-scale-bench")
    planner = DefaultSavePlanner()
    global_plans, metadata = planner.create_global_plan([writer.attach_local_plan(p) for p in plans])
    central = writer.prepare_global_plan(global_plans)
    return writer, central, metadata


def write_results(central: list[SavePlan]) -> list[list[ChecksummedWriteResult]]:
    """What the ranks' ``write_data`` would report for their final plans."""
    results = []
    for rank, plan in enumerate(central):
        out, offset = [], 0
        for n, item in enumerate(plan.items):
            length = (item.tensor_storage_size() or 8) + 1100  # torch.save framing
            path = f"__{rank}_0123456789abcdef_{n % 4}.distcp"
            out.append(ChecksummedWriteResult(item.index, length, _StorageInfo(path, offset, length), crc32=zlib.crc32(path.encode())))
            offset += length
        results.append(out)
    return results


class _Captured(ObjectStoreWriter):
    raw: bytes = b""

    def commit(self, raw_metadata: bytes, storage_data: dict) -> None:
        self.raw = raw_metadata


def torch_metadata_bytes(metadata: Metadata, results) -> int:
    """``.metadata`` as torch's ``FileSystemWriter`` writes it for the same save."""
    md = dataclasses.replace(metadata)
    md.storage_data = {
        wr.index: _StorageInfo(wr.storage_data.relative_path, wr.storage_data.offset, wr.storage_data.length)
        for rr in results
        for wr in rr
    }
    md.storage_meta = StorageMeta(checkpoint_id="s3://bucket/run/step_00000100", save_id="0" * 32)
    md.version = "1.0.0"
    return len(pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL))


def finish_bytes(writer_plans, metadata: Metadata, results, *, checksums: bool = True) -> tuple[bytes, float]:
    writer = _Captured("memory://dcpstore-scale-bench", checksums=checksums)
    writer.remember_local_plans(writer_plans)
    if writer_plans is None:
        writer._plans_missing = "cached"  # quiet: measuring "no plans"
    md = dataclasses.replace(metadata)
    t0 = time.perf_counter()
    writer.finish(md, results)
    return writer.raw, time.perf_counter() - t0


def v1_bytes(plans: list[SavePlan], metadata: Metadata, results) -> bytes:
    """``.metadata`` in the previous format: every rank's full SavePlan."""
    raw, _ = finish_bytes(None, metadata, results)
    md = pickle.loads(raw)
    md.planner_data = {**md.planner_data, planner_data.ALL_LOCAL_PLANS_KEY: plans}
    return pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL)


def best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(world_size: int, items_per_rank: int, *, v1_max_world: int, repeat: int) -> dict:
    plans = simulate_plans(world_size, items_per_rank)
    t0 = time.perf_counter()
    writer, central, metadata = global_step(plans)
    global_step_s = time.perf_counter() - t0
    results = write_results(central)
    torch_bytes = torch_metadata_bytes(metadata, results)
    no_plans, finish_no_plans_s = finish_bytes(None, metadata, results)
    compact_raw, finish_s = finish_bytes(writer.all_local_plans, metadata, results)
    t0 = time.perf_counter()
    loaded = pickle.loads(compact_raw)
    unpickle_s = time.perf_counter() - t0
    # read_plans gives back the ranks' plans exactly.
    assert planner_data.read_plans(loaded) == [planner_data.strip_plan(p) for p in plans]
    rank = world_size - 1

    def prime(md, r=rank):
        cache = PlanCache()
        assert cache.fill_from_metadata(md, rank=r, world_size=world_size, planner=DefaultSavePlanner(), writer=writer)
        return cache

    entry = prime(loaded).entry
    want = central[rank]
    assert entry.local_plan == planner_data.strip_plan(plans[rank])
    assert entry.central_plan == want and [i.index.index for i in entry.central_plan.items] == [i.index.index for i in want.items]
    prime_s = best_of(lambda: prime(loaded), repeat)
    prime_coordinator_s = best_of(lambda: prime(loaded, 0), repeat)
    row = {
        "world_size": world_size,
        "items_per_rank": items_per_rank,
        "items_total": sum(len(p.items) for p in plans),
        "torch_bytes": torch_bytes,
        "no_plans_bytes": len(no_plans),
        "compact_bytes": len(compact_raw),
        "compact_plans_bytes": len(compact_raw) - len(no_plans),
        "plans_vs_torch": (len(compact_raw) - len(no_plans)) / torch_bytes,
        "finish_s": finish_s,
        "finish_no_plans_s": finish_no_plans_s,
        "global_step_s": global_step_s,
        "prime_s": prime_s,
        "prime_coordinator_s": prime_coordinator_s,
        "read_bytes": len(compact_raw),
        "unpickle_s": unpickle_s,
    }
    if world_size <= v1_max_world:
        v1_raw = v1_bytes([planner_data.strip_plan(p) for p in plans], metadata, results)
        v1 = pickle.loads(v1_raw)
        row["v1_bytes"] = len(v1_raw)
        row["v1_plans_vs_torch"] = (len(v1_raw) - len(no_plans)) / torch_bytes
        row["prime_v1_s"] = best_of(lambda: prime(v1), 1)
    return row


COLUMNS = [
    ("W", "world_size", "{:d}"),
    ("torch .metadata", "torch_bytes", "{:,}"),
    ("dcpstore, no plans", "no_plans_bytes", "{:,}"),
    ("dcpstore, compact plans", "compact_bytes", "{:,}"),
    ("plans / torch", "plans_vs_torch", "{:.1%}"),
    ("previous format (full plans)", "v1_bytes", "{:,}"),
    ("finish, no plans s", "finish_no_plans_s", "{:.2f}"),
    ("finish, compact plans s", "finish_s", "{:.2f}"),
    ("prime rank W-1 s", "prime_s", "{:.4f}"),
    ("prime rank 0 s", "prime_coordinator_s", "{:.4f}"),
    ("prime, full plans s", "prime_v1_s", "{:.2f}"),
    ("read per rank", "read_bytes", "{:,}"),
    ("unpickle s", "unpickle_s", "{:.2f}"),
]


def table(rows: list[dict]) -> str:
    head = "| " + " | ".join(c[0] for c in COLUMNS) + " |"
    sep = "|" + "|".join("---:" for _ in COLUMNS) + "|"
    lines = [head, sep]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(row[key]) if key in row else "-" for _, key, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def plot(results: dict, path: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    ws = [r["world_size"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.loglog(ws, [r["torch_bytes"] for r in rows], "o-", label="torch's own")
    a.loglog(ws, [r["compact_bytes"] for r in rows], "o-", label="dcpstore, compact plans")
    v1 = [(r["world_size"], r["v1_bytes"]) for r in rows if "v1_bytes" in r]
    if v1:
        a.loglog(*zip(*v1), "o--", label="previous format (full plans)")
    a.set_xlabel("world size W")
    a.set_ylabel(".metadata bytes")
    a.legend()
    a.set_title(f".metadata size, N={results['items_per_rank']} items/rank")
    b.loglog(ws, [r["prime_s"] for r in rows], "o-", label="prime rank W-1 (compact)")
    b.loglog(ws, [r["prime_coordinator_s"] for r in rows], "o-", label="prime rank 0 (compact)")
    pv1 = [(r["world_size"], r["prime_v1_s"]) for r in rows if "prime_v1_s" in r]
    if pv1:
        b.loglog(*zip(*pv1), "o--", label="prime from full plans")
    b.loglog(ws, [r["unpickle_s"] for r in rows], "o:", label="unpickle .metadata")
    b.set_xlabel("world size W")
    b.set_ylabel("seconds")
    b.legend()
    b.set_title("resume, per rank")
    fig.suptitle(f"dcpstore plans at scale on {results['machine']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 256, 1024, 4096])
    parser.add_argument("--items-per-rank", type=int, default=64)
    parser.add_argument("--v1-max-world", type=int, default=1024, help="largest W to time the full-plans prime at")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    os.makedirs(args.out, exist_ok=True)
    machine = f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}"
    results = {
        "machine": machine,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "items_per_rank": args.items_per_rank,
        "rows": [],
    }
    for ws in args.world_sizes:
        row = measure(ws, args.items_per_rank, v1_max_world=args.v1_max_world, repeat=args.repeat)
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
    rows = results["rows"]
    results["acceptance"] = {
        "max_plans_vs_torch": max(r["plans_vs_torch"] for r in rows),
        "prime_largest_vs_smallest": rows[-1]["prime_s"] / rows[0]["prime_s"],
    }
    text = io.StringIO()
    text.write(f"{machine}, torch {torch.__version__}, N={args.items_per_rank} items/rank\n\n")
    text.write(table(rows) + "\n\n")
    acc = results["acceptance"]
    text.write(
        f"persisted plans add at most {acc['max_plans_vs_torch']:.1%} to torch's own .metadata; "
        f"prime at W={rows[-1]['world_size']} is {acc['prime_largest_vs_smallest']:.2f}x the one at W={rows[0]['world_size']}\n"
    )
    print("\n" + text.getvalue())
    with open(os.path.join(args.out, "scale.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(args.out, "scale.txt"), "w") as f:
        f.write(text.getvalue())
    wrote = ["scale.json", "scale.txt"]
    if plot(results, os.path.join(args.out, "scale.png")):
        wrote.append("scale.png")
    print(f"wrote {', '.join(os.path.join(args.out, w) for w in wrote)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
