"""Seeded chaos: real gloo jobs saving through a fault-injecting proxy, checked from outside.

Each iteration draws a world size (2 or 4) and one fault: 503/500 on a shard
part or PUT, a connection reset, a stall past the read timeout, a truncated
GET while resuming, S3's rate limit (``ThrottleModel``) on every write, SIGKILL of a rank at staging / during the upload /
around the ``.metadata`` PUT, or two jobs writing one root at once.  Some
iterations then resume with a fresh job at the same or another world size.
Every other iteration saves with ``incremental=True``: a job's replicated
6 MiB tensor never changes, so each of its saves after the first (or after
the resume's load) has the bucket copy it from the last commit, under the
same faults.
After each iteration the root is checked with plain boto3 and a fresh
reader:

* every step with ``.metadata`` loads bit-exact (as one of the jobs saved it);
* the latest committed step loads;
* ``keep_last`` kept every step of its window that a job reported committed;
* the live ranks of a job agree on every step's outcome, within 60 s, and
  a committed step is never reported failed (nor a failed one committed);
* of two jobs racing for one step, at most one reports it committed, and
  the committed bytes are that job's;
* no multipart upload is left open after a clean ``close()``.

The default tier runs 2 iterations (``test_chaos[short]``); the ``slow``
tier runs the campaign, ``DCPSTORE_CHAOS_ITERATIONS`` (default 6, each fault
kind once per round of 12).  ``DCPSTORE_CHAOS_SEED`` sets both; a summary
line is printed (``pytest -s`` shows it).
"""

from __future__ import annotations

import collections
import os
import queue
import random
import re
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpstore
from chaos_worker import BIG, ROWS, full_state, rank_main
from dist_utils import in_environment, rank_context
from s3server import ThrottleModel

ITERATIONS = int(os.environ.get("DCPSTORE_CHAOS_ITERATIONS", "6"))  # the campaign's (slow tier)
SHORT_ITERATIONS = 2  # the default tier's
SEED = int(os.environ.get("DCPSTORE_CHAOS_SEED", "20261203"))
COLLECTIVE_TIMEOUT = 15  # seconds; bounds how long live ranks wait on a dead one
COMMIT_WINDOW = 10  # seconds; well above the proxy's 1 s hold of the .metadata PUT
# Seconds from save() to an outcome on every live rank.  A rank that lost the coordinator settles for
# COLLECTIVE_TIMEOUT + COMMIT_WINDOW + the landing time (5 + 4 + 4 + 1 s) after it began to wait: 39 s.
OUTCOME_BOUND = 75
STEPS = (1, 2, 3)
KEEP_LAST = 2

FAULTS = (
    "none",
    "503_part",
    "500_put",
    "reset_put",
    "stall_put",
    "truncated_get",
    "kill_staging",
    "kill_upload",
    "kill_commit_before_put",
    "kill_commit_after_put",
    "two_jobs",
    "throttle",
)


class _Job:
    """One job: ``world_size`` spawned ranks, their reports, and a way to kill one."""

    def __init__(self, ctx, results, name: str, world_size: int, spec: dict):
        fd, init_file = tempfile.mkstemp(prefix="gloo-chaos-")
        os.close(fd)
        os.unlink(init_file)
        self.name, self.world_size, self.spec, self.init_file = name, world_size, {**spec, "name": name}, init_file
        self.procs = [
            ctx.Process(target=in_environment, args=(dict(os.environ), rank_main, r, world_size, init_file, self.spec, results))
            for r in range(world_size)
        ]
        self.reports: dict[int, list] = collections.defaultdict(list)
        self.killed: set[int] = set()
        for p in self.procs:
            p.start()

    def kill(self, rank: int) -> None:
        self.killed.add(rank)
        self.procs[rank].kill()

    def exited(self, rank: int) -> bool:
        return any(kind == "exit" for kind, _ in self.reports[rank])

    def outcomes(self, rank: int) -> dict[int, tuple]:
        return {p[0]: p[1:] for kind, p in self.reports[rank] if kind == "outcome"}

    def reaped(self) -> None:
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if os.path.exists(self.init_file):
            os.unlink(self.init_file)


