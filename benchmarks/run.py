"""dcpstore vs its peers, side by side, on one local S3 server, in one run.

    python -m benchmarks.run                      # 1 GiB, 3 rounds, world size 1 and 2, size sweep
    python -m benchmarks.run --size-mib 64 --rounds 1 --world-sizes 1 --sweep-mib   # quick
    eval "$(bash scripts/ceph_rgw.sh env)" && python -m benchmarks.run --endpoint "$AWS_ENDPOINT_URL"  # a real server

One moto server subprocess on loopback is started once (``--endpoint URL``:
an external S3 server instead, such as the Ceph RGW of scripts/ceph_rgw.sh,
with credentials from the AWS environment); every contender saves
and loads the same state dict against it, interleaved A B C A B C ... for
``--rounds`` rounds.  Medians are reported, with ratios measured in this run
only (these machines are noisy: never compare absolute times across runs):
each contender against a raw boto3 multipart PUT/GET of the same bytes (its
payload and its download sink made outside the meter, as every contender's
input is), dcpstore against the best peer, and every contender's CPU per
GiB against the ``floor`` row: this machine's cost of the work no client
can avoid (one copy into a reused buffer, one crc32 pass, the bytes sent
over loopback to a process that discards them; for the load, received
into that buffer and checked).  Writes ``results.json`` and ``results.png``
into ``--out``.  A contender that fails against the server (s3torchconnector
cannot write to Ceph RGW) is recorded as failed, with its error, and the run
goes on.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import resource
import statistics
import sys
import threading
import time
import uuid
import warnings

import boto3
import psutil
import torch

MiB = 1 << 20
GiB = 1 << 30


# -- measurement helpers ------------------------------------------------------------------


class RequestCounter:
    """Counts HTTP requests made by botocore and aiobotocore clients in this process."""

    def __init__(self):
        self.count = 0
        self._lock = threading.Lock()
        import aiobotocore.httpsession
        import botocore.httpsession

        for cls in (botocore.httpsession.URLLib3Session, aiobotocore.httpsession.AIOHTTPSession):
            original = cls.send
            if getattr(original, "_counted", False):
                continue
            counter = self
            if cls is botocore.httpsession.URLLib3Session:

                def send(self_, request, _original=original):
                    with counter._lock:
                        counter.count += 1
                    return _original(self_, request)
            else:

                async def send(self_, request, _original=original):
                    with counter._lock:
                        counter.count += 1
                    return await _original(self_, request)

            send._counted = True
            cls.send = send


class PeakRSS:
    """Peak resident memory of this process while the block runs, above its start, with no thread of its own.

    On Linux the kernel keeps the peak (``VmHWM``); writing 5 to
    ``/proc/self/clear_refs`` resets it to the current size, so the block's
    peak is read after it.  A sampling thread in this process would contend
    for the GIL with the contenders' I/O threads: sampling every 5 ms made
    raw boto3's 16-thread download cost 1.42x the CPU (1.48 against 1.04
    s/GiB, 1 GiB, 2 rounds, the same run otherwise) and dcpstore's loads
    1.09-1.16x.  Elsewhere the lifetime peak (``ru_maxrss``) stands in: it
    counts only what rises above every earlier peak of the process.
    """

    def __enter__(self):
        self._base = psutil.Process().memory_info().rss
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._peak = _kernel_peak_rss
        except OSError:
            self._peak = _lifetime_peak_rss
        return self

    def __exit__(self, *exc):
        self.peak_extra = max(0, self._peak() - self._base)


def _kernel_peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _lifetime_peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def make_state_dict(total_bytes: int, n_tensors: int = 64, seed: int = 0) -> dict:
    """``n_tensors`` float32 tensors from 1 KiB up to 128 MiB (geometric), about ``total_bytes`` in all."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = 1024, 128 * MiB
    sizes = [lo * (hi / lo) ** (i / (n_tensors - 1)) for i in range(n_tensors)]
    scale = total_bytes / sum(sizes)
    sizes = [max(1024, min(hi, int(s * scale))) for s in sizes]
    sd = {f"layer{i:02d}.weight": torch.rand(s // 4, generator=g) for i, s in enumerate(sizes)}
    sd["optim"] = {"step": 12345, "lr": 3e-4, "schedule": list(range(16))}
    sd["rng"] = torch.random.get_rng_state().numpy().tobytes()
    return sd


def nbytes(sd: dict) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values() if isinstance(v, torch.Tensor))


def blank_like(sd: dict) -> dict:
    return {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


# -- contenders ---------------------------------------------------------------------------
# Each takes (state_dict, url, rank-local context) and returns
# {"blocking_s", "commit_s", "load_s", "save_cpu_s", "load_cpu_s"}.


def _cpu_s() -> float:
    """CPU seconds of this process so far, every thread (the server's are not counted)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Phases:
    """Wall and CPU time of a save's phases, then of the load."""

    def __init__(self):
        self._t0, self._c0 = time.perf_counter(), _cpu_s()
        self.result: dict = {}

    def mark(self, name: str) -> None:
        self.result[name] = time.perf_counter() - self._t0

    def saved(self) -> None:
        self.mark("commit_s")
        self.result["save_cpu_s"] = _cpu_s() - self._c0
        self._t0, self._c0 = time.perf_counter(), _cpu_s()

    def loaded(self) -> dict:
        self.mark("load_s")
        self.result["load_cpu_s"] = _cpu_s() - self._c0
        return self.result


class _KeptForTheRun:
    """What the run makes once and keeps, outside every meter.

    Stateful contenders (``AsyncCheckpointer``; torch's ``DefaultStager`` with
    a plan-caching planner; the writers ``dcp.async_save`` stages through),
    one per bucket, are made once and each round
    saves the next step, as every save after a job's first does: their
    buffers and caches are warm from round 2 on, so the medians of 3 rounds
    are steady-state saves (round 1, the cold one, is in the JSON rows).
    Inputs and sinks a contender reuses (raw boto3's payload and download
    buffer, the floor's buffer and loopback peer) are made before its meter
    starts, as dcpstore's state dict is.
    """

    def __init__(self):
        self._kept: dict[tuple, list] = {}

    def once(self, key: tuple, make):
        """The object kept under ``key``, made on first use."""
        if key not in self._kept:
            self._kept[key] = [make(), 0]
        return self._kept[key][0]

    def get(self, contender: str, url: str, make):
        """``contender``'s object for ``url``'s bucket, and how many saves have used it (the step to save)."""
        key = (contender, url.split("/")[2])
        self.once(key, make)
        entry = self._kept[key]
        entry[1] += 1
        return entry[0], entry[1]

    def close(self) -> None:
        for kept, _ in self._kept.values():
            if hasattr(kept, "close"):
                kept.close()
        self._kept.clear()


KEPT = _KeptForTheRun()


def load_destination(sd: dict) -> dict:
    """The tensors every load of ``sd`` lands in: made once per run, outside every meter, every page touched.

    A resumed job loads into its model and optimizer state, which exist and
    have been written (initialised) before it loads; raw boto3 downloads
    into a sink made, and written, before its meter starts.  A destination
    made inside the meter with ``torch.empty_like`` instead charged each
    load the kernel's first-touch page faults for every byte: 1.28 against
    1.01 CPU s/GiB for dcpstore's load, 1 GiB, 3 rounds (``/tmp/load_probe.py``
    in issue 39's note), which is no client's work.
    """
    return KEPT.once(
        ("load destination", nbytes(sd)),
        lambda: {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in sd.items()},
    )


def dcpstore_async(sd, url, pg):
    import dcpstore

    bucket = url.split("/")[2]
    ckpt, step = KEPT.get("dcpstore", url, lambda: dcpstore.AsyncCheckpointer(f"s3://{bucket}/run", process_group=pg))
    destination = load_destination(sd)
    phases = _Phases()
    handle = ckpt.save(sd, step=step)
    phases.mark("blocking_s")
    handle.result()
    phases.saved()
    ckpt.load(destination, step=step)
    return phases.loaded()


def _dcp_load(phases, destination, url, pg, reader_factory) -> dict:
    import torch.distributed.checkpoint as dcp

    dcp.load(destination, storage_reader=reader_factory(url), process_group=pg, no_dist=pg is None)
    return phases.loaded()


def _dcp_pair(writer_factory, reader_factory, use_async):
    import torch.distributed.checkpoint as dcp

    def run(sd, url, pg):
        no_dist = pg is None
        destination = load_destination(sd)
        phases = _Phases()
        if use_async:  # the writer kept, as a user who wants its staging memory reused does
            writer, _ = KEPT.get(writer_factory.__name__, url, lambda: writer_factory(url))
            fut = dcp.async_save(sd, checkpoint_id=url, storage_writer=writer, process_group=pg, no_dist=no_dist)
            phases.mark("blocking_s")
            (getattr(fut, "upload_completion", None) or fut).result()
        else:
            dcp.save(sd, storage_writer=writer_factory(url), process_group=pg, no_dist=no_dist)
            phases.mark("blocking_s")
        phases.saved()
        return _dcp_load(phases, destination, url, pg, reader_factory)

    return run


def torch_best_async(sd, url, pg):
    """What a careful torch 2.13 user picks today: ``DefaultStager``, plan caching, ``FsspecWriter``.

    Pinned memory, async staging and non-blocking copies need CUDA; shared
    memory is for the PROCESS checkpointer type, not this thread one.
    Blocking is until staging completes: until then training must not touch
    the state dict.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    class Kept:
        def __init__(self):
            cuda = torch.cuda.is_available()
            self.stager = DefaultStager(
                StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=cuda, use_non_blocking_copy=cuda)
            )
            self.planner = DefaultSavePlanner(enable_plan_caching=True)

        def close(self):
            self.stager.close()

    kept, _ = KEPT.get("torch", url, Kept)
    destination = load_destination(sd)
    phases = _Phases()
    response = dcp.async_save(
        sd,
        storage_writer=_fsspec_writer(url),
        planner=kept.planner,
        async_stager=kept.stager,
        process_group=pg,
        no_dist=pg is None,
    )
    staging = getattr(response, "staging_completion", None)
    if staging is not None:
        staging.result()
    phases.mark("blocking_s")
    (getattr(response, "upload_completion", None) or response).result()
    phases.saved()
    return _dcp_load(phases, destination, url, pg, _fsspec_reader)


def _dcpstore_writer(url):
    import dcpstore

    return dcpstore.ObjectStoreWriter(url)


def _dcpstore_reader(url):
    import dcpstore

    return dcpstore.ObjectStoreReader(url)


def _fsspec_writer(url):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(url, thread_count=4)


def _fsspec_reader(url):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(url)


def _s3tc_config():
    from s3torchconnector import S3ClientConfig

    return S3ClientConfig(force_path_style=True)


def _s3tc_writer(url):
    from s3torchconnector.dcp import S3StorageWriter

    return S3StorageWriter(region="us-east-1", path=url, s3client_config=_s3tc_config(), thread_count=4)


def _s3tc_reader(url):
    from s3torchconnector.dcp import S3StorageReader

    return S3StorageReader(region="us-east-1", path=url, s3client_config=_s3tc_config())


FLOOR = "floor (copy + crc32 + loopback)"


class _PreallocatedSink(io.RawIOBase):
    """A seekable file over a buffer allocated once: a download lands each byte with one copy, and nothing grows."""

    def __init__(self, size: int):
        self._view = memoryview(bytearray(size))
        self._pos = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self._pos = pos if whence == io.SEEK_SET else self._pos + pos if whence == io.SEEK_CUR else len(self._view) + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def write(self, b) -> int:
        n = len(b)
        self._view[self._pos : self._pos + n] = b
        self._pos += n
        return n


def raw_boto3(sd, url, pg):
    """The ceiling: the same bytes as one multipart PUT and one GET with boto3's transfer manager.

    Its payload (an immutable ``bytes``, which ``BytesIO`` shares without a
    copy) and its download sink (a preallocated buffer) are made outside the
    meter: what is metered is boto3's own work.
    """
    from boto3.s3.transfer import TransferConfig

    bucket, key = url[len("s3://") :].split("/", 1)
    client = boto3.client("s3")
    cfg = TransferConfig(multipart_threshold=16 * MiB, multipart_chunksize=16 * MiB, max_concurrency=16)
    size = nbytes(sd)
    payload = KEPT.once(("raw boto3 payload", size), lambda: bytes(size))
    sink = KEPT.once(("raw boto3 sink", size), lambda: _PreallocatedSink(size))
    phases = _Phases()
    client.upload_fileobj(io.BytesIO(payload), bucket, f"{key}/blob-{os.getpid()}", Config=cfg)
    phases.mark("blocking_s")
    phases.saved()
    sink.seek(0)
    client.download_fileobj(bucket, f"{key}/blob-{os.getpid()}", sink, Config=cfg)
    return phases.loaded()


_LOOPBACK_PEER = r"""
import socket, sys, threading
chunk = bytearray(1 << 20)
def serve(listener, role):
    while True:
        conn, _ = listener.accept()
        with conn:
            if role == "sink":  # read everything, then say so
                while conn.recv_into(chunk):
                    pass
                conn.sendall(b"k")
            else:  # send the number of bytes asked for
                want = int.from_bytes(conn.recv(8), "big")
                view = memoryview(chunk)
                while want:
                    n = conn.send(view[: min(want, len(chunk))])
                    want -= n
sockets = []
for role in ("sink", "source"):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(4); sockets.append(s)
    threading.Thread(target=serve, args=(s, role), daemon=True).start()
print(sockets[0].getsockname()[1], sockets[1].getsockname()[1], flush=True)
sys.stdin.read()
"""


class _LoopbackPeer:
    """A process on loopback that discards what it is sent and sends what it is asked for (its CPU is not metered)."""

    def __init__(self):
        import subprocess

        self._proc = subprocess.Popen([sys.executable, "-c", _LOOPBACK_PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.sink_port, self.source_port = map(int, self._proc.stdout.readline().split())

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=10)


def floor(sd, url, pg):
    """What no client can avoid on this machine, per byte: the floor every contender's CPU is measured against.

    Save: one copy of the tensors into a reused buffer, one crc32 pass, and
    the bytes sent over loopback to a process that discards them.  Load:
    the bytes received over loopback into that buffer, and one crc32 pass.
    The buffer and the peer process exist before the meter starts.
    """
    import socket
    import zlib

    size = nbytes(sd)
    buf = KEPT.once(("floor buffer", size), lambda: torch.empty(size, dtype=torch.uint8))
    peer = KEPT.once(("floor peer",), _LoopbackPeer)
    view = memoryview(buf.numpy())
    phases = _Phases()
    offset = 0
    for v in sd.values():
        if isinstance(v, torch.Tensor):
            n = v.numel() * v.element_size()
            buf[offset : offset + n].copy_(v.reshape(-1).view(torch.uint8))
            offset += n
    zlib.crc32(view)
    with socket.create_connection(("127.0.0.1", peer.sink_port)) as conn:
        conn.sendall(view)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)
    phases.mark("blocking_s")
    phases.saved()
    with socket.create_connection(("127.0.0.1", peer.source_port)) as conn:
        conn.sendall(size.to_bytes(8, "big"))
        got = 0
        while got < size:
            got += conn.recv_into(view[got:])
    zlib.crc32(view)
    return phases.loaded()


def contenders(with_s3tc: bool) -> dict:
    out = {
        "dcpstore AsyncCheckpointer": dcpstore_async,
        "dcpstore ObjectStoreWriter dcp.save": _dcp_pair(_dcpstore_writer, _dcpstore_reader, False),
        "dcpstore ObjectStoreWriter dcp.async_save": _dcp_pair(_dcpstore_writer, _dcpstore_reader, True),
        "torch FsspecWriter dcp.save": _dcp_pair(_fsspec_writer, _fsspec_reader, False),
        "torch FsspecWriter dcp.async_save": _dcp_pair(_fsspec_writer, _fsspec_reader, True),
        "torch DefaultStager + plan caching async_save": torch_best_async,
        "raw boto3 multipart": raw_boto3,
        FLOOR: floor,
    }
    if with_s3tc:
        out["s3torchconnector dcp.save"] = _dcp_pair(_s3tc_writer, _s3tc_reader, False)
    return out


DISTRIBUTED = ("dcpstore AsyncCheckpointer", "dcpstore ObjectStoreWriter dcp.save", "torch FsspecWriter dcp.save")


def _have_s3tc() -> bool:
    try:
        import s3torchconnector.dcp  # noqa: F401
    except Exception:  # noqa: BLE001 - optional extra
        return False
    return True


# -- running ------------------------------------------------------------------------------


def measure(name, fn, sd, url, pg, counter) -> dict:
    """One save + load of ``sd`` at ``url``.

    ``peak_rss_over_state`` is the peak growth of resident memory during the
    save + load over the state-dict bytes, above what the process held when it
    began: memory a kept contender holds from earlier rounds, or that was freed
    but not returned to the OS, is reused and not counted again.
    """
    before = counter.count
    gc_collect()
    with PeakRSS() as rss:
        result = fn(sd, url, pg)
    size = nbytes(sd)
    result.update(
        requests=counter.count - before,
        peak_rss_over_state=rss.peak_extra / size,
        save_mb_s=size / MiB / result["commit_s"],
        load_mb_s=size / MiB / result["load_s"],
        save_cpu_s_per_gib=result["save_cpu_s"] / (size / GiB),
        load_cpu_s_per_gib=result["load_cpu_s"] / (size / GiB),
        bytes=size,
    )
    return result


def gc_collect():
    import gc

    gc.collect()


def _rank_main(rank, world_size, init_file, queue, endpoint, names, rounds, size, bucket):
    """A rank of a world-size>1 run: the same contenders, each rank saving its own shard."""
    import torch.distributed as dist

    os.environ["AWS_ENDPOINT_URL"] = endpoint
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    pg = dist.new_group(backend="gloo")
    counter = RequestCounter()
    full = make_state_dict(size)
    sd = {k: v for i, (k, v) in enumerate(full.items()) if i % world_size == rank}
    load_destination(sd)  # before any meter
    table = contenders(False)
    rows = []
    for r in range(rounds):
        for i, name in enumerate(names):
            url = f"s3://{bucket}/ws{world_size}-r{r}-c{i}/step_00000001"  # the same on every rank
            dist.barrier(pg)
            result = measure(name, table[name], sd, url, pg, counter)
            dist.barrier(pg)
            rows.append((name, r, result))
    KEPT.close()
    queue.put((rank, rows))
    dist.destroy_process_group()


def run_distributed(world_size, endpoint, names, rounds, size, bucket):
    from benchmarks.ranks import spawn_ranks

    per_rank = spawn_ranks(_rank_main, world_size, endpoint, names, rounds, size, bucket)
    # A distributed save is as slow as its slowest rank; requests and memory add up per rank.
    merged = []
    for i, (name, r, first) in enumerate(per_rank[0]):
        rows = [per_rank[k][i][2] for k in per_rank]
        merged.append(
            (name, r, {
                "blocking_s": max(x["blocking_s"] for x in rows),
                "commit_s": max(x["commit_s"] for x in rows),
                "load_s": max(x["load_s"] for x in rows),
                "requests": sum(x["requests"] for x in rows),
                "peak_rss_over_state": max(x["peak_rss_over_state"] for x in rows),
                "bytes": sum(x["bytes"] for x in rows),
                "save_cpu_s": sum(x["save_cpu_s"] for x in rows),
                "load_cpu_s": sum(x["load_cpu_s"] for x in rows),
            })
        )
    for _, _, row in merged:
        row["save_mb_s"] = row["bytes"] / MiB / row["commit_s"]
        row["load_mb_s"] = row["bytes"] / MiB / row["load_s"]
        row["save_cpu_s_per_gib"] = row["save_cpu_s"] / (row["bytes"] / GiB)
        row["load_cpu_s_per_gib"] = row["load_cpu_s"] / (row["bytes"] / GiB)
    return merged


def summarize(rows) -> dict:
    """Medians per contender; a contender with no successful round is ``{"error": ...}``."""
    by_name: dict[str, list] = {}
    for name, _, result in rows:
        by_name.setdefault(name, []).append(result)
    out = {}
    for name, results in by_name.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            out[name] = {"error": results[0]["error"]}
            continue
        out[name] = {key: statistics.median(r[key] for r in ok) for key in ok[0]}
        if len(ok) < len(results):
            out[name]["failed_rounds"] = len(results) - len(ok)
    return out


def _ok(summary: dict) -> dict:
    return {n: s for n, s in summary.items() if "error" not in s}


def add_ratios(summary: dict) -> None:
    summary = _ok(summary)
    raw = summary.get("raw boto3 multipart")
    low = summary.get(FLOOR)
    peers = {n: s for n, s in summary.items() if not n.startswith(("dcpstore", "raw", "floor"))}
    best_peer = max(peers.values(), key=lambda s: s["save_mb_s"]) if peers else None
    for name, s in summary.items():
        if raw:
            s["save_vs_raw_boto3"] = s["save_mb_s"] / raw["save_mb_s"]
            s["load_vs_raw_boto3"] = s["load_mb_s"] / raw["load_mb_s"]
        if best_peer and name.startswith("dcpstore"):
            s["save_vs_best_peer"] = s["save_mb_s"] / best_peer["save_mb_s"]
            s["load_vs_best_peer"] = s["load_mb_s"] / best_peer["load_mb_s"]
        # CPU per GiB against the ceiling and against s3torchconnector (issue 12's goals:
        # save <= 1.0x s3torchconnector and <= 1.1x raw boto3, load <= 1.5x raw boto3).
        for phase in ("save", "load") if low else ():
            if low[f"{phase}_cpu_s_per_gib"] > 0:  # a tiny run's floor can be below getrusage's resolution
                s[f"{phase}_cpu_vs_floor"] = s[f"{phase}_cpu_s_per_gib"] / low[f"{phase}_cpu_s_per_gib"]
        if raw and raw["save_cpu_s_per_gib"] > 0:
            s["save_cpu_vs_raw_boto3"] = s["save_cpu_s_per_gib"] / raw["save_cpu_s_per_gib"]
            s["load_cpu_vs_raw_boto3"] = s["load_cpu_s_per_gib"] / raw["load_cpu_s_per_gib"]
        s3tc = next((p for n, p in summary.items() if n.startswith("s3torchconnector")), None)
        if s3tc and s3tc["save_cpu_s_per_gib"] > 0:
            s["save_cpu_vs_s3torchconnector"] = s["save_cpu_s_per_gib"] / s3tc["save_cpu_s_per_gib"]


def print_table(title: str, summary: dict) -> str:
    lines = [f"\n{title}", f"{'contender':<47}{'block s':>9}{'commit s':>9}{'save MB/s':>10}{'load MB/s':>10}"
             f"{'save CPU s/GiB':>15}{'load CPU s/GiB':>15}{'RSS/sd':>8}{'reqs':>7}{'save/raw':>9}{'save/peer':>10}"
             f"{'CPU/floor save':>15}{'load':>6}"]
    for name, s in summary.items():
        if "error" in s:
            lines.append(f"{name:<44}  failed: {s['error'][:120]}")
            continue
        lines.append(
            f"{name:<47}{s['blocking_s']:>9.3f}{s['commit_s']:>9.3f}{s['save_mb_s']:>10.0f}{s['load_mb_s']:>10.0f}"
            f"{s['save_cpu_s_per_gib']:>15.2f}{s['load_cpu_s_per_gib']:>15.2f}"
            f"{s['peak_rss_over_state']:>8.2f}{s['requests']:>7.0f}"
            f"{s.get('save_vs_raw_boto3', float('nan')):>9.2f}{s.get('save_vs_best_peer', float('nan')):>10.2f}"
            f"{s.get('save_cpu_vs_floor', float('nan')):>15.2f}{s.get('load_cpu_vs_floor', float('nan')):>6.2f}"
        )
    for name, s in summary.items():
        if name.startswith("dcpstore") and "save_cpu_vs_raw_boto3" in s:
            vs_s3tc = s.get("save_cpu_vs_s3torchconnector")
            lines.append(
                f"  {name}: CPU per GiB vs raw boto3: save {s['save_cpu_vs_raw_boto3']:.2f}x, "
                f"load {s['load_cpu_vs_raw_boto3']:.2f}x"
                + (f"; save vs s3torchconnector {vs_s3tc:.2f}x" if vs_s3tc is not None else "")
            )
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = results["runs"][0]
    names = list(_ok(main["summary"]))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 6))
    y = range(len(names))
    ax1.barh(y, [main["summary"][n]["commit_s"] for n in names], color="tab:blue", label="time to commit")
    ax1.barh(y, [main["summary"][n]["blocking_s"] for n in names], color="tab:orange", label="blocking (training stalled)")
    ax1.set_yticks(list(y), names, fontsize=8)
    ax1.invert_yaxis()
    ax1.set_xlabel("seconds (median)")
    ax1.set_title(f"{main['label']}")
    ax1.legend(fontsize=8)
    for name in ("dcpstore AsyncCheckpointer", "torch FsspecWriter dcp.save", "raw boto3 multipart"):
        pts = [(s["size_mib"], s["summary"][name]["commit_s"]) for s in results.get("sweep", []) if name in _ok(s["summary"])]
        if pts:
            ax2.plot(*zip(*pts), marker="o", label=name)
    ax2.set_xlabel("state dict MiB")
    ax2.set_ylabel("time to commit, s (median)")
    ax2.set_title("scaling (world size 1)")
    ax2.legend(fontsize=8)
    fig.suptitle(f"dcpstore benchmark on {results['machine']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sweep-mib", type=int, nargs="*", default=[256, 1024, 2048],
                        help="state-dict sizes for the scaling sweep (world size 1); none to skip")
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--no-s3torchconnector", action="store_true")
    parser.add_argument("--endpoint", metavar="URL",
                        help="run against this S3 server (credentials from the AWS environment) instead of starting moto")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    os.makedirs(args.out, exist_ok=True)

    from dcpstore.local_s3 import TEST_CREDENTIALS, MotoServer

    if args.endpoint:
        if not os.environ.get("AWS_ACCESS_KEY_ID"):
            parser.error("--endpoint needs credentials in the AWS environment "
                         "(for scripts/ceph_rgw.sh: eval \"$(bash scripts/ceph_rgw.sh env)\")")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        server = None
        endpoint = args.endpoint
        server_label = f"external S3 server at {endpoint}"
    else:
        os.environ.update(TEST_CREDENTIALS)
        server = MotoServer()
        endpoint = server.endpoint
        server_label = "moto server (subprocess, loopback)"
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    machine = f"{platform.machine()} {psutil.cpu_count()} cores {psutil.virtual_memory().total / 2**30:.0f} GiB, {platform.system()}"
    results = {"machine": machine, "date": datetime.date.today().isoformat(), "server": server_label, "runs": [], "sweep": []}
    s3 = boto3.client("s3")
    counter = RequestCounter()
    texts = []
    try:
        with_s3tc = not args.no_s3torchconnector and _have_s3tc()
        table = contenders(with_s3tc)

        def run_ws1(size_mib, rounds, names):
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            s3.create_bucket(Bucket=bucket)
            sd = make_state_dict(size_mib * MiB)
            load_destination(sd)  # before any meter
            rows = []
            failed: set[str] = set()
            for r in range(rounds):
                for name in names:  # interleaved: A B C ... A B C
                    if name in failed:
                        continue
                    url = f"s3://{bucket}/r{r}-{uuid.uuid4().hex[:6]}/step_00000001"
                    try:
                        rows.append((name, r, measure(name, table[name], sd, url, None, counter)))
                    except BaseException as e:  # noqa: BLE001 - dcp's CheckpointException is a BaseException
                        if isinstance(e, (KeyboardInterrupt, SystemExit)):
                            raise
                        error = _describe(e)
                        print(f"{name}: failed against {endpoint}: {error}", file=sys.stderr, flush=True)
                        rows.append((name, r, {"error": error}))
                        failed.add(name)  # it fails the same way every round
                    _empty_bucket(s3, bucket)
            KEPT.close()
            return rows

        for ws in args.world_sizes:
            if ws == 1:
                rows = run_ws1(args.size_mib, args.rounds, list(table))
            else:
                bucket = f"bench-{uuid.uuid4().hex[:8]}"
                s3.create_bucket(Bucket=bucket)
                rows = run_distributed(ws, endpoint, list(DISTRIBUTED) + ["raw boto3 multipart"], args.rounds, args.size_mib * MiB, bucket)
                _empty_bucket(s3, bucket)
            summary = summarize(rows)
            add_ratios(summary)
            label = f"{args.size_mib} MiB state dict, world size {ws}, {args.rounds} rounds, medians"
            results["runs"].append({"label": label, "world_size": ws, "size_mib": args.size_mib, "summary": summary, "rows": rows})
            texts.append(print_table(label, summary))
        for size in args.sweep_mib:
            names = ["dcpstore AsyncCheckpointer", "torch FsspecWriter dcp.save", "raw boto3 multipart"]
            summary = summarize(run_ws1(size, args.rounds, names))
            add_ratios(summary)
            results["sweep"].append({"size_mib": size, "summary": summary})
            texts.append(print_table(f"sweep: {size} MiB, world size 1", summary))
        blocking_ratio = _blocking_vs_memcpy(make_state_dict(args.size_mib * MiB), results)
        texts.append(f"\ndcpstore AsyncCheckpointer blocking time / one torch.clone of the state dict: {blocking_ratio:.2f}")
        print(texts[-1])
    finally:
        if server is not None:
            server.stop()
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2, default=str)
    with open(os.path.join(args.out, "results.txt"), "w") as f:
        f.write(f"machine: {machine}\nserver: {server_label}\n" + "\n".join(texts) + "\n")
    plot(results, os.path.join(args.out, "results.png"))
    print(f"\nwrote {args.out}/results.json, results.txt, results.png")
    return 0


def _blocking_vs_memcpy(sd, results) -> float:
    """Steady-state blocking time of save (pool reused) over one clone of the same tensors."""
    import dcpstore

    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    ckpt = dcpstore.AsyncCheckpointer(f"s3://{bucket}/run")
    blocking = []
    for step in range(3):
        handle = ckpt.save(sd, step=step)
        blocking.append(handle.stats.blocking_s)
        handle.result()
    ckpt.close()
    clones = []
    for _ in range(3):
        t0 = time.perf_counter()
        copy = {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
        clones.append(time.perf_counter() - t0)
        del copy
    ratio = statistics.median(blocking[1:]) / statistics.median(clones)
    results["blocking_vs_clone"] = {"blocking_s": blocking, "clone_s": clones, "ratio_steady_state": ratio,
                                    "ratio_first_save": blocking[0] / statistics.median(clones)}
    return ratio


def _describe(e: BaseException) -> str:
    """One line: the root cause (dcp wraps each rank's error in a CheckpointException)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        e = next(iter(failures.values()))
        if isinstance(e, tuple):  # (exception, stack summary)
            e = e[0]
    return " ".join(f"{type(e).__name__}: {e}".split())


def _empty_bucket(s3, bucket):
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys})


if __name__ == "__main__":
    sys.exit(main())
