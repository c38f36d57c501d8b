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
import hashlib
import io
import itertools
import logging
import os
import random
import threading
import time
import uuid
from typing import Any, Callable, Iterable

import fsspec

from .errors import (
    BucketNotFoundError,
    DcpstoreError,
    ConditionalWriteError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    StorageAccessError,
    TransientStorageError,
    UnsupportedByStoreError,
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

_S3_SCHEMES = ("s3", "s3a")


def normalize_url(url: str | os.PathLike) -> str:
    """``url`` without trailing slashes; ``ValueError`` when it names no store location.

    Checked before stripping: ``"s3://"`` stripped is ``"s3:"``, which fsspec
    would take for a local folder of that name.
    """
    text = str(url)
    protocol, rest = fsspec.core.split_protocol(text)
    if protocol in _S3_SCHEMES and not rest.partition("/")[0]:
        raise ValueError(f"{text!r}: an S3 URL needs a bucket: s3://BUCKET/PREFIX")
    if protocol is not None and not rest.strip("/"):
        raise ValueError(f"{text!r}: the URL names no location after {protocol}://")
    return text.rstrip("/")


def is_store_url(url: str | os.PathLike) -> bool:
    """Whether ``url`` is a URL (``scheme://...``) that names a store location."""
    if "://" not in str(url):
        return False
    try:
        normalize_url(url)
    except ValueError:
        return False
    return True


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
    url = normalize_url(url)
    protocol, rest = fsspec.core.split_protocol(url)
    protocol = protocol or "file"
    if protocol in _S3_SCHEMES:
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
    if protocol in _S3_SCHEMES:
        return S3ObjectStore(url, storage_options, transfer)
    if protocol in ("file", "local"):
        return LocalObjectStore(url, storage_options, transfer)
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

    def put_async(self, key: str, data, *, if_none_match: bool = False, if_match: str | None = None) -> concurrent.futures.Future:
        """Write ``data`` (any bytes-like object) as ``key``.

        ``if_none_match``: only if ``key`` does not exist; ``if_match``: only
        if its current ETag (see ``get_with_etag``) is this one.  Otherwise
        ``ConditionalWriteError``, and nothing is written.  On S3, a refused
        condition where the object already holds exactly ``data`` counts as
        success: it is this write's own earlier attempt, whose response was lost.
        """
        return self._pool.submit(
            self._retrying, "PUT", key, lambda: self._put_blocking(key, data, if_none_match, if_match)
        )

    def get_range_async(self, key: str, start: int, end: int) -> concurrent.futures.Future:
        """Bytes ``[start, end)`` of ``key``; raises ``CorruptCheckpointError`` if fewer exist."""
        return self._pool.submit(
            self._retrying, "GET", key, lambda: self._checked_range(key, start, end, self._get_blocking(key, start, end))
        )

    # -- blocking API ---------------------------------------------------------

    def put(self, key: str, data, *, if_none_match: bool = False, if_match: str | None = None) -> None:
        self.put_async(key, data, if_none_match=if_none_match, if_match=if_match).result()

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.get_range_async(key, start, end).result()

    def get(self, key: str) -> bytes:
        return self.get_range(key, 0, self.size(key))

    def get_with_etag(self, key: str) -> tuple[bytes, str | None]:
        """The object and the tag that ``put(..., if_match=tag)`` expects.

        Stores without ETags use the MD5 of the content, which is what a
        simple S3 PUT's ETag is too.
        """
        data = self.get(key)
        return data, hashlib.md5(data).hexdigest()

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

    def _put_blocking(self, key: str, data, if_none_match: bool, if_match: str | None) -> None:
        if not (if_none_match or if_match):
            self._write(key, data)
            return
        # Generic fsspec filesystems have no conditional writes: check, then
        # write, under a process-wide lock.  Exact within one process (as for
        # memory://); across processes it is a check-then-act race, as the
        # README says.
        with _conditional_lock:
            self._check_condition(key, if_none_match, if_match)
            self._write(key, data)

    def _check_condition(self, key: str, if_none_match: bool, if_match: str | None) -> None:
        try:
            _, current = self.get_with_etag(key)
        except ObjectNotFoundError:
            current = None
        _refuse_unless_condition_holds(self.url_for(key), current, if_none_match, if_match)

    def _write(self, key: str, data) -> None:
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


_conditional_lock = threading.Lock()


def _refuse_unless_condition_holds(url: str, current: str | None, if_none_match: bool, if_match: str | None) -> None:
    """``ConditionalWriteError`` unless the object's ``current`` tag (``None``: absent) meets the condition.

    Tags compare without quotes: S3 quotes ETags, callers may not.
    """
    if if_none_match and current is not None:
        raise ConditionalWriteError(f"{url}: object already exists")
    if if_match and (current is None or current.strip('"') != if_match.strip('"')):
        state = "no longer exists" if current is None else f"changed (ETag {current}, expected {if_match})"
        raise ConditionalWriteError(f"{url}: object {state}")


class LocalObjectStore(ObjectStore):
    """``file://``: every object is written durably and appears atomically.

    An object is written to a temporary name in its folder, fsynced, then
    renamed into place (``os.replace``), and the folder is fsynced, so a
    crash leaves either no object or the whole one, never a torn
    ``.metadata`` that counts as committed.  ``if_none_match`` uses
    ``os.link``, which fails if the name exists, so two processes cannot
    both create an object; ``if_match`` checks, then renames, under a
    process-wide lock (exact within a process only).
    """

    def _put_blocking(self, key: str, data, if_none_match: bool, if_match: str | None) -> None:
        if if_match:
            with _conditional_lock:
                self._check_condition(key, False, if_match)
                self._write(key, data)
            return
        self._write(key, data, exclusive=if_none_match)

    def _write(self, key: str, data, exclusive: bool = False) -> None:
        path = self._path(key)
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(memoryview(data).cast("B"))
                f.flush()
                os.fsync(f.fileno())
            if exclusive:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise ConditionalWriteError(f"{self.url_for(key)}: object already exists") from None
            else:
                os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        _fsync_dir(folder)


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        "TooManyRequests",
        "ConditionalRequestConflict",
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

    async def _call(
        self,
        op: str,
        key: str,
        method: str,
        *,
        body=None,
        read_body: bool = False,
        tries: "_Tries | None" = None,
        **kwargs,
    ) -> Any:
        """One S3 request under the retry policy: the only retry loop a request goes through.

        ``body`` (bytes-like) is wrapped in a fresh reader for every attempt,
        so a retry resends the whole body; a reused stream would resume where
        the failed attempt left it while declaring the full length.  With
        ``read_body`` the response body is read inside the attempt, so a
        connection cut mid-body is retried like any other transient error.
        ``tries`` records how many attempts were sent, which tells a caller
        whether an earlier attempt may have taken effect unseen.
        """
        for attempt in itertools.count():
            if tries is not None:
                tries.count = attempt + 1
            try:
                if body is not None:
                    kwargs["Body"] = _as_body(body)
                client = await self._s3()
                resp = await getattr(client, method)(**kwargs)
                if read_body:
                    async with resp["Body"] as stream:
                        resp["Body"] = await stream.read()
                return resp
            except Exception as e:  # noqa: BLE001 - classified by _retry_delay
                await asyncio.sleep(self._retry_delay(op, key, attempt, e))

    def _run(self, coro):
        return self._submit(coro).result()

    # -- primitives -------------------------------------------------------------

    def put_async(self, key: str, data, *, if_none_match: bool = False, if_match: str | None = None) -> concurrent.futures.Future:
        return self._submit(self._put(key, data, if_none_match, if_match))

    async def _put(self, key: str, data, if_none_match: bool, if_match: str | None) -> None:
        bucket, path = self._split(key)
        conditions = {}
        if if_none_match:
            conditions["IfNoneMatch"] = "*"
        if if_match:
            conditions["IfMatch"] = if_match
        try:
            await self._call("PUT", key, "put_object", body=data, Bucket=bucket, Key=path, **conditions)
        except ConditionalWriteError:
            # After a lost response, our own earlier attempt may be what the
            # condition now sees (resent by us, or by aiohttp, which resends
            # a PUT once when a kept-alive connection drops).  An object that
            # holds exactly our bytes means the write took effect.
            if await self._holds(key, data):
                return
            raise
        except UnsupportedByStoreError:
            if not conditions:
                raise
            logger.warning(
                "%s: the server does not implement conditional writes; falling back to check-then-write, "
                "which two concurrent writers can race",
                self.url_for(key),
            )
            await self._check_condition_async(key, if_none_match, if_match)
            await self._call("PUT", key, "put_object", body=data, Bucket=bucket, Key=path)

    async def _holds(self, key: str, data) -> bool:
        try:
            return await self._get_one(key, None, None) == bytes(data)
        except ObjectNotFoundError:
            return False

    async def _check_condition_async(self, key: str, if_none_match: bool, if_match: str | None) -> None:
        bucket, path = self._split(key)
        try:
            current = (await self._call("HEAD", key, "head_object", Bucket=bucket, Key=path))["ETag"]
        except ObjectNotFoundError:
            current = None
        _refuse_unless_condition_holds(self.url_for(key), current, if_none_match, if_match)

    def get_with_etag(self, key: str) -> tuple[bytes, str | None]:
        bucket, path = self._split(key)
        resp = self._run(self._call("GET", key, "get_object", read_body=True, Bucket=bucket, Key=path))
        return resp["Body"], resp.get("ETag")

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
        resp = await self._call("GET", key, "get_object", read_body=True, Bucket=bucket, Key=path, **ranged)
        return resp["Body"]

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

    async def _pages(self, op: str, prefix: str, method: str, continuation: dict[str, str], folder: bool = True):
        """Every page of a paginated listing under ``prefix`` (a folder, or any key prefix).

        ``continuation`` maps each request parameter to the response field
        that carries its value for the next page.  Each page is one request
        under the retry policy: botocore's paginators cannot resume a listing
        at the page that failed.
        """
        bucket, path = self._split(prefix.strip("/"))
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": f"{path}/" if path and folder else path}
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

    async def _list_uploads(self, prefix: str, folder: bool = True) -> list[MultipartUploadInfo]:
        out = []
        continuation = {"KeyMarker": "NextKeyMarker", "UploadIdMarker": "NextUploadIdMarker"}
        async for bucket, resp in self._pages("LIST-UPLOADS", prefix, "list_multipart_uploads", continuation, folder):
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


class _Tries:
    """How many attempts ``S3ObjectStore._call`` sent for one request."""

    count = 0


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
            self._upload_id = self._store._run(self._create_upload())
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
                body=memoryview(buf)[:fill],
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
            self._store._run(self._complete_upload(etags))
        except BaseException:
            self._abort_upload()
            raise

    def abort(self) -> None:
        self._closed = True
        self._abort_upload()

    async def _create_upload(self) -> str:
        """Start the multipart upload; abort any that a lost response leaked.

        When an attempt's response is lost, S3 may still have created an
        upload that no one knows the id of.  Shard keys are unique to one
        save of one rank (see ``ObjectStoreWriter``), so any other open
        upload of exactly this key is such a leak.
        """
        store, tries = self._store, _Tries()
        resp = await store._call(
            "CREATE-MPU", self._key, "create_multipart_upload", tries=tries, Bucket=self._bucket, Key=self._path
        )
        upload_id = resp["UploadId"]
        if tries.count > 1:
            try:
                for upload in await store._list_uploads(self._key, folder=False):
                    if upload.key == self._key and upload.upload_id != upload_id:
                        await store._abort(upload.key, upload.upload_id)
            except Exception as e:  # noqa: BLE001 - gc reclaims what this misses
                logger.warning("%s: could not look for leaked multipart uploads: %s", store.url_for(self._key), e)
        return upload_id

    async def _complete_upload(self, etags: list[str]) -> None:
        """Complete the upload; after a lost success response, confirm by HEAD.

        A retried CompleteMultipartUpload whose first attempt succeeded is
        answered ``NoSuchUpload``; the object then exists with our size (the
        key is ours alone), and that is success, not a missing object.
        """
        store, tries = self._store, _Tries()
        try:
            await store._call(
                "COMPLETE-MPU",
                self._key,
                "complete_multipart_upload",
                tries=tries,
                Bucket=self._bucket,
                Key=self._path,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]},
            )
        except ObjectNotFoundError:
            if tries.count > 1:
                head = await store._call("HEAD", self._key, "head_object", Bucket=self._bucket, Key=self._path)
                if int(head["ContentLength"]) == self._pos:
                    self._upload_id = None  # completed: nothing to abort
                    return
            raise

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
    """Throttling, 5xx but 501, connection resets and timeouts are worth another try.

    Decided by S3 error code first (``RequestTimeout`` is a 400, and a
    ``ConditionalRequestConflict`` 409 asks the client to retry), then by
    status: 429 and 5xx other than 501 Not Implemented.  Every other 4xx
    would fail the same way again.
    """
    code, status, _ = _error_code(exc)
    if code is not None or status is not None:
        if code in _RETRYABLE_CODES:
            return True
        return status is not None and (status == 429 or (status >= 500 and status != 501))
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
    if isinstance(exc, DcpstoreError):
        return exc
    code, status, message = _error_code(exc)
    if code == "PreconditionFailed" or status == 412:
        return ConditionalWriteError(f"{url}: conditional write refused: the object exists or changed ({message})")
    if code == "NotImplemented" or status == 501:
        return UnsupportedByStoreError(f"{url}: the server does not implement this request ({code}: {message})")
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