def _run_jobs(jobs_spec, on_request=None, deadline_s: float = 600) -> list[_Job]:
    """Run jobs to the end, routing reports; ``on_request`` may kill ranks as requests pass."""
    ctx = rank_context()
    results = ctx.Queue()
    jobs = {name: _Job(ctx, results, name, ws, spec) for name, ws, spec in jobs_spec}
    stop = threading.Event()
    watcher = None
    if on_request is not None:
        watcher = threading.Thread(target=on_request, args=(jobs, stop), daemon=True)
        watcher.start()
    deadline = time.monotonic() + deadline_s
    try:
        while True:
            waiting = [
                (j, r) for j in jobs.values() for r in range(j.world_size)
                if r not in j.killed and not j.exited(r) and j.procs[r].exitcode is None
            ]
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"jobs still running after {deadline_s}s: {[(j.name, r) for j, r in waiting]}")
            try:
                name, rank, kind, payload = results.get(timeout=0.5)
            except queue.Empty:
                continue
            jobs[name].reports[rank].append((kind, payload))
            if kind == "crash":
                raise AssertionError(f"job {name} rank {rank} crashed:\n{payload}")
    finally:
        stop.set()
        for j in jobs.values():
            j.reaped()
    return list(jobs.values())


def _reader(endpoint):
    return lambda url: dcpstore.ObjectStoreReader(url, storage_options={"endpoint_url": endpoint})


def _load_full(url: str, endpoint: str) -> dict:
    out = {
        "model": {"sharded": torch.zeros(ROWS, 64), "sharded_int": torch.zeros(ROWS, 5, dtype=torch.int64), "big": torch.zeros(BIG)},
        "extra": {"step": -1, "seed": -1},
    }
    dcp.load(out, storage_reader=_reader(endpoint)(url), no_dist=True)
    return {**out["model"], "meta": out["extra"]}


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in ("sharded", "sharded_int", "big")) and a["meta"] == b["meta"]


