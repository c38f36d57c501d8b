"""Which store errors are worth another try, and what each one means to a caller.

Both questions are answered here, after the fact, from the exception a
request raised, for every store alike.  botocore answers the first one too,
but only inside its own retry handler (on a ``RetryContext``, with private
code lists), and dcpstore turns that handler off so that ``RetryPolicy`` is
the one retry policy a request goes through (see ``s3_requests.client_config``).
botocore's ``ClientError`` carries the S3 code and HTTP status; this module
maps them onto the ``dcpstore.errors`` types, each naming the object.
"""

from __future__ import annotations

import asyncio

from ..errors import (
    BucketNotFoundError,
    ConditionalWriteError,
    CorruptCheckpointError,
    DcpstoreError,
    ObjectNotFoundError,
    StorageAccessError,
    ThrottledError,
    TransientStorageError,
    UnsupportedByStoreError,
)

_RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "ConditionalRequestConflict",
        "BadDigest",  # the body arrived damaged (it fails its CRC32): the same bytes sent again may arrive whole
    }
)
_ACCESS_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
    }
)


def _error_code(exc: BaseException) -> tuple[str | None, int | None, str]:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, None, str(exc)
    error = response.get("Error", {}) or {}
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return error.get("Code"), status, error.get("Message") or str(exc)


_THROTTLE_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests", "ServiceUnavailable"}
)


def is_throttle(exc: BaseException) -> bool:
    """Whether the store asked to slow down: SlowDown and its kin, HTTP 429 or 503.

    These are answered by a lower request rate (``throttle``) and retried
    for as long as ``RetryPolicy.throttle_budget`` allows, not counted
    against ``max_attempts``: S3 throttles a hot key range for as long as
    the load on it lasts.
    """
    code, status, _ = _error_code(exc)
    return code in _THROTTLE_CODES or status in (429, 503)


def may_have_taken_effect(exc: BaseException) -> bool:
    """Whether a request that failed with ``exc`` may still have taken effect (see ``base.Tries``).

    No answer at all (a reset, a timeout), or a server error (5xx): a
    gateway answers 502/503/504 while the store behind it may still complete
    the request, and S3's 500 InternalError does not say it did not.  A 4xx
    is the store's own refusal.  Every 5xx counts, SlowDown too: a client
    cannot tell the store's answer from a gateway's.
    """
    code, status, _ = _error_code(exc)
    return status is None or status >= 500


def is_retryable(exc: BaseException) -> bool:
    """Throttling, 5xx but 501, connection resets and timeouts are worth another try.

    Decided by S3 error code first (``RequestTimeout`` and ``BadDigest``, a
    body damaged on the way, are 400s, and a ``ConditionalRequestConflict``
    409 asks the client to retry), then by
    status: 429 and 5xx other than 501 Not Implemented.  Every other 4xx
    would fail the same way again.
    """
    code, status, _ = _error_code(exc)
    if code is not None or status is not None:
        if code in _RETRYABLE_CODES:
            return True
        return status is not None and (status == 429 or (status >= 500 and status != 501))
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    try:
        import aiohttp
        import botocore.exceptions as bce
    except ImportError:  # pragma: no cover - s3fs brings both
        return False
    return isinstance(
        exc,
        (
            aiohttp.ClientConnectionError,
            aiohttp.ClientPayloadError,
            bce.ConnectionError,
            bce.HTTPClientError,
            bce.IncompleteReadError,
            bce.ResponseStreamingError,
        ),
    )


def translate_error(exc: BaseException, url: str) -> BaseException:
    """Turn a store error into the dcpstore exception that names ``url``."""
    if isinstance(exc, DcpstoreError):
        return exc
    if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):  # botocore's, raised as it signs: nothing was sent
        return StorageAccessError(
            f"{url}: no AWS credentials found ({exc}); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
            "AWS_PROFILE, or pass storage_options={'key': ..., 'secret': ...}, or run where an instance or pod role "
            "provides them"
        )
    code, status, message = _error_code(exc)
    if code == "PreconditionFailed" or status == 412:
        return ConditionalWriteError(f"{url}: conditional write refused: the object exists or changed ({message})")
    if code == "NotImplemented" or status == 501:
        return UnsupportedByStoreError(f"{url}: the server does not implement this request ({code}: {message})")
    if code == "NoSuchBucket":
        bucket = url.split("://", 1)[-1].split("/", 1)[0]
        return BucketNotFoundError(f"{url}: bucket {bucket!r} does not exist")
    if code in ("NoSuchKey", "NoSuchUpload", "404") or status == 404 or isinstance(exc, FileNotFoundError):
        return ObjectNotFoundError(f"{url}: object does not exist")
    if code in _ACCESS_CODES or status == 403 or isinstance(exc, PermissionError):
        return StorageAccessError(
            f"{url}: access denied ({code or 'PermissionError'}: {message}); "
            "check the AWS credentials and the bucket policy"
        )
    if code == "InvalidRange" or status == 416:
        return CorruptCheckpointError(f"{url}: object is truncated: the requested bytes lie past its end")
    if code is not None:
        return OSError(f"{url}: {code}: {message}")
    return exc


def _cause(exc: BaseException) -> str:
    code, status, message = _error_code(exc)
    return f"{code} (HTTP {status}): {message}" if code else f"{type(exc).__name__}: {exc}"


def gave_up(op: str, url: str, attempts: int, exc: BaseException) -> TransientStorageError:
    """The error of a request whose every attempt failed with a retryable error."""
    return TransientStorageError(f"{op} {url} failed after {attempts} attempt(s): {_cause(exc)}")


def paced_out(op: str, url: str, waited: float) -> TransientStorageError:
    """The error of a request whose first send slot came after its deadline: it was never sent."""
    return TransientStorageError(
        f"{op} {url} was not sent: its key range's request rate held it {waited:.1f}s, past its deadline"
    )


def throttled_out(op: str, url: str, seconds: float, attempts: int, exc: BaseException) -> ThrottledError:
    """The error of a request that stayed throttled for its whole ``throttle_budget``."""
    return ThrottledError(
        f"{op} {url} was throttled for {seconds:.0f}s ({attempts} attempt(s)) and gave up: {_cause(exc)}; "
        "the store admits fewer requests to this key range than the job sends "
        "(see ObjectStoreWriter(key_spread=...) and RetryPolicy.throttle_budget)"
    )
