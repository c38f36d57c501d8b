"""Throttling is a rate signal: saves survive sustained 503 SlowDown without a retry storm.

The proxy's ``ThrottleModel`` answers like one S3 partition under load (a
token bucket of requests per second, 503 SlowDown for the excess).  The
model is scaled down from S3's 3,500 writes/s to a few per second, and
``TransferConfig.prefix_write_rate`` is set to the same figure, as the
default is set to S3's.  Throughput against the modelled limit is measured
in ``benchmarks/throttle.py``, not asserted here: a busy 2-core box sets no
floor a test can hold.
"""

import asyncio
import math
import threading
import time
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dist_utils import deadline_scale, run_ranks
from s3server import ThrottleModel
from workers import rank_tensors, save_under_throttling

import dcpstore
from dcpstore.storage import RetryPolicy, TransferConfig, open_store
from dcpstore.storage import throttle
from dcpstore.storage.throttle import RATES

MiB = 1 << 20

# Pacing is what these tests are about: every writer starts as one told nothing (see conftest's bucket).
pytestmark = pytest.mark.slow_start


def _store(bucket, proxy, prefix, **transfer):
    return open_store(
        f"s3://{bucket}/{prefix}", storage_options={"endpoint_url": proxy.endpoint}, transfer=TransferConfig(**transfer)
    )


def test_a_throttle_that_never_lifts_fails_within_its_budget_naming_the_object(bucket, proxy):
    """Throttled answers are retried past max_attempts, for throttle_budget seconds, then named."""
    rule = proxy.add("PUT", r"/always-busy$", status=503, code="SlowDown")
    budget = 3.0
    store = _store(bucket, proxy, "r", retry=RetryPolicy(max_attempts=2, initial_backoff=0.01, throttle_budget=budget))
    t0 = time.monotonic()
    with pytest.raises(dcpstore.ThrottledError, match=r"PUT s3://.*/r/always-busy was throttled for \d+s .*SlowDown"):
        store.put("always-busy", b"x")
    assert isinstance(dcpstore.ThrottledError("x"), dcpstore.TransientStorageError)
    assert rule.hits > 2  # kept trying past max_attempts
    # Bounded by the budget plus a paced slot and one request's round trip (generous slack for a busy box).
    assert time.monotonic() - t0 < (budget + 5) * deadline_scale()


def test_other_transient_errors_stay_bounded_by_attempts(bucket, proxy):
    rule = proxy.add("PUT", r"/always-broken$", status=500, code="InternalError")
    store = _store(bucket, proxy, "r", retry=RetryPolicy(max_attempts=3, initial_backoff=0.01))
    with pytest.raises(dcpstore.TransientStorageError, match=r"always-broken failed after 3 attempt.*InternalError"):
        store.put("always-broken", b"x")
    assert rule.hits == 3


