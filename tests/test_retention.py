"""Retention and "latest" follow commit order, not step numbers (issue 26).

A rollback, a restart that resets the step counter, or a lower step saved
after a higher one must never prune the step just committed, nor make
``load()`` resume an abandoned step.
"""

import logging
import uuid

import pytest
import torch

import dcpstore
from conftest import wait_until_older_than

SD = {"w": torch.arange(6.0)}


def _save(ckpt, step, value):
    ckpt.save({"w": torch.full((6,), float(value))}, step=step)
    ckpt.wait()


def _loaded(ckpt, step=None):
    sd = {"w": torch.zeros(6)}
    got = ckpt.load(sd, step=step)
    return got, sd["w"][0].item()


@pytest.fixture(params=["s3", "file"])
def root(request, tmp_path, s3_server):
    if request.param == "file":
        return f"file://{tmp_path}/run"  # commit records from planner_data: no user metadata there
    return f"s3://{request.getfixturevalue('bucket')}/run"


def test_the_step_just_committed_is_never_pruned(root, caplog):
    """keep_last=1: 300, then 250. 250 was reported committed and must stay; it is the latest."""
    with dcpstore.AsyncCheckpointer(root, keep_last=1) as ckpt:
        _save(ckpt, 300, 3)
        with caplog.at_level(logging.WARNING, logger="dcpstore.checkpointer"):
            _save(ckpt, 250, 2)
        assert ckpt.committed_steps() == [250]
        assert ckpt.latest_step() == 250
        assert _loaded(ckpt) == (250, 2.0)
    assert "saving step 250 below the highest committed step 300" in caplog.text


def test_keep_last_deletes_a_pruned_steps_checkpoint_and_leaves_the_users_files(root, caplog):
    """keep_last=1 prunes step 1 (its .metadata, shards and resume index), not the evaluation results saved beside them."""
    from dcpstore.storage import open_store

    store = open_store(root)
    with dcpstore.AsyncCheckpointer(root, keep_last=1) as ckpt:
        _save(ckpt, 1, 1)
        store.put("step_00000001/eval_results.json", b"{}")
        _save(ckpt, 2, 2)
    # close() waited for the retention round
    assert [o.key for o in store.list() if o.key.startswith("step_00000001/")] == ["step_00000001/eval_results.json"]
    assert "eval_results.json" in caplog.text
    store.close()


@pytest.fixture(params=["s3", "memory"])
def shared_root(request, s3_server):
    if request.param == "memory":
        return f"memory://two-runs-{uuid.uuid4().hex[:12]}/run"
    return f"s3://{request.getfixturevalue('bucket')}/run"


def test_a_run_that_saves_rarely_beside_another_never_prunes_the_step_it_just_committed(shared_root):
    """Two runs on one root: a saves often, b (a zombie, a restart beside the old job) rarely.

    b's commit takes its sequence from what the root holds now, not from a
    count of its own: step 6 is the newest commit, b keeps it and resumes it.
    """
    with dcpstore.AsyncCheckpointer(shared_root, keep_last=2) as a, dcpstore.AsyncCheckpointer(shared_root, keep_last=2) as b:
        _save(b, 5, 5)
        for step in (100, 110, 120, 130):
            _save(a, step, step)
        _save(b, 6, 6)  # reported committed
        assert b.committed_steps()[-1] == 6 and b.latest_step() == 6
        assert _loaded(b) == (6, 6.0)
        _save(a, 140, 140)
        assert a.latest_step() == 140 and 140 in a.committed_steps()


