"""Objects sent to S3 in parts: streamed while the producer writes, or from memory.

boto3's transfer manager and s3fs's file objects upload from a file or from
their own buffers; ``torch.save`` instead writes an archive of unknown size
into a stream, and checkpoint memory must stay bounded.  So dcpstore keeps
its own writer: ``torch.save`` output lands in pooled part buffers, each
full buffer is uploaded (with no copy) while the next one fills, and the
pool bounds how many parts are in flight.

``put_in_parts`` sends a large object that is already in memory (a
``.metadata`` of thousands of ranks, the resume index) as views of it, and
completes the upload under the PUT's condition: S3 honours ``If-None-Match``
and ``If-Match`` on CompleteMultipartUpload, so a commit past
``TransferConfig.multipart_threshold`` is exactly as conditional as a small
one, and no object shows before every part is in.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import logging
import uuid
import zlib
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ConditionalWriteError, ObjectNotFoundError, UnsupportedByStoreError
from .base import WRITE_TOKEN_KEY, CopyInterrupted, ObjectWriter, Tries
from .body import Segments
from .config import MiB

if TYPE_CHECKING:
    import mmap

    from .base import MultipartUploadInfo
    from .config import TransferConfig
    from .connection import PartBufferPool

logger = logging.getLogger(__name__)

#: S3's smallest part but the last, and its largest copied part (UploadPartCopy).
MIN_PART_SIZE = 5 * MiB
MAX_COPY_PART_SIZE = 5 * 1024 * MiB


class PartStore(Protocol):
    """What a multipart upload needs of its store (``S3ObjectStore``): its request loop and its aborts.

    Named here so that this module does not import the store it serves.
    """

    transfer: TransferConfig
    has_user_metadata: bool

    def url_for(self, key: str) -> str: ...
    def _split(self, key: str) -> tuple[str, str]: ...
    def _submit(self, coro) -> concurrent.futures.Future: ...
    def _run(self, coro) -> Any: ...
    async def _call(self, op: str, key: str, method: str, **kwargs) -> Any: ...
    async def _list_uploads(self, prefix: str, folder: bool = True) -> list[MultipartUploadInfo]: ...
    async def _abort(self, key: str, upload_id: str, *, in_save: bool = True) -> None: ...
    def abort_upload(self, key: str, upload_id: str) -> None: ...
    def abort_later(self, key: str, upload_id: str) -> None: ...
    async def _abort_others(self, key: str, keep: str) -> None: ...
    def look_for_leaked_uploads_at_close(self, key: str, keep: str) -> None: ...
    async def _check_condition_async(self, key: str, if_none_match: bool, if_match: str | None) -> None: ...


class MultipartObjectWriter(ObjectWriter):
    """Streams an object to S3 in parts while the producer keeps writing.

    Bytes written are copied into ``part_size`` buffers from the pool; bytes
    lent (``write_lent``: a tensor's data, which its owner keeps unchanged
    until the object is closed) are not copied at all, unless there are
    fewer than ``LEND_MIN_BYTES`` of them: a part is the
    sequence of pieces that fill it, views of part buffers and of lent
    memory, sent one after the other as one body (``body.Segments``).  A
    full part is uploaded in the background (at most ``max_concurrency``
    parts in flight per connection, which is the backpressure that bounds
    host memory) and takes the part buffer it used with it, back to the pool
    when it is done, along with its hold on lent memory.  An object that
    never fills one part goes up as a single PUT.  Any failure aborts the
    multipart upload, so no orphaned parts remain.

    With ``crc32``, every body goes with its CRC32 (``x-amz-checksum-crc32``,
    computed once per part, 0.15 CPU s/GiB here): S3 refuses a body that
    does not match it (``BadDigest``, retried with the same bytes) and keeps
    the object's checksum (a multipart object's: the CRC32 of its parts'
    CRC32s, each listed in the completion).  Parts are then never copied
    (``copy_range`` answers 0): a copied part's checksum would be the
    server's alone.

    With ``create_only`` (see ``ObjectStore.open_writer``) the PUT or the
    completion carries ``If-None-Match: *`` and the object a token of its
    own (``WRITE_TOKEN_KEY``): a retry refused because an earlier attempt
    of ours landed unseen is told from another writer's object by one HEAD.
    """

    #: Lent bytes fewer than this are copied: a piece of its own costs its body a
    #: socket write and a drain, more than copying a small tensor (ViewBody.SLICE_BYTES).
    LEND_MIN_BYTES = 256 << 10

    def __init__(self, store: PartStore, key: str, parts: PartBufferPool, *, crc32: bool = False, create_only: bool = False):
        self._store, self._key, self._pool = store, key, parts
        self._token = uuid.uuid4().hex if create_only else None  # see _landed_earlier
        self._crc32s: list[str] | None = [] if crc32 else None  # each part's, as S3 spells it
        self._bucket, self._path = store._split(key)
        self._buf: mmap.mmap | None = None
        self._fill = 0  # bytes of _buf written
        self._sealed = 0  # of those, bytes already among the pieces
        self._pieces: list[memoryview] = []  # the next part's bytes, in order, but for _buf[_sealed:_fill]
        self._owners: list[object] = []  # what keeps the lent pieces alive
        self._pending = 0  # bytes of the next part: the pieces and _buf[_sealed:_fill]
        self._pos = 0
        self._upload_id: str | None = None
        self._parts: list[concurrent.futures.Future] = []
        self._closed = False
        self._sources: dict[str, str | None] = {}  # copy sources looked at: the ETag to copy each under, None if it cannot be
        self._copied: set[str] = set()  # sources parts were copied from, looked at again before the completion

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        size = self._pool.part_size
        written = 0
        while written < len(view):
            if self._buf is None:
                self._buf = self._pool.take()
                self._fill = self._sealed = 0
            n = min(size - self._pending, len(view) - written)
            self._buf[self._fill : self._fill + n] = view[written : written + n]
            self._fill += n
            self._pending += n
            written += n
            if self._pending == size:
                self._flush_part()
        self._pos += written
        return written

    def write_lent(self, data, owner: object) -> int:
        view = memoryview(data).cast("B")
        if len(view) < self.LEND_MIN_BYTES:
            return self.write(view)
        size = self._pool.part_size
        written = 0
        while written < len(view):
            self._seal()
            n = min(size - self._pending, len(view) - written)
            self._pieces.append(view[written : written + n])
            self._owners.append(owner)
            self._pending += n
            written += n
            if self._pending == size:
                self._flush_part()
        self._pos += written
        return written

    def tell(self) -> int:
        return self._pos

    def copy_range(self, source: str, start: int, length: int, etag: str | None) -> int:
        """Append a range of ``source`` as parts the server copies (``UploadPartCopy``); see ``ObjectWriter.copy_range``.

        Every part but the last must hold 5 MiB, and a copied one at most
        5 GiB: a range shorter than 5 MiB is refused, a longer one than
        5 GiB is copied as several equal parts, and any range is refused
        while the part being filled holds some bytes but fewer than 5 MiB
        (the caller writes more first).  The source is checked by one HEAD
        per source and writer (size and ETag; S3 also enforces
        ``CopySourceIfMatch``, which moto and Ceph RGW 16.2 ignore).  The
        copies are made on the caller's thread, each retried as any request:
        a first one that fails leaves the object as it was; a later one
        raises ``CopyInterrupted``.
        """
        if self._crc32s is not None or length < MIN_PART_SIZE or 0 < self._pending < MIN_PART_SIZE:
            return 0
        etag = self._source_etag(source, start + length, etag)
        if etag is None:
            return 0
        if self._pending:
            self._flush_part()
        if self._upload_id is None:
            self._upload_id = self._store._run(self._create_upload())
        source_bucket, _, source_key = source.partition("/")
        parts = -(-length // MAX_COPY_PART_SIZE)
        bounds = [start + length * k // parts for k in range(parts + 1)]
        for k, (first, end) in enumerate(zip(bounds, bounds[1:])):
            span = f"bytes={first}-{end - 1}"
            try:
                resp = self._store._run(
                    self._store._call(
                        "COPY-PART", self._key, "upload_part_copy",
                        Bucket=self._bucket, Key=self._path, UploadId=self._upload_id, PartNumber=len(self._parts) + 1,
                        CopySource={"Bucket": source_bucket, "Key": source_key}, CopySourceRange=span, CopySourceIfMatch=etag,
                    )
                )
                part_etag = resp["CopyPartResult"]["ETag"]
            except Exception as e:  # noqa: BLE001 - the caller sends the bytes instead
                self._sources[source] = None
                if k:
                    raise CopyInterrupted(f"{self._store.url_for(self._key)}: copying {span} of {source} failed after {k} of {parts} parts: {e}") from e
                logger.warning("%s: could not copy %s of %s (%s); sending the bytes", self._store.url_for(self._key), span, source, e)
                return 0
            copied: concurrent.futures.Future = concurrent.futures.Future()
            copied.set_result({"ETag": part_etag})
            self._parts.append(copied)
            self._copied.add(source)
            self._pos += end - first
        return parts

    def _source_etag(self, source: str, end: int, etag: str | None) -> str | None:
        """The ETag to copy ``source`` under: ``etag`` (or, if ``None``, the current one) if it holds ``end`` bytes; ``None`` if it cannot be copied from.

        One HEAD per source: it is gone (pruned), changed since it was
        written, shorter, or unreadable, and the bytes are sent.
        """
        if source not in self._sources:
            bucket, _, key = source.partition("/")
            try:
                head = self._store._run(self._store._call("HEAD", self._key, "head_object", Bucket=bucket, Key=key))
            except Exception as e:  # noqa: BLE001 - the bytes are sent
                logger.info("%s: cannot copy from %s (%s); sending the bytes", self._store.url_for(self._key), source, e)
                self._sources[source] = None
            else:
                current, size = head.get("ETag"), int(head["ContentLength"])
                usable = current is not None and (etag is None or current == etag) and size >= end
                if not usable:
                    logger.warning(
                        "%s: %s is not the object written (ETag %s, %d bytes; expected %s, at least %d); sending the bytes",
                        self._store.url_for(self._key), source, current, size, etag, end,
                    )
                self._sources[source] = current if usable else None
        return self._sources[source]

    def _seal(self) -> None:
        """Make the bytes copied into the part buffer since the last piece a piece of their own."""
        if self._buf is not None and self._fill > self._sealed:
            self._pieces.append(memoryview(self._buf)[self._sealed : self._fill])
            self._sealed = self._fill

    def _take_part(self):
        """The next part's body, and the part buffer and owners it holds, which the writer lets go of."""
        self._seal()
        pieces, owners, buf = self._pieces, self._owners, self._buf
        self._pieces, self._owners, self._pending = [], [], 0
        self._buf, self._fill, self._sealed = None, 0, 0
        body = pieces[0] if len(pieces) == 1 else Segments(pieces)
        return body, buf, owners

    def _checksum(self, body) -> dict[str, str]:
        """The request parameter that carries ``body``'s CRC32, as S3 spells it; none without ``crc32``."""
        if self._crc32s is None:
            return {}
        crc = 0
        for view in body.views if isinstance(body, Segments) else (body,):
            crc = zlib.crc32(view, crc)
        return {"ChecksumCRC32": base64.b64encode(crc.to_bytes(4, "big")).decode()}

    def _flush_part(self) -> None:
        if self._upload_id is None:
            self._upload_id = self._store._run(self._create_upload())
        body, buf, owners = self._take_part()
        number = len(self._parts) + 1
        checksum = self._checksum(body)
        if self._crc32s is not None:
            self._crc32s.append(checksum["ChecksumCRC32"])  # listed again in the completion, part by part
        self._pool.in_flight.acquire()
        fut = self._store._submit(
            self._store._call(
                "UPLOAD-PART",
                self._key,
                "upload_part",
                Bucket=self._bucket,
                Key=self._path,
                UploadId=self._upload_id,
                PartNumber=number,
                body=body,
                **checksum,
            )
        )

        def release(_f, buf=buf, owners=owners):
            self._pool.in_flight.release()
            if buf is not None:
                self._pool.give_back(buf)
            owners.clear()

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
            if self._upload_id is None and (len(self._pieces) == 0 or self._pending <= self._store.transfer.multipart_threshold):
                body, buf, owners = self._take_part() if self._pending else (b"", None, [])
                try:
                    self._store._run(self._put_whole(body))
                finally:
                    if buf is not None:
                        self._pool.give_back(buf)
                    owners.clear()
                return
            if self._pending:
                self._flush_part()
            etags = [f.result()["ETag"] for f in self._parts]
            if self._copied:
                self._store._run(self._check_copy_sources())
            self._store._run(self._complete_upload(etags))
        except BaseException:
            self._abort_upload()
            raise

    def abort(self) -> None:
        self._closed = True
        self._abort_upload()

    def _tagged(self) -> dict[str, Any]:
        """The user metadata a ``create_only`` object carries: its write token."""
        return {"Metadata": {WRITE_TOKEN_KEY: self._token}} if self._token else {}

    async def _conditionally(self, op: str, method: str, tries: Tries, **kwargs) -> dict:
        """``method`` (the PUT or the completion), under ``If-None-Match: *`` when ``create_only``.

        A server that does not implement the condition (501) gets the
        request again without it, with a warning: the names a save writes
        are fresh, so the condition only catches what should never happen.
        """
        if self._token is None:
            return await self._store._call(op, self._key, method, tries=tries, Bucket=self._bucket, Key=self._path, **kwargs)
        try:
            return await self._store._call(
                op, self._key, method, tries=tries, Bucket=self._bucket, Key=self._path, IfNoneMatch="*", **kwargs
            )
        except UnsupportedByStoreError:
            logger.warning("%s: the server does not implement If-None-Match; written without it", self._store.url_for(self._key))
            return await self._store._call(op, self._key, method, tries=tries, Bucket=self._bucket, Key=self._path, **kwargs)

    async def _put_whole(self, body) -> None:
        """The object as one PUT, whose answer holds the ETag."""
        tries = Tries()
        try:
            resp = await self._conditionally("PUT", "put_object", tries, body=body, **self._checksum(body), **self._tagged())
        except ConditionalWriteError:
            if await self._landed_earlier(tries):
                return
            raise
        self.etag = resp.get("ETag") or None

    async def _landed_earlier(self, tries: Tries) -> bool:
        """After a retried write was refused (412) or its upload was gone (``NoSuchUpload``): whether an earlier attempt made our object.

        One HEAD: our write token where the object has one (``create_only``;
        also after aiohttp's own resend of a PUT whose kept-alive connection
        dropped, which ``tries`` does not count), else our size after a
        retry of ours (the key is this writer's alone).  If so, the object
        is ours and nothing is left to abort.
        """
        if self._token is None and tries.count < 2:
            return False
        try:
            head = await self._store._call("HEAD", self._key, "head_object", Bucket=self._bucket, Key=self._path)
        except ObjectNotFoundError:
            return False
        token = head.get("Metadata", {}).get(WRITE_TOKEN_KEY)
        if self._token is not None and (token is not None or self._store.has_user_metadata):
            ours = token == self._token
        else:  # no token sent, or a server that drops user metadata
            ours = int(head["ContentLength"]) == self._pos
        if not ours:
            return False
        self._upload_id = None
        self.etag = head.get("ETag") or None
        return True

    async def _check_copy_sources(self) -> None:
        """Raise ``CopyInterrupted`` if a source copied from is no longer the object its parts were copied under.

        S3 copies a part only from the source tagged ``CopySourceIfMatch``;
        moto and Ceph RGW 16.2 ignore that header, so a source rewritten
        between its HEAD and the copy would be copied as it is now.  One HEAD
        per source, after its copies and before the completion, closes that:
        an ETag that changed means a copied part may hold other bytes, and
        the caller writes the object again, every byte sent.
        """
        for source in sorted(self._copied):
            bucket, _, key = source.partition("/")
            try:
                head = await self._store._call("HEAD", self._key, "head_object", Bucket=bucket, Key=key)
                current = head.get("ETag")
            except Exception as e:  # noqa: BLE001 - unverified: the bytes are sent
                current = f"unreadable ({e})"
            if current != self._sources.get(source):
                raise CopyInterrupted(
                    f"{self._store.url_for(self._key)}: {source} changed while parts were copied from it "
                    f"(ETag {current}, copied under {self._sources.get(source)})"
                )

    async def _create_upload(self) -> str:
        """Start the multipart upload; abort any that a lost response leaked.

        When an attempt's response is lost, S3 may still have created an
        upload that no one knows the id of.  Shard keys are unique to one
        save of one rank (see ``ObjectStoreWriter``), so any other open
        upload of exactly this key is such a leak: looked for now, and, where
        an attempt may still land (a 5xx a gateway sent while the store went
        on), again when the store's owner closes.
        """
        store, tries = self._store, Tries()
        algorithm = {} if self._crc32s is None else {"ChecksumAlgorithm": "CRC32"}
        resp = await store._call(
            "CREATE-MPU", self._key, "create_multipart_upload", tries=tries, Bucket=self._bucket, Key=self._path,
            **algorithm, **self._tagged(),
        )
        upload_id = resp["UploadId"]
        if tries.count > 1:
            try:
                await store._abort_others(self._key, upload_id)
            except Exception as e:  # noqa: BLE001 - gc reclaims what this misses
                logger.warning("%s: could not look for leaked multipart uploads: %s", store.url_for(self._key), e)
        if tries.may_have_landed:
            # An attempt answered 5xx (or not at all) may still create an upload after this look:
            # the store's owner looks again as it closes (settle_aborts).
            store.look_for_leaked_uploads_at_close(self._key, upload_id)
        return upload_id

    async def _complete_upload(self, etags: list[str]) -> None:
        """Complete the upload; after a lost success response, confirm by HEAD.

        A retried CompleteMultipartUpload whose first attempt succeeded is
        answered ``NoSuchUpload`` (or, under ``create_only``, 412); the
        object then is ours (``_landed_earlier``), and that is success.
        """
        parts = [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]
        if self._crc32s is not None:  # S3 refuses a completion that leaves out a part's checksum
            for part, crc in zip(parts, self._crc32s, strict=True):
                part["ChecksumCRC32"] = crc
        tries = Tries()
        try:
            resp = await self._conditionally(
                "COMPLETE-MPU", "complete_multipart_upload", tries, UploadId=self._upload_id, MultipartUpload={"Parts": parts}
            )
            self.etag = resp.get("ETag") or None  # Ceph RGW 16.2 answers an empty one: taken from a HEAD when needed
        except (ObjectNotFoundError, ConditionalWriteError):
            if await self._landed_earlier(tries):
                return
            raise

    def _release_current(self) -> None:
        self._pieces, self._owners, self._pending = [], [], 0
        if self._buf is not None:
            self._pool.give_back(self._buf)
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
            except Exception as e:  # noqa: BLE001 - tried again in the background, and at close
                logger.info("could not abort multipart upload of %s yet: %s", self._store.url_for(self._key), e)
                self._store.abort_later(self._key, self._upload_id)


