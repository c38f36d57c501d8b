"""The resume index: a restarted rank reads its own share of a checkpoint, not the whole job's ``.metadata``."""

import json
import zlib

import pytest
import torch

from conftest import read_metadata_raw
from dist_utils import run_ranks
from test_checkpointer import assert_same
from workers import checkpointer_resume_logged, checkpointer_resume_then_save, checkpointer_three_saves, load_with_state_dict

from dcpstore import resume_index
from dcpstore.cli import main
from dcpstore.planner_data import INDEX_KEY, split


def _index(s3, bucket, prefix):
    """The index pointer ``.metadata`` holds, and the directory it names (read straight from the object)."""
    pointer = split(read_metadata_raw(s3, bucket, prefix).planner_data)[1][INDEX_KEY]
    offset, length, _ = pointer["directory"]
    body = s3.get_object(Bucket=bucket, Key=f"{prefix}/{pointer['key']}", Range=f"bytes={offset}-{offset + length - 1}")
    return pointer, json.loads(zlib.decompress(body["Body"].read()))


def _index_gets(proxy, prefix):
    """(start, end) of each GET of the step's index object, from the Range header the proxy saw."""
    out = []
    for method, path, headers in proxy.headers:
        if method == "GET" and f"{prefix}/.dcpstore-index-" in path:
            first, last = headers["range"].removeprefix("bytes=").split("-")
            out.append((int(first), int(last) + 1))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_resumes_from_its_own_block_with_one_ranged_get(world_size, bucket, s3, proxy):
    root = f"s3://{bucket}/run"
    (_, final, _), *_ = run_ranks(checkpointer_three_saves, world_size, root, "central").values()
    pointer, directory = _index(s3, bucket, "run/step_00000030")
    assert directory["world_size"] == world_size and len(directory["blocks"]) == world_size
    head = s3.head_object(Bucket=bucket, Key="run/step_00000030/.metadata")
    assert head["Metadata"][resume_index.INDEX_TAG] == ":".join(map(str, pointer["directory"]))
    index_size = s3.head_object(Bucket=bucket, Key=f"run/step_00000030/{pointer['key']}")["ContentLength"]
    assert index_size == pointer["size"]

    proxy.clear()
    results = run_ranks(checkpointer_resume_logged, world_size, root, proxy.endpoint)
    # .metadata: the coordinator's HEADs (commit order; the index's pointer), then its one GET of it,
    # for the next commit, on a thread of its own after the load: no rank parses .metadata to resume.
    assert [m for m, p in proxy.requests if p.split("?")[0].endswith("step_00000030/.metadata")] == ["HEAD", "HEAD", "GET"]
    # The coordinator GETs the directory; every rank, the coordinator too, exactly its block: one ranged GET each.
    offset, length, _ = pointer["directory"]
    blocks = [(offset, offset + length)] + [(start, start + size) for start, size, _ in directory["blocks"]]
    assert sorted(_index_gets(proxy, "step_00000030")) == sorted(blocks)
    for rank, ((step, loaded, counts, reused, expected, reloaded), logged) in results.items():
        assert step == 30
        assert_same(loaded, final)
        assert reused and counts.get("scatter_object_list", 0) == 0  # primed from the block: no planning
        assert_same(reloaded, expected)
        assert not [r for r in logged if r.startswith("WARNING")], (rank, logged)


def test_a_resharded_resume_reads_metadata(bucket, s3, proxy):
    root = f"s3://{bucket}/run"
    (_, final, _), *_ = run_ranks(checkpointer_three_saves, 4, root, "central").values()
    proxy.clear()
    results = run_ranks(checkpointer_resume_logged, 2, root, proxy.endpoint)
    offset, length, _ = _index(s3, bucket, "run/step_00000030")[0]["directory"]
    assert _index_gets(proxy, "step_00000030") == [(offset, offset + length)]  # the directory says: 4 ranks
    assert [m for m, p in proxy.requests if p.split("?")[0].endswith("step_00000030/.metadata")] == ["HEAD", "HEAD", "GET"]
    for (step, loaded, *_rest), _logged in results.values():
        assert step == 30
        assert_same(loaded, final)


