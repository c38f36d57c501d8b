"""``dcpstore``: see and repair what is in the bucket without writing Python.

    dcpstore ls s3://bucket/run-7            steps, committed or not
    dcpstore inspect s3://bucket/run-7/step_00001000 [--json]
    dcpstore verify URI [--deep]             exit 1 on any problem, naming the object
    dcpstore gc s3://bucket/run-7 [--keep-last N] [--grace SECONDS] [--dry-run]
                                             (also a failed export's shards: dcpstore gc s3://bucket/hf)
    dcpstore export-hf SRC DST [--max-shard-size 5GB] [--dtype bf16|fp16|fp32] [--prefix model.] [--overwrite] [--no-crc32]
                                             a step as Hugging Face safetensors shards and index
    dcpstore demo                            train, save, kill, resume on an embedded S3

No command runs code from the bucket: ``ls`` only lists objects, and
``inspect``/``verify`` read ``.metadata`` with the reader's allow-list
unpickler and validate non-tensor items with torch's weights-only unpickler.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import zlib

from tqdm import tqdm

from .errors import CheckpointNotFoundError, CorruptCheckpointError, DcpstoreError, UnsafeCheckpointError
from .layout import (
    METADATA_KEY,
    StepInfo,
    StepNaming,
    Tombstone,
    holds_only_a_tombstone,
    list_steps,
    not_written_by_dcp,
    open_uploads,
    parse_step,
)
from .storage import ObjectStore, open_store

# torch (and the modules that need it) are imported by the commands that read
# checkpoint contents, not here: ``--help``, ``ls`` and ``gc`` only list and
# delete objects, and torch's import alone takes seconds on a small machine.


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _when(ts: float | None) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _progress(items: list, desc: str, unit: str, at_least: int = 1):
    """A progress bar over ``items``, only for a person watching and only when there are ``at_least``.

    ``disable=None`` is tqdm's own "not on a non-TTY": no bars in logs, pipes or CI.
    """
    return tqdm(items, desc=desc, unit=unit, disable=True if len(items) < at_least else None)


# -- commands -------------------------------------------------------------------------------


def cmd_ls(args) -> int:
    """Steps from the object listing alone: no ``.metadata`` is read (``inspect`` shows world size)."""
    store = open_store(args.root)
    uploads = open_uploads(store)
    open_by_step: dict[str, int] = {}
    for up in uploads:
        head = up.key.split("/", 1)[0]
        open_by_step[head] = open_by_step.get(head, 0) + 1
    steps = list_steps(store)
    if not steps and not uploads:
        print(f"no steps under {args.root}")
        return 0
    # A save whose first shards are still multipart uploads has no object yet.
    listed = {s.prefix for s in steps}
    steps += [
        StepInfo(step=parse_step(prefix), prefix=prefix, committed=False, size=0, objects=0, last_modified=None)
        for prefix in open_by_step
        if prefix not in listed and parse_step(prefix) is not None
    ]
    steps.sort(key=lambda s: s.step)
    print(f"{'STEP':>10}  {'STATUS':<11} {'SIZE':>10} {'OBJECTS':>7}  {'WRITTEN (UTC)':<19}  OPEN UPLOADS")
    for s in steps:
        # Committed is decided by .metadata alone: an upload left open under a committed step
        # (a lost CreateMultipartUpload answer whose abort was refused) is shown in its own column.
        status = (
            "committed" if s.committed
            else "collected" if holds_only_a_tombstone(s)  # swept by gc: only its tombstone is left, for a grace
            else "marked" if s.tombstone is Tombstone.MARKED  # a failed save's debris, deleted by a gc a grace later
            else "incomplete"
        )
        print(
            f"{s.step:>10}  {status:<11} {_size(s.size):>10} {s.objects:>7}  "
            f"{_when(s.last_modified):<19}  {open_by_step.get(s.prefix, 0)}"
        )
    return 0


def summarize(store: ObjectStore) -> dict:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    from . import planner_data
    from .metadata_reading import read_metadata

    metadata = read_metadata(store)
    tensors, byte_items = [], []
    for fqn, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            tensors.append({"fqn": fqn, "shape": list(md.size), "dtype": str(md.properties.dtype).replace("torch.", ""), "chunks": len(md.chunks)})
        elif isinstance(md, BytesStorageMetadata):
            byte_items.append(fqn)
    storage = metadata.storage_data or {}
    plan_ranks = planner_data.persisted_plan_ranks(metadata)
    return {
        "url": store.url,
        "version": metadata.version,
        "tensors": tensors,
        "bytes_items": byte_items,
        "total_bytes": sum(info.length for info in storage.values()),
        "objects": len({info.relative_path for info in storage.values()}),
        "plans_persisted": plan_ranks is not None,
        "plan_ranks": plan_ranks or 0,
        "checksums": bool(planner_data.read_checksums(metadata, store.url_for(METADATA_KEY))),
    }


def cmd_inspect(args) -> int:
    summary = summarize(open_store(args.uri))
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"checkpoint {summary['url']} (DCP format {summary['version']})")
    print(f"  {len(summary['tensors'])} tensors, {len(summary['bytes_items'])} bytes items, "
          f"{_size(summary['total_bytes'])} in {summary['objects']} objects")
    plans = f"yes, for {summary['plan_ranks']} ranks" if summary["plans_persisted"] else "no"
    print(f"  save plans persisted: {plans}; per-item checksums: {'yes' if summary['checksums'] else 'no'}")
    for t in summary["tensors"]:
        print(f"  {t['fqn']:<48} {t['dtype']:<10} {tuple(t['shape'])}  ({t['chunks']} chunk(s))")
    for fqn in summary["bytes_items"]:
        print(f"  {fqn:<48} bytes")
    return 0


def verify(store: ObjectStore, deep: bool, progress: bool = True) -> list[str]:
    """Problems found in the checkpoint at ``store``'s root; empty when it is sound."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms

    from . import planner_data, resume_share

    from .metadata_reading import read_metadata
    from .stored_items import undo_transforms
    from .safe_pickle import check_bytes_item
    from .tensor_archive import load_tensor

    metadata = read_metadata(store)
    storage = metadata.storage_data or {}
    sizes = {o.key: o.size for o in store.list()}
    transforms = _StorageReaderTransforms()  # torch's default registry: ZStandard
    problems = []
    try:
        checksums = planner_data.read_checksums(metadata, store.url_for(METADATA_KEY))
    except CorruptCheckpointError as e:
        problems.append(str(e))
        checksums = {}
    for index, info in storage.items():
        if info.relative_path not in sizes:
            problems.append(f"{store.url_for(info.relative_path)}: missing (needed by {index.fqn!r})")
        elif info.offset + info.length > sizes[info.relative_path]:
            problems.append(
                f"{store.url_for(info.relative_path)}: truncated: {index.fqn!r} needs bytes up to "
                f"{info.offset + info.length}, object has {sizes[info.relative_path]}"
            )
    problems += resume_share.check(store, metadata, sizes, deep)
    if not deep or problems:
        return problems
    for index, info in (_progress(list(storage.items()), "verify", "item") if progress else storage.items()):
        where = f"{store.url_for(info.relative_path)} ({index.fqn!r})"
        raw = store.get_range(info.relative_path, info.offset, info.offset + info.length)
        if index in checksums and zlib.crc32(raw) != checksums[index]:
            problems.append(f"{where}: checksum mismatch")
            continue
        md = metadata.state_dict_metadata.get(index.fqn)
        try:
            raw = undo_transforms(raw, info, transforms, where)
        except DcpstoreError as e:
            problems.append(str(e))
            continue
        if isinstance(md, TensorStorageMetadata):
            try:
                tensor = load_tensor(raw)
            except Exception as e:  # noqa: BLE001
                problems.append(f"{where}: does not deserialize ({e})")
                continue
            chunk = next((c for c in md.chunks if tuple(c.offsets) == tuple(index.offset or ())), None)
            want_shape = tuple(chunk.sizes) if chunk is not None else None
            if tensor.dtype != md.properties.dtype or (want_shape is not None and tuple(tensor.shape) != want_shape):
                problems.append(f"{where}: holds {tensor.dtype} {tuple(tensor.shape)}, metadata says {md.properties.dtype} {want_shape}")
        elif isinstance(md, BytesStorageMetadata):
            try:
                check_bytes_item(raw, where)
            except UnsafeCheckpointError as e:
                problems.append(str(e))
    return problems


