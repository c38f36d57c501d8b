"""The exceptions dcpstore raises.

Every class also derives from the standard exception a caller would catch
without knowing dcpstore (``FileNotFoundError``, ``ValueError``, ...), so
generic handlers keep working, while ``except DcpstoreError`` catches them all.
Messages always name the object (URL) and the cause.
"""

from __future__ import annotations

import pickle


class DcpstoreError(Exception):
    """Base class of every error raised by dcpstore."""


class ObjectNotFoundError(DcpstoreError, FileNotFoundError):
    """An object or bucket that should exist does not."""


class BucketNotFoundError(ObjectNotFoundError):
    """The bucket named in a URL does not exist."""




class CheckpointExistsError(DcpstoreError, FileExistsError):
    """A save targets a prefix that already holds a committed checkpoint."""


class ConditionalWriteError(DcpstoreError, FileExistsError):
    """A conditional write was refused: the object exists (``If-None-Match``) or changed (``If-Match``)."""


class CorruptCheckpointError(DcpstoreError, ValueError):
    """A shard object is truncated, or its bytes do not match their checksum."""


class UnsafeCheckpointError(DcpstoreError, pickle.UnpicklingError):
    """Something read from the checkpoint would run code if deserialized, and was refused.

    Raised for a ``.metadata`` pickle that names a global outside the
    allow-list, and for a non-tensor item that ``torch.load(weights_only=True)``
    refuses; the message names the object, the item and the global.
    """




class StorageAccessError(DcpstoreError, PermissionError):
    """The store refused the request: wrong credentials or missing permissions."""


class TransientStorageError(DcpstoreError, OSError):
    """A request kept failing with retryable errors until the retry budget ran out."""


class ThrottledError(TransientStorageError):
    """A request stayed throttled (503 SlowDown, 429) for its whole ``RetryPolicy.throttle_budget``."""


class UnpicklableValueError(DcpstoreError, TypeError):
    """A non-tensor value of the state dict cannot be pickled; the message names its key."""


class UnsupportedByStoreError(DcpstoreError, OSError):
    """The store does not implement a request (HTTP 501), e.g. ``ListMultipartUploads`` on some servers."""


class CheckpointSaveError(DcpstoreError, RuntimeError):
    """A save failed on one or more ranks; the step was not committed.

    ``failures`` maps rank to a one-line description of what failed there.
    """

    verdict = "was not committed"

    def __init__(self, url: str, failures: dict[int, str]):
        self.url = url
        self.failures = dict(failures)
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(self.failures.items()))
        super().__init__(f"checkpoint {url} {self.verdict}: {detail}")


class CommitOutcomeUnknownError(CheckpointSaveError):
    """Whether the step committed is unknown: its ``.metadata`` PUT may have landed, and storage could not be read in time.

    The step's shards are kept (a ``.metadata`` that names them may exist);
    ``dcpstore verify`` tells later, and ``dcpstore gc`` reclaims the shards
    if it did not commit.
    """

    verdict = "may or may not be committed (its shards are kept; `dcpstore verify` tells)"


class CheckpointLoadError(DcpstoreError, RuntimeError):
    """``AsyncCheckpointer.load`` failed on one or more ranks.

    torch reports a failed ``dcp.load`` as ``CheckpointException``, a
    ``BaseException`` that ``except Exception`` misses; this is its
    ``Exception`` form.  ``failures`` maps rank to that rank's exception
    (the first one is also ``__cause__``); the message names the step and
    the first failing rank's error, which names the object.
    """

    def __init__(self, url: str, step: int, failures: dict[int, BaseException]):
        self.url, self.step, self.failures = url, step, dict(failures)
        rank = min(self.failures)
        first = self.failures[rank]
        more = f" (and {len(self.failures) - 1} more rank(s))" if len(self.failures) > 1 else ""
        super().__init__(f"loading step {step} from {url} failed: rank {rank}: {type(first).__name__}: {first}{more}")


class _LoadRefused(CheckpointLoadError):
    """A failed load told by one message (a reader's check), not by the ranks' failures."""

    def __init__(self, message: str):
        self.url = self.step = None
        self.failures = {}
        DcpstoreError.__init__(self, message)


class CheckpointNotFoundError(_LoadRefused, FileNotFoundError):
    """A prefix holds no ``.metadata`` object: an incomplete or missing checkpoint."""


class StateDictMismatchError(_LoadRefused, ValueError):
    """The state dict to load does not match the checkpoint (keys or shapes)."""


class CheckpointTimeoutError(DcpstoreError, TimeoutError):
    """A background save did not finish within its timeout."""