def test_the_coordinators_read_of_metadata_never_holds_up_training(bucket, s3, proxy):
    """The coordinator's GET of .metadata (for its next commit) is answered late; its save() returns before that.

    An order, not a deadline: had save() waited for the global state, it
    would return after the proxy answered the GET.
    """
    root = f"s3://{bucket}/run"
    run_ranks(checkpointer_three_saves, 2, root, "central")
    proxy.clear()
    late = proxy.add("GET", r"/run/step_00000030/\.metadata$", delay=3.0)
    results = run_ranks(checkpointer_resume_then_save, 2, root, proxy.endpoint)
    assert late.hits == 1  # the coordinator's, in the background; no rank GETs it to resume
    returned, reused = results[0]
    assert reused and returned < late.answered_at
    assert all(reused for _, reused in results.values())


@pytest.mark.parametrize("saved_by", [2, 4], ids=["same-world-size", "resharded-4-to-2"])
def test_a_reader_given_the_state_dict_reads_only_its_share(saved_by, bucket, s3, proxy):
    """Plain dcp.load, 2 ranks, ObjectStoreReader(state_dict=sd): a HEAD and two ranged GETs a rank, no .metadata."""
    root = f"s3://{bucket}/run"
    (_, final, _), *_ = run_ranks(checkpointer_three_saves, saved_by, root, "central").values()
    pointer, directory = _index(s3, bucket, "run/step_00000030")
    proxy.clear()
    results = run_ranks(load_with_state_dict, 2, f"{root}/step_00000030", proxy.endpoint)
    for loaded in results.values():
        assert_same(loaded, final)
    metadata_requests = sorted(m for m, p in proxy.requests if p.split("?")[0].endswith("step_00000030/.metadata"))
    offset, length, _ = pointer["directory"]
    if saved_by == 2:
        assert metadata_requests == ["HEAD", "HEAD"]
        blocks = [(start, start + size) for start, size, _ in directory["blocks"]]
        assert sorted(_index_gets(proxy, "step_00000030")) == sorted([(offset, offset + length)] * 2 + blocks)
    else:  # saved by 4 ranks: the directory says so, and each rank reads .metadata
        assert metadata_requests == ["GET", "GET", "HEAD", "HEAD"]
        assert _index_gets(proxy, "step_00000030") == [(offset, offset + length)] * 2


