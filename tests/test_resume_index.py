"""The resume index: a restarted rank reads its own share of a checkpoint, not the whole job's ``.metadata``."""

import dataclasses
import hashlib
import json
import zlib

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from conftest import read_metadata_raw
from dist_utils import run_ranks
from test_checkpointer import assert_same
from workers import OBJECT_COLLECTIVES, checkpointer_resume_logged, checkpointer_resume_then_save, checkpointer_three_saves, load_with_state_dict

from dcpstore import planner_data, resume_index, resume_share
from dcpstore.plan_cache import PlanCache, describe_source
from dcpstore.cli import main
from dcpstore.planner_data import INDEX_KEY


def _index(s3, bucket, prefix):
    """The index pointer ``.metadata`` holds, and the directory it names (read straight from the object)."""
    pointer = resume_index.pointer_of(read_metadata_raw(s3, bucket, prefix))
    offset, length, _ = pointer["directory"]
    body = s3.get_object(Bucket=bucket, Key=f"{prefix}/{pointer['key']}", Range=f"bytes={offset}-{offset + length - 1}")
    return pointer, json.loads(body["Body"].read())


def _index_gets(proxy, prefix):
    """(start, end) of each GET of the step's index object, from the Range header the proxy saw."""
    out = []
    for method, path, headers in proxy.headers:
        if method == "GET" and f"{prefix}/.dcpstore-index-" in path:
            first, last = headers["range"].removeprefix("bytes=").split("-")
            out.append((int(first), int(last) + 1))
    return out


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
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
    # The coordinator GETs the directory and the save's values (sent on with each rank's entry); every rank,
    # the coordinator too, exactly its block: one ranged GET each.  Then, off the training thread, the
    # coordinator reads what it patches the next commit with: the commit template's map and all the blocks.
    offset, length, _ = pointer["directory"]
    values_start, values_length, _ = directory["values"]
    template_start, template_length, _ = directory["template"]
    blocks = [(offset, offset + length), (values_start, values_start + values_length)]
    blocks += [(start, start + size) for start, size, _ in directory["blocks"]]
    blocks += [(template_start, template_start + template_length), (0, sum(size for _, size, _ in directory["blocks"]))]
    assert sorted(_index_gets(proxy, "step_00000030")) == sorted(blocks)
    for rank, ((step, loaded, counts, reused, expected, reloaded), logged) in results.items():
        assert step == 30
        assert_same(loaded, final)
        assert reused and counts.get("scatter_object_list", 0) == 0  # primed from the block: no planning
        # and the commit patched the resumed .metadata: no object collective at all
        assert sum(counts.get(name, 0) for name in OBJECT_COLLECTIVES) == 0, counts
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
        # and the segments of the ranks whose values its block reads: its own, and the writers of what it shares
        segments = [
            (directory["segments"][w][0], directory["segments"][w][0] + directory["segments"][w][1])
            for needs in directory["needs"] for first, last in needs for w in range(first, last + 1)
        ]
        assert any(len(needs) > 1 or needs[0][0] != needs[0][1] for needs in directory["needs"])  # a value read across ranks
        assert sorted(_index_gets(proxy, "step_00000030")) == sorted([(offset, offset + length)] * 2 + blocks + segments)
    else:  # saved by 4 ranks: the directory says so, and each rank reads .metadata
        assert metadata_requests == ["GET", "GET", "HEAD", "HEAD"]
        assert _index_gets(proxy, "step_00000030") == [(offset, offset + length)] * 2


# "truncated" takes the path of "deleted" (the coordinator finds no readable directory): the slow tier runs it.
@pytest.mark.parametrize("damage", ["deleted", "corrupted", pytest.param("truncated", marks=pytest.mark.slow)])
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


