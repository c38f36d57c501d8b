"""dcpstore inside torchtitan 0.3: its real ``CheckpointManager``, FSDP2 on gloo ranks, objects over HTTP (issue 27).

``dcpstore.integrations.torchtitan.CheckpointManager`` must resume the
newest committed step bit for bit after a SIGKILL and at another world
size, reuse the persisted plans on the first save after a resume, keep
``keep_latest_k`` committed steps whatever fails, and share checkpoints with
stock torchtitan both ways.  The training loops are in
``torchtitan_workers``.
"""

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan 0.3 is installed by the README's test command (Python >= 3.11)")

from dist_utils import run_ranks  # noqa: E402
from workers import OBJECT_COLLECTIVES  # noqa: E402
from torchtitan_workers import (  # noqa: E402
    failed_saves,
    interop,
    load_latest,
    pinned_round_trip,
    resume_then_save,
    rollback,
    rollback_then_restarts,
    rollbacks_delete_only_reused_abandoned_steps,
    train_then_die,
)


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_a_killed_job_resumes_its_newest_committed_step_reuses_its_plans_and_reshards(bucket, s3, proxy, tmp_path):
    """2 ranks, async: steps 2, 4, 6 commit, SIGKILL during step 8's upload; a restart resumes 6 bit-exact.

    Its first save (step 8) runs no planning collective, retention leaves
    exactly keep_latest_k=2 committed steps, and one rank then loads step 8
    bit-exact.
    """
    proxy.add("PUT", r"run/step-8/.*\.distcp", delay=3)
    proxy.add("POST", r"run/step-8/.*\.distcp", delay=3)
    root = f"s3://{bucket}/run"
    expected_path = tmp_path / "expected.pt"
    run_ranks(train_then_die, 2, root, str(expected_path), "async", 2, proxy.endpoint, expect_killed=(0, 1))
    expected = torch.load(expected_path)
    assert sorted(expected) == [2, 4, 6]
    assert "run/step-8/.metadata" not in {o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}

    results = run_ranks(resume_then_save, 2, root, "async", 2)
    for (step, resumed), counts, reused, after, committed in results.values():
        assert step == 6
        assert_same(resumed, expected[6])
        assert reused and counts.get("scatter_object_list", 0) == 0 and counts.get("all_gather_object", 0) == 0
        # No planning, and the commit patched the resumed step's .metadata: no object collective at all.
        assert sum(counts.get(name, 0) for name in OBJECT_COLLECTIVES) == 0, counts
        assert committed == [6, 8]
    after = results[0][3]
    assert after["train_step"].item() == 8

    (state,) = run_ranks(load_latest, 1, root, True).values()
    assert_same(state, after)


def test_stock_torchtitan_and_dcpstore_resume_each_others_steps_in_one_process(bucket):
    """Both directions, and torchtitan's step discovery (fsspec's cached listing) sees dcpstore's steps."""
    (result,) = run_ranks(interop, 1, f"s3://{bucket}/run").values()
    stock_state, resumed_stock, ours_state, resumed_ours, stock_state_2, resumed_stock_2 = result
    assert stock_state["train_step"].item() == 2 and ours_state["train_step"].item() == 4
    assert_same(resumed_stock, stock_state)
    assert_same(resumed_ours, ours_state)
    assert stock_state_2["train_step"].item() == 6
    assert_same(resumed_stock_2, stock_state_2)  # stock steps after dcpstore's are newer, though unsequenced


@pytest.mark.slow
def test_a_rollback_saves_the_abandoned_step_numbers_again(bucket):
    """load_step=2 after 4 committed: saves 3 and 4 replace the abandoned ones (steps are never overwritten in place)."""
    (result,) = run_ranks(rollback, 1, f"s3://{bucket}/run").values()
    abandoned, redone, committed, resumed = result
    assert redone["train_step"].item() == 4 and not torch.equal(redone["0.weight"], abandoned["0.weight"])
    assert committed == [1, 2, 3, 4]
    assert_same(resumed, redone)


def test_a_rollback_survives_any_number_of_restarts(bucket):
    """Roll back to 2 and save 3; restart and save 4-6; restart again: the abandoned 4 is deleted when 4 is saved again, by the restarted job."""
    (result,) = run_ranks(rollback_then_restarts, 1, f"s3://{bucket}/run").values()
    first, committed, second = result
    assert first == 3 and second == 6
    assert committed == [1, 2, 3, 4, 5, 6]  # commit order: the old 4 went, the new 3 came after 2


