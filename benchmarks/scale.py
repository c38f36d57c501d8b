"""What a checkpoint costs as the world size W and the items per rank N grow, simulated in one process.

    python -m benchmarks.scale                 # N = 64: W = 8..4096; N = 2000: W = 8..1024 (15 min)
    python -m benchmarks.scale --grid 8x64 64x2000 --out /tmp/s   # quick

No process group, no storage but ``memory://``: W ranks' local plans are made
directly, as ``DefaultSavePlanner`` makes them for an FSDP-style state dict
(per rank ``N`` items: most of them ``Shard(0)`` chunks of a parameter, one
chunk per rank; a few plain tensors and a few bytes items that every rank
holds and the dedup gives to one rank).  The coordinator's global step runs
once with torch's ``DefaultSavePlanner``, write results are made up for the
final plans, and ``ObjectStoreWriter.finish`` runs with ``commit`` captured
(it also builds and PUTs the resume index).  Per (W, N) it reports:

* the coordinator's first save of the structure: ``global_step_s`` (torch's
  ``create_global_plan``) and ``finish_s`` (dcpstore: compact plans, the
  resume index, pickling ``.metadata``);
* ``.metadata`` bytes, torch's own for the same state beside dcpstore's, and
  the resume index: the whole object, and what rank W-1 reads of it (its
  block; the coordinator also reads the directory);
* the ``.metadata`` template (``metadata_template``): ``template_build_s``
  (finding its slots, once per structure: the walk, a second pickle, the
  diff and the proof), ``slots`` and ``patch_s`` (writing the next save's
  values over them in place, beside ``finish_s`` building and pickling
  the same ``.metadata`` from objects);
* the later saves of the structure (``steady_commits``): ``steady_s`` and
  ``steady_rss`` (the coordinator's patched commit, from the ranks' values
  as the tensor gather stacks them to the new ``.metadata`` and resume
  index, and its peak RSS growth), and after a restart
  ``resume_template_s``/``_rss`` (the template read back from the
  committed bytes and the index's map) and ``first_after_resume_s``;
* reading ``.metadata`` whole, as a fallback or ``dcp.load`` without
  ``state_dict=`` does: ``unpickle_s`` (C ``pickle.loads``, unsafe) and
  ``safe_read_s`` (``safe_pickle.loads_metadata``, bounded; timed up to
  ``--safe-read-max-mb``);
* resuming from the index, rank W-1: ``share_s`` (check, inflate, parse and
  build its ``Metadata`` from its block) and ``share_rss`` (peak RSS growth
  of doing that in a fresh process), beside ``metadata_rss`` (the same for
  the safe read of ``.metadata``, where timed).

Writes ``scale.json``, ``scale.txt`` and (with matplotlib) ``scale.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import hashlib
import io
import json
import logging
import os
import pickle
import platform
import subprocess
import sys
import tempfile
import time
import uuid
import zlib

import numpy
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from dcpstore import metadata_template, resume_index, resume_share, safe_pickle
from dcpstore.persisted_plans import attach_local_plan
from dcpstore.shard_writing import ChecksummedWriteResult
from dcpstore.writer import ObjectStoreWriter

REPLICATED = 4  # plain tensors every rank holds (norms, scalars)
SIMULATED_NONCE = "0123456789abcdef"  # the save's nonce in the simulated shard names
BYTES_ITEMS = 2  # bytes items every rank holds (step, rng state)


def simulate_plans(world_size: int, items_per_rank: int) -> list[SavePlan]:
    """The local plans ``DefaultSavePlanner`` makes on each of ``world_size`` FSDP ranks."""
    n_shard = max(1, items_per_rank - REPLICATED - BYTES_ITEMS)
    props = TensorProperties(dtype=torch.bfloat16)
    shard_fqns = [f"model.layers.{i // 4}.{('wq', 'wk', 'wv', 'wo')[i % 4]}.weight" for i in range(n_shard)]
    rep_fqns = [f"model.norm{i}.weight" for i in range(REPLICATED)]
    bytes_fqns = [f"extra.item{i}" for i in range(BYTES_ITEMS)]
    rows, cols = 64 * world_size, 64
    plans = []
    for rank in range(world_size):
        items = []
        for fqn in shard_fqns:
            offsets, sizes = torch.Size([64 * rank, 0]), torch.Size([64, cols])
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, sizes), props, torch.Size([rows, cols])),
                )
            )
        for fqn in rep_fqns:
            offsets, size = torch.Size([0]), torch.Size([cols])
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, offsets),
                    type=WriteItemType.TENSOR,
                    tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, size), props, size),
                )
            )
        for fqn in bytes_fqns:
            items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
        # The flatten mappings: the same on every rank, one dict per rank (as gathered).
        mappings = {fqn: tuple(fqn.split(".", 1)) for fqn in shard_fqns + rep_fqns + bytes_fqns}
        plans.append(SavePlan(items, planner_data=mappings))
    return plans


def global_step(plans: list[SavePlan]) -> tuple[ObjectStoreWriter, list[SavePlan], Metadata]:
    """The coordinator's global step, as ``dcp.save`` runs it with an ``ObjectStoreWriter``."""
    writer = ObjectStoreWriter("memory://dcpstore-scale-bench")
    planner = DefaultSavePlanner()
    global_plans, metadata = planner.create_global_plan([attach_local_plan(p) for p in plans])
    central = writer.prepare_global_plan(global_plans)
    return writer, central, metadata


