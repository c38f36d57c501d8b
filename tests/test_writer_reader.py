"""ObjectStoreWriter / ObjectStoreReader under plain dcp.save / dcp.load, one process."""

import copy
import dataclasses
import pickle
import re
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

import dcpstore
from conftest import read_metadata_raw
from dcpstore import planner_data
from helpers import assert_state_dict_equal, sample_state_dict, zeros_like_state_dict


def save(sd, url, **kwargs):
    planner = kwargs.pop("planner", None)
    return dcp.save(sd, storage_writer=dcpstore.ObjectStoreWriter(url, **kwargs), planner=planner, no_dist=True)


def load(sd, url, **kwargs):
    dcp.load(sd, storage_reader=dcpstore.ObjectStoreReader(url, **kwargs), no_dist=True)
    return sd


@pytest.mark.also_rgw
def test_round_trip_bit_exact(bucket, s3):
    sd = sample_state_dict()
    url = f"s3://{bucket}/ckpt"
    save(sd, url)
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"])
    assert keys[0] == "ckpt/.metadata"
    assert all(k.startswith("ckpt/__0_") and k.endswith(".distcp") for k in keys[1:])
    assert_state_dict_equal(load(zeros_like_state_dict(sd), url), sd)


@pytest.mark.also_rgw
def test_round_trip_mixed_sizes_and_dtypes(bucket, s3):
    """Tiny to multipart-sized items, every common dtype, a 0-d tensor and bytes: back bit-exact."""
    g = torch.Generator().manual_seed(7)
    sd = {
        "big": torch.randn(3 << 20, generator=g),  # 12 MiB: a multipart object at 5 MiB parts
        "u8": torch.randint(0, 256, (6 << 20,), generator=g, dtype=torch.uint8),
        "f16": torch.randn(123, generator=g).half(),
        "bf16": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "f64": torch.randn(1000, generator=g, dtype=torch.float64),
        "i8": torch.randint(-128, 128, (1,), generator=g, dtype=torch.int8),
        "i32": torch.randint(-(2**31), 2**31 - 1, (9, 3), generator=g, dtype=torch.int32),
        "mask": torch.rand(7, generator=g) > 0.5,
        "c64": torch.randn(10, generator=g, dtype=torch.complex64),
        "scalar": torch.tensor(3, dtype=torch.int64),
        "strided": torch.randn(40, 30, generator=g).t(),  # non-contiguous
        "meta": {"step": 42, "name": "run-7"},
        "blob": b"\x00\xff" * 1000,
    }
    url = f"s3://{bucket}/mixed"
    save(sd, url, objects_per_rank=2, transfer=dcpstore.TransferConfig(part_size=5 << 20))
    tags = [s3.head_object(Bucket=bucket, Key=k)["ETag"] for k in _keys(s3, bucket, "mixed/__")]
    assert any("-" in t for t in tags), tags  # at least one object went up in parts
    out = zeros_like_state_dict(sd)
    out["strided"] = torch.zeros(30, 40)
    assert_state_dict_equal(load(out, url), sd)


@pytest.mark.also_rgw
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
    assert planner_data.PLANS_KEY in md.planner_data  # the compact form
    plans = dcpstore.read_plans(md)
    assert len(plans) == 1
    assert plans[0].items == expected.items and plans[0].planner_data == expected.planner_data
    # One crc32 an item, as one fixed-width array in storage_data's order.
    assert planner_data.CHECKSUMS_KEY not in md.planner_data
    assert len(md.planner_data[planner_data.CRC32_ARRAY_KEY]) == 4 * len(md.storage_data)
    assert set(planner_data.read_checksums(md)) == set(md.storage_data)


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


@pytest.mark.also_rgw
def test_existing_checkpoint_is_not_overwritten(bucket, s3):
    url = f"s3://{bucket}/ckpt"
    save({"w": torch.ones(4)}, url)
    before = s3.get_object(Bucket=bucket, Key="ckpt/.metadata")["Body"].read()
    with pytest.raises(BaseException, match=r"Checkpoint already exists.*overwrite=True"):
        save({"w": torch.zeros(4)}, url)
    assert s3.get_object(Bucket=bucket, Key="ckpt/.metadata")["Body"].read() == before
    assert torch.equal(load({"w": torch.zeros(4)}, url)["w"], torch.ones(4))