class _Iteration:
    def __init__(self, i: int, fault: str, rng: random.Random, bucket: str, s3, proxy):
        self.i, self.rng, self.bucket, self.s3, self.proxy = i, rng, bucket, s3, proxy
        self.prefix = f"chaos-{i}"
        self.root = f"s3://{bucket}/{self.prefix}"
        self.violations: list[str] = []
        self.world_size = rng.choice((2, 2, 4))
        self.fault = fault
        self.copies = 0  # UploadPartCopy requests the proxy saw: incremental saves at work under the fault

    def fail(self, message: str) -> None:
        self.violations.append(f"iteration {self.i} ({self.fault}, world size {self.world_size}): {message}")

    def spec(self, seed: int, **extra) -> dict:
        return {
            "root": self.root, "endpoint": self.proxy.endpoint, "seed": seed, "steps": STEPS,
            "keep_last": KEEP_LAST, "collective_timeout": COLLECTIVE_TIMEOUT, "commit_window": COMMIT_WINDOW,
            "incremental": self.i % 2 == 1,  # every other iteration: unchanged items are copied from the last commit
            **extra,
        }

    # -- faults -------------------------------------------------------------------------

    def run(self) -> None:
        rng, p, shard = self.rng, re.escape(f"/{self.prefix}/"), r"step_\d+/__\d+_[0-9a-f]+_\d+\.distcp"
        step = rng.choice(STEPS)
        on_request = None
        jobs = [("a", self.world_size, self.spec(seed=1))]
        if self.fault == "503_part":
            self.proxy.add("PUT", rf"{p}step_0*{step}/.*partNumber={rng.choice((1, 2))}$", status=503, times=1)
        elif self.fault == "500_put":
            self.proxy.add("PUT", rf"{p}{shard}", status=500, code="InternalError", times=2, after=rng.randrange(3))
        elif self.fault == "reset_put":
            self.proxy.add("PUT", rf"{p}{shard}", reset=True, times=1, after=rng.randrange(3))
        elif self.fault == "stall_put":  # longer than the read timeout: the attempt times out and is resent
            self.proxy.add("PUT", rf"{p}{shard}", delay=6, times=1, after=rng.randrange(3))
        elif self.fault in ("kill_staging", "kill_upload"):
            phase = self.fault.split("_")[1]
            if phase == "upload":
                self.proxy.add("*", rf"{p}step_0*{step}/.*\.distcp", delay=0.5)
            jobs = [("a", self.world_size, self.spec(seed=1, kill=(phase, rng.randrange(self.world_size), step)))]
        elif self.fault.startswith("kill_commit"):
            before = self.fault.endswith("before_put")
            victim = rng.randrange(self.world_size)
            # Before: the .metadata PUT is held, the victim dies, the PUT never lands.
            # After: the PUT lands, the victim dies as the response travels back.
            rule = self.proxy.add("PUT", rf"{p}step_0*{step}/\.metadata$", delay=1.0, reset=before, times=1)
            on_request = self._killer(rule, "a", victim)
        elif self.fault == "two_jobs":
            jobs = [("a", self.world_size, self.spec(seed=1)), ("b", 2, self.spec(seed=2))]
        elif self.fault == "throttle":  # S3's rate limit on the whole root, for every request of the run
            self.proxy.throttle = ThrottleModel(rate=rng.choice((5, 10)), burst=5)
        t0 = time.monotonic()
        ran = _run_jobs(jobs, on_request)
        self.count_copies()
        self.proxy.clear()
        self.check(ran, time.monotonic() - t0)
        if self.fault == "truncated_get" or self.rng.random() < 0.35:
            self.resume()

    def count_copies(self) -> None:
        self.copies += sum(1 for method, _, headers in self.proxy.headers if method == "PUT" and "x-amz-copy-source" in headers)

    @staticmethod
    def _killer(rule, job_name: str, victim: int):
        def watch(jobs, stop):
            while not stop.is_set():
                if rule.hits:
                    jobs[job_name].kill(victim)
                    return
                time.sleep(0.02)  # polling the proxy's own counter; no ordering depends on it

        return watch

    # -- checks -------------------------------------------------------------------------

    def committed(self) -> list[int]:
        resp = self.s3.list_objects_v2(Bucket=self.bucket, Prefix=f"{self.prefix}/")
        keys = [o["Key"] for o in resp.get("Contents", [])]
        return sorted(int(m.group(1)) for k in keys if (m := re.search(r"step_(\d+)/\.metadata$", k)))

    def check(self, jobs: list[_Job], elapsed: float) -> None:
        committed = self.committed()
        seeds = {"a": 1, "b": 2}
        reported_ok: dict[int, set[str]] = collections.defaultdict(set)
        for job in jobs:
            live = [r for r in range(job.world_size) if r not in job.killed and not self._self_killed(job, r)]
            per_rank = {r: job.outcomes(r) for r in live}
            for step in STEPS:
                seen = {r: o[step] for r, o in per_rank.items() if step in o}
                if not seen:
                    continue
                kinds = {o[0] for o in seen.values()}
                if len(kinds) > 1 or len(seen) != len(live):
                    self.fail(f"job {job.name} step {step}: live ranks disagree: {seen}; reports: {dict(job.reports)}")
                for r, (kind, msg, took) in seen.items():
                    if took > OUTCOME_BOUND:
                        self.fail(f"job {job.name} rank {r} step {step}: outcome after {took:.0f}s")
                    if kind == "ok":
                        reported_ok[step].add(job.name)
                    elif step in committed and len(jobs) == 1:
                        self.fail(f"job {job.name} rank {r} reported committed step {step} failed: {msg}")
            clean = not job.killed and all(not self._self_killed(job, r) for r in range(job.world_size))
            if clean and all(("closed", None) in job.reports[r] for r in range(job.world_size)):
                uploads = self.s3.list_multipart_uploads(Bucket=self.bucket, Prefix=f"{self.prefix}/").get("Uploads", [])
                if uploads and len(jobs) == 1:
                    self.fail(f"open uploads after a clean close(): {[u['Key'] for u in uploads]}")
        for step, names in reported_ok.items():
            if len(names) > 1:
                self.fail(f"step {step} reported committed by both jobs {sorted(names)}")
            if step not in committed and step >= max(reported_ok) - KEEP_LAST + 1:
                self.fail(f"step {step} reported committed but has no .metadata (keep_last={KEEP_LAST})")
        for step in committed:
            data = _load_full(f"{self.root}/step_{step:08d}", self.proxy.endpoint)
            writers = [n for n, s in seeds.items() if _equal(data, full_state(s, step))]
            if not writers:
                self.fail(f"committed step {step} does not load bit-exact as any job saved it")
            elif reported_ok.get(step) and writers[0] not in reported_ok[step]:
                self.fail(f"step {step} holds job {writers[0]}'s data but job {sorted(reported_ok[step])} reported it")
        self.elapsed = elapsed

    @staticmethod
    def _self_killed(job: _Job, rank: int) -> bool:
        kill = job.spec.get("kill")
        return kill is not None and kill[1] == rank and not job.exited(rank)

    def resume(self) -> None:
        """A fresh job at the same or another world size loads the latest step and saves once more."""
        committed = self.committed()
        if self.fault == "truncated_get":
            self.proxy.add("GET", rf"{re.escape(f'/{self.prefix}/')}.*\.distcp", truncate=True, times=2)
        world_size = self.rng.choice((1, 2, self.world_size))
        spec = self.spec(seed=3, resume=True, steps=(100,))
        (job,) = _run_jobs([("r", world_size, spec)])
        self.count_copies()
        self.proxy.clear()
        loaded = [p for r in range(world_size) for kind, p in job.reports[r] if kind == "loaded"]
        if not committed:
            if any(x is not None for x in loaded):
                self.fail("resume loaded a step although none is committed")
        elif len(loaded) != world_size or any(x is None or x[0] != committed[-1] for x in loaded):
            self.fail(f"resume at world size {world_size} did not load latest step {committed[-1]}: {[x and x[0] for x in loaded]}")
        else:
            expect = [full_state(s, committed[-1]) for s in (1, 2)]
            for step, data in loaded:
                if not any(_equal(data, e) for e in expect):
                    self.fail(f"resume at world size {world_size}: step {step} loaded wrong values")
        outcomes = [job.outcomes(r).get(100) for r in range(world_size)]
        if any(o is None or o[0] != "ok" for o in outcomes):
            self.fail(f"save after resume at world size {world_size} failed: {outcomes}")
        elif not _equal(_load_full(f"{self.root}/step_00000100", self.proxy.endpoint), full_state(3, 100)):
            self.fail("step saved after resume does not load bit-exact")


