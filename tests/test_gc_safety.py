"""gc deletes only what is dead: a step where nothing changed within the grace, on the server's clock.

Times go through the fault proxy, which reports them as AWS does (an open
upload's ``Initiated`` and a multipart object's LastModified are when the
upload began); moto alone reports neither that way.
"""

import threading
import time

import boto3
import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpstore
from conftest import wait_until_older_than
from dcpstore.cli import main
from dcpstore.layout import list_steps
from dcpstore.collection import plan_gc
from dcpstore.storage import open_store
from helpers import sample_state_dict, zeros_like_state_dict

GRACE = 2.0
PART = 5 << 20


@pytest.fixture
def store(bucket, proxy):
    store = open_store(f"s3://{bucket}/run", storage_options={"endpoint_url": proxy.endpoint})
    yield store
    store.close()


@pytest.fixture
def client(proxy):
    return boto3.client("s3", endpoint_url=proxy.endpoint)


@pytest.mark.also_rgw
def test_gc_leaves_every_upload_and_object_of_a_live_step_alone(bucket, store, client, proxy):
    """An upload that began long ago but sent a part just now is live; so is an old upload beside a shard that just landed."""
    slow = client.create_multipart_upload(Bucket=bucket, Key="run/step_00000002/__0_a_0.distcp")
    client.upload_part(Bucket=bucket, Key="run/step_00000002/__0_a_0.distcp", UploadId=slow["UploadId"], PartNumber=1, Body=b"x" * PART)
    stalled = client.create_multipart_upload(Bucket=bucket, Key="run/step_00000003/__0_b_0.distcp")
    client.upload_part(Bucket=bucket, Key="run/step_00000003/__0_b_0.distcp", UploadId=stalled["UploadId"], PartNumber=1, Body=b"x" * PART)
    wait_until_older_than(store, GRACE)
    client.upload_part(Bucket=bucket, Key="run/step_00000002/__0_a_0.distcp", UploadId=slow["UploadId"], PartNumber=2, Body=b"x")
    client.put_object(Bucket=bucket, Key="run/step_00000003/__1_b_0.distcp", Body=b"another shard of step 3, just landed")

    list_parts = lambda: sum(1 for method, path in proxy.requests if method == "GET" and "uploadId=" in path)  # noqa: E731
    asked = list_parts()
    plan = plan_gc(store, None, grace=GRACE)
    assert plan.uploads == [] and plan.marks == []  # both steps are live: nothing is aborted or marked
    assert list_parts() - asked == 1  # ListParts only for the old upload of a step not known live

    wait_until_older_than(store, GRACE)  # now nothing under either step changed within the grace
    plan = plan_gc(store, None, grace=GRACE)
    assert sorted(u.upload_id for u in plan.uploads) == sorted([slow["UploadId"], stalled["UploadId"]])
    assert [s.step for s in plan.marks] == [3]
    plan.run(store)
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_a_gc_host_whose_clock_runs_ahead_still_sees_a_running_save_as_live(bucket, store, client, monkeypatch):
    """Ages are measured on the server's clock (the Date of its answers), not on the host's."""
    client.put_object(Bucket=bucket, Key="run/step_00000002/__0_0.distcp", Body=b"a shard of a save running now")
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 7200)  # this host's clock runs two hours ahead
    plan = plan_gc(store, None, grace=3600)
    assert plan.marks == []


def test_a_grace_must_be_positive(root_on_memory="memory://gc-grace"):
    import dcpstore

    for bad in ("0", "-5", "nan"):
        with pytest.raises(SystemExit):
            main(["gc", root_on_memory, "--grace", bad])
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="grace period must be positive"):
            dcpstore.AsyncCheckpointer(root_on_memory, gc_grace=bad)
        with pytest.raises(ValueError, match="grace period must be positive"):
            plan_gc(open_store(root_on_memory), None, grace=bad)


