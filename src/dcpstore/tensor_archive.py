"""A tensor into and out of a ``torch.save`` archive: safely, quickly, without copying its bytes.

DCP stores every tensor item as one ``torch.save`` archive, and torch's
readers load each with ``torch.load(weights_only=True)``: safe, but its
unpickler is pure Python and it copies the data into new storage.  For the
many small tensors of an optimizer state that is most of a load's time
(about 0.5 ms an item on a 2-core machine: 1.5 s for 3,000 items of 1 KiB,
against ~0.1 ms here), and for large ones a second copy of every byte.

``load_tensor`` takes the common case, a plain dense tensor as torch's DCP
writers save it, on a fast path: torch's C++ archive reader finds the
records; the small ``data.pkl`` is first scanned opcode by opcode and must be
exactly the shape ``Tensor.__reduce_ex__`` writes (a ``_rebuild_tensor_v2``
call on one storage, no BUILD, no other globals), then unpickled by the C
unpickler with only those globals; the storage is a view of ``raw`` itself.
The tensor returned therefore shares memory with ``raw``: callers copy it
into their destination (one copy of each fetched byte) and
must not write to it.  Anything else (another pickle shape, a big-endian
archive, quantized or newer storage types) goes to ``torch.load(weights_only=True)``,
so the fast path can only ever refuse, never accept more than torch would.
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
import pickletools
import warnings

import torch

from .storage.body import ViewFile

# The opcodes ``torch.save(tensor)`` writes for a plain tensor's data.pkl.
_OPCODES = frozenset(
    {
        "PROTO", "FRAME", "GLOBAL", "BINPUT", "LONG_BINPUT", "MEMOIZE", "BINGET", "LONG_BINGET",
        "MARK", "BINUNICODE", "SHORT_BINUNICODE", "BININT", "BININT1", "BININT2", "LONG1",
        "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_TUPLE", "BINPERSID", "NEWFALSE", "NEWTRUE",
        "NONE", "REDUCE", "STOP",
    }
)
_STORAGE_TYPES = (
    "BFloat16Storage", "BoolStorage", "ByteStorage", "CharStorage", "ComplexDoubleStorage",
    "ComplexFloatStorage", "DoubleStorage", "FloatStorage", "HalfStorage", "IntStorage",
    "LongStorage", "ShortStorage",
)
with warnings.catch_warnings():  # a legacy storage class's dtype warns that TypedStorage is deprecated
    warnings.simplefilter("ignore", UserWarning)
    _DTYPES = {getattr(torch, name): getattr(torch, name).dtype for name in _STORAGE_TYPES}
_GLOBALS = {
    "torch._utils _rebuild_tensor_v2": torch._utils._rebuild_tensor_v2,
    "collections OrderedDict": collections.OrderedDict,
    **{f"torch {name}": getattr(torch, name) for name in _STORAGE_TYPES},
}
_MAX_PICKLE = 4096  # a plain tensor's data.pkl is ~150 bytes


def save_tensor(tensor: torch.Tensor, stream) -> None:
    """``torch.save(tensor, stream)``, less torch's crc32 of every record.

    That crc is one more pass over every byte (0.53 CPU s/GiB measured
    here) that no reader checks: torch's own reader is built with miniz's
    crc checks off.  dcpstore's item crc32, taken in the same pass as the
    write (``writer._ChecksummingStream``), is the one committed and
    checked.  ``torch.serialization.set_crc32_options`` would turn torch's
    off for every thread in the process, the training loop's ``torch.save``
    included, so the archive is opened here as ``torch.save`` opens it,
    with the option given to this writer alone.
    """
    archive = torch._C.PyTorchFileWriter(stream, False, torch.serialization._get_storage_alignment())
    torch.serialization._save(tensor, archive, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    archive.write_end_of_file()


class _NotPlain(Exception):
    """The archive is not the plain-tensor shape: use torch.load."""


def load_tensor(raw: bytes | memoryview) -> torch.Tensor:
    """The tensor ``torch.save`` wrote into ``raw``; a view of ``raw`` when it can be.

    Raises what ``torch.load(weights_only=True)`` raises for bytes it refuses.
    """
    view = memoryview(raw)
    try:
        return _load_plain(view)
    except _NotPlain:
        return torch.load(io.BytesIO(view), map_location="cpu", weights_only=True)


def _load_plain(view: memoryview) -> torch.Tensor:
    try:
        archive = torch._C.PyTorchFileReader(ViewFile(view))  # io.BytesIO(view) would copy the item
        if archive.has_record("byteorder") and bytes(archive.get_record("byteorder")) != b"little":
            raise _NotPlain
        data_pkl = archive.get_record("data.pkl")
    except _NotPlain:
        raise
    except Exception:  # noqa: BLE001 - not an archive torch's reader takes: let torch.load say why
        raise _NotPlain from None
    if len(data_pkl) > _MAX_PICKLE:
        raise _NotPlain
    if not _is_plain(data_pkl):
        raise _NotPlain
    unpickler = _PlainTensorUnpickler(io.BytesIO(data_pkl), archive, view)
    try:
        tensor = unpickler.load()
    except _NotPlain:
        raise
    except Exception:  # noqa: BLE001
        raise _NotPlain from None
    if type(tensor) is not torch.Tensor or unpickler.storages != 1:
        raise _NotPlain
    return tensor


@functools.lru_cache(maxsize=4096)
def _is_plain(data_pkl: bytes) -> bool:
    """Whether ``data_pkl`` uses only a plain tensor's opcodes and globals.

    Cached: tensors of one shape and dtype (an optimizer's moments, a
    model's repeated layers) have byte-identical ``data.pkl``s, and the scan
    is most of the fast path's cost.
    """
    try:
        return all(
            opcode.name in _OPCODES and (opcode.name != "GLOBAL" or arg in _GLOBALS)
            for opcode, arg, _ in pickletools.genops(data_pkl)
        )
    except Exception:  # noqa: BLE001 - malformed: torch.load reports it
        return False


class _PlainTensorUnpickler(pickle.Unpickler):
    """The C unpickler, with storages as views of the archive's bytes."""

    def __init__(self, file, archive, view: memoryview):
        super().__init__(file)
        self._archive = archive
        self._view = view
        self.storages = 0

    def find_class(self, module: str, name: str):
        try:
            return _GLOBALS[f"{module} {name}"]
        except KeyError:
            raise _NotPlain from None

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[1] in _DTYPES):
            raise _NotPlain
        _, storage_type, key, _location, numel = pid
        if not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise _NotPlain
        dtype = _DTYPES[storage_type]
        record = f"data/{key}"
        start = self._archive.get_record_offset(record)
        end = start + numel * dtype.itemsize
        if self._archive.get_record_size(record) != end - start or end > len(self._view):
            raise _NotPlain
        self.storages += 1
        with warnings.catch_warnings():
            # The view is read-only; the tensor is only read (copied into its destination).
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(self._view[start:end], dtype=torch.uint8) if end > start else torch.empty(0, dtype=torch.uint8)
            return torch.storage.TypedStorage(wrap_storage=data.untyped_storage(), dtype=dtype, _internal=True)
