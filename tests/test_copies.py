"""How often the bytes of a checkpoint are copied and passed over, counted in instrumented runs.

The guard for the storage layer's per-byte cost (each copy or pass is
0.1-0.9 CPU s/GiB, see ``storage.body``, ``s3_requests.client_config`` and
``tensor_archive.save_tensor``):

* save: a tensor's bytes are not copied in Python land: ``torch.save``'s
  write of its storage is lent to the part writer, and parts go to the
  socket as views of that memory and of the part buffers the archive's
  headers were copied into (asyncio's transport copies at most what the
  kernel did not take of a 256 KiB slice); no SHA-256 of the body
  (``UNSIGNED-PAYLOAD``); one crc pass, dcpstore's (torch's zip crc fields
  are 0).  An async save copies each byte once, into its staging slab, and
  sends it from there.
* load: a tensor's bytes go from aiohttp's chunks straight into the
  destination tensor's memory (``scatter``), so nothing of an item's size is
  made on Python's heap; a destination that cannot take them as stored (not
  contiguous) gets them from one buffer of the item's size, carved from the
  load's host memory (``load_buffers``).

Python-heap copies are counted with ``tracemalloc``, which sees every
``bytes``/``bytearray`` allocation (part buffers are ``mmap``s and tensors
live in torch's allocator, so neither is counted).
"""

import asyncio.selector_events
import io
import tracemalloc
import zipfile
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpstore
from dcpstore import load_buffers, planner_data
from dcpstore.staging import HostSlab
from dcpstore.storage import TransferConfig
from dcpstore.storage.multipart import MultipartObjectWriter

from conftest import read_metadata_raw

MiB = 1 << 20
PART = 8 * MiB
BIG = 5 * PART // 2  # an item of 2.5 parts: multipart save, the split-range load


class TransportCopies:
    """Bytes asyncio's socket transports were handed, and bytes they kept (copied) to send later."""

    def __init__(self, monkeypatch):
        self.handed = self.kept = 0
        original = asyncio.selector_events._SelectorSocketTransport.write
        counter = self

        def write(transport, data):
            before = transport.get_write_buffer_size()
            original(transport, data)
            counter.handed += memoryview(data).nbytes
            counter.kept += max(0, transport.get_write_buffer_size() - before)

        monkeypatch.setattr(asyncio.selector_events._SelectorSocketTransport, "write", write)


class WriterTally:
    """Bytes the part writers copied into part buffers, and bytes lent to them (sent from where they lie), with their owners."""

    def __init__(self, monkeypatch):
        self.copied = self.lent = 0
        self.owners = []
        write, write_lent = MultipartObjectWriter.write, MultipartObjectWriter.write_lent
        tally = self

        def counting_write(writer, data):
            n = write(writer, data)
            tally.copied += n
            return n

        def counting_write_lent(writer, data, owner):
            n = write_lent(writer, data, owner)
            if n >= writer.LEND_MIN_BYTES:  # fewer are handed to write(), and counted there
                tally.lent += n
                tally.owners.append(owner)
            return n

        monkeypatch.setattr(MultipartObjectWriter, "write", counting_write)
        monkeypatch.setattr(MultipartObjectWriter, "write_lent", counting_write_lent)


