"""AsyncCheckpointer on real gloo groups against the moto server."""

import re

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

import dcpstore
from conftest import object_exists, read_metadata_raw
from dist_utils import run_ranks
from workers import (
    OBJECT_COLLECTIVES,
    latest_step_when_the_coordinators_listing_fails,
    checkpointer_keep_last,
    checkpointer_killed_mid_upload,
    checkpointer_load_errors,
    checkpointer_plan_changes_on_one_rank,
    checkpointer_resume,
    checkpointer_resume_logged,
    checkpointer_returns_before_upload,
    checkpointer_save_steps,
    checkpointer_three_saves,
    checkpointer_upload_error,
)


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_save_returns_before_upload_finishes(bucket, proxy):
    proxy.add("PUT", r"\.distcp", delay=1.5)
    results = run_ranks(checkpointer_returns_before_upload, 2, f"s3://{bucket}/run", proxy.endpoint)
    for done_after_save, committed_early, visible_early, visible_late in results.values():
        assert not done_after_save
        assert committed_early == []
        assert not visible_early
        assert visible_late


@pytest.mark.parametrize(
    "world_size,planning,plan_collective",
    [
        (2, "central", "scatter_object_list"),
        pytest.param(4, "central", "scatter_object_list", marks=pytest.mark.slow),
        (2, "decentralized", "all_gather_object"),
    ],
)
@pytest.mark.also_rgw(world_size=2, planning="central")
def test_plans_are_exchanged_once_then_reused(world_size, planning, plan_collective, bucket, s3):
    results = run_ranks(checkpointer_three_saves, world_size, f"s3://{bucket}/run", planning)
    stored_items = len(read_metadata_raw(s3, bucket, "run/step_00000030").storage_data)
    for rank, (saves, _, _) in results.items():
        counts = [c.get(plan_collective, 0) for c, _ in saves]
        assert counts == [1, 0, 0], (rank, saves)
        assert [reused for _, reused in saves] == [False, True, True]
        # One flag all-reduce per save decides reuse, one how to commit.
        assert [c.get("all_reduce", 0) for c, _ in saves] == [2, 2, 2]
        # The write results travel as objects until a save can patch the last full commit's .metadata
        # (a job's first save, with no parent, is no template): from then on, no object collective.
        assert [c.get("gather_object", 0) for c, _ in saves] == ([2, 1, 0] if planning == "central" else [1, 1, 0])
        assert [c.get("broadcast_object_list", 0) for c, _ in saves] == [1, 1, 0]
        assert sum(saves[2][0].get(name, 0) for name in OBJECT_COLLECTIVES) == 0
    names, tensors = {}, {}
    for step in (10, 20, 30):
        assert object_exists(s3, bucket, f"run/step_{step:08d}/.metadata")
        metadata = read_metadata_raw(s3, bucket, f"run/step_{step:08d}")
        # Every rank's shards are named after the save's nonce: the coordinator knows each name, at a fixed length.
        nonce = metadata.storage_meta.save_id
        paths = {info.relative_path for info in metadata.storage_data.values()}
        assert len(nonce) == 16 and all(re.fullmatch(rf"__\d+_{nonce}_\d+\.distcp", p) for p in paths), paths
        names[step] = sorted(p.replace(nonce, "") for p in paths)
        # Bytes items go last in their shard: the step's size changing moves no tensor.
        tensors[step] = {
            index: (info.relative_path.replace(nonce, ""), info.offset, info.length)
            for index, info in metadata.storage_data.items()
            if not isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata)
        }
    assert names[10] == names[20] == names[30]
    assert tensors[10] == tensors[20] == tensors[30]
    staged = [items for _, _, items in results.values()]
    # Planned saves stage every rank's items, replicated ones on every rank;
    # cached ones only what each rank writes: each stored item once in all.
    assert sum(s[0] for s in staged) > stored_items
    assert sum(s[1] for s in staged) == sum(s[2] for s in staged) == stored_items


