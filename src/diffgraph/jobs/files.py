"""A job's images on disk, written so that a crash (SIGKILL, a power cut) leaves either the whole image under its
name or nothing there: the bytes go to a temporary name in the same folder, are fsynced, renamed over the final
name (os.replace: atomic on POSIX), and the folder is fsynced so the rename itself is durable. Only then does the
caller commit the image as done (store.py): a crash between the rename and the commit leaves an image that is
stored but not marked, which `matches` recognises on restart (it decodes, and the settings inside are the
candidate's), so it is adopted, not made again; temporary files left by a crash are swept (`sweep_temporary`).

Used by the job store (`--state-dir`) and by `diffgraph batch --out` alike; pure Python and Pillow.
"""

from __future__ import annotations

import errno
import json
import os
from typing import Any

from ..image_metadata import JSON_KEY
from ..safe_files import fsync_folder, write_durably

TEMP_SUFFIX = ".tmp"


class ImageWriteError(Exception):
    """An image could not be written (disk full, a read-only or unwritable folder): one line naming the path, the
    reason and what to do. `full`: the disk (or the quota) is full, so no other image can be written either."""

    def __init__(self, message: str, full: bool = False):
        super().__init__(message)
        self.full = full


FULL = (errno.ENOSPC, errno.EDQUOT)


def _hint(e: OSError, flag: str) -> str:
    if e.errno in FULL:
        return f"free disk space or change {flag}"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"make the folder writable or change {flag}"
    return f"check the disk or change {flag}"


def make_folder(folder: str) -> None:
    """`folder` and the missing folders above it, each new one made durable in its parent."""
    if os.path.isdir(folder):
        return
    parent = os.path.dirname(folder)
    make_folder(parent)
    try:
        os.mkdir(folder)
    except FileExistsError:
        return
    fsync_folder(parent)


def write_image(path: str, data: bytes, flag: str = "--state-dir") -> None:
    """Writes `data` at `path`: temporary name, fsync, os.replace, fsync of the folder. Raises ImageWriteError."""
    folder = os.path.dirname(path)
    temp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}{TEMP_SUFFIX}")
    try:
        make_folder(folder)
        write_durably(path, data, temp)
    except OSError as e:
        raise ImageWriteError(f"could not write the image to {path}: {e.strerror or e}; {_hint(e, flag)}",
                              e.errno in FULL) from None


def matches(path: str, expected: dict[str, Any] | None, ignore: tuple[str, ...] = ()) -> bool:
    """Whether `path` holds a whole PNG image whose settings (its `diffgraph` metadata) are `expected` (as
    image_metadata.request_fields writes them), but for the fields in `ignore`; with `expected` None (images written
    without metadata), whether it decodes."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            if image.format != "PNG":
                return False
            text = image.info.get(JSON_KEY)  # the settings come before the pixels (image_metadata.py's chunks)
            image.verify()  # every chunk to the end, each checked by its CRC: a truncated file fails here
    except Exception:  # missing, truncated, not an image: not a stored image
        return False
    if expected is None:
        return True
    try:
        if text is None:
            return False
        found, wanted = json.loads(text), json.loads(json.dumps(expected))
        return isinstance(found, dict) and all(found.get(k) == v for k, v in wanted.items() if k not in ignore) \
            and set(found) - set(ignore) == set(wanted) - set(ignore)
    except ValueError:
        return False


def sweep_temporary(folder: str) -> int:
    """Removes the temporary files a crash left in `folder`; returns how many."""
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    removed = 0
    for name in names:
        if name.startswith(".") and name.endswith(TEMP_SUFFIX):
            try:
                os.unlink(os.path.join(folder, name))
                removed += 1
            except OSError:
                pass
    return removed