@pytest.mark.parametrize("damage", ["deleted", "corrupted", "truncated"])
def test_a_missing_or_damaged_index_falls_back_to_metadata_with_a_warning(damage, bucket, s3, proxy):
    root = f"s3://{bucket}/run"
    (_, final, _), *_ = run_ranks(checkpointer_three_saves, 2, root, "central").values()
    pointer, directory = _index(s3, bucket, "run/step_00000030")
    key = f"run/step_00000030/{pointer['key']}"
    step_url = f"{root}/step_00000030"
    assert main(["verify", step_url, "--deep"]) == 0
    body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    if damage == "deleted":  # the coordinator finds no index
        s3.delete_object(Bucket=bucket, Key=key)
    elif damage == "corrupted":  # rank 1's block no longer matches its hash: rank 1 falls back, so all do
        start, length, _ = directory["blocks"][1]
        body[start + length // 2] ^= 0xFF
        s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    else:  # the directory, last in the object, is cut short
        s3.put_object(Bucket=bucket, Key=key, Body=bytes(body[:-10]))
    assert main(["verify", step_url, "--deep"]) == 1  # dcpstore verify names the damage
    proxy.clear()
    results = run_ranks(checkpointer_resume_logged, 2, root, proxy.endpoint)
    for rank, ((step, loaded, _counts, _reused, expected, reloaded), logged) in results.items():
        assert step == 30
        assert_same(loaded, final)  # bit-exact from .metadata
        assert_same(reloaded, expected)
        warned = rank == 1 if damage == "corrupted" else rank == 0
        fallback = "falls back to .metadata" if damage == "corrupted" else "every rank reads .metadata"
        if warned:
            assert any(r.startswith("WARNING") and fallback in r for r in logged), logged
    # The fallback is the coordinator's one GET, broadcast: rank 1 never GETs .metadata itself.
    assert [m for m, p in proxy.requests if p.split("?")[0].endswith("step_00000030/.metadata")] == ["HEAD", "HEAD", "GET"]


def _tensor_row(fqn="w", dtype="float32", size=(4,)):
    return [fqn, "tensor", list(size), dtype, "strided", False, "contiguous_format", False]


def _item_row(offsets=(0,), sizes=(4,), path="__0_a_0.distcp"):
    return [0, 0, list(offsets), list(sizes), 1, path, 0, 16, None, None]


ENTRY = {"save_id": "s", "dcp_version": None}


def test_a_well_formed_block_gives_the_ranks_share_and_its_plans():
    block = {"fqns": [_tensor_row()], "items": [_item_row()], "plan_data": {"dict": {"w": {"tuple": [{"v": "w"}]}}}}
    share = resume_index.share_metadata(block, ENTRY, "s3://b/ck")
    md = share.metadata.state_dict_metadata["w"]
    assert md.size == torch.Size([4]) and md.properties.dtype is torch.float32
    assert [c.offsets for c in md.chunks] == [torch.Size([0])]
    assert share.local_plan.planner_data == {"w": ("w",)} and len(share.final_plan.items) == 1


@pytest.mark.parametrize(
    "block",
    [
        {"fqns": [_tensor_row(dtype="load")], "items": [_item_row()]},  # a torch function, not a dtype
        {"fqns": [_tensor_row(dtype="os.system")], "items": [_item_row()]},
        {"fqns": [_tensor_row(dtype="_dynamo")], "items": [_item_row()]},  # a lazy torch submodule: never imported
        {"fqns": [_tensor_row(size=(10**30,))], "items": [_item_row()]},
        {"fqns": [_tensor_row()], "items": [_item_row(offsets=(-1,))]},
        {"fqns": [_tensor_row()], "items": [_item_row(offsets=(0, 0))]},  # wrong rank
        {"fqns": [_tensor_row()], "items": [[7, 0, [0], [4], 1, "p", 0, 1, None, None]]},  # no such fqn
        {"fqns": [["w", "pickle"]], "items": []},
        {"fqns": [_tensor_row()], "items": [_item_row()], "plan_data": {"eval": "__import__('os')"}},
        {"fqns": "w", "items": []},
    ],
)
def test_a_malformed_block_is_refused_by_name_never_built(block):
    with pytest.raises(resume_index.IndexUnusable, match="s3://b/ck|planner_data"):
        resume_index.share_metadata(block, ENTRY, "s3://b/ck")


def test_nesting_in_plan_data_is_bounded():
    node = {"v": 1}
    for _ in range(100):
        node = {"list": [node]}
    with pytest.raises(resume_index.IndexUnusable):
        resume_index.share_metadata({"fqns": [], "items": [], "plan_data": node}, ENTRY, "s3://b/ck")


def test_chunks_of_one_fqn_are_capped_since_their_keys_hash_predictably():
    rows = [_item_row(offsets=(n,), sizes=(1,)) for n in range(resume_index.MAX_CHUNKS_PER_FQN + 1)]
    block = {"fqns": [_tensor_row(size=(resume_index.MAX_CHUNKS_PER_FQN + 1,))], "items": rows}
    with pytest.raises(resume_index.IndexUnusable, match="chunks of 'w'"):
        resume_index.share_metadata(block, ENTRY, "s3://b/ck")
