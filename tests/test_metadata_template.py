"""The .metadata template: patched bytes are exactly the pickle of the same content, or the patch is refused."""

import pickle
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpstore
from benchmarks.scale import finish, global_step, simulate_plans, write_results
from dcpstore import metadata_template
from dcpstore.metadata_template import Unpatchable, build, dcpstore_slots


def _simulated(world_size=4, items_per_rank=12):
    """A coordinator's .metadata for W ranks, with compact plans, the resume index pointer and a commit record."""
    plans = simulate_plans(world_size, items_per_rank)
    _, central, metadata = global_step(plans)
    results = write_results(central)
    writer, _ = finish(plans, metadata, results)
    writer.close()
    md = pickle.loads(writer.raw)
    md.planner_data[dcpstore.planner_data.COMMIT_KEY] = {"sequence": 5, "parent": 4}
    return pickle.dumps(md, protocol=metadata_template.PROTOCOL)


def _next_values(template, md):
    """New values for every slot, at the widths they had: what the next save of the structure changes."""
    old_nonce = "0123456789abcdef"
    out = []
    for slot, value in zip(template.slots, template.values):
        if slot.role == "name":
            out.append(value.replace(old_nonce, "fedcba9876543210"))
        elif slot.role == "crc32":
            out.append(bytes((b + 7) % 256 for b in value))
        elif slot.role == "commit.sequence":
            out.append(value + 1)
        elif slot.kind == "int" and slot.role.startswith("bytes."):
            out.append(value + 3)  # a pickled step counter grew by 3 bytes, same width
        elif slot.kind == "str":
            out.append(value[::-1])  # another value of the same length
        else:
            out.append(value)
    return out


def test_a_patched_template_is_byte_for_byte_the_pickle_of_the_same_content():
    raw = _simulated()
    md = pickle.loads(raw)
    found = dcpstore_slots(md)
    template = build(md, found)
    # (A loaded Metadata pickles a little differently from the writer's: unpickling interns attribute names.)
    assert template is not None and template.raw == pickle.dumps(md, protocol=metadata_template.PROTOCOL)
    roles = {slot.role for slot in template.slots}
    # The save id is one str object, met first in the index pointer: one slot for every place that holds it.
    assert {"name", "crc32", "commit.sequence", "commit.parent", "bytes.offset", "bytes.length", "checkpoint_id",
            "index.key", "index.save_id", "index.directory", "index.size"} <= roles
    assert len(template.roles("name")) == len({id(info.relative_path) for info in md.storage_data.values()})
    values = _next_values(template, md)
    for v, new in zip(found, values):
        v.set(new)
    assert template.patch(values) == pickle.dumps(md, protocol=metadata_template.PROTOCOL)
    # And once more from there: the patched bytes are the next template.
    again = [v[::-1] if isinstance(v, str) else v for v in values]
    for v, new in zip(found, again):
        v.set(new)
    assert template.patch(again) == pickle.dumps(md, protocol=metadata_template.PROTOCOL)


@pytest.mark.parametrize(
    "role,value",
    [("bytes.length", 1 << 16), ("checkpoint_id", "s3://b/x"), ("crc32", b"\0" * 4), ("commit.sequence", "7")],
    ids=["wider-int", "shorter-str", "shorter-bytes", "another-type"],
)
def test_a_value_of_another_width_is_refused_and_nothing_is_written(role, value):
    raw = _simulated()
    md = pickle.loads(raw)
    template = build(md, dcpstore_slots(md))
    before = bytes(template.raw)
    values = list(template.values)
    values[template.roles(role)[0]] = value
    with pytest.raises(Unpatchable, match=role):
        template.patch(values)
    assert template.raw == before


def test_no_template_where_a_slot_has_no_fixed_width():
    """A first save's commit record has no parent (None): that save keeps the full path."""
    raw = _simulated()
    md = pickle.loads(raw)
    md.planner_data[dcpstore.planner_data.COMMIT_KEY]["parent"] = None
    assert build(md, dcpstore_slots(md)) is None


