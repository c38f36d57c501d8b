"""``file://``: a store whose objects are written durably and appear atomically."""

from __future__ import annotations

import os
import uuid

from ..errors import ConditionalWriteError
from .base import ObjectStore, conditional_lock


class LocalObjectStore(ObjectStore):
    """``file://``: every object is written durably and appears atomically.

    An object is written to a temporary name in its folder, fsynced, then
    renamed into place (``os.replace``), and the folder is fsynced, so a
    crash leaves either no object or the whole one, never a torn
    ``.metadata`` that counts as committed.  ``if_none_match`` uses
    ``os.link``, which fails if the name exists, so two processes cannot
    both create an object; ``if_match`` checks, then renames, under a
    process-wide lock (exact within a process only).
    """

    def _put_blocking(self, key: str, data, if_none_match: bool, if_match: str | None) -> None:
        if if_match:
            with conditional_lock:
                self._check_condition(key, False, if_match)
                self._write(key, data)
            return
        self._write(key, data, exclusive=if_none_match)

    def _write(self, key: str, data, exclusive: bool = False) -> None:
        path = self._path(key)
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(memoryview(data).cast("B"))
                f.flush()
                os.fsync(f.fileno())
            if exclusive:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise ConditionalWriteError(f"{self.url_for(key)}: object already exists") from None
            else:
                os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        _fsync_dir(folder)


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
