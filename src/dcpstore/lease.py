"""A running save's lease: a small object under its step that its coordinator rewrites, so that a collection finds the step live.

A collection judges a step dead when nothing under it changed for its grace
(``collection.live_steps``).  A save can go that long without changing
anything there: a shard upload that began long ago and just completed is
stamped with the time it began, and a commit may wait on a throttled
``.metadata`` PUT.  Mark-then-sweep keeps such a save from losing its
checkpoint if it commits within a grace of being marked; the lease keeps it
from being marked at all while its coordinator lives.  ``period`` is a
quarter of the grace it protects against (``DEFAULT_PERIOD``: ``dcpstore
gc``'s default hour; an ``AsyncCheckpointer``'s ``gc_grace`` when shorter).

The first PUT comes one ``period`` after the save began, not at once: until
a grace has passed, everything the save wrote, and every upload it began,
is younger than the grace, so its step is live without a lease.  A save
shorter than ``period`` (most: 15 minutes by default) writes no lease at
all; a longer one writes one small PUT every ``period``, from its
coordinator only, and one DELETE at its end.  Nothing of it stands in the
way of the save's own requests until then.

Its key carries the save's id (``LEASE_PREFIX``), so a save deletes its own
lease only; a lease whose save died stops being rewritten and goes with the
step's other debris (it is ``.dcpstore-*``, which collections treat as DCP's).
"""

from __future__ import annotations

import logging
import threading

from .storage import ObjectStore

logger = logging.getLogger(__name__)

LEASE_PREFIX = ".dcpstore-lease-"
DEFAULT_PERIOD = 3600.0 / 4  # a quarter of dcpstore gc's default grace


class Lease:
    """Writes ``{store}/.dcpstore-lease-{save_id}`` every ``period`` seconds, from ``period`` on, on a thread of its own until ``release``."""

    def __init__(self, store: ObjectStore, save_id: str, period: float = DEFAULT_PERIOD):
        self.store, self.key, self.period = store, f"{LEASE_PREFIX}{save_id}", period
        self._released = threading.Event()
        self._written = False  # whether any PUT of it succeeded (then it is deleted at the end)
        self._thread = threading.Thread(target=self._hold, name="dcpstore-lease", daemon=True)
        self._thread.start()

    def _hold(self) -> None:
        while not self._released.wait(self.period):
            try:
                self.store.put(self.key, b"")
                self._written = True
            except Exception as e:  # noqa: BLE001 - a lease not renewed is a risk for this save, not a failure of it
                logger.warning("%s: could not renew this save's lease (%s); a collection with a grace under %.0fs may "
                               "take this step for debris", self.store.url_for(self.key), e, 4 * self.period)

    def release(self) -> None:
        """Stop renewing and delete the lease, if one was written (best effort: a leftover goes with the step)."""
        if self._released.is_set():
            return
        self._released.set()
        self._thread.join()
        if not self._written:
            return
        try:
            self.store.delete([self.key])
        except Exception as e:  # noqa: BLE001
            logger.info("%s: could not delete this save's lease: %s", self.store.url_for(self.key), e)
