"""Safe loading: whoever can write objects in the bucket cannot run code in a reader.

Planted ``.metadata`` pickles and non-tensor items are refused with
``UnsafeCheckpointError`` by every entry point (``ObjectStoreReader``,
``dcp.load`` with any planner, ``AsyncCheckpointer.load``, the CLI), over HTTP
to moto and on ``file://``, and a marker file the payload would create stays
absent.  Controls show each live payload does run under plain unpickling.
"""

import ast
import contextlib
import dataclasses
import io
import os
import pathlib
import pickle
import re
import subprocess
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, _MEM_FORMAT_ENCODING
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

import dcpstore
from dcpstore import planner_data
from dcpstore.cli import main
from helpers import Epoch, assert_state_dict_equal, sample_state_dict, zeros_like_state_dict

STEP = "step_00000001"
METADATA_MODULE = "torch.distributed.checkpoint.metadata"


@dataclasses.dataclass
class Root:
    """A checkpoint root on one store, with raw access that bypasses dcpstore."""

    url: str
    put: object
    get: object

    def step_url(self, step_prefix: str = STEP) -> str:
        return f"{self.url}/{step_prefix}"


@pytest.fixture(params=["s3", "file"])
def root(request, tmp_path) -> Root:
    if request.param == "s3":
        s3, bucket = request.getfixturevalue("s3"), request.getfixturevalue("bucket")
        return Root(
            f"s3://{bucket}/run",
            lambda key, body: s3.put_object(Bucket=bucket, Key=f"run/{key}", Body=body),
            lambda key: s3.get_object(Bucket=bucket, Key=f"run/{key}")["Body"].read(),
        )
    base = tmp_path / "bucket" / "run"

    def put(key, body):
        path = base / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)

    return Root(f"file://{base}", put, lambda key: (base / key).read_bytes())


@pytest.fixture
def marker(tmp_path) -> pathlib.Path:
    return tmp_path / "MARKER"


# -- hand-assembled pickles -----------------------------------------------------------------


def _s(text: str) -> bytes:
    """SHORT_BINUNICODE."""
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def _global(module: str, name: str) -> bytes:
    """STACK_GLOBAL: protocol 4 resolves dotted names such as ``os.system`` attribute by attribute."""
    return _s(module) + _s(name) + b"\x93"


def _call(module: str, name: str, *args: str) -> bytes:
    """A protocol-4 pickle calling ``module.name(*args)``."""
    return b"\x80\x04" + _global(module, name) + b"(" + b"".join(_s(a) for a in args) + b"tR."


