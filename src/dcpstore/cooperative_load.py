"""Read once, restore everywhere: a stored byte range that several ranks load leaves the bucket once per load.

Under DDP every rank loads the same tensors, under HSDP every replica group
does; read each rank's share from the bucket and the job reads the
checkpoint R times over (R replicas), at R times the request rate on one
cold prefix, while the links between the ranks sit idle.  Here each stored
item (an object's byte range: key, offset, length) that several ranks need
is read by one of them, its owner, checked there, and sent to the others.

**Who reads what** (``plan``, on the coordinator, inside the planning
gather ``dcp.load`` already does).  Each rank names the stored items its
local plan reads (``Wanted``, attached to its ``LoadPlan`` by
``ObjectStoreReader.prepare_local_plan``).  The coordinator gives every item
that several ranks need one owner among them, balanced by bytes: items only
one rank needs count first, then the shared ones, largest first, each to
the needer with the fewest bytes to read so far.  It packs the shared items
into rounds, each rank holding at most ``round_bytes`` of them in a round
(an item larger than that takes a round of its own), and hands each rank its
part (``Assignment``), which names items by their place in that rank's own
``Wanted``: O(its items), never the world's.  The planning is linear in the
read items the gather brought, the same order as DCP's own global planning.

**A round, on every rank** (``Exchange``).  The owner fetches its items of
the round into the load's host ring (``load_buffers``) and checks their
crc32 there (the reader's ``fetch``); one all-reduce of one int64 says
whether every rank's fetch succeeded; only then does each owner send its
items, in chunks of at most ``chunk_bytes``, point to point to the ranks
that need them, while the next round's reads are already in flight.  What
travels, and where it lands, is the reader's (``SharedItems``): a tensor's
values, straight into a destination that can take them as they are, else
into the receiver's ring.  A receiver delivers without a crc32 pass of its
own: the owner's verdict stands, and a second pass would cost every rank
the same CPU again.  Memory: two rounds, the one sent and the one read.

**Transport.**  The items travel over the group the reader is given: a
gloo group as host memory, an NCCL group through the current CUDA device
(``_DeviceLink``), where a CUDA destination takes its values in place.
``AsyncCheckpointer.load`` gives the training group where the
destinations are on a GPU and it is NCCL, else its own gloo group.

**Failures.**  A fetch that fails at its owner (a missing object, a crc32
that fails twice) fails the round's all-reduce on every rank before any of
that round's bytes move: each rank raises, naming the owner and its error
(gathered as objects, on the failure path only), and no destination of the
round is touched.  A peer that dies or hangs breaks a point-to-point
operation or the next all-reduce within the group's timeout; the rank
raises ``PeerLoadError`` naming the peer and the item it was exchanging.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlan

from .errors import DcpstoreError
from .load_buffers import LoadBuffers, Region

logger = logging.getLogger(__name__)

#: A stored item: object key, offset, length, then its storage index (key and offset).  Two ranks that
#: name the same one need the same bytes; only the length (``[2]``) means anything to the plan.
StoredItem = tuple

#: The largest point-to-point message; an item larger than this is sent in several.
CHUNK_BYTES = 32 << 20

#: gloo's tags are C ints: a load's chunks are numbered modulo this.
_TAG_SPACE = 1 << 30


class PeerLoadError(DcpstoreError, RuntimeError):
    """A cooperative load failed on another rank, or lost its link to one; the message names the rank and the item."""


@dataclasses.dataclass(frozen=True)
class Wanted:
    """The stored items a rank's load plan reads, each once, in the order the rank keeps them."""

    items: tuple[StoredItem, ...]


@dataclasses.dataclass
class Part:
    """One rank's part of a round: the items it sends and those it receives, by their place in its ``Wanted``.

    ``sends``: ``(item, receivers, tag)``; ``receives``: ``(item, owner, tag)``.
    Ranks are the group's; ``tag`` numbers the item's first chunk.
    """

    sends: list[tuple[int, tuple[int, ...], int]] = dataclasses.field(default_factory=list)
    receives: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)

    def items(self) -> list[int]:
        return [i for i, _, _ in self.sends] + [i for i, _, _ in self.receives]