@pytest.mark.also_rgw
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
    assert keys[0] == "ckpt/.metadata"
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


@pytest.mark.also_rgw
def test_missing_bucket_on_load(endpoint):
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


@pytest.mark.also_rgw
def test_a_metadata_body_cut_short_in_transit_is_read_again_and_one_short_in_storage_is_corrupt(bucket, s3, proxy):
    """A 200 whose body and Content-Length a middlebox cut in half looks whole: the object's size in its answer tells."""
    url = f"s3://{bucket}/ckpt"
    sd = sample_state_dict()
    save(sd, url)
    via_proxy = {"storage_options": {"endpoint_url": proxy.endpoint}}
    cut = proxy.add("GET", r"/ckpt/\.metadata$", short=True, times=2)
    assert_state_dict_equal(load(zeros_like_state_dict(sd), url, **via_proxy), sd)
    assert cut.hits == 2  # both cut answers were read again, not parsed
    # Short in storage itself: no retry brings the missing bytes back, and the error says what it is.
    body = s3.get_object(Bucket=bucket, Key="ckpt/.metadata")["Body"].read()
    s3.put_object(Bucket=bucket, Key="ckpt/.metadata", Body=body[: len(body) // 2])
    with pytest.raises(BaseException, match=r"ckpt/\.metadata: cannot unpickle the metadata"):
        load(zeros_like_state_dict(sd), url, **via_proxy)


@pytest.mark.also_rgw
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
    from dcpstore.metadata_reading import check_state_dict

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


@pytest.mark.also_rgw
def test_async_save_with_our_writer(bucket):
    sd = sample_state_dict(3)
    url = f"s3://{bucket}/ckpt"
    fut = dcp.async_save(sd, storage_writer=dcpstore.ObjectStoreWriter(url), no_dist=True)
    (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
    assert_state_dict_equal(load(zeros_like_state_dict(sd), url), sd)


def test_a_staged_copy_that_is_still_held_keeps_its_memory(bucket):
    """``ObjectStoreWriter.stage`` (what ``dcp.async_save`` calls): reused memory serves one staged copy at a time.

    A copy still held (its save uploading, or a failed save's traceback
    holding it) is never overwritten by the next stage: that one gets other
    memory.  Dropped, its memory is reused.
    """
    sd = sample_state_dict(3)
    writer = dcpstore.ObjectStoreWriter(f"s3://{bucket}/ckpt")
    first = writer.stage(sd)
    expected = copy.deepcopy(sd)
    for t in sd["model"].values():
        t.add_(1)
    second = writer.stage(sd)
    assert_state_dict_equal(first, expected)  # untouched by the second stage
    assert_state_dict_equal(second, sd)
    memory = first["model"]["embed.weight"].data_ptr()
    assert second["model"]["embed.weight"].data_ptr() != memory
    del first
    third = writer.stage(sd)
    assert third["model"]["embed.weight"].data_ptr() == memory
    del second, third
    assert len(writer._free_staging) == 2
    writer.close()
    assert writer._free_staging == []


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


# -- integrity: per-save shard names, conditional commit, overwrite ------------------------------


def _keys(s3, bucket, prefix=""):
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


def _shard_writes(proxy) -> list[str]:
    """The shard names the proxy saw created: each single PUT and each multipart upload begun (not its parts)."""
    return [path.split("?")[0] for method, path in proxy.requests
            if ".distcp" in path and (method == "PUT" and "partNumber=" not in path or method == "POST" and "?uploads" in path)]


def test_a_reused_writer_without_checkpoint_ids_writes_no_name_twice_and_a_failed_save_loses_nothing(bucket, s3, proxy):
    """Three saves through one writer, no checkpoint_id (torch then never calls ``reset``): the third fails mid-write.

    It fails after one of its two shards landed; save 2 still loads
    bit-exact with dcpstore and with stock ``FsspecReader``, and no shard
    name was ever written twice.
    """
    url = f"s3://{bucket}/ckpt"
    writer = dcpstore.ObjectStoreWriter(url, overwrite=True, objects_per_rank=2, storage_options={"endpoint_url": proxy.endpoint})
    state = lambda v: {"a": torch.full((1000,), v), "b": torch.full((1000,), -v)}  # noqa: E731 - two items: two shards
    for value in (1.0, 2.0):
        dcp.save(state(value), storage_writer=writer, no_dist=True)
    committed = {k: s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in _keys(s3, bucket)}
    proxy.add("PUT", r"\.distcp", status=403, code="AccessDenied", after=1)  # the save's second shard is refused
    with pytest.raises(BaseException, match="access denied"):
        dcp.save(state(3.0), storage_writer=writer, no_dist=True)
    writes = _shard_writes(proxy)
    assert len(writes) == 2 * 3 and len(set(writes)) == len(writes), writes
    assert {k: s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in committed} == committed
    for reader in (dcpstore.ObjectStoreReader(url), FsspecReader(url)):
        got = {"a": torch.zeros(1000), "b": torch.zeros(1000)}
        dcp.load(got, storage_reader=reader, no_dist=True)
        assert_state_dict_equal(got, state(2.0))


@pytest.mark.also_rgw
def test_a_shard_name_already_taken_fails_the_save_loudly_and_overwrites_nothing(bucket, s3, endpoint, s3_server):
    """Shards are written with ``If-None-Match: *`` (one PUT, and a multipart upload's completion): a second writer of one name is refused.

    Ceph RGW 16.2 ignores the condition on a completion (docs/development.md): there, only the single PUT is checked.
    """
    store = dcpstore.storage.open_store(f"s3://{bucket}/x", storage_options={"endpoint_url": endpoint},
                                        transfer=dcpstore.TransferConfig(part_size=5 << 20, multipart_threshold=5 << 20))
    sizes = (("small.distcp", 10),) + ((("large.distcp", 6 << 20),) if s3_server == "moto" else ())
    for key, size in sizes:
        s3.put_object(Bucket=bucket, Key=f"x/{key}", Body=b"committed")
        with pytest.raises(dcpstore.ConditionalWriteError, match=rf"x/{key}: conditional write refused"):
            with store.open_writer(key, create_only=True) as out:
                out.write(bytes(size))
        assert s3.get_object(Bucket=bucket, Key=f"x/{key}")["Body"].read() == b"committed"
    assert not s3.list_multipart_uploads(Bucket=bucket).get("Uploads")  # the refused upload was aborted
    store.close()


@pytest.mark.parametrize("size", [10, 6 << 20], ids=["put", "multipart"])
def test_a_create_only_write_whose_answer_was_lost_is_ours_on_the_retry(bucket, s3, proxy, size):
    """The retry of a shard PUT (or completion) that landed unseen is refused (412); one HEAD finds our token, and the write succeeded."""
    store = dcpstore.storage.open_store(f"s3://{bucket}/x", storage_options={"endpoint_url": proxy.endpoint},
                                        transfer=dcpstore.TransferConfig(part_size=5 << 20, multipart_threshold=5 << 20))
    method = "PUT" if size == 10 else "POST"
    rule = proxy.add(method, r"/x/lost\.distcp($|\?uploadId=)", drop_response=True, times=1)
    with store.open_writer("lost.distcp", create_only=True) as out:
        out.write(bytes([7]) * size)
    assert rule.hits == 1
    assert s3.get_object(Bucket=bucket, Key="x/lost.distcp")["Body"].read() == bytes([7]) * size
    store.close()


def test_overwrite_never_deletes_nested_checkpoints(bucket, s3):
    save({"w": torch.ones(4)}, f"s3://{bucket}/run")
    save({"w": torch.full((4,), 5.0)}, f"s3://{bucket}/run/step_00000001")
    save({"w": torch.zeros(4)}, f"s3://{bucket}/run", overwrite=True)
    nested = load({"w": torch.zeros(4)}, f"s3://{bucket}/run/step_00000001")["w"]
    assert torch.equal(nested, torch.full((4,), 5.0))
    top = [k for k in _keys(s3, bucket, "run/") if "/" not in k[len("run/") :]]
    assert len(top) == 2  # .metadata + the new shard; the replaced shard is gone


class _RacingWriter(dcpstore.ObjectStoreWriter):
    """Runs a whole other job's save to the same prefix while this one uploads."""

    def __init__(self, url, rival, **kwargs):
        super().__init__(url, **kwargs)
        self.rival = rival

    def write_data(self, plan, planner):
        if self.rival is not None:
            self.rival()
            self.rival = None
        return super().write_data(plan, planner)


@pytest.mark.also_rgw
def test_two_jobs_on_one_prefix_exactly_one_commits(bucket, s3):
    url = f"s3://{bucket}/ckpt"
    rival = lambda: save({"w": torch.full((100,), 9.0)}, url)  # noqa: E731
    rival_keys = []

    def rival_and_record():
        rival()
        rival_keys.extend(_keys(s3, bucket))

    writer = _RacingWriter(url, rival_and_record)
    with pytest.raises(BaseException, match=r"ckpt/\.metadata: Checkpoint already exists"):
        dcp.save({"w": torch.full((100,), 1.0)}, storage_writer=writer, no_dist=True)
    assert torch.equal(load({"w": torch.zeros(100)}, url)["w"], torch.full((100,), 9.0))
    assert _keys(s3, bucket) == rival_keys  # the loser deleted the shards it wrote


@pytest.mark.also_rgw
def test_overwrite_does_not_replace_a_commit_it_has_not_seen(bucket, s3):
    url = f"s3://{bucket}/ckpt"
    save({"w": torch.ones(10)}, url)
    rival = lambda: save({"w": torch.full((10,), 9.0)}, url, overwrite=True)  # noqa: E731
    writer = _RacingWriter(url, rival, overwrite=True)
    with pytest.raises(BaseException, match="changed since this save read it"):
        dcp.save({"w": torch.full((10,), 2.0)}, storage_writer=writer, no_dist=True)
    assert torch.equal(load({"w": torch.zeros(10)}, url)["w"], torch.full((10,), 9.0))
    assert len(_keys(s3, bucket)) == 2  # the rival's .metadata and shard


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_two_jobs_on_one_local_prefix(scheme, tmp_path):
    url = f"file://{tmp_path}/ckpt" if scheme == "file" else f"memory://dcpstore-race-{tmp_path.name}/ckpt"
    writer = _RacingWriter(url, lambda: save({"w": torch.full((10,), 9.0)}, url))
    with pytest.raises(BaseException, match="Checkpoint already exists"):
        dcp.save({"w": torch.ones(10)}, storage_writer=writer, no_dist=True)
    assert torch.equal(load({"w": torch.zeros(10)}, url)["w"], torch.full((10,), 9.0))


@pytest.mark.also_rgw
def test_missing_bucket_on_multipart_save_is_named(endpoint):
    big = {"w": torch.zeros(6 << 20, dtype=torch.uint8)}  # above one 5 MiB part
    transfer = dcpstore.TransferConfig(part_size=5 << 20)
    with pytest.raises(BaseException, match="bucket 'no-such-bucket-z' does not exist"):
        save(big, "s3://no-such-bucket-z/ckpt", transfer=transfer)


def _original_error(exc_info) -> BaseException:
    """The rank's own exception inside torch's CheckpointException (as the README shows)."""
    ((error, _traceback),) = exc_info.value.failures.values()
    return error


@pytest.mark.also_rgw
@pytest.mark.parametrize("op", ["save", "load"])
def test_plain_dcp_reports_a_missing_bucket_with_our_error(op, endpoint):
    from torch.distributed.checkpoint.api import CheckpointException

    url = "s3://no-such-bucket-dcp/ckpt"
    with pytest.raises(CheckpointException) as e:
        (save if op == "save" else load)({"w": torch.zeros(4)}, url)
    if op == "save":
        error = _original_error(e)
        assert isinstance(error, dcpstore.BucketNotFoundError)
        assert "s3://no-such-bucket-dcp/ckpt/" in str(error) and "does not exist" in str(error)
    else:  # torch reports the load's metadata failure as text
        assert "s3://no-such-bucket-dcp/ckpt/.metadata: bucket 'no-such-bucket-dcp' does not exist" in str(e.value)


def test_plain_dcp_reports_an_unreachable_endpoint_with_our_error():
    from torch.distributed.checkpoint.api import CheckpointException

    from dcpstore.local_s3 import free_port

    options = {"endpoint_url": f"http://127.0.0.1:{free_port()}"}  # nothing listens there
    with pytest.raises(CheckpointException) as e:
        save({"w": torch.zeros(4)}, "s3://b/ckpt", storage_options=options)
    error = _original_error(e)
    assert isinstance(error, dcpstore.TransientStorageError)
    assert "s3://b/ckpt/.metadata" in str(error) and "Could not connect" in str(error)


def test_plain_dcp_save_names_the_key_of_an_unpicklable_value(bucket):
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as e:
        save({"w": torch.zeros(4), "optim": {"schedule": lambda step: 0.1}}, f"s3://{bucket}/ckpt")
    error = _original_error(e)
    assert isinstance(error, dcpstore.UnpicklableValueError) and "'optim.schedule'" in str(error)


def test_zstd_extension_interop_both_ways(bucket, s3):
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    sd = sample_state_dict(3)
    sd["model"]["zeros"] = torch.zeros(4096)  # compresses: the transform really ran
    ours = f"s3://{bucket}/ours"
    save(sd, ours, _extensions=[ZStandard()])
    stored = read_metadata_raw(s3, bucket, "ours").storage_data
    assert all(info.transform_descriptors == ["stream.zstd/1"] for info in stored.values())
    zeros = next(info for index, info in stored.items() if index.fqn == "model.zeros")
    assert zeros.length < 4096 * 4 // 10
    assert_state_dict_equal(load(zeros_like_state_dict(sd), ours), sd)
    theirs_loaded = zeros_like_state_dict(sd)
    dcp.load(theirs_loaded, storage_reader=FsspecReader(ours), no_dist=True)
    assert_state_dict_equal(theirs_loaded, sd)

    theirs = f"s3://{bucket}/theirs"
    dcp.save(sd, storage_writer=FsspecWriter(theirs, _extensions=[ZStandard()]), no_dist=True)
    assert_state_dict_equal(load(zeros_like_state_dict(sd), theirs), sd)


def test_an_unknown_stream_extension_is_a_clear_error(bucket, s3):
    from torch.distributed.checkpoint.api import CheckpointException

    url = f"s3://{bucket}/ckpt"
    sd = {"w": torch.arange(8.0)}
    save(sd, url)
    metadata = read_metadata_raw(s3, bucket, "ckpt")
    for info in metadata.storage_data.values():
        info.transform_descriptors = ["stream.rot13/1"]
    s3.put_object(Bucket=bucket, Key="ckpt/.metadata", Body=pickle.dumps(metadata))
    with pytest.raises(CheckpointException) as e:
        load({"w": torch.zeros(8)}, url, verify_checksums=False)
    error = _original_error(e)
    assert isinstance(error, dcpstore.CorruptCheckpointError)
    assert "stream.rot13/1" in str(error) and "Unknown extension" in str(error)


def test_a_failed_load_writes_nothing_into_the_state_dict_once_it_has_raised(bucket, s3, proxy):
    """Tensors land in place as their bytes arrive; a load that fails must stop every fetch before it raises.

    Item ``a`` is corrupted and fails its checksum while ``b``'s GET is still
    held at the proxy; the caller then reuses ``b`` (say, to load an older
    step) and no late byte of the failed load may land in it.
    """
    url = f"s3://{bucket}/ckpt"
    save({"a": torch.full((1000,), 1.0), "b": torch.full((1000,), 2.0)}, url, objects_per_rank=2)
    reader = dcpstore.ObjectStoreReader(url, storage_options={"endpoint_url": proxy.endpoint})
    stored = {index.fqn: info for index, info in reader.read_metadata().storage_data.items()}
    assert stored["a"].relative_path != stored["b"].relative_path
    key_a = f"ckpt/{stored['a'].relative_path}"
    body = bytearray(s3.get_object(Bucket=bucket, Key=key_a)["Body"].read())
    body[stored["a"].offset + stored["a"].length // 2] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key_a, Body=bytes(body))
    held = proxy.add("GET", re.escape(stored["b"].relative_path), delay=1.0, times=1)

    dest = {"a": torch.zeros(1000), "b": torch.zeros(1000)}
    with pytest.raises(BaseException, match="checksum mismatch"):
        dcp.load(dest, storage_reader=reader, no_dist=True)
    dest["b"].fill_(-7.0)
    assert held.answered.wait(timeout=120)
    # A late write would land within moments of the answer; its absence can only be watched for.
    watch_until = time.monotonic() + 2.0
    while time.monotonic() < watch_until and torch.equal(dest["b"], torch.full((1000,), -7.0)):
        time.sleep(0.05)
    assert torch.equal(dest["b"], torch.full((1000,), -7.0))


def test_tied_destinations_load_the_item_that_comes_last(bucket, s3):
    """Two keys on one tensor (tied weights): neither item lands where the other writes, so neither looks corrupted."""
    url = f"s3://{bucket}/ckpt"
    sd = {"emb": torch.randn(1000), "head": torch.randn(1000)}
    save(sd, url, objects_per_rank=1)
    tied = torch.zeros(1000)
    load({"emb": tied, "head": tied}, url)
    assert torch.equal(tied, sd["head"]) or torch.equal(tied, sd["emb"])


def test_code_written_for_torchs_fsspec_classes_runs_with_their_arguments(bucket, s3, endpoint):
    """FsspecWriter's and FsspecReader's keywords, each mapped or accepted; .fs; a reader that pickles."""
    import fsspec
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    sd = sample_state_dict()
    url = f"s3://{bucket}/ckpt"
    writer = dcpstore.ObjectStoreWriter(
        url, thread_count=2, sync_files=False, single_file_per_rank=True, per_thread_copy_ahead=1 << 20,
        overwrite=False, endpoint_url=endpoint,  # a storage option, as FsspecWriter's **kwargs
    )
    assert writer.objects_per_rank == 2 and writer.storage_options == {"endpoint_url": endpoint}
    assert writer.fs is fsspec.filesystem("s3", endpoint_url=endpoint)  # fsspec's shared instance, as FsspecWriter.fs
    dcp.save(sd, storage_writer=writer, no_dist=True)
    shards = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="ckpt/__")["Contents"]}
    assert len(shards) == 2  # thread_count: objects a rank writes at once
    reader = pickle.loads(pickle.dumps(dcpstore.ObjectStoreReader(url, endpoint_url=endpoint)))
    out = zeros_like_state_dict(sd)
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert_state_dict_equal(out, sd)
    with pytest.raises(ValueError, match="torch.save only"):
        dcpstore.ObjectStoreWriter(url, serialization_format=SerializationFormat.SAFETENSORS)
    with pytest.raises(ValueError, match="not both"):
        dcpstore.ObjectStoreWriter(url, objects_per_rank=2, thread_count=2)


@pytest.mark.parametrize("cls,typo", [(dcpstore.ObjectStoreWriter, "comit_window"), (dcpstore.ObjectStoreReader, "readahead")])
def test_a_mistyped_keyword_fails_and_names_the_valid_ones(cls, typo, bucket):
    """Any other keyword is a storage option (as FsspecWriter's are), but fsspec takes any keyword: a typo would vanish."""
    with pytest.raises(TypeError, match=rf"{cls.__name__} got unexpected keyword argument\(s\) '{typo}': .*commit_window|readahead_bytes") as e:
        cls(f"s3://{bucket}/ckpt", **{typo: 1})
    assert "endpoint_url" in str(e.value) and "profile" in str(e.value)  # the storage options it does take
    cls(f"s3://{bucket}/ckpt", use_ssl=False, default_block_size=1 << 20).reset()  # real s3fs options still pass


@pytest.mark.parametrize("cls", [dcpstore.ObjectStoreWriter, dcpstore.ObjectStoreReader, dcpstore.AsyncCheckpointer])
def test_a_mistyped_storage_option_fails_at_construction_and_names_the_valid_ones(cls, bucket):
    """Issue 57: a typo inside ``storage_options={...}`` failed only at the first request, with an ``AioSession`` ``TypeError``."""
    with pytest.raises(TypeError, match=rf"{cls.__name__}\(storage_options=...\) got unexpected key\(s\) 'endpont_url': .*endpoint_url"):
        cls(f"s3://{bucket}/ckpt", storage_options={"endpont_url": "http://127.0.0.1:1"})
