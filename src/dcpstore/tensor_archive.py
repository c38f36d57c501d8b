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
into their destination and must not write to it.  Anything else (another
pickle shape, a big-endian archive, quantized or newer storage types) goes
to ``torch.load(weights_only=True)``, so the fast path can only ever refuse,
never accept more than torch would.

Better still, a tensor's bytes need not pass through a buffer at all
(``scatter``): ``locate_data`` finds where the data record starts from the
archive's first few hundred bytes, so the rest can land in the destination
as it arrives, and ``holds_in_place`` then checks, by the same fast-path
rules over the whole archive, that those bytes are the tensor
``torch.load`` would return.
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
import pickletools
import struct
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
        return _read_plain(ViewFile(view), view.nbytes, _view_storage(view))  # io.BytesIO(view) would copy the item
    except _NotPlain:
        return torch.load(io.BytesIO(view), map_location="cpu", weights_only=True)


def holds_in_place(archive_file: ViewFile, size: int, data_start: int, target: torch.Tensor) -> bool:
    """Whether the archive in ``archive_file`` is ``target``'s bytes as they lie at ``data_start``.

    That is: the plain tensor of the fast path, of ``target``'s dtype and
    shape, contiguous, its storage exactly the record that torch's reader
    (central directory and all) finds at ``data_start``, so that those
    bytes, copied as they are into a contiguous ``target``, are the tensor
    ``torch.load`` would return.  ``locate_data`` only guessed where the
    data starts; this decides.
    """
    nbytes = target.numel() * target.element_size()

    def storage_at(start: int, length: int, dtype: torch.dtype):
        if start != data_start or length != nbytes:
            raise _NotPlain
        return torch.empty(length, dtype=torch.uint8, device="meta").untyped_storage()

    try:
        tensor = _read_plain(archive_file, size, storage_at)
    except _NotPlain:
        return False
    return (
        tensor.dtype == target.dtype
        and tensor.size() == target.size()
        and tensor.storage_offset() == 0
        and tensor.is_contiguous()
    )


_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip local file header, up to the name
_DESCRIPTOR = struct.Struct("<4sIII")  # a data descriptor: signature, crc32, sizes


def locate_data(head: memoryview) -> int | None:
    """Where the first ``data/`` record's bytes start in the archive that begins with ``head``.

    Walks the local file headers as ``torch.save`` writes them (stored,
    sizes in a data descriptor after each record: the records before the
    data, ``data.pkl`` and a few short ones, are at most ``_MAX_PICKLE``
    bytes each).  ``None``: ``head`` is too short to tell yet.  Raises
    ``ValueError`` for anything else.  A guess from bytes not yet checked:
    ``holds_in_place`` decides, once the whole archive is there.
    """
    pos = 0
    while True:
        if len(head) < pos + _LOCAL_HEADER.size:
            return None
        signature, _, flags, method, _, _, _, _, _, name_len, extra_len = _LOCAL_HEADER.unpack_from(head, pos)
        if signature != b"PK\x03\x04" or method != 0 or not flags & 0x08:
            raise ValueError("not a record as torch.save writes one")
        start = pos + _LOCAL_HEADER.size + name_len + extra_len
        if len(head) < start:
            return None
        name = bytes(head[pos + _LOCAL_HEADER.size : pos + _LOCAL_HEADER.size + name_len])
        if name.partition(b"/")[2].startswith(b"data/"):
            return start
        window = bytes(head[start : start + _MAX_PICKLE + _DESCRIPTOR.size])
        length = _record_length(window)
        if length is None:
            if len(window) < _MAX_PICKLE + _DESCRIPTOR.size:
                return None
            raise ValueError("a record before the data is longer than a plain tensor's")
        pos = start + length + _DESCRIPTOR.size


def _record_length(window: bytes) -> int | None:
    """The length of the record ``window`` starts with: where a data descriptor of that length follows it."""
    end = window.find(b"PK\x07\x08")
    while 0 <= end and end + _DESCRIPTOR.size <= len(window):
        _, _, stored, size = _DESCRIPTOR.unpack_from(window, end)
        if stored == size == end:
            return end
        end = window.find(b"PK\x07\x08", end + 1)
    return None


