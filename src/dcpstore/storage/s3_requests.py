"""S3 requests: the one retry loop every request of ``S3ObjectStore`` goes through, paced per key range.

``S3Requests`` is the plumbing under ``S3ObjectStore`` (``s3``): the private
s3fs instance and its aiobotocore client (``connect``, ``client_config``),
the coroutine runner on fsspec's I/O loop (``_submit``, ``_run``), and
``_call``: one request under ``RetryPolicy``, with every attempt waiting
for a send slot of its key range's rate (``throttle``), whole bodies resent
on a retry, response bodies read inside the attempt (a cut is retried like
a reset), and fsspec's cached listings dropped after a request that
changes them.  The operations (put, get, list, delete, multipart) are the
store's; this module knows nothing of checkpoints.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import itertools
import math
import os
import sys
import threading
import time
import weakref
from typing import Any, Iterable

from ..errors import CorruptCheckpointError
from .base import ObjectStore, Tries, url_to_fs
from .body import Segments, ViewBody, body_nbytes
from .config import TransferConfig
from .throttle import RATES, RequestRate, key_range
from .translate import gave_up, is_throttle, may_have_taken_effect, paced_out, throttled_out

# Requests after which an object may exist, or be gone, where it was not: listings must be redone.
_CHANGES_LISTINGS = frozenset({"put_object", "complete_multipart_upload", "delete_objects"})

# Requests S3 counts against a key range's write rate; the rest are reads.
_WRITES = frozenset(
    {
        "put_object", "upload_part", "upload_part_copy", "create_multipart_upload", "complete_multipart_upload",
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


def client_environment() -> str:
    """A digest of the client environment (not the values: the key must hold no secret)."""
    return hashlib.sha256(repr([os.environ.get(name) for name in _CLIENT_ENVIRONMENT]).encode()).hexdigest()


def server_of(storage_options: dict[str, Any]) -> str:
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


class S3Requests(ObjectStore):
    """An ``ObjectStore`` whose requests go to S3 through one retry loop (see the module docstring)."""

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
        environment = client_environment()
        with _filesystems_lock:
            made_in, fs = _filesystems.get(key, (None, None))
            if fs is None or made_in != environment:
                options = dict(storage_options)
                ours, theirs = client_config(transfer), options.get("config_kwargs", {})
                options["config_kwargs"] = {**ours, **theirs, "s3": {**ours["s3"], **theirs.get("s3", {})}}
                options.setdefault("skip_instance_cache", True)
                server = server_of(storage_options)  # before anything is kept: a bad profile raises here, every time
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
