"""Read once, restore everywhere (``cooperative_load``): 4 real gloo ranks, each stored byte read from moto once per job."""

from __future__ import annotations

import collections
import random
import re

from torch.distributed.checkpoint.planner import LoadPlan

from cooperative_workers import (
    LAYOUTS,
    load_alone_with_read_once,
    load_corrupt,
    load_failing_a_delivery,
    load_layouts,
    load_losing_a_peer,
    save_layouts,
    save_step,
)
from dist_utils import run_ranks

from dcpstore import cooperative_load

MIB = 4


def shard_bytes_read(proxy, prefix: str) -> int:
    """Bytes of ``.distcp`` objects under ``prefix`` that GETs through ``proxy`` asked for."""
    total = 0
    for method, path, headers in proxy.headers:
        if method == "GET" and f"/{prefix}/" in path and ".distcp" in path:
            lo, hi = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", headers["range"]).groups())
            total += hi - lo + 1
    return total


def shard_bytes_stored(s3, bucket: str, prefix: str) -> int:
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/")["Contents"]
    return sum(o["Size"] for o in listed if o["Key"].endswith(".distcp"))


def test_each_stored_byte_is_read_once_per_job_in_every_layout(bucket, s3, proxy):
    root = f"s3://{bucket}/layouts"
    run_ranks(save_layouts, 4, root, MIB)
    proxy.clear()
    loaded = run_ranks(load_layouts, 4, root, MIB, True, proxy.endpoint)
    for layout in LAYOUTS:
        assert all(loaded[r][layout][0] for r in range(4)), f"{layout}: a rank's state differs from what was saved"
        ratio = shard_bytes_read(proxy, f"layouts/{layout}") / shard_bytes_stored(s3, bucket, f"layouts/{layout}")
        assert ratio <= 1.10, f"{layout}: the job read {ratio:.2f}x the stored shard bytes"
    # Resharded: every rank of a sharded state reads a quarter of each replicated checkpoint's items (ranged, narrowed).
    proxy.clear()
    resharded = run_ranks(load_layouts, 4, root, MIB, True, proxy.endpoint, ("sharded", "hsdp"), "replicated")
    assert all(resharded[r][layout][0] for r in range(4) for layout in ("sharded", "hsdp"))
    ratio = shard_bytes_read(proxy, "layouts/replicated") / shard_bytes_stored(s3, bucket, "layouts/replicated")
    assert ratio <= 2 * 1.10, f"two loads of the replicated checkpoint read {ratio:.2f}x its bytes"
    # Without it, every replica reads its own copy: what the option saves.
    proxy.clear()
    alone = run_ranks(load_layouts, 4, root, MIB, False, proxy.endpoint, ("replicated",))
    assert all(alone[r]["replicated"][0] for r in range(4))
    ratio = shard_bytes_read(proxy, "layouts/replicated") / shard_bytes_stored(s3, bucket, "layouts/replicated")
    assert ratio >= 3.9


def test_a_checksum_failure_at_the_owner_fails_every_rank_and_lands_nothing(bucket, s3):
    root = f"s3://{bucket}/corrupt"
    run_ranks(save_layouts, 4, root, MIB, ("replicated",))
    # Flip one byte in the middle of one shard object: its item fails its crc32 at whichever rank owns it.
    key = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="corrupt/")["Contents"] if o["Key"].endswith(".distcp"))[0]
    body = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    results = run_ranks(load_corrupt, 4, f"{root}/replicated", MIB)
    for rank, (error, untouched) in results.items():
        assert "checksum mismatch" in error and key.rsplit("/", 1)[1] in error, (rank, error)
        assert untouched, f"rank {rank}: a destination was written"


def test_a_delivery_that_fails_on_one_rank_fails_the_load_on_every_rank_and_hangs_none(bucket, s3):
    """A failure after the bytes moved (here the planner refusing an item on rank 2) is reported at the next agreement."""
    root = f"s3://{bucket}/refused"
    run_ranks(save_layouts, 4, root, 1, ("replicated",))
    errors = run_ranks(load_failing_a_delivery, 4, f"{root}/replicated", 1, 2, collective_timeout=30)
    assert "the planner refused the item" in errors[2]
    for rank in (0, 1, 3):
        assert "rank 2 failed in round" in errors[rank] and "the planner refused the item" in errors[rank], (rank, errors[rank])
    # Without a process group the option changes nothing: one rank reads every stored byte once, as always.
    ok, read = load_alone_with_read_once(f"{root}/replicated", 1)
    assert ok and read == shard_bytes_stored(s3, bucket, "refused/replicated")


