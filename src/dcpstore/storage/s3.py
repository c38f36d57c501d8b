"""``s3://``: the S3 request transport, on the aiobotocore client that s3fs configures.

Credentials, endpoint and profile come from s3fs and botocore as usual;
requests go to the client directly rather than through s3fs's file API,
because checkpoint traffic needs three things that API does not give:
parallel multipart uploads fed from reused buffers (``multipart``), one
retry policy that the caller controls (``S3ObjectStore._call``), and errors
that name the object (``translate``).

Concurrency model: requests run as coroutines on fsspec's I/O event loop
thread, so no request holds the GIL while it waits on the network; callers
on any thread get ``concurrent.futures.Future`` objects back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import email.utils
import functools
import hashlib
import itertools
import logging
import math
import os
import random
import sys
import threading
import time
import uuid
import weakref
from typing import Any, Iterable

from ..errors import ConditionalWriteError, CorruptCheckpointError, ObjectNotFoundError, UnsupportedByStoreError
from .base import (
    MultipartUploadInfo,
    ObjectHead,
    ObjectInfo,
    ObjectStore,
    ObjectWriter,
    Tries,
    refuse_unless_condition_holds,
    url_to_fs,
)
from .body import BufferSink, Segments, ViewBody, body_nbytes
from .config import TransferConfig
from .multipart import MultipartObjectWriter, put_in_parts
from .throttle import RATES, RequestRate, key_range
from .translate import gave_up, is_throttle, may_have_taken_effect, paced_out, throttled_out

logger = logging.getLogger(__name__)

S3_SCHEMES = ("s3", "s3a")
WRITE_TOKEN_KEY = "dcpstore-write"  # x-amz-meta of a conditional write: which writer's object storage holds
ABORT_ROUNDS = 5  # background rounds of a failed abort, each under the retry policy, max_backoff apart

# Requests after which an object may exist, or be gone, where it was not: listings must be redone.
_CHANGES_LISTINGS = frozenset({"put_object", "complete_multipart_upload", "delete_objects"})

# Requests S3 counts against a key range's write rate; the rest are reads.
_WRITES = frozenset(
    {
        "put_object", "upload_part", "create_multipart_upload", "complete_multipart_upload",
        "abort_multipart_upload", "delete_objects",
    }
)


def client_config(transfer: TransferConfig) -> dict[str, Any]:
    """botocore settings under which dcpstore's own retry policy is the only one.

    botocore's retries are turned off so that attempts are bounded by
    ``RetryPolicy`` alone, timeouts are set on connect and read so nothing
    hangs, and the connection pool is large enough for ``max_concurrency``.

    No pass over the bytes is botocore's: bodies go out ``UNSIGNED-PAYLOAD``
    and without botocore's checksums.  Under these settings botocore would
    otherwise SHA-256 every body, on HTTPS too (0.92 CPU s/GiB here, more
    than the rest of the client's work on a byte), and flexible checksums
    add another pass.  Integrity end to end is dcpstore's own: every item's
    crc32, computed in the one pass over the bytes as ``torch.save`` writes
    them, is committed in ``.metadata`` and checked on every load, so a
    body damaged on any hop is caught naming the item; on the way, TLS
    protects the bytes on ``https`` endpoints.
    """
    return {
        "retries": {"total_max_attempts": 1},
        "connect_timeout": transfer.connect_timeout,
        "read_timeout": transfer.read_timeout,
        "max_pool_connections": transfer.max_concurrency * 2,
        "request_checksum_calculation": "when_required",
        "response_checksum_validation": "when_required",
        "s3": {"payload_signing_enabled": False},
    }


# The environment botocore reads a new client's endpoint and credentials from.
_CLIENT_ENVIRONMENT = (
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_REGION",
    "AWS_DEFAULT_REGION", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
)

# (scheme, options, transfer) -> (digest of the client environment, the instance made under it).
_filesystems: dict[tuple, tuple[str, Any]] = {}
_filesystems_lock = threading.Lock()
# id(instance) -> the server its requests go to, while the instance lives (throttling is per server).
_servers: dict[int, str] = {}


def _client_environment() -> str:
    """A digest of the client environment (not the values: the key must hold no secret)."""
    return hashlib.sha256(repr([os.environ.get(name) for name in _CLIENT_ENVIRONMENT]).encode()).hexdigest()


def _server(storage_options: dict[str, Any]) -> str:
    """The endpoint a client made now with ``storage_options`` sends to, as botocore picks it.

    An explicit ``endpoint_url``, else botocore's own resolution: the
    environment (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``), the
    profile's configuration (``endpoint_url``, or its ``services`` section),
    then S3's regional endpoint.  Read from a client made for the purpose
    (with placeholder keys, so no credential lookup), once per filesystem:
    two profiles that point at two servers are paced apart.
    """
    explicit = storage_options.get("endpoint_url") or storage_options.get("client_kwargs", {}).get("endpoint_url")
    if explicit:
        return explicit
    import botocore.session

    session = botocore.session.Session(profile=storage_options.get("profile"))
    client = session.create_client(
        "s3",
        region_name=storage_options.get("client_kwargs", {}).get("region_name"),
        aws_access_key_id="placeholder",
        aws_secret_access_key="placeholder",
    )
    return client.meta.endpoint_url


class S3ObjectStore(ObjectStore):
    """The S3 store: parallel multipart uploads, ranged reads, one retry policy."""

    has_buckets = True
    has_user_metadata = True

    @classmethod
    def connect(cls, url: str, storage_options: dict[str, Any], transfer: TransferConfig) -> tuple[Any, str]:
        """One private s3fs instance per (scheme, options, transfer) and client environment, shared by all buckets.

        Private, because the botocore settings of ``client_config`` must not
        leak into s3fs instances that user code shares through fsspec's
        instance cache.  Kept while the environment it was made in
        (``AWS_ENDPOINT_URL``, the credential variables, the profile) stays
        the same, because it holds no threads (requests run on fsspec's I/O
        loop) and making one costs a credential lookup and a client.  When
        that environment changes, the next store gets a new instance, and
        the old one is freed once the stores that use it are closed.
        fsspec's own instance cache keys on the options alone, so it would
        keep sending to the old endpoint.
        """
        protocol, rest = url.split("://", 1)
        key = (protocol, repr(sorted(storage_options.items())), transfer)
        environment = _client_environment()
        with _filesystems_lock:
            made_in, fs = _filesystems.get(key, (None, None))
            if fs is None or made_in != environment:
                options = dict(storage_options)
                ours, theirs = client_config(transfer), options.get("config_kwargs", {})
                options["config_kwargs"] = {**ours, **theirs, "s3": {**ours["s3"], **theirs.get("s3", {})}}
                options.setdefault("skip_instance_cache", True)
                server = _server(storage_options)  # before anything is kept: a bad profile raises here, every time
                fs = url_to_fs(f"{protocol}://{rest.partition('/')[0]}", options)[0]
                _filesystems[key] = (environment, fs)
                _servers[id(fs)] = server
                weakref.finalize(fs, _servers.pop, id(fs), None)
        return fs, rest

    # -- plumbing ---------------------------------------------------------------

    def _split(self, key: str) -> tuple[str, str]:
        bucket, _, path = self._path(key).partition("/")
        return bucket, path

    async def _s3(self):
        return await self.fs.set_session()  # s3fs caches the client

    def _submit(self, coro) -> concurrent.futures.Future:
        if not self._lease.alive:
            coro.close()
            raise RuntimeError(f"{self.url}: the store is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop)

    async def _call(self, op: str, key: str, method: str, **kwargs) -> Any:
        """``_attempts``; after a request that may have added or removed objects, fsspec's listings of them are dropped."""
        try:
            return await self._attempts(op, key, method, **kwargs)
        finally:
            if method in _CHANGES_LISTINGS:
                bucket = kwargs["Bucket"]
                keys = [o["Key"] for o in kwargs["Delete"]["Objects"]] if method == "delete_objects" else [kwargs["Key"]]
                forget_listings(f"{bucket}/{k}" for k in keys)

    async def _attempts(
        self,
        op: str,
        key: str,
        method: str,
        *,
        body=None,
        read_body: bool = False,
        into: tuple[Any, int, int] | None = None,
        tries: Tries | None = None,
        deadline: float | None = None,
        in_save: bool = True,
        **kwargs,
    ) -> Any:
        """One S3 request under the retry policy: the only retry loop a request goes through.

        ``body`` (bytes-like) is wrapped in a fresh reader for every attempt,
        so a retry resends the whole body; a reused stream would resume where
        the failed attempt left it while declaring the full length.  With
        ``read_body`` the response body is read inside the attempt, so a
        connection cut mid-body is retried like any other transient error;
        with ``into``, a ``(sink, offset, limit)``, the body lands in the sink
        (see ``_read_into``) and ``resp["Body"]`` is the number of bytes it held.
        ``tries`` records how many attempts were sent and how many may have
        taken effect unseen (no answer, or a 5xx).  No attempt starts after ``deadline`` (``time.monotonic()``).

        Every attempt first waits for a send slot of its key range's rate
        (``throttle``).  A throttled answer lowers that rate and is retried
        for up to ``RetryPolicy.throttle_budget`` seconds, and not once the
        store's ``save_throttle`` has run out (unless ``in_save`` is false: a
        background abort after the save), not counted against
        ``max_attempts``, which bounds every other retryable error.
        """
        rate = self._rate(key, method)
        clock = self.save_throttle if in_save else None  # this save's, even if the next save's replaces it meanwhile
        throttled_since, failures, last_error = None, 0, None
        held = False  # this request holds the save's throttle clock: a throttled answer, and its retry not yet sent
        try:
            for attempt in itertools.count():
                asked_at = time.monotonic()
                sent_at, paced = await rate.acquire()
                if last_error is None and time.monotonic() >= (deadline or math.inf):
                    raise paced_out(op, self.url_for(key), time.monotonic() - asked_at)
                if last_error is not None:
                    throttled = is_throttle(last_error)
                    out_of_budget = throttled and clock is not None and clock.exhausted()
                    if out_of_budget or time.monotonic() >= (deadline or math.inf):
                        # The pace held this retry past the deadline or the budget: nothing is sent after it.
                        url = self.url_for(key)
                        if throttled:
                            raise throttled_out(op, url, time.monotonic() - throttled_since, attempt, last_error) from last_error
                        raise gave_up(op, url, attempt, last_error) from last_error
                if held:
                    clock.release()  # the retry goes out: sending is not being throttled
                    held = False
                if tries is not None:
                    tries.count = attempt + 1
                try:
                    client = await self._s3()
                    if body is not None:
                        kwargs["Body"] = _as_body(body)
                        resp = await asyncio.wait_for(getattr(client, method)(**kwargs), self._send_deadline(body))
                    else:
                        resp = await getattr(client, method)(**kwargs)
                    if read_body:
                        async with resp["Body"] as stream:
                            resp["Body"] = await (stream.read() if into is None else _read_into(stream, *into))
                        self._check_body_length(key, kwargs.get("Range"), resp)
                    rate.succeeded(paced)
                    return resp
                except Exception as e:  # noqa: BLE001 - classified below and by _retry_delay
                    last_error = e
                    if tries is not None and may_have_taken_effect(e):
                        tries.may_have_landed += 1
                    now = time.monotonic()
                    if is_throttle(e):
                        # Paced by the key range's lowered rate, not by a backoff of its own.
                        rate.throttled(sent_at)
                        throttled_since = sent_at if throttled_since is None else throttled_since
                        if clock is not None:
                            clock.hold()  # the save's throttle budget runs until the retry is sent
                            held = True
                        budget_end = min(throttled_since + self.transfer.retry.throttle_budget, deadline or math.inf)
                        if now >= budget_end or (clock is not None and clock.exhausted()):
                            raise throttled_out(op, self.url_for(key), now - throttled_since, attempt + 1, e) from e
                        continue
                    delay = self._retry_delay(op, key, failures, e)
                    if deadline is not None and now + delay >= deadline:
                        raise gave_up(op, self.url_for(key), attempt + 1, e) from e
                    await asyncio.sleep(delay)
                    failures += 1
        finally:
            if held:
                clock.release()

    @functools.cached_property
    def rate_scope(self) -> tuple[str, str]:
        """What this store's request rates are kept under: (server, bucket), shared by every client sending there.

        Fixed for the store's life (its client and bucket are), so the
        per-request path reads it once.
        """
        return _servers[id(self.fs)], self._split("")[0]

    def _rate(self, key: str, method: str) -> RequestRate:
        """The request rate ``method`` on ``key`` is paced by (see ``throttle``)."""
        path = self._split(key)[1]
        return RATES.rate(self.rate_scope, key_range(path), "write" if method in _WRITES else "read")

    def share_write_rate(self, writers: int) -> None:
        """Start at a share of a key range's rate: this process is one of ``writers`` (ranks x sub-prefixes) writing at once."""
        if self.transfer.prefix_write_rate is not None:
            RATES.share(self.rate_scope, "write", self.transfer.prefix_write_rate / max(1, writers))

    def _check_body_length(self, key: str, asked: str | None, resp: dict) -> None:
        """A ranged body shorter than its range is retried, unless the object itself ends there.

        A 206 may carry fewer bytes than asked (a connection cut short under
        an honest Content-Length, a proxy): that is a transient error, like a
        reset.  Only when the object is shorter than the range (the total of
        ``Content-Range``) is it ``CorruptCheckpointError``: no retry brings
        the missing bytes.
        """
        if asked is None:
            return
        start, _, end = asked.removeprefix("bytes=").partition("-")
        total = (resp.get("ContentRange") or "").rpartition("/")[2]
        if not end:  # an open range: the rest of the object, as long as Content-Range says it is
            if not total.isdigit():
                return  # a whole-object 200 from a server that ignores Range: nothing to check against
            end = str(int(total) - 1)
        wanted = int(end) + 1 - int(start)
        received = resp["Body"] if isinstance(resp["Body"], int) else len(resp["Body"])
        if received >= wanted:
            return
        if total.isdigit() and int(total) <= int(end):
            raise CorruptCheckpointError(
                f"{self.url_for(key)}: object is truncated: it holds {total} bytes, "
                f"and bytes [{start}, {int(end) + 1}) were asked for"
            )
        raise ShortBodyError(f"{self.url_for(key)}: {received} of {wanted} bytes of a ranged GET came back")

    def _send_deadline(self, body) -> float:
        """Seconds a request that sends ``body`` may take in all (see ``TransferConfig.min_send_rate``)."""
        t = self.transfer
        return t.connect_timeout + t.read_timeout + body_nbytes(body) / t.min_send_rate

    def _run(self, coro):
        return self._submit(coro).result()

    # -- primitives -------------------------------------------------------------

    def put_async(
        self,
        key: str,
        data,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
        metadata: dict[str, str] | None = None,
        deadline: float | None = None,
        tries: Tries | None = None,
    ) -> concurrent.futures.Future:
        request = {"deadline": deadline, "tries": tries}
        if metadata:
            request["Metadata"] = dict(metadata)
        return self._submit(self._put(key, data, if_none_match, if_match, request))

    async def _put(self, key: str, data, if_none_match: bool, if_match: str | None, request: dict) -> None:
        """One PUT, or past ``multipart_threshold`` a multipart upload, under the same condition.

        A conditional or multipart write is tagged with a token of its own
        (user metadata ``WRITE_TOKEN_KEY``), so that after a lost answer one
        HEAD tells our object from another writer's (``_holds``).
        """
        bucket, path = self._split(key)
        conditions = {}
        if if_none_match:
            conditions["IfNoneMatch"] = "*"
        if if_match:
            conditions["IfMatch"] = if_match
        in_parts = body_nbytes(data) > self.transfer.multipart_threshold
        if conditions or in_parts:
            request = {**request, "Metadata": {**request.get("Metadata", {}), WRITE_TOKEN_KEY: uuid.uuid4().hex}}
        if in_parts:
            send = functools.partial(put_in_parts, self, key, data, request)
        else:
            send = functools.partial(self._call, "PUT", key, "put_object", body=data, Bucket=bucket, Key=path, **request)
        try:
            await send(**conditions)
        except (ConditionalWriteError, ObjectNotFoundError):
            # After a lost response, our own earlier attempt may be what the
            # condition now sees (resent by us, or by aiohttp, which resends
            # a PUT once when a kept-alive connection drops), or what made a
            # retried CompleteMultipartUpload find no upload.
            if (conditions or in_parts) and await self._holds(key, data, request["Metadata"][WRITE_TOKEN_KEY]):
                return
            if if_match and if_match.startswith('"') and await self._etag(key) == if_match:
                # The object is still the one we read, so the 412 was the
                # server's: Ceph RGW matches If-Match only against the bare
                # hex of the quoted ETag its own GET returns.  Once more,
                # bare; a change since the HEAD still fails the condition.
                await send(IfMatch=if_match.strip('"'))
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
            await send()

    async def _holds(self, key: str, data, token: str) -> bool:
        """Whether the object at ``key`` is the one a write tagged ``token`` sent.

        One HEAD where the store keeps user metadata; where it drops it, the
        bytes are compared (a GET, only when the sizes match).
        """
        bucket, path = self._split(key)
        try:
            head = await self._call("HEAD", key, "head_object", Bucket=bucket, Key=path)
            if WRITE_TOKEN_KEY in head.get("Metadata", {}):
                return head["Metadata"][WRITE_TOKEN_KEY] == token
            if int(head["ContentLength"]) != memoryview(data).nbytes:
                return False
            return (await self._get_whole(key))["Body"] == bytes(data)
        except ObjectNotFoundError:
            return False

    async def _etag(self, key: str) -> str | None:
        """The object's ETag as the server quotes it, or ``None`` when there is no object."""
        bucket, path = self._split(key)
        try:
            return (await self._call("HEAD", key, "head_object", Bucket=bucket, Key=path))["ETag"]
        except ObjectNotFoundError:
            return None

    async def _check_condition_async(self, key: str, if_none_match: bool, if_match: str | None) -> None:
        refuse_unless_condition_holds(self.url_for(key), await self._etag(key), if_none_match, if_match)

    def get_with_etag(self, key: str) -> tuple[bytes, str | None]:
        resp = self._run(self._get_whole(key))
        return resp["Body"], resp.get("ETag")

    def get_range_async(self, key: str, start: int, end: int, sink=None) -> concurrent.futures.Future:
        return self._submit(self._get_range(key, start, end, sink))

    async def _get_range(self, key: str, start: int, end: int, sink=None) -> bytes | bytearray | None:
        """Bytes ``[start, end)`` of ``key``, each read once, into one buffer or ``sink``.

        Ranges of more than two parts are fetched as concurrent part-sized
        GETs; every GET's body goes straight from aiohttp's chunks to its
        place (``_read_into``).  The buffer is handed over as it is: a
        ``bytes()`` of it would copy every byte again.
        """
        if end <= start:
            return b"" if sink is None else None
        out = None
        if sink is None:
            out = bytearray(end - start)
            sink = BufferSink(memoryview(out))
        bucket, path = self._split(key)

        async def fetch(lo: int, hi: int) -> None:
            resp = await self._call(
                "GET", key, "get_object", read_body=True, into=(sink, lo - start, hi - lo),
                Bucket=bucket, Key=path, Range=f"bytes={lo}-{hi - 1}",
            )
            self._check_range_length(key, lo, hi, resp["Body"])

        step = self.transfer.part_size if end - start > 2 * self.transfer.part_size else end - start
        parts = [asyncio.ensure_future(fetch(lo, min(lo + step, end))) for lo in range(start, end, step)]
        try:
            await asyncio.gather(*parts)
        except BaseException:
            # No part may go on landing bytes once the range has failed (or was cancelled).
            for part in parts:
                part.cancel()
            await asyncio.gather(*parts, return_exceptions=True)
            raise
        return out

    def get(self, key: str) -> bytes:
        # One GET, no HEAD first: a HEAD's 404 cannot tell a missing bucket from a missing key.
        return self._run(self._get_whole(key))["Body"]

    async def _get_whole(self, key: str) -> dict:
        """The whole object: one GET of the open range ``bytes=0-``, so its answer says how long the object is.

        A 200 whose body and Content-Length were both cut short (a broken
        middlebox) looks whole; a 206 still carries the object's size in
        ``Content-Range``, so a short body is retried (``_check_body_length``).
        An empty object has no byte 0 (416): it is read with a plain GET.
        """
        bucket, path = self._split(key)
        try:
            return await self._call("GET", key, "get_object", read_body=True, Bucket=bucket, Key=path, Range="bytes=0-")
        except CorruptCheckpointError:  # InvalidRange: the object is empty
            return await self._call("GET", key, "get_object", read_body=True, Bucket=bucket, Key=path)

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
            return True
        except ObjectNotFoundError:
            return False

    def size(self, key: str) -> int:
        return self.head(key).size

    def head(self, key: str) -> ObjectHead:
        bucket, path = self._split(key)
        resp = self._run(self._call("HEAD", key, "head_object", Bucket=bucket, Key=path))
        return ObjectHead(int(resp["ContentLength"]), resp.get("ETag"), dict(resp.get("Metadata") or {}))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self._run(self._list(prefix))

    async def _pages(
        self, op: str, prefix: str, method: str, continuation: dict[str, str], folder: bool = True, **extra: Any
    ):
        """Every page of a paginated listing under ``prefix`` (a folder, or any key prefix).

        ``continuation`` maps each request parameter to the response field
        that carries its value for the next page.  Each page is one request
        under the retry policy: botocore's paginators cannot resume a listing
        at the page that failed.
        """
        bucket, path = self._split(prefix.strip("/"))
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": f"{path}/" if path and folder else path, **extra}
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

    def list_folders(self) -> list[str]:
        return self._run(self._list_folders())

    async def _list_folders(self) -> list[str]:
        out = []
        continuation = {"ContinuationToken": "NextContinuationToken"}
        async for bucket, resp in self._pages("LIST", "", "list_objects_v2", continuation, Delimiter="/"):
            out.extend(self._relative(f"{bucket}/{p['Prefix']}").strip("/") for p in resp.get("CommonPrefixes", []))
        return sorted(out)

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

    def upload_last_active(self, upload: MultipartUploadInfo) -> float | None:
        return self._run(self._upload_last_active(upload))

    async def _upload_last_active(self, upload: MultipartUploadInfo) -> float | None:
        bucket, path = self._split(upload.key)
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": path, "UploadId": upload.upload_id}
        newest = upload.initiated
        while True:
            try:
                resp = await self._call("LIST-PARTS", upload.key, "list_parts", **kwargs)
            except ObjectNotFoundError:  # NoSuchUpload: completed or aborted since it was listed
                return None
            times = [p["LastModified"].timestamp() for p in resp.get("Parts", []) if p.get("LastModified")]
            newest = max([t for t in (newest, *times) if t is not None], default=None)
            if not resp.get("IsTruncated"):
                return newest
            kwargs["PartNumberMarker"] = resp.get("NextPartNumberMarker")

    def server_time(self) -> float:
        """The ``Date`` of the server's answer to a one-key listing of the root; this host's clock if it sends none.

        ``Date`` has one-second resolution and is truncated, so it is at
        most a second behind the server's clock: ages come out younger, never older.
        """
        bucket, path = self._split("")
        resp = self._run(self._call("LIST", "", "list_objects_v2", Bucket=bucket, Prefix=f"{path}/" if path else "", MaxKeys=1))
        date = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        try:
            return email.utils.parsedate_to_datetime(date).timestamp()
        except (TypeError, ValueError):
            logger.warning("%s: the server's answer carries no Date; ages are measured on this host's clock", self.url)
            return time.time()

    async def _abort(self, key: str, upload_id: str, *, in_save: bool = True) -> None:
        """Abort an upload; ``in_save=False``: after the save, not bounded by its spent throttle budget."""
        bucket, path = self._split(key)
        try:
            await self._call(
                "ABORT", key, "abort_multipart_upload", in_save=in_save, Bucket=bucket, Key=path, UploadId=upload_id
            )
        except ObjectNotFoundError:
            pass  # already completed or aborted

    def abort_later(self, key: str, upload_id: str) -> None:
        """Keep trying to abort an upload whose abort failed, in the background, past the save's own budget.

        An upload left open costs storage until a lifecycle rule or ``gc``
        removes it.  ``settle_aborts`` (at the owner's ``close``) waits for
        these, tries once more, and names what still could not be aborted.
        """
        self._connection.unaborted.add((self, key, upload_id, self._submit(self._abort_persistently(key, upload_id))))

    async def _abort_persistently(self, key: str, upload_id: str) -> None:
        delay = self.transfer.retry.max_backoff
        for _ in range(ABORT_ROUNDS):
            await asyncio.sleep(random.uniform(delay / 2, delay))
            try:
                return await self._abort(key, upload_id, in_save=False)
            except Exception as e:  # noqa: BLE001 - the next round, or settle_aborts, says so
                error = e
        raise error

    def settle_aborts(self) -> None:
        for entry in list(self._connection.unaborted):  # any store's: a checkpointer moves its writer's store every step
            self._connection.unaborted.discard(entry)
            owner, key, upload_id, background = entry
            try:
                background.result()
                continue
            except Exception:  # noqa: BLE001 - once more, now
                pass
            try:
                self._run(owner._abort(key, upload_id, in_save=False))
            except Exception as e:  # noqa: BLE001
                logger.warning(
                    "%s: multipart upload %s could not be aborted (%s); it holds storage until "
                    "`dcpstore gc %s` (or a lifecycle rule) removes it",
                    owner.url_for(key), upload_id, e, owner.url,
                )

    def open_writer(self, key: str) -> ObjectWriter:
        return MultipartObjectWriter(self, key, self._connection.parts)


def forget_listings(paths: Iterable[str]) -> None:
    """Make every s3fs instance in fsspec's instance cache list ``paths`` (``bucket/key``) and their parents afresh.

    dcpstore sends requests through a private client (see ``connect``).
    s3fs instances that user code shares through fsspec's instance cache
    (torchtitan's step discovery and purge, ``fsspec.filesystem("s3")``)
    keep directory listings, which would never learn of dcpstore's writes
    and deletes; stock ``FsspecWriter`` writes through such an instance,
    which drops its own.  So dcpstore drops them too, in every cached
    instance whatever its endpoint (their cache key holds no endpoint from
    the environment, and one listing too many is the only cost).  Instances
    made with ``skip_instance_cache=True`` are nobody's to find.
    """
    s3fs = sys.modules.get("s3fs")
    if s3fs is None:
        return  # never imported: no instance to hold a listing
    paths = list(paths)
    classes = [s3fs.S3FileSystem]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        for fs in list(getattr(cls, "_cache", {}).values()):
            for path in paths:
                fs.invalidate_cache(path)


async def _read_into(stream, sink, offset: int, limit: int) -> int:
    """Land the response body ``stream`` in ``sink`` at ``offset``; the number of bytes the body held.

    Chunk by chunk as aiohttp received them from the socket (its
    ``StreamReader.readany``, under aiobotocore's body), so the sink's copy
    is the only one: ``read()`` would first join the chunks into one
    ``bytes``.  Bytes beyond ``limit`` are counted, not landed.
    """
    content, pos = stream._raw_stream.content, 0
    while chunk := await content.readany():
        n = max(0, min(len(chunk), limit - pos))
        if n:
            sink.write(offset + pos, memoryview(chunk)[:n])
        pos += len(chunk)
    return pos


class ShortBodyError(ConnectionError):
    """A response body ended before the length its range asked for: retried like a reset."""


def _as_body(data) -> bytes | bytearray | ViewBody:
    if isinstance(data, (bytes, bytearray)):
        return data
    if isinstance(data, Segments):
        return ViewBody(*data.views)
    return ViewBody(memoryview(data))