def _save_in_background(url: str, endpoint: str, state: dict) -> tuple[threading.Thread, dict]:
    """``dcp.save`` of ``state`` to ``url`` on a thread (one process, no process group); its error, if any, lands in the dict."""
    outcome: dict = {}

    def run():
        try:
            dcp.save(state, storage_writer=dcpstore.ObjectStoreWriter(url, storage_options={"endpoint_url": endpoint}))
        except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException; returned to the test
            outcome["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def _load(url: str, endpoint: str, like: dict) -> dict:
    loaded = zeros_like_state_dict(like)
    dcp.load(loaded, storage_reader=dcpstore.ObjectStoreReader(url, storage_options={"endpoint_url": endpoint}))
    return loaded


@pytest.mark.also_rgw
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_save_that_looked_dead_while_gc_marked_it_commits_and_the_sweep_leaves_it(bucket, store, proxy, overwrite):
    """Issue 56.2: a save's shards look dead (a long upload, then a slow commit); gc marks the step; the commit lands in place of the mark.

    Before mark-then-sweep, gc laid its tombstone and deleted the shards at
    once, and the commit was refused: the checkpoint was lost.  Now the
    commit replaces exactly the mark (by its ETag), and a later gc finds a
    committed step.  ``overwrite``: an overwrite's commit, which reads the
    destination again as it commits, does the same.
    """
    held = threading.Event()
    metadata_put = proxy.add("PUT", r"/run/step_00000002/\.metadata", hold=held, times=1)
    url = f"s3://{bucket}/run/step_00000002"
    state = sample_state_dict()
    outcome: dict = {}

    def save():
        try:
            dcp.save(state, storage_writer=dcpstore.ObjectStoreWriter(url, overwrite=overwrite, storage_options={"endpoint_url": proxy.endpoint}))
        except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            outcome["error"] = e

    thread = threading.Thread(target=save)
    thread.start()
    try:
        assert metadata_put.arrived.wait(60)
        wait_until_older_than(store, GRACE)  # the shards now look like a failed save's
        plan = plan_gc(store, None, grace=GRACE)
        assert [s.step for s in plan.marks] == [2] and not plan.sweeps
        plan.run(store)
    finally:
        held.set()
        thread.join(120)
    assert "error" not in outcome, outcome
    wait_until_older_than(store, GRACE)
    plan = plan_gc(store, None, grace=GRACE)
    assert plan.empty, plan
    assert torch.equal(_load(url, proxy.endpoint, state)["model"]["embed.weight"], state["model"]["embed.weight"])


@pytest.mark.also_rgw
def test_gc_and_a_held_commit_cannot_both_succeed(bucket, store, proxy):
    """A commit held past the mark and a grace more: the sweep replaces the mark first, and the commit is then refused.

    Before: gc deleted the shards, the PUT landed, and the save reported
    committed: only .metadata was left, and loading the step failed on a shard.
    """
    held = threading.Event()
    metadata_put = proxy.add("PUT", r"/run/step_00000002/\.metadata", hold=held, times=1)
    thread, outcome = _save_in_background(f"s3://{bucket}/run/step_00000002", proxy.endpoint, sample_state_dict())
    try:
        assert metadata_put.arrived.wait(60)
        wait_until_older_than(store, GRACE)
        plan_gc(store, None, grace=GRACE).run(store)  # marked
        wait_until_older_than(store, GRACE)
        plan = plan_gc(store, None, grace=GRACE)
        assert [s.step for s in plan.sweeps] == [2]
        plan.run(store)
    finally:
        held.set()
        thread.join(120)
    assert "took this step for a failed save's debris" in str(outcome.get("error")), outcome
    assert [(s.committed, s.keys) for s in list_steps(store)] == [(False, (".metadata",))]  # the sweep's tombstone
    with pytest.raises(BaseException, match="not a checkpoint: `dcpstore gc` deleted"):  # torch wraps our CorruptCheckpointError
        _load(f"s3://{bucket}/run/step_00000002", proxy.endpoint, sample_state_dict())

    # The step's number is free again: a later save replaces the tombstone and commits.
    state = sample_state_dict(seed=7)
    thread, outcome = _save_in_background(f"s3://{bucket}/run/step_00000002", proxy.endpoint, state)
    thread.join(120)
    assert "error" not in outcome, outcome
    loaded = _load(f"s3://{bucket}/run/step_00000002", proxy.endpoint, state)
    assert torch.equal(loaded["model"]["embed.weight"], state["model"]["embed.weight"])
    assert [(s.step, s.committed) for s in list_steps(store)] == [(2, True)]


def test_a_commit_whose_shards_are_gone_writes_no_metadata(bucket, store, proxy, client):
    """The commit lists its step before the .metadata PUT: a shard deleted meanwhile (a lifecycle rule, a person) stops it."""
    held = threading.Event()
    listing = proxy.add("GET", r"list-type=2.*prefix=run%2Fstep_00000002%2F", hold=held, times=1)
    thread, outcome = _save_in_background(f"s3://{bucket}/run/step_00000002", proxy.endpoint, sample_state_dict())
    try:
        assert listing.arrived.wait(60), "the commit did not list its step"
        shard = next(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="run/step_00000002/")["Contents"] if o["Key"].endswith(".distcp"))
        client.delete_object(Bucket=bucket, Key=shard)
    finally:
        held.set()
        thread.join(120)
    error = str(outcome.get("error"))
    assert shard in error and "gone from storage" in error and "no .metadata was written" in error, error
    assert not any(method == "PUT" and path.split("?")[0].endswith("/.metadata") for method, path in proxy.requests)


