"""Reading a checkpoint's ``.metadata``: found, bounded, unpickled safely, and checked before anything trusts it.

``.metadata`` comes from the bucket: whoever can write there can write it.
It is unpickled with ``safe_pickle``'s allow-list (no code runs, the work
bounded by its size), a collection's tombstone is told apart from a
checkpoint, dcpstore's own ``planner_data`` is set aside from the user's,
and every key its ``storage_data`` names must lie below the checkpoint
prefix (``check_storage_data``).  Values from it appear in messages only
through a bounded repr.  ``ObjectStoreReader``, the resume protocol, the
commit (what an overwrite replaces) and the CLI all read it here.
"""

from __future__ import annotations

import reprlib
from typing import Any, Iterable

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from . import planner_data
from .errors import (
    BucketNotFoundError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ObjectNotFoundError,
    StateDictMismatchError,
    UnsafeCheckpointError,
)
from .layout import METADATA_KEY, holds_tombstone
from .safe_pickle import loads_metadata
from .storage import ObjectStore


def read_metadata(store: ObjectStore, allow_globals: Iterable[Any] = ()) -> Metadata:
    """The committed ``Metadata`` under ``store``'s root, with dcpstore's extras set aside.

    Unpickled with ``safe_pickle``'s allow-list, extended by ``allow_globals``:
    ``UnsafeCheckpointError`` names any other global the pickle asks for.
    Raises ``CheckpointNotFoundError`` when there is no ``.metadata`` object:
    whatever shards lie there, that prefix is no checkpoint.  Its
    ``storage_data`` has passed ``check_storage_data``.
    """
    return parse_metadata(read_metadata_bytes(store), store.url_for(METADATA_KEY), allow_globals)


def read_metadata_bytes(store: ObjectStore) -> bytes:
    """The ``.metadata`` object under ``store``'s root, not yet unpickled.

    Raises ``CheckpointNotFoundError`` when there is none.
    """
    try:
        return store.get(METADATA_KEY)
    except BucketNotFoundError:
        raise
    except ObjectNotFoundError:
        raise no_metadata_error(store) from None


def no_metadata_error(store: ObjectStore) -> CheckpointNotFoundError:
    """What reading a checkpoint under ``store`` raises when it has no ``.metadata``."""
    return CheckpointNotFoundError(f"{store.url_for(METADATA_KEY)}: no metadata object: incomplete or missing checkpoint")


def parse_metadata(raw: bytes, url: str, allow_globals: Iterable[Any] = ()) -> Metadata:
    """``Metadata`` from the bytes of the ``.metadata`` object at ``url``, unpickled safely."""
    if holds_tombstone(raw):
        raise CheckpointNotFoundError(
            f"{url}: not a checkpoint: `dcpstore gc` deleted a failed save's shards here and left this marker"
        )
    try:
        metadata = loads_metadata(raw, url, allow_globals)
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        raise CorruptCheckpointError(f"{url}: cannot unpickle the metadata ({_reason(e)})") from e
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{url}: holds a {type(metadata).__name__}, not Metadata")
    if metadata.storage_data is not None:
        check_storage_data(metadata.storage_data, url)
    user, extras = planner_data.split(metadata.planner_data)
    if user is not metadata.planner_data:
        # The user's planner stored a non-dict: give it back as it was.
        metadata.planner_data = user
        setattr(metadata, planner_data.DCPSTORE_ATTR, extras)
    return metadata


def check_storage_data(storage_data: Any, url: str) -> None:
    """Raise ``CorruptCheckpointError`` unless every item lies below the checkpoint prefix.

    A key is ``/``-separated and relative: non-empty segments, none ``.`` or
    ``..``, no backslash and no URL scheme, so it names the same object on
    every store (``file://`` would otherwise resolve ``../../etc/x``).  Offsets
    and lengths are non-negative ints.  The check lives here, where keys
    arrive from untrusted data, rather than in ``ObjectStore``: every other key
    a store sees is made by dcpstore itself.  ``read_metadata`` runs it for
    every caller (the CLI included), ``set_up_storage_reader`` again for
    metadata that reached the reader some other way; both are cheap, one
    check per distinct object.
    """
    if not isinstance(storage_data, dict):
        raise CorruptCheckpointError(f"{url}: storage_data is a {type(storage_data).__name__}, not a dict")
    checked: set[str] = set()
    for index, info in storage_data.items():
        if not isinstance(info, _StorageInfo):
            raise CorruptCheckpointError(f"{url}: storage_data[{_shown(index)}] is a {type(info).__name__}, not _StorageInfo")
        for name in ("offset", "length"):
            value = getattr(info, name, None)  # an unpickled object need not have its class's fields
            if type(value) is not int or value < 0:
                raise CorruptCheckpointError(f"{url}: item {_shown(index)} has {name} {_shown(value)}")
        key = getattr(info, "relative_path", None)
        if isinstance(key, str) and key in checked:  # a key of another type may not even hash
            continue
        if (
            not isinstance(key, str)
            or not key
            or key.startswith("/")
            or "\\" in key
            or "://" in key
            or "\0" in key
            or any(part in ("", ".", "..") for part in key.split("/"))
        ):
            raise CorruptCheckpointError(
                f"{url}: item {_shown(index)} names the object {_shown(key)}, which is not a key below the checkpoint prefix"
            )
        checked.add(key)


# Values from an untrusted .metadata in messages: a repr that may raise (an
# object missing its class's fields) or recurse is replaced, a long one cut.
_UNTRUSTED_REPR = reprlib.Repr()
_UNTRUSTED_REPR.maxstring = _UNTRUSTED_REPR.maxother = 300


def _shown(value: Any) -> str:
    try:
        return _UNTRUSTED_REPR.repr(value)
    except Exception:  # noqa: BLE001 - reprlib catches a failing repr only for instances of user classes
        return f"<a {type(value).__name__}>"


def _reason(error: Exception) -> str:
    """``str(error)``, which for an error raised on untrusted data may itself fail (a recursive value)."""
    try:
        return str(error)[:1000]
    except Exception:  # noqa: BLE001
        return type(error).__name__


def check_state_dict(state_dict: dict[str, Any], metadata: Metadata, where: str) -> None:
    """Raise ``StateDictMismatchError`` listing keys or shapes that do not match."""
    flat, _ = flatten_state_dict(_flatten_sharded_tensors(state_dict))
    stored = metadata.state_dict_metadata
    missing = sorted(k for k in flat if k not in stored)
    wrong = []
    for key, value in flat.items():
        md = stored.get(key)
        if isinstance(value, (torch.Tensor, DTensor)) and isinstance(md, TensorStorageMetadata):
            if tuple(value.size()) != tuple(md.size):
                wrong.append(f"{key}: {tuple(md.size)} in the checkpoint vs {tuple(value.size())}")
    problems = []
    if missing:
        problems.append(f"keys missing from the checkpoint: {', '.join(missing[:10])}" + (" ..." if len(missing) > 10 else ""))
    if wrong:
        problems.append(f"shape mismatches: {'; '.join(wrong[:10])}" + (" ..." if len(wrong) > 10 else ""))
    if problems:
        raise StateDictMismatchError(f"{where}: the state dict does not match the checkpoint: {'; '.join(problems)}")