def test_deleting_a_committed_step_gives_back_the_store_it_opened_even_when_it_fails(bucket, proxy):
    from dcpstore.layout import delete_committed_step
    from dcpstore.storage import TransferConfig, open_store

    url = f"s3://{bucket}/run"
    with dcpstore.AsyncCheckpointer(url, storage_options={"endpoint_url": proxy.endpoint}) as ckpt:
        _save(ckpt, 1, 1)
    store = open_store(url, {"endpoint_url": proxy.endpoint}, TransferConfig())
    leases = store._connection._leases
    proxy.add("GET", r"list-type=2", status=403, code="AccessDenied")
    with pytest.raises(dcpstore.StorageAccessError) as failed:
        delete_committed_step(store, "step_00000001")
    assert failed.value is not None  # the error, and the frames it holds, live on
    assert store._connection._leases == leases  # yet the step's store gave its lease back
    store.close()


@pytest.mark.also_rgw(root="s3")
def test_a_rollback_keeps_its_point_and_drops_the_abandoned_step(root):
    """keep_last=2: 200, 300, roll back to 200 (a loss spike), save 250: keep 200 and 250, resume 250."""
    with dcpstore.AsyncCheckpointer(root, keep_last=2) as ckpt:
        _save(ckpt, 200, 2)
        _save(ckpt, 300, 3)
        assert _loaded(ckpt, step=200) == (200, 2.0)
        _save(ckpt, 250, 25)
        assert sorted(ckpt.committed_steps()) == [200, 250]
        assert ckpt.committed_steps()[-1] == 250
        assert _loaded(ckpt) == (250, 25.0)


def test_commit_order_survives_a_restart_that_resets_the_step_counter(root):
    with dcpstore.AsyncCheckpointer(root) as ckpt:
        _save(ckpt, 500, 5)
    with dcpstore.AsyncCheckpointer(root, keep_last=2) as ckpt:  # a new job: its counter starts again
        assert ckpt.latest_step() == 500
        _save(ckpt, 10, 1)
        _save(ckpt, 20, 2)
        assert ckpt.committed_steps() == [10, 20]  # 500 is older than both, whatever its number
    with dcpstore.AsyncCheckpointer(root) as ckpt:  # and after another restart
        assert ckpt.latest_step() == 20
        assert _loaded(ckpt) == (20, 2.0)


def test_gc_keep_last_follows_commit_order_too(root, capsys):
    from dcpstore.cli import main

    with dcpstore.AsyncCheckpointer(root) as ckpt:
        _save(ckpt, 300, 3)
        _save(ckpt, 250, 2)
    assert main(["gc", root, "--keep-last", "1"]) == 0
    assert "deleting committed step 300" in capsys.readouterr().out
    with dcpstore.AsyncCheckpointer(root) as ckpt:
        assert ckpt.committed_steps() == [250]


def test_torchtitan_step_names_keep_commit_order_and_stay_apart_from_dcpstore_names(root, capsys):
    """``StepNaming.TORCHTITAN`` writes ``step-N``; retention, latest and load see only those; the CLI sees both."""
    from dcpstore.cli import main
    from dcpstore.layout import StepNaming, list_steps
    from dcpstore.storage import open_store

    with dcpstore.AsyncCheckpointer(root) as ckpt:
        _save(ckpt, 7, 7)  # another naming under the same root: never pruned, never latest here
    with dcpstore.AsyncCheckpointer(root, keep_last=2, step_naming=StepNaming.TORCHTITAN) as ckpt:
        for step, value in ((10, 1), (20, 2), (5, 3)):
            _save(ckpt, step, value)
        assert ckpt.step_url(5).endswith("/step-5")
        assert ckpt.committed_steps() == [20, 5]  # commit order: 5 is the newest
        assert _loaded(ckpt) == (5, 3.0)
    assert [s.prefix for s in list_steps(open_store(root))] == ["step-5", "step_00000007", "step-20"]
    assert main(["ls", root]) == 0
    listed = [line.split()[:2] for line in capsys.readouterr().out.splitlines()[1:]]
    assert listed == [["5", "committed"], ["7", "committed"], ["20", "committed"]]


