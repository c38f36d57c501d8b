"""The object-store vocabulary, and the store for any fsspec filesystem.

``ObjectStore`` wraps an fsspec filesystem (``memory://`` and anything
else without a store of its own) behind a small object-store vocabulary:
put, ranged get, exists, list, delete, and abort of incomplete multipart
uploads.  Its blocking calls run on the connection's thread pool (see
``connection``), under the caller's ``RetryPolicy``.  ``LocalObjectStore``
(``local``) and ``S3ObjectStore`` (``s3``) implement the same vocabulary.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import itertools
import logging
import threading
import time
import weakref
from typing import Any, Callable, Iterable

import fsspec

from ..errors import ConditionalWriteError, CorruptCheckpointError, ObjectNotFoundError
from .connection import Connection
from .translate import gave_up, is_retryable, translate_error

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    key: str  # relative to the store's root
    size: int
    last_modified: float | None = None  # seconds since the epoch
    etag: str | None = None  # as listed (quoted, as S3 lists it); None where the store lists none


@dataclasses.dataclass(frozen=True)
class ObjectHead:
    """What a HEAD tells of an object."""

    size: int
    etag: str | None = None  # None where the store has no ETags
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)  # user metadata (x-amz-meta-*)


#: x-amz-meta of a conditional write: which writer's object storage holds, so
#: that after a lost answer one HEAD tells our object from another writer's.
WRITE_TOKEN_KEY = "dcpstore-write"


class Tries:
    """What the attempts of one request came to: how many were sent, how many may have taken effect unseen.

    An attempt without an answer (a reset, a timeout) may still have taken
    effect, or may yet; so may one answered with a server error (5xx): a
    gateway in front of the store (nginx or HAProxy before MinIO or Ceph
    RGW) answers 502/503/504 while the store goes on with the request, and
    S3's own 500 InternalError does not say it did not.  A caller that must
    know the outcome reads it back, after such an attempt has had time to land.
    """

    def __init__(self) -> None:
        self.count = 0
        self.may_have_landed = 0


@dataclasses.dataclass(frozen=True)
class MultipartUploadInfo:
    key: str
    upload_id: str
    initiated: float | None = None


def url_to_fs(url: str, options: dict[str, Any]):
    """fsspec's filesystem instance (from its instance cache) and path for ``url``."""
    try:
        return fsspec.core.url_to_fs(url, **options)
    except (ValueError, ImportError) as e:
        raise ValueError(f"{url}: cannot open this URL ({e})") from None


