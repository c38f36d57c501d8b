"""What a checkpointer holds while open, it gives back on ``close()``: threads and memory.

Thirty saves with an ``AsyncCheckpointer``, then ``close()``; the process must
be back at the thread count and RSS it had before.  The baseline is taken
after a warm-up save on another prefix (another bucket on S3), so what a
process pays once (torch's first use, fsspec's I/O thread, the S3 client,
the allocator's arenas) is not counted, while every pool that belongs to the
stores of the measured run is.
"""

import ctypes
import gc
import os
import threading
import time
import uuid

import pytest
import torch

import dcpstore

STEPS = 30
OBJECTS_PER_RANK = 4
BIG = 40 << 20  # one item of 2.5 parts: the part-buffer pool then holds 40 MiB of written buffers
# A store whose part buffers outlived it would keep at least the 40 MiB of
# the big item's parts; allocator noise over thirty saves stays below this.
RSS_TOLERANCE = 20 << 20


def rss() -> int:
    """Resident memory, after the collector frees unreachable cycles and glibc gives back what it holds freed.

    A cycle (a frame, a traceback) may keep a buffer until the collector
    runs, which in a long process can be any time: what this test counts is
    memory still reachable, so it collects first.

    A freed buffer of up to 32 MiB raises glibc's mmap threshold to its size
    and its trim threshold to twice that, so the next buffers of that size
    come from the heap and stay resident once freed: 40 MiB more, measured
    in a process that had run other tests first (torch 2.15), with nothing
    alive.  ``malloc_trim`` returns it; a buffer still referenced stays.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass  # not glibc: nothing to trim
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def threads() -> tuple[int, int]:
    """Python threads and OS threads, less the default executor of fsspec's I/O loop.

    aiohttp resolves host names (``getaddrinfo``) on that executor.  It belongs to the event loop fsspec keeps for the life
    of the process and is bounded (``min(32, cpus + 4)`` threads) however
    many stores come and go, so it is no store's to free.
    """
    loop_executor = sum(t.name.startswith("asyncio_") for t in threading.enumerate())
    return threading.active_count() - loop_executor, len(os.listdir("/proc/self/task")) - loop_executor


def settled(os_count: int, before: int, seconds: float = 10.0) -> int:
    """The OS thread count once the native workers of threads that just exited are gone too (polled, bounded).

    torch's bundled libgomp gives a thread that runs a parallel region (a
    staging copy) a team of worker threads, which exit after that thread
    does, a few milliseconds later.  Right after ``close()`` one or two
    may still be there: seen under torch 2.15 with gdb, each in
    ``gomp_thread_start``/``gomp_barrier_wait_end``, and gone within 0.1 s.
    A thread that stays is still counted.
    """
    end = time.monotonic() + seconds
    while os_count > before and time.monotonic() < end:
        time.sleep(0.05)
        os_count = threads()[1]
    return os_count


def save_steps(root: str, steps: int) -> None:
    g = torch.Generator().manual_seed(0)
    sd = {"big": torch.randn(BIG // 4, generator=g)}
    sd.update({f"w{i}": torch.randn(64 << 10, generator=g) for i in range(OBJECTS_PER_RANK - 1)})
    with dcpstore.AsyncCheckpointer(root, keep_last=2, objects_per_rank=OBJECTS_PER_RANK) as ckpt:
        for step in range(steps):
            sd["w0"].add_(1)
            ckpt.save(sd, step=step)
        ckpt.wait()
        assert ckpt.committed_steps() == [steps - 2, steps - 1][-steps:]


@pytest.fixture
def two_roots(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path}/warm-up", f"file://{tmp_path}/run"
    s3 = request.getfixturevalue("s3")
    buckets = [f"test-{uuid.uuid4().hex[:12]}" for _ in range(2)]
    for name in buckets:
        s3.create_bucket(Bucket=name)
    return tuple(f"s3://{name}/run" for name in buckets)


@pytest.mark.parametrize("two_roots", ["file", pytest.param("s3", marks=pytest.mark.slow)], indirect=True)
def test_thirty_async_saves_leave_no_threads_or_memory_behind(two_roots):
    warm_up, root = two_roots
    save_steps(warm_up, 1)
    (py_threads, os_threads), memory = threads(), rss()
    save_steps(root, STEPS)
    (py_after, os_after), memory_after = threads(), rss()
    os_after = settled(os_after, os_threads)
    print(f"threads {py_threads} -> {py_after}, OS threads {os_threads} -> {os_after}, RSS {memory >> 20} -> {memory_after >> 20} MiB")
    # At most: a thread of an earlier test (a proxy's request handler) may end meanwhile.
    assert py_after <= py_threads, [t.name for t in threading.enumerate()]
    assert os_after <= os_threads
    assert memory_after - memory < RSS_TOLERANCE


def test_staging_memory_is_what_the_items_need_and_stays_flat_while_shapes_change(tmp_path):
    """Host memory as allocated (``SaveStats.host_bytes``) within 1.1x the staged tensor bytes, flat over 5 saves.

    Sizes that are not powers of two: torch's caching host allocator would
    round each buffer up (a 172 MiB shard pins 256 MiB); the pool's one slab
    holds the items' bytes at 64-byte offsets.  The first save is the
    largest; later saves change shapes and reuse the slab.
    """
    shapes = [(3000, 173), (3000, 173), (2500, 199), (1000, 77), (3000, 173)]
    with dcpstore.AsyncCheckpointer(f"file://{tmp_path}/run") as ckpt:
        held = []
        for step, (rows, cols) in enumerate(shapes):
            sd = {"w": torch.randn(rows, cols), "b": torch.randn(cols + 1), "s": torch.tensor(step)}
            stats = ckpt.save(sd, step=step).result()
            tensor_bytes = sum(t.numel() * t.element_size() for t in sd.values())
            held.append(stats.host_bytes)
            if step == 0:
                assert tensor_bytes <= stats.host_bytes <= 1.1 * tensor_bytes
        assert held == [held[0]] * len(shapes)
        assert all(s.pinned_bytes == 0 for s in [stats])  # no CUDA tensor: nothing pinned
    assert all(pool.nbytes == 0 for pool in ckpt._pools)  # close() gave it back


@pytest.mark.skipif(not hasattr(threading, "_shutdown_locks_lock"), reason="CPython < 3.13's threading internals")
def test_a_store_nobody_closed_is_let_go_without_waiting_for_its_threads(tmp_path):
    """A store garbage-collected, not closed, frees its connection's pool without joining a thread.

    Collection runs a finalizer wherever an allocation triggers it: it once
    ran inside threading's own ``_shutdown_locks_lock``, in a pool thread
    being started, and joining the last store's pool threads there waited
    for that same lock forever (the suite hung in CI).  Here the store's
    last reference goes inside that lock, as collection did.
    """
    from dcpstore.storage import TransferConfig, open_store

    # A transfer of its own: the store's connection is no other test's, so dropping it releases the last lease.
    store = open_store(f"file://{tmp_path}", transfer=TransferConfig(max_concurrency=3))
    store.put("k", b"x")  # starts the connection's thread pool
    holder = [store]
    del store

    def drop():
        with threading._shutdown_locks_lock:
            holder.clear()

    dropping = threading.Thread(target=drop, daemon=True)
    dropping.start()
    dropping.join(timeout=60)  # immediate when correct; a deadlock never ends
    assert not dropping.is_alive(), "the unclosed store's finalizer waited on a lock its thread holds"
