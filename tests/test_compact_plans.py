"""The compact persisted plans: exact round trip, size, flat resume, torch's plan caching, old checkpoints."""

import dataclasses
import logging
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties

import dcpstore
from benchmarks.scale import finish_bytes, global_step, simulate_plans, torch_metadata_bytes, write_results
from dcpstore import PlanCache, planner_data
from dcpstore.plan_cache import default_global_step


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def dcpstore_log():
    handler = _Records()
    logger = logging.getLogger("dcpstore")
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(old_level)


@pytest.fixture(scope="module")
def w256():
    plans = simulate_plans(256, 24)
    writer, central, metadata = global_step(plans)
    results = write_results(central)
    raw, _ = finish_bytes(writer.plans.plans, metadata, results)
    return plans, central, metadata, results, raw


def test_encode_at_w256_round_trips_and_stays_small(w256):
    plans, central, metadata, results, raw = w256
    loaded = pickle.loads(raw)
    assert planner_data.PLANS_KEY in loaded.planner_data
    assert planner_data.ALL_LOCAL_PLANS_KEY not in loaded.planner_data
    assert dcpstore.read_plans(loaded) == [planner_data.strip_plan(p) for p in plans]
    # Only builtins in the compact form: stock readers unpickle it.
    compact = loaded.planner_data[planner_data.PLANS_KEY]
    assert all(isinstance(b, bytes) for b in compact["ranks"]) and isinstance(compact["planner_data_index"], bytes)
    # Bounded relative to torch's own .metadata of the same save.
    no_plans, _ = finish_bytes(None, metadata, results)
    assert len(raw) - len(no_plans) <= 0.10 * torch_metadata_bytes(metadata, results)


def test_decode_rank_gives_the_global_steps_final_plan(w256):
    plans, central, metadata, _, raw = w256
    loaded = pickle.loads(raw)
    compact = planner_data.read_compact(loaded)
    for rank in (0, 1, 128, 255):
        local, final = planner_data.decode_rank(compact, loaded, rank)
        assert local == planner_data.strip_plan(plans[rank])
        want = dataclasses.replace(central[rank], storage_data=None)
        assert final == want
        assert [i.index.index for i in final.items] == [i.index.index for i in want.items]  # index hints too


def test_flat_prime_matches_full_global_step(w256):
    plans, central, metadata, _, raw = w256
    loaded = pickle.loads(raw)
    writer = dcpstore.ObjectStoreWriter("memory://unused")
    for rank in (0, 77):
        cache = PlanCache()
        assert cache.fill_from_metadata(loaded, rank=rank, world_size=256, planner=DefaultSavePlanner(), writer=writer)
        entry = cache.entry
        assert entry.local_plan == planner_data.strip_plan(plans[rank])
        # The same plan, and the same storage prefix (the coordinator's nonce beside it is the save's own).
        assert dataclasses.replace(entry.central_plan, storage_data=None) == dataclasses.replace(central[rank], storage_data=None)
        assert entry.central_plan.storage_data.prefix == central[rank].storage_data.prefix == f"__{rank}_"
        if rank == 0:
            # The coordinator commits with the metadata torch's global step would make.
            assert entry.metadata == metadata
            assert planner_data.is_compact(entry.all_local_plans)
        else:
            assert entry.metadata is None and entry.all_local_plans is None
    assert not cache.fill_from_metadata(loaded, rank=0, world_size=128, planner=DefaultSavePlanner(), writer=writer)


def test_mismatches_fall_back_to_full_plans(w256):
    plans, central, metadata, results, _ = w256
    written = [{wr.index for wr in rr} for rr in results]
    assert planner_data.encode_plans(plans, metadata, written) is not None
    # A rank that wrote an item its local plan does not hold: not the default dedup.
    bad = list(written)
    bad[3] = bad[3] | {MetadataIndex("model.layers.0.wq.weight", [0, 0])}  # rank 0's chunk
    assert planner_data.encode_plans(plans, metadata, bad) is None
    # A local item that is not in the metadata.
    odd = list(plans)
    odd[5] = dataclasses.replace(odd[5], items=odd[5].items + [dataclasses.replace(odd[5].items[0], index=MetadataIndex("nope", [0, 0]))])
    assert planner_data.encode_plans(odd, metadata, written) is None
    # Items the codes cannot carry: each field decoding would take from the metadata, changed alone.
    item = plans[5].items[0]
    data = item.tensor_data
    wider = dataclasses.replace(data.chunk, sizes=torch.Size([data.chunk.sizes[0] + 1, data.chunk.sizes[1]]))
    for changed in (
        dataclasses.replace(item, tensor_data=dataclasses.replace(data, chunk=wider)),
        dataclasses.replace(item, tensor_data=dataclasses.replace(data, properties=TensorProperties(dtype=torch.float64))),
        dataclasses.replace(item, tensor_data=dataclasses.replace(data, size=torch.Size([1, 1]))),
        dataclasses.replace(item, index=MetadataIndex(item.index.fqn, [1, 0])),
        dataclasses.replace(item, bytes_io_data=object()),
    ):
        one_off = list(plans)
        one_off[5] = dataclasses.replace(plans[5], items=[changed] + plans[5].items[1:])
        assert planner_data.encode_plans(one_off, metadata, written) is None, changed
    unusable = list(plans)
    unusable[5] = dataclasses.replace(plans[5], usable=False)
    assert planner_data.encode_plans(unusable, metadata, written) is None
    # finish() then persists the full plans, which read_plans still returns.
    raw, _ = finish_bytes([planner_data.strip_plan(p) for p in odd], metadata, results)
    loaded = pickle.loads(raw)
    assert planner_data.PLANS_KEY not in loaded.planner_data
    assert dcpstore.read_plans(loaded) == [planner_data.strip_plan(p) for p in odd]


