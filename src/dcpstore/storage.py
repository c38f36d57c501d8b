"""The object store: every byte dcpstore moves goes through this module.

``ObjectStore`` wraps any fsspec filesystem (``file://``, ``memory://``, ...)
behind a small object-store vocabulary: put, ranged get, exists, list, delete,
and abort of incomplete multipart uploads.  ``S3ObjectStore`` implements the
same vocabulary for ``s3://`` directly on the aiobotocore client that s3fs
configures (credentials, endpoint, profile all come from s3fs and botocore as
usual), because checkpoint traffic needs three things s3fs's generic file API
does not give: parallel multipart uploads fed from reused buffers, one retry
policy that the caller controls, and errors that name the object.

Concurrency model: S3 requests run as coroutines on fsspec's I/O event loop
thread, so no request holds the GIL while it waits on the network; callers on
any thread get ``concurrent.futures.Future`` objects back.  Other filesystems
run their blocking calls on a small thread pool owned by the store.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import io
import itertools
import logging
import random
import threading
import time
from typing import Any, Callable, Iterable

import fsspec

from .errors import (
    BucketNotFoundError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    StorageAccessError,
    TransientStorageError,
)

logger = logging.getLogger(__name__)

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with full-jitter exponential backoff.

    Attempt ``n`` (0-based) that fails with a retryable error sleeps
    ``uniform(0, min(max_backoff, initial_backoff * 2**n))`` before the next,
    the scheme AWS recommends so that many ranks throttled at once do not
    retry in lockstep.
    """

    max_attempts: int = 5
    initial_backoff: float = 0.1
    max_backoff: float = 5.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")

    def backoff(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_backoff, self.initial_backoff * 2**attempt))


@dataclasses.dataclass(frozen=True)
class TransferConfig:
    """How objects move.  Defaults follow AWS guidance (8-16 MiB parts).

    Host memory used by uploads is bounded by
    ``(max_concurrency + number of open writers) * part_size``: part buffers
    are allocated once per store and reused.
    """

    part_size: int = 16 * MiB
    multipart_threshold: int = 16 * MiB
    max_concurrency: int = 16
    connect_timeout: float = 10.0
    read_timeout: float = 120.0
    retry: RetryPolicy = RetryPolicy()

    def __post_init__(self) -> None:
        if self.part_size < 5 * MiB:
            raise ValueError("part_size must be at least 5 MiB (the S3 minimum part size)")
        if self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    key: str  # relative to the store's root
    size: int
    last_modified: float | None = None  # seconds since the epoch


@dataclasses.dataclass(frozen=True)
class MultipartUploadInfo:
    key: str
    upload_id: str
    initiated: float | None = None


_stores: dict[tuple, "ObjectStore"] = {}
_stores_lock = threading.Lock()


def open_store(
    url: str,
    storage_options: dict[str, Any] | None = None,
    transfer: TransferConfig | None = None,
) -> "ObjectStore":
    """The store rooted at ``url``; the S3 implementation for ``s3://``.

    Stores are cached per process by (scheme, bucket, options, transfer), so a
    writer or reader per checkpoint reuses one connection pool, one set of
    part buffers and one credential lookup; ``url`` only picks the prefix.
    """
    url = str(url).rstrip("/")
    protocol, rest = fsspec.core.split_protocol(url)
    protocol = protocol or "file"
    if protocol in ("s3", "s3a"):
        bucket, _, prefix = rest.partition("/")
        base = f"{protocol}://{bucket}"
    else:  # no bucket to share a connection under: one store per URL
        base, prefix = url, ""
    key = (base, repr(sorted((storage_options or {}).items())), transfer)
    with _stores_lock:
        root = _stores.get(key)
        if root is None:
            root = _stores[key] = _new_store(base, storage_options, transfer)
    return root.child(prefix)


def _new_store(url: str, storage_options, transfer) -> "ObjectStore":
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError as e:
        raise ValueError(f"{url}: unknown URL scheme {protocol!r} ({e})") from None
    except ImportError as e:
        raise ValueError(f"{url}: the {protocol!r} filesystem needs a missing package ({e})") from None
    if protocol in ("s3", "s3a"):
        return S3ObjectStore(url, storage_options, transfer)
    return ObjectStore(url, storage_options, transfer)