_END = struct.Struct("<4sHHHHIIH")  # end of central directory
_END64_LOCATOR = struct.Struct("<4sIQI")
_END64 = struct.Struct("<4sQHHIIQQQQ")
_ENTRY = struct.Struct("<4sHHHHHHIIIHHHHHII")  # a central directory entry, up to the name


def _all_stored(archive_file: ViewFile, size: int) -> bool:
    """Whether the central directory, which torch's reader goes by, lists every record as stored.

    A storage is taken as the bytes at its record's offset, which is what
    ``torch.load`` reads only for a stored record: it inflates a deflated
    one.  ``torch.save`` never compresses, and writes no archive comment,
    so the end record is the last 22 bytes (anything else is not plain).
    Walked here rather than with ``zipfile``, which takes 0.2 ms an
    archive, more than the rest of the fast path (measured: ~10 us here).
    """

    def read(offset: int, n: int) -> bytes:
        archive_file.seek(offset)
        return archive_file.read(n)

    if size < _END.size:
        return False
    signature, _, _, _, entries, cd_size, cd_offset, comment = _END.unpack(read(size - _END.size, _END.size))
    if signature != b"PK\x05\x06" or comment:
        return False
    if entries == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:  # zip64
        at = size - _END.size - _END64_LOCATOR.size
        if at < 0:
            return False
        signature, _, end64, _ = _END64_LOCATOR.unpack(read(at, _END64_LOCATOR.size))
        if signature != b"PK\x06\x07" or end64 + _END64.size > size:
            return False
        signature, *_, entries, cd_size, cd_offset = _END64.unpack(read(end64, _END64.size))
        if signature != b"PK\x06\x06":
            return False
    if cd_size > _MAX_PICKLE * 4 or cd_offset + cd_size > size:
        return False
    directory, pos = read(cd_offset, cd_size), 0
    for _ in range(entries):
        if pos + _ENTRY.size > len(directory):
            return False
        fields = _ENTRY.unpack_from(directory, pos)
        if fields[0] != b"PK\x01\x02" or fields[4] != 0:  # signature, compression method
            return False
        pos += _ENTRY.size + fields[10] + fields[11] + fields[12]
    return True


def _view_storage(view: memoryview):
    """Storages as views of ``view`` itself: the tensor ``load_tensor`` returns shares its memory."""

    def storage_at(start: int, length: int, dtype: torch.dtype):
        with warnings.catch_warnings():
            # The view is read-only; the tensor is only read (copied into its destination).
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(view[start : start + length], dtype=torch.uint8) if length else torch.empty(0, dtype=torch.uint8)
        return data.untyped_storage()

    return storage_at


def _read_plain(archive_file: ViewFile, size: int, storage_at) -> torch.Tensor:
    """The plain tensor in the archive, its storage made by ``storage_at(start, length, dtype)``."""
    try:
        archive = torch._C.PyTorchFileReader(archive_file)
        if archive.has_record("byteorder") and bytes(archive.get_record("byteorder")) != b"little":
            raise _NotPlain
        data_pkl = archive.get_record("data.pkl")
    except _NotPlain:
        raise
    except Exception:  # noqa: BLE001 - not an archive torch's reader takes: let torch.load say why
        raise _NotPlain from None
    if len(data_pkl) > _MAX_PICKLE or not _is_plain(data_pkl) or not _all_stored(archive_file, size):
        raise _NotPlain
    unpickler = _PlainTensorUnpickler(io.BytesIO(data_pkl), archive, size, storage_at)
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
    """The C unpickler, with storages made by ``storage_at`` from the records' places in the archive."""

    def __init__(self, file, archive, size: int, storage_at):
        super().__init__(file)
        self._archive = archive
        self._size = size
        self._storage_at = storage_at
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
        length = numel * dtype.itemsize
        if self._archive.get_record_size(record) != length or start + length > self._size:
            raise _NotPlain
        self.storages += 1
        storage = self._storage_at(start, length, dtype)
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