def test_stores_and_threads_of_a_process_share_one_rate_per_key_range(bucket, proxy):
    """Four stores on one prefix, four threads each, against a limit of 15 writes/s: few requests wasted.

    Each store pacing itself would send four times what the key range admits.
    """
    proxy.throttle = ThrottleModel(rate=15, burst=15)
    transfer = dict(prefix_write_rate=15.0, retry=RetryPolicy(initial_backoff=0.01))
    stores = [_store(bucket, proxy, "shared", **transfer) for _ in range(4)]
    stores[0].share_write_rate(1)
    errors = []

    def put_many(store, first):
        try:
            for i in range(first, first + 3):
                store.put(f"obj-{i}", b"%d" % i)
        except Exception as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    threads = [threading.Thread(target=put_many, args=(s, 3 * (4 * n + t))) for n, s in enumerate(stores) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(o.key for o in stores[0].list()) == sorted(f"obj-{i}" for i in range(48))
    assert proxy.throttle.admitted == 48
    assert proxy.throttle.amplification <= 1.5, (proxy.throttle.sent, proxy.throttle.admitted)


def test_a_request_paced_past_its_deadline_is_not_sent(bucket, proxy):
    """A request's first send slot is checked against its deadline too, not only its retries'.

    The late request's slot is 1/rate after the first one's, so the first
    request's round trip must stay under that interval: 4 s, not 1 s, which
    a busy CI box once exceeded (the slot had come by the time it asked).
    """
    store = _store(bucket, proxy, "paced", prefix_write_rate=0.25)
    store.share_write_rate(1)  # one write every 4 seconds in this key range
    store.put("first", b"1")
    with pytest.raises(dcpstore.TransientStorageError, match=r"paced/late was not sent: .* past its deadline"):
        store.put("late", b"2", deadline=time.monotonic() + 0.05)
    assert not any(path.split("?")[0].endswith("/paced/late") for _, path in proxy.requests)
    store.close()


def test_a_cut_for_one_key_range_leaves_the_others_alone(bucket, proxy):
    """Key spreading can only help if a hot range's cut does not slow the bucket's other ranges."""
    store = _store(bucket, proxy, "ranges", prefix_write_rate=100.0)
    store.share_write_rate(1)
    store.put("cold/warm-up", b"x")
    store.put("hot/warm-up", b"x")
    proxy.add("PUT", r"/ranges/hot/", status=503, code="SlowDown", times=3)
    store.put("hot/obj", b"x")
    scope = store.rate_scope
    assert RATES.rate(scope, "ranges/hot", "write").rate < 100.0
    assert RATES.rate(scope, "ranges/cold", "write").rate >= 100.0


@pytest.mark.parametrize("world_size,rate", [(2, 8), pytest.param(8, 4, marks=pytest.mark.slow)])
def test_ranks_commit_under_sustained_throttling_without_a_retry_storm(bucket, s3, proxy, world_size, rate):
    """Gloo ranks, plain dcp.save, one partition admitting ``rate`` writes/s: every save commits bit-exact.

    Each rank writes 2 objects of 6 MiB in 5 MiB parts (create, 2 parts,
    complete): 8 write requests a rank; 8 ranks (the slow tier) send 66 with
    the coordinator's resume index and ``.metadata``, about 16 s at 4
    writes/s.  Before rates were paced, 6 of 8 such saves failed within
    30 s, with 1.7x the requests needed.  The default tier runs 2 ranks at 8
    writes/s.
    """
    proxy.throttle = ThrottleModel(rate=rate, burst=rate)
    transfer = TransferConfig(part_size=5 * MiB, max_concurrency=4, prefix_write_rate=float(rate))
    url = f"s3://{bucket}/ckpt"
    run_ranks(save_under_throttling, world_size, url, proxy.endpoint, transfer, timeout=300)
    model = proxy.throttle
    admitted = 8 * world_size + 2  # + the resume index and .metadata
    held_back = (admitted - rate) / rate * 0.65  # 8 ranks at 4/s: 10 s
    assert model.throttled > 0 or model.last - model.first > held_back  # the limit held the save back
    assert model.admitted == admitted
    assert model.amplification <= 1.5, (model.sent, model.admitted)
    proxy.throttle = None

    expected = {k: v for r in range(world_size) for k, v in rank_tensors(r).items()}
    loaded = {k: torch.empty_like(v) for k, v in expected.items()}
    reader = dcpstore.ObjectStoreReader(url)
    dcp.load(loaded, storage_reader=reader)
    reader.close()
    for k, v in expected.items():
        assert torch.equal(loaded[k], v), k


@pytest.mark.slow
def test_eight_processes_without_a_process_group_commit_under_throttling_without_a_retry_storm(bucket, s3, proxy):
    """The same partition and tensors, but 8 processes, each its own plain dcp.save, no process group, no hint.

    No writer knows how many others share the partition, so none can
    start at its share: each slow-starts (``RequestRate.SLOW_START``).
    Each writes 9 requests (8 for its two objects, then its ``.metadata``;
    a job of one rank writes no resume index), 72 in all.  Before, each
    started at the whole ``prefix_write_rate``: 185 sent here (2.57x), and
    16.2x in the issue's run (777 for 48).  Now 1.36-1.44x on an idle box
    and 1.61x once on a busy one: the goal (1.5x) is measured by
    ``benchmarks/throttle.py``; the bound here is for a storm, with room
    for a busy box.
    """
    from workers import save_alone_under_throttling

    writers = 8
    proxy.throttle = ThrottleModel(rate=4, burst=4)
    transfer = TransferConfig(part_size=5 * MiB, max_concurrency=4, prefix_write_rate=4.0)
    root = f"s3://{bucket}/root"
    run_ranks(save_alone_under_throttling, writers, root, proxy.endpoint, transfer, timeout=300, process_group=False)
    model = proxy.throttle
    proxy.throttle = None
    print(f"sent {model.sent} write requests for {model.admitted} admitted")
    assert model.admitted == 9 * writers
    assert model.amplification <= 1.8, (model.sent, model.admitted)
    for rank in range(writers):
        expected = rank_tensors(rank)
        loaded = {k: torch.empty_like(v) for k, v in expected.items()}
        dcp.load(loaded, storage_reader=dcpstore.ObjectStoreReader(f"{root}/w{rank}"), no_dist=True)
        for k, v in expected.items():
            assert torch.equal(loaded[k], v), (rank, k)


def test_key_spread_places_shards_under_hashed_sub_prefixes_that_stock_readers_load(bucket, s3):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    url = f"s3://{bucket}/spread"
    sd = {f"t{i}": torch.randn(1000, generator=torch.Generator().manual_seed(i)) for i in range(16)}
    writer = dcpstore.ObjectStoreWriter(url, objects_per_rank=8, key_spread=4)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    writer.close()
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="spread/")["Contents"]]
    folders = {k.split("/")[1] for k in keys if k.endswith(".distcp")}
    assert len(folders) > 1 and folders <= {"00", "40", "80", "c0"}, folders
    assert all(k.count("/") == 2 for k in keys if k.endswith(".distcp"))
    # The next save puts each shard under the same sub-prefix: its name changes by the generation alone.
    writer = dcpstore.ObjectStoreWriter(f"s3://{bucket}/spread2", objects_per_rank=8, key_spread=4)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    writer.close()
    again = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="spread2/")["Contents"]]

    def sub_prefix_of_shard(keys):
        return {k.rsplit("_", 1)[1]: k.split("/")[1] for k in keys if k.endswith(".distcp")}

    assert sub_prefix_of_shard(again) == sub_prefix_of_shard(keys) and len(sub_prefix_of_shard(keys)) == 8
    for reader in (dcpstore.ObjectStoreReader(url), FsspecReader(url)):
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(out, storage_reader=reader, no_dist=True)
        assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_a_save_has_one_throttling_budget_not_one_per_request(bucket, proxy):
    """Every write of the save is throttled: the save fails once its one budget is spent, naming an object."""
    from torch.distributed.checkpoint.api import CheckpointException

    proxy.add("PUT", r"/one-budget/", status=503, code="SlowDown")
    budget = 1.5
    transfer = TransferConfig(retry=RetryPolicy(initial_backoff=0.01, throttle_budget=budget))
    writer = dcpstore.ObjectStoreWriter(
        f"s3://{bucket}/one-budget", storage_options={"endpoint_url": proxy.endpoint}, transfer=transfer, objects_per_rank=4
    )
    t0 = time.monotonic()
    with pytest.raises(CheckpointException) as e:
        dcp.save({f"t{i}": torch.ones(10) for i in range(4)}, storage_writer=writer, no_dist=True)
    writer.close()
    assert "was throttled for" in str(e.value) and f"s3://{bucket}/one-budget/" in str(e.value)
    assert time.monotonic() - t0 < (budget + 10) * deadline_scale()