def write_results(central: list[SavePlan]) -> list[list[ChecksummedWriteResult]]:
    """What the ranks' ``write_data`` would report for their final plans."""
    results = []
    for rank, plan in enumerate(central):
        out, offset = [], 0
        paths = [f"__{rank}_{SIMULATED_NONCE}_{n}.distcp" for n in range(4)]  # one str a shard, as write_items shares it
        for n, item in enumerate(plan.items):
            length = (item.tensor_storage_size() or 8) + 1100  # torch.save framing
            path = paths[n % 4]
            out.append(
                ChecksummedWriteResult(
                    item.index, length, _StorageInfo(path, offset, length), crc32=zlib.crc32(path.encode()),
                    bytes_item=item.type == WriteItemType.BYTE_IO,
                )
            )
            offset += length
        results.append(out)
    return results


class _Captured(ObjectStoreWriter):
    raw: bytes = b""
    metadata: Metadata | None = None  # what raw pickles (set by finish below): the template is built from it

    def commit(self, raw_metadata: bytes, paths: set[str]) -> None:
        self.raw = raw_metadata


def torch_metadata_bytes(metadata: Metadata, results) -> int:
    """``.metadata`` as torch's ``FileSystemWriter`` writes it for the same save."""
    md = dataclasses.replace(metadata)
    md.storage_data = {
        wr.index: _StorageInfo(wr.storage_data.relative_path, wr.storage_data.offset, wr.storage_data.length)
        for rr in results
        for wr in rr
    }
    md.storage_meta = StorageMeta(checkpoint_id="s3://bucket/run/step_00000100", save_id="0" * 32)
    md.version = "1.0.0"
    return len(pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL))


def finish(writer_plans, metadata: Metadata, results, *, checksums: bool = True) -> tuple[_Captured, float]:
    """The coordinator's ``finish()``, timed; the writer holds the ``.metadata`` bytes and its store the index."""
    # A root of its own: the resume index goes up with If-None-Match, under a name the simulated nonce fixes.
    writer = _Captured(f"memory://dcpstore-scale-bench/{uuid.uuid4().hex}", checksums=checksums)
    writer.save_id = SIMULATED_NONCE  # an AsyncCheckpointer's nonce: its shard names' generation
    writer.plans.remember(writer_plans)
    writer.commit_record = {"sequence": 5, "parent": 4}  # what an AsyncCheckpointer's commit records
    if writer_plans is None:
        writer.plans.missing = "cached"  # quiet: measuring "no plans"
    md = dataclasses.replace(metadata)
    t0 = time.perf_counter()
    writer.finish(md, results)
    writer.metadata = md
    return writer, time.perf_counter() - t0