@dataclasses.dataclass
class Assignment:
    """What the coordinator hands one rank (in its ``LoadPlan.storage_data``).

    ``rounds``: how many rounds the job's load takes; every rank takes part
    in each one's all-reduce.  ``parts``: this rank's part of the rounds it
    sends or receives in.  An item of ``Wanted`` in no part is read by this
    rank alone, as any load reads.
    """

    rounds: int
    parts: dict[int, Part]
    chunk_bytes: int

    def shared(self) -> set[int]:
        return {i for part in self.parts.values() for i in part.items()}


def plan(plans: list[LoadPlan], *, round_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> list[LoadPlan]:
    """On the coordinator: each rank's plan with its ``Assignment`` in ``storage_data``; see the module docstring.

    When no stored item is needed by two ranks, or a rank did not name its
    items (it opted out), every plan comes back with ``storage_data=None``
    and every rank reads as it would alone.
    """
    wanted = [p.storage_data for p in plans]
    if len(plans) < 2 or not all(isinstance(w, Wanted) for w in wanted):
        return [dataclasses.replace(p, storage_data=None) for p in plans]
    needers: dict[StoredItem, list[tuple[int, int]]] = {}  # item -> (rank, its place in that rank's Wanted)
    for rank, w in enumerate(wanted):
        for place, item in enumerate(w.items):
            needers.setdefault(item, []).append((rank, place))
    load = [0] * len(plans)  # bytes each rank reads from the bucket
    shared = []
    for item, who in needers.items():
        if len(who) == 1:
            load[who[0][0]] += item[2]
        else:
            shared.append(item)
    if not shared:
        return [dataclasses.replace(p, storage_data=None) for p in plans]
    owner: dict[StoredItem, int] = {}
    for item in sorted(shared, key=lambda it: (-it[2], it)):
        rank = min((r for r, _ in needers[item]), key=lambda r: (load[r], r))
        owner[item] = rank
        load[rank] += item[2]

    rounds = _Rounds(len(plans), round_bytes)
    parts: list[dict[int, Part]] = [{} for _ in plans]
    tag = 0
    for item in sorted(shared):  # by object and offset: an owner's items of a round coalesce
        who = needers[item]
        source = owner[item]
        receivers = tuple(rank for rank, _ in who if rank != source)
        # The owner's share of a round counts every copy it sends, so that a
        # round's sending is spread over many owners, not left to a few.
        r = rounds.place({rank: item[2] * (len(receivers) if rank == source else 1) for rank, _ in who})
        for rank, place in who:
            part = parts[rank].setdefault(r, Part())
            if rank == source:
                part.sends.append((place, receivers, tag))
            else:
                part.receives.append((place, source, tag))
        tag = (tag + max(1, -(-item[2] // chunk_bytes))) % _TAG_SPACE
    return [dataclasses.replace(p, storage_data=Assignment(rounds.count, parts[rank], chunk_bytes)) for rank, p in enumerate(plans)]


class _Rounds:
    """Packs items into rounds: each in the earliest round where every rank it involves has room left.

    A rank's room in a round is ``budget`` bytes; an item that does not fit
    an empty round takes one alone.  Items of different replica groups
    share rounds (an item that every rank needs does not hold the others
    back), and a rank's rounds fill from the first, so the job takes about
    as many rounds as its busiest rank needs.
    """

    def __init__(self, ranks: int, budget: int):
        self.budget = budget
        self.used: list[list[int]] = [[] for _ in range(ranks)]  # each rank's bytes in each round
        self.lowest = [0] * ranks  # each rank's first round with room left
        self.count = 0

    def place(self, shares: dict[int, int]) -> int:
        """The round the item goes in, ``shares`` being each involved rank's bytes of it; booked."""
        r = max(self.lowest[rank] for rank in shares)
        while True:  # each rank's first round from r with room for its share, until they agree
            later = max(self._first_fit(rank, r, n) for rank, n in shares.items())
            if later == r:
                break
            r = later
        for rank, n in shares.items():
            used = self.used[rank]
            used.extend([0] * (r + 1 - len(used)))
            used[r] += n
            while self.lowest[rank] < len(used) and used[self.lowest[rank]] >= self.budget:
                self.lowest[rank] += 1
        self.count = max(self.count, r + 1)
        return r

    def _first_fit(self, rank: int, r: int, n: int) -> int:
        """The first round from ``r`` where ``rank`` has room for ``n`` more bytes (an empty round always has)."""
        used = self.used[rank]
        while r < len(used) and used[r] and used[r] + n > self.budget:
            r += 1
        return r


def travels_on_device(group: dist.ProcessGroup | None) -> bool:
    """Whether items sent over ``group`` travel through the current CUDA device (NCCL), not as host memory (gloo)."""
    return "nccl" in dist.get_backend(group)  # "nccl", or NCCL for CUDA beside gloo for CPU


class _HostLink:
    """gloo: items travel as host memory, each send and receive posted on its own."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group

    def flag(self, value: int) -> torch.Tensor:
        return torch.tensor([value], dtype=torch.int64)

    def outgoing(self, payload: torch.Tensor) -> torch.Tensor:
        return payload

    def incoming(self, landing: torch.Tensor) -> torch.Tensor:
        return landing

    def arrived(self, landing: torch.Tensor, incoming: torch.Tensor) -> None:
        pass

    def post(self, ops: list[tuple[Callable, torch.Tensor, int, int]]) -> list:
        """Each operation's work, or the error posting it raised (a peer already gone): the others are posted all the same."""
        works: list = []
        for op, data, peer, tag in ops:
            try:
                works.append(op(data, peer, group=self.group, tag=tag))
            except Exception as e:  # noqa: BLE001 - reported with the peer and the item by the caller
                works.append(e)
        return works

    def settle(self) -> None:
        """Return once the round's bytes are where they belong and the memory they came from may be reused."""


class _DeviceLink(_HostLink):
    """NCCL: items travel through the current CUDA device.

    An owner's bytes are copied to the device once per round (whatever the
    number of receivers); a receiver's land straight in a CUDA destination,
    or in device memory and then in the host memory it asked for.  The
    round's operations go as one NCCL group (``batch_isend_irecv``), in
    the same order on both sides of each pair, as NCCL matches them.
    Device memory: the round's bytes, within half the read-ahead window.
    """

    def __init__(self, group: dist.ProcessGroup | None):
        super().__init__(group)
        self.device = torch.device("cuda", torch.cuda.current_device())

    def flag(self, value: int) -> torch.Tensor:
        return torch.tensor([value], dtype=torch.int64, device=self.device)

    def outgoing(self, payload: torch.Tensor) -> torch.Tensor:
        return payload if payload.is_cuda else payload.to(self.device)

    def incoming(self, landing: torch.Tensor) -> torch.Tensor:
        return landing if landing.is_cuda else torch.empty(len(landing), dtype=torch.uint8, device=self.device)

    def arrived(self, landing: torch.Tensor, incoming: torch.Tensor) -> None:
        if incoming is not landing:
            landing.copy_(incoming)  # to host: waits for the transfer, on the stream NCCL's work made wait

    def post(self, ops: list[tuple[Callable, torch.Tensor, int, int]]) -> list:
        """The works of one NCCL group: one for all (then ``None`` for the rest), or one each."""
        if not ops:
            return []
        works = dist.batch_isend_irecv([dist.P2POp(op, data, peer, self.group, tag) for op, data, peer, tag in ops])
        return works if len(works) == len(ops) else works + [None] * (len(ops) - len(works))

    def settle(self) -> None:
        # work.wait() only makes the current stream wait: device memory of the round goes back after this.
        torch.cuda.current_stream(self.device).synchronize()


class Fetch(Protocol):
    """The GETs of the items a rank owns in a round, begun into the ring's buffers."""

    def wait(self) -> None:
        """Return once every item is in, checked and ready to send; raise if one could not be read or failed its check."""
        ...

    def cancel(self) -> None: ...


class SharedItems(Protocol):
    """The reader's side of a cooperative load: where each item lands, how it is fetched, sent and delivered."""

    def prepare(self, items: list[int], owned: set[int]) -> tuple[list[int], torch.device | None]:
        """Resolve the items' destinations: the ring bytes each needs here (0: it is received in place), and their CUDA device if any."""
        ...

    def fetch(self, owned: list[tuple[int, memoryview]]) -> Fetch:
        """Begin the GETs of these owned items into these ring buffers."""
        ...

    def payload(self, item: int) -> torch.Tensor:
        """An owned item's bytes to send (uint8), once its fetch is checked."""
        ...

    def landing(self, item: int, view: memoryview | None) -> torch.Tensor:
        """Where a received item's bytes go (uint8): its destination's memory, or ``view`` of the ring."""
        ...

    def deliver(self, item: int, region: Region | None) -> None:
        """Hand the item to the planner, its bytes all here (``region``: its ring memory)."""
        ...


@dataclasses.dataclass
class _Round:
    index: int
    part: Part
    region: Region | None
    views: dict[int, memoryview | None]
    fetch: Fetch | None
    arrivals: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)  # (landing, what the link receives into)


class Exchange:
    """One rank's rounds of a cooperative load (see the module docstring).

    Args:
        assignment: this rank's ``Assignment``.
        group: the group the items travel over, its members in the order
            of the group ``dcp.load`` runs on: that group itself (gloo, the
            items as host memory), or the training group (NCCL, through
            the current CUDA device; ``travels_on_device``).
        describe: names an item (its object and key) for error messages.
    """

    def __init__(self, assignment: Assignment, group: dist.ProcessGroup | None, describe: Callable[[int], str]):
        self.assignment = assignment
        self.group = group
        self.rank = dist.get_rank(group)
        self.ranks = dist.get_process_group_ranks(group or dist.group.WORLD)  # group rank -> global rank
        self.describe = describe
        self.link = _DeviceLink(group) if travels_on_device(group) else _HostLink(group)

    def run(self, buffers: LoadBuffers, items: SharedItems) -> None:
        """Every round in turn, the next one's reads in flight meanwhile: fetch, agree, send and receive, deliver.

        Nothing of a round is sent before the all-reduce that says every
        rank is ready for it: its owners' fetches checked, every rank's
        memory and destinations prepared, the last round delivered.  So a
        received item can land straight in its destination, a round in which
        anything failed touches no destination on any rank, and no rank
        that failed leaves the others waiting for it.  One more all-reduce
        after the last round reports the last delivery.
        """
        rounds = self.assignment.rounds
        nxt: _Round | None = None
        later: BaseException | None = None  # a failure to report at the next agreement
        try:
            for r in range(rounds):
                failure, later = later, None
                now = ops = None
                try:
                    if failure is None:
                        now = nxt if nxt is not None else self._begin(r, buffers, items)
                        nxt = None
                        if r + 1 < rounds:
                            try:
                                nxt = self._begin(r + 1, buffers, items, wait_for_room=False)
                            except Exception as e:  # noqa: BLE001 - round r + 1's, reported with it
                                later = e
                        if now.fetch is not None:
                            now.fetch.wait()
                        ops = self._operations(now, items)
                except Exception as e:  # noqa: BLE001 - every rank must hear of it in the all-reduce below
                    failure = e
                self._agree(r, failure)
                self._transfer(now, ops)
                try:
                    for item in now.views:
                        items.deliver(item, now.region)
                except Exception as e:  # noqa: BLE001
                    later = later or e
                if now.region is not None:
                    now.region.delivered = True
            self._agree(rounds, later)
        except BaseException:
            if nxt is not None and nxt.fetch is not None:
                nxt.fetch.cancel()
            raise

    def _begin(self, r: int, buffers: LoadBuffers, items: SharedItems, wait_for_room: bool = True) -> _Round | None:
        """Round ``r``'s memory and the GETs of what this rank owns in it; ``None`` if the ring has no room yet."""
        part = self.assignment.parts.get(r, Part())
        mine = part.items()
        owned = {i for i, _, _ in part.sends}
        views: dict[int, memoryview | None] = dict.fromkeys(mine)
        region = None
        if mine:
            sizes, device = items.prepare(mine, owned)
            buffered = [(i, n) for i, n in zip(mine, sizes) if n]
            region = buffers.reserve([n for _, n in buffered], device)
            if region is None:
                if not wait_for_room:
                    return None
                raise AssertionError("the load's ring holds an undelivered round")  # run delivers each round before it begins one
            views.update((i, view) for (i, _), view in zip(buffered, region.buffers))
        fetch = items.fetch([(i, views[i]) for i, _, _ in part.sends]) if owned else None
        return _Round(r, part, region, views, fetch)

    def _agree(self, r: int, failure: BaseException | None) -> None:
        """Raise on every rank if any rank failed on its way to round ``r`` (or, ``r`` = rounds, in the last delivery)."""
        flag = self.link.flag(int(failure is not None))
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        except Exception as e:  # noqa: BLE001 - gloo's error names an address, not a rank
            raise PeerLoadError(
                f"rank {self.rank}: round {r} of the cooperative load could not agree with its peers "
                f"(a rank died, hung or lost its link): {e}"
            ) from failure or e
        if not flag.item():
            return
        reports: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(reports, None if failure is None else f"{type(failure).__name__}: {failure}", group=self.group)
        if failure is not None:
            raise failure
        rank, report = next((n, m) for n, m in enumerate(reports) if m is not None)
        raise PeerLoadError(f"rank {self.rank}: rank {rank} failed in round {r} of the cooperative load, which this rank takes part in: {report}")

    def _operations(self, now: _Round, items: SharedItems) -> list[tuple[Callable, torch.Tensor, int, int, int, str]]:
        """The round's transfers, in chunks, ready to post: ``(isend or irecv, bytes, peer, tag, item, verb)``.

        Everything that may fail before bytes move (where each item lands,
        what each sends, device memory over NCCL) is done here, before the
        round's agreement.
        """
        chunk = self.assignment.chunk_bytes
        ops: list = []

        def add(op, wire: torch.Tensor, peers: Sequence[int], tag: int, item: int, verb: str) -> None:
            for c, start in enumerate(range(0, len(wire), chunk)):
                ops.extend((op, wire[start : start + chunk], peer, (tag + c) % _TAG_SPACE, item, verb) for peer in peers)

        now.arrivals = []
        for item, owner, tag in now.part.receives:
            landing = items.landing(item, now.views[item])
            wire = self.link.incoming(landing)
            now.arrivals.append((landing, wire))
            add(dist.irecv, wire, (owner,), tag, item, "receiving")
        for item, receivers, tag in now.part.sends:
            add(dist.isend, self.link.outgoing(items.payload(item)), receivers, tag, item, "sending")
        return ops

    def _transfer(self, now: _Round, ops: list) -> None:
        """Post every operation of the round, then wait for them all.

        A peer that is lost does not stop the others' transfers: every
        operation with a live peer is still posted and waited for, so that
        the live peers finish the round and name the lost rank themselves,
        rather than this one once it gives up on them.
        """
        lost: dict[int, tuple[int, str, BaseException]] = {}  # peer -> the first item it failed, and how
        try:
            works = self.link.post([(op, wire, self.ranks[peer], tag) for op, wire, peer, tag, _, _ in ops])
        except Exception as e:  # noqa: BLE001 - one NCCL group: none of it was posted
            works = [e] * len(ops)
        for work, (_, _, peer, _, item, verb) in zip(works, ops):
            try:
                if isinstance(work, BaseException):
                    raise work
                if work is not None:
                    work.wait()
            except Exception as e:  # noqa: BLE001
                lost.setdefault(peer, (item, verb, e))
        if lost:
            message = f"rank {self.rank}: lost " + "; ".join(
                f"rank {peer} while {verb} {self.describe(item)}" for peer, (item, verb, _) in sorted(lost.items())
            )
            first = lost[min(lost)][2]
            message += f" in round {now.index} of the cooperative load: {first}"
            logger.error("%s", message)
            raise PeerLoadError(message) from first
        for landing, wire in now.arrivals:
            self.link.arrived(landing, wire)
        self.link.settle()


def _wire(view: memoryview | None) -> torch.Tensor:
    """The bytes of ``view`` as a uint8 tensor over the same memory, for gloo to send from or receive into."""
    if view is None or not len(view):
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)
