"""The commit: one conditional write of ``.metadata``, and the outcome storage shows.

A checkpoint exists exactly when its ``.metadata`` does, so the commit is
the one request whose outcome every rank must know truly.  An answer can be
lost after the request took effect (a reset, a timeout, a proxy), and the
retries that follow can be throttled until they give up: an error from the
PUT therefore does not mean "not committed", and neither does an error
answer: a gateway answers 502/503/504 while the store behind it may still
complete the PUT (``storage.Tries``).  ``write_metadata`` settles
every error by reading storage back, and reports one of four outcomes:

- ``COMMITTED``: this save's ``.metadata`` is in storage;
- ``REFUSED``: another writer's ``.metadata`` is there (another job, a
  zombie), and the condition keeps this save's from ever landing;
- ``FAILED``: no ``.metadata`` of this save exists, and none can appear:
  every attempt was answered, or the ones that were not have had time to
  land;
- ``UNKNOWN``: storage could not be read in time.  The caller must keep the
  shards: a ``.metadata`` that names them may exist, and ``dcpstore verify``
  or ``gc`` settle the step later.

Which ``.metadata`` is this save's: the PUT carries the save's nonce as
user metadata (``x-amz-meta-dcpstore-save``), so one HEAD tells, without
reading or parsing the object; it equals ``StorageMeta.save_id`` inside it,
which is what a store without user metadata is checked by.

``Destination`` is one save's side of it: what the key holds as the save
begins (nothing, a collection's tombstone, or the checkpoint an overwrite
replaces), the checks before the PUT (every named object still stored, the
coordinator's ``put_deadline``), the PUT, and the objects deleted after.

``settle`` is also how a rank that lost its coordinator learns the outcome.
Why the ranks of an ``AsyncCheckpointer`` never disagree:

1. The coordinator notes ``put_deadline = now + T`` as it enters the gather
   of the write results, ``T`` being the group's collective timeout.  It
   sends no ``.metadata`` PUT after ``put_deadline`` (``Destination.commit``
   refuses to, and the save fails on the coordinator with no PUT sent),
   however long its work before the PUT takes (the resume index, the root's
   listing, a stalled store).
2. No rank leaves that gather before every rank entered it
   (``gather_object`` begins with an ``all_gather`` of the sizes), so a
   peer enters the verdict's broadcast at ``b >= put_deadline - T``.
3. A peer that gets the verdict reports it.  A peer whose broadcast breaks
   settles from storage until ``max(now, b + T) + commit_window +
   landing_margin``, which is at least ``put_deadline + commit_window +
   landing_margin``: the coordinator's last attempt starts within
   ``commit_window`` of its PUT's start, and lands within ``landing_margin``
   of being sent.  So storage's answer then is final: if it shows this
   save's ``.metadata``, the peer reports committed, as the coordinator
   does (or would have); if not, none can appear, and the coordinator,
   alive or not, reports or would have reported failed.
4. The coordinator's own verdict is storage's answer too (``write_metadata``).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import random
import time

from . import planner_data, resume_index
from .errors import (
    CheckpointExistsError,
    CommitOutcomeUnknownError,
    ConditionalWriteError,
    DcpstoreError,
    ObjectNotFoundError,
)
from .layout import METADATA_KEY, NONCE_KEY, Tombstone, destination, is_tombstone, metadata_state
from .metadata_reading import parse_metadata
from .storage import ObjectStore, Tries

logger = logging.getLogger(__name__)

# What a commit tags .metadata with, as user metadata (x-amz-meta-*): NONCE_KEY
# (layout), the nonce of the save that wrote it (= StorageMeta.save_id), and
SEQUENCE_KEY = "dcpstore-seq"  # a checkpointer's commit sequence (see steps)
PARENT_KEY = "dcpstore-parent"  # the step that commit continued from (see steps)


class Outcome(enum.Enum):
    COMMITTED = "committed"
    REFUSED = "refused"
    FAILED = "failed"
    UNKNOWN = "unknown"


def landing_margin(store: ObjectStore, nbytes: int | None = None) -> float:
    """Seconds after its last attempt started within which an unsettled ``.metadata`` PUT of ``nbytes`` could still land.

    Unsettled (``storage.Tries``): no answer came, or a 5xx, which a gateway
    may send while the store still acts on the request.  An attempt is given
    up after connect + read timeouts plus its body's time at
    ``min_send_rate`` (a single PUT is at most ``multipart_threshold``; a
    larger ``.metadata`` lands with its small CompleteMultipartUpload), and
    a gateway in front of the store is assumed to give up on its upstream
    within the same bounds; a second more for clocks and the server's own
    work.  ``nbytes=None``: a rank that does not know the size assumes the largest.
    """
    t = store.transfer
    body = t.multipart_threshold if nbytes is None else min(nbytes, t.multipart_threshold)
    return t.connect_timeout + t.read_timeout + body / t.min_send_rate + 1.0


def write_metadata(
    store: ObjectStore,
    raw: bytes,
    nonce: str,
    *,
    replaced_etag: str | None,
    window: float,
    tags: dict[str, str] | None = None,
) -> tuple[Outcome, BaseException | None]:
    """Write ``.metadata`` conditionally, trying for at most ``window`` seconds; the outcome and the error, if any.

    ``replaced_etag``: the ETag of the committed ``.metadata`` an overwrite
    replaces (``If-Match``), or ``None`` for a new checkpoint
    (``If-None-Match: *``).  ``tags``: more user metadata for the object
    (a checkpointer's commit sequence, see ``steps``).
    """
    tries = Tries()
    try:
        store.put(
            METADATA_KEY,
            raw,
            if_none_match=replaced_etag is None,
            if_match=replaced_etag,
            metadata={**(tags or {}), NONCE_KEY: nonce},
            deadline=time.monotonic() + window,
            tries=tries,
        )
        return Outcome.COMMITTED, None
    except ConditionalWriteError as e:
        return Outcome.REFUSED, e  # the store already told its own lost answer from another writer's object
    except Exception as e:  # noqa: BLE001 - it may have taken effect: storage decides
        if isinstance(e, ObjectNotFoundError) and replaced_etag is not None:
            # If-Match on an object that is gone: S3 answers 404, not 412 (a collection removed the tombstone).
            return Outcome.REFUSED, e
        if tries.may_have_landed:
            time.sleep(landing_margin(store, len(raw)))  # an attempt unanswered, or answered 5xx, may still land
        return settle(store, nonce, replaced_etag), e


def settle(store: ObjectStore, nonce: str, replaced_etag: str | None = None) -> Outcome:
    """What storage shows of the save with ``nonce``, once no attempt of it can still land."""
    try:
        head = store.head(METADATA_KEY)
    except ObjectNotFoundError:
        return Outcome.FAILED
    except Exception:  # noqa: BLE001 - storage could not be read: nobody can know yet
        return Outcome.UNKNOWN
    tags, etag = head.metadata, head.etag
    if NONCE_KEY not in tags and not is_tombstone(head.size):  # a store without user metadata, or another tool's .metadata
        try:
            tags, etag = tags_in_object(store)
        except ObjectNotFoundError:
            return Outcome.FAILED
        except DcpstoreError:
            tags = {}  # not a .metadata this save could have written
        except Exception:  # noqa: BLE001
            return Outcome.UNKNOWN
    if tags.get(NONCE_KEY) == nonce:
        return Outcome.COMMITTED
    if replaced_etag is not None and etag is not None and etag.strip('"') == replaced_etag.strip('"'):
        return Outcome.FAILED  # still the checkpoint this save would have replaced
    return Outcome.REFUSED


def tags_in_object(store: ObjectStore) -> tuple[dict[str, str], str | None]:
    """The tags a commit puts on ``.metadata``, read from the object itself, and its ETag.

    For a store that keeps no user metadata (or a HEAD that shows none):
    the nonce is ``StorageMeta.save_id``, the sequence and parent are in
    ``planner_data["dcpstore/commit"]``.  A GET and a parse, not a HEAD.
    """
    raw, etag = store.get_with_etag(METADATA_KEY)
    metadata = parse_metadata(raw, store.url_for(METADATA_KEY))
    record = planner_data.read_commit(metadata) or {}
    values = {
        NONCE_KEY: getattr(metadata.storage_meta, "save_id", None),
        SEQUENCE_KEY: record.get("sequence"),
        PARENT_KEY: record.get("parent"),
    }
    return {k: str(v) for k, v in values.items() if v is not None}, etag


def wait_and_settle(store: ObjectStore, nonce: str, until: float) -> Outcome:
    """Watch storage until ``until`` (``time.monotonic()``) for this save's ``.metadata``, then settle.

    For a rank whose coordinator can no longer tell it the outcome.  Reads
    are HEADs, the first after a random wait of up to a second, then spaced
    by jittered backoff (0.5 s doubling to 8 s), so that thousands of ranks
    settling at once, the moment a peer died, do not stampede one key
    (4,095 ranks: about 4,100 HEADs in the first second, then fewer; S3
    serves 5,500/s, see docs/scale.md).  It returns as soon as this save's
    ``.metadata`` shows.
    """
    time.sleep(random.uniform(0, min(1.0, max(0.0, until - time.monotonic()))))
    delay = 0.5
    while True:
        outcome = settle(store, nonce)
        now = time.monotonic()
        if outcome is Outcome.COMMITTED or now >= until:
            return outcome
        time.sleep(min(random.uniform(delay / 2, delay), until - now))
        delay = min(8.0, delay * 2)


@dataclasses.dataclass(frozen=True)
class Replaced:
    """The committed checkpoint an overwrite replaces, as read at planning time."""

    etag: str | None
    paths: frozenset[str]  # the shard objects its .metadata references


@dataclasses.dataclass
class Destination:
    """One save's ``.metadata`` key: what it holds as the save begins, and the commit that replaces exactly that.

    A new step commits with ``If-None-Match: *``; a step where a collection
    left its tombstone (``collection.mark``), with ``If-Match`` on the
    tombstone's ETag noted as the save began; an overwrite, with
    ``If-Match`` on the ETag of the ``.metadata`` read at planning time, so
    it never replaces a commit it has not seen, and afterwards it deletes
    exactly the shards that ``.metadata`` referenced: it never lists them.
    A writer holds one per save (``ObjectStoreWriter.reset``); the store is
    passed in, since a writer may move to another prefix between saves.
    """

    tombstone: str | None = None  # ETag of a collection's tombstone at .metadata as the save began
    replaced: Replaced | None = None

    def check(self, store: ObjectStore, overwrite: bool) -> bool:
        """Refuse to save over a committed checkpoint unless ``overwrite``; True if one is there."""
        committed = self.committed(store)
        if committed and not overwrite:
            raise exists_error(store)
        return committed

    def committed(self, store: ObjectStore) -> bool:
        """Whether a checkpoint is committed here; notes a collection's tombstone, which the commit replaces."""
        committed, self.tombstone = destination(store)
        return committed

    @staticmethod
    def _laid_meanwhile(store: ObjectStore, condition: str | None) -> tuple[bool, str | None]:
        """After a new step's commit was refused: whether to try once more, and under which condition.

        A collection may have marked the step since the save looked
        (``collection``: a save that seemed dead, as a long multipart shard
        does the moment it lands); the commit then replaces exactly that
        mark (its ETag), and the collection's sweep, which needs the same
        mark, deletes nothing.  Or the tombstone the save found is gone
        (removed by a collection): then no ``.metadata`` (``If-None-Match``).
        Never a sweep's tombstone, nor a checkpoint.
        """
        committed, kind, etag = metadata_state(store)
        if not committed and kind is Tombstone.MARKED and etag != condition:
            return True, etag
        if not committed and kind is None and condition is not None:
            return True, None
        return False, condition

    def read_replaced(self, store: ObjectStore) -> None:
        """Note the committed checkpoint an overwrite would replace (planning time), if any."""
        try:
            raw, etag = store.get_with_etag(METADATA_KEY)
        except ObjectNotFoundError:
            self.replaced = None
            return
        if is_tombstone(len(raw)):
            self.replaced = None  # not a checkpoint; the commit replaces only the tombstone noted as the save began
            return
        old = parse_metadata(raw, store.url_for(METADATA_KEY))
        paths = {info.relative_path for info in (old.storage_data or {}).values()}
        index = resume_index.key_of(old)
        self.replaced = Replaced(etag, frozenset(paths | ({index} if index else set())))

    def commit(
        self,
        store: ObjectStore,
        raw_metadata: bytes | bytearray,
        paths: set[str],
        *,
        nonce: str,
        overwrite: bool,
        tags: dict[str, str],
        window: float,
        put_deadline: float | None,
        rank: int,
    ) -> None:
        """Write ``.metadata``, naming ``paths``: the one conditional PUT that makes the checkpoint exist.

        Its outcome is what storage shows (``write_metadata``): an error
        after the PUT may have taken effect is settled by reading back.
        Refused (``CheckpointExistsError``) when another writer committed
        first; the objects in ``paths`` are then deleted, since nothing
        references them.  ``CommitOutcomeUnknownError`` when storage could
        not be read back: they are kept.  After an overwrite, the replaced
        checkpoint's shards are deleted (``overwrite``).  No PUT is sent after
        ``put_deadline`` (``time.monotonic()``), the bound an
        ``AsyncCheckpointer``'s peers settle by (see this module's docstring).
        """
        listed = check_still_stored(store, paths)
        if overwrite and self.replaced is None:
            self.read_replaced(store)  # planning ran elsewhere (e.g. a cached plan)
        replaced = self.replaced
        if put_deadline is not None and time.monotonic() >= put_deadline:
            # No PUT is sent: no .metadata of this save can appear, and the peers that stopped waiting know it.
            raise DcpstoreError(
                f"{store.url_for(METADATA_KEY)}: not written: the work before the commit took "
                f"{time.monotonic() - put_deadline:.0f}s past the point its peers stop waiting for the coordinator"
            )
        condition = replaced.etag if replaced is not None else self.tombstone
        outcome, error = write_metadata(store, raw_metadata, nonce, replaced_etag=condition, window=window, tags=tags)
        if outcome is Outcome.REFUSED and replaced is None:
            again, condition = self._laid_meanwhile(store, condition)
            if again and (put_deadline is None or time.monotonic() < put_deadline):
                logger.info("%s: a collection marked this step while it committed; committing in place of its mark", store.url)
                outcome, error = write_metadata(store, raw_metadata, nonce, replaced_etag=condition, window=window, tags=tags)
        if outcome is Outcome.COMMITTED:
            if error is not None:
                logger.warning("%s: committed (read back after the PUT failed: %s)", store.url_for(METADATA_KEY), error)
            if replaced is not None:
                delete_quietly(store, replaced.paths - paths, "shards of the replaced checkpoint", listed)
            return
        if outcome is Outcome.REFUSED:
            delete_quietly(store, paths, "shards of the refused commit", listed)
            if destination(store)[1] is not None:
                raise DcpstoreError(
                    f"{store.url_for(METADATA_KEY)}: not committed: a collection (`dcpstore gc`, or gc_grace) "
                    "took this step for a failed save's debris while it committed, and deleted its shards"
                ) from error
            if replaced is None:
                raise exists_error(store) from error
            raise CheckpointExistsError(
                f"{store.url_for(METADATA_KEY)}: Checkpoint already exists and changed since this save "
                f"read it (another job committed in between); this save was not committed ({error})"
            ) from error
        if outcome is Outcome.UNKNOWN:
            raise CommitOutcomeUnknownError(
                store.url, {rank: f"writing .metadata failed ({error}) and storage could not be read back"}
            ) from error
        raise error  # FAILED: no .metadata of this save exists or can appear


def exists_error(store: ObjectStore) -> CheckpointExistsError:
    # torch's writers say "Checkpoint already exists"; code that matches that text keeps working.
    return CheckpointExistsError(
        f"{store.url_for(METADATA_KEY)}: Checkpoint already exists (a committed checkpoint is here) "
        "and overwrite=False; pass overwrite=True to replace it"
    )


def check_still_stored(store: ObjectStore, paths: set[str]) -> dict[str, str | None]:
    """Refuse to commit unless every object ``.metadata`` would name is in storage: one listing of the step, returned (key -> ETag).

    The shards were written minutes ago, perhaps: a collection that took
    the step for debris (see ``collection``), a
    lifecycle rule or a person may have deleted them since.  No
    ``.metadata`` is sent then, so none can name what is gone.
    """
    listed = {o.key: o.etag for o in store.list()}
    gone = sorted(paths - listed.keys())
    if gone:
        raise DcpstoreError(
            f"{store.url_for(gone[0])}: not committed: this save wrote it, and it is gone from storage "
            f"({len(gone)} of the {len(paths)} objects .metadata would name; deleted while the save ran, by "
            "`dcpstore gc`, a lifecycle rule or a person); no .metadata was written"
        )
    return listed


def delete_quietly(store: ObjectStore, keys: set[str], what: str, listed: dict[str, str | None] | None = None) -> None:
    """Delete the objects of a save nothing will reference, each while it is unchanged since ``listed`` (best effort: orphans cost space, not correctness).

    ``listed``: key -> ETag from a listing made for this decision; by
    default one listing here.  A key not listed is gone already.
    """
    if not keys:
        return
    try:
        if listed is None:
            listed = {o.key: o.etag for o in store.list()}
        changed = store.delete_if_unchanged({k: listed[k] for k in sorted(keys) if k in listed})
        if changed:
            logger.warning("%s: left %d of the %s: changed since listed (%s)", store.url, len(changed), what, ", ".join(changed[:5]))
    except Exception as e:  # noqa: BLE001 - gc reclaims what is left
        logger.warning("%s: could not delete %d %s: %s", store.url, len(keys), what, e)
