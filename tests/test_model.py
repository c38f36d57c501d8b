"""The model-based adversary (tests/model/): every mechanism composed with faults, checked against an oracle.

The default tier runs it for ``DCPSTORE_MODEL_SECONDS`` (60) with a fixed
seed; the ``slow`` tier runs the long campaign (``DCPSTORE_MODEL_CAMPAIGN_SECONDS``,
600).  Each round of examples has a seed of its own, printed with a
failure together with hypothesis's shortest failing sequence; a failure
replays from that output alone: ``DCPSTORE_MODEL_REPLAY=<seed> pytest
tests/test_model.py -k default``.

Below the runs: each open defect's shortest failing sequence, as the
machine found it (or as its rule reaches it), a strict ``xfail`` that
passes the day the defect is fixed.  The issue that fixes one switches its
flag on in ``model.rules.DEFECTS`` and removes the ``xfail``.
"""

from __future__ import annotations

import os
import time

import pytest
import s3fs
from hypothesis import HealthCheck, Phase, settings
from hypothesis.internal.conjecture import engine
from hypothesis.stateful import run_state_machine_as_test

from model import rules
from model.invariants import Violation
from model.rules import DEFECTS, CheckpointWorld, World

SEED = int(os.environ.get("DCPSTORE_MODEL_SEED", "20261207"))
# Shrinking a failure replays sequences whose rules take seconds (processes, holds, graces); hypothesis's own bound
# is 300 s of shrinking, which with the run itself would pass pytest-timeout's 600 s.  The sequence left after
# 150 s is short enough to read, and replays from the printed seed.
SHRINK_SECONDS = int(os.environ.get("DCPSTORE_MODEL_SHRINK_SECONDS", "150"))
STEPS_PER_EXAMPLE = 10
EXAMPLES_PER_ROUND = 2


@pytest.fixture
def shrink_bound(monkeypatch):
    monkeypatch.setattr(engine, "MAX_SHRINKING_SECONDS", SHRINK_SECONDS)


@pytest.fixture
def world(bucket, proxy, moto_endpoint, tmp_path, monkeypatch):
    """The machine's bucket and proxy; ``dcpstore gc`` and s3fs reach the server through the proxy too (AWS's object times)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    s3fs.S3FileSystem.clear_instance_cache()
    rules.WORLD = World(bucket, proxy, moto_endpoint, str(tmp_path))
    yield rules.WORLD
    rules.WORLD = None
    s3fs.S3FileSystem.clear_instance_cache()


def run_campaign(seconds: float, seed: int) -> None:
    """Rounds of examples, each with its own seed, until ``seconds`` have passed (at least one round)."""
    replay = os.environ.get("DCPSTORE_MODEL_REPLAY")
    seeds = [int(replay)] if replay else None
    started, rounds, longest = time.monotonic(), 0, 0.0
    # A round starts only if the longest so far still fits the budget: one is 2 examples of up to 10 rules, seconds each.
    while (seeds is None and (rounds == 0 or time.monotonic() - started + longest < seconds)) or (seeds and rounds < len(seeds)):
        round_seed = seeds[rounds] if seeds else seed + rounds
        round_started = time.monotonic()
        CheckpointWorld._hypothesis_internal_use_seed = round_seed
        try:
            run_state_machine_as_test(CheckpointWorld, settings=settings(
                max_examples=EXAMPLES_PER_ROUND, stateful_step_count=STEPS_PER_EXAMPLE, deadline=None,
                database=None, print_blob=True, suppress_health_check=list(HealthCheck), phases=(Phase.generate, Phase.shrink),
            ))
        except BaseException:
            print(f"model: the round with seed {round_seed} failed; replay it: DCPSTORE_MODEL_REPLAY={round_seed} "
                  f"DCPSTORE_MODEL_DEFECTS={','.join(n for n, on in DEFECTS.items() if on) or '(none)'}")
            raise
        rounds += 1
        longest = max(longest, time.monotonic() - round_started)
    on = sorted(n for n, v in DEFECTS.items() if v)
    print(f"model: {rounds} rounds x {EXAMPLES_PER_ROUND} examples x <= {STEPS_PER_EXAMPLE} rules (seed {seed}) "
          f"in {time.monotonic() - started:.0f}s; defect rules on: {on or 'none'}; rules run: {dict(sorted(rules.RULES_RUN.items()))}")


def test_model_default(world, shrink_bound):
    run_campaign(float(os.environ.get("DCPSTORE_MODEL_SECONDS", "60")), SEED)


CAMPAIGN_SECONDS = float(os.environ.get("DCPSTORE_MODEL_CAMPAIGN_SECONDS", "600"))


@pytest.mark.slow
@pytest.mark.timeout(CAMPAIGN_SECONDS + SHRINK_SECONDS + 300)
def test_model_campaign(world, shrink_bound):
    run_campaign(CAMPAIGN_SECONDS, SEED + 1_000_000)


# -- the open defects' shortest sequences -----------------------------------------------------------


class Choose:
    """Stands in for hypothesis's ``data()`` in a written-out sequence: each draw takes the next value given."""

    def __init__(self, *values):
        self.values = list(values)

    def draw(self, strategy, label=None):
        return self.values.pop(0)


