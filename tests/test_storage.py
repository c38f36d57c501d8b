"""The storage layer against a real moto server over HTTP, and local fsspec stores."""

import os
import time

import pytest

from dcpstore import (
    BucketNotFoundError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    RetryPolicy,
    StorageAccessError,
    TransferConfig,
    TransientStorageError,
)
from dcpstore.storage import S3ObjectStore, open_store
from s3server import MotoServer, free_port

MiB = 1 << 20
SMALL_PARTS = TransferConfig(part_size=5 * MiB, multipart_threshold=5 * MiB, max_concurrency=4)


def test_put_get_list_delete(bucket):
    store = open_store(f"s3://{bucket}/root")
    assert isinstance(store, S3ObjectStore)
    store.put("a/x", b"hello world")
    assert store.get_range("a/x", 6, 11) == b"world"
    assert store.size("a/x") == 11
    assert store.exists("a/x") and not store.exists("a/y")
    store.put("b", memoryview(bytearray(b"12345")))
    assert [o.key for o in store.list()] == ["a/x", "b"]
    store.delete(["a/x"])
    assert [o.key for o in store.list()] == ["b"]


def test_multipart_upload_streams_parts_and_reassembles(bucket, s3):
    store = open_store(f"s3://{bucket}/mp", transfer=SMALL_PARTS)
    data = os.urandom(17 * MiB + 3)
    with store.open_writer("big") as w:
        for i in range(0, len(data), 3 * MiB + 1):  # writes straddle part boundaries
            w.write(data[i : i + 3 * MiB + 1])
        assert w.tell() == len(data)
    head = s3.head_object(Bucket=bucket, Key="mp/big")
    assert head["ContentLength"] == len(data)
    assert head["ETag"].strip('"').endswith("-4")  # 4 parts: 5+5+5+2 MiB
    assert store.get_range("big", 0, len(data)) == data  # concurrent sub-range GETs
    assert store.get_range("big", 5 * MiB - 2, 5 * MiB + 2) == data[5 * MiB - 2 : 5 * MiB + 2]


def test_small_object_uses_single_put(bucket, s3):
    store = open_store(f"s3://{bucket}/sp", transfer=SMALL_PARTS)
    with store.open_writer("small") as w:
        w.write(b"x" * 1000)
    assert "-" not in s3.head_object(Bucket=bucket, Key="sp/small")["ETag"]


def test_failed_multipart_is_aborted(bucket, s3):
    store = open_store(f"s3://{bucket}/ab", transfer=SMALL_PARTS)
    with pytest.raises(RuntimeError):
        with store.open_writer("obj") as w:
            w.write(os.urandom(11 * MiB))
            raise RuntimeError("producer failed")
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket, Prefix="ab/")


def test_abort_multipart_uploads_under_prefix(bucket, s3):
    s3.create_multipart_upload(Bucket=bucket, Key="run/step_1/__0_0.distcp")
    s3.create_multipart_upload(Bucket=bucket, Key="other/x")
    store = open_store(f"s3://{bucket}/run")
    assert [u.key for u in store.list_multipart_uploads()] == ["step_1/__0_0.distcp"]
    assert store.abort_multipart_uploads() == 1
    assert [u["Key"] for u in s3.list_multipart_uploads(Bucket=bucket)["Uploads"]] == ["other/x"]


def test_truncated_range_is_an_error_naming_the_object(bucket):
    store = open_store(f"s3://{bucket}/t")
    store.put("obj", b"abc")
    with pytest.raises(CorruptCheckpointError, match=f"s3://{bucket}/t/obj.*truncated"):
        store.get_range("obj", 0, 10)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        store.get_range("obj", 5, 10)


def test_missing_object_and_bucket(bucket):
    with pytest.raises(ObjectNotFoundError, match=f"s3://{bucket}/m/nope"):
        open_store(f"s3://{bucket}/m").get("nope")
    t0 = time.monotonic()
    with pytest.raises(BucketNotFoundError, match="bucket 'no-such-bucket-x' does not exist"):
        open_store("s3://no-such-bucket-x/p").put("k", b"1")
    assert time.monotonic() - t0 < 10


def test_unknown_scheme():
    with pytest.raises(ValueError, match="unknown URL scheme 'nosuch'"):
        open_store("nosuch://bucket/x")


@pytest.mark.parametrize("url", ["memory://dcpstore-test/root", "file://{tmp}/root"])
def test_local_fsspec_stores(url, tmp_path):
    store = open_store(url.format(tmp=tmp_path))
    with store.open_writer("d/obj") as w:
        w.write(b"abc")
        w.write(memoryview(b"def"))
    assert store.get_range("d/obj", 2, 5) == b"cde"
    assert [o.key for o in store.list()] == ["d/obj"]
    with pytest.raises(CorruptCheckpointError):
        store.get_range("d/obj", 0, 100)
    store.delete(["d/obj"])
    assert store.list() == []


def test_retries_503_slowdown_then_succeeds(bucket, proxy):
    rule = proxy.add("PUT", r"/retry-me$", status=503, code="SlowDown", times=2)
    store = open_store(
        f"s3://{bucket}/r",
        storage_options={"endpoint_url": proxy.endpoint},
        transfer=TransferConfig(retry=RetryPolicy(max_attempts=4, initial_backoff=0.01)),
    )
    store.put("retry-me", b"payload")
    assert rule.hits == 2
    assert store.get("retry-me") == b"payload"


def test_retries_are_bounded(bucket, proxy):
    rule = proxy.add("PUT", r"/always-busy$", status=503, code="SlowDown")
    store = open_store(
        f"s3://{bucket}/r",
        storage_options={"endpoint_url": proxy.endpoint},
        transfer=TransferConfig(retry=RetryPolicy(max_attempts=3, initial_backoff=0.01)),
    )
    with pytest.raises(TransientStorageError, match=r"always-busy failed after 3 attempt.*SlowDown"):
        store.put("always-busy", b"x")
    assert rule.hits == 3


def test_connection_reset_is_retried(bucket, proxy):
    rule = proxy.add("GET", r"/flaky", reset=True, times=1)
    store = open_store(
        f"s3://{bucket}/r",
        storage_options={"endpoint_url": proxy.endpoint},
        transfer=TransferConfig(retry=RetryPolicy(max_attempts=3, initial_backoff=0.01)),
    )
    store.put("flaky", b"data")
    assert store.get_range("flaky", 0, 4) == b"data"
    assert rule.hits == 1


def test_unreachable_endpoint_fails_within_seconds(bucket):
    store = open_store(
        f"s3://{bucket}/u",
        storage_options={"endpoint_url": f"http://127.0.0.1:{free_port()}"},
        transfer=TransferConfig(connect_timeout=1, retry=RetryPolicy(max_attempts=2, initial_backoff=0.01)),
    )
    t0 = time.monotonic()
    with pytest.raises(TransientStorageError, match="failed after 2 attempt"):
        store.put("k", b"1")
    assert time.monotonic() - t0 < 10


def test_wrong_credentials(moto_endpoint):
    """A moto server that enforces IAM auth rejects unknown keys: PermissionError, named."""
    server = MotoServer(env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        store = open_store(
            "s3://some-bucket/p",
            storage_options={"endpoint_url": server.endpoint, "key": "AKIAWRONG", "secret": "wrong"},
        )
        with pytest.raises(StorageAccessError, match=r"s3://some-bucket/p/k: access denied") as info:
            store.put("k", b"1")
        assert isinstance(info.value, PermissionError)
    finally:
        server.stop()
