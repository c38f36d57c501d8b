"""The storage layer against a real moto server over HTTP, and local fsspec stores."""

import os
import socket
import threading
import time

import pytest

import dcpstore
from dcpstore import (
    BucketNotFoundError,
    ConditionalWriteError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    RetryPolicy,
    StorageAccessError,
    TransferConfig,
    TransientStorageError,
    UnsupportedByStoreError,
)
from dcpstore.storage import S3ObjectStore, open_store
from s3server import MotoServer, free_port

MiB = 1 << 20
SMALL_PARTS = TransferConfig(part_size=5 * MiB, max_concurrency=4)


@pytest.mark.also_rgw
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


@pytest.mark.also_rgw
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


@pytest.mark.parametrize("total_parts", [0.5, 3.4], ids=["one-put", "multipart"])
def test_lent_and_copied_writes_make_parts_of_pieces_across_boundaries(bucket, s3, total_parts):
    """What a shard is: headers copied, a tensor's data lent (sent from its own memory), boundaries anywhere."""
    store = open_store(f"s3://{bucket}/lend", transfer=SMALL_PARTS)
    data = os.urandom(int(total_parts * 5 * MiB))
    cuts = sorted({0, len(data), *(int(len(data) * f) for f in (0.01, 0.3, 0.3001, 0.62, 0.9))})
    with store.open_writer("obj") as w:
        for n, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
            piece = memoryview(data)[lo:hi]
            if n % 2:
                owner = bytearray(piece)  # the lent memory: what the writer must keep alive
                assert w.write_lent(memoryview(owner), owner) == hi - lo
                del owner
            else:
                assert w.write(piece) == hi - lo
        assert w.tell() == len(data)
    etag = s3.head_object(Bucket=bucket, Key="lend/obj")["ETag"].strip('"')
    assert ("-" in etag) == (total_parts > 1)
    assert store.get_range("obj", 0, len(data)) == data


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


@pytest.mark.also_rgw
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


@pytest.mark.also_rgw
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


@pytest.mark.also_rgw
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


@pytest.mark.also_rgw
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


def test_a_server_that_stops_reading_the_body_does_not_hang_a_put(bucket):
    """A full Ceph OSD stops reading request bodies; the socket timeouts never fire then."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []
    stop = threading.Event()

    def accept_and_never_read():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    threading.Thread(target=accept_and_never_read, daemon=True).start()
    try:
        store = open_store(
            f"s3://{bucket}/stall",
            storage_options={"endpoint_url": f"http://127.0.0.1:{listener.getsockname()[1]}"},
            transfer=TransferConfig(
                connect_timeout=1, read_timeout=1, min_send_rate=64 << 20,
                retry=RetryPolicy(max_attempts=2, initial_backoff=0.01),
            ),
        )
        with pytest.raises(TransientStorageError, match="failed after 2 attempt"):
            store.put("big", bytearray(64 << 20))  # far more than the socket buffers hold
        store.close()
    finally:
        stop.set()
        for conn in accepted:
            conn.close()
        listener.close()


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


@pytest.mark.rgw
def test_wrong_secret_key_on_rgw(rgw_gateway):
    """RGW checks S3 signatures (only the cluster's own auth is off): a wrong secret is denied, named."""
    import uuid

    import boto3

    server = rgw_gateway
    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3", endpoint_url=server.endpoint, aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key
    ).create_bucket(Bucket=name)
    options = {"endpoint_url": server.endpoint, "key": server.access_key, "secret": "wrong-secret"}
    store = open_store(f"s3://{name}/p", storage_options=options)
    with pytest.raises(StorageAccessError, match=rf"s3://{name}/p/k: access denied") as info:
        store.put("k", b"1")
    assert isinstance(info.value, PermissionError)
    with pytest.raises(StorageAccessError, match=rf"s3://{name}/p/k: access denied"):
        store.get("k")


# -- retries resend whole bodies, per request, classified by code -----------------------------

