"""``dcpstore demo``: the whole life of a checkpointed job, in about a minute.

A small model trains with ``AsyncCheckpointer`` saves every N steps.  The
first run is SIGKILLed right after one of its saves returns, while that
save's upload may still be running.  A second run resumes from the latest
*committed* step (an uncommitted one is invisible), and its first save reuses
the save plans persisted in the checkpoint.  With no S3 endpoint configured,
an embedded moto S3 server on loopback is started for the demo.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from tqdm import tqdm

from .checkpointer import AsyncCheckpointer
from .layout import committed_steps
from .storage import open_store


class TrainState(Stateful):
    """Model, optimizer and step as one DCP-friendly Stateful."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer, self.step = model, optimizer, 0

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def load_state_dict(self, state_dict):
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"])
        self.step = state_dict["step"]


def _make_job(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(2048, 64, generator=g)
    y = x[:, :8].sum(dim=1, keepdim=True).sin()
    return TrainState(model, optimizer), x, y


def train(root: str, steps: int, save_every: int, die_after: int | None, report: str) -> None:
    """One job's life: resume if a committed step exists, train, save every ``save_every``."""
    state, x, y = _make_job()
    ckpt = AsyncCheckpointer(root)
    events = []
    resumed = None
    if ckpt.latest_step() is not None:
        resumed = ckpt.load({"train": state})
        events.append({"event": "resumed", "step": resumed})
    handles = []
    loss = float("nan")
    for step in tqdm(range(state.step + 1, steps + 1), desc="resumed run" if resumed else "first run", unit="step"):
        state.step = step
        i = (step * 128) % x.shape[0]
        loss_t = torch.nn.functional.mse_loss(state.model(x[i : i + 128]), y[i : i + 128])
        state.optimizer.zero_grad()
        loss_t.backward()
        state.optimizer.step()
        loss = loss_t.item()
        ckpt.maybe_finalize()
        if step % save_every == 0:
            dying = die_after is not None and step >= die_after
            if dying:
                ckpt.wait()  # deterministic demo: earlier saves commit before the fatal one
            handles.append(ckpt.save({"train": state}, step=step))
            if dying:
                events.append({"event": "killed", "step": step})
                _write(report, events + _save_events(handles, resumed), loss)
                os.kill(os.getpid(), signal.SIGKILL)
    ckpt.wait()
    ckpt.close()
    _write(report, events + _save_events(handles, resumed), loss)


def _save_events(handles, resumed) -> list:
    """One event per save, with what its planning cost once it committed."""
    return [
        {
            "event": "save",
            "step": h.step,
            "blocking_ms": h.stats.blocking_s * 1e3,
            "after_resume": bool(resumed) and n == 0,
            "plan_reused": h.stats.plan_reused,
            "planning_ms": h.stats.planning_s * 1e3,
        }
        for n, h in enumerate(handles)
    ]


def _write(path: str, events: list, loss: float) -> None:
    with open(path, "w") as f:
        json.dump({"events": events, "loss": loss}, f)


def run_demo(steps: int = 300, save_every: int = 50, root: str | None = None) -> int:
    server = None
    if root is None:
        if not os.environ.get("AWS_ENDPOINT_URL"):
            from .local_s3 import TEST_CREDENTIALS, MotoServer

            print("no S3 endpoint configured (AWS_ENDPOINT_URL): starting an embedded moto S3 server on loopback")
            os.environ.update(TEST_CREDENTIALS)
            server = MotoServer()
            os.environ["AWS_ENDPOINT_URL"] = server.endpoint
        import boto3

        boto3.client("s3").create_bucket(Bucket="dcpstore-demo")
        root = f"s3://dcpstore-demo/run-{int(time.time())}"
    print(f"checkpoint root: {root}")
    if steps < 3 * save_every:
        raise ValueError(f"the demo needs steps >= 3 * save_every, got {steps} and {save_every}")
    die_after = max(2 * save_every, (steps * 3 // 5) // save_every * save_every)
    reports = []
    try:
        for die in (die_after, None):
            report = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"dcpstore-demo-{os.getpid()}-{len(reports)}.json")
            cmd = [sys.executable, "-m", "dcpstore.demo", "--root", root, "--steps", str(steps),
                   "--save-every", str(save_every), "--report", report]
            if die is not None:
                cmd += ["--die-after", str(die)]
            rc = subprocess.call(cmd)
            if die is not None and rc != -signal.SIGKILL:
                print(f"expected the first run to be killed, it exited with {rc}")
                return 1
            if die is None and rc != 0:
                print(f"the resumed run failed with exit code {rc}")
                return 1
            with open(report) as f:
                reports.append(json.load(f))
            os.unlink(report)
        _print_report(root, reports, die_after)
    finally:
        if server is not None:
            server.stop()
    return 0


def _print_report(root: str, reports: list, die_after: int) -> None:
    _, second = reports
    saves = [e for r in reports for e in r["events"] if e["event"] == "save"]
    resumed = next((e["step"] for e in second["events"] if e["event"] == "resumed"), None)
    after_resume = next(e for e in second["events"] if e["event"] == "save")
    print("\n=== dcpstore demo report ===")
    print(f"root:                       {root}")
    print(f"saves:                      {len(saves)}, blocking {min(s['blocking_ms'] for s in saves):.1f}-"
          f"{max(s['blocking_ms'] for s in saves):.1f} ms each")
    print(f"first run:                  SIGKILLed right after its save of step {die_after} returned")
    print(f"resumed from:               step {resumed} (latest committed)")
    print(f"first save after resume:    step {after_resume['step']}, plans reused: {after_resume['plan_reused']} "
          f"(planning {after_resume['planning_ms']:.1f} ms)")
    print(f"committed steps now:        {[s.step for s in committed_steps(open_store(root))]}")
    print(f"final loss:                 {second['loss']:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description="one run of the dcpstore demo job (used by `dcpstore demo`)")
    parser.add_argument("--root", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, required=True)
    parser.add_argument("--die-after", type=int, default=None)
    parser.add_argument("--report", required=True)
    args = parser.parse_args()
    train(args.root, args.steps, args.save_every, args.die_after, args.report)


if __name__ == "__main__":
    main()
