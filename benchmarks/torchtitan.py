"""Stock torchtitan on ``s3://`` against dcpstore's torchtitan integration: one model, one server, one run.

    python -m benchmarks.torchtitan                          # 2 ranks, ~290 MiB state dict, 3 rounds, async
    python -m benchmarks.torchtitan --mib 16 --rounds 1      # quick
    python -m benchmarks.torchtitan --async-mode disabled

Each rank (spawned, gloo) trains a 4-layer MLP sharded with FSDP2, with
torchtitan's ``OptimizersContainer`` (AdamW) and ``LRSchedulersContainer``,
and torchtitan 0.3's ``CheckpointManager``: the stock one
(``folder="s3://..."``: DCP's ``FsspecWriter``/``FsspecReader`` over s3fs) or
dcpstore's (``dcpstore.integrations.torchtitan``), built from the same
``Config`` fields.  The state dict is the model, its two AdamW moments, the
scheduler and the step: about 3 x ``--mib``.

Per round, the contenders take turns (A B A B ...), each on a fresh prefix
of one moto server on loopback: ``--saves`` saves at ``--async-mode`` (the
first plans and allocates; the rest are the steady state, where dcpstore
reuses its plans and host buffers: their median per round), then a fresh
manager resumes the newest step.  Reported, per save and for the resume:
the blocking time of ``save()`` (training stalled), the time to commit
(``save()`` until torchtitan's wait for it returns), the resume time
(``load()`` of the fresh manager, step discovery included), and HTTP
requests.  Times are the slowest rank's; requests are summed over ranks.
Medians over rounds, and dcpstore / stock ratios from this run only: never
compare absolute times across runs.  Writes ``torchtitan.json``,
``torchtitan.txt`` and ``torchtitan.png`` into ``--out``.

``TrainingJob`` is also what tests/test_torchtitan.py trains with.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import uuid
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

CONTENDERS = {"torchtitan (FsspecWriter)": False, "torchtitan + dcpstore": True}  # name: uses dcpstore
PHASES = ("first save", "steady save", "resume")


class TrainState(Stateful):
    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step, dtype=torch.int64)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"].item())


class TrainingJob:
    """One rank's model, optimizer, scheduler and torchtitan checkpoint manager (stock or dcpstore's).

    The model is 4 square ``Linear`` layers of ``mib`` MiB in all, sharded
    with FSDP2 over the default group's ranks (on CUDA: one rank, unsharded,
    since gloo has no CUDA ``all_gather_into_tensor``).  A training step is a
    deterministic function of the step number, so two runs agree bit for bit.
    ``config``: ``CheckpointManager.Config`` fields (``enable=True`` and
    ``interval=1`` unless given).
    """

    def __init__(self, root: str, *, dcpstore: bool = True, mib: float = 0.05, device: str = "cpu", **config: Any):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
        from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

        if dcpstore:
            from dcpstore.integrations.torchtitan import CheckpointManager
        else:
            from torchtitan.components.checkpointer import CheckpointManager

        torch.manual_seed(0)
        width = max(8, int((mib * 2**20 / 4 / 4) ** 0.5))
        self.model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4))).to(device)
        if device == "cpu":
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for layer in self.model:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.width, self.device = width, device
        self.optimizers = OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
            implementation="for-loop",
        ).build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=100
        )
        self.train_state = TrainState()
        config.setdefault("enable", True)
        config.setdefault("interval", 1)
        self.manager = CheckpointManager.Config(folder=root, **config).build(
            dataloader=None,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=None,
        )

    def train_step(self) -> None:
        self.train_state.step += 1
        gen = torch.Generator().manual_seed(self.train_state.step)
        x = torch.randn(4, self.width, generator=gen).to(self.device)
        self.optimizers.zero_grad()
        self.model(x).square().mean().backward()
        self.optimizers.step()
        self.lr_schedulers.step()

    def train_and_save(self, steps: int) -> None:
        for _ in range(steps):
            self.train_step()
            self.manager.save(self.train_state.step)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Model and optimizer as full CPU tensors (a collective), and the step."""
        out = {"train_step": torch.tensor(self.train_state.step)}
        for k, v in self.manager._flattened_model_states_sd().items():
            if k == "train_state":
                continue
            for name, t in _tensors(v, k):
                out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()
        return out

    def close(self) -> None:
        self.manager.close()


