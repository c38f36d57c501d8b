"""The object store: every byte dcpstore moves goes through this package.

Layers, top down:

- ``registry``: ``open_store(url)`` picks the store for a URL and the
  connection it shares with other stores over the same filesystem and bucket;
- ``base``: the object-store vocabulary (``ObjectStore``: put, ranged get,
  exists, list, delete, multipart aborts; ``ObjectWriter``) over any fsspec
  filesystem; ``local``: ``file://`` with durable, atomic objects;
- ``s3``: the S3 request transport, one retry loop under ``RetryPolicy``,
  paced by ``throttle``'s request rates;
  ``multipart``: streaming ``torch.save`` output into pooled parts;
- ``connection``: what stores share (filesystem, thread pool, part buffers)
  and the leases that free it when the last store closes;
- ``translate``: retry classification and error translation;
  ``config``: ``TransferConfig`` and ``RetryPolicy``.
"""

from .base import MultipartUploadInfo, ObjectHead, ObjectInfo, ObjectStore, ObjectWriter, Tries
from .config import RetryPolicy, TransferConfig
from .local import LocalObjectStore
from .registry import StoreOwner, check_keywords, is_store_url, normalize_url, open_store
from .s3 import S3ObjectStore
from .throttle import ThrottleClock
from .translate import is_retryable, translate_error

__all__ = [
    "LocalObjectStore",
    "MultipartUploadInfo",
    "ObjectHead",
    "ObjectInfo",
    "ObjectStore",
    "ObjectWriter",
    "RetryPolicy",
    "S3ObjectStore",
    "ThrottleClock",
    "TransferConfig",
    "Tries",
    "check_keywords",
    "is_retryable",
    "is_store_url",
    "normalize_url",
    "open_store",
    "translate_error",
]
