"""Where a checkpointer's steps live under its root, and how to list them.

Each step is a DCP checkpoint at ``{root}/step_{step:08d}/``; zero-padding
keeps lexical and numeric order the same in any object-store listing.  A step
counts as committed exactly when its ``.metadata`` object exists.
"""

from __future__ import annotations

import dataclasses
import re

from .storage import ObjectStore

METADATA_KEY = ".metadata"  # a DCP checkpoint exists exactly when this object does
# User metadata (x-amz-meta-*) of a committed .metadata: the nonce of the save
# that wrote it (= StorageMeta.save_id inside it; see commit).
NONCE_KEY = "dcpstore-save"

_STEP_RE = re.compile(r"^step_(\d{8,})$")


def step_prefix(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}"


def parse_step(prefix: str) -> int | None:
    match = _STEP_RE.match(prefix.strip("/"))
    return int(match.group(1)) if match else None


@dataclasses.dataclass(frozen=True)
class StepInfo:
    step: int
    prefix: str
    committed: bool
    size: int  # bytes in all objects of the step
    objects: int
    last_modified: float | None  # newest object's time
    keys: tuple[str, ...] = ()  # the step's objects as listed, relative to its prefix


def list_steps(store: ObjectStore) -> list[StepInfo]:
    """Every step under ``store``'s root, committed or not, oldest first."""
    grouped: dict[str, list] = {}
    for obj in store.list():
        head, _, rest = obj.key.partition("/")
        if rest and parse_step(head) is not None:
            grouped.setdefault(head, []).append((rest, obj))
    steps = []
    for prefix, objects in grouped.items():
        times = [o.last_modified for _, o in objects if o.last_modified is not None]
        steps.append(
            StepInfo(
                step=parse_step(prefix),
                prefix=prefix,
                committed=any(name == METADATA_KEY for name, _ in objects),
                size=sum(o.size for _, o in objects),
                objects=len(objects),
                last_modified=max(times) if times else None,
                keys=tuple(name for name, _ in objects),
            )
        )
    return sorted(steps, key=lambda s: s.step)


def delete_committed_step(store: ObjectStore, prefix: str) -> None:
    """Delete a committed step: ``.metadata`` first, so it stops being a checkpoint before its shards go."""
    child = store.child(prefix)
    child.delete([METADATA_KEY])
    child.delete([o.key for o in child.list()])


def committed_steps(store: ObjectStore) -> list[int]:
    return [s.step for s in list_steps(store) if s.committed]
