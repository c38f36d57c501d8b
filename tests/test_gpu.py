"""The CUDA paths, made deterministic: skipped without CUDA, run by ``scripts/gpu_check.sh``.

A ``torch.cuda._sleep`` queued on the pool's side stream before ``save()``
holds the device-to-host copy back (or, on the caller's stream, the work
that produces a tensor), so each test knows the order the GPU runs things
in instead of racing a sub-millisecond copy.
"""

import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

import dcpstore

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HOLD = 2_000_000_000  # GPU clock cycles on the side stream: about a second


def _hold_copies(ckpt, device, pool: int = 0) -> None:
    """Queue a long kernel on the side stream the next save's copies go on."""
    with torch.cuda.device(device):
        side = ckpt._pools[pool]._side_stream(torch.device(device))
        with torch.cuda.stream(side):
            torch.cuda._sleep(HOLD)


def _loaded(ckpt, like: dict, step: int) -> dict:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    ckpt.load(out, step=step)
    return out


def test_overlap_copy_returns_before_the_copy_and_the_step_keeps_the_values_saved(tmp_path):
    """(a) With overlap_copy the copy is still pending when save() returns, and the training stream is not held."""
    ckpt = dcpstore.AsyncCheckpointer(f"file://{tmp_path}/run", overlap_copy=True)
    w = torch.randn(1024, 1024, device="cuda")
    ckpt.save({"w": w}, step=1).result()  # the slab exists from here on
    _hold_copies(ckpt, w.device)
    expected = w.clone()
    handle = ckpt.save({"w": w}, step=2)
    marker = torch.cuda.Event()
    marker.record()  # on the training stream, after save()
    marker.synchronize()
    assert not handle._staged._copies[w.device].query()  # the copy waits behind the held side stream
    handle.wait_staged()  # the optimizer step's wait, on the GPU
    w.add_(1)
    stats = handle.result()
    assert torch.equal(_loaded(ckpt, {"w": w}, 2)["w"], expected)
    assert stats.device_stall_s > 0.1  # w.add_ waited for the held copy
    assert stats.pinned_bytes >= w.numel() * 4
    ckpt.close()


def test_by_default_the_next_kernel_waits_and_an_overwrite_leaves_the_saved_values(tmp_path):
    """(b) Without overlap_copy, a kernel queued right after save() runs after the copy."""
    ckpt = dcpstore.AsyncCheckpointer(f"file://{tmp_path}/run")
    w = torch.randn(1024, 1024, device="cuda")
    ckpt.save({"w": w}, step=1).result()
    _hold_copies(ckpt, w.device)
    expected = w.clone()
    handle = ckpt.save({"w": w}, step=2)
    w.mul_(0)  # queued on the training stream after its wait on the copy
    handle.result()
    assert torch.equal(_loaded(ckpt, {"w": w}, 2)["w"], expected)
    ckpt.close()


def test_two_saves_in_flight_each_hold_their_own_values(tmp_path):
    """(c) max_in_flight=2, the second save's copy held back: each step has the values it was saved with."""
    ckpt = dcpstore.AsyncCheckpointer(f"file://{tmp_path}/run", max_in_flight=2)
    w = torch.randn(512, 512, device="cuda")
    first = w.clone()
    ckpt.save({"w": w}, step=1)
    w.add_(1)
    second = w.clone()
    _hold_copies(ckpt, w.device, pool=1)
    ckpt.save({"w": w}, step=2)
    w.add_(1)
    ckpt.wait()
    assert torch.equal(_loaded(ckpt, {"w": w}, 1)["w"], first)
    assert torch.equal(_loaded(ckpt, {"w": w}, 2)["w"], second)
    ckpt.close()


def test_a_save_under_a_non_default_stream_captures_its_pending_work(tmp_path):
    """(e) The copies wait for the work queued on the caller's current stream, whichever stream that is."""
    ckpt = dcpstore.AsyncCheckpointer(f"file://{tmp_path}/run")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        w = torch.zeros(1024, 1024, device="cuda")
        torch.cuda._sleep(HOLD)
        w.fill_(7.0)
        handle = ckpt.save({"w": w}, step=1)
    handle.result()
    assert torch.equal(_loaded(ckpt, {"w": w}, 1)["w"].cpu(), torch.full((1024, 1024), 7.0))
    ckpt.close()


