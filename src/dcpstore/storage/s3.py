"""``s3://``: the S3 store, on the aiobotocore client that s3fs configures.

Credentials, endpoint and profile come from s3fs and botocore as usual;
requests go to the client directly rather than through s3fs's file API,
because checkpoint traffic needs three things that API does not give:
parallel multipart uploads fed from reused buffers (``multipart``), one
retry policy that the caller controls (``s3_requests``), and errors
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
import logging
import random
import time
import uuid
from typing import Any, Iterable

from ..errors import ConditionalWriteError, CorruptCheckpointError, ObjectNotFoundError, UnsupportedByStoreError
from .base import (
    MultipartUploadInfo,
    ObjectHead,
    ObjectInfo,
    ObjectWriter,
    WRITE_TOKEN_KEY,
    Tries,
    refuse_unless_condition_holds,
)
from .body import BufferSink, body_nbytes
from .multipart import MultipartObjectWriter, put_in_parts
from .s3_requests import S3Requests

logger = logging.getLogger(__name__)

S3_SCHEMES = ("s3", "s3a")
ABORT_ROUNDS = 5  # background rounds of a failed abort, each under the retry policy, max_backoff apart


class S3ObjectStore(S3Requests):
    """The S3 store: parallel multipart uploads, ranged reads, one retry policy (``s3_requests``)."""

    has_buckets = True
    has_user_metadata = True
    server_side_copy = True  # UploadPartCopy

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
            if resp.get("ETag"):
                self.read_etags[key] = resp["ETag"]

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
                        etag=obj.get("ETag") or None,
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
        self.delete_if_unchanged(dict.fromkeys(keys))

    def delete_if_unchanged(self, objects: dict[str, str | None]) -> list[str]:
        """See ``ObjectStore.delete_if_unchanged``: ``DeleteObjects`` of up to 1,000 keys a request, each with its ``ETag`` element.

        S3 deletes an object so tagged only while its ETag matches, and
        answers ``PreconditionFailed`` for it otherwise (moto 5.2 ignores
        the element; the test proxy models S3's answer).
        """
        keys, changed = list(objects), []
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            bucket = self._split(batch[0])[0]
            entries = [{"Key": self._split(k)[1], **({"ETag": objects[k]} if objects[k] else {})} for k in batch]
            resp = self._run(self._call("DELETE", batch[0], "delete_objects", Bucket=bucket, Delete={"Objects": entries, "Quiet": True}))
            for err in resp.get("Errors", []):
                key = self._relative(f"{bucket}/{err.get('Key')}")
                if err.get("Code") == "PreconditionFailed":
                    changed.append(key)
                elif err.get("Code") != "NoSuchKey":
                    raise OSError(f"{self.url_for(key)}: delete failed ({err.get('Code')}: {err.get('Message')})")
        return changed

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

    async def _abort_others(self, key: str, keep: str) -> None:
        """Abort every open upload of exactly ``key`` but ``keep`` (a shard key is one save's alone: the others leaked)."""
        for upload in await self._list_uploads(key, folder=False):
            if upload.key == key and upload.upload_id != keep:
                await self._abort(upload.key, upload.upload_id, in_save=False)

    def look_for_leaked_uploads_at_close(self, key: str, keep: str) -> None:
        """Have ``settle_aborts`` abort any other upload of ``key`` than ``keep``: a create that may land unseen, after its own look."""
        self._connection.leak_checks.add((self, key, keep))

    def settle_aborts(self) -> None:
        for owner, key, keep in list(self._connection.leak_checks):  # any store's, as below
            self._connection.leak_checks.discard((owner, key, keep))
            try:
                self._run(owner._abort_others(key, keep))
            except Exception as e:  # noqa: BLE001
                logger.warning("%s: could not look for leaked multipart uploads (%s); `dcpstore gc %s` removes any",
                               owner.url_for(key), e, owner.url)
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

    def open_writer(self, key: str, *, crc32: bool = False, create_only: bool = False) -> ObjectWriter:
        return MultipartObjectWriter(self, key, self._connection.parts, crc32=crc32, create_only=create_only)