def next_values(template: metadata_template.Template) -> list:
    """What the next save of the structure writes in each slot: another nonce, other crc32s, the next commit."""
    out = []
    for slot, value in zip(template.slots, template.values):
        if slot.kind == "str":
            out.append(value.replace(SIMULATED_NONCE, SIMULATED_NONCE[::-1]))
        elif slot.role == "crc32":
            out.append(numpy.random.default_rng(0).integers(0, 256, len(value), numpy.uint8).tobytes())
        elif slot.role.startswith("commit."):
            out.append(value + 1)
        else:
            out.append(value)
    return out


def steady_values(template: metadata_template.CommitTemplate, seed: int = 0) -> numpy.ndarray:
    """What the ranks send the coordinator in a patched commit, as the gather stacks it: per rank its count, its crc32s, its bytes extents."""
    slots = template.template.slots
    extents = iter([v for slot, v in zip(slots, template.template.values) if slot.role in ("bytes.offset", "bytes.length")])
    widths = [template.width(r) for r in range(len(template.counts))]
    out = numpy.zeros((len(widths), 1 + max(widths)), numpy.int64)
    rng = numpy.random.default_rng(seed)
    for rank, (items, bytes_items) in enumerate(template.counts):
        k = items * template.checksums
        out[rank, 0] = widths[rank]
        out[rank, 1 : 1 + k] = rng.integers(0, 1 << 32, k)
        out[rank, 1 + k : 1 + k + 2 * bytes_items] = [next(extents) for _ in range(2 * bytes_items)]
    return out


def next_save(writer: ObjectStoreWriter, nonce: str) -> None:
    """The writer as the coordinator's next save finds it: the save's nonce, the next commit record."""
    writer.save_id = nonce
    writer.commit_record = {**writer.commit_record, "sequence": writer.commit_record["sequence"] + 1}


class PeakRSS:
    """Peak RSS growth of a block, in this process: the kernel's high-water mark, reset first (``/proc/self/clear_refs``)."""

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    def __enter__(self) -> "PeakRSS":
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.before = self._status("VmRSS:")
        return self

    def __exit__(self, *exc) -> None:
        self.growth = self._status("VmHWM:") - self.before


def finish_bytes(writer_plans, metadata: Metadata, results, *, checksums: bool = True) -> tuple[bytes, float]:
    writer, seconds = finish(writer_plans, metadata, results, checksums=checksums)
    writer.close()
    return writer.raw, seconds


def best_of(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def rss_growth(kind: str, raw: bytes) -> int:
    """Peak RSS growth (bytes) of parsing ``raw`` in a fresh process: ``share`` (an index block) or ``metadata``."""
    with tempfile.NamedTemporaryFile(suffix=".bin") as f:
        f.write(raw)
        f.flush()
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.scale", "--rss-child", kind, f.name],
            check=True, capture_output=True, text=True,
        )
    return int(out.stdout.split()[-1])


def _rss_child(kind: str, path: str) -> int:
    """What ``rss_growth`` runs: VmHWM after the parse minus VmRSS before it."""
    raw = open(path, "rb").read()

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    if kind == "share":  # the block and the segments of the writers it reads, as measure() pickled them
        raw, segments = pickle.loads(raw)
    entry = {"key": "index", "save_id": "0", "rank": 0, "block": [0, len(raw), hashlib.sha256(raw).hexdigest()]}

    class _OneObject:
        def get_range(self, key, start, end):
            return raw[start:end]

        def url_for(self, key):
            return key

    gc.collect()
    before = status("VmRSS:")
    if kind == "share":
        kept = resume_share.share_metadata(resume_share.read_block(_OneObject(), entry), entry, "bench", segments)
    else:
        kept = safe_pickle.loads_metadata(raw, "bench")
    peak = status("VmHWM:")
    del kept
    print(peak - before)
    return 0