def test_bf16_transposed_and_0_dim_items_round_trip(tmp_path):
    """(f) Items the slab carves at odd sizes and dtypes."""
    ckpt = dcpstore.AsyncCheckpointer(f"file://{tmp_path}/run")
    sd = {
        "bf16": torch.randn(333, 77, device="cuda").to(torch.bfloat16),
        "transposed": torch.randn(64, 48, device="cuda").t(),
        "scalar": torch.tensor(3.25, device="cuda"),
        "int": torch.arange(1001, device="cuda", dtype=torch.int16),
    }
    expected = {k: v.cpu() for k, v in sd.items()}
    ckpt.save(sd, step=1).result()
    for k, v in _loaded(ckpt, {k: v.contiguous() for k, v in sd.items()}, 1).items():
        assert torch.equal(v.cpu(), expected[k]), k
    ckpt.close()


class _TemporaryPlanner(DefaultSavePlanner):
    """Hands each tensor over as a temporary (as a cast or ``full_tensor`` would), freed once it is staged."""

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        return data * 1 if isinstance(data, torch.Tensor) else data


def test_planner_temporaries_survive_allocation_churn_until_copied(tmp_path):
    """(d) overlap_copy and a held copy: the temporaries' memory is not handed out again before the copy read it."""
    ckpt = dcpstore.AsyncCheckpointer(f"file://{tmp_path}/run", overlap_copy=True, planner_factory=_TemporaryPlanner)
    sd = {f"w{i}": torch.randn(256, 1024, device="cuda") for i in range(4)}
    ckpt.save(sd, step=1).result()
    expected = {k: v.clone() for k, v in sd.items()}
    _hold_copies(ckpt, sd["w0"].device)
    handle = ckpt.save(sd, step=2)
    for _ in range(20):  # same-sized blocks, filled on the training stream while the copy is held
        junk = [torch.empty_like(v).fill_(-1.0) for v in sd.values()]
        del junk
    handle.wait_staged()
    handle.result()
    loaded = _loaded(ckpt, sd, 2)
    assert all(torch.equal(loaded[k], expected[k]) for k in sd)
    ckpt.close()


def test_dtensor_items_round_trip_on_cuda(tmp_path):
    """(f) A DTensor on a one-GPU mesh (NCCL for tensors, gloo for dcpstore's object collectives)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        full = torch.randn(129, 65, device="cuda")
        sd = {"d": distribute_tensor(full, mesh, [Shard(0)])}
        ckpt = dcpstore.AsyncCheckpointer(f"file://{tmp_path}/run")
        ckpt.save(sd, step=1).result()
        out = {"d": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)])}
        ckpt.load(out, step=1)
        ckpt.close()
        assert torch.equal(out["d"].full_tensor(), full)
    finally:
        dist.destroy_process_group()


def test_plain_dcp_save_under_a_non_default_stream_captures_its_pending_work(tmp_path):
    """Plain ``dcp.save`` copies on upload threads: on the caller's stream, after the work queued there."""
    url = f"file://{tmp_path}/plain"
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        w = torch.zeros(1024, 1024, device="cuda")
        torch.cuda._sleep(HOLD)
        w.fill_(7.0)
        dcp.save({"w": w}, storage_writer=dcpstore.ObjectStoreWriter(url), no_dist=True)
    out = {"w": torch.zeros(1024, 1024, device="cuda")}
    dcp.load(out, storage_reader=dcpstore.ObjectStoreReader(url), no_dist=True)
    assert torch.equal(out["w"].cpu(), torch.full((1024, 1024), 7.0))