class _Reduce:
    """Pickles as a call of ``func(*args)``: the classic ``__reduce__`` payload."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _touch(marker) -> str:
    return f"touch {marker}"


# Each: (what the pickle calls first, builder(marker) -> bytes, whether plain pickle.loads runs it).
PAYLOADS = {
    "os.system": ("os.system", lambda m: f"cos\nsystem\n(V{_touch(m)}\ntR.".encode(), True),
    "posix.system": ("posix.system", lambda m: pickle.dumps(_Reduce(os.system, _touch(m))), True),
    "subprocess.Popen": ("subprocess.Popen", lambda m: pickle.dumps(_Reduce(subprocess.Popen, ["touch", str(m)])), True),
    "subprocess.check_call": (
        "subprocess.check_call", lambda m: pickle.dumps(_Reduce(subprocess.check_call, ["touch", str(m)])), True,
    ),
    "builtins.eval": (
        "builtins.eval", lambda m: pickle.dumps(_Reduce(eval, f"__import__('os').system({_touch(m)!r})")), True,
    ),
    "builtins.getattr": (
        "builtins.getattr",
        lambda m: f"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(Vos\ntRVsystem\ntR(V{_touch(m)}\ntR.".encode(),
        True,
    ),
    "nested pickle.loads": (
        "_pickle.loads", lambda m: pickle.dumps(_Reduce(pickle.loads, pickle.dumps(_Reduce(os.system, _touch(m))))), True,
    ),
    "torch.load": ("torch.serialization.load", lambda m: pickle.dumps(_Reduce(torch.load, str(m) + ".pt")), False),
    "functools.partial": (
        "functools.partial", lambda m: b"\x80\x04" + _global("functools", "partial") + _global("os", "system")
        + _s(_touch(m)) + b"\x86R)R.", True,
    ),
    "copyreg._reconstructor": (
        "copyreg._reconstructor", lambda m: _call("copyreg", "_reconstructor", "x", "y", "z"), False,
    ),
    "os reached through an allowed module": (
        f"{METADATA_MODULE}.os.system", lambda m: _call(METADATA_MODULE, "os.system", _touch(m)), True,
    ),
    "torch reached through an allowed module": (
        f"{METADATA_MODULE}.torch.load", lambda m: _call(METADATA_MODULE, "torch.load", str(m)), False,
    ),
    "payload inside a real Metadata": (
        "posix.system", lambda m: pickle.dumps(Metadata({}, planner_data={"x": _Reduce(os.system, _touch(m))})), True,
    ),
}


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_planted_metadata_is_refused_everywhere(payload, root, marker, capsys):
    offending, build, live = PAYLOADS[payload]
    raw = build(marker)
    root.put(f"{STEP}/.metadata", raw)
    refused = rf"refusing to unpickle global '{re.escape(offending)}'"
    url = root.step_url()

    with pytest.raises(dcpstore.UnsafeCheckpointError, match=rf"{re.escape(url)}/\.metadata: {refused}"):
        dcpstore.ObjectStoreReader(url).read_metadata()
    with pytest.raises(BaseException, match=refused):
        dcp.load({"w": torch.zeros(3)}, storage_reader=dcpstore.ObjectStoreReader(url), no_dist=True)
    with dcpstore.AsyncCheckpointer(root.url) as ckpt, pytest.raises(dcpstore.CheckpointLoadError, match=refused) as e:
        ckpt.load({"w": torch.zeros(3)})
    assert isinstance(e.value.__cause__, dcpstore.UnsafeCheckpointError)
    for command in (["inspect", url], ["inspect", url, "--json"], ["verify", url], ["verify", url, "--deep"]):
        assert main(command) == 1, command
        assert re.search(refused, capsys.readouterr().err), command
    assert main(["ls", root.url]) == 0  # ls lists objects, reads no metadata
    assert re.search(r"^\s+1\s+committed", capsys.readouterr().out, re.M)
    assert not marker.exists()

    if live:  # control: the payload is real, plain unpickling runs it
        try:
            result = pickle.loads(raw)
            if isinstance(result, subprocess.Popen):
                result.wait()
        except Exception:  # noqa: BLE001 - only the side effect matters
            pass
        assert marker.exists()


def _build_on(target: bytes, state: bytes) -> bytes:
    return b"\x80\x04" + target + state + b"b."


def test_state_cannot_be_restored_into_shared_objects(root):
    """BUILD on an allowed class, function or Enum member would rewrite torch for the whole process."""
    eq, cache, member = Metadata.__eq__, dict(torch.serialization._get_layout.cache), _MEM_FORMAT_ENCODING(0)
    size = _global("torch", "Size")
    payloads = {
        "the class 'torch.distributed.checkpoint.metadata.Metadata'":
            _build_on(_global(METADATA_MODULE, "Metadata"), b"N}" + _s("__eq__") + size + b"s\x86"),
        "the function 'torch.serialization._get_layout'":
            _build_on(_global("torch.serialization", "_get_layout"), b"}" + _s("cache") + b"}s"),
        "a torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING object":
            _build_on(_global(METADATA_MODULE, "_MEM_FORMAT_ENCODING") + b"K\x00\x85R", b"N}" + _s("_value_") + b"K\x02s\x86"),
    }
    for described, raw in payloads.items():
        root.put(f"{STEP}/.metadata", raw)
        with pytest.raises(dcpstore.UnsafeCheckpointError, match=re.escape(f"refusing to restore state into {described}")):
            dcpstore.ObjectStoreReader(root.step_url()).read_metadata()
    assert Metadata.__eq__ is eq and torch.serialization._get_layout.cache == cache
    assert member.value == 0


@pytest.mark.parametrize(
    "raw",
    [
        _call("torch", "Size", "touch MARKER"),
        _call("torch.serialization", "_get_layout", "os.system"),
        _call("pathlib", "PosixPath", "/etc/passwd"),
        _call(METADATA_MODULE, "_MEM_FORMAT_ENCODING", "touch MARKER"),
        b"\x80\x04\x95garbage",
    ],
    ids=["Size", "_get_layout", "PosixPath", "Enum", "garbage"],
)
def test_allowed_names_with_attacker_arguments_only_build_data(raw, root):
    root.put(f"{STEP}/.metadata", raw)
    with pytest.raises(dcpstore.CorruptCheckpointError, match=r"\.metadata: (cannot unpickle the metadata|holds a)"):
        dcpstore.ObjectStoreReader(root.step_url()).read_metadata()


# -- non-tensor items -------------------------------------------------------------------------


def _save_step(root: Root, state_dict: dict) -> None:
    with dcpstore.AsyncCheckpointer(root.url) as ckpt:
        ckpt.save(state_dict, step=1)


def _rewrite_metadata(root: Root, edit) -> None:
    """Rewrite the step's .metadata as an attacker with write access would (plain pickle, trusted here)."""
    metadata = pickle.loads(root.get(f"{STEP}/.metadata"))
    edit(metadata)
    root.put(f"{STEP}/.metadata", pickle.dumps(metadata))