FAST_RETRY = TransferConfig(
    part_size=5 * MiB,
    max_concurrency=4,
    read_timeout=20,
    retry=RetryPolicy(max_attempts=4, initial_backoff=0.01),
)


def _via_proxy(bucket, proxy, prefix, transfer=FAST_RETRY):
    return open_store(f"s3://{bucket}/{prefix}", storage_options={"endpoint_url": proxy.endpoint}, transfer=transfer)


@pytest.mark.parametrize("make_body", [bytes, bytearray, memoryview], ids=["bytes", "bytearray", "memoryview"])
def test_retried_put_resends_the_whole_body(bucket, proxy, make_body):
    """A reused body stream would resume at its end and time out on every retry."""
    rule = proxy.add("PUT", r"/body$", status=503, code="SlowDown", times=1)
    store = _via_proxy(bucket, proxy, "rb")
    data = os.urandom(300_000)
    store.put("body", make_body(data))
    assert rule.hits == 1
    assert store.get("body") == data


@pytest.mark.also_rgw(part=2)
@pytest.mark.parametrize("part", [1, 2, 3])
def test_a_failed_part_is_retried_alone(bucket, proxy, part):
    """The first attempt of part N gets a 503; only that part is sent again."""
    rule = proxy.add("PUT", rf"partNumber={part}$", status=503, code="SlowDown", times=1)
    store = _via_proxy(bucket, proxy, "pr")
    data = os.urandom(12 * MiB + 5)
    with store.open_writer("streamed") as w:  # streamed as torch.save writes: small pieces
        for i in range(0, len(data), 1 << 20):
            w.write(memoryview(data)[i : i + (1 << 20)])
    assert rule.hits == 1
    part_puts = [p for m, p in proxy.requests if m == "PUT" and "partNumber=" in p]
    assert len(part_puts) == 4  # 3 parts + 1 retry; the upload was not restarted
    assert sum("uploads" in p for m, p in proxy.requests if m == "POST") == 1
    assert store.get("streamed") == data


def test_second_attempt_failing_too_is_still_bounded(bucket, proxy):
    rule = proxy.add("PUT", r"partNumber=2$", status=500, code="InternalError", after=0, times=2)
    store = _via_proxy(bucket, proxy, "p2")
    data = os.urandom(11 * MiB)
    with store.open_writer("obj") as w:
        w.write(data)
    assert rule.hits == 2
    assert store.get("obj") == data


def test_not_implemented_is_not_retried(bucket, proxy):
    rule = proxy.add("GET", r"uploads", status=501, code="NotImplemented")
    store = _via_proxy(bucket, proxy, "ni")
    with pytest.raises(UnsupportedByStoreError, match="does not implement"):
        store.list_multipart_uploads()
    assert rule.hits == 1


def test_client_errors_are_not_retried(bucket, proxy):
    rule = proxy.add("PUT", r"/denied$", status=403, code="AccessDenied")
    store = _via_proxy(bucket, proxy, "ce")
    with pytest.raises(StorageAccessError, match="denied"):
        store.put("denied", b"x")
    assert rule.hits == 1


@pytest.mark.also_rgw
def test_truncated_get_body_is_retried(bucket, proxy):
    store = _via_proxy(bucket, proxy, "tg")
    data = os.urandom(200_000)
    store.put("obj", data)
    rule = proxy.add("GET", r"/obj$", truncate=True, times=1)
    assert store.get_range("obj", 10, 150_000) == data[10:150_000]
    assert rule.hits == 1


def test_create_multipart_upload_with_a_lost_response_leaks_nothing(bucket, proxy, s3):
    rule = proxy.add("POST", r"\?uploads", drop_response=True, times=1)
    store = _via_proxy(bucket, proxy, "lc")
    data = os.urandom(6 * MiB)
    with store.open_writer("obj") as w:
        w.write(data)
    assert rule.hits == 1
    assert s3.list_multipart_uploads(Bucket=bucket, Prefix="lc/").get("Uploads", []) == []
    assert store.get("obj") == data