def test_loads_into_cuda_tensors_are_bit_exact_and_a_corrupt_item_never_reaches_its_destination(tmp_path):
    """(h) Pinned, checked, then copied: odd dtypes and layouts, a CPU item beside them, and a corrupt shard."""
    ckpt = dcpstore.AsyncCheckpointer(f"file://{tmp_path}/run")
    sd = {
        "big": torch.randn(3001, 1013, device="cuda"),
        "bf16": torch.randn(333, 77, device="cuda").to(torch.bfloat16),
        "scalar": torch.tensor(3.25, device="cuda"),
        "cpu": torch.randn(1000),
    }
    ckpt.save(sd, step=1).result()
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    out["big"] = torch.zeros(1013, 3001, device="cuda").t()  # a destination that is not contiguous
    ckpt.load(out, step=1)
    assert all(torch.equal(out[k], v) for k, v in sd.items())

    ckpt.save({"big": sd["big"]}, step=2).result()
    (shard,) = pathlib.Path(tmp_path, "run").glob("*2/**/*.distcp")
    body = bytearray(shard.read_bytes())
    body[len(body) // 2] ^= 0xFF  # inside the tensor's data
    shard.write_bytes(bytes(body))
    before = torch.full((3001, 1013), 7.0, device="cuda")
    dest = {"big": before.clone()}
    with pytest.raises(BaseException) as e:  # torch's CheckpointException around ours
        ckpt.load(dest, step=2)
    assert "its destination keeps its old contents" in str(e.value)
    assert torch.equal(dest["big"], before)
    ckpt.close()


def test_a_load_reuses_pinned_memory_only_after_its_copies_ran(tmp_path):
    """(h) The caller's stream held: every H2D copy waits behind it, so reusing a region too early would land wrong bytes."""
    url = f"file://{tmp_path}/ring"
    sd = {f"t{i}": torch.randn(512 * 1024, device="cuda") for i in range(16)}  # 2 MiB each
    dcp.save(sd, storage_writer=dcpstore.ObjectStoreWriter(url), no_dist=True)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    reader = dcpstore.ObjectStoreReader(url, readahead_bytes=1 << 20, transfer=dcpstore.TransferConfig(part_size=5 << 20))
    torch.cuda._sleep(HOLD)  # on the current stream, which the load's side stream waits for
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in sd.items())


def test_pinned_memory_is_exact_and_given_back(tmp_path):
    """Pinned bytes within 1.1x the staged bytes (not a power of two), flat over 5 saves with a shape change, 0 after close."""
    ckpt = dcpstore.AsyncCheckpointer(f"file://{tmp_path}/run")
    pinned = []
    for step, rows in enumerate((3001, 3001, 2003, 1001, 3001)):
        w = torch.randn(rows, 15013, device="cuda")  # about 172 MiB at 3001 rows
        stats = ckpt.save({"w": w}, step=step).result()
        pinned.append(stats.pinned_bytes)
        if step == 0:
            assert w.numel() * 4 <= stats.pinned_bytes <= 1.1 * w.numel() * 4
    assert pinned == [pinned[0]] * 5
    ckpt.close()
    assert all(pool.pinned_bytes == 0 for pool in ckpt._pools)


def test_a_read_once_load_into_cuda_destinations_is_bit_exact(tmp_path):
    """Two gloo ranks on one GPU: the items each owner sends land in the other's pinned ring, then on the GPU."""
    from cooperative_workers import load_into_cuda, save_layouts
    from dist_utils import run_ranks

    root = f"file://{tmp_path}/layouts"
    run_ranks(save_layouts, 2, root, 4, ("replicated",))
    assert all(run_ranks(load_into_cuda, 2, f"{root}/replicated", 4).values())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_read_once_load_over_nccl_is_bit_exact(tmp_path):
    """Two ranks, a GPU each: the items travel over an NCCL group, into CUDA destinations in place, through the ring, and to a CPU one."""
    from cooperative_workers import load_over_nccl, save_layouts
    from dist_utils import run_ranks

    root = f"file://{tmp_path}/layouts"
    run_ranks(save_layouts, 2, root, 4, ("replicated",))
    assert all(run_ranks(load_over_nccl, 2, f"{root}/replicated", 4).values())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensors_on_cuda_1_create_no_context_on_gpu_0(tmp_path):
    """(g) A rank whose tensors are on cuda:1 and that never called set_device: no primary context on GPU 0."""
    code = f"""
import torch, dcpstore
w = torch.randn(1000, 1000, device="cuda:1")
ckpt = dcpstore.AsyncCheckpointer("file://{tmp_path}/run")
ckpt.save({{"w": w}}, step=1).result()
out = {{"w": torch.zeros(1000, 1000, device="cuda:1")}}
ckpt.load(out, step=1)
ckpt.close()
assert torch.equal(out["w"], w)
import torch.distributed.checkpoint as dcp
dcp.save({{"w": w}}, storage_writer=dcpstore.ObjectStoreWriter("file://{tmp_path}/plain"), no_dist=True)
out = {{"w": torch.zeros(1000, 1000, device="cuda:1")}}
dcp.load(out, storage_reader=dcpstore.ObjectStoreReader("file://{tmp_path}/plain"), no_dist=True)
assert torch.equal(out["w"], w)
assert not torch._C._cuda_hasPrimaryContext(0), "a context was created on GPU 0"
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