def _plant_item(root: Root, fqn: str, payload: bytes) -> None:
    """Point ``fqn``'s item at a new object holding ``payload``, with a matching checksum."""
    root.put(f"{STEP}/planted.distcp", payload)

    def edit(metadata):
        (index,) = [i for i in metadata.storage_data if i.fqn == fqn]
        metadata.storage_data[index] = _StorageInfo("planted.distcp", 0, len(payload))
        crcs = planner_data.read_checksums(metadata)
        crcs[index] = zlib.crc32(payload)
        metadata.planner_data.update(planner_data.checksum_extras(metadata.storage_data, crcs))

    _rewrite_metadata(root, edit)


def _torch_saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class RawPicklePlanner(DefaultLoadPlanner):
    """A user planner that reads bytes items with plain pickle."""

    def load_bytes(self, read_item, value):
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], pickle.load(value))


BYTES_PAYLOADS = {
    "torch.save archive": lambda m: _torch_saved({"epoch": _Reduce(os.system, _touch(m))}),
    "raw pickle protocol 2": lambda m: pickle.dumps(_Reduce(os.system, _touch(m)), protocol=2),
}


@pytest.mark.parametrize("payload", list(BYTES_PAYLOADS))
def test_planted_bytes_item_is_refused_whatever_the_planner(payload, root, marker, capsys):
    _save_step(root, {"w": torch.ones(3), "extra": {"epoch": 3}})
    _plant_item(root, "extra.epoch", BYTES_PAYLOADS[payload](marker))
    url = root.step_url()
    refused = r"planted\.distcp \((item )?'extra\.epoch'.*refusing to unpickle global 'posix\.system'"

    for planner in (None, DefaultLoadPlanner(), RawPicklePlanner(), _EmptyStateDictLoadPlanner()):
        with pytest.raises(BaseException, match=refused):
            sd = {} if isinstance(planner, _EmptyStateDictLoadPlanner) else {"w": torch.zeros(3), "extra": {"epoch": 0}}
            _load_state_dict(sd, storage_reader=dcpstore.ObjectStoreReader(url), planner=planner, no_dist=True)
    with dcpstore.AsyncCheckpointer(root.url) as ckpt, pytest.raises(BaseException, match=refused):
        ckpt.load({"w": torch.zeros(3), "extra": {"epoch": 0}})
    assert main(["verify", url]) == 0  # sizes and keys are fine
    assert main(["verify", url, "--deep"]) == 1
    assert re.search(refused, capsys.readouterr().out)
    assert not marker.exists()

    # Control: with the check switched off, torch's planner runs the payload.
    with pytest.raises(BaseException) if payload.startswith("raw") else contextlib.nullcontext():
        dcp.load({"w": torch.zeros(3), "extra": {"epoch": 0}},
                 storage_reader=dcpstore.ObjectStoreReader(url, allow_unsafe_pickle=True), no_dist=True)
    assert marker.exists()