def peak_python_heap(fn) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def state_dict() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"big": torch.randn(BIG // 4, generator=g), "small": torch.randn(1000, generator=g)}


def test_a_save_copies_each_byte_once_and_passes_over_it_once(bucket, s3, proxy, monkeypatch):
    sd = state_dict()

    def save(prefix: str, **storage_options) -> None:
        writer = dcpstore.ObjectStoreWriter(
            f"s3://{bucket}/{prefix}", storage_options=storage_options, transfer=TransferConfig(part_size=PART), objects_per_rank=1
        )
        dcp.save(sd, storage_writer=writer, no_dist=True)
        writer.close()

    save("warm-up")  # the client, the connections
    # Straight to the server (the fault proxy's threads would be counted).
    transport = TransportCopies(monkeypatch)
    tally = WriterTally(monkeypatch)
    peak = peak_python_heap(lambda: save("ckpt"))
    stored = sum(x.numel() * x.element_size() for x in sd.values())
    # The big tensor's bytes were lent, from the state dict's own tensor; only headers and the small one were copied.
    assert tally.lent == sd["big"].numel() * 4 and tally.copied < 16 * 1024
    assert {o.data_ptr() for o in tally.owners} == {sd["big"].data_ptr()}
    # No copy of a part was made on Python's heap: not a bytes() of a
    # buffer, not a join of headers and body, not a file read back into new
    # bytes.  What there is: the transports' leftovers of at most one 256 KiB
    # slice per part in flight, and the requests' own small objects.
    assert peak < 2 * MiB, f"{peak / MiB:.1f} MiB of Python heap during the save"
    # Parts went to the socket from the tensors and buffers; the transport
    # kept (copied) only what the kernel did not take at once.
    assert transport.handed >= stored
    assert transport.kept < stored / 2, f"the transport copied {transport.kept / MiB:.1f} of {stored / MiB:.0f} MiB"

    save("ckpt2", endpoint_url=proxy.endpoint)
    # No SHA-256 pass over a body.
    bodies = [h for m, p, h in proxy.headers if m == "PUT" and "ckpt2/" in p]
    assert len(bodies) >= 4  # three parts and .metadata
    assert {h["x-amz-content-sha256"] for h in bodies} == {"UNSIGNED-PAYLOAD"}
    # One crc pass: dcpstore's, checked against the stored bytes; torch's zip crc was not computed.
    metadata = read_metadata_raw(s3, bucket, "ckpt2")
    crcs = planner_data.read_checksums(metadata)
    for index, info in metadata.storage_data.items():
        obj = s3.get_object(Bucket=bucket, Key=f"ckpt2/{info.relative_path}")["Body"].read()
        item = obj[info.offset : info.offset + info.length]
        assert zlib.crc32(item) == crcs[index]
        assert {z.CRC for z in zipfile.ZipFile(io.BytesIO(item)).infolist()} == {0}
        assert torch.equal(torch.load(io.BytesIO(item), weights_only=True), sd[index.fqn])  # stock torch still loads it


def test_an_async_save_copies_each_byte_once_into_staging_and_sends_it_from_there(bucket, monkeypatch):
    sd = state_dict()
    ckpt = dcpstore.AsyncCheckpointer(f"s3://{bucket}/run", transfer=TransferConfig(part_size=PART), objects_per_rank=1)
    ckpt.save(sd, step=1).result()  # the client, the connections, the staging slab
    tally = WriterTally(monkeypatch)
    peak = peak_python_heap(lambda: ckpt.save(sd, step=2).result())
    slab = ckpt._pools[0]._slab.tensor
    # The big tensor's bytes lent from the staging slab (not a clone of a view of it); headers and the small one copied.
    assert tally.lent == sd["big"].numel() * 4 and tally.copied < 16 * 1024
    assert all(slab.data_ptr() <= o.data_ptr() < slab.data_ptr() + slab.numel() for o in tally.owners)
    assert peak < 2 * MiB, f"{peak / MiB:.1f} MiB of Python heap during the save"
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    ckpt.load(out, step=2)
    ckpt.close()
    assert all(torch.equal(out[k], v) for k, v in sd.items())


def test_dcp_async_save_stages_into_the_writers_reused_memory_and_sends_it_from_there(bucket, monkeypatch):
    """``dcp.async_save`` with a kept ``ObjectStoreWriter`` stages through the writer, not torch's ``DefaultStager``.

    The first save allocates the host memory; the second copies into the
    same slab (no allocation) and its big tensor's bytes are lent from it;
    what the trainer does after ``async_save`` returns never reaches the
    checkpoint.
    """
    from torch.distributed.checkpoint.staging import DefaultStager

    sd = state_dict()
    writer = dcpstore.ObjectStoreWriter(f"s3://{bucket}/ckpt1", transfer=TransferConfig(part_size=PART), objects_per_rank=1)
    monkeypatch.setattr(DefaultStager, "stage", lambda *a: pytest.fail("torch's DefaultStager staged"))

    def async_save(url):
        response = dcp.async_save(sd, checkpoint_id=url, storage_writer=writer, no_dist=True)
        expected = {k: v.clone() for k, v in sd.items()}
        sd["big"].add_(1)  # the trainer moves on at once
        (getattr(response, "upload_completion", None) or response).result()
        return expected

    expected = [async_save(f"s3://{bucket}/ckpt1")]
    (pool,) = writer._free_staging  # back once the save's copy was dropped
    slab = pool._slab.tensor
    tally = WriterTally(monkeypatch)
    monkeypatch.setattr(dcpstore.staging, "HostSlab", lambda n: pytest.fail("a second save allocated host memory"))
    expected.append(async_save(f"s3://{bucket}/ckpt2"))
    assert writer._free_staging == [pool] and pool._slab.tensor is slab
    assert tally.lent == sd["big"].numel() * 4
    assert all(slab.data_ptr() <= o.data_ptr() < slab.data_ptr() + slab.numel() for o in tally.owners)
    writer.close()
    for n, want in enumerate(expected, 1):
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(out, storage_reader=dcpstore.ObjectStoreReader(f"s3://{bucket}/ckpt{n}"), no_dist=True)
        assert all(torch.equal(out[k], v) for k, v in want.items()), n


def save_and_open(bucket: str, size: int, **storage_options):
    sd = {"big": torch.randn(size // 4, generator=torch.Generator().manual_seed(1)), "small": torch.arange(10.0)}
    url = f"s3://{bucket}/ckpt-{size}"
    transfer = TransferConfig(part_size=PART)
    dcp.save(sd, storage_writer=dcpstore.ObjectStoreWriter(url, transfer=transfer), no_dist=True)
    return sd, dcpstore.ObjectStoreReader(url, transfer=transfer, storage_options=storage_options)


@pytest.mark.parametrize("size", [3 * PART // 2, BIG], ids=["one-range", "split-range"])
def test_a_load_lands_a_tensors_bytes_straight_in_its_destination(bucket, s3, size):
    sd, reader = save_and_open(bucket, size)
    dest = {name: torch.zeros_like(t) for name, t in sd.items()}
    memory = dest["big"].data_ptr()
    peak = peak_python_heap(lambda: dcp.load(dest, storage_reader=reader, no_dist=True))
    reader.close()
    assert torch.equal(dest["big"], sd["big"]) and torch.equal(dest["small"], sd["small"])
    assert dest["big"].data_ptr() == memory
    # Nothing of the item's size on Python's heap: a range buffer, a join of
    # aiohttp's chunks, a BytesIO or a bytes() of the item would each be one.
    # Chunks of later parts that come before the head is read wait as
    # aiohttp made them (no copy), so a split range may hold those.
    waiting = size - PART if size > 2 * PART else 0
    assert peak < waiting + 2 * MiB, f"{peak / MiB:.1f} MiB of Python heap to load a {size / MiB:.0f} MiB item"


def test_a_destination_that_cannot_take_the_bytes_as_stored_gets_them_from_the_loads_host_memory(bucket, s3, monkeypatch):
    """One buffer of the item's size, carved from the load's slab (``load_buffers``), not made on Python's heap."""
    sd, reader = save_and_open(bucket, BIG)
    dest = {"big": torch.zeros(2 * sd["big"].numel())[::2], "small": torch.zeros(10)}  # not contiguous
    slabs = []
    monkeypatch.setattr(load_buffers, "HostSlab", lambda n: slabs.append(n) or HostSlab(n))
    peak = peak_python_heap(lambda: dcp.load(dest, storage_reader=reader, no_dist=True))
    reader.close()
    assert torch.equal(dest["big"], sd["big"])
    assert peak < BIG / 4, f"{peak / MiB:.1f} MiB of Python heap to load a {BIG / MiB:.0f} MiB item"
    assert len(slabs) == 1 and BIG < slabs[0] < BIG + 64 * 1024, f"slabs of {slabs} bytes: one, the big item's archive"


@pytest.mark.parametrize("cut", ["first-part", "last-part"])
def test_a_cut_body_landing_in_the_destination_is_fetched_again_bit_exact(bucket, s3, proxy, cut):
    """The part GET that carries the archive's head, or one that carries only data and tail, cut halfway."""
    sd, reader = save_and_open(bucket, BIG, endpoint_url=proxy.endpoint)
    rule = proxy.add("GET", r"\.distcp$", truncate=True, times=1, after=0 if cut == "first-part" else 2)
    dest = {name: torch.zeros_like(t) for name, t in sd.items()}
    dcp.load(dest, storage_reader=reader, no_dist=True)
    reader.close()
    assert rule.hits == 1
    assert torch.equal(dest["big"], sd["big"]) and torch.equal(dest["small"], sd["small"])
