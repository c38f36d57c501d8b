"""Every outcome a rank reports is the one storage shows (issue 26).

The commit's answer can be lost after the ``.metadata`` PUT took effect, and
the retries that follow can be throttled until they give up, time out, or
the commit lands only after the deadline.  Each case must end either
committed with a loadable step, or failed with no ``.metadata`` left; never
"failed" with shards deleted under a ``.metadata`` that names them.
"""

import pytest

from conftest import object_exists, read_metadata_raw
from dist_utils import run_ranks
from helpers import assert_state_dict_equal, sample_state_dict, zeros_like_state_dict
from workers import checkpointer_one_save, checkpointer_slow_retention, load_sharded
from test_multirank import assert_loaded
from test_writer_reader import _original_error, load, save

import dcpstore
from dcpstore.commit import NONCE_KEY

# Attempts give up within seconds; the commit window is shorter than one stalled attempt.
FAST = dcpstore.TransferConfig(
    connect_timeout=1, read_timeout=3, min_send_rate=64 << 20, retry=dcpstore.RetryPolicy(max_attempts=3, initial_backoff=0.01)
)
METADATA = r"/ckpt/\.metadata$"


def _shards(s3, bucket):
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="ckpt/__").get("Contents", []))


def _save_via(proxy, bucket, **writer):
    sd = sample_state_dict()
    save(sd, f"s3://{bucket}/ckpt", storage_options={"endpoint_url": proxy.endpoint}, transfer=FAST, **writer)
    return sd


# The slow tier's variants of the default tier's tests below, each waiting out longer bounds: a lost
# answer (its classification as "may have landed" is in the unknown-outcome test) settled as the 504
# that lands later is, a commit landing after the window closed (so does that 504's), and the same
# outcome on every gloo rank (as where the coordinator dies after its PUT landed).
@pytest.mark.slow
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


@pytest.mark.slow
def test_a_commit_that_lands_after_the_deadline_is_committed(bucket, s3, proxy):
    """Every attempt is held past its read timeout and lands after the commit window closed."""
    proxy.add("PUT", METADATA, delay=FAST.read_timeout + 0.5)
    sd = _save_via(proxy, bucket, commit_window=1.0)
    proxy.clear()
    assert_state_dict_equal(load(zeros_like_state_dict(sd), f"s3://{bucket}/ckpt"), sd)


@pytest.mark.parametrize(
    "status,code", [(504, "GatewayTimeout"), pytest.param(500, "InternalError", marks=pytest.mark.slow)]
)
def test_a_commit_answered_with_a_server_error_that_lands_later_is_committed(bucket, s3, proxy, status, code):
    """A gateway answers every .metadata PUT with an error at once; the store completes the first one later.

    An error answer is not "did not land": the outcome waits out the landing
    margin (5 s here) and then reads storage, which shows this save's commit.
    """
    first = proxy.add("PUT", METADATA, status=status, code=code, lands_after=2.0, times=1)
    proxy.add("PUT", METADATA, status=status, code=code)
    sd = _save_via(proxy, bucket, commit_window=1.0)  # returns: committed
    assert first.hits == 1 and any(m == "PUT" and p.endswith("/ckpt/.metadata") for m, p, _ in proxy.landed)
    proxy.clear()
    md = read_metadata_raw(s3, bucket, "ckpt")
    assert {info.relative_path for info in md.storage_data.values()} <= {k.split("/", 1)[1] for k in _shards(s3, bucket)}
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


@pytest.mark.slow
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


@pytest.mark.parametrize("timeouts", [(4.0, 4.0), (30.0, 4.0)], ids=["equal-timeouts", "the-coordinators-longer"])
def test_ranks_agree_when_the_coordinators_work_before_the_put_outlasts_their_wait(bucket, s3, proxy, timeouts):
    """The resume index PUT stalls past the peers' collective timeout (4 s here, connect and read 1 s, window 1 s).

    The coordinator then starts no .metadata PUT, since its peers may
    already have settled without it: both ranks report failed, and storage
    holds no .metadata.  (Before: rank 1 settled "failed", rank 0 committed;
    and with the coordinator given 30 s and rank 1 4 s, issue 57.3, the
    coordinator kept its own 30 s and committed while rank 1 reported failed.)
    """
    proxy.add("PUT", r"/run/step_00000001/\.dcpstore-index-", delay=6)
    transfer = dcpstore.TransferConfig(
        connect_timeout=1, read_timeout=1, min_send_rate=64 << 20, retry=dcpstore.RetryPolicy(initial_backoff=0.01)
    )
    outcomes = run_ranks(checkpointer_one_save, 2, f"s3://{bucket}/run", proxy.endpoint, transfer, 1.0, timeouts)
    assert outcomes[0] is not None and "past the point its peers stop waiting" in outcomes[0][1]
    assert outcomes[1] is not None and "storage shows no .metadata of this save" in outcomes[1][1]
    assert not object_exists(s3, bucket, "run/step_00000001/.metadata")