def test_the_next_real_save_of_a_structure_is_the_last_one_patched(tmp_path):
    """Two saves of one structure by an AsyncCheckpointer: step 3's .metadata is step 2's template, patched, exactly."""
    root = tmp_path / "run"
    sd = {"w": torch.arange(64.0), "b": torch.ones(3, 5), "step": 0, "note": b"x" * 300}
    with dcpstore.AsyncCheckpointer(f"file://{root}") as ckpt:
        for step in (1, 2, 3):
            sd["step"] = 10 ** step  # its pickled size changes, at the same int width as stored offsets
            sd["w"].add_(1)
            ckpt.save(sd, step=step)
            ckpt.wait()
    md2, md3 = (pickle.loads((root / f"step_{step:08d}" / ".metadata").read_bytes()) for step in (2, 3))
    template = build(md2, dcpstore_slots(md2))
    assert template is not None
    values = [v.value for v in dcpstore_slots(md3)]
    assert [slot.role for slot in template.slots] == [v.role for v in dcpstore_slots(md3)]
    assert template.values != values  # the nonce, the crc32s, the step, the counter's length all moved
    assert template.patch(values) == pickle.dumps(md3, protocol=metadata_template.PROTOCOL)


def test_a_template_read_back_from_its_map_is_the_one_that_made_it_or_is_refused():
    """What a resumed coordinator patches: the committed bytes and the map in the resume index; any other bytes are refused."""
    plans = simulate_plans(4, 12)
    _, central, metadata = global_step(plans)
    writer, _ = finish(plans, metadata, write_results(central))
    writer.close()
    template, raw = writer.builder.template, writer.raw
    assert template is not None and template.index is not None and bytes(template.template.raw) == raw

    def read_back(body: bytes, stored: bytes = template.stored_map()):
        return metadata_template.CommitTemplate.from_stored(
            body, stored, "structure", template.counts, template.checksums, template.index, template.template_id
        )

    back = read_back(raw)
    assert back.template.slots == template.template.slots and back.template.values == template.template.values
    assert back.generation == template.generation and back.metadata == "structure"
    name = next(slot for slot in template.template.slots if slot.role == "name")
    other_shard = bytearray(raw)
    other_shard[name.position + 2] ^= 1  # __0_<nonce>_0.distcp -> __1_<nonce>_0.distcp: the width and the nonce kept
    with pytest.raises(Unpatchable, match="names other shards"):
        read_back(bytes(other_shard))
    outside = bytearray(raw)
    outside[name.position - 3] ^= 1
    with pytest.raises(Unpatchable, match="outside the slots differ"):
        read_back(bytes(outside))
    with pytest.raises(Unpatchable, match="malformed"):
        read_back(raw, template.stored_map()[:-5])


def test_an_async_checkpointer_patches_each_save_of_an_unchanged_structure_and_stock_torch_loads_it(bucket, s3):
    """From the save after a full commit on, .metadata is the last one patched (a job's first save, with no parent, is not a template).

    A step counter whose pickled size changes every save still patches; a
    new shape takes the full path, and the save after it patches again.
    Every step loads bit-exact with stock ``FsspecReader`` and with dcpstore
    (which checks each crc32), and ``dcpstore verify --deep`` finds nothing.
    """
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    from conftest import read_metadata_raw
    from dcpstore.cli import verify
    from dcpstore.storage import open_store

    root = f"s3://{bucket}/run"
    sd = {"w": torch.arange(64.0), "b": torch.ones(3, 5), "optim": {"step": 0}, "note": b"x" * 300}
    patched, saved = [], {}
    with dcpstore.AsyncCheckpointer(root) as ckpt:
        for step in range(1, 7):
            sd["optim"]["step"] = 10 ** step  # a pickled size of its own every save
            sd["w"].add_(1)
            if step == 4:
                sd["b"] = torch.ones(4, 5)  # a new structure: planned and committed in full
            patched.append(ckpt.save(sd, step=step).result().metadata_patched)
            saved[step] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
            saved[step]["optim"] = dict(sd["optim"])
    assert patched == [False, False, True, False, True, True]
    for step, want in saved.items():
        url = f"{root}/step_{step:08d}"
        metadata = read_metadata_raw(s3, bucket, f"run/step_{step:08d}")
        nonce = metadata.storage_meta.save_id
        assert metadata.storage_meta.checkpoint_id == url
        assert all(re.fullmatch(rf"__0_{nonce}_\d\.distcp", info.relative_path) for info in metadata.storage_data.values())
        for reader in (FsspecReader(url), dcpstore.ObjectStoreReader(url)):
            out = {"w": torch.zeros(64), "b": torch.zeros_like(want["b"]), "optim": {"step": -1}, "note": b""}
            dcp.load(out, storage_reader=reader, no_dist=True)
            assert torch.equal(out["w"], want["w"]) and torch.equal(out["b"], want["b"]), step
            assert out["optim"] == want["optim"] and out["note"] == want["note"], step
        store = open_store(url)
        try:
            assert verify(store, deep=True, progress=False) == [], step
        finally:
            store.close()


