"""What dcpstore keeps in ``Metadata.planner_data``, under reserved keys.

``planner_data`` belongs to the planner: ``DefaultSavePlanner`` stores its
flatten mappings there (fqn -> path in the nested state dict), and stock
loaders read them back.  dcpstore adds its own entries beside them:

* ``ALL_LOCAL_PLANS_KEY``: the local ``SavePlan`` of every rank, as the ranks
  made them (before global dedup), indexed by rank.  They let a restarted job
  rebuild the global plan without any planning collective.
* ``CHECKSUMS_KEY``: ``MetadataIndex -> crc32`` of every item's stored bytes,
  so readers detect corrupted shards instead of loading garbage.

Only torch types are stored, so a checkpoint unpickles without dcpstore.  A
``dict`` from the user's planner is kept and extended.  Anything else is kept
intact under ``USER_PLANNER_DATA_KEY``; ``ObjectStoreReader.read_metadata``
hands that original object back as ``planner_data`` and keeps dcpstore's
entries on the side (``DCPSTORE_ATTR``), where ``read_plans`` finds them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan

ALL_LOCAL_PLANS_KEY = "dcpstore/all_local_plans"
CHECKSUMS_KEY = "dcpstore/checksums"
USER_PLANNER_DATA_KEY = "dcpstore/user_planner_data"
RESERVED_KEYS = (ALL_LOCAL_PLANS_KEY, CHECKSUMS_KEY, USER_PLANNER_DATA_KEY)

# Attribute set on Metadata objects returned by ObjectStoreReader when the
# user's planner_data was not a dict and has been handed back unwrapped.
DCPSTORE_ATTR = "_dcpstore_planner_data"

_MISSING = object()


def strip_plan(plan: SavePlan) -> SavePlan:
    """The plan as the planner made it: storage-specific data removed."""
    return dataclasses.replace(plan, storage_data=None)


def embed(planner_data: Any, extras: dict[str, Any]) -> dict[str, Any]:
    """``planner_data`` with dcpstore's ``extras`` added; the original is not mutated."""
    if planner_data is None:
        return dict(extras)
    if isinstance(planner_data, dict) and USER_PLANNER_DATA_KEY not in planner_data:
        return {**planner_data, **extras}
    return {USER_PLANNER_DATA_KEY: planner_data, **extras}


def split(planner_data: Any) -> tuple[Any, dict[str, Any]]:
    """Undo ``embed`` for non-dict user data: ``(user_planner_data, dcpstore_extras)``.

    Dict planner data stays as it is (extended); only a wrapped non-dict object
    is unwrapped.
    """
    if isinstance(planner_data, dict):
        extras = {k: planner_data[k] for k in RESERVED_KEYS if k in planner_data}
        user = planner_data.get(USER_PLANNER_DATA_KEY, _MISSING)
        if user is not _MISSING:
            return user, extras
        return planner_data, extras
    return planner_data, {}


def _extras(metadata: Metadata) -> dict[str, Any]:
    attached = getattr(metadata, DCPSTORE_ATTR, None)
    if attached is not None:
        return attached
    return split(metadata.planner_data)[1]


def read_plans(metadata: Metadata) -> list[SavePlan] | None:
    """The local save plans persisted by dcpstore, one per rank, or ``None``.

    ``None`` means the checkpoint was written by another tool (or by a planner
    path that persisted no plans), and a restarted job must plan in full.
    """
    plans = _extras(metadata).get(ALL_LOCAL_PLANS_KEY)
    if not isinstance(plans, list) or not all(isinstance(p, SavePlan) for p in plans):
        return None
    return plans


def read_checksums(metadata: Metadata) -> dict[MetadataIndex, int]:
    """``MetadataIndex -> crc32`` of each stored item; empty for other tools' checkpoints."""
    checksums = _extras(metadata).get(CHECKSUMS_KEY)
    return checksums if isinstance(checksums, dict) else {}