def test_retention_that_outlasts_the_peers_wait_leaves_the_group_in_step(bucket, s3, proxy):
    """keep_last=1: step 2's commit deletes step 1, and every delete stalls past the read timeout five times over.

    Retention runs before the verdict goes out, so that every rank lists
    what is kept; but its deletes (about 5 s of timed-out attempts here)
    outlast the peers' 4 s wait for the verdict.  The coordinator stops
    waiting for them before the peers stop waiting for it: both ranks
    report step 2 committed, the next collective (latest_step) agrees, and
    the deletes finish in the background.  (Before: rank 1 timed out in
    the broadcast, settled "committed" from storage, and the group broke at
    latest_step.)
    """
    deletes = proxy.add("POST", r"\?delete", delay=6, times=5)
    transfer = dcpstore.TransferConfig(
        connect_timeout=1, read_timeout=1, min_send_rate=64 << 20,
        retry=dcpstore.RetryPolicy(max_attempts=10, initial_backoff=0.01),
    )
    results = run_ranks(checkpointer_slow_retention, 2, f"s3://{bucket}/run", proxy.endpoint, transfer, 4.0)
    assert results == {0: ["committed", "committed", 2], 1: ["committed", "committed", 2]}
    assert deletes.hits == 5
    assert not object_exists(s3, bucket, "run/step_00000001/.metadata")  # close() let the deletes finish
    assert object_exists(s3, bucket, "run/step_00000002/.metadata")


@pytest.mark.parametrize(
    "after_put,step",
    [  # the default tier runs the last; the slow tier the three that wait out longer bounds
        pytest.param(False, 1, id="dies-before-the-put-full-commit", marks=pytest.mark.slow),
        pytest.param(False, 3, id="dies-before-the-put-patched-commit", marks=pytest.mark.slow),
        pytest.param(True, 1, id="dies-after-it-landed-full-commit", marks=pytest.mark.slow),
        pytest.param(True, 3, id="dies-after-it-landed-patched-commit"),
    ],
)
def test_time_to_an_outcome_when_the_coordinator_dies_at_the_commit(bucket, s3, after_put, step):
    """3 gloo ranks; rank 0 dies at the .metadata PUT of step 1, or of step 3 (a patched commit: no object collective).
    The others report what storage shows, within the bound.

    The bound is docs/guarantees.md's: the collective timeout (20 s in the worker;
    a socket that closes sooner is settled as a timeout, since the
    coordinator might be alive and still committing), then commit_window +
    connect + read timeout + 1 s, plus 1 s of jitter and slack for a busy
    box (deadline_scale).  A step that committed is reported as soon as it shows.
    """
    from dist_utils import deadline_scale
    from workers import checkpointer_coordinator_dies_at_commit

    window = 2.0
    root = f"s3://{bucket}/run"
    results = run_ranks(
        checkpointer_coordinator_dies_at_commit, 3, root, FAST, window, after_put, step, expect_killed=(0,), timeout=240
    )
    landing = FAST.connect_timeout + FAST.read_timeout + FAST.multipart_threshold / FAST.min_send_rate + 1
    bound = (20 + window + landing + 1 + 15) * deadline_scale()
    for rank in (1, 2):
        outcome, seconds, object_collectives = results[rank]
        assert seconds < bound, (rank, seconds, bound)
        assert (object_collectives == 0) == (step == 3), (rank, object_collectives)
        if after_put:
            assert outcome == "committed"
        else:
            assert outcome.startswith("CheckpointSaveError") and "storage shows no .metadata of this save" in outcome
    assert object_exists(s3, bucket, f"run/step_{step:08d}/.metadata") == after_put
    if after_put:
        for r in run_ranks(load_sharded, 2, f"{root}/step_{step:08d}", "fsspec" if step == 3 else "dcpstore").values():
            assert_loaded(r)


# -- a .metadata past multipart_threshold ----------------------------------------------
#
# At 4,096 ranks x 2,000 items torch's .metadata is about 1.4 GB.  It goes up
# as a multipart upload whose completion carries the commit's condition.  A
# threshold of 6 MiB and 5 MiB parts make an 11 MiB .metadata three parts.

IN_PARTS = dcpstore.TransferConfig(
    part_size=5 << 20,
    multipart_threshold=6 << 20,
    connect_timeout=2,
    read_timeout=10,
    retry=dcpstore.RetryPolicy(max_attempts=3, initial_backoff=0.01),
)
COMPLETION = r"/ckpt/\.metadata\?uploadId="


def _commit_in_parts(proxy, bucket, raw, nonce, replaced_etag=None):
    from dcpstore.commit import write_metadata
    from dcpstore.storage import open_store

    store = open_store(f"s3://{bucket}/ckpt", {"endpoint_url": proxy.endpoint}, IN_PARTS)
    try:
        return write_metadata(store, raw, nonce, replaced_etag=replaced_etag, window=30.0)
    finally:
        store.close()