def steady_commits(captured: ObjectStoreWriter, world_size: int) -> dict:
    """The coordinator's later saves of the structure: a patched commit, and the first one after a restart.

    ``captured`` has just committed the structure's first save in full (and
    kept its template).  The steady-state save: from the ranks' values, as
    the tensor gather stacks them, to the new ``.metadata`` and resume index
    (``commit_patched``).  After a restart: the template read back from the
    committed bytes and the index (``read_layout``, ``from_stored``; the
    resume's reads come from memory), then that save's patched commit.
    Object collectives in both: none (counted with real gloo ranks in
    tests/test_metadata_template.py and tests/test_resume_index.py).
    """
    store = captured.store
    keys = [captured._index_key]
    next_save(captured, SIMULATED_NONCE[::-1])
    values = steady_values(captured.builder.template)
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        assert captured.commit_patched(values)
        steady_s = time.perf_counter() - t0
    out = {"steady_s": steady_s, "steady_rss": peak.growth, "values_bytes": values.nbytes}
    if captured._index_key is None:
        return out
    keys.append(captured._index_key)
    offset, length, digest = captured._index_tags[resume_index.INDEX_TAG].split(":")
    pointer = {"key": captured._index_key, "save_id": captured.save_id, "directory": [int(offset), int(length), digest]}
    committed = captured.raw
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        directory = resume_share.read_directory(store, pointer, world_size)
        layout = resume_share.read_layout(store, directory)
        resumed = metadata_template.CommitTemplate.from_stored(
            committed, layout.template, object(), layout.counts, layout.checksums, layout, layout.template_of
        )
        resume_s = time.perf_counter() - t0
    out.update(resume_template_s=resume_s, resume_template_rss=peak.growth)
    captured.builder.use_template(resumed)
    next_save(captured, "0f1e2d3c4b5a6978")
    values = steady_values(resumed, seed=1)
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        assert captured.commit_patched(values)
        first_s = time.perf_counter() - t0
    out.update(first_after_resume_s=first_s, first_after_resume_rss=peak.growth)
    keys.append(captured._index_key)
    store.delete(keys[1:])
    return out


def measure(world_size: int, items_per_rank: int, *, repeat: int, safe_read_max: int) -> dict:
    plans = simulate_plans(world_size, items_per_rank)
    t0 = time.perf_counter()
    writer, central, metadata = global_step(plans)
    global_step_s = time.perf_counter() - t0
    results = write_results(central)
    torch_bytes = torch_metadata_bytes(metadata, results)
    captured, finish_s = finish(writer.plans.plans, metadata, results)
    raw = captured.raw
    t0 = time.perf_counter()
    md = captured.metadata
    template = metadata_template.build(md, metadata_template.dcpstore_slots(md))
    template_build_s = time.perf_counter() - t0
    assert template is not None
    values = next_values(template)
    patch_s = best_of(lambda: template.patch(values), repeat)
    slots = len(template.slots)
    del template
    steady = steady_commits(captured, world_size)
    del md, captured.metadata
    del plans, central, results
    loaded = pickle.loads(raw)
    unpickle_s = best_of(lambda: pickle.loads(raw), repeat if len(raw) <= safe_read_max else 1)
    rank = world_size - 1
    row = {
        "world_size": world_size,
        "items_per_rank": items_per_rank,
        "items_total": sum(len(md.chunks) if hasattr(md, "chunks") else 1 for md in loaded.state_dict_metadata.values()),
        "global_step_s": global_step_s,
        "finish_s": finish_s,
        "torch_bytes": torch_bytes,
        "metadata_bytes": len(raw),
        "unpickle_s": unpickle_s,
        "template_build_s": template_build_s,
        "slots": slots,
        "patch_s": patch_s,
        **steady,
    }
    if world_size >= 2:
        store = captured.store
        pointer = resume_index.pointer_of(loaded)
        directory = resume_share.read_directory(store, pointer, world_size)
        entry = resume_share.rank_entry(directory, rank, resume_share.read_values(store, directory))
        offset, length, _ = entry["block"]
        segments = resume_share.read_segments(store, entry)
        share = resume_share.share_metadata(resume_share.read_block(store, entry), entry, "bench", segments)
        assert len(share.metadata.storage_data) == len(share.local_plan.items)

        def read_share():
            return resume_share.share_metadata(
                resume_share.read_block(store, entry), entry, "bench", resume_share.read_segments(store, entry)
            )

        row.update(
            index_bytes=pointer["size"],
            block_bytes=length,
            directory_bytes=pointer["directory"][1],
            share_s=best_of(read_share, repeat),
            share_rss=rss_growth("share", pickle.dumps((store.get_range(pointer["key"], offset, offset + length), segments))),
        )
        store.delete([pointer["key"]])
    if len(raw) <= safe_read_max:
        row["safe_read_s"] = best_of(lambda: safe_pickle.loads_metadata(raw, "bench"), 2)
        row["safe_vs_c"] = row["safe_read_s"] / unpickle_s
        row["metadata_rss"] = rss_growth("metadata", raw)
    captured.close()
    return row