def replay(world, monkeypatch, defect: str, *rules_and_args) -> None:
    """Run one sequence of rules with ``defect``'s rules on, checking the invariants after each, as the machine does."""
    monkeypatch.setitem(DEFECTS, defect, True)
    machine = CheckpointWorld()
    try:
        for name, kwargs in rules_and_args:
            getattr(machine, name)(**kwargs)
            machine.storage_holds_what_users_were_told()
    finally:
        machine.teardown()


def open_defect(issue: str):
    return pytest.mark.xfail(strict=True, raises=Violation, reason=f"open defect: {issue}")


START = ("configure", dict(keep_last=None, incremental=False))
SAVE = ("save_with_checkpointer", dict(structure="A", again=False))


def test_a_create_answered_5xx_that_lands_later_leaves_no_upload_after_close(world, monkeypatch):
    """Interactions F x S: the late create's upload was left open after a clean close() (the leak check ran before it landed)."""
    replay(world, monkeypatch, "ORPHAN_UPLOAD_AFTER_CLOSE", START, ("arm_fault", dict(kind="late_5xx_create")),
           ("save_with_plain_dcp", dict(reused=False, overwrite=False, asynchronous=False)))


def test_a_reused_writer_writes_no_name_twice(world, monkeypatch):
    plain = ("save_with_plain_dcp", dict(reused=True, overwrite=True, asynchronous=False))
    replay(world, monkeypatch, "REUSED_WRITER_OVERWRITES_SHARDS", START, plain, plain)


def test_gc_right_after_a_long_upload_leaves_the_save_to_commit(world, monkeypatch):
    replay(world, monkeypatch, "GC_TAKES_A_LONG_UPLOAD", START, ("gc_right_after_a_long_upload", {}))


def test_gc_while_a_stock_save_commits_leaves_it_loadable(world, monkeypatch):
    replay(world, monkeypatch, "GC_TAKES_A_STOCK_SAVE", START, ("gc_while_a_stock_save_commits", {}))


@open_defect("issue 59.2: gc collects a running export, which then commits its index")
def test_gc_while_an_export_runs_leaves_a_loadable_export(world, monkeypatch):
    replay(world, monkeypatch, "GC_TAKES_A_RUNNING_EXPORT", START, SAVE, ("gc_while_an_export_runs", dict(data=Choose(1))))


def test_a_copy_whose_source_changed_midway_is_not_committed(world, monkeypatch):
    replay(world, monkeypatch, "COPY_SOURCE_CHANGED", ("configure", dict(keep_last=None, incremental=True)), SAVE,
           ("rewrite_a_copy_source_mid_copy", {}))


@open_defect("issue 59.1: of two exports into one folder, the loser deletes the winner's shards")
def test_two_exports_racing_for_one_folder_leave_one_loadable_export(world, monkeypatch):
    replay(world, monkeypatch, "TWO_EXPORTS_ONE_FOLDER", START, SAVE, ("two_exports_race_for_one_folder", dict(data=Choose(1))))


@open_defect("issue 59.4: --overwrite with another shard count leaves the old shards")
def test_an_export_overwritten_with_fewer_shards_leaves_none_of_the_old(world, monkeypatch):
    replay(world, monkeypatch, "EXPORT_OVERWRITE_LEFTOVERS", START, SAVE,
           ("export", dict(data=Choose(1), shard_size="20KB", again=False)),
           ("export", dict(data=Choose(1), shard_size="5GB", again=True)))


@open_defect("issue 58.2: a planted .metadata is resumed and patched into the next step")
def test_a_planted_copy_of_the_latest_step_is_never_republished(world, monkeypatch):
    replay(world, monkeypatch, "PLANTED_METADATA_REPUBLISHED", START, ("save_with_two_ranks", dict(structure="A", resume=False)),
           ("plant_a_copy_of_the_latest_step", {}), ("save_with_two_ranks", dict(structure="A", resume=True)))


@open_defect("issue 58.1: a late template is patched with another structure's values")
def test_a_slow_resume_read_never_patches_the_old_structure(world, monkeypatch):
    replay(world, monkeypatch, "LATE_TEMPLATE", START, ("save_with_two_ranks", dict(structure="A", resume=False)),
           ("restart_with_a_slow_resume_read", {}))


def test_stock_torchtitan_resumes_a_loadable_step_after_gc(world, monkeypatch):
    replay(world, monkeypatch, "STOCK_RESUME_INTO_TOMBSTONE", START, SAVE, ("arm_fault", dict(kind="refused_shard")), SAVE,
           ("gc", dict(grace=rules.GRACE, keep_last=None, aged=True, now=True)))
