"""ObjectStoreWriter / Reader under dcp.save / dcp.load on real gloo groups (world size 2 and 4)."""

import re
import time

import pytest
import torch

from conftest import object_exists, read_metadata_raw
from dist_utils import deadline_scale, run_ranks
from workers import (
    async_save_in_checkpoint_process,
    full_tensors,
    load_sharded,
    save_sharded,
    save_with_failing_rank,
)

import dcpstore


def expected(seed=0):
    full = full_tensors(seed)
    return {**full, "step": 1000 + seed, "note": b"dcpstore"}


def assert_loaded(result, seed=0):
    want = expected(seed)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(result[k], v), k
        else:
            assert result[k] == v, k


@pytest.mark.also_rgw(world_size=2)
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_sharded_round_trip_reshard_and_stock_reader(world_size, bucket, s3):
    url = f"s3://{bucket}/ckpt"
    local_plans = run_ranks(save_sharded, world_size, url, 0)

    # The persisted plans are the local plans the ranks made, in rank order.
    md = read_metadata_raw(s3, bucket, "ckpt")
    plans = dcpstore.read_plans(md)
    assert len(plans) == world_size
    for rank in range(world_size):
        assert plans[rank].items == local_plans[rank].items
        assert plans[rank].planner_data == local_plans[rank].planner_data
    # Each rank wrote its own shard objects.
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
    for r in range(world_size):  # __{rank}_{generation}_{n}.distcp: names of this save alone
        assert any(re.fullmatch(rf"ckpt/__{r}_[0-9a-f]{{16}}_0\.distcp", k) for k in keys), (r, keys)

    # Bit-exact with the same world size, with a different one, and with stock FsspecReader.
    for ws, reader in ((world_size, "dcpstore"), (world_size, "fsspec"), (6 // world_size if world_size == 2 else 2, "dcpstore")):
        results = run_ranks(load_sharded, ws, url, reader)
        for r in results.values():
            assert_loaded(r)


def test_failed_upload_on_one_rank_leaves_no_metadata(bucket, s3, proxy):
    proxy.add("PUT", r"/ckpt/__1_", status=403, code="AccessDenied")
    proxy.add("POST", r"/ckpt/__1_.*uploads", status=403, code="AccessDenied")
    url = f"s3://{bucket}/ckpt"
    errors = run_ranks(save_with_failing_rank, 2, url, proxy.endpoint)
    for rank, message in errors.items():
        assert message is not None, f"rank {rank} did not raise"
        assert f"s3://{bucket}/ckpt/__1_" in message and "access denied" in message
    assert not object_exists(s3, bucket, "ckpt/.metadata")


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_async_save_in_a_checkpoint_process(bucket):
    """``dcp.async_save(..., PROCESS)``: the writer travels to torch's checkpoint process and back out."""
    url = f"s3://{bucket}/ckpt"
    timeout = 120 * deadline_scale()
    pids = run_ranks(async_save_in_checkpoint_process, 2, url, timeout)
    for r in run_ranks(load_sharded, 2, url, "dcpstore").values():
        assert_loaded(r)
    # The checkpoint processes end with their ranks instead of outliving the job.
    deadline = time.monotonic() + 30 * deadline_scale()
    while any(_running(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)  # polling for an exit there is no event for
    assert not [pid for pid in pids.values() if _running(pid)]


def test_a_refused_commit_deletes_the_losers_shards_once(bucket, s3, proxy):
    """2 gloo ranks lose the commit to another job: one batched DELETE request removes all they wrote."""
    from workers import save_losing_the_commit

    url = f"s3://{bucket}/ckpt"
    errors = run_ranks(save_losing_the_commit, 2, url, proxy.endpoint)
    assert all(error and "Checkpoint already exists" in error for error in errors.values()), errors
    deletes = [(m, p) for m, p in proxy.requests if m == "POST" and p.split("?", 1)[-1].startswith("delete")]
    assert len(deletes) == 1, deletes
    left = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="ckpt/").get("Contents", [])]
    assert left == ["ckpt/.metadata"]  # the other job's commit, and nothing of the loser's
    assert s3.get_object(Bucket=bucket, Key="ckpt/.metadata")["Body"].read() == b"another job's commit"


def test_ranks_import_the_checkout_whose_tests_run(tmp_path):
    """A suite run from another checkout (a worktree of an older commit) tests that checkout's code in its ranks too.

    A copy of src/dcpstore stands in for the other checkout: a fresh test
    process puts it first on its path and starts a rank as every test does.
    Python 3.11's forkserver ignores the parent's ``sys.path``; without
    ``dist_utils`` passing it on, the rank imports the installed dcpstore.
    """
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    checkout = tmp_path / "src"
    shutil.copytree(Path(dcpstore.__file__).parent, checkout / "dcpstore", ignore=shutil.ignore_patterns("__pycache__"))
    tests = Path(__file__).parent
    script = (
        f"import sys; sys.path[:0] = [{str(checkout)!r}, {str(tests)!r}]\n"
        "import dcpstore\n"
        "from dist_utils import run_ranks\n"
        "from workers import imported_dcpstore\n"
        "print(dcpstore.__file__)\n"
        "print(run_ranks(imported_dcpstore, 1, process_group=False)[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300 * deadline_scale())
    assert out.returncode == 0, out.stderr
    parent, rank = out.stdout.split()
    assert parent == str(checkout / "dcpstore" / "__init__.py")
    assert rank == parent


def test_a_relative_path_under_a_process_group_warns(tmp_path):
    """Each rank would resolve it against its own working directory, on its own node's disk (issue 57)."""
    from workers import relative_path_warnings

    results = run_ranks(relative_path_warnings, 2, str(tmp_path))
    for rank, messages in results.items():
        assert len(messages) == 2, messages  # the writer's and the reader's; not the absolute path's
        assert "each of the 2 ranks resolves it against its own working directory" in messages[0]
