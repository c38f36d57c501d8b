"""From a URL to a store: which implementation, and which connection it shares."""

from __future__ import annotations

import inspect
import os
import threading
import warnings
import weakref
from typing import Any

import fsspec
from aiobotocore.session import AioSession
from fsspec.dircache import DirCache

from .base import ObjectStore, url_to_fs
from .config import TransferConfig
from .connection import Connection
from .local import LocalObjectStore
from .s3 import S3_SCHEMES, S3ObjectStore

# (id of the filesystem instance, bucket, transfer) -> the connection stores
# there share.  An entry whose connection closed is replaced on next use; an
# entry no store holds any more goes, and with it the filesystem instance
# (the key's id cannot be reused while the connection holds the instance).
_connections: weakref.WeakValueDictionary[tuple, Connection] = weakref.WeakValueDictionary()
_connections_lock = threading.Lock()


def normalize_url(url: str | os.PathLike) -> str:
    """``url`` without trailing slashes; ``ValueError`` when it names no store location.

    Checked before stripping: ``"s3://"`` stripped is ``"s3:"``, which fsspec
    would take for a local folder of that name.
    """
    text = str(url)
    protocol, rest = fsspec.core.split_protocol(text)
    if protocol in S3_SCHEMES and not rest.partition("/")[0]:
        raise ValueError(f"{text!r}: an S3 URL needs a bucket: s3://BUCKET/PREFIX")
    if protocol is not None and not rest.strip("/"):
        raise ValueError(f"{text!r}: the URL names no location after {protocol}://")
    return text.rstrip("/")


def warn_if_each_rank_resolves_it_alone(url: str | os.PathLike) -> None:
    """Warn where ``url`` is a relative local path (or ``file://relative``) and a process group of more than one rank runs.

    Each rank resolves it against its own working directory, on its own
    node's disk: a checkpoint no rank can load whole, silently.
    """
    protocol, rest = fsspec.core.split_protocol(str(url))
    if protocol not in (None, "file", "local") or os.path.isabs(rest):
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        warnings.warn(
            f"{str(url)!r} is a relative local path: each of the {dist.get_world_size()} ranks resolves it against its own "
            f"working directory ({os.getcwd()} on rank {dist.get_rank()}), on its own node's disk; pass an absolute path "
            "on a filesystem every rank shares, or an s3:// URL",
            stacklevel=3,
        )


def storage_option_names(url: str | os.PathLike) -> set[str]:
    """The keywords the fsspec filesystem for ``url`` takes: its classes' ``__init__`` parameters and fsspec's own.

    fsspec accepts any keyword (``AbstractFileSystem.__init__(**storage_options)``),
    so a mistyped one would pass unnoticed; these are the ones it uses.
    """
    protocol = fsspec.core.split_protocol(str(url))[0] or "file"
    names = {"skip_instance_cache"}  # taken by fsspec's instance cache, before any __init__
    # s3fs hands the keywords it does not take itself to its botocore session (``profile``, ...).
    session = (AioSession,) if protocol in S3_SCHEMES else ()
    for cls in (*fsspec.get_filesystem_class(protocol).__mro__, DirCache, *session):
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        names.update(
            p.name for p in inspect.signature(init).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"
        )
    return names


def check_keywords(owner: type, url: str | os.PathLike, options: dict[str, Any]) -> None:
    """``TypeError`` naming every keyword in ``options`` (the ``**kwargs`` of ``owner``) that is not a storage option of ``url``'s filesystem.

    The message lists both: ``owner``'s own keywords and the storage options.
    """
    known = storage_option_names(url)
    unknown = sorted(set(options) - known)
    if unknown:
        own = [
            p.name for p in inspect.signature(owner.__init__).parameters.values()
            if p.kind is p.KEYWORD_ONLY and not p.name.startswith("_")
        ]
        raise TypeError(
            f"{owner.__name__} got unexpected keyword argument(s) {', '.join(map(repr, unknown))}: neither its own "
            f"({', '.join(own)}) nor a storage option of {url}'s filesystem ({', '.join(sorted(known))})"
        )


