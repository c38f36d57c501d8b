"""Deserializing what a checkpoint bucket holds without letting it run code.

Whoever can write one object in a checkpoint bucket must not be able to run
code in the jobs and operators that read it.  Two kinds of object are pickles:

* ``.metadata``: a pickled ``Metadata``.  ``loads_metadata`` unpickles it with
  an allow-list: the DCP metadata schema, the torch scalars it holds, plain
  containers, and what the caller trusts explicitly (``allow_globals``, and
  the globals registered with ``torch.serialization.add_safe_globals``).
  Anything else raises ``UnsafeCheckpointError`` before it is called.
* non-tensor ("bytes") items: ``torch.save`` output that torch's
  ``DefaultLoadPlanner.load_bytes`` reads back with
  ``torch.load(weights_only=False)``.  ``check_bytes_item`` validates them with
  torch's weights-only unpickler first, so no planner ever sees bytes that
  ``torch.load(weights_only=True)`` would refuse.

Why the pure-Python unpickler (``pickle._Unpickler``) for ``.metadata``: a
restricted ``find_class`` alone, on the C unpickler, still lets a pickle run
BUILD on an allowed *class* or function, which ``setattr``\\s on it
(``Metadata.__eq__ = ...``, ``_get_layout.cache = {...}``) or on a shared Enum
member, and so rewrites torch's classes for the rest of the process.  The C
unpickler offers no hook for BUILD; the Python one does.  It is about 7x
slower than the C unpickler (a 3.8 MB ``.metadata`` of 4 ranks x 5,000
items: 3.5 s against 0.5 s on a 2-core machine; ``pickle._loads`` alone,
with no checks, is 5.6x), and resuming ranks do not pay it: they read their
share of the resume index (``resume_index``), JSON at C speed.  Measured and
not taken: the C unpickler resolving every global to a stand-in type, then
a checked rebuild, came to 3.9x (C load 1.3x, the rebuild walk 2.6x), and it
cannot bound what the C unpickler does before the rebuild sees it: a dict
of colliding int keys costs it quadratic time (about 2 s for 459 KB), which
the budget below refuses in milliseconds.  Bounds win over speed there.

Bounded: a pickle of ``n`` bytes may only cost work in proportion to ``n``.
The allow-list alone does not bound it: ``bytearray(3_000_000_000)`` is an
allowed call on 70 bytes, a call on a memoized list repeats its work for
every 6-byte reference to it, and a dict whose int keys all hash alike
costs the square of its size (ints hash to themselves; strings, and so
every key DCP writes, hash with a per-process random seed).  So no allowed
callable takes a size from the bucket (``bytearray`` only copies bytes),
every call and every container fill is charged against a budget of
``WORK_PER_BYTE`` units per input byte, keys with a predictable hash are
capped at ``MAX_PREDICTABLE_KEYS``, and containers nest at most
``MAX_NESTING`` deep.  A refusal raises ``CorruptCheckpointError`` (via
``metadata_reading.parse_metadata``) naming the object.
"""

from __future__ import annotations

import enum
import functools
import io
import pathlib
import pickle
import re
from collections import OrderedDict
from typing import Any, Iterable

import torch
from torch.distributed.checkpoint import filesystem as _dcp_filesystem
from torch.distributed.checkpoint import metadata as _dcp_metadata
from torch.distributed.checkpoint import planner as _dcp_planner

from .errors import UnsafeCheckpointError

WORK_PER_BYTE = 8  # work units (items filled, elements passed to a call) per byte of pickle
WORK_FLOOR = 1 << 16  # a tiny pickle still gets this much
MAX_PREDICTABLE_KEYS = 4096  # dict/set keys whose hash an attacker can choose (ints, floats, their tuples)
MAX_NESTING = 100  # open MARKs: containers being filled inside one another


class ParseBudgetError(ValueError):
    """A pickle asked for more work than its size allows; ``metadata_reading.parse_metadata`` names the object."""


def _bytearray(data=b"", *args) -> bytearray:
    """``bytearray`` as pickles call it (a copy of bytes, or of a str with its encoding), never of a size."""
    if isinstance(data, int):
        raise ParseBudgetError(f"refusing bytearray({data}): a size read from the bucket would allocate it")
    return bytearray(data, *args)

