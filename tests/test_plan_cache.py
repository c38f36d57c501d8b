"""PlanCache.fill_from_metadata: reuse when the checkpoint matches, fall back when it does not."""

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import dcpstore
from dcpstore import PlanCache


def _local_plan(sd):
    planner = DefaultSavePlanner()
    planner.set_up_planner(sd, is_coordinator=True)
    return planner.create_local_plan()


def _fill(cache, md, world_size=1):
    return cache.fill_from_metadata(
        md, rank=0, world_size=world_size, planner=DefaultSavePlanner(), writer=dcpstore.ObjectStoreWriter("memory://unused")
    )


def test_fill_from_our_checkpoint_then_lookup(bucket):
    sd = {"w": torch.ones(8), "step": 3}
    url = f"s3://{bucket}/ckpt"
    dcp.save(sd, storage_writer=dcpstore.ObjectStoreWriter(url), no_dist=True)
    md = dcpstore.ObjectStoreReader(url).read_metadata()
    cache = PlanCache()
    assert _fill(cache, md)
    entry = cache.lookup(_local_plan(sd), world_size=1)
    assert entry is not None and entry.central_plan.storage_data.prefix == "__0_"
    assert set(entry.metadata.state_dict_metadata) == {"w", "step"}
    assert cache.lookup(_local_plan({"w": torch.ones(9), "step": 3}), world_size=1) is None  # shape changed
    assert cache.lookup(_local_plan(sd), world_size=2) is None  # world size changed


def test_world_size_change_and_foreign_checkpoints_fall_back(bucket):
    url = f"s3://{bucket}/ckpt"
    dcp.save({"w": torch.ones(2)}, storage_writer=dcpstore.ObjectStoreWriter(url), no_dist=True)
    cache = PlanCache()
    assert not _fill(cache, dcpstore.ObjectStoreReader(url).read_metadata(), world_size=2)
    assert cache.entry is None
    other = f"s3://{bucket}/torch-written"
    dcp.save({"w": torch.ones(2)}, storage_writer=FsspecWriter(other), no_dist=True)
    md = dcpstore.ObjectStoreReader(other).read_metadata()
    assert dcpstore.read_plans(md) is None
    assert not _fill(cache, md)