COLUMNS = [
    ("W", "world_size", "{:d}"),
    ("N", "items_per_rank", "{:d}"),
    ("global step s", "global_step_s", "{:.2f}"),
    ("finish s", "finish_s", "{:.2f}"),
    ("torch .metadata", "torch_bytes", "{:,}"),
    ("dcpstore .metadata", "metadata_bytes", "{:,}"),
    ("template s", "template_build_s", "{:.2f}"),
    ("slots", "slots", "{:,}"),
    ("patch s", "patch_s", "{:.3f}"),
    ("steady save s", "steady_s", "{:.2f}"),
    ("steady RSS", "steady_rss", "{:,}"),
    ("resume: template s", "resume_template_s", "{:.2f}"),
    ("resume: template RSS", "resume_template_rss", "{:,}"),
    ("first save after resume s", "first_after_resume_s", "{:.2f}"),
    ("C unpickle s", "unpickle_s", "{:.2f}"),
    ("safe read s", "safe_read_s", "{:.2f}"),
    ("safe / C", "safe_vs_c", "{:.1f}x"),
    (".metadata RSS", "metadata_rss", "{:,}"),
    ("index", "index_bytes", "{:,}"),
    ("read per rank", "block_bytes", "{:,}"),
    ("share s", "share_s", "{:.3f}"),
    ("share RSS", "share_rss", "{:,}"),
]


def table(rows: list[dict]) -> str:
    head = "| " + " | ".join(c[0] for c in COLUMNS) + " |"
    sep = "|" + "|".join("---:" for _ in COLUMNS) + "|"
    lines = [head, sep]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(row[key]) if key in row else "-" for _, key, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def extrapolate(rows: list[dict], world_size: int = 4096, items_per_rank: int = 2000) -> dict:
    """Linear in W x N from the largest measured row of ``items_per_rank``: what this machine cannot hold."""
    base = max((r for r in rows if r["items_per_rank"] == items_per_rank), key=lambda r: r["world_size"])
    scale = world_size / base["world_size"]
    out = {"from_world_size": base["world_size"], "world_size": world_size, "items_per_rank": items_per_rank}
    for key in ("metadata_bytes", "torch_bytes", "unpickle_s", "global_step_s", "finish_s", "template_build_s", "patch_s",
                "steady_s", "steady_rss", "resume_template_s", "resume_template_rss", "first_after_resume_s"):
        out[key] = base[key] * scale
    safe = [r for r in rows if r["items_per_rank"] == items_per_rank and "safe_vs_c" in r]
    if safe:  # the ratio of the largest .metadata timed both ways
        out["safe_read_s"] = out["unpickle_s"] * max(safe, key=lambda r: r["metadata_bytes"])["safe_vs_c"]
    for key in ("block_bytes", "share_s", "share_rss"):
        out[key] = base.get(key)  # a rank's share does not grow with W
    out["directory_bytes"] = base["directory_bytes"] * scale
    return out