@pytest.mark.also_rgw(world_size=2)
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_resume_reuses_persisted_plans_and_falls_back_on_change(world_size, bucket, proxy):
    root = f"s3://{bucket}/run"
    (_, final, _), *_ = run_ranks(checkpointer_three_saves, world_size, root, "central").values()

    proxy.clear()
    results = run_ranks(checkpointer_resume, world_size, root, False, proxy.endpoint)
    # The coordinator's HEADs of the resumed step's .metadata (the commit order, see steps; the
    # resume index's pointer), then one GET of it for the whole job: the coordinator's, off the
    # training thread, for its next commit.  The ranks resume from their index blocks.
    assert [m for m, path in proxy.requests if path.split("?")[0].endswith("step_00000030/.metadata")] == ["HEAD", "HEAD", "GET"]
    for step, loaded, counts, reused, expected, reloaded in results.values():
        assert step == 30
        assert_same(loaded, final)  # resumed bit-exact from the latest step
        # No planning, and the commit patched the resumed .metadata: no object collective at all.
        assert sum(counts.get(name, 0) for name in OBJECT_COLLECTIVES) == 0, counts
        assert reused
        assert_same(reloaded, expected)  # what the first save after resume wrote loads bit-exact

    # One rank's structure changed: every rank plans again, and the job says why (never silently).
    results = run_ranks(checkpointer_resume_logged, world_size, root, None, "rank 1")
    for rank, ((step, _, counts, reused, expected, reloaded), logged) in results.items():
        assert step == 31
        assert counts.get("scatter_object_list", 0) == 1  # structure changed: planned again
        assert not reused
        assert_same(reloaded, expected)
        warnings = [r for r in logged if r.startswith("WARNING") and "cannot be reused" in r]
        if rank == 0:
            assert any("rank 1's local plan differs" in r for r in warnings), logged
        if rank == 1:
            assert len(warnings) == 1 and "item 'model.new_param'" in warnings[0] and "is not in them" in warnings[0]
            assert f"read by torch {torch.__version__}" in warnings[0] and "run/step_00000031" in warnings[0]
        if rank > 1:
            assert not warnings


def test_rank_killed_mid_upload_leaves_previous_step_latest(bucket, s3, proxy):
    proxy.add("PUT", r"step_00000002/.*\.distcp", delay=3)
    proxy.add("POST", r"step_00000002/.*\.distcp", delay=3)
    root = f"s3://{bucket}/run"
    results = run_ranks(checkpointer_killed_mid_upload, 2, root, proxy.endpoint, expect_killed=(1,))
    assert results[1] is None
    assert results[0] is not None and "step_00000002 was not committed" in results[0]
    assert not object_exists(s3, bucket, "run/step_00000002/.metadata")
    ckpt = dcpstore.AsyncCheckpointer(root)
    assert ckpt.latest_step() == 1
    # A restarted job resumes from step 1, bit-exact.
    results = run_ranks(checkpointer_resume, 2, root, False)
    for step, loaded, *_ in results.values():
        assert step == 1
        from workers import full_tensors

        assert torch.equal(loaded["replicated"], full_tensors(0)["replicated"])
        assert torch.equal(loaded["sharded"], full_tensors(0)["sharded"])


def test_upload_error_on_one_rank_raises_everywhere_and_next_save_works(bucket, s3, proxy):
    proxy.add("PUT", r"step_00000002/__1_", status=403, code="AccessDenied")
    proxy.add("POST", r"step_00000002/__1_", status=403, code="AccessDenied")
    results = run_ranks(checkpointer_upload_error, 2, f"s3://{bucket}/run", proxy.endpoint)
    for error, latest in results.values():
        assert error is not None
        message, failures = error
        assert "step_00000002 was not committed" in message
        assert list(failures) == [1] and "access denied" in failures[1]
        assert latest == 3
    assert not object_exists(s3, bucket, "run/step_00000002/.metadata")
    assert object_exists(s3, bucket, "run/step_00000003/.metadata")