def cmd_verify(args) -> int:
    store = open_store(args.uri)
    problems = verify(store, args.deep)
    for p in problems:
        print(f"PROBLEM {p}")
    if problems:
        print(f"{store.url}: {len(problems)} problem(s)")
        return 1
    print(f"{store.url}: OK ({'deep' if args.deep else 'metadata and object sizes'})")
    return 0


def cmd_gc(args) -> int:
    from .collection import collect_now, plan_gc

    store = open_store(args.root)
    plan = plan_gc(store, args.keep_last, args.grace)
    verb = "would delete" if args.dry_run else "deleting"
    for s in plan.marks:
        print(f"{'would mark' if args.dry_run else 'marking'} incomplete step {s.step} ({s.objects} objects, {_size(s.size)}): "
              f"deleted by a gc a grace later, unless it commits meanwhile")
    for s in plan.sweeps:
        print(f"{verb} incomplete step {s.step} ({s.objects - 1} objects, marked over a grace ago)")
    for s in plan.unmarks:
        print(f"{'would remove' if args.dry_run else 'removing'} the tombstone of step {s.step} (swept over a grace ago)")
    for u in plan.uploads:
        print(f"{'would abort' if args.dry_run else 'aborting'} multipart upload of {store.url_for(u.key)}")
    for folder, keys in plan.exports.items():
        print(f"{verb} a failed Hugging Face export's {len(keys)} shard(s) in {store.url_for(folder)} (no index)")
    for s in plan.pruned:
        print(f"{verb} committed step {s.step} (beyond --keep-last {args.keep_last})")
        others = not_written_by_dcp(s.keys)
        if others:
            print(f"  {'would leave' if args.dry_run else 'leaving'} {len(others)} object(s) in its folder that no DCP writer wrote:")
            for key in others:
                print(f"    {store.url_for(f'{s.prefix}/{key}')}")
    if args.dry_run:
        return 0
    progress = lambda items, desc, unit: _progress(items, desc, unit, at_least=5)  # noqa: E731
    if args.now:
        rounds = collect_now(store, args.grace, plan, progress,
                             waiting=lambda seconds: print(f"--now: collecting again in {seconds:.0f}s, once what was marked or swept is a grace old"))
    else:
        rounds = [(plan, plan.run(store, progress))]
    total = lambda count: sum(count(p) for p, _ in rounds)  # noqa: E731
    print(
        f"done: {total(lambda p: len(p.marks))} incomplete steps marked, {sum(swept for _, swept in rounds)} deleted, "
        f"{total(lambda p: len(p.unmarks))} tombstones removed, {len(plan.pruned)} committed steps deleted, "
        f"{total(lambda p: len(p.exports))} failed exports deleted, {total(lambda p: len(p.uploads))} uploads aborted"
    )
    return 0


