"""The .metadata template: patched bytes are exactly the pickle of the same content, or the patch is refused."""

import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

import dcpstore
from benchmarks.scale import finish, global_step, simulate_plans, write_results
from dcpstore import metadata_template
from dcpstore.metadata_template import Unpatchable, build, dcpstore_slots


def _slots(md):
    return dcpstore_slots(md, lambda index: isinstance(md.state_dict_metadata[index.fqn], BytesStorageMetadata))


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
    found = _slots(md)
    template = build(md, found)
    # (A loaded Metadata pickles a little differently from the writer's: unpickling interns attribute names.)
    assert template is not None and template.raw == pickle.dumps(md, protocol=metadata_template.PROTOCOL)
    roles = {slot.role for slot in template.slots}
    # The save id is one str object, met first in the index pointer: one slot for every place that holds it.
    assert {"name", "crc32", "commit.sequence", "commit.parent", "bytes.offset", "bytes.length", "checkpoint_id",
            "index.key", "index.save_id", "index.directory.2"} <= roles
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
    template = build(md, _slots(md))
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
    assert build(md, _slots(md)) is None


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
    template = build(md2, _slots(md2))
    assert template is not None
    values = [v.value for v in _slots(md3)]
    assert [slot.role for slot in template.slots] == [v.role for v in _slots(md3)]
    assert template.values != values  # the nonce, the crc32s, the step, the counter's length all moved
    assert template.patch(values) == pickle.dumps(md3, protocol=metadata_template.PROTOCOL)
