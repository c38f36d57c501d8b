"""ObjectStoreWriter / ObjectStoreReader under plain dcp.save / dcp.load, one process."""

import dataclasses
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

import dcpstore
from conftest import object_exists, read_metadata_raw
from dcpstore import planner_data
from helpers import assert_state_dict_equal, sample_state_dict, zeros_like_state_dict


def save(sd, url, **kwargs):
    planner = kwargs.pop("planner", None)
    return dcp.save(sd, storage_writer=dcpstore.ObjectStoreWriter(url, **kwargs), planner=planner, no_dist=True)


def load(sd, url, **kwargs):
    dcp.load(sd, storage_reader=dcpstore.ObjectStoreReader(url, **kwargs), no_dist=True)
    return sd


def test_round_trip_bit_exact(bucket, s3):
    sd = sample_state_dict()
    url = f"s3://{bucket}/ckpt"
    save(sd, url)
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"])
    assert keys[0] == "ckpt/.metadata"
    assert all(k.startswith("ckpt/__0_") and k.endswith(".distcp") for k in keys[1:])
    assert_state_dict_equal(load(zeros_like_state_dict(sd), url), sd)


def test_stock_fsspec_reader_loads_our_checkpoint(bucket):
    sd = sample_state_dict(1)
    url = f"s3://{bucket}/ckpt"
    save(sd, url)
    out = zeros_like_state_dict(sd)
    dcp.load(out, storage_reader=FsspecReader(url), no_dist=True)
    assert_state_dict_equal(out, sd)


