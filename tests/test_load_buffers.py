"""The load's host memory: a ring carved in issue order, freed in delivery order, bounded by the read-ahead window."""

import random

import torch

from test_writer_reader import load, save

from dcpstore import load_buffers
from dcpstore.load_buffers import LoadBuffers
from dcpstore.staging import HostSlab

KiB, MiB = 1 << 10, 1 << 20


def test_regions_are_carved_in_order_wrap_around_and_wait_for_delivery():
    ring = LoadBuffers(1000)
    first, second, third = (ring.reserve([300]) for _ in range(3))
    assert [(r.start, r.end) for r in (first, second, third)] == [(0, 320), (320, 640), (640, 960)]
    assert ring.reserve([300]) is None  # every region is a range not yet delivered
    first.delivered = True
    fourth = ring.reserve([300])
    assert (fourth.start, fourth.end) == (0, 320)  # wrapped into the first's memory
    assert ring.reserve([10]) is None  # between the fourth and the second: nothing free
    for i, region in enumerate((second, third, fourth)):
        region.buffers[0][:] = bytes([i]) * 300
    assert [bytes(r.buffers[0][:1]) for r in (second, third, fourth)] == [b"\0", b"\1", b"\2"]
    assert ring.nbytes == 1000
    ring.close()
    assert ring.nbytes == 0


def test_a_range_larger_than_the_ring_grows_it_once_empty_and_one_without_buffers_takes_nothing():
    ring = LoadBuffers(100)
    nothing = ring.reserve([])
    assert nothing.delivered and nothing.buffers == [] and ring.nbytes == 0
    region = ring.reserve([500, 7])
    assert [len(b) for b in region.buffers] == [500, 7] and ring.nbytes == 512 + 64
    assert ring.reserve([1]) is None
    region.delivered = True
    assert ring.reserve([600]).start == 0 and ring.nbytes == 640  # waited for, then replaced
    ring.close()


def test_many_buffered_items_under_a_small_readahead_load_bit_exact_in_bounded_memory(bucket, monkeypatch):
    """verify_before_landing: every tensor item lands in the ring, sized once for the window (two ranges at least)."""
    rng = random.Random(3)
    sd = {f"t{i}": torch.randn(rng.choice((1, 100, 30 * KiB, 300 * KiB, 700 * KiB))) for i in range(40)}
    url = f"s3://{bucket}/ckpt"
    save(sd, url)
    slabs = []
    monkeypatch.setattr(load_buffers, "HostSlab", lambda n: slabs.append(n) or HostSlab(n))
    out = load({k: torch.zeros_like(v) for k, v in sd.items()}, url, verify_before_landing=True, readahead_bytes=MiB)
    assert all(torch.equal(out[k], v) for k, v in sd.items())
    tensor_bytes = sum(v.numel() * 4 for v in sd.values())
    assert len(slabs) == 1 and slabs[0] <= 1.01 * tensor_bytes + 64 * KiB, slabs  # sized once, never grown