def plot(results: dict, path: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for n in sorted({r["items_per_rank"] for r in rows}):
        mine = [r for r in rows if r["items_per_rank"] == n]
        ws = [r["world_size"] for r in mine]
        a.loglog(ws, [r["metadata_bytes"] for r in mine], "o-", label=f".metadata, N={n}")
        idx = [(r["world_size"], r["block_bytes"]) for r in mine if "block_bytes" in r]
        a.loglog(*zip(*idx), "s--", label=f"read per rank (index block), N={n}")
        b.loglog(ws, [r["unpickle_s"] for r in mine], "o:", label=f"C unpickle .metadata, N={n}")
        safe = [(r["world_size"], r["safe_read_s"]) for r in mine if "safe_read_s" in r]
        if safe:
            b.loglog(*zip(*safe), "^-", label=f"safe read .metadata, N={n}")
        share = [(r["world_size"], r["share_s"]) for r in mine if "share_s" in r]
        b.loglog(*zip(*share), "s--", label=f"share from index, N={n}")
    a.set_xlabel("world size W")
    a.set_ylabel("bytes")
    a.legend(fontsize=7)
    a.set_title("what a rank reads at resume")
    b.set_xlabel("world size W")
    b.set_ylabel("seconds, rank W-1")
    b.legend(fontsize=7)
    b.set_title("what a rank parses at resume")
    fig.suptitle(f"dcpstore at scale on {results['machine']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# N = 2,000 stops at W = 1,024: 10.1 GiB peak RSS on the 23 GiB development machine (~40 GiB at 4,096).
DEFAULT_GRID = ["8x64", "64x64", "256x64", "1024x64", "4096x64", "8x2000", "64x2000", "256x2000", "1024x2000"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", nargs="+", default=DEFAULT_GRID, help="WxN pairs: world size x items per rank")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--safe-read-max-mb", type=float, default=25.0, help="largest .metadata to time the safe read of")
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--rss-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_child:
        return _rss_child(*args.rss_child)
    logging.disable(logging.WARNING)
    os.makedirs(args.out, exist_ok=True)
    machine = f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}"
    results = {"machine": machine, "date": datetime.date.today().isoformat(), "torch": torch.__version__, "rows": []}
    for cell in args.grid:
        ws, n = (int(x) for x in cell.split("x"))
        row = measure(ws, n, repeat=args.repeat, safe_read_max=int(args.safe_read_max_mb * (1 << 20)))
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
    rows = results["rows"]
    text = io.StringIO()
    text.write(f"{machine}, torch {torch.__version__}\n\n")
    text.write(table(rows) + "\n\n")
    if any(r["items_per_rank"] == 2000 for r in rows):
        x = results["extrapolated"] = extrapolate(rows)
        text.write(
            f"linear in W x N from W={x['from_world_size']} to W={x['world_size']}, N={x['items_per_rank']}: "
            f".metadata {x['metadata_bytes'] / 1e9:.2f} GB (torch's own {x['torch_bytes'] / 1e9:.2f} GB), "
            f"C unpickle {x['unpickle_s']:.0f} s"
            + (f", safe read {x['safe_read_s']:.0f} s" if "safe_read_s" in x else "")
            + f"; coordinator global step {x['global_step_s']:.0f} s + finish {x['finish_s']:.0f} s; "
            f"per rank from the index: {x['block_bytes']:,} bytes, {x['share_s']:.2f} s, {x['share_rss'] / 2**20:.0f} MiB RSS "
            f"(the coordinator also reads a {x['directory_bytes'] / 1e6:.2f} MB directory)\n"
        )
    print("\n" + text.getvalue())
    with open(os.path.join(args.out, "scale.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(args.out, "scale.txt"), "w") as f:
        f.write(text.getvalue())
    wrote = ["scale.json", "scale.txt"]
    if plot(results, os.path.join(args.out, "scale.png")):
        wrote.append("scale.png")
    print(f"wrote {', '.join(os.path.join(args.out, w) for w in wrote)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