class ObjectStore:
    """Object-store operations over a generic fsspec filesystem.

    Keys are '/'-separated and relative to the store's root URL.
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        transfer: TransferConfig | None = None,
    ):
        self.url = str(url).rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.transfer = transfer or TransferConfig()
        self.fs, self.root = self._connect()
        self.root = self.root.rstrip("/")
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.transfer.max_concurrency, thread_name_prefix="dcpstore-io"
        )

    def _connect(self):
        return _url_to_fs(self.url, self.storage_options)

    # -- naming ---------------------------------------------------------------

    def url_for(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def child(self, prefix: str) -> "ObjectStore":
        """A store rooted at ``prefix`` below this one, sharing its connection."""
        if not prefix.strip("/"):
            return self
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.url = self.url_for(prefix.strip("/"))
        clone.root = self._path(prefix.strip("/"))
        return clone

    # -- futures API (the primitives) --------------------------------------------

    def put_async(self, key: str, data) -> concurrent.futures.Future:
        return self._pool.submit(self._retrying, "PUT", key, lambda: self._put_blocking(key, data))

    def get_range_async(self, key: str, start: int, end: int) -> concurrent.futures.Future:
        """Bytes ``[start, end)`` of ``key``; raises ``CorruptCheckpointError`` if fewer exist."""
        return self._pool.submit(
            self._retrying, "GET", key, lambda: self._checked_range(key, start, end, self._get_blocking(key, start, end))
        )

    # -- blocking API ---------------------------------------------------------

    def put(self, key: str, data) -> None:
        self.put_async(key, data).result()

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.get_range_async(key, start, end).result()

    def get(self, key: str) -> bytes:
        return self.get_range(key, 0, self.size(key))

    def exists(self, key: str) -> bool:
        return self._retrying("HEAD", key, lambda: self.fs.exists(self._path(key)))

    def size(self, key: str) -> int:
        def op():
            try:
                return int(self.fs.size(self._path(key)))
            except FileNotFoundError:
                raise ObjectNotFoundError(f"{self.url_for(key)}: object does not exist") from None

        return self._retrying("HEAD", key, op)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object under ``prefix`` (recursively), sorted by key."""
        base = self._path(prefix.strip("/")) if prefix else self.root

        def op():
            if not self.fs.exists(base):
                return []
            found = self.fs.find(base, detail=True)
            return [
                ObjectInfo(
                    key=self._relative(path),
                    size=int(info.get("size") or 0),
                    last_modified=_mtime(info),
                )
                for path, info in found.items()
                if info.get("type", "file") != "directory"
            ]

        return sorted(self._retrying("LIST", prefix, op), key=lambda o: o.key)

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._retrying("DELETE", key, lambda k=key: self.fs.rm_file(self._path(k)))

    def list_multipart_uploads(self, prefix: str = "") -> list[MultipartUploadInfo]:
        """Open multipart uploads under ``prefix``; only object stores have them."""
        return []

    def abort_multipart_uploads(self, prefix: str = "", older_than: float | None = None) -> int:
        """Abort open multipart uploads under ``prefix`` (started before ``older_than``)."""
        aborted = 0
        for upload in self.list_multipart_uploads(prefix):
            if older_than is None or (upload.initiated or 0) < older_than:
                self.abort_upload(upload.key, upload.upload_id)
                aborted += 1
        return aborted

    def open_writer(self, key: str) -> "ObjectWriter":
        """A write-only stream; the object appears when ``close()`` returns."""
        return _BufferedObjectWriter(self, key)

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    # -- implementation hooks ----------------------------------------------------

    def _put_blocking(self, key: str, data) -> None:
        path = self._path(key)
        parent = path.rsplit("/", 1)[0]
        if parent and not self.fs.exists(parent):
            self.fs.makedirs(parent, exist_ok=True)
        self.fs.pipe_file(path, bytes(data))

    def _get_blocking(self, key: str, start: int, end: int) -> bytes:
        try:
            return self.fs.cat_file(self._path(key), start=start, end=end)
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{self.url_for(key)}: object does not exist") from None

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Abort one multipart upload; only object stores have them."""
        raise NotImplementedError

    def _relative(self, path: str) -> str:
        path = path.rstrip("/")
        root = self.root.lstrip("/")
        path_stripped = path.lstrip("/")
        if path_stripped.startswith(root):
            return path_stripped[len(root) :].lstrip("/")
        return path_stripped

    def _checked_range(self, key: str, start: int, end: int, data) -> bytes:
        if len(data) != end - start:
            raise CorruptCheckpointError(
                f"{self.url_for(key)}: object is truncated: expected bytes [{start}, {end}) "
                f"but only {len(data)} of {end - start} came back"
            )
        return data

    def _retrying(self, op: str, key: str, fn: Callable[[], Any]) -> Any:
        for attempt in itertools.count():
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - classified by _retry_delay
                time.sleep(self._retry_delay(op, key, attempt, e))

    def _retry_delay(self, op: str, key: str, attempt: int, exc: Exception) -> float:
        """How long to wait before retrying after ``exc``; raises when it is not worth it."""
        policy = self.transfer.retry
        if not is_retryable(exc):
            raise translate_error(exc, self.url_for(key)) from exc
        if attempt + 1 >= policy.max_attempts:
            raise _gave_up(op, self.url_for(key), attempt + 1, exc) from exc
        delay = policy.backoff(attempt)
        logger.info("%s %s failed (%s); retry %d in %.2fs", op, self.url_for(key), exc, attempt + 1, delay)
        return delay


class ObjectWriter:
    """A write-only, append-only object stream (what ``torch.save`` writes into)."""

    def write(self, data) -> int:
        raise NotImplementedError

    def tell(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        """Finish the upload; the object exists once this returns."""
        raise NotImplementedError

    def abort(self) -> None:
        """Drop the upload; no object and no parts are left behind."""
        raise NotImplementedError

    def __enter__(self) -> "ObjectWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # torch.save probes these on file-like objects
    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        pass


class _BufferedObjectWriter(ObjectWriter):
    """For filesystems without multipart uploads: buffer, then one put."""

    def __init__(self, store: ObjectStore, key: str):
        self._store, self._key = store, key
        self._buf = bytearray()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._buf += view
        return len(view)

    def tell(self) -> int:
        return len(self._buf)

    def close(self) -> None:
        self._store.put(self._key, self._buf)
        self._buf = bytearray()

    def abort(self) -> None:
        self._buf = bytearray()


# ---------------------------------------------------------------------------------------
# S3
# ---------------------------------------------------------------------------------------

_RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
    }
)
_ACCESS_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
    }
)


def _s3_defaults(transfer: TransferConfig) -> dict[str, Any]:
    """botocore settings under which dcpstore's own retry policy is the only one.

    botocore's retries are turned off so that attempts are bounded by
    ``RetryPolicy`` alone, timeouts are set on connect and read so nothing
    hangs, and the connection pool is large enough for ``max_concurrency``.
    """
    return {
        "retries": {"total_max_attempts": 1},
        "connect_timeout": transfer.connect_timeout,
        "read_timeout": transfer.read_timeout,
        "max_pool_connections": transfer.max_concurrency * 2,
        "request_checksum_calculation": "when_required",
        "response_checksum_validation": "when_required",
    }


class S3ObjectStore(ObjectStore):
    """The S3 store: parallel multipart uploads, ranged reads, one retry policy.

    Stores made by ``child`` share the s3fs instance, the part buffers and the
    in-flight budget of the store they came from.
    """

    def _connect(self):
        options = dict(self.storage_options)
        options["config_kwargs"] = {**_s3_defaults(self.transfer), **options.get("config_kwargs", {})}
        # A private instance: the botocore settings above must not leak into
        # s3fs instances that user code shares through fsspec's cache.
        options.setdefault("skip_instance_cache", True)
        fs, root = _url_to_fs(self.url, options)
        self._part_buffers: list[bytearray] = []
        self._part_buffers_lock = threading.Lock()
        self._inflight = threading.BoundedSemaphore(self.transfer.max_concurrency)
        return fs, root

    # -- plumbing ---------------------------------------------------------------

    def _split(self, key: str) -> tuple[str, str]:
        bucket, _, path = self._path(key).partition("/")
        return bucket, path

    async def _s3(self):
        return await self.fs.set_session()  # s3fs caches the client

    def _submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop)

    async def _call(self, op: str, key: str, method: str, **kwargs) -> Any:
        for attempt in itertools.count():
            try:
                client = await self._s3()
                return await getattr(client, method)(**kwargs)
            except Exception as e:  # noqa: BLE001 - classified by _retry_delay
                await asyncio.sleep(self._retry_delay(op, key, attempt, e))

    def _run(self, coro):
        return self._submit(coro).result()

    # -- primitives -------------------------------------------------------------

    def put_async(self, key: str, data) -> concurrent.futures.Future:
        bucket, path = self._split(key)
        return self._submit(self._call("PUT", key, "put_object", Bucket=bucket, Key=path, Body=_as_body(data)))

    def get_range_async(self, key: str, start: int, end: int) -> concurrent.futures.Future:
        return self._submit(self._get_range(key, start, end))

    async def _get_range(self, key: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        part = self.transfer.part_size
        if end - start <= 2 * part:
            return self._checked_range(key, start, end, await self._get_one(key, start, end))
        # Large items: concurrent sub-range GETs into one buffer.
        out = bytearray(end - start)

        async def fetch(lo: int) -> None:
            hi = min(lo + part, end)
            chunk = self._checked_range(key, lo, hi, await self._get_one(key, lo, hi))
            out[lo - start : hi - start] = chunk

        await asyncio.gather(*(fetch(lo) for lo in range(start, end, part)))
        return bytes(out)

    def get(self, key: str) -> bytes:
        # One GET, no HEAD first: a HEAD's 404 cannot tell a missing bucket from a missing key.
        return self._run(self._get_one(key, None, None))

    async def _get_one(self, key: str, start: int | None, end: int | None) -> bytes:
        bucket, path = self._split(key)
        ranged = {} if start is None else {"Range": f"bytes={start}-{end - 1}"}
        for attempt in itertools.count():
            resp = await self._call("GET", key, "get_object", Bucket=bucket, Key=path, **ranged)
            try:
                async with resp["Body"] as body:
                    return await body.read()
            except Exception as e:  # noqa: BLE001 - e.g. a connection reset while streaming the body
                await asyncio.sleep(self._retry_delay("GET", key, attempt, e))

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
            return True
        except ObjectNotFoundError:
            return False

    def size(self, key: str) -> int:
        bucket, path = self._split(key)
        resp = self._run(self._call("HEAD", key, "head_object", Bucket=bucket, Key=path))
        return int(resp["ContentLength"])

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self._run(self._list(prefix))

    async def _pages(self, op: str, prefix: str, method: str, continuation: dict[str, str]):
        """Every page of a paginated listing under ``prefix``.

        ``continuation`` maps each request parameter to the response field
        that carries its value for the next page.
        """
        bucket, path = self._split(prefix.strip("/"))
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": f"{path}/" if path else ""}
        while True:
            resp = await self._call(op, prefix, method, **kwargs)
            yield bucket, resp
            if not resp.get("IsTruncated"):
                return
            kwargs.update({param: resp.get(field) for param, field in continuation.items()})

    async def _list(self, prefix: str) -> list[ObjectInfo]:
        out = []
        async for bucket, resp in self._pages("LIST", prefix, "list_objects_v2", {"ContinuationToken": "NextContinuationToken"}):
            for obj in resp.get("Contents", []):
                modified = obj.get("LastModified")
                out.append(
                    ObjectInfo(
                        key=self._relative(f"{bucket}/{obj['Key']}"),
                        size=int(obj["Size"]),
                        last_modified=modified.timestamp() if modified else None,
                    )
                )
        return sorted(out, key=lambda o: o.key)

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            bucket = self._split(batch[0])[0]
            objects = [{"Key": self._split(k)[1]} for k in batch]
            resp = self._run(self._call("DELETE", batch[0], "delete_objects", Bucket=bucket, Delete={"Objects": objects, "Quiet": True}))
            if resp.get("Errors"):
                err = resp["Errors"][0]
                raise OSError(f"{self.url}/{err.get('Key')}: delete failed ({err.get('Code')}: {err.get('Message')})")

    def list_multipart_uploads(self, prefix: str = "") -> list[MultipartUploadInfo]:
        return self._run(self._list_uploads(prefix))

    async def _list_uploads(self, prefix: str) -> list[MultipartUploadInfo]:
        out = []
        continuation = {"KeyMarker": "NextKeyMarker", "UploadIdMarker": "NextUploadIdMarker"}
        async for bucket, resp in self._pages("LIST-UPLOADS", prefix, "list_multipart_uploads", continuation):
            for up in resp.get("Uploads", []):
                initiated = up.get("Initiated")
                out.append(
                    MultipartUploadInfo(
                        key=self._relative(f"{bucket}/{up['Key']}"),
                        upload_id=up["UploadId"],
                        initiated=initiated.timestamp() if initiated else None,
                    )
                )
        return out

    def abort_upload(self, key: str, upload_id: str) -> None:
        self._run(self._abort(key, upload_id))

    async def _abort(self, key: str, upload_id: str) -> None:
        bucket, path = self._split(key)
        try:
            await self._call("ABORT", key, "abort_multipart_upload", Bucket=bucket, Key=path, UploadId=upload_id)
        except ObjectNotFoundError:
            pass  # already completed or aborted

    def open_writer(self, key: str) -> ObjectWriter:
        return _MultipartObjectWriter(self, key)

    # -- multipart pieces used by the writer ---------------------------------------

    def _take_part_buffer(self) -> bytearray:
        with self._part_buffers_lock:
            if self._part_buffers:
                return self._part_buffers.pop()
        return bytearray(self.transfer.part_size)

    def _return_part_buffer(self, buf: bytearray) -> None:
        with self._part_buffers_lock:
            self._part_buffers.append(buf)


def _url_to_fs(url: str, options: dict[str, Any]):
    try:
        return fsspec.core.url_to_fs(url, **options)
    except (ValueError, ImportError) as e:
        raise ValueError(f"{url}: cannot open this URL ({e})") from None


class _MultipartObjectWriter(ObjectWriter):
    """Streams an object to S3 in parts while the producer keeps writing.

    Bytes land in reused ``part_size`` buffers.  A full buffer is uploaded as a
    part in the background (at most ``max_concurrency`` parts in flight per
    store, which is the backpressure that bounds host memory).  Parts are sent
    as memoryviews of those buffers, so no per-part copy is made.  An object
    that never fills one part goes up as a single PUT.  Any failure aborts the
    multipart upload, so no orphaned parts remain.
    """

    def __init__(self, store: S3ObjectStore, key: str):
        self._store, self._key = store, key
        self._bucket, self._path = store._split(key)
        self._buf: bytearray | None = None
        self._fill = 0
        self._pos = 0
        self._upload_id: str | None = None
        self._parts: list[concurrent.futures.Future] = []
        self._closed = False

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        size = self._store.transfer.part_size
        written = 0
        while written < len(view):
            if self._buf is None:
                self._buf = self._store._take_part_buffer()
                self._fill = 0
            n = min(size - self._fill, len(view) - written)
            self._buf[self._fill : self._fill + n] = view[written : written + n]
            self._fill += n
            written += n
            if self._fill == size:
                self._flush_part()
        self._pos += written
        return written

    def tell(self) -> int:
        return self._pos

    def _flush_part(self) -> None:
        if self._upload_id is None:
            resp = self._store._run(
                self._store._call("CREATE-MPU", self._key, "create_multipart_upload", Bucket=self._bucket, Key=self._path)
            )
            self._upload_id = resp["UploadId"]
        buf, fill = self._buf, self._fill
        self._buf, self._fill = None, 0
        number = len(self._parts) + 1
        self._store._inflight.acquire()
        fut = self._store._submit(
            self._store._call(
                "UPLOAD-PART",
                self._key,
                "upload_part",
                Bucket=self._bucket,
                Key=self._path,
                UploadId=self._upload_id,
                PartNumber=number,
                Body=_as_body(memoryview(buf)[:fill]),
            )
        )

        def release(_f, buf=buf):
            self._store._inflight.release()
            self._store._return_part_buffer(buf)

        fut.add_done_callback(release)
        self._parts.append(fut)
        # Surface a failed part early instead of streaming the rest of the object.
        for done in self._parts:
            if done.done() and done.exception() is not None:
                done.result()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._upload_id is None:
                body = memoryview(self._buf)[: self._fill] if self._buf is not None else b""
                try:
                    self._store.put(self._key, body)
                finally:
                    self._release_current()
                return
            if self._fill:
                self._flush_part()
            etags = [f.result()["ETag"] for f in self._parts]
            self._store._run(
                self._store._call(
                    "COMPLETE-MPU",
                    self._key,
                    "complete_multipart_upload",
                    Bucket=self._bucket,
                    Key=self._path,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]},
                )
            )
        except BaseException:
            self._abort_upload()
            raise

    def abort(self) -> None:
        self._closed = True
        self._abort_upload()

    def _release_current(self) -> None:
        if self._buf is not None:
            self._store._return_part_buffer(self._buf)
            self._buf = None

    def _abort_upload(self) -> None:
        self._release_current()
        for f in self._parts:
            try:
                f.result()
            except Exception:  # noqa: BLE001 - the first error is already propagating
                pass
        if self._upload_id is not None:
            try:
                self._store.abort_upload(self._key, self._upload_id)
            except Exception as e:  # noqa: BLE001
                logger.warning("could not abort multipart upload of %s: %s", self._store.url_for(self._key), e)


# ---------------------------------------------------------------------------------------
# error classification, shared by both stores
# ---------------------------------------------------------------------------------------


def _error_code(exc: BaseException) -> tuple[str | None, int | None, str]:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, None, str(exc)
    error = response.get("Error", {}) or {}
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return error.get("Code"), status, error.get("Message") or str(exc)


def is_retryable(exc: BaseException) -> bool:
    """Throttling, 5xx, connection resets and timeouts are worth another try."""
    code, status, _ = _error_code(exc)
    if code is not None or status is not None:
        return code in _RETRYABLE_CODES or (status is not None and status >= 500)
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    try:
        import aiohttp
        import botocore.exceptions as bce
    except ImportError:  # pragma: no cover - s3fs brings both
        return False
    return isinstance(
        exc,
        (
            aiohttp.ClientConnectionError,
            aiohttp.ClientPayloadError,
            bce.ConnectionError,
            bce.HTTPClientError,
            bce.IncompleteReadError,
            bce.ResponseStreamingError,
        ),
    )


def translate_error(exc: BaseException, url: str) -> BaseException:
    """Turn a store error into the dcpstore exception that names ``url``."""
    if isinstance(exc, (ObjectNotFoundError, StorageAccessError, CorruptCheckpointError, TransientStorageError)):
        return exc
    code, status, message = _error_code(exc)
    if code == "NoSuchBucket":
        bucket = url.split("://", 1)[-1].split("/", 1)[0]
        return BucketNotFoundError(f"{url}: bucket {bucket!r} does not exist")
    if code in ("NoSuchKey", "NoSuchUpload", "404") or status == 404 or isinstance(exc, FileNotFoundError):
        return ObjectNotFoundError(f"{url}: object does not exist")
    if code in _ACCESS_CODES or status == 403 or isinstance(exc, PermissionError):
        return StorageAccessError(
            f"{url}: access denied ({code or 'PermissionError'}: {message}); "
            "check the AWS credentials and the bucket policy"
        )
    if code == "InvalidRange" or status == 416:
        return CorruptCheckpointError(f"{url}: object is truncated: the requested bytes lie past its end")
    if code is not None:
        return OSError(f"{url}: {code}: {message}")
    return exc


def _gave_up(op: str, url: str, attempts: int, exc: BaseException) -> TransientStorageError:
    code, status, message = _error_code(exc)
    cause = f"{code} (HTTP {status}): {message}" if code else f"{type(exc).__name__}: {exc}"
    return TransientStorageError(f"{op} {url} failed after {attempts} attempt(s): {cause}")


class _ViewReader(io.RawIOBase):
    """A seekable, read-only file over a memoryview.

    botocore takes ``bytes``, ``bytearray`` or a file as a request body, and
    slicing either of the first two copies.  Handing it this reader instead
    sends a part of a staged buffer with no copy of the part.
    """

    def __init__(self, view: memoryview):
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), len(self._view) - self._pos)
        b[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, min(len(self._view), base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return len(self._view)


def _as_body(data) -> bytes | bytearray | _ViewReader:
    if isinstance(data, (bytes, bytearray)):
        return data
    return _ViewReader(memoryview(data).cast("B"))


def _mtime(info: dict) -> float | None:
    value = info.get("mtime") or info.get("LastModified") or info.get("created")
    if value is None:
        return None
    if hasattr(value, "timestamp"):
        return value.timestamp()
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
