"""Client-side request rates: S3 throttling is a signal to slow down, not a failure.

S3 admits about 3,500 writes/s and 5,500 reads/s per partition of a
bucket's key space, answers the excess with 503 SlowDown, and splits a
partition only after its load has lasted a while.  A save of thousands of
ranks into a fresh prefix is therefore throttled for as long as it lasts,
and a client that merely retries each request (with backoff) sends most of
its requests twice or more and still gives up.

So every S3 request first takes a send slot from the ``RequestRate`` of its
key range: reads and writes apart, shared by every store and thread of the
process.  A throttled answer cuts the rate by ``BETA`` (once per round of
requests: answers to requests sent before the cut do not cut again), every
success of a request that waited for its slot raises it by ``GROWTH`` of
itself, more the longer the range has gone unthrottled, as TCP's congestion
control probes for capacity; a success that went out unpaced says nothing
about the capacity, and the rate stays finite (``RequestRate.succeeded``).
botocore's adaptive retry mode does the same per client with a cubic curve,
but it paces a whole client (every bucket and key range alike) and only
inside botocore's retry handler, which dcpstore turns off to keep one retry
policy (see ``s3_requests.client_config``).

A key range here is a key's parent "folder" in its bucket: the objects of
one checkpoint share one, and ``ObjectStoreWriter(key_spread=...)`` gives
each hashed sub-prefix its own, so a cut for one hot partition does not slow
the others.  S3's partitions are ranges of keys, not folders, but a client
cannot see where they split; a folder is the finest unit whose objects S3 is
likely to serve from one partition.  A range first used after another one
of its bucket was throttled starts at the rate learned there (the lowest,
if several were): a new step of a job does not learn the throttling again.
One first used while the process's other ranges of the bucket are still
in slow start goes on from the highest rate they reached.  What is
learned expires after ``TTL`` seconds unused.

A job-wide start (``RateBook.share``): per-process adaptation alone lets W
ranks send ``W x max_concurrency`` requests in the first second (about
65,000 at 4,096 ranks) into a partition that admits 3,500.  A writer that
knows the job's world size starts each rank at its share of what one key
range admits (``TransferConfig.prefix_write_rate / W``), then adapts.  A
writer that does not (no process group, or a job of one: other jobs,
evaluation or export processes may write the same range) has nothing to
calibrate its rate by, and slow-starts it (``RequestRate.SLOW_START``):
1 request/s, doubling once a second while the pace holds requests back,
down to the admitted rate at the first throttled answer.
"""

from __future__ import annotations

import asyncio
import collections
import math
import random
import threading
import time

TTL = 600.0  # seconds a key range's learned rate is kept unused


