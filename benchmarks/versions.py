"""dcpstore against an earlier version of itself, taking turns on one S3 server, in one run.

    python -m benchmarks.versions --baseline HEAD~1               # 1 GiB, 3 rounds
    python -m benchmarks.versions --baseline v0.2 --size-mib 256 --rounds 5

A change that cuts CPU must keep blocking time and throughput where they
were, and figures from two runs on these noisy machines say nothing about
that.  So this measures dcpstore's own contenders of ``benchmarks.run`` (plain
``dcp.save``, ``dcp.async_save`` and ``AsyncCheckpointer``, each with its
load) from this tree and from a git worktree of ``--baseline``, in one
process per version that lives for the whole run (so ``AsyncCheckpointer``
saves in steady state from round 2 on, as in ``benchmarks.run``), taking
turns round by round (new, old, old, new, ...) against one moto server
subprocess on loopback.  Each process meters itself (``getrusage``) and is
idle while the other runs.  Prints, per contender and figure, the medians
and the ratio new/old; writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid

NAMES = ("dcpstore ObjectStoreWriter dcp.save", "dcpstore ObjectStoreWriter dcp.async_save", "dcpstore AsyncCheckpointer")
FIGURES = ("blocking_s", "commit_s", "load_s", "save_cpu_s_per_gib", "load_cpu_s_per_gib", "requests")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(size_mib: int, bucket: str) -> int:
    """Measure one round of every contender per line read from stdin; print each round's rows as one JSON line."""
    import warnings

    from benchmarks import run

    warnings.simplefilter("ignore")
    sd = run.make_state_dict(size_mib * run.MiB)
    table = run.contenders(False)
    counter = run.RequestCounter()
    for line in sys.stdin:
        rows = {}
        for name in NAMES:
            url = f"s3://{bucket}/{uuid.uuid4().hex[:8]}/step_00000001"
            rows[name] = run.measure(name, table[name], sd, url, None, counter)
        print(json.dumps(rows), flush=True)
    run.KEPT.close()
    return 0


def _worktree(rev: str, where: str) -> str:
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", where, rev], check=True, capture_output=True)
    return where


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=False, help="the git revision to compare against")
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--child", metavar="BUCKET", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.size_mib, args.child)
    if not args.baseline:
        parser.error("--baseline is required")

    import boto3

    from dcpstore.local_s3 import TEST_CREDENTIALS, MotoServer

    server = MotoServer()
    env = {**os.environ, **TEST_CREDENTIALS, "AWS_ENDPOINT_URL": server.endpoint}
    scratch = tempfile.mkdtemp(prefix="dcpstore-versions-")
    old_tree = _worktree(args.baseline, os.path.join(scratch, "baseline"))
    procs = {}
    try:
        s3 = boto3.client("s3", endpoint_url=server.endpoint, **_boto_credentials(TEST_CREDENTIALS))
        for version, tree in (("new", REPO), ("old", old_tree)):
            bucket = f"versions-{version}-{uuid.uuid4().hex[:6]}"
            s3.create_bucket(Bucket=bucket)
            # This tree's benchmarks, that version's dcpstore.
            version_env = {**env, "PYTHONPATH": os.pathsep.join((os.path.join(tree, "src"), REPO))}
            procs[version] = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.versions", "--child", bucket, "--size-mib", str(args.size_mib)],
                cwd=REPO, env=version_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )
        rows = {"new": [], "old": []}
        for r in range(args.rounds):
            for version in ("new", "old") if r % 2 == 0 else ("old", "new"):
                proc = procs[version]
                proc.stdin.write(f"{r}\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"the {version} version's process ended (exit {proc.wait()})")
                rows[version].append(json.loads(line))
        for proc in procs.values():
            proc.stdin.close()
            proc.wait(timeout=300)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        server.stop()
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", old_tree], capture_output=True)

    summary = {}
    print(f"{args.size_mib} MiB state dict, {args.rounds} rounds, medians; new = this tree, old = {args.baseline}")
    print(f"{'contender':45s} {'figure':20s} {'new':>10s} {'old':>10s} {'new/old':>8s}")
    for name in NAMES:
        summary[name] = {}
        for figure in FIGURES:
            new = statistics.median(row[name][figure] for row in rows["new"])
            old = statistics.median(row[name][figure] for row in rows["old"])
            summary[name][figure] = {"new": new, "old": old, "ratio": new / old if old else None}
            ratio = f"{new / old:8.2f}" if old else "       -"
            print(f"{name:45s} {figure:20s} {new:10.3f} {old:10.3f} {ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"baseline": args.baseline, "size_mib": args.size_mib, "rounds": args.rounds, "summary": summary, "rows": rows}, f, indent=2)
    return 0


def _boto_credentials(creds: dict) -> dict:
    return {"aws_access_key_id": creds["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": creds["AWS_SECRET_ACCESS_KEY"], "region_name": creds.get("AWS_DEFAULT_REGION", "us-east-1")}


if __name__ == "__main__":
    raise SystemExit(main())
