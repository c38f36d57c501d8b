"""The object store: every byte dcpstore moves goes through this package.

Layers, top down; every import points down, none runs back up:

- ``registry``: ``open_store(url)`` picks the store for a URL and the
  connection it shares with other stores over the same filesystem and bucket;
- ``s3``: the S3 store's operations, over ``s3_requests``: one retry loop
  under ``RetryPolicy`` for every request, paced by ``throttle``'s rates;
- ``multipart``: streaming ``torch.save`` output into pooled parts, and
  large in-memory objects in parts (it names what it needs of the S3 store
  as a protocol, ``PartStore``, instead of importing it);
- ``local``: ``file://`` with durable, atomic objects;
- ``base``: the object-store vocabulary (``ObjectStore``: put, ranged get,
  exists, list, delete, multipart aborts; ``ObjectWriter``) over any fsspec
  filesystem; ``throttle``: request rates per key range; ``body``: request
  bodies and sinks;
- ``connection``: what stores share (filesystem, thread pool, part buffers)
  and the leases that free it when the last store closes: each store holds
  a lease, so the vocabulary sits above it;
- ``translate``: retry classification and error translation;
  ``config``: ``TransferConfig`` and ``RetryPolicy``.
"""

from .base import CopyInterrupted, MultipartUploadInfo, ObjectHead, ObjectInfo, ObjectStore, ObjectWriter, Tries
from .config import RetryPolicy, TransferConfig
from .local import LocalObjectStore
from .registry import (
    StoreOwner,
    check_keywords,
    check_storage_options,
    is_store_url,
    normalize_url,
    open_store,
    warn_if_each_rank_resolves_it_alone,
)
from .s3 import S3ObjectStore
from .throttle import ThrottleClock
from .translate import is_retryable, translate_error

__all__ = [
    "CopyInterrupted",
    "LocalObjectStore",
    "MultipartUploadInfo",
    "ObjectHead",
    "ObjectInfo",
    "ObjectStore",
    "ObjectWriter",
    "RetryPolicy",
    "S3ObjectStore",
    "StoreOwner",
    "ThrottleClock",
    "TransferConfig",
    "Tries",
    "check_keywords",
    "check_storage_options",
    "is_retryable",
    "is_store_url",
    "normalize_url",
    "open_store",
    "translate_error",
    "warn_if_each_rank_resolves_it_alone",
]