class RequestRate:
    """The pace of one key range's reads or writes in this process (multiplicative cut and growth)."""

    # A throttled answer multiplies the rate by BETA, each success by
    # 1 + GROWTH.  A gentle cut with slow regrowth, not TCP's halving: at a
    # fair share of a few requests/s, a rank hears only a handful of answers
    # per second, and which ranks' requests meet a full bucket is chance.  A
    # deep cut leaves those unlucky ranks far below their share for the rest
    # of the save (18 successes to undo a 0.7 cut), and the save then ends
    # with a tail of slow ranks while the partition idles.  The pair sets the
    # throttled fraction the rates settle at: GROWTH / (GROWTH + ln(1/BETA)),
    # about 5 %.  A pacer hears back about once per 1/rate seconds, so between
    # two answers it overshoots by GROWTH whatever its rate: W ranks at L/W
    # each grow the job's rate by GROWTH x L/W per second (at 4,096 ranks on
    # one partition, 0.5 %/s).
    BETA = 0.9
    GROWTH = 0.006
    # Growth per success doubles with every PROBE_DOUBLING seconds of sending
    # without a throttled answer (up to doubling the rate per success), as
    # TCP CUBIC probes: a range that stays unthrottled (S3 split its
    # partition, or the other writers finished) is found out within seconds,
    # while ranks that are throttled every few seconds, as at a fair share
    # under load, never get past a few percent per success.
    PROBE_DOUBLING = 5.0
    MAX_DOUBLINGS = 8  # 2**8 x GROWTH > 1: growth per success is already at its cap of doubling there
    FLOOR = 0.2  # requests/s a cut never goes below (unless the range started lower)
    # Far above what one process sends to one key range (S3 admits 3,500
    # writes/s and 5,500 reads/s a partition); only keeps the rate finite.
    CEILING = 100_000.0
    # Slow start, for a rate nothing calibrated (a writer that does not know
    # who else writes the range: no process group, or a job of one).  Its
    # share could be all of the range's 3,500 writes/s or a hundredth of it.
    # It starts at SLOW_START requests/s and doubles at most once per
    # SLOW_START_PERIOD, on a success that waited for its slot (TCP doubles
    # once per round trip), so a writer alone reaches 64 requests/s in 6 s
    # and 1,024 in 10 s, while 8 such writers started together offer 8
    # requests/s, not 8 x 3,500, to a partition that may admit 4.  Doubling
    # by the clock, not per success, keeps them in step: the first ones
    # served do not race ahead of the rest.  The first throttled answer ends
    # it: the rate drops to what was admitted (successes per second since
    # the range began, over at most GOODPUT_WINDOW seconds, and at most
    # half the rate), and is calibrated from then on.  A writer throttled
    # before any success (it began when the partition was full) measured
    # nothing: it keeps UNMEASURED_CUT of its rate.  Halving it would make
    # it a loser for good, since cuts and growth are both multiplicative
    # and keep the ratio between two writers' rates: in the benchmark's
    # independent mode that left a tail at 0.4 of a fair share while the
    # partition idled (achieved/allowed 0.5-0.6 instead of 0.7-0.8).
    SLOW_START = 1.0
    SLOW_START_PERIOD = 1.0
    GOODPUT_WINDOW = 2.0
    UNMEASURED_CUT = 0.7
    # While slow start may double the rate between two sends, a waiter
    # looks at it again at least this often instead of reserving a slot at
    # the old rate.
    SLOW_START_NAP = 0.05

    def __init__(self, rate: float | None, *, calibrated: bool = True):
        self._lock = threading.Lock()
        self.rate = rate  # requests/s; None: not paced (reads not throttled yet)
        self._base = rate
        self.calibrated = calibrated or rate is None  # False: slow start (see SLOW_START)
        self._next_slot = self._first_slot(rate)
        self._last_cut = -math.inf
        self._probing = 0.0  # seconds of sending since the last throttled answer
        self._recent: collections.deque[float] = collections.deque(maxlen=8192)  # send times while unpaced
        # Success times in slow start: enough for GOODPUT_WINDOW at S3's 3,500 writes/s a partition.
        self._admitted: collections.deque[float] = collections.deque(maxlen=8192)
        self._began = time.monotonic()  # since when it has been sending without a pause (goodput's window)
        self._last_send = -math.inf
        self._grown = -math.inf
        self.last_used = self._began

    @staticmethod
    def _first_slot(rate: float | None) -> float:
        """A random phase within the first interval: W ranks started at once do not all send at once."""
        return time.monotonic() + random.uniform(0, 1.0 / rate) if rate else 0.0

    def start_at(self, rate: float) -> None:
        """Start at ``rate``, as known, not measured (``RateBook.share``): no slow start."""
        with self._lock:
            self.rate = self._base = rate
            self.calibrated = True
            self._next_slot = self._first_slot(rate)

    async def acquire(self) -> tuple[float, bool]:
        """Wait for this range's next send slot; returns the send time (for ``throttled``) and whether the pace held it back (for ``succeeded``).

        A calibrated rate reserves the next slot at once (first come, first
        served).  In slow start a waiter takes a slot only when it is due at
        the rate of that moment, since the rate may double meanwhile.
        """
        paced = False
        with self._lock:
            now = time.monotonic()
            # Idle time does not count as probing (a rate learned in one save
            # starts the next where it was, not at a doubling per success), nor
            # as time in which goodput was measured.
            pause = 1.0 + (1.0 / self.rate if self.rate else 0.0)
            if now - self.last_used > pause:
                self._began = now
            self._probing += min(now - self.last_used, pause)
            self.last_used = now
            if self.rate is None:
                self._recent.append(now)
                return now, False
        while True:
            with self._lock:
                now = time.monotonic()
                slot = max(now, self._next_slot)
                if self.calibrated or slot == now:
                    self._next_slot = slot + 1.0 / self.rate
                    self._last_send = slot
                    break
                nap = min(slot - now, self.SLOW_START_NAP)
            paced = True
            await asyncio.sleep(nap)
        if slot > now:
            await asyncio.sleep(slot - now)
        return slot, paced or slot > now

    def succeeded(self, paced: bool) -> None:
        """A request was answered; ``paced``: it had waited for its slot.

        Only such a success says the rate, not the demand, was the limit, so
        only it raises the rate: a range whose requests go out unpaced keeps
        the rate it has, however many succeed (before, 1,164 successes at
        5 requests/s took a rate to ``inf``).  The rate stays below
        ``CEILING``, and the probing exponent below ``MAX_DOUBLINGS``: nothing
        here overflows, however long a job runs.
        """
        with self._lock:
            if not self.calibrated:
                self._admitted.append(time.monotonic())
            if self.rate is not None and paced:
                if self.calibrated:
                    doublings = min(self._probing / self.PROBE_DOUBLING, self.MAX_DOUBLINGS)
                    growth = min(1.0, self.GROWTH * 2**doublings)
                    self.rate = min(self.CEILING, self.rate * (1 + growth))
                elif time.monotonic() >= self._grown + self.SLOW_START_PERIOD:
                    # slow start: double, and the next send is due at the new rate
                    self._grown = time.monotonic()
                    self.rate = min(self.CEILING, self.rate * 2)
                    self._next_slot = min(self._next_slot, self._last_send + 1.0 / self.rate)

    def throttled(self, sent_at: float) -> None:
        """A request sent at ``sent_at`` was throttled: cut the rate, once per round."""
        with self._lock:
            if sent_at < self._last_cut:
                return  # sent before the last cut: that cut already answered this congestion
            now = time.monotonic()
            if self.rate is None:
                # Unpaced until now: start from what was sent in the last second.
                sent = sum(1 for t in self._recent if t > now - 1.0)
                self._recent.clear()
                self.rate = self._base = max(1.0, float(sent))
            if not self.calibrated:
                self.rate = self._base = self._goodput(now)
                self.calibrated = True
            else:
                self.rate = max(min(self.FLOOR, self._base), self.rate * self.BETA)
            self._last_cut = now
            self._probing = 0.0
            self._next_slot = max(self._next_slot, now + 1.0 / self.rate)

    def _goodput(self, now: float) -> float:
        """The rate slow start ends at: successes per second, over the last GOODPUT_WINDOW seconds of sending (not of a pause).

        Not more than half the rate it was throttled at (the rate before
        its last doubling); UNMEASURED_CUT of it where nothing got through
        yet; not below FLOOR.
        """
        window = max(min(self.GOODPUT_WINDOW, now - self._began), 1.0 / self.rate)
        admitted = sum(1 for t in self._admitted if t > now - window)
        self._admitted.clear()
        return max(self.FLOOR, min(self.rate / 2, admitted / window) if admitted else self.rate * self.UNMEASURED_CUT)