def test_a_damaged_commit_template_costs_one_full_commit_after_the_resume_and_nothing_else(bucket, s3, proxy):
    """The template's map in the index no longer matches its hash: the ranks still resume from their blocks, the
    coordinator parses .metadata for its next commit (logged, no warning), and that save commits in full and loads
    bit-exact."""
    root = f"s3://{bucket}/run"
    (_, final, _), *_ = run_ranks(checkpointer_three_saves, 2, root, "central").values()
    pointer, directory = _index(s3, bucket, "run/step_00000030")
    key = f"run/step_00000030/{pointer['key']}"
    body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    start, length, _ = directory["template"]
    body[start + length // 2] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    results = run_ranks(checkpointer_resume_logged, 2, root, proxy.endpoint)
    for rank, ((step, loaded, counts, reused, expected, reloaded), logged) in results.items():
        assert step == 30 and reused
        assert_same(loaded, final)
        assert counts.get("gather_object", 0) == 1  # the write results, as objects: a full commit
        assert_same(reloaded, expected)
        assert not [r for r in logged if r.startswith("WARNING")], logged
        if rank == 0:
            assert any("the next commit is built in full" in r and "commit template does not match its hash" in r for r in logged), logged


def test_an_older_dcpstores_index_is_an_ordinary_miss_not_damage():
    """Version 3 kept the directory zlib-compressed and its pointer's sizes as ints: .metadata serves, without a warning."""
    metadata = Metadata({}, planner_data=planner_data.embed(None, {INDEX_KEY: {
        "version": 3, "key": ".dcpstore-index-0123456789abcdef", "save_id": "0123456789abcdef", "size": 9,
        "directory": [0, 9, "0" * 64]}}))
    metadata.storage_meta = StorageMeta(checkpoint_id="s3://b/ck", save_id="0123456789abcdef")
    with pytest.raises(resume_index.IndexUnusable, match="version 3") as raised:
        resume_index.pointer_of(metadata)
    assert not raised.value.damaged
    directory = zlib.compress(b'{"version":3}')

    class _Store:  # an index object holding a version 3 directory, found by its tag
        def get_range(self, key, start, end):
            return directory[start:end]

        def url_for(self, key):
            return f"s3://b/ck/{key}"

    pointer = {"key": ".dcpstore-index-x", "save_id": "x", "directory": [0, len(directory), hashlib.sha256(directory).hexdigest()]}
    with pytest.raises(resume_index.IndexUnusable, match="an older index") as raised:
        resume_share.read_directory(_Store(), pointer, 2)
    assert not raised.value.damaged


def _tensor_row(fqn="w", dtype="float32", size=(4,), **fields):
    properties = {"dtype": {"dtype": dtype}, "layout": {"layout": "strided"}, "requires_grad": {"v": False}, **fields}
    return [fqn, "tensor", list(size), properties]


def _item_row(offsets=(0,), sizes=(4,), path="__0_*_0.distcp", writer=0, at=0):
    return [0, 0, list(offsets), list(sizes), 1, writer, path, 0, 16, None, at, None]


ENTRY = {"save_id": "s", "dcp_version": None}
SEGMENTS = {0: ("0123456789abcdef", [12345] * (resume_index.MAX_CHUNKS_PER_FQN + 1), [])}  # rank 0's values


def test_a_well_formed_block_gives_the_ranks_share_and_its_plans():
    block = {"fqns": [_tensor_row()], "items": [_item_row()], "plan_data": {"dict": {"w": {"tuple": [{"v": "w"}]}}}}
    share = resume_share.share_metadata(block, ENTRY, "s3://b/ck", SEGMENTS)
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
        {"fqns": [_tensor_row(layout={"layout": "load"})], "items": [_item_row()]},
        {"fqns": [_tensor_row(pin_memory={"call": "os.system"})], "items": [_item_row()]},
        {"fqns": [_tensor_row()[:3] + ["float32", "strided", False, "contiguous_format", False]], "items": [_item_row()]},
        {"fqns": [_tensor_row()], "items": [_item_row(offsets=(-1,))]},
        {"fqns": [_tensor_row()], "items": [_item_row(offsets=(0, 0))]},  # wrong rank
        {"fqns": [_tensor_row()], "items": [[7, 0, [0], [4], 1, 0, "p_*_", 0, 1, None, 0, None]]},  # no such fqn
        {"fqns": [_tensor_row()], "items": [_item_row(writer=3)]},  # no such writer's values
        {"fqns": [_tensor_row()], "items": [_item_row(at=10**6)]},  # no such crc32
        {"fqns": [_tensor_row()], "items": [_item_row(path="__0_0_0.distcp")]},  # no generation to put in
        {"fqns": [["w", "pickle"]], "items": []},
        {"fqns": [_tensor_row()], "items": [_item_row()], "plan_data": {"eval": "__import__('os')"}},
        {"fqns": "w", "items": []},
    ],
)
def test_a_malformed_block_is_refused_by_name_never_built(block):
    with pytest.raises(resume_index.IndexUnusable, match="s3://b/ck|planner_data"):
        resume_share.share_metadata(block, ENTRY, "s3://b/ck", SEGMENTS)