def test_old_format_checkpoints_still_prime(bucket):
    sd = {"w": torch.arange(8.0), "step": 3}
    url = f"s3://{bucket}/ckpt"
    dcp.save(sd, storage_writer=dcpstore.ObjectStoreWriter(url), no_dist=True)
    md = dcpstore.ObjectStoreReader(url).read_metadata()
    plans = dcpstore.read_plans(md)
    # Rewrite it as the previous version did: full plans, no compact form.
    old = dataclasses.replace(md, planner_data={**planner_data.user_planner_data(md), planner_data.ALL_LOCAL_PLANS_KEY: plans})
    old = pickle.loads(pickle.dumps(old))
    assert planner_data.read_compact(old) is None and dcpstore.read_plans(old) == plans
    cache = PlanCache()
    assert cache.fill_from_metadata(old, rank=0, world_size=1, planner=DefaultSavePlanner(), writer=dcpstore.ObjectStoreWriter("memory://x"))
    assert cache.entry.central_plan.storage_data.prefix == "__0_"


def _local_plan(planner_cls, sd):
    planner = planner_cls()
    planner.set_up_planner(sd, is_coordinator=True)
    return planner_data.strip_plan(planner.create_local_plan())


class CompactCachingPlannerA(DefaultSavePlanner):
    """torch's plan caching on; torch keys its class-level caches by class name."""

    def __init__(self):
        super().__init__(enable_plan_caching=True)


class CompactPlainPlannerB(DefaultSavePlanner):
    pass


@pytest.mark.parametrize("planner_cls", [CompactCachingPlannerA, CompactPlainPlannerB])
def test_plain_dcp_save_twice_persists_plans_with_and_without_torch_caching(planner_cls, bucket, dcpstore_log):
    sd = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3)}, "step": 7}
    expected = [_local_plan(DefaultSavePlanner, sd)]
    for n in range(3):
        url = f"s3://{bucket}/{planner_cls.__name__}/step_{n}"
        dcp.save(sd, storage_writer=dcpstore.ObjectStoreWriter(url), planner=planner_cls(), no_dist=True)
        md = dcpstore.ObjectStoreReader(url).read_metadata()
        assert planner_data.read_compact(md) is not None, n
        assert dcpstore.read_plans(md) == expected, n
        out = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(3)}, "step": 0}
        dcp.load(out, storage_reader=dcpstore.ObjectStoreReader(url), no_dist=True)
        assert torch.equal(out["model"]["w"], sd["model"]["w"]) and out["step"] == 7
    assert not [r for r in dcpstore_log if r.levelno >= logging.WARNING], [r.getMessage() for r in dcpstore_log]
    # A changed structure (torch's case 2.2) is persisted too.
    sd["model"]["extra"] = torch.zeros(2)
    url = f"s3://{bucket}/{planner_cls.__name__}/changed"
    dcp.save(sd, storage_writer=dcpstore.ObjectStoreWriter(url), planner=planner_cls(), no_dist=True)
    md = dcpstore.ObjectStoreReader(url).read_metadata()
    assert dcpstore.read_plans(md) == [_local_plan(DefaultSavePlanner, sd)]
    assert not [r for r in dcpstore_log if r.levelno >= logging.WARNING]


class CompactCachingPlannerC(DefaultSavePlanner):
    def __init__(self):
        super().__init__(enable_plan_caching=True)


@pytest.mark.parametrize("planner_factory", [DefaultSavePlanner, CompactCachingPlannerC])
def test_checkpointer_resume_reuses_compact_plans(planner_factory, bucket, dcpstore_log):
    root = f"s3://{bucket}/run"
    sd = {"model": {"w": torch.arange(6.0), "b": torch.ones(2)}, "step": 1}
    with dcpstore.AsyncCheckpointer(root, planner_factory=planner_factory) as ckpt:
        ckpt.save(sd, step=1).result()
        assert ckpt.save(sd, step=2).result().plan_reused
    with dcpstore.AsyncCheckpointer(root, planner_factory=planner_factory) as ckpt:
        out = {"model": {"w": torch.zeros(6), "b": torch.zeros(2)}, "step": 0}
        assert ckpt.load(out) == 2
        assert planner_data.is_compact(ckpt.plan_cache.entry.all_local_plans)
        assert ckpt.save(out, step=3).result().plan_reused
    md = dcpstore.ObjectStoreReader(f"{root}/step_00000003").read_metadata()
    assert dcpstore.read_plans(md) == [_local_plan(DefaultSavePlanner, sd)]
    assert not [r for r in dcpstore_log if r.levelno >= logging.WARNING], [r.getMessage() for r in dcpstore_log]


def test_custom_global_step_is_not_flat():
    class Custom(DefaultSavePlanner):
        def create_global_plan(self, all_plans):
            return super().create_global_plan(all_plans)

    assert default_global_step(DefaultSavePlanner()) and default_global_step(CompactCachingPlannerA())
    assert not default_global_step(Custom())