@pytest.mark.also_rgw
def test_complete_multipart_upload_with_a_lost_success_succeeds(bucket, proxy):
    rule = proxy.add("POST", r"uploadId=", drop_response=True, times=1)
    store = _via_proxy(bucket, proxy, "lm")
    data = os.urandom(6 * MiB)
    with store.open_writer("obj") as w:
        w.write(data)
    assert rule.hits == 1
    assert store.get("obj") == data


# -- conditional writes -------------------------------------------------------------------


def _stores_for_conditions(bucket, tmp_path):
    return [open_store(f"s3://{bucket}/cw"), open_store(f"file://{tmp_path}/cw"), open_store("memory://dcpstore-cw/x")]


@pytest.mark.also_rgw
def test_if_none_match_refuses_an_existing_object(bucket, tmp_path):
    for store in _stores_for_conditions(bucket, tmp_path):
        store.put("m", b"first", if_none_match=True)
        with pytest.raises(ConditionalWriteError, match=r"/m: .*exist"):
            store.put("m", b"second", if_none_match=True)
        assert store.get("m") == b"first", store.url


@pytest.mark.also_rgw
def test_if_match_replaces_only_the_version_read(bucket, tmp_path):
    for store in _stores_for_conditions(bucket, tmp_path):
        store.put("v", b"one")
        _, tag = store.get_with_etag("v")
        store.put("v", b"two", if_match=tag)
        with pytest.raises(ConditionalWriteError):
            store.put("v", b"three", if_match=tag)  # someone (we) changed it since
        assert store.get("v") == b"two", store.url


@pytest.mark.also_rgw
def test_conditional_put_after_a_lost_response_is_a_success(bucket, proxy):
    rule = proxy.add("PUT", r"/meta$", drop_response=True, times=1)
    store = _via_proxy(bucket, proxy, "cl")
    store.put("meta", b"ours", if_none_match=True)
    assert rule.hits == 1
    store.put("other", b"x")
    with pytest.raises(ConditionalWriteError):
        store.put("other", b"not ours", if_none_match=True)


def test_server_without_conditional_writes_falls_back_to_a_check(bucket, proxy):
    proxy.add("PUT", r"/nc$", status=501, code="NotImplemented", times=1)
    store = _via_proxy(bucket, proxy, "nc")
    store.put("nc", b"1", if_none_match=True)
    assert store.get("nc") == b"1"


def test_local_commit_is_atomic_and_leaves_no_temporary_files(tmp_path):
    store = open_store(f"file://{tmp_path}/at")
    store.put("step/.metadata", b"m", if_none_match=True)
    with pytest.raises(ConditionalWriteError):
        store.put("step/.metadata", b"n", if_none_match=True)
    assert sorted(os.listdir(tmp_path / "at" / "step")) == [".metadata"]


# -- URLs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["s3://", "s3:///", "s3:///prefix", "s3a://"])
def test_s3_url_without_bucket_is_refused(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="needs a bucket"):
        open_store(url)
    assert not dcpstore.ObjectStoreWriter.validate_checkpoint_id(url)
    assert not dcpstore.ObjectStoreReader.validate_checkpoint_id(url)
    assert os.listdir(tmp_path) == []


def test_a_short_ranged_answer_is_retried(bucket, proxy):
    """A 206 whose body is shorter than its range (under an honest Content-Length) is retried like a reset."""
    store = _via_proxy(bucket, proxy, "short")
    data = os.urandom(1 << 20)
    store.put("obj", data)
    rule = proxy.add("GET", r"/short/obj$", short=True, times=1)
    assert bytes(store.get_range("obj", 1000, 600_000)) == data[1000:600_000]
    assert rule.hits == 1