_TRUST_HINT = "pass allow_globals=[...] or torch.serialization.add_safe_globals to trust it"


@functools.lru_cache(maxsize=1)
def _builtin_allowed() -> dict[str, Any]:
    """dcpstore's allow-list for ``.metadata``, keyed ``"module.name"``.

    Each entry is needed by some real checkpoint, and calling it (REDUCE,
    NEWOBJ) with any arguments only builds data:

    * the ``metadata`` dataclasses: the DCP metadata schema; ``_MEM_FORMAT_ENCODING``
      is how ``TensorProperties`` pickles its memory format;
    * ``filesystem._StorageInfo``: ``storage_data`` of torch's writers and dcpstore's;
    * ``planner`` SavePlan, WriteItem, WriteItemType, TensorWriteData: the
      full plans of checkpoints written before the compact form
      (``planner_data["dcpstore/all_local_plans"]``; ``dcpstore/plans_v2`` is builtins only);
    * ``torch.Size`` (sizes, offsets) and every ``torch.<dtype>`` (dtypes pickle
      as globals, are not callable);
    * ``torch.serialization._get_layout``: how a ``torch.layout`` pickles; it
      only looks a name up in a dict of layouts;
    * ``pathlib`` paths: ``FileSystemWriter`` stores ``checkpoint_id`` as a Path
      (``pathlib._local`` is where Python 3.13 defines them);
    * ``OrderedDict``, ``set``, ``frozenset``, ``complex``, ``bytearray``: plain
      values in a user's ``planner_data`` that some pickle protocol writes as a
      call to a global.

    Not here, on purpose: ``copyreg._reconstructor`` (protocol 0/1 objects; it
    calls ``base.__init__`` for an attacker-chosen base), ``_codecs.encode``
    (protocol-2 bytes; it imports codecs by name), tensor rebuild functions
    (``.metadata`` holds no tensors).
    """
    allowed: dict[str, Any] = {}

    def add(module: str, names: Iterable[str], source: Any) -> None:
        for name in names:
            allowed[f"{module}.{name}"] = getattr(source, name)

    add(
        "torch.distributed.checkpoint.metadata",
        ["Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
         "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"],
        _dcp_metadata,
    )
    add("torch.distributed.checkpoint.filesystem", ["_StorageInfo"], _dcp_filesystem)
    add("torch.distributed.checkpoint.planner", ["SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"], _dcp_planner)
    add("torch", ["Size"], torch)
    add("torch", [name for name, value in vars(torch).items() if isinstance(value, torch.dtype)], torch)
    add("torch.serialization", ["_get_layout"], torch.serialization)
    for module in ("pathlib", "pathlib._local"):
        add(module, ["PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"], pathlib)
    allowed["collections.OrderedDict"] = OrderedDict
    for value in (set, frozenset, complex):
        allowed[f"builtins.{value.__name__}"] = value
    allowed["builtins.bytearray"] = _bytearray
    return allowed


def _by_name(entries: Iterable[Any]) -> dict[str, Any]:
    """``"module.name" -> object`` for globals given as objects or ``(object, "module.name")``.

    Accepts both forms ``torch.serialization.add_safe_globals`` does.
    """
    out = {}
    for entry in entries:
        if isinstance(entry, tuple):
            obj, name = entry
            out[name] = obj
        else:
            out[f"{entry.__module__}.{entry.__qualname__}"] = entry
    return out


def _describe(obj: Any) -> str:
    if isinstance(obj, type):
        return f"the class '{obj.__module__}.{obj.__qualname__}'"
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"the function '{getattr(obj, '__module__', '?')}.{obj.__qualname__}'"
    return f"a {type(obj).__module__}.{type(obj).__qualname__} object"


