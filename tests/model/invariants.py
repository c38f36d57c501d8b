"""The invariants of the model-based test: the oracle (what the user was told) held against storage and stock readers.

Checked after every rule.  Storage is read straight from the S3 server,
never through the fault proxy, so that a fault meant for dcpstore cannot
make the check itself fail.  A step or export whose objects did not change
since it was last proven is not read again (``Proven``): loading every step
after every rule would cost the campaign most of its time, and bytes that
did not change load as they did.
"""

from __future__ import annotations

import json
import os
import sys

import boto3
import safetensors.torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

import dcpstore
from helpers import zeros_like_state_dict
from model.oracle import ABSENT, Oracle, equal_states

HF_INDEX = "model.safetensors.index.json"
# A collection's tombstone in place of .metadata (dcpstore's layout.py writes it): 64 bytes, this text and 32 hex
# digits.  Not a checkpoint to any reader; recognised here only to say so in a violation.
TOMBSTONE_PREFIX, TOMBSTONE_SIZE = b"dcpstore gc: no checkpoint here ", 64


def step_folder(number: int) -> str:
    """Step ``number``'s folder under the root: torchtitan's naming (``step-N``), which stock torchtitan resumes from."""
    return f"step-{number}"


class Violation(AssertionError):
    """What the user was told and what storage holds disagree.

    The first one of a run is printed at once: shrinking it to the shortest
    sequence may take minutes, and a run stopped meanwhile still says what it found.
    """

    printed = False

    def __init__(self, message: str):
        super().__init__(message)
        if not Violation.printed:
            Violation.printed = True
            print(f"model: violation (shrinking follows): {message}", file=sys.stderr, flush=True)


class Storage:
    """The bucket as a user's own tools see it: boto3 and the stock readers, straight to the server."""

    def __init__(self, endpoint: str, bucket: str, root: str):
        self.endpoint, self.bucket, self.root = endpoint, bucket, root
        self.s3 = boto3.client("s3", endpoint_url=endpoint)

    def keys(self, prefix: str) -> dict[str, str]:
        """``{key: etag}`` under ``prefix/``."""
        out = {}
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=f"{prefix}/"):
            out.update({o["Key"]: o["ETag"] for o in page.get("Contents", [])})
        return out

    def open_uploads(self, prefix: str) -> list[str]:
        listed = self.s3.list_multipart_uploads(Bucket=self.bucket, Prefix=f"{prefix}/")
        return [u["Key"] for u in listed.get("Uploads", [])]

    def step_prefix(self, number: int) -> str:
        return f"{self.root}/{step_folder(number)}"

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def load_with_dcpstore(self, number: int, like: dict) -> dict:
        target = zeros_like_state_dict(like)
        reader = dcpstore.ObjectStoreReader(self.url(self.step_prefix(number)), storage_options={"endpoint_url": self.endpoint})
        try:
            dcp.load(target, storage_reader=reader)
        finally:
            reader.close()
        return target

    def load_with_stock(self, number: int, like: dict) -> dict:
        target = zeros_like_state_dict(like)
        dcp.load(target, storage_reader=FsspecReader(self.url(self.step_prefix(number)), endpoint_url=self.endpoint))
        return target

    def holds_a_tombstone(self, key: str) -> bool:
        head = self.read(key) if self.s3.head_object(Bucket=self.bucket, Key=key)["ContentLength"] == TOMBSTONE_SIZE else b""
        return head.startswith(TOMBSTONE_PREFIX)

    def read(self, key: str) -> bytes:
        return self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()


class Proven:
    """What was proven already: the objects (keys and ETags) a step or an export had when it last held."""

    def __init__(self):
        self._seen: dict[str, tuple] = {}
        self.written: dict[str, str] = {}  # every save's object (not .metadata) ever seen -> its ETag then

    def unchanged(self, what: str, snapshot: tuple) -> bool:
        return self._seen.get(what) == snapshot

    def holds(self, what: str, snapshot: tuple) -> None:
        self._seen[what] = snapshot


def check_all(oracle: Oracle, storage: Storage, proven: Proven, sentinel: str) -> None:
    check_no_code_ran(sentinel)
    check_steps(oracle, storage, proven)
    check_exports(oracle, storage, proven)
    check_no_code_ran(sentinel)


def check_no_code_ran(sentinel: str) -> None:
    if os.path.exists(sentinel):
        raise Violation(f"bytes from the bucket ran code: the planted call made {sentinel}")