def test_gc_keep_last_keeps_what_each_namings_checkpointer_keeps(root):
    """A torchtitan-named run (step-100..300), then a dcpstore-named one (1..3), on one root: each numbers its own commits.

    ``dcpstore gc --keep-last N`` orders each naming's steps as that
    naming's checkpointer does: with 3 it deletes nothing, with 2 the
    oldest of each, and never either run's newest.
    """
    from dcpstore.cli import main
    from dcpstore.layout import StepNaming, committed_steps
    from dcpstore.storage import open_store

    with dcpstore.AsyncCheckpointer(root, step_naming=StepNaming.TORCHTITAN) as titan:
        for step in (100, 200, 300):
            _save(titan, step, step)
    with dcpstore.AsyncCheckpointer(root) as ours:
        for step in (1, 2, 3):
            _save(ours, step, step)
    store = open_store(root)
    assert main(["gc", root, "--keep-last", "3"]) == 0
    assert len(committed_steps(store)) == 6
    assert main(["gc", root, "--keep-last", "2"]) == 0
    assert [s.prefix for s in committed_steps(store)] == ["step_00000002", "step_00000003", "step-200", "step-300"]
    with dcpstore.AsyncCheckpointer(root) as ours, dcpstore.AsyncCheckpointer(root, step_naming=StepNaming.TORCHTITAN) as titan:
        assert ours.latest_step() == 3 and titan.latest_step() == 300
    store.close()


def test_gc_grace_deletes_failed_saves_debris_after_a_commit_and_spares_young_debris(root):
    """With ``gc_grace``, a commit also deletes incomplete steps older than the grace period, as ``dcpstore gc`` does."""
    from dcpstore.layout import Tombstone, list_steps
    from dcpstore.storage import open_store

    store = open_store(root)
    store.put("step_00000003/__0_0.distcp", b"a failed save's shard")
    with dcpstore.AsyncCheckpointer(root, gc_grace=3600) as ckpt:
        _save(ckpt, 4, 4)  # the debris is seconds old: it may be a save still running
        assert [s.step for s in list_steps(store)] == [3, 4]
    store.put("step_00000002/model.safetensors.index.json", b"{}")  # someone's export, not a failed save
    wait_until_older_than(store, 1)
    with dcpstore.AsyncCheckpointer(root, keep_last=5, gc_grace=1) as ckpt:
        _save(ckpt, 5, 5)  # marks step 3 (see collection)
        steps = list_steps(store)
        assert [(s.step, s.committed) for s in steps] == [(2, False), (3, False), (4, True), (5, True)]
        assert steps[1].keys == (".metadata", "__0_0.distcp") and steps[1].tombstone is Tombstone.MARKED
        wait_until_older_than(store, 1)
        _save(ckpt, 6, 6)  # a grace later, a later commit's round sweeps it
    steps = list_steps(store)
    assert [(s.step, s.committed) for s in steps] == [(2, False), (3, False), (4, True), (5, True), (6, True)]
    assert steps[1].keys == (".metadata",) and steps[1].tombstone is Tombstone.SWEPT  # only the sweep's tombstone, for a grace


def test_steps_other_tools_committed_go_among_dcpstores_by_time():
    """dcpstore 100, then stock torchtitan 200 and 300, then dcpstore 310: the stock steps are not older than 100."""
    from dcpstore.steps import CommitRecord, in_commit_order, retained

    records = [CommitRecord(300, None, None, 30.0), CommitRecord(100, 1, None, 10.0), CommitRecord(200, None, None, 20.0)]
    assert [r.step for r in in_commit_order(records)] == [100, 200, 300]
    records.append(CommitRecord(310, 2, 300, None))  # just committed here: its time is not listed yet
    assert [r.step for r in in_commit_order(records)] == [100, 200, 300, 310]
    assert retained(in_commit_order(records), 2) == {300, 310}
    same_second = [CommitRecord(5, None, None, 10.0), CommitRecord(4, 1, None, 10.0)]
    assert [r.step for r in in_commit_order(same_second)] == [4, 5]
