"""Nothing corrupt lands silently: a failed crc32 is fetched once more, then named with its destination's fate (issue 26)."""

import pytest
import torch

from test_writer_reader import load, save

import dcpstore

MiB = 1 << 20


def _saved(bucket, s3) -> tuple[str, dict, str]:
    """A checkpoint of one whole 1 MiB tensor (landed in place on load) and the key of its shard."""
    url = f"s3://{bucket}/ckpt"
    sd = {"w": torch.arange(MiB // 4, dtype=torch.float32)}
    save(sd, url)
    (shard,) = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="ckpt/__")["Contents"]]
    return url, sd, shard


def _corrupt_in_storage(s3, bucket, key):
    body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF  # inside the tensor's data
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))


def _shard_gets(proxy, shard):
    return sum(1 for m, p in proxy.requests if m == "GET" and shard.split("/")[-1] in p)


def test_bytes_damaged_in_transit_are_fetched_once_more(bucket, s3, proxy):
    url, sd, shard = _saved(bucket, s3)
    proxy.add("GET", shard.split("/")[-1], corrupt=True, times=1)
    out = load({"w": torch.zeros(MiB // 4)}, url, storage_options={"endpoint_url": proxy.endpoint})
    assert torch.equal(out["w"], sd["w"])
    assert _shard_gets(proxy, shard) == 2


def test_bytes_corrupt_in_storage_name_the_tensor_that_holds_them(bucket, s3, proxy):
    """Landed in place (the default): the error says which tensor now holds unverified bytes."""
    url, sd, shard = _saved(bucket, s3)
    _corrupt_in_storage(s3, bucket, shard)
    reader = dcpstore.ObjectStoreReader(url, storage_options={"endpoint_url": proxy.endpoint})
    with pytest.raises(BaseException) as e:  # torch's CheckpointException around ours
        torch.distributed.checkpoint.load({"w": torch.zeros(MiB // 4)}, storage_reader=reader, no_dist=True)
    assert "checksum mismatch on two fetches" in str(e.value)
    assert "the tensor 'w' now holds these unverified bytes" in str(e.value)
    assert _shard_gets(proxy, shard) == 2


def test_verify_before_landing_keeps_the_destination_as_it_was(bucket, s3, proxy):
    url, sd, shard = _saved(bucket, s3)
    _corrupt_in_storage(s3, bucket, shard)
    before = torch.full((MiB // 4,), 7.0)
    dest = {"w": before.clone()}
    reader = dcpstore.ObjectStoreReader(url, storage_options={"endpoint_url": proxy.endpoint}, verify_before_landing=True)
    with pytest.raises(BaseException) as e:
        torch.distributed.checkpoint.load(dest, storage_reader=reader, no_dist=True)
    assert "its destination keeps its old contents" in str(e.value)
    assert torch.equal(dest["w"], before)


def test_verify_before_landing_loads_a_sound_checkpoint(bucket, s3):
    url, sd, _ = _saved(bucket, s3)
    assert torch.equal(load({"w": torch.zeros(MiB // 4)}, url, verify_before_landing=True)["w"], sd["w"])
