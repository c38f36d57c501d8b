"""The reader fetches many small items with few ranged GETs (``stored_items.coalesce``)."""

import uuid

import boto3
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo

import dcpstore
from dcpstore.stored_items import coalesce

N_SMALL = 3000  # optimizer-state shaped: many 1 KiB tensors


def small_tensors(n: int) -> dict:
    g = torch.Generator().manual_seed(n)
    return {f"state.{i}": torch.randn(256, generator=g) for i in range(n)}  # 1 KiB each


def shard_gets(proxy) -> list[str]:
    return [path for method, path in proxy.requests if method == "GET" and ".distcp" in path]


@pytest.fixture(scope="module")
def saved_small(moto_endpoint):
    """One save of N_SMALL tensors for the module (3 s of serializing them); each test reads a copy of its own."""
    sd = small_tensors(N_SMALL)
    source = f"test-small-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=source)
    dcp.save(sd, storage_writer=dcpstore.ObjectStoreWriter(f"s3://{source}/small"), no_dist=True)
    return sd, source


@pytest.fixture
def small_checkpoint(saved_small, bucket, proxy, s3):
    sd, source = saved_small
    for o in s3.list_objects_v2(Bucket=source, Prefix="small/")["Contents"]:
        s3.copy_object(Bucket=bucket, Key=o["Key"], CopySource={"Bucket": source, "Key": o["Key"]})
    proxy.clear()
    return sd, f"s3://{bucket}/small", {"endpoint_url": proxy.endpoint}


def test_thousands_of_small_tensors_take_one_get_per_object(small_checkpoint, proxy, s3, bucket):
    sd, url, options = small_checkpoint
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=dcpstore.ObjectStoreReader(url, storage_options=options), no_dist=True)
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    objects = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="small/")["Contents"] if o["Key"].endswith(".distcp")]
    gets = shard_gets(proxy)
    assert len(gets) == len(objects), gets  # N_SMALL items, one GET per shard object


def test_a_partial_load_reads_each_needed_item_exactly(small_checkpoint, proxy):
    sd, url, options = small_checkpoint
    wanted = {k: torch.zeros_like(v) for i, (k, v) in enumerate(sd.items()) if i % 3 == 0}
    dcp.load(wanted, storage_reader=dcpstore.ObjectStoreReader(url, storage_options=options), no_dist=True)
    assert all(torch.equal(wanted[k], sd[k]) for k in wanted)
    assert len(shard_gets(proxy)) <= 8


def test_a_corrupted_item_in_a_coalesced_range_is_named(small_checkpoint, s3, bucket):
    sd, url, _ = small_checkpoint
    reader = dcpstore.ObjectStoreReader(url)
    info = reader.read_metadata().storage_data
    index, victim = next((i, s) for i, s in info.items() if i.fqn == "state.1234")
    key = f"small/{victim.relative_path}"
    body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[victim.offset + victim.length - 5] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    with pytest.raises(CheckpointException) as e:
        dcp.load(out, storage_reader=reader, no_dist=True)
    ((failure, _traceback),) = e.value.failures.values()
    assert isinstance(failure, dcpstore.CorruptCheckpointError)
    assert "state.1234" in str(failure) and "checksum mismatch" in str(failure)


def info(key: str, offset: int, length: int) -> tuple:
    return _StorageInfo(key, offset, length), (key, offset)


def spans(ranges) -> list[tuple]:
    return [(r.key, r.start, r.end, [extra for _, extra in r.items]) for r in ranges]


def test_coalesce_merges_close_items_per_object_and_keeps_first_seen_order():
    items = [info("b", 0, 10), info("a", 100, 10), info("a", 0, 10), info("a", 15, 5), info("b", 10, 10)]
    got = spans(coalesce(items, gap_bytes=4, max_bytes=1 << 20))
    assert got == [
        ("b", 0, 20, [("b", 0), ("b", 10)]),
        ("a", 0, 20, [("a", 0), ("a", 15)]),  # gap 5 > 4 but <= the 10 bytes already needed
        ("a", 100, 110, [("a", 100)]),  # gap 80: not worth reading
    ]


def test_coalesce_reads_an_object_whole_when_most_of_it_is_needed():
    items = [info("a", 0, 600), info("a", 1000, 600)]  # a 400-byte hole, 1,200 useful
    assert spans(coalesce(items, gap_bytes=0, max_bytes=1 << 20)) == [("a", 0, 1600, [("a", 0), ("a", 1000)])]


def test_coalesce_bounds_a_range_by_max_bytes():
    items = [info("a", i * 10, 10) for i in range(10)] + [info("a", 100, 500)]
    got = spans(coalesce(items, gap_bytes=1 << 20, max_bytes=30))
    assert [(s, e) for _, s, e, _ in got] == [(0, 30), (30, 60), (60, 90), (90, 100), (100, 600)]