@pytest.mark.parametrize(
    "iterations",
    [pytest.param(SHORT_ITERATIONS, id="short"), pytest.param(ITERATIONS, id="campaign", marks=pytest.mark.slow)],
)
@pytest.mark.timeout(300 + 90 * max(ITERATIONS, SHORT_ITERATIONS))  # a campaign runs longer than the suite's per-test bound
def test_chaos(bucket, s3, proxy, iterations):
    rng = random.Random(SEED)
    counts: collections.Counter = collections.Counter()
    violations: list[str] = []
    copies = 0
    t0 = time.monotonic()
    # Every kind once per round, in a seeded order, so short runs still cover the kills.
    order = [f for _ in range(iterations // len(FAULTS) + 1) for f in rng.sample(FAULTS, len(FAULTS))]
    for i in range(iterations):
        it = _Iteration(i, order[i], rng, bucket, s3, proxy)
        counts[it.fault] += 1
        it.run()
        violations += it.violations
        copies += it.copies
    summary = (
        f"chaos: {iterations} iterations (seed {SEED}) in {time.monotonic() - t0:.0f}s; "
        f"faults: {dict(sorted(counts.items()))}; server-side copies: {copies}; violations: {len(violations)}"
    )
    print(summary)
    assert not violations, summary + "\n" + "\n".join(violations)
    assert copies or iterations < 2, "no incremental save copied anything"
