"""What all stores over one filesystem instance and bucket share, and who frees it.

A checkpointer opens a store per step, a reader per load; each of them
owning a thread pool or part buffers would leak one set per checkpoint (and
did).  They share one ``Connection`` instead: the filesystem (for S3 the
aiobotocore client and its connection pool), a thread pool for filesystems
whose calls block, and the part-buffer pool of multipart uploads.

Every store holds one lease on its connection, taken when it is made
(``open_store``, ``ObjectStore.child``) and released by ``ObjectStore.close``
or, for a store nobody closed, when it is garbage-collected or the
interpreter exits.  When the last lease goes, the thread pool is shut down
and the part buffers are freed; the next ``open_store`` makes a new
connection.  So an owner that closes what it opened (``ObjectStoreWriter``,
``ObjectStoreReader``, ``AsyncCheckpointer``) leaves nothing running behind.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import threading
from typing import Any

from .config import TransferConfig

_pool_thread = threading.local()


def _mark_pool_thread() -> None:
    _pool_thread.active = True


class Connection:
    def __init__(self, fs: Any, transfer: TransferConfig):
        self.fs = fs
        self.transfer = transfer
        self.parts = PartBufferPool(transfer.part_size, transfer.max_concurrency)
        # Reentrant: a store garbage-collected while this thread holds the
        # lock releases its lease from inside the locked region.
        self._lock = threading.RLock()
        self._leases = 0
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        # Multipart uploads whose abort failed, still being aborted in the
        # background: (store, key, upload id, future); see S3ObjectStore.abort_later.
        self.unaborted: set[tuple] = set()
        # Shard keys a CreateMultipartUpload may still have made an upload for unseen:
        # (store, key, the upload id in use); see S3ObjectStore.look_for_leaked_uploads_at_close.
        self.leak_checks: set[tuple] = set()
        self.closed = False

    def lease(self) -> bool:
        """Take a lease; ``False`` once the connection is closed (open a new one)."""
        with self._lock:
            if self.closed:
                return False
            self._leases += 1
            return True

    def release(self, wait: bool = True) -> None:
        """Return a lease; the last one frees the pools, waiting for the pool's threads to end if ``wait``.

        A store garbage-collected releases with ``wait=False``: collection
        runs finalizers wherever an allocation triggers it, inside locks of
        the interrupted code, and joining a thread there can wait for a lock
        its own thread holds (threading's ``_shutdown_locks_lock``, while a
        thread starts).  The idle pool threads end on their own.
        """
        with self._lock:
            self._leases -= 1
            if self._leases > 0:
                return
            self.closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            # A pool thread that drops the last store cannot wait for itself.
            executor.shutdown(wait=wait and not getattr(_pool_thread, "active", False))
        self.parts.close()

    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The thread pool for blocking filesystem calls, started on first use."""
        with self._lock:
            if self.closed:
                raise RuntimeError("the store's connection is closed")
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.transfer.max_concurrency,
                    thread_name_prefix="dcpstore-io",
                    initializer=_mark_pool_thread,
                )
            return self._executor


class PartBufferPool:
    """Reused ``part_size`` buffers, and the budget of parts in flight, of one connection.

    Buffers are allocated when no free one is left and kept for the next
    writer; ``close()`` (the connection's last lease) frees them, and a
    buffer handed back after that is freed at once.  Each buffer is an
    anonymous ``mmap``, not a ``bytearray``: freeing it returns its pages to
    the OS, where glibc keeps a freed 16 MiB ``bytearray`` resident in the
    arena of the thread that freed it, and it costs memory only for the
    bytes written into it.
    """

    def __init__(self, part_size: int, max_in_flight: int):
        self.part_size = part_size
        self.in_flight = threading.BoundedSemaphore(max_in_flight)
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._closed = False

    def take(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        return mmap.mmap(-1, self.part_size)

    def give_back(self, buf: mmap.mmap) -> None:
        with self._lock:
            if not self._closed:
                self._free.append(buf)
                return
        _unmap(buf)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for buf in free:
            _unmap(buf)


def _unmap(buf: mmap.mmap) -> None:
    try:
        buf.close()
    except BufferError:  # a view of it is still alive; unmapped when that goes
        pass