def _tensors(value: Any, prefix: str):
    if isinstance(value, Stateful):
        value = value.state_dict()
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors(v, f"{prefix}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{prefix}.{i}")
    elif isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, (int, float)):
        yield prefix, torch.tensor(value)


# -- the measurement ----------------------------------------------------------------------------


def _measure_contender(root: str, uses_dcpstore: bool, mib: float, async_mode: str, saves: int, counter) -> dict:
    """One rank's figures for one contender and round: PHASES x (blocking_s, commit_s, requests)."""
    job = TrainingJob(root, dcpstore=uses_dcpstore, mib=mib, keep_latest_k=0, async_mode=async_mode)
    per_save = []
    for _ in range(saves):
        job.train_step()
        dist.barrier()
        counter.count = 0
        t0 = time.perf_counter()
        job.manager.save(job.train_state.step)
        blocking = time.perf_counter() - t0
        job.manager.maybe_wait_for_saving()
        per_save.append({"blocking_s": blocking, "commit_s": time.perf_counter() - t0, "requests": counter.count})
    steady = {key: statistics.median(s[key] for s in per_save[1:]) for key in per_save[0]}
    out: dict[str, Any] = {"first save": per_save[0], "steady save": steady, "saves": per_save}
    state_bytes = sum(t.numel() * t.element_size() for t in job.full_state().values())
    job.close()
    fresh = TrainingJob(root, dcpstore=uses_dcpstore, mib=mib, keep_latest_k=0, async_mode=async_mode)
    dist.barrier()
    counter.count = 0
    t0 = time.perf_counter()
    assert fresh.manager.load(), f"{root}: nothing to resume"
    resume = time.perf_counter() - t0
    out["resume"] = {"blocking_s": resume, "commit_s": resume, "requests": counter.count}
    assert fresh.train_state.step == saves
    fresh.close()
    out["state_mib"] = state_bytes / 2**20
    return out


def _rank_main(rank, world_size, init_file, queue, endpoint, bucket, args):
    from benchmarks.run import RequestCounter

    os.environ["AWS_ENDPOINT_URL"] = endpoint
    warnings.simplefilter("ignore")
    import logging

    logging.getLogger("torchtitan").setLevel(logging.WARNING)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    counter = RequestCounter()
    rows = []
    try:
        for r in range(args.rounds):
            for name, uses_dcpstore in CONTENDERS.items():
                root = f"s3://{bucket}/r{r}-{'dcpstore' if uses_dcpstore else 'stock'}"
                rows.append((name, r, _measure_contender(root, uses_dcpstore, args.mib, args.async_mode, args.saves, counter)))
        queue.put((rank, rows))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        queue.put((rank, f"{type(e).__name__}: {e}"))
        raise
    finally:
        dist.destroy_process_group()


def run(endpoint: str, args) -> list:
    """Every rank's rows, merged: the slowest rank's times, the requests of all ranks."""
    import boto3

    from benchmarks.ranks import spawn_ranks

    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    per_rank = spawn_ranks(_rank_main, args.world_size, endpoint, bucket, args)
    merged = []
    for i, (name, r, _) in enumerate(per_rank[0]):
        ranks = [per_rank[k][i][2] for k in sorted(per_rank)]
        row = {"state_mib": ranks[0]["state_mib"]}  # full tensors: the same on every rank
        for phase in PHASES:
            row[phase] = _merge([x[phase] for x in ranks])
        row["saves"] = [_merge([x["saves"][j] for x in ranks]) for j in range(len(ranks[0]["saves"]))]
        merged.append((name, r, row))
    return merged


def _merge(ranks: list[dict]) -> dict:
    """A distributed save is as slow as its slowest rank; requests add up."""
    return {
        "blocking_s": max(x["blocking_s"] for x in ranks),
        "commit_s": max(x["commit_s"] for x in ranks),
        "requests": sum(x["requests"] for x in ranks),
    }


