"""Landing a ranged read's pieces where they belong (``dcpstore.scatter``), in any order.

The store may hand a range over in pieces of any size, out of order (part
GETs run concurrently) and more than once (a retried GET writes its part
again).  Whatever the order, every item must end up either whole in a buffer
of its own or, for a tensor the destination can take as stored, with its
data in the destination; and ``leftover`` must then give exactly what
``torch.load`` would read.
"""

import io
import random
import struct
import zipfile
import zlib

import pytest
import torch

from dcpstore.scatter import HEAD_BYTES, ItemLanding, RangeScatter, destination_bytes
from dcpstore.tensor_archive import load_tensor, locate_data, save_tensor


def archive(tensor, saver=save_tensor) -> bytes:
    stream = io.BytesIO()
    saver(tensor, stream)
    return stream.getvalue()


def land(items: list[tuple[bytes, torch.Tensor | None]], rng: random.Random, *, gap: int = 100) -> list[ItemLanding]:
    """Scatter a range holding ``items`` (bytes, target) with gaps between them, in shuffled, repeated pieces."""
    body, spans = bytearray(), []
    for raw, target in items:
        body += rng.randbytes(gap)
        spans.append((len(body), ItemLanding(len(raw), target)))
        body += raw
    cuts = sorted({0, len(body), *(rng.randrange(len(body)) for _ in range(12))})
    pieces = [(a, memoryview(bytes(body[a:b]))) for a, b in zip(cuts, cuts[1:])]
    pieces += rng.sample(pieces, k=len(pieces) // 3)  # retried parts write again
    rng.shuffle(pieces)
    sink = RangeScatter(spans)
    for offset, piece in pieces:
        sink.write(offset, piece)
    return [landing for _, landing in spans]


TENSORS = {
    "float32": lambda: torch.randn(1000),
    "matrix": lambda: torch.randn(37, 11),
    "bfloat16": lambda: torch.randn(513).to(torch.bfloat16),
    "bool": lambda: torch.rand(77) > 0.5,
    "int64": lambda: torch.arange(-50, 50),
    "complex64": lambda: torch.randn(20, dtype=torch.complex64),
    "scalar": lambda: torch.tensor(2.5),
    "large": lambda: torch.randn(HEAD_BYTES),  # more than the head window
}


@pytest.mark.parametrize("saver", [save_tensor, torch.save], ids=["dcpstore", "torch.save"])
@pytest.mark.parametrize("seed", range(4))
def test_a_tensor_lands_in_its_destination_whatever_the_order_of_pieces(saver, seed):
    rng = random.Random(seed)
    stored = {name: make() for name, make in TENSORS.items()}
    raws = {name: archive(t, saver) for name, t in stored.items()}
    targets = {name: torch.zeros_like(t) for name, t in stored.items()}
    landings = land([(raws[name], targets[name]) for name in stored], rng)
    for name, landing in zip(stored, landings):
        assert landing.in_destination, name
        assert landing.crc32() == zlib.crc32(raws[name]), name
        assert landing.leftover() is None, name
        assert torch.equal(targets[name], stored[name]), name


def test_what_the_destination_cannot_take_as_stored_is_loaded_from_the_item_put_together():
    """Bytes already in the destination are not trusted to be the tensor: ``holds_in_place`` decides."""
    rng = random.Random(5)
    transposed = torch.randn(8, 6).t()  # stored with its strides, as torch's FileSystemWriter keeps it
    floats = torch.randn(100)
    cases = [
        (archive(transposed, torch.save), torch.zeros(6, 8)),  # same bytes, another order
        (archive(floats), torch.zeros(100, dtype=torch.int32)),  # same size, another dtype
        (archive(floats), torch.zeros(10, 10)),  # same size, another shape
    ]
    for (raw, target), landing in zip(cases, land(cases, rng)):
        assert landing.in_destination  # the guess from the head...
        assert landing.crc32() == zlib.crc32(raw)
        assert bytes(landing.leftover()) == raw  # ...which the whole archive overrules


def test_a_decoy_data_record_ahead_of_the_real_one_is_not_taken_for_the_tensor():
    """A hostile archive: torch's reader follows ``data.pkl`` to ``data/0``, and so must the result."""
    real = torch.arange(64, dtype=torch.float32)
    pickled = torch._C.PyTorchFileReader(io.BytesIO(archive(real))).get_record("data.pkl")
    stream = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(stream)
    writer.write_record("data.pkl", pickled, len(pickled))
    writer.write_record("byteorder", b"little", 6)
    decoy = torch.full((64,), -1.0).numpy().tobytes()
    writer.write_record("data/1", decoy, len(decoy))
    writer.write_record("data/0", real.numpy().tobytes(), real.numel() * 4)
    writer.write_end_of_file()
    raw = stream.getvalue()
    assert torch.equal(torch.load(io.BytesIO(raw), weights_only=True), real)

    target = torch.zeros(64)
    (landing,) = land([(raw, target)], random.Random(0))
    assert landing.in_destination and torch.equal(target, torch.full((64,), -1.0))  # the decoy landed...
    leftover = landing.leftover()
    assert leftover is not None  # ...and was refused
    assert torch.equal(load_tensor(leftover), real)


# A torch.save-like first record whose data descriptor never comes.
RECORD_WITHOUT_END = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0x08, 0, 0, 0, 0, 0, 0, 16, 0) + b"archive/data.pkl" + bytes(HEAD_BYTES)