def check_steps(oracle: Oracle, storage: Storage, proven: Proven) -> None:
    """Every step loads as its save was reported: committed bit-exact with dcpstore and stock; failed not at all."""
    for number, step in sorted(oracle.steps.items()):
        prefix = storage.step_prefix(number)
        objects = storage.keys(prefix)
        if not step.tampered:
            _check_written_once(objects, proven)
        snapshot = (tuple(sorted(objects.items())), tuple(id(c) for c in step.contents), step.removable, step.tampered)
        if proven.unchanged(prefix, snapshot):
            continue
        metadata = f"{prefix}/.metadata"
        is_checkpoint = metadata in objects and not storage.holds_a_tombstone(metadata)
        if not is_checkpoint:
            if ABSENT in step.contents or step.removable:
                if len(step.contents) > 1:
                    oracle.settle(number, ABSENT)
                proven.holds(prefix, snapshot)
                continue
            raise Violation(f"step {number} was reported committed, and {metadata} is {'a tombstone' if metadata in objects else 'gone'}; "
                            f"objects left: {sorted(objects)}")
        candidates = [c for c in step.contents if c is not ABSENT]
        if not candidates:
            raise Violation(f"step {number}: its save was reported failed, yet {metadata} is a checkpoint")
        _check_loads(oracle, storage, number, candidates, step.tampered)
        proven.holds(prefix, (tuple(sorted(storage.keys(prefix).items())), *snapshot[1:]))


def _check_loads(oracle: Oracle, storage: Storage, number: int, candidates: list, tampered: bool) -> None:
    loaded = None
    for candidate in candidates:
        try:
            got = storage.load_with_dcpstore(number, candidate)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            if tampered:
                return  # refused, as a step whose bytes a bucket writer changed must be
            error = e
            continue
        if equal_states(got, candidate):
            loaded = candidate
            break
        error = Violation(f"step {number}: dcpstore loads other values than its save was reported to hold")
    if loaded is None:
        raise Violation(f"step {number} does not load bit-exact with dcpstore: {error!r}") from error
    if len(candidates) > 1 or len(oracle.steps[number].contents) > 1:
        oracle.settle(number, loaded)
    if tampered:
        return  # a stock reader checks no checksum: it cannot tell
    try:
        stock = storage.load_with_stock(number, loaded)
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        raise Violation(f"step {number} does not load with stock FsspecReader: {e!r}") from e
    if not equal_states(stock, loaded):
        raise Violation(f"step {number}: stock FsspecReader loads other values than dcpstore")


def _check_written_once(objects: dict[str, str], proven: Proven) -> None:
    """No name a save wrote is written again (README: every save writes its shards under fresh names).

    ``.metadata`` is the one key a step's commits share (an overwrite's
    commit replaces it, conditionally); every other object of a step, the
    shards and dcpstore's resume index, is one save's alone, so a second
    ETag under its name means a later save wrote over it.
    """
    for key, etag in objects.items():
        if key.endswith("/.metadata"):
            continue
        before = proven.written.setdefault(key, etag)
        if before != etag:
            raise Violation(f"{key} was written again: a later save wrote over an object an earlier save left there")


def check_exports(oracle: Oracle, storage: Storage, proven: Proven) -> None:
    """Every committed export loads with safetensors and holds the step's tensors; nothing else of it is in its folder."""
    for folder, export in sorted(oracle.exports.items()):
        objects = storage.keys(folder)
        snapshot = (tuple(sorted(objects.items())), id(export))
        if proven.unchanged(folder, snapshot):
            continue
        index_key = f"{folder}/{HF_INDEX}"
        if index_key not in objects:
            raise Violation(f"export {folder} was reported committed, and its index is gone; objects: {sorted(objects)}")
        try:
            index = json.loads(storage.read(index_key))
            shards = sorted(set(index["weight_map"].values()))
        except (ValueError, KeyError) as e:
            raise Violation(f"export {folder}: its index does not parse: {e!r}") from e
        if index["weight_map"].keys() != export.tensors.keys():
            raise Violation(f"export {folder}: its index names {sorted(index['weight_map'])}, step {export.step} has {sorted(export.tensors)}")
        loaded = {}
        for shard in shards:
            if f"{folder}/{shard}" not in objects:
                raise Violation(f"export {folder}: its index names {shard}, which is not stored")
            tensors = safetensors.torch.load(storage.read(f"{folder}/{shard}"))
            misplaced = sorted(name for name in tensors if index["weight_map"].get(name) != shard)
            if misplaced or loaded.keys() & tensors.keys():
                raise Violation(f"export {folder}: {shard} holds {misplaced or sorted(loaded.keys() & tensors.keys())}, which the index puts elsewhere")
            loaded.update(tensors)
        if loaded.keys() != export.tensors.keys():
            raise Violation(f"export {folder}: holds {sorted(loaded)}, step {export.step} has {sorted(export.tensors)}")
        for name, want in export.tensors.items():
            if loaded[name].dtype != want.dtype or not loaded[name].equal(want):
                raise Violation(f"export {folder}: {name} holds other values than step {export.step}")
        leftovers = sorted(k for k in objects if k.endswith(".safetensors") and k.rpartition("/")[2] not in shards)
        if leftovers:
            raise Violation(f"export {folder}: shards its index does not name stay in the folder: {leftovers}")
        proven.holds(folder, snapshot)