def summarize(rows: list) -> dict:
    """Medians per contender and phase, and dcpstore / stock ratios."""
    out: dict[str, dict] = {}
    for name in CONTENDERS:
        mine = [row for n, _, row in rows if n == name]
        out[name] = {
            phase: {key: statistics.median(row[phase][key] for row in mine) for key in mine[0][phase]} for phase in PHASES
        }
        out[name]["state_mib"] = mine[0]["state_mib"]
        out[name]["worst_steady_blocking_s"] = max(s["blocking_s"] for row in mine for s in row["saves"][1:])
    stock, ours = (out[n] for n in CONTENDERS)
    out["ratios (dcpstore / stock)"] = {
        phase: {key: ours[phase][key] / stock[phase][key] if stock[phase][key] else float("nan") for key in stock[phase]}
        for phase in PHASES
    }
    return out


def table(summary: dict, label: str) -> str:
    lines = [f"\n{label}", f"{'contender':<30}{'phase':<14}{'blocking s':>11}{'commit s':>10}{'requests':>10}"]
    for name, phases in summary.items():
        for phase in PHASES:
            s = phases[phase]
            fmt = "{:>11.2f}{:>10.2f}{:>10.2f}" if name.startswith("ratios") else "{:>11.3f}{:>10.3f}{:>10.0f}"
            lines.append(f"{name:<30}{phase:<14}" + fmt.format(s["blocking_s"], s["commit_s"], s["requests"]))
    lines.append("(resume: the blocking and commit columns are both the time of load())")
    for name in CONTENDERS:
        lines.append(f"{name}: longest steady-state stall of any save: {summary[name]['worst_steady_blocking_s']:.3f} s")
    return "\n".join(lines)


def plot(summary: dict, label: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.38
    for i, name in enumerate(CONTENDERS):
        xs = [p + (i - 0.5) * width for p in range(len(PHASES))]
        ax1.bar(xs, [summary[name][p]["commit_s"] for p in PHASES], width, label=f"{name}: commit / load", alpha=0.5)
        ax1.bar(xs, [summary[name][p]["blocking_s"] for p in PHASES], width, label=f"{name}: blocking", alpha=0.9)
        ax2.bar(xs, [summary[name][p]["requests"] for p in PHASES], width, label=name)
    for ax, ylabel in ((ax1, "seconds (median)"), (ax2, "HTTP requests (all ranks)")):
        ax.set_xticks(range(len(PHASES)), PHASES)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.suptitle(label, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=96, help="model size; the state dict is about 3x (AdamW)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--saves", type=int, default=4, help="saves per round: the first, then the steady state")
    parser.add_argument("--async-mode", default="async", choices=("disabled", "async"),
                        help="torchtitan's async_mode for both (async_with_pinned_mem needs an accelerator)")
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    os.makedirs(args.out, exist_ok=True)
    import psutil

    from dcpstore.local_s3 import TEST_CREDENTIALS, MotoServer

    os.environ.update(TEST_CREDENTIALS)
    server = MotoServer()
    try:
        rows = run(server.endpoint, args)
    finally:
        server.stop()
    summary = summarize(rows)
    machine = f"{platform.machine()} {psutil.cpu_count()} cores {psutil.virtual_memory().total / 2**30:.0f} GiB"
    label = (
        f"torchtitan 0.3 CheckpointManager, async_mode={args.async_mode}, {args.world_size} ranks (FSDP2, gloo), "
        f"{summary[next(iter(CONTENDERS))]['state_mib']:.0f} MiB state dict, moto on loopback, "
        f"{args.rounds} rounds, medians; {machine}"
    )
    text = table(summary, label)
    print(text)
    results = {"date": datetime.date.today().isoformat(), "machine": machine, "args": vars(args), "label": label,
               "summary": summary, "rows": rows}
    with open(os.path.join(args.out, "torchtitan.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(args.out, "torchtitan.txt"), "w") as f:
        f.write(text + "\n")
    plot(summary, label, os.path.join(args.out, "torchtitan.png"))
    print(f"\nwrote {args.out}/torchtitan.json, torchtitan.txt, torchtitan.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