def test_a_failed_saves_step_is_marked_swept_then_unmarked_a_grace_apart_and_ls_says_so(bucket, store, client, capsys):
    """The collection's three phases, each on a later run than the last, each once the step is a grace older."""
    client.put_object(Bucket=bucket, Key="run/step_00000005/__0_0.distcp", Body=b"a failed save's shard")

    def status():
        assert main(["ls", f"s3://{bucket}/run"]) == 0
        return capsys.readouterr().out.splitlines()[1].split()[1]

    now = time.time() + 60
    plan = plan_gc(store, None, grace=GRACE, now=now)
    assert [s.step for s in plan.marks] == [5] and not plan.sweeps
    plan.run(store)
    assert [s.keys for s in list_steps(store)] == [(".metadata", "__0_0.distcp")] and status() == "marked"
    assert plan_gc(store, None, grace=GRACE, now=time.time()).empty  # the mark is young: nothing more this run
    plan = plan_gc(store, None, grace=GRACE, now=now + 60)
    assert [s.step for s in plan.sweeps] == [5]
    plan.run(store)
    assert [s.keys for s in list_steps(store)] == [(".metadata",)] and status() == "collected"
    plan = plan_gc(store, None, grace=GRACE, now=now + 120)
    assert [s.step for s in plan.unmarks] == [5]
    plan.run(store)
    assert list_steps(store) == []  # stock readers and torchtitan no longer meet a tombstone


def test_gc_deletes_nothing_that_changed_since_it_was_listed(bucket, store, client):
    """A commit between a run's listing and its mark or its sweep keeps the step; a shard rewritten after the listing stays."""
    client.put_object(Bucket=bucket, Key="run/step_00000006/__0_0.distcp", Body=b"debris")
    plan = plan_gc(store, None, grace=GRACE, now=time.time() + 60)
    client.put_object(Bucket=bucket, Key="run/step_00000006/.metadata", Body=b"committed meanwhile" * 20)
    plan.run(store)  # the mark's If-None-Match is refused
    assert client.get_object(Bucket=bucket, Key="run/step_00000006/.metadata")["Body"].read() == b"committed meanwhile" * 20

    client.put_object(Bucket=bucket, Key="run/step_00000007/__0_0.distcp", Body=b"debris")
    client.put_object(Bucket=bucket, Key="run/step_00000007/__1_0.distcp", Body=b"debris")
    plan_gc(store, None, grace=GRACE, now=time.time() + 60).run(store)  # marked
    plan = plan_gc(store, None, grace=GRACE, now=time.time() + 120)
    assert [s.step for s in plan.sweeps] == [7]
    client.put_object(Bucket=bucket, Key="run/step_00000007/__1_0.distcp", Body=b"rewritten after the listing")
    plan.run(store)
    assert [s.keys for s in list_steps(store) if s.step == 7] == [(".metadata", "__1_0.distcp")]
    assert {s.step for s in list_steps(store) if s.committed} == {6}




def test_a_running_saves_lease_keeps_gc_from_marking_its_step(bucket, store, proxy):
    """An ``AsyncCheckpointer(gc_grace=...)`` renews its lease every quarter grace: its commit held past the grace, gc finds the step live.

    Its shards are older than the grace, as a long upload's are when it
    lands; only the lease under the step is recent.  Once the save is done,
    no lease is left.
    """
    held = threading.Event()
    put = proxy.add("PUT", r"/run/step_00000004/\.metadata", hold=held, times=1)
    with dcpstore.AsyncCheckpointer(f"s3://{bucket}/run", storage_options={"endpoint_url": proxy.endpoint}, gc_grace=GRACE) as ckpt:
        ckpt.save(sample_state_dict(), step=4)
        try:
            assert put.arrived.wait(60)
            shards = [o.last_modified for o in store.list("step_00000004") if o.key.endswith(".distcp")]
            while store.server_time() - max(shards) <= GRACE:  # the shards age past the grace on the server's clock
                time.sleep(0.2)
            plan = plan_gc(store, None, grace=GRACE)
            assert plan.empty, plan
        finally:
            held.set()
        ckpt.wait()
    keys = [o.key for o in store.list("step_00000004")]
    assert "step_00000004/.metadata" in keys and not any(".dcpstore-lease-" in k for k in keys), keys


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_on_a_filesystem_a_sweep_or_an_unmark_never_undoes_a_commit_made_after_the_listing(scheme, tmp_path):
    """A filesystem lists no ETags: the sweep reads the mark again, and deletes hold each object to its listed size and time.

    Found by review: the sweep overwrote, and the unmark deleted, the
    ``.metadata`` of a save that committed in place of the tombstone
    between gc's listing and its act.
    """
    root = f"file://{tmp_path}/run" if scheme == "file" else f"memory://gc-fs-{int(time.time() * 1e6)}/run"
    store = open_store(root)
    for phase in ("sweep", "unmark"):
        step = 1 if phase == "sweep" else 2
        store.put(f"step_0000000{step}/__0_dead_0.distcp", b"debris of a failed save")
        for _ in range(1 if phase == "sweep" else 2):  # marked (and swept)
            wait_until_older_than(store, 1.0)
            plan_gc(store, None, 1.0).run(store)
        wait_until_older_than(store, 1.0)
        plan = plan_gc(store, None, 1.0)
        assert [s.step for s in (plan.sweeps if phase == "sweep" else plan.unmarks)] == [step]
        state = sample_state_dict()
        dcp.save(state, storage_writer=dcpstore.ObjectStoreWriter(f"{root}/step_0000000{step}"))  # in place of the tombstone
        plan.run(store)
        assert step in [s.step for s in list_steps(store) if s.committed], phase
        loaded = zeros_like_state_dict(state)
        dcp.load(loaded, storage_reader=dcpstore.ObjectStoreReader(f"{root}/step_0000000{step}"))
        assert torch.equal(loaded["model"]["embed.weight"], state["model"]["embed.weight"])