class ObjectStore:
    """Object-store operations over a generic fsspec filesystem.

    Keys are '/'-separated and relative to the store's root.  Stores come
    from ``open_store`` and ``child``; each holds a lease on the connection
    it shares with the other stores over the same filesystem instance (and
    bucket), released by ``close()``.
    """

    #: Whether the first component of a path names a bucket, which then
    #: scopes the connection (see ``open_store``).
    has_buckets = False
    #: Whether ``put(metadata=...)`` is stored and ``head`` returns it.
    has_user_metadata = False
    #: Whether ``ObjectWriter.copy_range`` can append another object's bytes without sending them.
    server_side_copy = False

    def __init__(self, url: str, root: str, connection: Connection):
        """A store at ``url`` (``root`` on the filesystem); takes over a lease the caller holds on ``connection``."""
        self.url = str(url).rstrip("/")
        self.root = root.rstrip("/")
        self.fs = connection.fs
        self.transfer = connection.transfer
        self._connection = connection
        self._lease = weakref.finalize(self, connection.release, wait=False)  # collected, not closed: see release
        # When set, no throttled request of this store is retried once it has
        # run out: a save's one budget for throttling, shards and .metadata
        # alike, set by ``ObjectStoreWriter.write_data`` (see ``throttle.ThrottleClock``).
        self.save_throttle = None  # a throttle.ThrottleClock (throttle is the layer above this one)
        #: The ETag each object had when this store last read a range of it, where the store has ETags (S3).
        self.read_etags: dict[str, str] = {}

    @classmethod
    def connect(cls, url: str, storage_options: dict[str, Any], transfer) -> tuple[Any, str]:
        """The filesystem instance to reach ``url`` through, and ``url``'s path on it."""
        return url_to_fs(url, storage_options)

    # -- naming and lifetime ------------------------------------------------------

    def url_for(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def location(self, key: str) -> str:
        """Where ``key`` lies on the server, as another store on the same connection names it (``ObjectWriter.copy_range``'s source)."""
        return self._path(key)

    def child(self, prefix: str) -> "ObjectStore":
        """A store rooted at ``prefix`` below this one, on the same connection (with a lease of its own)."""
        if not self._lease.alive or not self._connection.lease():
            raise RuntimeError(f"{self.url}: the store is closed")
        prefix = prefix.strip("/")
        return type(self)(self.url_for(prefix), self._path(prefix), self._connection)

    def close(self) -> None:
        """Release this store's lease; the connection's pools go with the last one, their threads waited for.  Idempotent."""
        if self._lease.detach() is not None:
            self._connection.release()

    def share_write_rate(self, writers: int) -> None:
        """Start at a share of a key range's write rate: one of ``writers`` pacers writing at once (S3; nothing here)."""

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if not self._lease.alive:
            raise RuntimeError(f"{self.url}: the store is closed")
        return self._connection.executor()

    # -- futures API (the primitives) --------------------------------------------

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
        """Write ``data`` (any bytes-like object) as ``key``.

        ``if_none_match``: only if ``key`` does not exist; ``if_match``: only
        if its current ETag (see ``get_with_etag``) is this one.  Otherwise
        ``ConditionalWriteError``, and nothing is written.  On S3, a refused
        condition where the object already holds exactly ``data`` counts as
        success: it is this write's own earlier attempt, whose response was lost.

        For object stores: ``metadata`` is stored as the object's user
        metadata (``head``), no attempt starts after ``deadline`` (a
        ``time.monotonic()`` value), and ``tries`` records the attempts.
        A filesystem writes at once and answers every time, so these are
        not needed there.
        """
        return self._executor().submit(
            self._retrying, "PUT", key, lambda: self._put_blocking(key, data, if_none_match, if_match)
        )

    def get_range_async(self, key: str, start: int, end: int, sink=None) -> concurrent.futures.Future:
        """Bytes ``[start, end)`` of ``key``; raises ``CorruptCheckpointError`` if fewer exist.

        With ``sink``, the bytes land there instead and the future's result
        is ``None``: the store calls ``sink.write(offset, chunk)`` (``offset``
        relative to ``start``) for pieces that together cover the range, one
        call at a time, from one thread.  It may write a byte more than once
        (a retried GET writes its part again) and pieces need not come in
        order; a sink may keep a ``chunk`` it is given, which nobody reuses.
        """

        def op():
            data = self._checked_range(key, start, end, self._get_blocking(key, start, end))
            if sink is None:
                return data
            sink.write(0, memoryview(data))
            return None

        return self._executor().submit(self._retrying, "GET", key, op)

    # -- blocking API ---------------------------------------------------------

    def put(self, key: str, data, **options) -> None:
        """``put_async(key, data, **options)``, waited for."""
        self.put_async(key, data, **options).result()

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

    def head(self, key: str) -> ObjectHead:
        """The object's size, ETag and user metadata; ``ObjectNotFoundError`` if there is none."""
        return ObjectHead(self.size(key))

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
                    etag=_listing_tag(info),
                )
                for path, info in found.items()
                if info.get("type", "file") != "directory"
            ]

        return sorted(self._retrying("LIST", prefix, op), key=lambda o: o.key)

    def list_folders(self) -> list[str]:
        """The names of the folders directly under the root (one listing, not of every object below them), sorted."""

        def op():
            try:
                entries = self.fs.ls(self.root, detail=True)
            except FileNotFoundError:
                return []
            return [self._relative(e["name"]).strip("/") for e in entries if e.get("type") == "directory"]

        return sorted(self._retrying("LIST", "", op))

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._retrying("DELETE", key, lambda k=key: self.fs.rm_file(self._path(k)))

    def delete_if_unchanged(self, objects: dict[str, str | None]) -> list[str]:
        """Delete each of ``objects`` (key -> the ETag it was listed or written with) only while it is still that object; the keys left because they changed.

        What every deciding delete uses (gc, retention, a failed save's
        cleanup): an object rewritten since the decision is not the one
        decided on.  S3 checks the ETag itself (``DeleteObjects``); here the
        tag is what ``list`` reports (size and modification time, see
        ``_listing_tag``), checked then deleted under a process-wide lock:
        exact within one process.  ``None``: nothing to hold it to, deleted
        unconditionally.  A key already gone counts as deleted.
        """
        changed = []
        with conditional_lock:
            for key, etag in objects.items():
                if etag is not None:
                    try:
                        current = self._retrying("HEAD", key, lambda k=key: _listing_tag(self.fs.info(self._path(k))))
                    except ObjectNotFoundError:
                        continue
                    if current != etag:
                        changed.append(key)
                        continue
                try:
                    self.delete([key])
                except ObjectNotFoundError:
                    pass
        return changed

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

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Abort one multipart upload; only object stores have them."""
        raise NotImplementedError

    def upload_last_active(self, upload: MultipartUploadInfo) -> float | None:
        """When the upload last changed: its newest part's time (``ListParts``), or when it began if it has none.

        An upload's start says nothing about whether it still runs: a 50 GB
        object over a shared link, or a throttled one, sends parts for hours.
        ``None``: it is gone (completed or aborted).  Only object stores have uploads.
        """
        return upload.initiated

    def server_time(self) -> float:
        """The storage server's clock now (seconds since the epoch), which stamps its objects' times.

        Ages of objects are measured on it, never on this host's clock: a
        host whose clock runs ahead would see live saves as old.  Here, for
        fsspec's filesystems, this host's clock: right for a local disk and
        ``memory://``; a shared filesystem (NFS, Lustre) stamps files with
        its server's clock, which must then be kept in sync.
        """
        return time.time()

    def settle_aborts(self) -> None:
        """Finish the aborts of this store's uploads that failed during a save; warn of any left open.

        Object stores only: ``ObjectStoreWriter.close`` calls it, so no
        upload stays open behind a clean ``close()`` without a warning.
        """

    def open_writer(self, key: str, *, crc32: bool = False, create_only: bool = False) -> "ObjectWriter":
        """A write-only stream; the object appears when ``close()`` returns.

        ``create_only``: the object is made only if ``key`` does not exist
        (``If-None-Match: *`` on the PUT or the multipart completion), else
        ``close()`` raises ``ConditionalWriteError`` and nothing is written:
        what a save's shards are written with, whose names no earlier save
        used, so that a name used twice fails loudly instead of replacing a
        committed checkpoint's bytes.  Ceph RGW 16.2 ignores the condition
        on a multipart completion (docs/development.md).

        ``crc32``: send each request body's CRC32, which S3 checks against
        the bytes it receives (a body damaged on the way is refused, and sent
        again) and keeps with the object.  For objects that no ``.metadata``
        crc32 covers (the Hugging Face export's shards).  Some S3-compatible
        servers ignore the header (Ceph RGW 16.2) and a few refuse it.  A
        local file has no hop to check: ignored here.
        """
        return _BufferedObjectWriter(self, key, create_only)

    # -- implementation hooks ----------------------------------------------------

    def _put_blocking(self, key: str, data, if_none_match: bool, if_match: str | None) -> None:
        if not (if_none_match or if_match):
            self._write(key, data)
            return
        # Generic fsspec filesystems have no conditional writes: check, then
        # write, under a process-wide lock.  Exact within one process (as for
        # memory://); across processes it is a check-then-act race, as
        # docs/guarantees.md says ("Two jobs on one root").
        with conditional_lock:
            self._check_condition(key, if_none_match, if_match)
            self._write(key, data)

    def _check_condition(self, key: str, if_none_match: bool, if_match: str | None) -> None:
        try:
            _, current = self.get_with_etag(key)
        except ObjectNotFoundError:
            current = None
        refuse_unless_condition_holds(self.url_for(key), current, if_none_match, if_match)

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

    def _relative(self, path: str) -> str:
        path = path.rstrip("/")
        root = self.root.lstrip("/")
        path_stripped = path.lstrip("/")
        if path_stripped.startswith(root):
            return path_stripped[len(root) :].lstrip("/")
        return path_stripped

    def _checked_range(self, key: str, start: int, end: int, data) -> bytes:
        self._check_range_length(key, start, end, len(data))
        return data

    def _check_range_length(self, key: str, start: int, end: int, received: int) -> None:
        if received < end - start:
            raise CorruptCheckpointError(
                f"{self.url_for(key)}: object is truncated: expected bytes [{start}, {end}) "
                f"but only {received} of {end - start} came back"
            )
        if received > end - start:
            raise CorruptCheckpointError(
                f"{self.url_for(key)}: asked for bytes [{start}, {end}) but {received} bytes came back "
                "(the server ignored the Range header)"
            )

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
            raise gave_up(op, self.url_for(key), attempt + 1, exc) from exc
        delay = policy.backoff(attempt)
        logger.info("%s %s failed (%s); retry %d in %.2fs", op, self.url_for(key), exc, attempt + 1, delay)
        return delay


conditional_lock = threading.Lock()


def refuse_unless_condition_holds(url: str, current: str | None, if_none_match: bool, if_match: str | None) -> None:
    """``ConditionalWriteError`` unless the object's ``current`` tag (``None``: absent) meets the condition.

    Tags compare without quotes: S3 quotes ETags, callers may not.
    """
    if if_none_match and current is not None:
        raise ConditionalWriteError(f"{url}: object already exists")
    if if_match and (current is None or current.strip('"') != if_match.strip('"')):
        state = "no longer exists" if current is None else f"changed (ETag {current}, expected {if_match})"
        raise ConditionalWriteError(f"{url}: object {state}")


class CopyInterrupted(Exception):
    """A ``copy_range`` failed after some of its bytes were appended: the object must be written again, without copies."""


class ObjectWriter:
    """A write-only, append-only object stream (what ``torch.save`` writes into)."""

    #: The finished object's ETag, where the store reports one (set by ``close``).
    etag: str | None = None

    def write(self, data) -> int:
        raise NotImplementedError

    def write_lent(self, data, owner: object) -> int:
        """``write(data)``, where the caller keeps ``data``'s bytes unchanged until ``close()`` or ``abort()`` returns.

        A writer may then send them from where they lie, with no copy;
        ``owner`` is what keeps that memory alive (a tensor), held as long
        as the bytes are.  By default they are copied like any others.
        """
        return self.write(data)

    def tell(self) -> int:
        raise NotImplementedError

    def copy_range(self, source: str, start: int, length: int, etag: str | None) -> int:
        """Append bytes ``[start, start + length)`` of the object at ``source`` (``ObjectStore.location``) without sending them; the copy requests that did.

        The server copies them, if the source still is the object tagged
        ``etag`` (``None``: whatever it is now).  0 (nothing appended) when it cannot: this store
        has no server-side copy (the default), the writer sends each part's
        CRC32 (``open_writer(crc32=True)``), the range cannot form whole
        parts here, the source is gone or changed, or the copy failed after
        its retries.  The caller then writes the bytes itself.  A range
        copied in several requests whose later one fails raises
        ``CopyInterrupted``: some bytes are appended, so the caller aborts
        the object and writes it again.
        """
        return 0

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

    def __init__(self, store: ObjectStore, key: str, create_only: bool):
        self._store, self._key, self._create_only = store, key, create_only
        self._buf = bytearray()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._buf += view
        return len(view)

    def tell(self) -> int:
        return len(self._buf)

    def close(self) -> None:
        self._store.put(self._key, self._buf, if_none_match=self._create_only)
        self._buf = bytearray()

    def abort(self) -> None:
        self._buf = bytearray()


def _listing_tag(info: dict) -> str:
    """What a filesystem listing says of an object in place of an ETag: its size and modification time.

    Reading every object to hash it would make a listing cost the bytes it
    lists; a rewrite changes the time (a new file, or ``memory://``'s new
    object), which is what a deciding delete must notice.
    """
    return f"{int(info.get('size') or 0)}@{_mtime(info)}"


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