class ThrottleClock:
    """How long one save has been throttled: the time during which at least one of its requests was held by throttling.

    A request is held from a throttled answer until its retry is sent.  A
    save's budget for throttling (``RetryPolicy.throttle_budget``) runs on
    this clock, not on the wall clock from the start of its upload: an
    upload that simply takes long (large shards, a shared link) has used
    none of it.  Concurrent throttled requests count once (a union of
    intervals, not a sum): a save of 64 parts throttled together for a
    second has been throttled for a second.
    """

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self._lock = threading.Lock()
        self._held = 0  # requests of the save now waiting on a throttled answer
        self._since = 0.0  # when _held last rose from 0
        self._spent = 0.0  # throttled seconds before that

    def hold(self) -> None:
        """A request of the save was throttled: the clock runs (if it was not already) until it is released."""
        with self._lock:
            if self._held == 0:
                self._since = time.monotonic()
            self._held += 1

    def release(self) -> None:
        """That request is done: answered, or given up."""
        with self._lock:
            self._held -= 1
            if self._held == 0:
                self._spent += time.monotonic() - self._since

    def spent(self) -> float:
        with self._lock:
            return self._spent + (time.monotonic() - self._since if self._held else 0.0)

    def exhausted(self) -> bool:
        return self.spent() >= self.budget


class RateBook:
    """The process's request rates, by (connection scope, key range, read or write)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rates: dict[tuple, RequestRate] = {}
        self._starts: dict[tuple, float] = {}  # (scope, kind) -> rate a new range starts at

    def rate(self, scope: tuple, key_range: str, kind: str) -> RequestRate:
        with self._lock:
            now = time.monotonic()
            rate = self._rates.get((scope, key_range, kind))
            if rate is not None and now - rate.last_used < TTL:
                return rate
            self._expire(now)
            mine = [r for (s, _, k), r in self._rates.items() if s == scope and k == kind and r.rate is not None]
            known = [r.rate for r in mine if r.calibrated] + [x for x in [self._starts.get((scope, kind))] if x is not None]
            ramped = [r.rate for r in mine if not r.calibrated]
            if known:  # a share, or a rate throttling calibrated: the lowest
                rate = RequestRate(min(known))
            elif ramped:  # slow start goes on where it got to (no range of it was ever throttled)
                rate = RequestRate(max(ramped), calibrated=False)
            elif kind == "write":  # nothing known: slow start
                rate = RequestRate(RequestRate.SLOW_START, calibrated=False)
            else:  # reads go unpaced until throttled
                rate = RequestRate(None)
            self._rates[(scope, key_range, kind)] = rate
            return rate

    def share(self, scope: tuple, kind: str, rate: float) -> None:
        """Start ranges of ``scope`` (new ones, and those not calibrated yet) at ``rate`` requests/s, the job's share."""
        with self._lock:
            self._starts[(scope, kind)] = rate
            for (s, _, k), r in self._rates.items():
                if s == scope and k == kind and (r.rate is None or not r.calibrated):
                    r.start_at(rate)

    def _expire(self, now: float) -> None:
        for key in [k for k, r in self._rates.items() if now - r.last_used >= TTL]:
            del self._rates[key]


RATES = RateBook()


def key_range(path: str) -> str:
    """The key range a bucket-relative ``path`` is paced in: its parent folder."""
    return path.rpartition("/")[0]