def test_a_peer_killed_mid_broadcast_fails_the_load_on_every_rank(bucket):
    root = f"s3://{bucket}/killed"
    run_ranks(save_step, 4, root, MIB)
    errors = run_ranks(load_losing_a_peer, 4, root, MIB, 1, expect_killed=(1,), collective_timeout=30)
    for rank in (0, 2, 3):
        assert "rank 1" in errors[rank] and "step_00000001" in errors[rank], (rank, errors[rank])


def simulated_plans(replicas: int, shards: int, items: int, seed: int = 0) -> list[LoadPlan]:
    """The local plans of a job of ``replicas`` x ``shards`` ranks (HSDP): rank ``r`` needs shard ``r % shards`` of every tensor."""
    rng = random.Random(seed)
    sizes = [rng.randint(1, 1 << 20) for _ in range(items)]
    plans = []
    for rank in range(replicas * shards):
        shard = rank % shards
        wanted = tuple((f"__{shard}_0.distcp", sum(sizes[:i]), size) for i, size in enumerate(sizes))
        plans.append(LoadPlan([], storage_data=cooperative_load.Wanted(wanted)))
    return plans


def test_the_plan_gives_each_shared_item_one_owner_balanced_by_bytes_and_rounds_within_their_bound():
    replicas, shards, items, round_bytes = 8, 8, 200, 8 << 20
    plans = simulated_plans(replicas, shards, items)
    out = cooperative_load.plan(plans, round_bytes=round_bytes, chunk_bytes=1 << 18)
    wanted = [p.storage_data.items for p in plans]
    assignments = [p.storage_data for p in out]
    assert len({a.rounds for a in assignments}) == 1
    senders: dict = collections.defaultdict(list)
    receivers: dict = collections.defaultdict(list)
    for rank, a in enumerate(assignments):
        for r, part in a.parts.items():
            assert part.items() and sum(wanted[rank][i][2] for i in part.items()) <= round_bytes or len(part.items()) == 1
            for place, to, tag in part.sends:
                senders[wanted[rank][place]].append((rank, set(to), tag, r))
            for place, owner, tag in part.receives:
                receivers[wanted[rank][place]].append((rank, owner, tag, r))
    read = [0] * len(plans)
    for item, sent in senders.items():
        assert len(sent) == 1, f"{item} has {len(sent)} owners"
        owner, to, tag, r = sent[0]
        assert {(rank, owner, tag, r) for rank in to} == set(receivers[item])
        assert {owner} | to == {rank for rank, w in enumerate(wanted) if item in w}  # every needer, no one else
        read[owner] += item[2]
    assert set(receivers) == set(senders)
    # Each replica group's shard is split among its 8 replicas: about an eighth each, within one item.
    for shard in range(shards):
        group = [read[r] for r in range(shard, len(plans), shards)]
        assert max(group) - min(group) <= 1 << 20, group


def test_an_item_every_rank_needs_does_not_hold_the_replica_groups_back():
    """Replicated scalars (an optimizer's step) in every shard file: each replica group's rounds still run side by side."""
    plans = simulated_plans(2, 8, 40)
    alone = cooperative_load.plan(plans, round_bytes=8 << 20)[0].storage_data.rounds
    for rank, p in enumerate(plans):  # every rank also needs a small item in each shard's file
        extra = tuple((f"__{shard}_0.distcp", 1 << 40, 8) for shard in range(8))
        plans[rank] = LoadPlan([], storage_data=cooperative_load.Wanted(p.storage_data.items + extra))
    assert cooperative_load.plan(plans, round_bytes=8 << 20)[0].storage_data.rounds <= alone + 1


def test_the_plan_is_off_when_nothing_is_shared_or_a_rank_opted_out():
    sharded = [LoadPlan([], storage_data=cooperative_load.Wanted(((f"__{r}_0.distcp", 0, 100),))) for r in range(4)]
    assert all(p.storage_data is None for p in cooperative_load.plan(sharded, round_bytes=1 << 20))
    replicated = simulated_plans(4, 1, 10)
    replicated[2] = LoadPlan([], storage_data=None)  # a rank whose reader was made without read_once
    assert all(p.storage_data is None for p in cooperative_load.plan(replicated, round_bytes=1 << 20))
