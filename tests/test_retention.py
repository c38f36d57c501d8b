"""Retention and "latest" follow commit order, not step numbers (issue 26).

A rollback, a restart that resets the step counter, or a lower step saved
after a higher one must never prune the step just committed, nor make
``load()`` resume an abandoned step.
"""

import logging

import pytest
import torch

import dcpstore

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
    assert main(["gc", root, "--keep-last", "1", "--grace", "0"]) == 0
    assert "deleting committed step 300" in capsys.readouterr().out
    with dcpstore.AsyncCheckpointer(root) as ckpt:
        assert ckpt.committed_steps() == [250]