def test_an_object_shorter_than_its_range_is_corrupt_at_once(bucket, proxy):
    store = _via_proxy(bucket, proxy, "short")
    store.put("obj", b"x" * 1000)
    proxy.requests.clear()
    with pytest.raises(CorruptCheckpointError, match=r"/short/obj: object is truncated: it holds 1000 bytes"):
        store.get_range("obj", 0, 5000)
    assert sum(1 for m, p in proxy.requests if m == "GET") == 1  # not retried: no retry brings the bytes


def _failed_save_with_abort_faults(bucket, proxy, prefix, abort_failures):
    """A streamed upload whose part 2 always fails, and whose abort fails ``abort_failures`` times."""
    proxy.add("PUT", rf"/{prefix}/obj\?.*partNumber=2", status=500, code="InternalError")
    abort = proxy.add("DELETE", rf"/{prefix}/obj\?uploadId=", status=500, code="InternalError", times=abort_failures)
    transfer = TransferConfig(part_size=5 * MiB, max_concurrency=2, retry=RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.05))
    store = _via_proxy(bucket, proxy, prefix, transfer)
    with pytest.raises(TransientStorageError):
        with store.open_writer("obj") as w:
            w.write(os.urandom(11 * MiB))
    return store, abort


def test_a_failed_abort_is_retried_until_no_upload_is_left_open(bucket, proxy):
    store, abort = _failed_save_with_abort_faults(bucket, proxy, "abort-later", abort_failures=3)
    store.settle_aborts()  # what ObjectStoreWriter.close() does
    assert abort.hits == 3  # the save's 2 attempts, one background round, then it went through
    assert store.list_multipart_uploads() == []


def test_an_upload_that_cannot_be_aborted_is_named_with_the_gc_command(bucket, proxy, caplog):
    store, abort = _failed_save_with_abort_faults(bucket, proxy, "abort-never", abort_failures=None)
    with caplog.at_level("WARNING", logger="dcpstore.storage.s3"):
        store.settle_aborts()
    (upload,) = store.list_multipart_uploads()
    assert f"s3://{bucket}/abort-never/obj: multipart upload {upload.upload_id} could not be aborted" in caplog.text
    assert f"`dcpstore gc s3://{bucket}/abort-never`" in caplog.text


# -- coherence with fsspec's cached filesystems ---------------------------------------------


@pytest.mark.parametrize("writer", ["dcpstore", "fsspec"])
def test_fsspecs_cached_listing_sees_what_a_save_writes_and_a_delete_removes(writer, bucket):
    """List, save, list; list, delete, list, in one process: the fsspec instance user code shares sees both.

    ``writer="fsspec"`` is the reference: torch's FsspecWriter writes through that very instance.
    """
    import fsspec
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    import dcpstore
    from dcpstore.layout import delete_committed_step

    fs = fsspec.filesystem("s3")
    fs.ls(bucket)  # cached: the bucket is empty
    url = f"s3://{bucket}/lst/ck"
    storage_writer = dcpstore.ObjectStoreWriter(url) if writer == "dcpstore" else FsspecWriter(url)
    dcp.save({"w": torch.arange(4.0)}, storage_writer=storage_writer, no_dist=True)
    assert f"{bucket}/lst" in fs.ls(bucket)
    assert f"{bucket}/lst/ck/.metadata" in fs.ls(f"{bucket}/lst/ck")
    if writer == "fsspec":
        return
    store = open_store(f"s3://{bucket}/lst")
    try:
        delete_committed_step(store, "ck")
    finally:
        store.close()
    assert not fs.exists(f"{bucket}/lst/ck/.metadata")
    assert f"{bucket}/lst" not in fs.ls(bucket)


# -- the client follows the environment ------------------------------------------------------