@pytest.mark.also_rgw
def test_keep_last_prunes_only_committed_older_steps(bucket, s3):
    root = f"s3://{bucket}/run"
    s3.put_object(Bucket=bucket, Key="run/step_00000000/__0_0.distcp", Body=b"orphan")  # incomplete step
    ckpt = dcpstore.AsyncCheckpointer(root, keep_last=2)
    sd = {"w": torch.arange(4.0), "step": 0}
    for step in (1, 2, 3):
        sd["step"] = step
        ckpt.save(sd, step=step)
    ckpt.wait()
    assert ckpt.committed_steps() == [2, 3]
    assert object_exists(s3, bucket, "run/step_00000000/__0_0.distcp")  # not ours to prune
    out = {"w": torch.zeros(4), "step": 0}
    assert ckpt.load(out) == 3 and out["step"] == 3
    ckpt.close()


def test_every_rank_lists_the_coordinators_steps_after_pruning(bucket):
    results = run_ranks(checkpointer_keep_last, 2, f"s3://{bucket}/run")
    assert results[0] == results[1] == [[1], [1, 2], [2, 3], [3, 4]]


def test_single_process_cpu_path_and_staging_isolation(bucket):
    """CPU tensors are copied at save(): later in-place updates do not leak into the checkpoint."""
    ckpt = dcpstore.AsyncCheckpointer(f"s3://{bucket}/run")
    w = torch.arange(1000.0)
    handle = ckpt.save({"w": w}, step=1)
    w.add_(1)  # the trainer moves on immediately
    stats = handle.result()
    assert stats.staged_bytes >= w.numel() * 4 and stats.blocking_s > 0
    out = {"w": torch.zeros(1000)}
    ckpt.load(out, step=1)
    assert torch.equal(out["w"], torch.arange(1000.0))
    with pytest.raises(dcpstore.CheckpointLoadError, match="rank 0: StateDictMismatchError: .*keys missing from the checkpoint: extra") as e:
        ckpt.load({"w": torch.zeros(1000), "extra": torch.zeros(1)}, step=1)
    assert isinstance(e.value.__cause__, dcpstore.StateDictMismatchError)
    with pytest.raises(dcpstore.CheckpointNotFoundError) as e:
        ckpt.load(out, step=99)
    assert isinstance(e.value, dcpstore.CheckpointLoadError)  # one except catches every failed load
    ckpt.close()


@pytest.mark.also_rgw
def test_saving_a_committed_step_again_fails_on_every_rank(bucket):
    root = f"s3://{bucket}/run"
    run_ranks(checkpointer_save_steps, 2, root, (1,), 0)
    with pytest.raises(AssertionError, match="step 1 is already committed"):
        run_ranks(checkpointer_save_steps, 2, root, (1,), 1)


def test_a_load_that_cannot_succeed_fails_on_every_rank_and_the_group_goes_on(bucket):
    """Issue 57.1: one rank's mismatch fails every rank at once with ``CheckpointLoadError`` naming it (before, rank 0 waited in
    ``dcp.load`` for the group's timeout and then raised gloo's error).  The collective timeout here is a minute: a rank that
    waited for it would not report the mismatch."""
    root = f"s3://{bucket}/run"
    results = run_ranks(checkpointer_load_errors, 2, root)
    (errors0, mismatch0, loaded0), (errors1, mismatch1, loaded1) = results.values()
    assert errors0 == errors1 and len(errors0) == 2
    assert "no committed checkpoint to load" in errors0[0]
    assert "step_00000099/.metadata: no metadata object" in errors0[1]
    for name, message, _ in (mismatch0, mismatch1):
        assert name == "CheckpointLoadError" and "rank 1: StateDictMismatchError" in message and "replicated" in message, message
    assert mismatch0[1] == mismatch1[1] and mismatch1[2] == "StateDictMismatchError"  # the same error; rank 1's own is its cause
    assert_same(loaded0, loaded1)


