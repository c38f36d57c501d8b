"""``tensor_archive.load_tensor``: plain tensors are views of the fetched bytes; anything else goes to torch."""

import io
import pickle
import warnings
import zipfile

import pytest
import torch

from dcpstore.tensor_archive import load_tensor

PLAIN = [
    torch.randn(256),
    torch.randn(3, 4).t(),  # saved with its transposed strides
    torch.arange(10, dtype=torch.int64),
    torch.zeros(0),
    torch.tensor(3.5),
    torch.randn(5).to(torch.bfloat16),
    torch.ones(4, dtype=torch.bool),
    torch.randn(2, 2, dtype=torch.complex64),
    torch.randn(4, dtype=torch.float16),
]


def archive(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def shares_memory_with(tensor: torch.Tensor, raw: bytes) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # raw is read-only; it is only looked at
        lo = torch.frombuffer(raw, dtype=torch.uint8).data_ptr()
    return tensor.numel() == 0 or lo <= tensor.untyped_storage().data_ptr() < lo + len(raw)


@pytest.mark.parametrize("value", PLAIN, ids=lambda t: f"{t.dtype}-{tuple(t.shape)}")
def test_plain_tensors_load_as_views_of_the_archive(value):
    raw = archive(value)
    got = load_tensor(raw)
    assert got.dtype == value.dtype and got.shape == value.shape and got.stride() == value.stride()
    assert torch.equal(got, value)
    assert shares_memory_with(got, raw)  # no copy: the fast path took it


def test_other_tensors_go_to_torch_load_and_load_the_same():
    value = torch.randn(4).to(torch.float8_e4m3fn)  # no legacy storage class
    raw = archive(value)
    got = load_tensor(raw)
    assert got.dtype == value.dtype and torch.equal(got.float(), value.float())
    assert not shares_memory_with(got, raw)


def replace_data_pkl(raw: bytes, data_pkl: bytes) -> bytes:
    src = zipfile.ZipFile(io.BytesIO(raw))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, data_pkl if info.filename.endswith("/data.pkl") else src.read(info))
    return out.getvalue()


def test_a_pickle_that_restores_state_into_a_torch_function_is_refused_and_changes_nothing():
    evil = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n}X\x04\x00\x00\x00evilK\x01sb."
    raw = replace_data_pkl(archive(torch.randn(4)), evil)
    with pytest.raises(pickle.UnpicklingError):
        load_tensor(raw)
    assert not hasattr(torch._utils._rebuild_tensor_v2, "evil")


def test_a_storage_larger_than_its_record_is_refused():
    raw = archive(torch.randn(4))
    data_pkl = torch._C.PyTorchFileReader(io.BytesIO(raw)).get_record("data.pkl")
    lying = data_pkl.replace(b"K\x04", b"M\x00\x01", 1)  # numel 4 -> 256
    assert lying != data_pkl
    with pytest.raises(Exception):
        load_tensor(replace_data_pkl(raw, lying))


def test_bytes_that_are_no_archive_raise():
    with pytest.raises(Exception):
        load_tensor(b"not a torch.save archive")