def test_a_slow_upload_leaves_the_saves_throttle_budget_unspent(bucket, s3, proxy):
    """The budget counts time the save spent throttled, not time spent uploading.

    The one shard takes longer than the whole budget, unthrottled; the
    ``.metadata`` PUT is then throttled once, and the save still commits.
    (A writer alone slow-starts: its retry waits for the rate it then
    calibrates at, 2 s here, within the budget.)
    """
    budget = 4.0
    proxy.add("PUT", r"/slow-upload/.*\.distcp", delay=budget + 1)
    slow_down = proxy.add("PUT", r"/slow-upload/\.metadata$", status=503, code="SlowDown", times=1)
    transfer = TransferConfig(retry=RetryPolicy(initial_backoff=0.01, throttle_budget=budget))
    writer = dcpstore.ObjectStoreWriter(
        f"s3://{bucket}/slow-upload", storage_options={"endpoint_url": proxy.endpoint}, transfer=transfer, objects_per_rank=1
    )
    dcp.save({"w": torch.arange(10.0)}, storage_writer=writer, no_dist=True)
    writer.close()
    assert slow_down.hits == 1
    assert s3.head_object(Bucket=bucket, Key="slow-upload/.metadata")["ContentLength"] > 0


def test_a_saves_throttle_clock_counts_concurrent_throttling_once(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(throttle, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    save = throttle.ThrottleClock(budget=10.0)
    clock[0] = 100.0  # an hour of unthrottled upload would change nothing: only held time counts
    save.hold()
    clock[0] += 3
    save.hold()  # a second request throttled while the first still is
    clock[0] += 2
    save.release()
    clock[0] += 1
    save.release()
    assert save.spent() == pytest.approx(6.0) and not save.exhausted()
    clock[0] += 50  # uploading, unthrottled
    save.hold()
    clock[0] += 4
    assert save.spent() == pytest.approx(10.0) and save.exhausted()


def test_growth_probes_faster_the_longer_a_range_sends_unthrottled_and_idle_time_does_not_count(monkeypatch):
    """A range S3 split (or that other writers left) is found out in seconds; a pause between saves is not probing."""
    clock = [1000.0]
    monkeypatch.setattr(throttle, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))

    def send(rate, seconds_apart):
        """One request ``seconds_apart`` after the last (never sooner than its slot): its send time."""
        clock[0] += seconds_apart
        return asyncio.run(rate.acquire())[0]

    rate = throttle.RequestRate(10.0)
    rate.throttled(send(rate, 0.2))
    cut = rate.rate
    assert cut == pytest.approx(10.0 * throttle.RequestRate.BETA)

    send(rate, 0.2)
    before = rate.rate
    rate.succeeded(paced=True)
    fresh = rate.rate / before - 1  # right after a cut: GROWTH per success
    assert fresh == pytest.approx(throttle.RequestRate.GROWTH, rel=0.1)

    for _ in range(100):  # 20 s of sending, unthrottled
        send(rate, 0.2)
    before = rate.rate
    rate.succeeded(paced=True)
    probing = rate.rate / before - 1
    assert probing > 10 * fresh  # 2 ** (20 / PROBE_DOUBLING) = 16 times

    rate.throttled(send(rate, 0.2))
    send(rate, 600.0)  # idle between two saves: not probing
    before = rate.rate
    rate.succeeded(paced=True)
    assert rate.rate / before - 1 < 2 * fresh


def test_a_week_of_saves_keeps_every_rate_finite_and_grows_it_only_where_the_pace_was_the_limit(monkeypatch):
    """On a fake clock: a week of requests, unthrottled, at low demand and at demand above the rate.

    Before, a range whose demand stayed below its rate grew on every success
    (to ``inf`` after 1,164 successes at 5 requests/s), and ``2 ** (probing /
    5)`` raised ``OverflowError`` once a range had sent for 5,120 s without
    a throttled answer, failing requests S3 had answered 200.
    """
    clock = [0.0]

    async def sleep(seconds):
        clock[0] += seconds

    monkeypatch.setattr(throttle, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(throttle, "asyncio", types.SimpleNamespace(sleep=sleep))

    def request(rate, demand_gap):
        """One request ``demand_gap`` after the last, answered 200 (the fake sleep never suspends)."""
        clock[0] += demand_gap
        coroutine = rate.acquire()
        try:
            coroutine.send(None)
        except StopIteration as done:
            _, paced = done.value
        rate.succeeded(paced)

    week = 7 * 24 * 3600.0
    low = throttle.RequestRate(50.0)  # demand 0.25/s: never held back by its pace
    while clock[0] < week:
        request(low, 4.0)
    assert low.rate == 50.0

    high = throttle.RequestRate(0.2)  # demand 1/s: the pace is the limit until the rate passes the demand
    start = clock[0]
    while clock[0] < start + week:
        request(high, 1.0)
    # It stops growing once it passes the demand: the last paced successes may each double it (probing).
    assert 1.0 <= high.rate <= 4 * 1.0 and math.isfinite(high.rate)
    assert high.rate <= throttle.RequestRate.CEILING


def test_a_rate_nothing_calibrated_starts_low_doubles_while_paced_and_drops_to_what_was_admitted(monkeypatch):
    """Slow start, on a fake clock: a write range of a process that knows no share, and one that does.

    Alone, the writer doubles its rate once a second while paced; at its
    first throttled answer it drops to the rate that was admitted, and
    from then on cuts and grows as a calibrated rate does.  A job's share
    (``RateBook.share``) is a calibrated start: no slow start.
    """
    clock = [0.0]

    async def sleep(seconds):
        clock[0] += seconds

    monkeypatch.setattr(throttle, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(throttle, "asyncio", types.SimpleNamespace(sleep=sleep))
    monkeypatch.setattr(throttle.random, "uniform", lambda lo, hi: hi)  # the latest first slot

    def send(rate):
        """One request, sent as soon as its slot allows (the fake sleep advances the clock)."""
        return asyncio.run(rate.acquire())

    book = throttle.RateBook()
    alone = book.rate(("scope",), "root/w0", "write")
    assert not alone.calibrated and alone.rate == throttle.RequestRate.SLOW_START
    assert book.rate(("scope",), "root/w0", "read").rate is None  # reads: unpaced until throttled
    pointer = book.rate(("scope",), "root", "write")  # a range written rarely (one PUT a save)

    sent = []
    while alone.rate < 64:  # paced successes; the rate doubles once a second: 1, 2, 4, ... 64 requests/s
        at, paced = send(alone)
        assert paced
        sent.append(at)
        alone.succeeded(paced)
    # The documented ramp: 64 requests/s 6 s after the first send (at 1 s, the
    # latest phase), with each send at the rate of its moment, not in a slot
    # reserved at the start's rate (1, 2, 4, ... sends in successive seconds).
    assert sent[-1] - sent[0] == pytest.approx(5.0)
    assert len(sent) == 1 + 2 + 4 + 8 + 16 + 32
    at, _ = send(alone)
    alone.throttled(at)
    assert alone.calibrated
    admitted = sum(1 for t in sent if t > clock[0] - throttle.RequestRate.GOODPUT_WINDOW)
    assert alone.rate == pytest.approx(min(admitted / throttle.RequestRate.GOODPUT_WINDOW, 64.0 / 2))  # what was admitted
    calibrated = alone.rate
    at, paced = send(alone)
    alone.succeeded(paced)
    assert alone.rate == pytest.approx(calibrated * (1 + throttle.RequestRate.GROWTH), rel=0.01)  # no doubling

    # A new range of the same process starts at what was learned, calibrated,
    # whatever a rarely written range of it reached in slow start meanwhile.
    assert pointer.rate == throttle.RequestRate.SLOW_START and not pointer.calibrated
    step2 = book.rate(("scope",), "root/w0/step2", "write")
    assert step2.calibrated and step2.rate == alone.rate

    # While no range was throttled, a new one goes on from the highest rate slow start reached.
    ramping = throttle.RateBook()
    first = ramping.rate(("scope",), "root/step1", "write")
    first.rate = 32.0
    ramping.rate(("scope",), "root", "write")  # a rarely written range, at 1/s
    second = ramping.rate(("scope",), "root/step2", "write")
    assert second.rate == 32.0 and not second.calibrated

    # A pause does not count as time goodput was measured in: at 32/s, idle a
    # minute, then 4 successes in 1/8 s and a throttled answer.  Over a
    # window that took in the pause, 4 successes would be 2/s.
    clock[0] += 60.0
    for _ in range(4):
        first.succeeded(send(first)[1])
    at, _ = send(first)
    first.throttled(at)
    assert first.calibrated and first.rate >= 16.0

    # Throttled before any success (the partition was full when it began):
    # nothing measured, so it keeps most of its rate, and is calibrated.
    late = throttle.RateBook().rate(("scope",), "root/w1", "write")
    at, _ = send(late)
    late.throttled(at)
    assert late.calibrated and late.rate == pytest.approx(throttle.RequestRate.SLOW_START * throttle.RequestRate.UNMEASURED_CUT)

    job = throttle.RateBook()
    job.share(("scope",), "write", 3500 / 8)
    shared = job.rate(("scope",), "root/ckpt", "write")
    assert shared.calibrated and shared.rate == 3500 / 8
    early = throttle.RateBook()
    first = early.rate(("scope",), "root/ckpt", "write")  # made before the writer knew the world size
    early.share(("scope",), "write", 3500 / 8)
    assert first.calibrated and first.rate == 3500 / 8


def test_a_background_abort_is_not_bound_by_the_saves_spent_throttle_budget(bucket, s3, proxy, monkeypatch):
    """An abort that failed in the save goes on in the background, where a SlowDown is retried, not the end of a round.

    One background round (and ``settle_aborts``' one more try): three
    SlowDowns get through only if the round retries them.
    """
    from dcpstore.storage import s3 as s3_store
    from dcpstore.storage.throttle import ThrottleClock

    monkeypatch.setattr(s3_store, "ABORT_ROUNDS", 1)
    upload = s3.create_multipart_upload(Bucket=bucket, Key="late/shard")["UploadId"]
    store = _store(bucket, proxy, "late", retry=RetryPolicy(initial_backoff=0.01, max_backoff=0.05, throttle_budget=5.0))
    store.save_throttle = ThrottleClock(budget=0.0)  # the save that left it spent its whole budget
    slow_down = proxy.add("DELETE", r"/late/shard\?uploadId=", status=503, code="SlowDown", times=3)
    store.abort_later("shard", upload)
    store.settle_aborts()
    assert slow_down.hits == 3
    assert not s3.list_multipart_uploads(Bucket=bucket).get("Uploads")
    store.close()


def test_two_profiles_that_point_at_two_servers_are_paced_apart(bucket, proxy, tmp_path, monkeypatch, endpoint):
    """An endpoint set in an AWS profile is the server a store's rates are kept for, not one shared "aws"."""
    config = tmp_path / "config"
    config.write_text(
        "".join(
            f"[profile {name}]\nendpoint_url = {url}\naws_access_key_id = testing\naws_secret_access_key = testing\n\n"
            for name, url in (("via-proxy", proxy.endpoint), ("direct", endpoint))
        )
    )
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    via_proxy = open_store(f"s3://{bucket}/p", {"profile": "via-proxy"}, TransferConfig())
    direct = open_store(f"s3://{bucket}/p", {"profile": "direct"}, TransferConfig())
    assert via_proxy.rate_scope == (proxy.endpoint, bucket) and direct.rate_scope == (endpoint, bucket)
    via_proxy.put("obj", b"x")  # and the client does send there
    assert any(method == "PUT" and path.split("?")[0].endswith(f"/{bucket}/p/obj") for method, path in proxy.requests)
    via_proxy.close()
    direct.close()