@pytest.mark.slow
def test_a_rollback_deletes_only_the_abandoned_steps_it_saves_again(bucket):
    """An explicit load_step deletes nothing by itself; a save deletes one committed step only when it reuses its number.

    And only a step committed after the one loaded: loading the newest step
    is no rollback, and loading the seed (step 0) deletes nothing, so its
    save of step 1 is refused as a collision.
    """
    (result,) = run_ranks(rollbacks_delete_only_reused_abandoned_steps, 1, f"s3://{bucket}/run").values()
    after_newest, after_rollback, seed_error, after_seed = result
    assert after_newest == [0, 1, 2, 3, 4, 5]
    assert after_rollback == [0, 1, 2, 4, 5, 3]  # 3 again (committed last); 4 and 5 were not reused, so they stay
    assert seed_error is not None and "step 1 is already committed" in seed_error
    assert after_seed == after_rollback


@pytest.mark.slow
def test_failed_saves_never_cost_a_committed_step_and_debris_goes(bucket, s3, proxy):
    """keep_latest_k=2 while saves 3 and 4 fail: 1 and 2 stay; after 5 commits, 2 and 5, and stale debris is deleted."""
    for method in ("PUT", "POST"):
        proxy.add(method, r"run/step-[34]/", status=403, code="AccessDenied")
    s3.put_object(Bucket=bucket, Key="run/step-0/__0_0.distcp", Body=b"a killed save's shard")
    (result,) = run_ranks(failed_saves, 1, f"s3://{bucket}/run", proxy.endpoint).values()
    errors, after_failures, after_commit = result
    assert len(errors) == 2 and all("was not committed" in e and "access denied" in e for e in errors)
    assert after_failures == [1, 2]
    assert after_commit == [2, 5]
    keys = {"/".join(o["Key"].split("/")[1:3]) for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
    assert {k.split("/")[0] for k in keys} == {"step-0", "step-2", "step-5"}
    assert [k for k in keys if k.startswith("step-0/")] == ["step-0/.metadata"]  # the sweep's tombstone: the shard went


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torchtitan's stager for async_with_pinned_mem refuses to run without an accelerator")
def test_async_with_pinned_mem_round_trips_on_cuda(bucket):
    (result,) = run_ranks(pinned_round_trip, 1, f"s3://{bucket}/run").values()
    saved, resumed = result
    assert saved["train_step"].item() == 2
    assert_same(resumed, saved)


def test_one_config_line_selects_the_manager_and_torchtitan_stays_optional():
    """``CheckpointManager.Config`` is a torchtitan checkpoint config that builds dcpstore's manager; nothing else imports torchtitan."""
    import subprocess
    import sys

    from torchtitan.components.checkpointer import BaseCheckpointManager

    import dcpstore
    from dcpstore.integrations.torchtitan import CheckpointManager

    config = CheckpointManager.Config(
        enable=True, folder="s3://bucket/run", storage_options={"endpoint_url": "http://x"},
        transfer=dcpstore.TransferConfig(), objects_per_rank=8,
    )
    assert isinstance(config, BaseCheckpointManager.Config) and type(config)._owner is CheckpointManager
    assert config.to_dict()["objects_per_rank"] == 8 and config.to_dict()["storage_options"] == {"endpoint_url": "http://x"}
    code = (
        "import sys, dcpstore, dcpstore.cli, dcpstore.demo\n"
        "[getattr(dcpstore, name) for name in dcpstore.__all__]\n"
        "assert 'torchtitan' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.slow
def test_the_torchtitan_benchmark_runs_end_to_end(tmp_path):
    """One tiny round of benchmarks.torchtitan (nothing is timed here)."""
    import json
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.torchtitan", "--mib", "1", "--rounds", "1", "--saves", "2", "--out", str(tmp_path)],
        cwd=root, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "torchtitan.json").read_text())["summary"]
    for name in ("torchtitan (FsspecWriter)", "torchtitan + dcpstore"):
        for phase in ("first save", "steady save", "resume"):
            assert summary[name][phase]["commit_s"] > 0 and summary[name][phase]["requests"] > 0, (name, phase)
    assert (tmp_path / "torchtitan.png").stat().st_size > 1000