class _AllowListUnpickler(pickle._Unpickler):
    """Resolves only allowed globals, and calls and restores state only where they allow.

    Every object a pickle can call comes from ``find_class``, so REDUCE,
    NEWOBJ and INST/OBJ are checked against the allow-list again by identity
    (defence in depth).  BUILD is refused unless the target is an instance of
    an allowed class that is not an Enum: never a class, a function, or an
    Enum member, which are shared by the whole process.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, url: str, allowed: dict[str, Any], size: int):
        super().__init__(file)
        self._work_left = WORK_FLOOR + WORK_PER_BYTE * size
        self._size = size
        self._predictable_keys = 0
        self._url = url
        self._allowed = allowed
        self._allowed_ids = {id(obj) for obj in allowed.values()}
        self._buildable = {id(obj) for obj in allowed.values() if isinstance(obj, type) and not issubclass(obj, enum.Enum)}

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[f"{module}.{name}"]
        except KeyError:
            raise UnsafeCheckpointError(
                f"{self._url}: refusing to unpickle global '{module}.{name}': "
                f"not on dcpstore's allow-list ({_TRUST_HINT})"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self._url}: refusing a pickle persistent id: .metadata holds none")

    def _check_callable(self, func: Any) -> None:
        if id(func) not in self._allowed_ids:
            raise UnsafeCheckpointError(f"{self._url}: refusing to call {_describe(func)}: not on dcpstore's allow-list")

    # -- the budget -------------------------------------------------------------

    def _charge(self, units: int) -> None:
        self._work_left -= units
        if self._work_left < 0:
            raise ParseBudgetError(
                f"the pickle asks for more work than its {self._size} bytes allow "
                f"({WORK_PER_BYTE} units a byte): not a .metadata DCP writes"
            )

    def _charge_call(self, args: Any, func: Any = None) -> None:
        """A call's cost: the elements it is handed (a call copies or iterates them), and what it hashes."""
        units = 1
        for arg in args if isinstance(args, tuple) else (args,):
            units += len(arg) if isinstance(arg, (list, tuple, dict, set, frozenset, str, bytes, bytearray)) else 1
            if func in (set, frozenset) and isinstance(arg, (list, tuple)):
                self._charge_keys(arg)
            elif func is OrderedDict and isinstance(arg, (list, tuple)):
                self._charge_keys([pair[0] for pair in arg if isinstance(pair, tuple) and pair])
        self._charge(units)

    def _charge_keys(self, keys: Iterable[Any]) -> None:
        """Keys about to be hashed: charge hashing a tuple (Python does not cache it), count predictable ones."""
        for key in keys:
            if isinstance(key, (tuple, frozenset)):
                self._charge(_hash_cost(key, self._work_left))
            elif not (isinstance(key, (int, float, complex)) or key is None):
                continue  # str, bytes, MetadataIndex and the like: hashes seeded per process
            self._predictable_keys += 1
            if self._predictable_keys > MAX_PREDICTABLE_KEYS:
                raise ParseBudgetError(
                    f"more than {MAX_PREDICTABLE_KEYS} dict or set keys whose hash the writer can choose "
                    "(numbers, tuples): DCP writes none, and their collisions cost quadratic time"
                )

    def load_mark(self) -> None:
        if len(self.metastack) >= MAX_NESTING:
            raise ParseBudgetError(f"containers nested more than {MAX_NESTING} deep")
        super().load_mark()

    dispatch[pickle.MARK[0]] = load_mark

    def load_appends(self) -> None:
        self._charge(len(self.stack))  # the items above the mark, about to be appended
        super().load_appends()

    dispatch[pickle.APPENDS[0]] = load_appends

    def load_setitems(self) -> None:
        items = self.stack
        self._charge(len(items))
        self._charge_keys(items[0::2])
        super().load_setitems()

    dispatch[pickle.SETITEMS[0]] = load_setitems

    def load_setitem(self) -> None:
        self._charge(1)
        self._charge_keys((self.stack[-2],))
        super().load_setitem()

    dispatch[pickle.SETITEM[0]] = load_setitem

    def load_additems(self) -> None:
        self._charge(len(self.stack))
        self._charge_keys(self.stack)
        super().load_additems()

    dispatch[pickle.ADDITEMS[0]] = load_additems

    def load_frozenset(self) -> None:
        self._charge(len(self.stack))
        self._charge_keys(self.stack)
        super().load_frozenset()

    dispatch[pickle.FROZENSET[0]] = load_frozenset

    def load_dict(self) -> None:
        self._charge(len(self.stack))
        self._charge_keys(self.stack[0::2])
        super().load_dict()

    dispatch[pickle.DICT[0]] = load_dict

    def _instantiate(self, klass: Any, args: Any) -> None:
        self._check_callable(klass)
        self._charge_call(args)
        super()._instantiate(klass, args)

    def load_reduce(self) -> None:
        self._check_callable(self.stack[-2])
        self._charge_call(self.stack[-1], self.stack[-2])
        super().load_reduce()

    dispatch[pickle.REDUCE[0]] = load_reduce

    def load_newobj(self) -> None:
        self._check_callable(self.stack[-2])
        self._charge_call(self.stack[-1])
        super().load_newobj()

    dispatch[pickle.NEWOBJ[0]] = load_newobj

    def load_newobj_ex(self) -> None:
        self._check_callable(self.stack[-3])
        self._charge_call(self.stack[-2])
        self._charge_call(tuple(self.stack[-1].values()) if isinstance(self.stack[-1], dict) else self.stack[-1])
        super().load_newobj_ex()

    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex

    def load_build(self) -> None:
        inst = self.stack[-2]
        self._charge_call(self.stack[-1])
        if id(type(inst)) not in self._buildable:
            raise UnsafeCheckpointError(
                f"{self._url}: refusing to restore state into {_describe(inst)}: "
                "a pickle may only fill in instances of allowed classes, never shared objects"
            )
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