def test_a_patched_commit_that_loses_the_race_for_its_step_is_refused_and_deletes_only_its_shards(bucket, s3, proxy):
    """Another job commits the step while the patched .metadata PUT is held: refused, its own shards deleted, the winner intact."""
    import threading

    from conftest import read_metadata_raw

    root = f"s3://{bucket}/run"
    options = {"endpoint_url": proxy.endpoint}
    sd = {"w": torch.arange(64.0), "optim": {"step": 0}}
    held = threading.Event()
    put = proxy.add("PUT", r"/run/step_00000003/\.metadata", hold=held, times=1)
    with dcpstore.AsyncCheckpointer(root, storage_options=options) as loser:
        for step in (1, 2):
            loser.save(sd, step=step).result()
        handle = loser.save(sd, step=3)
        assert put.arrived.wait(60)
        with dcpstore.AsyncCheckpointer(root) as winner:
            assert winner.save({"w": torch.ones(64), "optim": {"step": 9}}, step=3).result().metadata_patched is False
        held.set()
        with pytest.raises(dcpstore.CheckpointSaveError, match="refused"):
            handle.result()
        assert loser._writer.builder.patched_commit  # the refused .metadata was the patched one
    metadata = read_metadata_raw(s3, bucket, "run/step_00000003")
    names = {info.relative_path for info in metadata.storage_data.values()}
    keys = {o["Key"].rsplit("/", 1)[1] for o in s3.list_objects_v2(Bucket=bucket, Prefix="run/step_00000003/")["Contents"]}
    assert keys == names | {".metadata"}  # the loser's shards are gone, the winner's all there
    out = {"w": torch.zeros(64), "optim": {"step": -1}}
    dcp.load(out, storage_reader=dcpstore.ObjectStoreReader(f"{root}/step_00000003"), no_dist=True)
    assert torch.equal(out["w"], torch.ones(64)) and out["optim"] == {"step": 9}


# -- several ranks: values in one tensor collective, no object collective --------------------


@pytest.mark.parametrize(
    "world_size,items",
    [pytest.param(2, 200, id="2x200"), pytest.param(4, 2000, id="4x2000", marks=pytest.mark.slow)],
)
def test_ranks_patch_every_save_of_a_structure_without_an_object_collective(bucket, s3, world_size, items):
    """Gloo ranks x DTensors (4 x 2,000, as real jobs hold, in the slow tier; 2 x 200 in the default one): from the third save on, the commit sends tensors only, and stock torch loads every step.

    A bytes item's pickled size changes every save.  Rank 1 widens a tensor
    of its own at step 4 (planned anew, committed in full), and step 5 is
    patched again.  At step 6 a bytes item grows past what its slot's width
    holds: the plans are reused, but the coordinator cannot patch, so every
    rank commits in full, and step 7 is patched again.
    ``dcpstore verify --deep`` checks every rank's resume index share
    against each patched ``.metadata``.
    """
    from conftest import read_metadata_raw
    from dist_utils import run_ranks
    from workers import checkpointer_patched_saves

    from dcpstore.cli import main

    root = f"s3://{bucket}/run"
    steps = (1, 2, 3, 4, 5, 6, 7)
    results = run_ranks(checkpointer_patched_saves, world_size, root, items, steps, 4, 6, timeout=900)
    for rank, by_step in results.items():
        objects = [by_step[s][0] for s in steps]
        steady = [n == 0 for n in objects]
        assert steady == [False, False, True, False, True, False, True], (rank, objects)
        assert [by_step[s][1] for s in steps] == [False, True, True, False, True, True, True]  # plans reused
        assert all(by_step[s][3] for s in steps), rank  # stock FsspecReader, bit-exact, every step
    assert [results[0][s][2] for s in steps] == [False, False, True, False, True, False, True]  # .metadata patched
    for step in (3, 5, 7):
        metadata = read_metadata_raw(s3, bucket, f"run/step_{step:08d}")
        assert len(metadata.storage_data) == world_size * items + world_size + 3
        assert main(["verify", f"{root}/step_{step:08d}", "--deep"]) == 0