def test_a_replan_gives_a_replicated_item_to_a_rank_that_staged_it_and_the_step_commits(bucket, s3):
    results = run_ranks(checkpointer_plan_changes_on_one_rank, 2, f"s3://{bucket}/run")
    (staged0, outcome0, loaded0), (staged1, outcome1, loaded1) = results.values()
    assert (staged0, staged1) == (1, 1)  # rank 1 left the replicated tensor to rank 0
    assert outcome0 == outcome1 == "committed"
    assert loaded0 == loaded1 == [True, True]  # steps 3 and 4, bit-exact


def test_an_item_no_rank_staged_fails_the_step_loudly_and_the_next_one_commits(bucket, s3):
    """Rank 1 left the replicated tensor to rank 0, which no longer holds it: the step would lack it."""
    results = run_ranks(checkpointer_plan_changes_on_one_rank, 2, f"s3://{bucket}/run", True)
    for _, outcome, loaded in results.values():
        assert "step_00000003 was not committed" in outcome and "'replicated' of rank 1 was staged by no rank" in outcome
        assert loaded == [True]  # step 4 staged all and planned afresh
    assert not object_exists(s3, bucket, "run/step_00000003/.metadata")


def test_latest_step_ignores_incomplete_steps(bucket, s3):
    root = f"s3://{bucket}/run"
    ckpt = dcpstore.AsyncCheckpointer(root)
    ckpt.save({"w": torch.ones(2)}, step=7)
    ckpt.wait()
    s3.put_object(Bucket=bucket, Key="run/step_00000009/__0_0.distcp", Body=b"partial")
    assert ckpt.latest_step() == 7
    ckpt.close()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_staging_is_pinned_async_and_ordered(bucket):
    ckpt = dcpstore.AsyncCheckpointer(f"s3://{bucket}/run")
    w = torch.randn(1024, 1024, device="cuda")
    expected = w.cpu()
    handle = ckpt.save({"w": w}, step=1)
    w.mul_(0)  # queued after the staging copy on the training stream
    handle.result()
    pool = ckpt._pools[0]
    assert pool.pinned_bytes >= w.numel() * 4 and pool._slab.tensor.is_pinned()
    out = {"w": torch.zeros(1024, 1024, device="cuda")}
    ckpt.load(out, step=1)
    assert torch.equal(out["w"].cpu(), expected)
    ckpt.close()


class _ComputingPlanner(DefaultSavePlanner):
    """resolve_data launches a kernel and returns a temporary, as DTensor redistribution does."""

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor) and data.is_cuda:
            torch.cuda._sleep(10_000_000)  # a slow kernel before the one that makes the value
            return data * 2
        return data


@cuda
def test_cuda_staging_waits_for_each_items_kernels(bucket):
    ckpt = dcpstore.AsyncCheckpointer(f"s3://{bucket}/run", planner_factory=_ComputingPlanner)
    sd = {f"w{i}": torch.randn(256, 256, device="cuda") for i in range(4)}
    expected = {k: v.cpu() * 2 for k, v in sd.items()}
    ckpt.save(sd, step=1).result()
    out = {k: torch.zeros(256, 256, device="cuda") for k in sd}
    ckpt.load(out, step=1)
    for k in sd:
        assert torch.equal(out[k].cpu(), expected[k]), k
    ckpt.close()


def test_an_unpicklable_value_raises_at_save_naming_its_key(bucket):
    ckpt = dcpstore.AsyncCheckpointer(f"s3://{bucket}/run")
    sd = {"w": torch.arange(4.0), "optim": {"schedule": lambda step: 0.1}}
    with pytest.raises(dcpstore.UnpicklableValueError, match="state dict key 'optim.schedule'"):
        ckpt.save(sd, step=1)
    assert ckpt.wait() == []  # reported once, at save()
    sd["optim"]["schedule"] = 0.1
    ckpt.save(sd, step=2)
    ckpt.wait()
    assert ckpt.committed_steps() == [2]
    ckpt.close()