async def put_in_parts(store: PartStore, key: str, data, request: dict, **conditions) -> None:
    """Upload ``data`` (bytes-like) to ``key`` as a multipart upload, completed under ``conditions``.

    ``request``: what the PUT would carry (``Metadata``, and the caller's
    ``deadline`` and ``tries``).  The object's user metadata goes on
    CreateMultipartUpload; ``deadline`` bounds every request; ``tries``
    counts the CompleteMultipartUpload attempts, the only request that makes
    the object appear (and so the only one whose lost answer can leave the
    outcome unknown).  The condition is also checked by a HEAD just before
    the completion, for servers that do not enforce it there (Ceph RGW
    16.2: see docs/development.md).  Parts are views of ``data``, at most
    ``max_concurrency`` in flight.  Any failure aborts the upload: a refused
    or failed commit leaves no parts behind (or ``abort_later`` keeps
    trying).  A retried completion answered ``NoSuchUpload`` means an
    earlier attempt completed it; the caller's read-back (``_holds``)
    tells whether the object is ours.
    """
    bucket, path = store._split(key)
    deadline, tries = request.get("deadline"), request.get("tries")
    extra = {"Metadata": request["Metadata"]} if request.get("Metadata") else {}
    created = await store._call(
        "CREATE-MPU", key, "create_multipart_upload", deadline=deadline, Bucket=bucket, Key=path, **extra
    )
    upload_id = created["UploadId"]
    view = memoryview(data).cast("B")
    size = store.transfer.part_size
    slots = asyncio.Semaphore(store.transfer.max_concurrency)

    async def send(number: int) -> str:
        async with slots:
            resp = await store._call(
                "UPLOAD-PART", key, "upload_part", deadline=deadline,
                Bucket=bucket, Key=path, UploadId=upload_id, PartNumber=number + 1,
                body=view[number * size : (number + 1) * size],
            )
        return resp["ETag"]

    try:
        etags = await asyncio.gather(*(send(n) for n in range(max(1, -(-len(view) // size)))))
        if conditions:
            # Ceph RGW (16.2) ignores both conditions on the completion; a HEAD
            # just before narrows what it lets through to one round trip.
            await store._check_condition_async(key, "IfNoneMatch" in conditions, conditions.get("IfMatch"))
        await store._call(
            "COMPLETE-MPU", key, "complete_multipart_upload", deadline=deadline, tries=tries,
            Bucket=bucket, Key=path, UploadId=upload_id,
            MultipartUpload={"Parts": [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]},
            **conditions,
        )
    except BaseException as e:
        if isinstance(e, ObjectNotFoundError) and tries is not None and tries.count > 1:
            raise  # NoSuchUpload to a retried completion: an earlier attempt completed it
        try:
            await store._abort(key, upload_id)
        except Exception as abort_error:  # noqa: BLE001 - kept trying in the background, and at close
            logger.info("could not abort multipart upload of %s yet: %s", store.url_for(key), abort_error)
            store.abort_later(key, upload_id)
        raise