def loads_metadata(raw: bytes, url: str, allow_globals: Iterable[Any] = ()) -> Any:
    """Unpickle ``raw`` (the ``.metadata`` object at ``url``) with the allow-list.

    Allowed: dcpstore's list (see ``_builtin_allowed``), the globals registered
    with ``torch.serialization.add_safe_globals``, and ``allow_globals``
    (classes or functions, or ``(object, "module.name")`` pairs).  Raises
    ``UnsafeCheckpointError`` naming ``url`` and the offending global before
    anything not allowed is called; other failures propagate as they come.
    """
    allowed = {**_builtin_allowed(), **_by_name(torch.serialization.get_safe_globals()), **_by_name(allow_globals)}
    return _AllowListUnpickler(io.BytesIO(raw), url, allowed, len(raw)).load()


def _hash_cost(key: tuple | frozenset, limit: int) -> int:
    """Elements that hashing ``key`` visits (nested tuples each time they occur, as ``hash`` does), up to past ``limit``."""
    cost, todo = 0, [key]
    while todo:
        item = todo.pop()
        cost += len(item)
        if cost > limit:  # the charge refuses it; counting on would be the work it guards against
            return cost
        if isinstance(item, tuple):
            todo.extend(x for x in item if isinstance(x, tuple))
    return cost


def _weights_only_reason(exc: BaseException) -> str:
    """What torch's weights-only unpickler objected to, without its boilerplate."""
    message = str(exc)
    found = re.search(r"GLOBAL (\S+)", message)
    if found:
        return f"refusing to unpickle global '{found.group(1)}': torch.load(weights_only=True) does not allow it"
    found = re.search(r"WeightsUnpickler error:\s*(.+)", message)
    detail = found.group(1) if found else (message.strip().splitlines() or [type(exc).__name__])[0]
    return f"not a payload torch.load(weights_only=True) accepts ({detail.strip()})"


def check_bytes_item(raw: bytes, where: str, allow_globals: Iterable[Any] = ()) -> None:
    """Raise ``UnsafeCheckpointError`` unless ``torch.load(weights_only=True)`` accepts ``raw``.

    Planners read bytes items back however they like; torch's
    ``DefaultLoadPlanner`` uses ``torch.load(weights_only=False)``, which runs
    whatever a pickle asks for, and also unpickles bytes that are not a
    ``torch.save`` archive at all (as a legacy pickle).  So anything the
    weights-only load refuses or cannot parse is refused here, whichever
    planner would get it.  ``allow_globals`` are added to torch's safe globals
    for the check (process-wide, for its duration, as
    ``torch.serialization.safe_globals`` does); those already registered stay.
    """
    registered = torch.serialization.get_safe_globals()
    extra = [g for g in allow_globals if g not in registered]
    try:
        with torch.serialization.safe_globals(extra):
            torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - whatever it is, the bytes are not vouched for
        raise UnsafeCheckpointError(
            f"{where}: {_weights_only_reason(e)}; not handed to the load planner "
            f"({_TRUST_HINT}, or allow_unsafe_pickle=True if you trust everyone who can write the bucket)"
        ) from e