def check_storage_options(owner: type, url: str | os.PathLike, storage_options: dict[str, Any] | None) -> None:
    """``TypeError`` naming every key of ``storage_options`` that is not a storage option of ``url``'s filesystem.

    Checked at construction, as keywords are (``check_keywords``): fsspec
    would take a typo, and the first request would fail on it far away.
    """
    known = storage_option_names(url)
    unknown = sorted(set(storage_options or {}) - known)
    if unknown:
        raise TypeError(
            f"{owner.__name__}(storage_options=...) got unexpected key(s) {', '.join(map(repr, unknown))}: not a storage "
            f"option of {url}'s filesystem ({', '.join(sorted(known))})"
        )


def is_store_url(url: str | os.PathLike) -> bool:
    """Whether ``url`` is a URL (``scheme://...``) that names a store location."""
    if "://" not in str(url):
        return False
    try:
        normalize_url(url)
    except ValueError:
        return False
    return True


def open_store(
    url: str,
    storage_options: dict[str, Any] | None = None,
    transfer: TransferConfig | None = None,
) -> ObjectStore:
    """The store rooted at ``url``; the S3 implementation for ``s3://``.

    Stores over one filesystem instance and bucket (with one transfer
    configuration) share a connection: a writer or reader per checkpoint
    reuses one connection pool, one set of part buffers and one credential
    lookup, and ``url`` only picks the prefix.  Close the store when done
    with it (see ``connection``).
    """
    url = normalize_url(url)
    cls = _store_class(url)
    transfer = transfer or TransferConfig()
    fs, root = cls.connect(url, dict(storage_options or {}), transfer)
    bucket = root.partition("/")[0] if cls.has_buckets else ""
    key = (id(fs), bucket, transfer)
    with _connections_lock:
        connection = _connections.get(key)
        if connection is None or not connection.lease():
            connection = _connections[key] = Connection(fs, transfer)
            connection.lease()
    return cls(url, root, connection)


def _store_class(url: str) -> type[ObjectStore]:
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError as e:
        raise ValueError(f"{url}: unknown URL scheme {protocol!r} ({e})") from None
    except ImportError as e:
        raise ValueError(f"{url}: the {protocol!r} filesystem needs a missing package ({e})") from None
    if protocol in S3_SCHEMES:
        return S3ObjectStore
    if protocol in ("file", "local"):
        return LocalObjectStore
    return ObjectStore


class StoreOwner:
    """The store of an object that reads or writes at ``self.url``, and owns it.

    For ``ObjectStoreWriter`` and ``ObjectStoreReader``, which set
    ``url``, ``storage_options``, ``transfer`` and ``_store = None``:
    ``move_store`` opens the store of a new URL (before it releases the old
    one, so their shared connection stays up), ``store`` reopens it on first
    use after ``release_store`` (or after unpickling, which drops it).
    """

    url: str
    storage_options: dict[str, Any]
    transfer: TransferConfig
    _store: ObjectStore | None

    @property
    def store(self) -> ObjectStore:
        """The store at ``url``: opened by ``reset`` (or on first use after ``close``), released by ``close``."""
        if self._store is None:
            self._store = open_store(self.url, self.storage_options, self.transfer)
        return self._store

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """fsspec's own filesystem for ``url`` and ``storage_options`` (s3fs for ``s3://``), as ``FsspecWriter.fs`` is.

        The instance user code shares through fsspec's instance cache, not
        dcpstore's private client; dcpstore's writes and deletes show in its
        listings (see ``s3_requests.forget_listings``).
        """
        return url_to_fs(self.url, self.storage_options)[0]

    def move_store(self, url: str | os.PathLike) -> None:
        url = normalize_url(url)
        store = open_store(url, self.storage_options, self.transfer)
        self.release_store()
        self.url, self._store = url, store

    def release_store(self) -> None:
        """Release the store (its pools go with the last store on them).  Idempotent."""
        if self._store is not None:
            self._store.close()
            self._store = None
