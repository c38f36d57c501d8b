"""Every outcome a rank reports is the one storage shows (issue 26).

The commit's answer can be lost after the ``.metadata`` PUT took effect, and
the retries that follow can be throttled until they give up, time out, or
the commit lands only after the deadline.  Each case must end either
committed with a loadable step, or failed with no ``.metadata`` left; never
"failed" with shards deleted under a ``.metadata`` that names them.
"""

import pytest
import torch

from conftest import object_exists, read_metadata_raw
from dist_utils import run_ranks
from helpers import assert_state_dict_equal, sample_state_dict, zeros_like_state_dict
from workers import checkpointer_one_save, load_sharded
from test_multirank import assert_loaded
from test_writer_reader import _original_error, load, save

import dcpstore
from dcpstore.commit import NONCE_KEY

# Attempts give up within seconds; the commit window is shorter than one stalled attempt.
FAST = dcpstore.TransferConfig(
    connect_timeout=1, read_timeout=3, retry=dcpstore.RetryPolicy(max_attempts=3, initial_backoff=0.01)
)
METADATA = r"/ckpt/\.metadata$"


def _shards(s3, bucket):
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="ckpt/__").get("Contents", []))


def _save_via(proxy, bucket, **writer):
    sd = sample_state_dict()
    save(sd, f"s3://{bucket}/ckpt", storage_options={"endpoint_url": proxy.endpoint}, transfer=FAST, **writer)
    return sd


@pytest.mark.also_rgw(then="throttled")
@pytest.mark.parametrize("then", ["throttled", "timeout"])
def test_a_commit_whose_answer_is_lost_is_committed(bucket, s3, proxy, then):
    """The PUT lands, its answer is lost; the retries are throttled (or stall) until the window closes."""
    lost = proxy.add("PUT", METADATA, drop_response=True, times=1)
    if then == "throttled":
        proxy.add("PUT", METADATA, status=503, code="SlowDown")
    else:
        proxy.add("PUT", METADATA, delay=FAST.read_timeout + 2)
    sd = _save_via(proxy, bucket, commit_window=2.0)  # returns: committed
    assert lost.hits == 1
    proxy.clear()
    md = read_metadata_raw(s3, bucket, "ckpt")
    assert s3.head_object(Bucket=bucket, Key="ckpt/.metadata")["Metadata"][NONCE_KEY] == md.storage_meta.save_id
    assert {info.relative_path for info in md.storage_data.values()} <= {k.split("/", 1)[1] for k in _shards(s3, bucket)}
    assert_state_dict_equal(load(zeros_like_state_dict(sd), f"s3://{bucket}/ckpt"), sd)


def test_a_commit_that_lands_after_the_deadline_is_committed(bucket, s3, proxy):
    """Every attempt is held past its read timeout and lands after the commit window closed."""
    proxy.add("PUT", METADATA, delay=FAST.read_timeout + 0.5)
    sd = _save_via(proxy, bucket, commit_window=1.0)
    proxy.clear()
    assert_state_dict_equal(load(zeros_like_state_dict(sd), f"s3://{bucket}/ckpt"), sd)


def test_a_commit_refused_every_time_fails_and_leaves_no_metadata(bucket, s3, proxy):
    """Every attempt is answered (throttled): no .metadata can exist, and the error names the object."""
    from torch.distributed.checkpoint.api import CheckpointException

    proxy.add("PUT", METADATA, status=503, code="SlowDown")
    with pytest.raises(CheckpointException) as e:
        _save_via(proxy, bucket, commit_window=1.0)
    error = _original_error(e)
    assert isinstance(error, dcpstore.ThrottledError)
    assert f"s3://{bucket}/ckpt/.metadata was throttled" in str(error)
    assert not object_exists(s3, bucket, "ckpt/.metadata")


def test_an_unreadable_outcome_is_unknown_and_keeps_the_shards(bucket, s3, proxy):
    """Answer lost, retries throttled, and the read-back throttled too: neither committed nor failed."""
    from torch.distributed.checkpoint.api import CheckpointException

    proxy.add("PUT", METADATA, drop_response=True, times=1)
    proxy.add("PUT", METADATA, status=503, code="SlowDown")
    proxy.add("HEAD", METADATA, status=503, code="SlowDown", after=1)  # the read-back, not the save's first check
    quick = dcpstore.TransferConfig(
        connect_timeout=1, read_timeout=1, retry=dcpstore.RetryPolicy(max_attempts=2, initial_backoff=0.01, throttle_budget=1)
    )
    sd = sample_state_dict()
    with pytest.raises(CheckpointException) as e:
        save(sd, f"s3://{bucket}/ckpt", storage_options={"endpoint_url": proxy.endpoint}, transfer=quick, commit_window=1.0)
    error = _original_error(e)
    assert isinstance(error, dcpstore.CommitOutcomeUnknownError)
    assert "may or may not be committed" in str(error)
    proxy.clear()
    assert _shards(s3, bucket)  # kept: the .metadata (which did land) names them
    assert_state_dict_equal(load(zeros_like_state_dict(sd), f"s3://{bucket}/ckpt"), sd)


def test_every_rank_reports_a_commit_whose_answer_was_lost(bucket, s3, proxy):
    """AsyncCheckpointer, 2 gloo ranks: committed on both, shards intact, step loads bit-exact."""
    proxy.add("PUT", r"/run/step_00000001/\.metadata$", drop_response=True, times=1)
    proxy.add("PUT", r"/run/step_00000001/\.metadata$", status=503, code="SlowDown")
    root = f"s3://{bucket}/run"
    outcomes = run_ranks(checkpointer_one_save, 2, root, proxy.endpoint, FAST, 2.0)
    assert outcomes == {0: None, 1: None}
    proxy.clear()
    for r in run_ranks(load_sharded, 2, f"{root}/step_00000001", "dcpstore").values():
        assert_loaded(r)


@pytest.mark.parametrize("after_put", [False, True], ids=["dies-before-the-put", "dies-after-it-landed"])
def test_time_to_an_outcome_when_the_coordinator_dies_at_the_commit(bucket, s3, after_put):
    """3 gloo ranks; rank 0 dies at the .metadata PUT.  The others report what storage shows, within the bound.

    The bound is the README's: the broken collective (at once: the peer's
    socket closes), then commit_window + connect + read timeout + 1 s, plus
    1 s of jitter and slack for a busy box (deadline_scale).
    """
    from dist_utils import deadline_scale
    from workers import checkpointer_coordinator_dies_at_commit

    window = 2.0
    root = f"s3://{bucket}/run"
    results = run_ranks(
        checkpointer_coordinator_dies_at_commit, 3, root, FAST, window, after_put, expect_killed=(0,), timeout=240
    )
    bound = (window + FAST.connect_timeout + FAST.read_timeout + 1 + 1 + 15) * deadline_scale()
    for rank in (1, 2):
        outcome, seconds = results[rank]
        assert seconds < bound, (rank, seconds, bound)
        if after_put:
            assert outcome == "committed"
        else:
            assert outcome.startswith("CheckpointSaveError") and "storage shows no .metadata of this save" in outcome
    assert object_exists(s3, bucket, "run/step_00000001/.metadata") == after_put
    if after_put:
        for r in run_ranks(load_sharded, 2, f"{root}/step_00000001", "dcpstore").values():
            assert_loaded(r)