def test_custom_type_in_a_bytes_item_needs_explicit_trust(root):
    sd = {"w": torch.ones(3), "extra": Epoch(3)}
    _save_step(root, sd)
    url = root.step_url()

    def load(**kwargs):
        out = {"w": torch.zeros(3), "extra": None}
        dcp.load(out, storage_reader=dcpstore.ObjectStoreReader(url, **kwargs), no_dist=True)
        return out

    with pytest.raises(BaseException, match=r"item 'extra'.*refusing to unpickle global 'helpers\.Epoch'"):
        load()
    before = torch.serialization.get_safe_globals()
    assert load(allow_unsafe_pickle=True)["extra"] == Epoch(3)
    assert load(allow_globals=[Epoch])["extra"] == Epoch(3)
    assert torch.serialization.get_safe_globals() == before  # allow_globals did not leak into torch's registry
    with torch.serialization.safe_globals([Epoch]):
        assert load(allow_globals=[Epoch])["extra"] == Epoch(3)
        assert Epoch in torch.serialization.get_safe_globals()  # a user's own registration survives
        assert load()["extra"] == Epoch(3)


class _UserPlannerData(DefaultSavePlanner):
    def create_global_plan(self, all_plans):
        plans, md = super().create_global_plan(all_plans)
        return plans, dataclasses.replace(md, planner_data=Epoch(5))


def test_custom_planner_data_type_needs_explicit_trust(root):
    url = root.step_url()
    dcp.save({"w": torch.ones(3)}, storage_writer=dcpstore.ObjectStoreWriter(url),
             planner=_UserPlannerData(flatten_state_dict=False), no_dist=True)
    with pytest.raises(dcpstore.UnsafeCheckpointError, match=r"refusing to unpickle global 'helpers\.Epoch'.*allow_globals"):
        dcpstore.ObjectStoreReader(url).read_metadata()
    assert dcpstore.ObjectStoreReader(url, allow_globals=[Epoch]).read_metadata().planner_data == Epoch(5)
    assert dcpstore.ObjectStoreReader(url, allow_globals=[(Epoch, "helpers.Epoch")]).read_metadata().planner_data == Epoch(5)
    with torch.serialization.safe_globals([Epoch]):
        assert dcpstore.ObjectStoreReader(url).read_metadata().planner_data == Epoch(5)
        out = {"w": torch.zeros(3)}
        dcp.load(out, storage_reader=dcpstore.ObjectStoreReader(url), no_dist=True)
    assert torch.equal(out["w"], torch.ones(3))


# -- keys ---------------------------------------------------------------------------------------


def test_an_item_whose_storage_info_lacks_its_fields_is_refused_by_name(root):
    """A ``_StorageInfo`` unpickled without ``offset`` (a BUILD with another dict): our error naming the item, not an AttributeError."""
    _save_step(root, {"w": torch.arange(4.0)})

    def edit(metadata):
        index, info = next(iter(metadata.storage_data.items()))
        hollow = object.__new__(_StorageInfo)
        hollow.__dict__["relative_path"] = info.relative_path
        metadata.storage_data[index] = hollow

    _rewrite_metadata(root, edit)
    with pytest.raises(dcpstore.CorruptCheckpointError, match=r"\.metadata: item .* has offset None"):
        dcpstore.ObjectStoreReader(root.step_url()).read_metadata()


@pytest.mark.parametrize("packed", [b"\0" * 4, b"\0" * 12, "not bytes"], ids=["short", "long", "str"])
def test_a_crc32_array_that_does_not_fit_the_items_is_refused_by_name(packed, root):
    """One crc32 per stored item, or the checkpoint is corrupt: never a check skipped, never an item paired with another's crc."""
    _save_step(root, {"w": torch.arange(4.0), "b": torch.ones(3)})

    def edit(metadata):
        assert len(metadata.planner_data[planner_data.CRC32_ARRAY_KEY]) == 8
        metadata.planner_data[planner_data.CRC32_ARRAY_KEY] = packed

    _rewrite_metadata(root, edit)
    reader = dcpstore.ObjectStoreReader(root.step_url())
    with pytest.raises(dcpstore.CorruptCheckpointError, match=r"\.metadata: its crc32 array .* each of its 2 stored items"):
        reader.set_up_storage_reader(reader.read_metadata(), True)