def test_reserved_planner_data_keys_do_not_disturb_empty_state_dict_loader(bucket):
    sd = sample_state_dict(2)
    url = f"s3://{bucket}/ckpt"
    save(sd, url)
    for reader in (FsspecReader(url), dcpstore.ObjectStoreReader(url)):
        out = {}
        _load_state_dict(out, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        assert_state_dict_equal(out, sd)


def test_plans_and_flatten_mappings_live_side_by_side(bucket, s3):
    sd = sample_state_dict()
    save(sd, f"s3://{bucket}/ckpt")
    md = read_metadata_raw(s3, bucket, "ckpt")
    # DefaultSavePlanner's flatten mappings are still there, untouched...
    assert md.planner_data["model.embed.weight"] == ("model", "embed.weight")
    # ...and the plans sit beside them, as the rank made them.
    planner = DefaultSavePlanner()
    planner.set_up_planner(sd, is_coordinator=True)
    expected = planner.create_local_plan()
    plans = md.planner_data[dcpstore.ALL_LOCAL_PLANS_KEY]
    assert len(plans) == 1
    assert plans[0].items == expected.items and plans[0].planner_data == expected.planner_data
    assert dcpstore.read_plans(md) == plans
    assert set(md.planner_data[planner_data.CHECKSUMS_KEY]) == set(md.storage_data)


class OpaquePlanner(DefaultSavePlanner):
    """A user planner whose planner_data is not a dict."""

    def create_global_plan(self, all_plans):
        plans, md = super().create_global_plan(all_plans)
        return plans, dataclasses.replace(md, planner_data=("custom", 42))


def test_non_dict_planner_data_round_trips_unchanged(bucket, s3):
    sd = {"w": torch.arange(6.0)}
    url = f"s3://{bucket}/ckpt"
    save(sd, url, planner=OpaquePlanner(flatten_state_dict=False))
    raw = read_metadata_raw(s3, bucket, "ckpt")
    assert raw.planner_data[planner_data.USER_PLANNER_DATA_KEY] == ("custom", 42)
    reader = dcpstore.ObjectStoreReader(url)
    md = reader.read_metadata()
    assert md.planner_data == ("custom", 42)
    assert len(dcpstore.read_plans(md)) == 1
    assert_state_dict_equal(load({"w": torch.zeros(6)}, url), sd)


def test_existing_checkpoint_is_not_overwritten(bucket, s3):
    url = f"s3://{bucket}/ckpt"
    save({"w": torch.ones(4)}, url)
    before = s3.get_object(Bucket=bucket, Key="ckpt/.metadata")["Body"].read()
    with pytest.raises(BaseException, match=r"a committed checkpoint already exists.*overwrite=True"):
        save({"w": torch.zeros(4)}, url)
    assert s3.get_object(Bucket=bucket, Key="ckpt/.metadata")["Body"].read() == before
    assert torch.equal(load({"w": torch.zeros(4)}, url)["w"], torch.ones(4))


def test_overwrite_replaces_only_after_commit(bucket, s3, proxy):
    url = f"s3://{bucket}/ckpt"
    save({"w": torch.ones(4)}, url)
    # A failed overwrite: every shard upload is refused.
    proxy.add("PUT", r"\.distcp", status=403, code="AccessDenied")
    with pytest.raises(BaseException, match="access denied"):
        save({"w": torch.full((4,), 7.0)}, url, overwrite=True, storage_options={"endpoint_url": proxy.endpoint})
    assert torch.equal(load({"w": torch.zeros(4)}, url)["w"], torch.ones(4))
    proxy.clear()
    save({"w": torch.full((4,), 7.0)}, url, overwrite=True)
    assert torch.equal(load({"w": torch.zeros(4)}, url)["w"], torch.full((4,), 7.0))
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    assert not object_exists(s3, bucket, "ckpt/__0_0.distcp")  # old shards are gone
    assert len(keys) == 2  # .metadata + one new shard


def test_missing_metadata_is_incomplete_checkpoint(bucket, s3):
    url = f"s3://{bucket}/ckpt"
    save({"w": torch.ones(4)}, url)
    s3.delete_object(Bucket=bucket, Key="ckpt/.metadata")
    pattern = r"ckpt/\.metadata: no metadata object: incomplete or missing checkpoint"
    with pytest.raises(dcpstore.CheckpointNotFoundError, match=pattern):
        dcpstore.ObjectStoreReader(url).read_metadata()
    with pytest.raises(BaseException, match=pattern):  # dcp.load wraps it, message intact
        load({"w": torch.zeros(4)}, url)


def test_missing_bucket_on_load(moto_endpoint):
    with pytest.raises(dcpstore.BucketNotFoundError, match="bucket 'no-such-bucket-y' does not exist"):
        dcpstore.ObjectStoreReader("s3://no-such-bucket-y/ckpt").read_metadata()
    with pytest.raises(BaseException, match="bucket 'no-such-bucket-y' does not exist"):
        load({"w": torch.zeros(4)}, "s3://no-such-bucket-y/ckpt")


def _only_shard(s3, bucket):
    return next(o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"] if o["Key"].endswith(".distcp"))


def test_truncated_shard_is_named(bucket, s3):
    url = f"s3://{bucket}/ckpt"
    save({"w": torch.randn(1000)}, url, objects_per_rank=1)
    key = _only_shard(s3, bucket)
    body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    s3.put_object(Bucket=bucket, Key=key, Body=body[: len(body) // 2])
    with pytest.raises(BaseException, match=rf"{key}.*truncated"):
        load({"w": torch.zeros(1000)}, url)


def test_corrupted_shard_fails_checksum(bucket, s3):
    url = f"s3://{bucket}/ckpt"
    save({"w": torch.randn(1000)}, url, objects_per_rank=1)
    key = _only_shard(s3, bucket)
    body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    with pytest.raises(BaseException, match=rf"{key}.*checksum mismatch"):
        load({"w": torch.zeros(1000)}, url)


def test_state_dict_mismatch_is_clear(bucket):
    url = f"s3://{bucket}/ckpt"
    save({"w": torch.ones(4)}, url)
    md = dcpstore.ObjectStoreReader(url).read_metadata()
    from dcpstore.reader import check_state_dict

    with pytest.raises(dcpstore.StateDictMismatchError, match=r"keys missing from the checkpoint: v"):
        check_state_dict({"w": torch.zeros(4), "v": torch.zeros(1)}, md, url)
    with pytest.raises(dcpstore.StateDictMismatchError, match=r"w: \(4,\) in the checkpoint vs \(5,\)"):
        check_state_dict({"w": torch.zeros(5)}, md, url)
    with pytest.raises(BaseException, match="w"):
        load({"w": torch.zeros(5)}, url)


def test_storage_options_survive_reset(bucket, proxy):
    writer = dcpstore.ObjectStoreWriter(f"s3://{bucket}/a", storage_options={"endpoint_url": proxy.endpoint})
    dcp.save({"w": torch.ones(2)}, storage_writer=writer, checkpoint_id=f"s3://{bucket}/b", no_dist=True)
    assert writer.storage_options == {"endpoint_url": proxy.endpoint}
    assert any(path.startswith(f"/{bucket}/b/") for _, path in proxy.requests)


def test_async_save_with_our_writer(bucket):
    sd = sample_state_dict(3)
    url = f"s3://{bucket}/ckpt"
    fut = dcp.async_save(sd, storage_writer=dcpstore.ObjectStoreWriter(url), no_dist=True)
    (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
    assert_state_dict_equal(load(zeros_like_state_dict(sd), url), sd)


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_local_backends(scheme, tmp_path):
    url = f"memory://dcpstore-wr-{tmp_path.name}/ckpt" if scheme == "memory" else f"file://{tmp_path}/ckpt"
    sd = sample_state_dict(4)
    save(sd, url)
    assert_state_dict_equal(load(zeros_like_state_dict(sd), url), sd)


def test_use_collectives_false_is_refused(bucket):
    with pytest.raises(BaseException, match="use_collectives=False"):
        dcp.save({"w": torch.ones(2)}, storage_writer=dcpstore.ObjectStoreWriter(f"s3://{bucket}/c"), no_dist=True, use_collectives=False)


def test_metadata_unpickles_with_plain_pickle(bucket, s3):
    save(sample_state_dict(), f"s3://{bucket}/ckpt")
    body = s3.get_object(Bucket=bucket, Key="ckpt/.metadata")["Body"].read()
    assert b"dcpstore" not in body.replace(b"dcpstore/", b"")  # no dcpstore class is referenced
    assert pickle.loads(body).version