def test_a_changed_endpoint_or_credential_environment_reaches_the_next_store_and_old_clients_are_freed(
    bucket, proxy, monkeypatch
):
    """AWS_ENDPOINT_URL to a second server (the proxy) and back, in one process; then new credentials.

    fsspec's instance cache keys on options only, so a cached client would
    keep the first endpoint.  Each store gets a client made under the
    current environment, and a client no open store uses is freed.
    """
    import gc
    import weakref

    from dcpstore.storage import s3_requests as s3_module

    url = f"s3://{bucket}/env"

    def put_through_a_new_store(name: str):
        store = open_store(url)
        store.put(name, b"x")
        fs = weakref.ref(store.fs)
        store.close()
        return fs

    first = put_through_a_new_store("direct-1")
    assert not proxy.requests
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    second = put_through_a_new_store("via-proxy")
    assert second() is not first()
    assert [m for m, path in proxy.requests if path.endswith("/env/via-proxy")] == ["PUT"]
    monkeypatch.undo()
    proxy.clear()
    third = put_through_a_new_store("direct-2")
    assert not proxy.requests
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "another-key")  # moto takes any key: only the client may change
    fourth = put_through_a_new_store("new-key")
    assert fourth() is not third()
    gc.collect()
    assert second() is None and third() is None  # no store uses them: freed ("first" may be an earlier test's)
    assert id(fourth()) in s3_module._servers and len(s3_module._servers) <= len(s3_module._filesystems)


def test_a_conditional_delete_leaves_an_object_rewritten_since_it_was_listed(bucket, s3, proxy):
    """``delete_if_unchanged``: each object goes only while its ETag is the one listed (S3's ``ETag`` element in ``DeleteObjects``)."""
    store = open_store(f"s3://{bucket}/d", storage_options={"endpoint_url": proxy.endpoint})
    for key in ("a", "b", "c"):
        store.put(key, key.encode())
    listed = {o.key: o.etag for o in store.list()}
    assert all(listed.values())
    s3.put_object(Bucket=bucket, Key="d/b", Body=b"rewritten")
    s3.delete_object(Bucket=bucket, Key="d/c")  # gone already: deleted all the same
    assert store.delete_if_unchanged(listed) == ["b"]
    assert [o.key for o in store.list()] == ["b"] and store.get("b") == b"rewritten"
    assert store.delete_if_unchanged({"b": listed["b"]}) == ["b"]  # alone in its request: answered without the server
    store.close()


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_a_conditional_delete_on_a_filesystem(scheme, tmp_path):
    store = open_store(f"file://{tmp_path}/d" if scheme == "file" else "memory://cond-delete/d")
    store.put("a", b"a")
    store.put("b", b"b")
    tags = {o.key: o.etag for o in store.list()}  # a filesystem's listing: size and modification time
    assert all(tags.values())
    store.put("b", b"rewritten")  # another size (and time)
    assert store.delete_if_unchanged(tags) == ["b"]
    assert [o.key for o in store.list()] == ["b"]
    store.close()


def test_a_create_answered_5xx_that_lands_later_leaves_no_upload_open_after_close(bucket, s3, proxy):
    """A gateway's 500 to CreateMultipartUpload, which the store completes later: the retry's upload is used, and the other is aborted at close.

    The adversary's "upload left open after close()" (tests/model, interactions F x S): the look for
    leaked uploads ran before the late create landed.
    """
    proxy.add("POST", r"\.distcp\?uploads", status=500, code="InternalError", lands_after=0.2, times=1)
    store = open_store(f"s3://{bucket}/x", storage_options={"endpoint_url": proxy.endpoint},
                       transfer=TransferConfig(part_size=5 << 20, multipart_threshold=5 << 20))
    with store.open_writer("a.distcp", create_only=True) as out:
        out.write(bytes(6 << 20))
    while sum(1 for method, path, _ in proxy.landed if method == "POST" and path.endswith("?uploads")) < 2:
        time.sleep(0.05)  # the late create has landed: a second open upload of the key
    store.settle_aborts()  # what a writer's close() does
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert s3.get_object(Bucket=bucket, Key="x/a.distcp")["ContentLength"] == 6 << 20
    store.close()
