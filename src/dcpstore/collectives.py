"""The checkpointer's collectives, on a gloo group of its own; no-ops in a single process.

Who calls it: the save pipeline, the commit protocol and the resume
protocol, on their one background thread (or the training thread, for
``load`` and the listing calls), in the same order on every rank.

What it promises: every wait on a peer is bounded by the group's timeout
(``timeout_s``), so a rank that died becomes an error here, not a hang.
Tensor collectives (``all_min``, ``gather_tensor``, ``broadcast_code``)
move a fixed, small number of int64s a rank; the object collectives
(``gather``, ``scatter``, ``all_gather``, ``broadcast``) pickle, and run
only where the structure changed, something failed, or once per load.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any, Callable

import torch
import torch.distributed as dist

from .errors import DcpstoreError


def describe(exc: BaseException) -> str:
    """An error as a peer reads it in a message: its type and text."""
    return f"{type(exc).__name__}: {exc}"


def _portable(error: BaseException) -> BaseException:
    """``error`` if a peer can unpickle it as it is, else a ``DcpstoreError`` of its description.

    An exception unpickles as ``type(error)(*error.args)``: one whose
    constructor those args do not fit (or that holds a lock) cannot travel.
    """
    try:
        pickle.dumps(error)
        type(error)(*error.args)
        return error
    except Exception:  # noqa: BLE001
        return DcpstoreError(describe(error))


class Collectives:
    """Tensor and object collectives on the checkpointer's group; no-ops in a single process."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.enabled = group is not None
        self.rank = dist.get_rank(group) if self.enabled else 0
        self.world_size = dist.get_world_size(group) if self.enabled else 1
        self.coordinator = dist.get_global_rank(group, 0) if self.enabled else 0

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def timeout_s(self, default: datetime.timedelta) -> float:
        """Seconds a rank waits in a collective of the group before it breaks: the gloo group's own timeout, else ``default``."""
        try:
            return self.group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        except (AttributeError, RuntimeError):
            return default.total_seconds()

    def all_min(self, values: list[int]) -> list[int]:
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return t.tolist()

    def gather_tensor(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """``tensor`` of every rank (one length), stacked on the coordinator: W rows; ``None`` elsewhere."""
        if not self.enabled:
            return tensor.unsqueeze(0)
        out = torch.empty((self.world_size, tensor.numel()), dtype=tensor.dtype) if self.is_coordinator else None
        dist.gather(tensor, list(out.unbind(0)) if out is not None else None, dst=self.coordinator, group=self.group)
        return out

    def broadcast_code(self, code: int) -> int:
        """The coordinator's ``code``, on every rank: one int64."""
        if not self.enabled:
            return code
        t = torch.tensor([code], dtype=torch.int64)
        dist.broadcast(t, src=self.coordinator, group=self.group)
        return int(t.item())

    def gather(self, obj: Any) -> list[Any] | None:
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size if self.is_coordinator else None
        dist.gather_object(obj, out, dst=self.coordinator, group=self.group)
        return out

    def scatter(self, objs: list[Any] | None) -> Any:
        if not self.enabled:
            return objs[0]
        out = [None]
        dist.scatter_object_list(out, objs if self.is_coordinator else None, src=self.coordinator, group=self.group)
        return out[0]

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.coordinator, group=self.group)
        return box[0]

    def failures(self, error: BaseException | None) -> dict[int, BaseException]:
        """Every rank's error of a check each ran alone (``{}``: none failed), so that all go on, or all stop, together.

        One all-reduce of an int64; an all-gather of the errors only when
        some rank failed.  This rank's error stays itself; a peer's arrives
        as a copy (its type and message), or, where it cannot be pickled, as
        a ``DcpstoreError`` of its description.
        """
        if self.all_min([self.rank if error is not None else self.world_size])[0] == self.world_size:
            return {}
        gathered = self.all_gather(_portable(error) if error is not None else None)
        return {r: error if r == self.rank else e for r, e in enumerate(gathered) if e is not None}

    def agreed_ints(self, fn: Callable[[], list[int]], where: str, what: str) -> list[int]:
        """``fn()``, a list of ints run on the coordinator, on every rank, through tensor collectives alone (``agreed`` pickles).

        Two broadcasts: the count (-1: ``fn`` failed, raised on every rank),
        then the values.  For a check on every save's path, where the first
        save after a resume runs no object collective.
        """
        values, error = None, None
        if self.is_coordinator:
            try:
                values = [int(v) for v in fn()]
            except Exception as e:  # noqa: BLE001 - the peers wait in the broadcast: they must hear of it
                error = e
        count = self.broadcast_code(len(values) if values is not None else -1)
        if count < 0:
            if isinstance(error, DcpstoreError):
                raise error
            raise DcpstoreError(f"{where}: {what} failed" + (f": {describe(error)}" if error is not None else " on the coordinator"))
        out = torch.tensor(values if values is not None else [0] * count, dtype=torch.int64)
        if self.enabled and count:
            dist.broadcast(out, src=self.coordinator, group=self.group)
        return out.tolist()

    def agreed(self, fn: Callable[[], Any], where: str, what: str) -> Any:
        """``fn()``, run on the coordinator, on every rank; its error raised on every rank (not a peer left waiting)."""
        result = None
        if self.is_coordinator:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - the peers wait in the broadcast: they must hear of it
                result = e if isinstance(e, DcpstoreError) else DcpstoreError(f"{where}: {what} failed: {describe(e)}")
        result = self.broadcast(result)
        if isinstance(result, BaseException):
            raise result
        return result