@pytest.mark.parametrize(
    "key",
    ["../other/x.distcp", "/etc/passwd", "a/../../x.distcp", "..\\..\\x.distcp", "s3://other-bucket/x.distcp", "", "a//b",
     ["x.distcp"]],  # not even hashable (the fuzz run found one): refused like the rest, not a TypeError
)
def test_keys_outside_the_checkpoint_are_refused(key, root, capsys):
    _save_step(root, {"w": torch.arange(4.0)})

    def edit(metadata):
        index = next(iter(metadata.storage_data))
        metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], relative_path=key)

    _rewrite_metadata(root, edit)
    url = root.step_url()
    refused = rf"\.metadata: item .* names the object {re.escape(repr(key))}, which is not a key below the checkpoint prefix"
    with pytest.raises(dcpstore.CorruptCheckpointError, match=refused):
        dcpstore.ObjectStoreReader(url).read_metadata()
    with pytest.raises(BaseException, match=refused):
        dcp.load({"w": torch.zeros(4)}, storage_reader=dcpstore.ObjectStoreReader(url), no_dist=True)
    assert main(["verify", url]) == 1
    assert re.search(refused, capsys.readouterr().err)


def test_keys_in_subfolders_of_the_checkpoint_still_load(root):
    _save_step(root, {"w": torch.arange(4.0)})
    (info,) = pickle.loads(root.get(f"{STEP}/.metadata")).storage_data.values()
    root.put(f"{STEP}/sub/{info.relative_path}", root.get(f"{STEP}/{info.relative_path}"))
    _rewrite_metadata(root, lambda md: md.storage_data.update(
        {i: dataclasses.replace(v, relative_path=f"sub/{v.relative_path}") for i, v in md.storage_data.items()}))
    out = {"w": torch.zeros(4)}
    dcp.load(out, storage_reader=dcpstore.ObjectStoreReader(root.step_url()), no_dist=True)
    assert torch.equal(out["w"], torch.arange(4.0))


def test_set_up_storage_reader_checks_keys_of_metadata_from_elsewhere(root):
    _save_step(root, {"w": torch.arange(4.0)})
    reader = dcpstore.ObjectStoreReader(root.step_url())
    metadata = reader.read_metadata()
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], relative_path="../x")
    with pytest.raises(dcpstore.CorruptCheckpointError, match="not a key below the checkpoint prefix"):
        reader.set_up_storage_reader(metadata, is_coordinator=True)


# -- stock writers still load ------------------------------------------------------------------


def test_stock_filesystem_writer_checkpoints_load(tmp_path):
    sd = sample_state_dict(5)
    path = tmp_path / "fs"
    dcp.save(sd, storage_writer=FileSystemWriter(path), no_dist=True)
    md = dcpstore.ObjectStoreReader(f"file://{path}").read_metadata()
    assert isinstance(md.storage_meta.checkpoint_id, pathlib.PurePath)  # a pickled PosixPath, allowed
    out = zeros_like_state_dict(sd)
    dcp.load(out, storage_reader=dcpstore.ObjectStoreReader(f"file://{path}"), no_dist=True)
    assert_state_dict_equal(out, sd)


def test_stock_fsspec_writer_checkpoints_load_with_plan_caching(bucket):
    sd = sample_state_dict(6)
    planner = DefaultSavePlanner(enable_plan_caching=True)
    for n in range(2):  # the second save reuses the cached plan and metadata
        url = f"s3://{bucket}/stock{n}"
        dcp.save(sd, storage_writer=FsspecWriter(url), planner=planner, no_dist=True)
        out = zeros_like_state_dict(sd)
        dcp.load(out, storage_reader=dcpstore.ObjectStoreReader(url), no_dist=True)
        assert_state_dict_equal(out, sd)
        empty: dict = {}
        _load_state_dict(empty, storage_reader=dcpstore.ObjectStoreReader(url), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        assert_state_dict_equal(empty, sd)


def test_no_unrestricted_unpickling_in_dcpstore():
    """No call in dcpstore unpickles without restrictions: plain pickle, or torch.load(weights_only=False)."""
    src = pathlib.Path(dcpstore.__file__).parent
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            where = f"{path.name}:{node.lineno}"
            func = ast.unparse(node.func)
            assert func not in ("pickle.load", "pickle.loads", "pickle.Unpickler"), where
            if func == "torch.load":
                flags = {k.arg: ast.unparse(k.value) for k in node.keywords}
                assert flags.get("weights_only") == "True", where
