"""How objects move: part size, concurrency, timeouts, and the retry policy."""

from __future__ import annotations

import dataclasses
import random

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with full-jitter exponential backoff; throttling bounded by time.

    Attempt ``n`` (0-based) that fails with a retryable error sleeps
    ``uniform(0, min(max_backoff, initial_backoff * 2**n))`` before the next,
    the scheme AWS recommends so that many ranks failing at once do not
    retry in lockstep; ``max_attempts`` bounds these.

    Throttling (503 SlowDown, 429) is different: S3 throttles a key range
    for as long as the load on it lasts, so a throttled request is not a
    failed one.  It slows the key range's request rate (``throttle``) and
    keeps trying for up to ``throttle_budget`` seconds from its first
    throttled answer, and within one save while the save has been throttled
    for less than ``throttle_budget`` in all (one budget for the save's
    shards and its ``.metadata``, not one per request; time spent uploading
    unthrottled does not count, see ``throttle.ThrottleClock``); only then
    does it raise ``ThrottledError``, naming the object and how long it was
    throttled.
    """

    max_attempts: int = 5
    initial_backoff: float = 0.1
    max_backoff: float = 5.0
    throttle_budget: float = 300.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.throttle_budget < 0:
            raise ValueError(f"throttle_budget must be >= 0, got {self.throttle_budget}")

    def backoff(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_backoff, self.initial_backoff * 2**attempt))


@dataclasses.dataclass(frozen=True)
class TransferConfig:
    """How objects move.  Defaults follow AWS guidance (8-16 MiB parts).

    An object streamed to storage (a shard) that is larger than one part is
    uploaded in parts, and one in memory when it is larger than
    ``multipart_threshold``; smaller ones go up as one PUT.  Host memory used by uploads is bounded by
    ``(max_concurrency + number of open writers) * part_size``: part buffers
    are allocated on first use, reused by every store over the same
    connection, and freed when the last of those stores is closed.
    """

    part_size: int = 16 * MiB
    # An in-memory object larger than this (a .metadata of thousands of
    # ranks, the resume index) goes up as a multipart upload of part_size
    # parts, completed under the same condition a PUT would carry: never
    # one huge PUT, and nothing shows until every part is in.
    multipart_threshold: int = 64 * MiB
    max_concurrency: int = 16
    connect_timeout: float = 10.0
    read_timeout: float = 120.0
    # A request that sends a body gets connect_timeout + read_timeout +
    # body size / min_send_rate (bytes/s) in all, then counts as timed out
    # and is retried: the socket timeouts cover connecting and reading, not
    # a server that stops reading the body (found on a full Ceph OSD).
    min_send_rate: float = 1 * MiB
    retry: RetryPolicy = RetryPolicy()
    # Writes/s that one fresh S3 key range admits (S3: about 3,500).  A
    # writer that knows the job's world size W (W > 1) starts each rank at
    # prefix_write_rate / W, then adapts (see ``throttle``).  Without that
    # start (None here, or a writer alone: no process group, or a job of
    # one), a write range slow-starts.
    prefix_write_rate: float | None = 3500.0

    def __post_init__(self) -> None:
        if self.part_size < 5 * MiB:
            raise ValueError("part_size must be at least 5 MiB (the S3 minimum part size)")
        if self.multipart_threshold < 1:
            raise ValueError("multipart_threshold must be >= 1")
        if self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if self.min_send_rate <= 0:
            raise ValueError("min_send_rate must be > 0")
        if self.prefix_write_rate is not None and self.prefix_write_rate <= 0:
            raise ValueError("prefix_write_rate must be > 0 or None")