@pytest.mark.parametrize(
    "raw",
    [b"", b"not an archive at all" * 100, RECORD_WITHOUT_END],
    ids=["empty", "garbage", "record-without-end"],
)
def test_an_item_that_is_no_plain_archive_lands_whole_in_its_buffer(raw):
    target = torch.zeros(16)
    (landing,) = land([(raw, target)], random.Random(1)) if raw else [ItemLanding(0, target)]
    assert not landing.in_destination
    assert bytes(landing.leftover()) == raw
    assert torch.equal(target, torch.zeros(16))


def test_items_without_a_usable_destination_land_whole_and_gaps_go_nowhere():
    rng = random.Random(2)
    t = torch.randn(300)
    raw = archive(t)
    non_contiguous = torch.zeros(600)[::2]
    cases = [(raw, None), (raw, non_contiguous), (raw, torch.zeros(300).to_sparse()), (b"\x80pickled", None)]
    for (item, _), landing in zip(cases, land(cases, rng, gap=5000)):
        assert not landing.in_destination
        assert bytes(landing.leftover()) == item
    assert destination_bytes(torch.zeros(3).conj()) is not None  # real tensors: conj is a no-op
    assert destination_bytes(torch.zeros(3, dtype=torch.complex64).conj()) is None
    assert destination_bytes(torch.zeros(0)) is None


def test_locate_data_waits_for_the_head_then_finds_the_data_record():
    t = torch.randn(10)
    raw = archive(t)
    start = locate_data(memoryview(raw))
    assert raw[start : start + 40] == t.numpy().tobytes()
    assert all(locate_data(memoryview(raw)[:cut]) is None for cut in range(start))


def test_a_deflated_data_record_is_inflated_as_torch_load_does():
    """torch's reader goes by the central directory and inflates a deflated record; the raw bytes are not the tensor."""
    t = torch.arange(4096, dtype=torch.float32) % 3
    source = zipfile.ZipFile(io.BytesIO(archive(t, torch.save)))
    stream = io.BytesIO()
    with zipfile.ZipFile(stream, "w") as z:
        for info in source.infolist():
            method = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED
            z.writestr(info.filename, source.read(info.filename), compress_type=method)
    raw = stream.getvalue()
    assert torch.equal(torch.load(io.BytesIO(raw), weights_only=True), t)
    assert torch.equal(load_tensor(raw), t)
    target = torch.zeros(4096)
    (landing,) = land([(raw, target)], random.Random(3))
    leftover = landing.leftover()
    assert leftover is not None and torch.equal(load_tensor(leftover), t)