def test_a_failed_load_raises_an_exception_naming_the_step_and_object(bucket, s3):
    """torch's CheckpointException is a BaseException; load() raises dcpstore's own, which `except Exception` catches."""
    root = f"s3://{bucket}/run"
    sd = {"w": torch.arange(10.0), "b": torch.ones(3)}
    with dcpstore.AsyncCheckpointer(root) as ckpt:
        ckpt.save(sd, step=7)
    shard = next(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="run/step_00000007/__")["Contents"])
    s3.delete_object(Bucket=bucket, Key=shard)
    with dcpstore.AsyncCheckpointer(root) as ckpt:
        try:
            ckpt.load({"w": torch.zeros(10), "b": torch.zeros(3)})
        except Exception as e:  # noqa: BLE001 - what a training loop's fallback catches
            error = e
    assert isinstance(error, dcpstore.CheckpointLoadError) and isinstance(error, dcpstore.DcpstoreError)
    assert error.step == 7
    assert f"loading step 7 from {root}/step_00000007 failed: rank 0" in str(error)
    assert shard.split("/")[-1] in str(error)
    assert isinstance(error.__cause__, dcpstore.ObjectNotFoundError)


@pytest.mark.parametrize("first", ["result", "maybe_finalize", "wait", "save", "close"])
def test_a_failed_save_is_raised_once_and_the_next_save_commits(first, bucket, proxy):
    """Step 1's uploads are refused; whichever API sees the failure first raises it, no later one does."""
    import concurrent.futures

    for method in ("PUT", "POST"):
        proxy.add(method, r"/run/step_00000001/.*\.distcp", status=403, code="AccessDenied")
    ckpt = dcpstore.AsyncCheckpointer(f"s3://{bucket}/run", storage_options={"endpoint_url": proxy.endpoint}, max_in_flight=1)
    handle = ckpt.save({"w": torch.ones(4)}, step=1)
    concurrent.futures.wait([handle._future])  # failed, not yet delivered
    with pytest.raises(dcpstore.CheckpointSaveError, match="step_00000001"):
        if first == "result":
            handle.result()
        elif first == "maybe_finalize":
            ckpt.maybe_finalize()
        elif first == "wait":
            ckpt.wait()
        elif first == "save":
            ckpt.save({"w": torch.ones(4)}, step=2)  # waits for step 1's slot, and delivers its failure
        else:
            ckpt.close()
    if first == "close":
        ckpt.close()  # closed: nothing more to deliver
        return
    assert ckpt.maybe_finalize() == [] and ckpt.wait() == []  # not again
    ckpt.save({"w": torch.full((4,), 3.0)}, step=3)
    assert ckpt.wait() == [3]
    assert ckpt.committed_steps() == [3]
    ckpt.close()


def test_a_listing_error_on_the_coordinator_reaches_every_rank(bucket, proxy):
    proxy.add("GET", r"list-type=2", status=403, code="AccessDenied")
    results = run_ranks(latest_step_when_the_coordinators_listing_fails, 2, f"s3://{bucket}/run", proxy.endpoint)
    assert results[0] == results[1] and "access denied" in results[0]


def test_the_readmes_training_loop_runs_as_written(bucket, tmp_path):
    """The README's "Use it in a training loop" snippet, executed as it is written (its bucket swapped for the test's), twice: fresh, then resumed."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## Use it in a training loop", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1).replace("s3://my-bucket/", f"s3://{bucket}/")
    state_dict = {"w": torch.zeros(4)}
    steps_trained = []
    for total_steps in (2001, 3001):  # a fresh run saves steps 1000 and 2000; the resumed one, 3000
        namespace = {"state_dict": state_dict, "total_steps": total_steps,
                     "train_step": lambda: (state_dict["w"].add_(1), steps_trained.append(1))}
        exec(compile(snippet, "README.md", "exec"), namespace)
        with dcpstore.AsyncCheckpointer(f"s3://{bucket}/run-7") as ckpt:
            assert ckpt.latest_step() == total_steps - 1
    assert len(steps_trained) == 3000  # the second run resumed at 2000: it trained 1000 more steps, not 3000
    assert torch.equal(state_dict["w"], torch.full((4,), 3000.0))
