"""Bounded ``.metadata`` parsing: hostile bytes fail fast, naming the object, whatever they ask for (issue 26).

The allow-list decides what a pickle may call; these tests hold what it may
cost: no allocation sized by an integer from the bucket, work in proportion
to the input, no quadratic dict, and a fuzz run over mutated real
``.metadata`` objects.  Time bounds are generous multiples of the ~1 s goal,
scaled for a busy box (``deadline_scale``).
"""

import pickle
import resource
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dcpstore
from dcpstore.metadata_reading import parse_metadata
from dcpstore.safe_pickle import MAX_NESTING, MAX_PREDICTABLE_KEYS, loads_metadata
from dist_utils import deadline_scale
from helpers import sample_state_dict

URL = "s3://bucket/run/step_00000001/.metadata"
GOAL_S = 1.0  # the bound on hostile input up to 1 MB


def _refused_fast(raw: bytes, match: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(dcpstore.CorruptCheckpointError, match=match) as e:
        parse_metadata(raw, URL)
    assert URL in str(e.value)
    assert time.monotonic() - t0 < 5 * GOAL_S * deadline_scale()


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def test_a_size_from_the_bucket_allocates_nothing():
    """70 bytes that asked for bytearray(3.3 GB) before; now refused before any allocation."""
    raw = b"\x80\x04" + _global("builtins", "bytearray") + b"\x8a\x05\x00\x00\x00\xc5\x00\x85R."
    assert len(raw) < 70
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _refused_fast(raw, r"refusing bytearray\(\d+\)")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 * 1024  # KiB: far below 3 GB
    # A bytearray of bytes, as pickle protocols 3 and 4 write one, is still data.
    assert loads_metadata(pickle.dumps(bytearray(b"abc"), protocol=3), URL) == bytearray(b"abc")


COLLIDING = (1 << 61) - 1  # hash(k * COLLIDING) == 0 for every k


def _pickle_of_colliding_keys(n: int) -> bytes:
    """The pickle of ``{k * COLLIDING: None for k in range(1, n)}``, written opcode by opcode.

    EMPTY_DICT, MARK, a LONG1 key and None per item, SETITEMS: building the
    dict itself would cost the test the quadratic time it checks for.
    """
    keys = ((k * COLLIDING).to_bytes(((k * COLLIDING).bit_length() + 8) // 8, "little", signed=True) for k in range(1, n))
    return b"\x80\x04}(" + b"".join(b"\x8a" + bytes([len(key)]) + key + b"N" for key in keys) + b"u."


def test_colliding_int_keys_cost_linear_time():
    """Half a MiB of int keys that all hash alike took 12 s and grew with the square of the size."""
    assert pickle.loads(_pickle_of_colliding_keys(100)) == {k * COLLIDING: None for k in range(1, 100)}
    raw = _pickle_of_colliding_keys(32_000)
    assert 400_000 < len(raw) < 1_000_000
    _refused_fast(raw, f"more than {MAX_PREDICTABLE_KEYS} dict or set keys")


def test_a_call_repeated_on_one_memoized_list_is_charged_each_time():
    """set(big_list) behind 6-byte references: the input grows by 6 bytes a call, the work by the list."""
    body = b"\x80\x02" + _global("builtins", "set") + b"q\x00"  # set -> memo 0
    body += b"]q\x01(" + b"X\x01\x00\x00\x00a" * 50_000 + b"e"  # a list of 50,000 strs -> memo 1
    body += b"(" + b"h\x00h\x01\x85R" * 20_000 + b"t."  # a tuple of 20,000 set(list) calls
    assert len(body) < 1_000_000
    _refused_fast(body, "more work than its")


def test_a_nested_tuple_key_is_charged_for_hashing():
    inner = tuple(range(1000))
    nested = (inner,) * 1000  # pickled as 1000 references to one tuple; hashing it visits 10^6 ints
    raw = pickle.dumps({nested: 1}, protocol=4)
    _refused_fast(raw, "more work than its")


def test_nesting_is_capped():
    raw = b"\x80\x04" + b"(" * (MAX_NESTING + 1) + b"."
    _refused_fast(raw, f"nested more than {MAX_NESTING} deep")


def test_every_metadata_dcp_writes_still_parses(tmp_path):
    """The bounds leave room for what DCP writes: a real .metadata with plans, checksums and user data."""
    with dcpstore.AsyncCheckpointer(f"file://{tmp_path}") as ckpt:
        ckpt.save(sample_state_dict(), step=1)
    raw = (tmp_path / "step_00000001" / ".metadata").read_bytes()
    md = parse_metadata(raw, URL)
    assert md.state_dict_metadata.keys() == pickle.loads(raw).state_dict_metadata.keys()


@pytest.fixture(scope="module")
def real_metadata(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("fuzz")
    with dcpstore.AsyncCheckpointer(f"file://{path}") as ckpt:
        ckpt.save({**sample_state_dict(), "steps": {i: torch.ones(2) for i in range(8)}}, step=1)
    return (path / "step_00000001" / ".metadata").read_bytes()


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_mutated_metadata_is_parsed_or_refused_with_our_error(real_metadata, data):
    """Bytes flipped, cut, repeated or spliced into a real .metadata: a Metadata, or dcpstore's error; fast."""
    raw = bytearray(real_metadata)
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "cut", "repeat", "insert"]))
        at = data.draw(st.integers(0, len(raw) - 1))
        if kind == "flip":
            raw[at] = data.draw(st.integers(0, 255))
        elif kind == "cut":
            del raw[at : at + data.draw(st.integers(1, 64))]
        elif kind == "repeat":
            raw[at:at] = raw[at : at + data.draw(st.integers(1, 32))] * data.draw(st.integers(1, 2000))
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=16))
        if not raw:
            raw = bytearray(b".")
    t0 = time.monotonic()
    try:
        parse_metadata(bytes(raw), URL)
    except (dcpstore.CorruptCheckpointError, dcpstore.UnsafeCheckpointError) as e:
        assert URL in str(e)
    assert time.monotonic() - t0 < 5 * GOAL_S * deadline_scale()