def _hostile(element: bytes, inflated: int) -> bytes:
    """A block that is one JSON list of ``element``, ``inflated`` bytes long: what whoever can write the bucket may put there."""
    if element == b"astral":  # one string that an escape makes four bytes a character
        return b'{"fqns":[],"items":[],"plan_data":{"v":"\\ud83d\\ude00' + b"a" * (inflated - 60) + b'"}}'
    if element == b"utf-8":  # json.dumps writes ASCII: text that is not is no block of ours
        return b'{"fqns":[],"items":[],"plan_data":{"v":"' + "\N{GRINNING FACE}".encode() * ((inflated - 60) // 4) + b'"}}'
    return b'{"fqns":[' + b",".join([element] * ((inflated - 20) // (len(element) + 1))) + b'],"items":[]}'


@pytest.mark.parametrize(
    "element,refused",
    [
        (b"[]", True),  # a 56-byte list for every 3 bytes of text
        (b'{"a":1000}', True),  # a one-key dict and an int for every 11
        (b'"\\u4e00"', True),  # a 76-byte string for every 9
        (b"[" * 40 + b"]" * 40, True),  # nesting
        (b"astral", True),  # 4 bytes a character, and the decoded text besides
        (b"utf-8", True),
        (b"[]", False),  # small enough to parse: the estimate lets it through
    ],
    ids=["lists", "dicts", "strings", "nesting", "astral", "utf-8", "under-the-estimate"],
)
def test_a_hostile_block_at_the_caps_is_refused_or_parsed_within_256_mib(element, refused):
    """The bounds are on bytes; what a parse builds is bounded too, before it starts (``resume_index.parse_cost``)."""
    import hashlib
    import tracemalloc

    from dcpstore.storage import open_store

    inflated = resume_index.MAX_BLOCK_JSON if refused else resume_index.MAX_PARSE_MEMORY // 160
    raw = zlib.compress(_hostile(element, inflated), 9)
    store = open_store(f"memory://hostile-{element.hex()[:8]}-{refused}")
    store.put(".dcpstore-index-x", raw)
    entry = {"key": ".dcpstore-index-x", "rank": 0, "block": [0, len(raw), hashlib.sha256(raw).hexdigest()]}
    del raw
    tracemalloc.start()
    try:
        if refused:
            with pytest.raises(resume_index.IndexUnusable, match="could take .* MiB of memory|does not parse|not ASCII"):
                resume_share.read_block(store, entry)
        else:
            assert len(resume_share.read_block(store, entry)["fqns"]) > 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        store.close()
    assert peak <= 256 << 20, f"{peak >> 20} MiB"


def test_a_real_blocks_parse_estimate_leaves_room_for_ten_times_the_usual_items():
    """A rank of 2,000 items (the usual FSDP shards and AdamW states) is far from the bound the estimate sets."""
    block = {
        "fqns": [_tensor_row(f"model.layers.{i}.weight", size=(4096, 4096)) for i in range(2000)],
        "items": [[i, 0, [0, 0], [256, 4096], 3, 0, "__0_*_0.distcp", i << 20, 4 << 20, None, i, None]
                  for i in range(2000)],
        "plan_data": {"v": None},
    }
    text = json.dumps(block, separators=(",", ":")).encode()
    assert 10 * resume_index.parse_cost(text) < resume_index.MAX_PARSE_MEMORY


def test_nesting_in_plan_data_is_bounded():
    node = {"v": 1}
    for _ in range(100):
        node = {"list": [node]}
    with pytest.raises(resume_index.IndexUnusable):
        resume_share.share_metadata({"fqns": [], "items": [], "plan_data": node}, ENTRY, "s3://b/ck", SEGMENTS)


def test_chunks_of_one_fqn_are_capped_since_their_keys_hash_predictably():
    rows = [_item_row(offsets=(n,), sizes=(1,)) for n in range(resume_index.MAX_CHUNKS_PER_FQN + 1)]
    block = {"fqns": [_tensor_row(size=(resume_index.MAX_CHUNKS_PER_FQN + 1,))], "items": rows}
    with pytest.raises(resume_index.IndexUnusable, match="chunks of 'w'"):
        resume_share.share_metadata(block, ENTRY, "s3://b/ck", SEGMENTS)


# -- a field torch adds to TensorProperties later (torch 2.15 added ``strides``) ---------------

# A copy of torch's dataclass with one more field, as a later torch might have it.
FutureProperties = dataclasses.make_dataclass(
    "TensorProperties", [("sparsity", int, dataclasses.field(default=0))], bases=(TensorProperties,)
)


def _share_of(properties, written_by="9.9.0"):
    """Rank 0's share, written with ``properties`` for item 'w', and the local plan it came from."""
    sdm = {"w": TensorStorageMetadata(properties, torch.Size([4]), [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))])}
    data = TensorWriteData(chunk=sdm["w"].chunks[0], properties=properties, size=sdm["w"].size)
    local = SavePlan([WriteItem(MetadataIndex("w", torch.Size([0])), WriteItemType.TENSOR, tensor_data=data)])
    info = _StorageInfo("__0_0123456789abcdef_0.distcp", 0, 16)
    metadata = Metadata(sdm, storage_data={MetadataIndex("w", torch.Size([0]), 0): info})
    compact = planner_data.encode_plans([local, local], metadata, [{MetadataIndex("w", torch.Size([0]))}, set()])
    layout = resume_index.layout_of(metadata, compact, [[WriteResult(MetadataIndex("w", torch.Size([0])), 16, info)], []], False)
    parts, pointer = layout.assemble([resume_index.encode_segment("0123456789abcdef", [], []), resume_index.encode_segment("0" * 16, [], [])], "s")
    raw = b"".join(parts)
    directory = json.loads(raw[pointer["directory"][0]:])
    start, length, _ = directory["blocks"][0]
    block = json.loads(zlib.decompress(raw[start:start + length]))
    return block, {**ENTRY, "torch_version": written_by}, local


def test_a_field_both_torches_have_is_carried_and_the_plan_is_reused(monkeypatch):
    monkeypatch.setattr(resume_index, "TensorProperties", FutureProperties)
    block, entry, local = _share_of(FutureProperties(dtype=torch.bfloat16, sparsity=3))
    assert block["fqns"][0][3]["sparsity"] == {"v": 3}  # stored by name, like every other field
    share = resume_share.share_metadata(block, entry, "s3://b/ck", SEGMENTS)
    assert share.metadata.state_dict_metadata["w"].properties == FutureProperties(dtype=torch.bfloat16, sparsity=3)
    cache = PlanCache()
    assert cache.fill_from_share(share.local_plan, share.final_plan, rank=1, world_size=2, planner=DefaultSavePlanner(),
                                 source=describe_source("s3://b/ck", "9.9.0"))
    assert cache.lookup(local, 2) is not None and cache.primed_miss(local) is None


def test_a_field_the_reading_torch_lacks_is_refused_by_name():
    written = FutureProperties(dtype=torch.bfloat16, sparsity=3)
    block, entry, _ = _share_of(written, written_by="9.9.0")
    with pytest.raises(resume_index.IndexUnusable, match=r"'w': TensorProperties.sparsity \(written by torch 9.9.0\) is not a field of torch"):
        resume_share.share_metadata(block, entry, "s3://b/ck", SEGMENTS)


def test_a_field_the_writing_torch_lacked_takes_its_default_and_the_miss_names_it(monkeypatch):
    block, entry, _ = _share_of(TensorProperties(dtype=torch.bfloat16), written_by="2.0.0")
    monkeypatch.setattr(resume_index, "TensorProperties", FutureProperties)
    share = resume_share.share_metadata(block, entry, "s3://b/ck", SEGMENTS)
    assert share.metadata.state_dict_metadata["w"].properties == FutureProperties(dtype=torch.bfloat16, sparsity=0)
    cache = PlanCache()
    assert cache.fill_from_share(share.local_plan, share.final_plan, rank=1, world_size=2, planner=DefaultSavePlanner(),
                                 source=describe_source("s3://b/ck", "2.0.0"))
    # This torch's planner fills the new field: the persisted plan cannot serve, and the miss says exactly why.
    now = FutureProperties(dtype=torch.bfloat16, sparsity=1)
    item = share.local_plan.items[0]
    local = SavePlan([dataclasses.replace(item, tensor_data=dataclasses.replace(item.tensor_data, properties=now))])
    assert cache.lookup(local, 2) is None
    why = cache.primed_miss(local)
    assert "item 'w': WriteItem.tensor_data.properties.sparsity is 1, cached 0" in why
    assert "s3://b/ck (written by torch 2.0.0, read by torch " in why
