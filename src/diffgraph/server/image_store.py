"""Images by URL: `response_format: "url"` stores each encoded image for `--image-ttl` seconds and
answers `{"url": ".../v1/images/files/ID.png"}`, which the same server (or any ingress replica sharing the store)
serves until the image expires; after that a GET is a 404.

An image's ID carries its expiry (hexadecimal seconds, then 24 random URL-safe characters), so any replica can tell
an expired image without shared state. Two stores behind one interface:
  * `MemoryImageStore`: in this process, bounded by `--image-store-bytes` (the oldest images go first when a new
    one does not fit; an image larger than the bound is refused with the flag to raise);
  * `DiskImageStore` (`--image-store DIR`): one file per image, written to a temporary name and renamed, readable
    by every ingress replica that mounts DIR; expired files are swept at most once a minute, when images are put.

`UrlSigner`: with `--api-key`, a browser's `<img src>` cannot send a Bearer header, so URLs carry `exp` and `sig`
query parameters: an HMAC-SHA256 of the image ID and the expiry, keyed by a secret derived from the server's keys
(every replica with the same keys verifies every other's URLs; a key rotation invalidates them). Standard library
only; nothing here is module state.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from typing import Callable, Protocol

from ..safe_files import write_durably

FORMATS = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
_ID = re.compile(r"^([0-9a-f]{8,12})([A-Za-z0-9_-]{24})$")
SWEEP_S = 60.0


class ImageStore(Protocol):
    ttl: float

    def put(self, data: bytes, fmt: str) -> tuple[str, int]:
        """Stores an encoded image; returns its ID and its expiry (Unix seconds). Raises ValueError if it cannot."""

    def get(self, image_id: str, fmt: str) -> bytes | None:
        """The image, or None when it is unknown, expired or of another format."""


def new_id(expires: int) -> str:
    return f"{expires:08x}{secrets.token_urlsafe(18)}"


def expiry_of(image_id: str) -> int | None:
    """The expiry an ID carries, or None for a string that is not an image ID (never a path: IDs are checked)."""
    m = _ID.match(image_id)
    return int(m.group(1), 16) if m else None


class MemoryImageStore:
    def __init__(self, ttl: float, max_bytes: int, clock: Callable[[], float] = time.time):
        self.ttl, self.max_bytes, self._clock = ttl, max_bytes, clock
        self._images: OrderedDict[str, tuple[bytes, str, int]] = OrderedDict()  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, data: bytes, fmt: str) -> tuple[str, int]:
        if len(data) > self.max_bytes:
            raise ValueError(f"an image of {len(data)} bytes does not fit the image store ({self.max_bytes} bytes); "
                             "raise --image-store-bytes or use --image-store DIR")
        now = self._clock()
        expires = int(now + self.ttl) + 1
        image_id = new_id(expires)
        with self._lock:
            while self._images and (self._bytes + len(data) > self.max_bytes
                                    or next(iter(self._images.values()))[2] <= now):
                _, (old, _, _) = self._images.popitem(last=False)
                self._bytes -= len(old)
            self._images[image_id] = (data, fmt, expires)
            self._bytes += len(data)
        return image_id, expires

    def get(self, image_id: str, fmt: str) -> bytes | None:
        with self._lock:
            entry = self._images.get(image_id)
        if entry is None or entry[1] != fmt or entry[2] <= self._clock():
            return None
        return entry[0]

    @property
    def bytes_held(self) -> int:
        return self._bytes


class DiskImageStore:
    def __init__(self, root: str, ttl: float, clock: Callable[[], float] = time.time):
        if not os.path.isdir(root):
            raise ValueError(f"image-store {root!r} is not a folder; create it (every ingress replica mounts it)")
        if not os.access(root, os.W_OK):
            raise ValueError(f"image-store {root!r} is not writable by this process; fix its permissions")
        self.root, self.ttl, self._clock = os.path.realpath(root), ttl, clock
        self._swept = 0.0
        self._lock = threading.Lock()

    def put(self, data: bytes, fmt: str) -> tuple[str, int]:
        now = self._clock()
        expires = int(now + self.ttl) + 1
        image_id = new_id(expires)
        tmp = os.path.join(self.root, f".put-{secrets.token_hex(8)}")
        try:  # a cache with a TTL: atomic (replicas read it), not synced to the disk
            write_durably(os.path.join(self.root, f"{image_id}.{fmt}"), data, tmp, sync=False)
        except OSError as e:
            raise ValueError(f"the image could not be stored in --image-store {self.root!r}: {e.strerror}") from None
        self._sweep(now)
        return image_id, expires

    def get(self, image_id: str, fmt: str) -> bytes | None:
        expires = expiry_of(image_id)
        if expires is None or fmt not in FORMATS or expires <= self._clock():
            return None
        try:
            with open(os.path.join(self.root, f"{image_id}.{fmt}"), "rb") as f:
                return f.read()
        except OSError:
            return None

    def _sweep(self, now: float) -> None:
        with self._lock:
            if now - self._swept < SWEEP_S:
                return
            self._swept = now
        for name in os.listdir(self.root):
            stem = name.rsplit(".", 1)[0]
            expires = expiry_of(stem)
            if expires is not None and expires <= now:
                try:
                    os.unlink(os.path.join(self.root, name))
                except OSError:  # another replica swept it first
                    pass


class UrlSigner:
    def __init__(self, keys: tuple[str, ...]):
        material = "\n".join(sorted(keys)).encode()
        self._secret = hashlib.sha256(b"diffgraph image urls\n" + material).digest()

    def sign(self, image_id: str, expires: int) -> str:
        return hmac.new(self._secret, f"{image_id}:{expires}".encode(), hashlib.sha256).hexdigest()[:32]

    def check(self, image_id: str, expires: str, sig: str) -> bool:
        if not (expires.isascii() and expires.isdigit()) or expiry_of(image_id) != int(expires):
            return False
        return hmac.compare_digest(self.sign(image_id, int(expires)), sig)


class NotSigned(PermissionError, LookupError):
    """An image URL this server did not sign (or whose signature was altered), asked for without a key."""


class ImageLinks:
    """The images API's side of the store: URLs for new images, and the images those URLs name."""

    def __init__(self, store: ImageStore, signer: UrlSigner | None, public_url: str | None):
        self.store, self.signer, self.public_url = store, signer, public_url

    def maker(self, request_base: str) -> Callable[[bytes, str], str]:
        """Stores an image and names it by URL (on `public_url`, else the request's own base); raises ValueError
        when the store cannot take it (the caller's 507)."""
        base = (self.public_url or request_base).rstrip("/")

        def store(data: bytes, fmt: str) -> str:
            image_id, expires = self.store.put(data, fmt)
            query = f"?exp={expires}&sig={self.signer.sign(image_id, expires)}" if self.signer else ""
            return f"{base}/v1/images/files/{image_id}.{fmt}{query}"
        return store

    def serve(self, name: str, exp: str, sig: str, key_given: bool) -> tuple[bytes, dict[str, str]]:
        """The image file `name` (ID.EXT) and its response headers; NotSigned (401) or LookupError (404)."""
        image_id, _, fmt = name.partition(".")
        if self.signer is not None and not key_given and not self.signer.check(image_id, exp, sig):
            raise NotSigned("this image URL is not signed by this server (or its signature was altered); use the "
                            "URL as the images API returned it")
        data = self.store.get(image_id, fmt)
        if data is None:
            raise LookupError(f"image {name!r} is unknown or has expired (images are kept {self.store.ttl:g} s, "
                              "--image-ttl)")
        left = max(0, (expiry_of(image_id) or 0) - int(time.time()))
        return data, {"content-type": FORMATS[fmt], "cache-control": f"private, max-age={left}"}


def make_store(root: str | None, ttl: float, max_bytes: int) -> ImageStore:
    return DiskImageStore(root, ttl) if root else MemoryImageStore(ttl, max_bytes)
