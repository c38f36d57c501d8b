"""Request bodies sent from the caller's memory: no copy, no chunked re-read.

A part of a shard lives in a pooled buffer that ``torch.save`` wrote into
(``multipart``).  Handing botocore a file over it (what boto3 does) makes
aiohttp read it back in 64 KiB chunks on an executor thread, one copy and
one thread hop per chunk; handing aiohttp the buffer as ``bytes`` would
need a copy to make the ``bytes``.  ``ViewBody`` is an aiohttp payload over
a ``memoryview`` that botocore also accepts: botocore takes any object with
``read`` as a blob, and aiobotocore passes a body that is not an
``io.IOBase`` to aiohttp unchanged, which sends a payload by calling its
``write_with_length``.

There the view goes to the socket in slices.  asyncio's transport sends a
write straight from the caller's memory when its own buffer is empty and
copies only what the kernel did not take, so each slice is written once the
buffer has drained completely (write-buffer limits of zero while the body is
sent).  The headers go first, on their own: aiohttp coalesces headers and
body with a join, which copies the body, on Python before 3.12.9.

``ViewFile`` is the file-like side of the same idea, for readers that want
a file over bytes already in memory, possibly in several pieces (an archive
whose data region landed in a tensor, its head and tail in buffers):
``io.BytesIO`` copies a ``memoryview`` or ``bytearray`` it is given.
``BufferSink`` is the simplest place a ranged read can land its body
(see ``ObjectStore.get_range_async``): one buffer.
"""

from __future__ import annotations

import bisect
import io
import itertools

from aiohttp.payload import Payload


class ViewFile(io.RawIOBase):
    """A seekable, read-only file over ``views`` end to end: reads copy only the bytes asked for."""

    def __init__(self, *views):
        super().__init__()
        self._views = [memoryview(v).cast("B") for v in views]
        self._starts = list(itertools.accumulate((v.nbytes for v in self._views), initial=0))
        self._size, self._pos = self._starts[-1], 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        pos = self._pos
        n = max(0, min(len(out), self._size - pos))
        if n == 0:
            return 0
        i = bisect.bisect_right(self._starts, pos) - 1
        if pos + n <= self._starts[i + 1]:  # within one view: torch's reader asks for headers and records
            lo = pos - self._starts[i]
            out[:n] = self._views[i][lo : lo + n]
        else:
            done = 0
            while done < n:
                view, lo = self._views[i], pos + done - self._starts[i]
                k = min(view.nbytes - lo, n - done)
                out[done : done + k] = view[lo : lo + k]
                done, i = done + k, i + 1
        self._pos = pos + n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


class BufferSink:
    """Where a ranged read lands: bytes ``[offset, offset + len(chunk))`` of the range go to ``view`` there."""

    def __init__(self, view: memoryview):
        self.view = view

    def write(self, offset: int, chunk: memoryview) -> None:
        self.view[offset : offset + len(chunk)] = chunk


class Segments:
    """One request body held in several buffers end to end (a part's header bytes and a tensor's data), never joined."""

    def __init__(self, views):
        self.views = tuple(memoryview(v).cast("B") for v in views)
        self.nbytes = sum(v.nbytes for v in self.views)


def body_nbytes(body) -> int:
    """The length of a request body: bytes-like, or ``Segments``."""
    return body.nbytes if isinstance(body, Segments) else memoryview(body).nbytes


class ViewBody(Payload):
    """A request body over ``views`` end to end, sent without a copy in Python.

    Its ``read``/``seek`` exist for botocore's type check and stream reset;
    dcpstore's client configuration (``s3_requests.client_config``: no payload
    signing, checksums only when required) never makes botocore read it.
    """

    SLICE_BYTES = 1 << 18  # the most a loopback socket takes per send, about; larger slices copy more

    def __init__(self, *views):
        views = tuple(memoryview(v).cast("B") for v in views)
        super().__init__(views, content_type="application/octet-stream")
        self._size = sum(v.nbytes for v in views)
        # Not an io.IOBase itself: aiobotocore would wrap one in its chunked reader.
        self._file = ViewFile(*views)

    def __len__(self) -> int:  # botocore's Content-Length
        return self._size

    def read(self, n: int = -1) -> bytes:
        return self._file.read(n)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._value).decode(encoding, errors)

    async def write(self, writer) -> None:
        await self.write_with_length(writer, None)

    def _slices(self, limit: int):
        """The views' bytes, up to ``limit``, in slices of at most ``SLICE_BYTES``."""
        for view in self._value:
            view = view[:limit]
            limit -= len(view)
            for lo in range(0, len(view), self.SLICE_BYTES):
                yield view[lo : lo + self.SLICE_BYTES]

    async def write_with_length(self, writer, content_length: int | None) -> None:
        slices = self._slices(self._size if content_length is None else content_length)
        writer.send_headers()
        transport = writer.transport
        if transport is None:  # closed under us: aiohttp's own write raises the right error
            for piece in slices:
                await writer.write(piece)
            return
        low, high = transport.get_write_buffer_limits()
        transport.set_write_buffer_limits(high=0, low=0)
        try:
            for piece in slices:
                await writer.drain()  # returns once the transport's buffer is empty
                await writer.write(piece, drain=False)
            await writer.drain()
        finally:
            if not transport.is_closing():
                transport.set_write_buffer_limits(high=high, low=low)