def _open_uploads(s3, bucket):
    return s3.list_multipart_uploads(Bucket=bucket, Prefix="ckpt/").get("Uploads", [])


@pytest.mark.also_rgw
def test_a_large_metadata_commits_in_parts_under_the_condition(bucket, s3, proxy):
    """moto enforces If-None-Match on the completion; Ceph RGW 16.2 ignores it, and the HEAD before it refuses."""
    from dcpstore.commit import Outcome

    raw = bytes(range(256)) * (11 * 4096)  # 11 MiB
    outcome, error = _commit_in_parts(proxy, bucket, raw, "first")
    assert (outcome, error) == (Outcome.COMMITTED, None)
    sent = [(m, p) for m, p in proxy.requests if "/ckpt/.metadata" in p]
    assert sum(1 for m, p in sent if m == "PUT" and "partNumber=" in p) == 3
    assert not [p for m, p in sent if m == "PUT" and "partNumber=" not in p]  # never one whole PUT
    completions = [h for m, p, h in proxy.headers if m == "POST" and "uploadId=" in p]
    assert [h.get("if-none-match") for h in completions] == ["*"]
    assert s3.get_object(Bucket=bucket, Key="ckpt/.metadata")["Body"].read() == raw
    assert s3.head_object(Bucket=bucket, Key="ckpt/.metadata")["Metadata"][NONCE_KEY] == "first"

    # Another writer of the same step is refused at the completion, and leaves no parts.
    proxy.clear()
    outcome, error = _commit_in_parts(proxy, bucket, raw[::-1], "second")
    assert outcome is Outcome.REFUSED and isinstance(error, dcpstore.ConditionalWriteError)
    assert s3.get_object(Bucket=bucket, Key="ckpt/.metadata")["Body"].read() == raw
    assert _open_uploads(s3, bucket) == []


def test_a_large_metadata_whose_completion_answer_is_lost_is_committed(bucket, s3, proxy):
    """The completion lands, its answer is lost; the retry finds the upload gone or completed: ours, by the HEAD."""
    from dcpstore.commit import Outcome

    raw = b"m" * (7 << 20)
    lost = proxy.add("POST", COMPLETION, drop_response=True, times=1)
    assert _commit_in_parts(proxy, bucket, raw, "mine") == (Outcome.COMMITTED, None)
    assert lost.hits == 1
    assert s3.head_object(Bucket=bucket, Key="ckpt/.metadata")["Metadata"][NONCE_KEY] == "mine"
    assert _open_uploads(s3, bucket) == []


def test_a_large_metadata_that_replaces_a_checkpoint_completes_only_over_the_one_it_read(bucket, s3, proxy):
    """If-Match on the completion.  moto 5.2 ignores it there, so the fault proxy checks it as AWS does (one HEAD)."""
    from dcpstore.commit import Outcome

    proxy.if_match_on_completion = True
    old = b"o" * (7 << 20)
    assert _commit_in_parts(proxy, bucket, old, "old") == (Outcome.COMMITTED, None)
    read_etag = s3.head_object(Bucket=bucket, Key="ckpt/.metadata")["ETag"]
    s3.put_object(Bucket=bucket, Key="ckpt/.metadata", Body=b"changed since", Metadata={NONCE_KEY: "other"})
    outcome, error = _commit_in_parts(proxy, bucket, b"n" * (7 << 20), "new", replaced_etag=read_etag)
    assert outcome is Outcome.REFUSED and isinstance(error, dcpstore.ConditionalWriteError)
    assert s3.get_object(Bucket=bucket, Key="ckpt/.metadata")["Body"].read() == b"changed since"
    assert _open_uploads(s3, bucket) == []
    current = s3.head_object(Bucket=bucket, Key="ckpt/.metadata")["ETag"]
    assert _commit_in_parts(proxy, bucket, b"n" * (7 << 20), "new", replaced_etag=current) == (Outcome.COMMITTED, None)
    assert s3.head_object(Bucket=bucket, Key="ckpt/.metadata")["Metadata"][NONCE_KEY] == "new"


def test_a_save_whose_metadata_goes_up_in_parts_loads_with_torchs_reader(bucket, s3):
    """End to end through dcp.save: .metadata as a one-part upload (threshold 1 byte), read back by FsspecReader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    sd = sample_state_dict()
    save(sd, f"s3://{bucket}/ckpt", transfer=dcpstore.TransferConfig(multipart_threshold=1))
    assert s3.head_object(Bucket=bucket, Key="ckpt/.metadata")["ETag"].strip('"').endswith("-1")  # a multipart ETag
    out = zeros_like_state_dict(sd)
    dcp.load(out, storage_reader=FsspecReader(f"s3://{bucket}/ckpt"), no_dist=True)
    assert_state_dict_equal(out, sd)