def test_a_save_whose_tombstone_is_removed_before_its_commit_commits(bucket, store, proxy, client):
    """The save found the sweep's tombstone; gc removes it while the commit is on its way: S3 answers the If-Match 404, and the commit goes in with If-None-Match."""
    client.put_object(Bucket=bucket, Key="run/step_00000001/__0_dead_0.distcp", Body=b"debris")
    for _ in range(2):
        wait_until_older_than(store, GRACE)
        plan_gc(store, None, GRACE).run(store)  # mark, then sweep
    wait_until_older_than(store, GRACE)
    plan = plan_gc(store, None, GRACE)
    assert [s.step for s in plan.unmarks] == [1]
    held = threading.Event()
    put = proxy.add("PUT", r"/run/step_00000001/\.metadata", hold=held, times=1)
    thread, outcome = _save_in_background(f"s3://{bucket}/run/step_00000001", proxy.endpoint, sample_state_dict())
    try:
        assert put.arrived.wait(60)
        plan.run(store)
    finally:
        held.set()
        thread.join(120)
    assert "error" not in outcome, outcome
    assert [s.step for s in list_steps(store) if s.committed] == [1]


def test_gc_now_leaves_no_tombstone_behind(tmp_path, capsys):
    """A step still live when ``gc --now`` began is not marked by its later rounds: it is left with no ``.metadata``, not a tombstone."""
    root = f"file://{tmp_path}/run"
    store = open_store(root)
    store.put("step_00000001/__0_a_0.distcp", b"debris of an old failed save")
    wait_until_older_than(store, 1.5)
    store.put("step_00000002/__0_b_0.distcp", b"debris of the save that failed just now")
    assert main(["gc", root, "--grace", "1", "--now"]) == 0
    assert "done: 1 incomplete steps marked, 1 deleted, 1 tombstones removed" in capsys.readouterr().out
    assert [(s.step, s.tombstone) for s in list_steps(store)] == [(2, None)]


def test_a_failed_plain_save_ends_its_lease(tmp_path):
    """torch tells a writer nothing of a failed save: the lease ends when the coordinator's write fails, or the writer is dropped."""
    writer = dcpstore.ObjectStoreWriter(f"file://{tmp_path}/run/step_00000001")
    writer.lease_period = 0.05
    with pytest.raises(BaseException):
        dcp.save({"w": torch.randn(8), "bad": lambda: None}, storage_writer=writer)  # the lambda fails to pickle
    assert not [t for t in threading.enumerate() if t.name == "dcpstore-lease"]
    assert not any(".dcpstore-lease-" in o.key for o in open_store(f"file://{tmp_path}/run").list())


def test_every_copy_of_a_writer_sent_to_a_checkpoint_process_saves_under_fresh_names(tmp_path):
    """``dcp.async_save(..., PROCESS)`` pickles the writer for every save and calls ``reset`` only with a checkpoint_id."""
    import pickle

    writer = dcpstore.ObjectStoreWriter(f"file://{tmp_path}/ckpt", overwrite=True)
    ids = []
    for i in range(2):
        copy = pickle.loads(pickle.dumps(writer))  # what the checkpoint process receives
        dcp.save({"w": torch.full((8,), float(i))}, storage_writer=copy)
        ids.append(copy.save_id)
    assert ids[0] != ids[1]