def cmd_export_hf(args) -> int:
    from .export.hf import export_hf

    result = export_hf(
        args.src, args.dst, max_shard_size=args.max_shard_size, dtype=args.dtype, prefix=args.prefix,
        overwrite=args.overwrite, crc32=args.crc32, progress=lambda file: print(f"wrote {file}"),
    )
    if result.skipped:
        print(f"skipped {len(result.skipped)} item(s) that are not tensors: {', '.join(result.skipped)}")
    print(f"done: {result.tensors} tensors, {_size(result.total_size)} in {len(result.shards)} shard(s); {result.index_url}")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(steps=args.steps, save_every=args.save_every, root=args.root)


def _positive_seconds(text: str) -> float:
    from .collection import check_grace

    try:
        seconds = float(text)
        check_grace(seconds)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return seconds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dcpstore", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("ls", help="list the steps under a checkpoint root")
    p.add_argument("root", help="checkpoint root, e.g. s3://bucket/run-7")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("inspect", help="summarize one checkpoint's metadata")
    p.add_argument("uri", help=f"checkpoint prefix, e.g. s3://bucket/run-7/{StepNaming.DCPSTORE.prefix(1000)}")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="check that every object and byte range the metadata names exists")
    p.add_argument("uri", help="checkpoint prefix")
    p.add_argument("--deep", action="store_true",
                   help="also read every item back: checksum, tensor shape and dtype, and that non-tensor "
                        "items pass torch.load(weights_only=True)")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("gc", help="delete incomplete steps and stale uploads; optionally prune old steps")
    p.add_argument("root", help="checkpoint root")
    p.add_argument("--keep-last", type=int, default=None, metavar="N", help="keep N committed steps of each naming: the newest commit and its lineage first, then the most recent (as AsyncCheckpointer's keep_last)")
    p.add_argument("--grace", type=_positive_seconds, default=3600.0, metavar="SECONDS",
                   help="leave a step's debris alone until nothing under it, no object and no upload's newest part, "
                        "changed for this long on the server's clock (a save may be running); positive, default 3600")
    p.add_argument("--now", action="store_true",
                   help="finish in one call: a failed save's step is marked first and deleted only a grace later, "
                        "and its tombstone removed a grace after that; wait out those graces here")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("export-hf", help="write a committed step as Hugging Face safetensors shards and index")
    p.add_argument("src", help="a committed step, e.g. s3://bucket/run-7/step_00001000 (dcpstore's or stock torch's)")
    p.add_argument("dst", help="where the shards and model.safetensors.index.json go: s3://..., file://...")
    p.add_argument("--max-shard-size", default="5GB", help="bytes a shard holds at most, as huggingface_hub reads it (5GB = 5 x 10^9; 2GiB); a larger tensor gets a shard of its own")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None, help="cast floating-point tensors to this dtype")
    p.add_argument("--prefix", default="", help="strip this from the tensor names that start with it, e.g. model.")
    p.add_argument("--overwrite", action="store_true", help="replace an export already in DST")
    p.add_argument("--no-crc32", dest="crc32", action="store_false",
                   help="send no CRC32 with the shards' bodies, for S3-compatible servers that refuse x-amz-checksum-crc32")
    p.set_defaults(func=cmd_export_hf)

    p = sub.add_parser("demo", help="train a small model with async checkpoints, kill it, resume it")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--root", default=None, help="checkpoint root (default: a bucket on an embedded local S3)")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "keep_last", None) is not None and args.keep_last < 1:
        print("dcpstore: error: --keep-last must be >= 1", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except BrokenPipeError:
        # The reader of the output went away (`dcpstore inspect ... | head`): stop quietly, and keep
        # Python's flush of stdout at exit from raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except CheckpointNotFoundError as e:
        print(f"dcpstore: error: {e}{_a_root_of_steps(args)}", file=sys.stderr)
        return 1
    except (DcpstoreError, ValueError, OSError) as e:
        print(f"dcpstore: error: {e}", file=sys.stderr)
        return 1


def _a_root_of_steps(args) -> str:
    """A hint where a command that reads one checkpoint was pointed at a run's root: how many steps it holds, and ``ls``."""
    uri = getattr(args, "uri", None)
    if uri is None:
        return ""
    try:
        steps = list_steps(open_store(uri))
    except Exception:  # noqa: BLE001 - only a hint
        return ""
    if not steps:
        return ""
    return f"; {uri} is a root of {len(steps)} step(s): `dcpstore ls {uri}` lists them, and each step's URL is a checkpoint"


if __name__ == "__main__":
    sys.exit(main())
