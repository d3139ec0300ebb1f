"""Images by URL (issue 34, point 3): `response_format: "url"` through the official OpenAI client, signed URLs with
API keys, expiry, the memory bound and the shared folder store."""

from __future__ import annotations

import base64
import io
import os
import time

import httpx
import pytest
from PIL import Image

from diffgraph.server.image_store import DiskImageStore, MemoryImageStore, UrlSigner, expiry_of
from diffgraph.server.process import ServerProcess

KEY = "url-test-key"


class Clock:
    def __init__(self, t: float = 1_800_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_memory_store_expires_and_keeps_its_bound():
    clock = Clock()
    store = MemoryImageStore(ttl=60, max_bytes=1000, clock=clock)
    a, exp_a = store.put(b"a" * 400, "png")
    assert expiry_of(a) == exp_a == int(clock.t + 60) + 1
    b, _ = store.put(b"b" * 400, "png")
    assert store.get(a, "png") == b"a" * 400 and store.get(a, "jpeg") is None  # the format is part of the name
    c, _ = store.put(b"c" * 400, "png")  # 1200 bytes > 1000: the oldest goes
    assert store.get(a, "png") is None and store.get(b, "png") and store.get(c, "png")
    assert store.bytes_held == 800
    clock.t += 61
    assert store.get(b, "png") is None  # expired
    with pytest.raises(ValueError, match="--image-store-bytes"):
        store.put(b"x" * 1001, "png")


def test_disk_store_writes_whole_files_and_sweeps_expired_ones(tmp_path):
    clock = Clock()
    store = DiskImageStore(str(tmp_path), ttl=10, clock=clock)
    a, _ = store.put(b"PNGDATA", "png")
    assert os.listdir(tmp_path) == [f"{a}.png"]  # no temporary file left behind
    other = DiskImageStore(str(tmp_path), ttl=10, clock=clock)  # another ingress replica on the same folder
    assert other.get(a, "png") == b"PNGDATA"
    for bad in ("../etc/passwd", "x" * 32, a[:-1]):
        assert other.get(bad, "png") is None
    clock.t += 100
    assert other.get(a, "png") is None
    b, _ = store.put(b"NEW", "png")  # a put sweeps expired files (at most once a minute)
    assert os.listdir(tmp_path) == [f"{b}.png"]
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o500)
    if not os.access(tmp_path / "ro", os.W_OK):  # (root ignores permissions)
        with pytest.raises(ValueError, match="not writable"):
            DiskImageStore(str(tmp_path / "ro"), ttl=10)


def test_signer_rejects_altered_ids_expiries_and_other_keys():
    clock = Clock()
    image_id, exp = MemoryImageStore(ttl=60, max_bytes=10, clock=clock).put(b"x", "png")
    signer = UrlSigner(("k1", "k2"))
    sig = signer.sign(image_id, exp)
    assert signer.check(image_id, str(exp), sig)
    assert UrlSigner(("k2", "k1")).check(image_id, str(exp), sig)  # every replica with the same keys
    assert not UrlSigner(("k3",)).check(image_id, str(exp), sig)
    assert not signer.check(image_id, str(exp + 1), sig)
    assert not signer.check(image_id[:-1] + ("A" if image_id[-1] != "A" else "B"), str(exp), sig)
    assert not signer.check(image_id, "abc", sig)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    store = tmp_path_factory.mktemp("images")
    s = ServerProcess("--api-key", KEY, "--image-store", str(store), "--request-timeout", "600")
    try:
        s.wait_ready()
        yield s, store
    finally:
        s.stop(timeout=30)


def test_the_openai_client_gets_a_signed_url_that_serves_the_same_image(keyed):
    openai = pytest.importorskip("openai")
    server, store = keyed
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    by_url = client.images.generate(prompt="a red fox", response_format="url", extra_body={"seed": 4, "num_inference_steps": 3})
    url = by_url.data[0].url
    assert url.startswith(server.url + "/v1/images/files/") and "?exp=" in url and "&sig=" in url
    assert by_url.data[0].b64_json is None
    inline = client.images.generate(prompt="a red fox", extra_body={"seed": 4, "num_inference_steps": 3})
    fetched = httpx.get(url, timeout=60)  # no Authorization header: the URL's signature is enough (an <img src>)
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/png"
    assert fetched.content == base64.b64decode(inline.data[0].b64_json)
    assert Image.open(io.BytesIO(fetched.content)).size == (64, 64)
    assert len(os.listdir(store)) == 1  # stored in the shared folder
    path = url.split("?")[0]
    assert httpx.get(path, timeout=60).status_code == 401  # unsigned
    tampered = url.replace("sig=", "sig=0")
    assert httpx.get(tampered, timeout=60).status_code == 401
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(path, headers=headers, timeout=60).status_code == 200  # a key holder needs no signature
    gone = path.rsplit("/", 1)[0] + "/00000001" + "A" * 24 + ".png"  # expired in 1970
    assert httpx.get(gone, headers=headers, timeout=60).status_code == 404
    assert httpx.get(path.replace(".png", ".jpeg"), headers=headers, timeout=60).status_code == 404


def test_public_url_and_an_expired_image(tmp_path):
    with ServerProcess("--public-url", "https://img.example.com/base", "--image-ttl", "1",
                       "--request-timeout", "600") as server:
        server.wait_ready()
        r = httpx.post(server.url + "/v1/images/generations", timeout=600,
                       json={"prompt": "a", "response_format": "url", "num_inference_steps": 2, "n": 2, "output_format": "webp"})
        assert r.status_code == 200, r.text
        urls = [d["url"] for d in r.json()["data"]]
        assert len(urls) == 2 and all(u.startswith("https://img.example.com/base/v1/images/files/") for u in urls)
        assert all(u.endswith(".webp") and "sig=" not in u for u in urls)  # no keys: unguessable IDs, no signature
        local = server.url + urls[0][len("https://img.example.com/base"):]
        image_id = local.rsplit("/", 1)[1].split(".")[0]
        expires = expiry_of(image_id)
        assert time.time() - 1 <= expires <= time.time() + 3
        fetched = httpx.get(local, timeout=60)
        if time.time() < expires - 0.5:  # still well inside its second (a loaded box may be slower)
            assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/webp"
        time.sleep(max(0.0, expires - time.time() + 0.1))
        assert httpx.get(local, timeout=60).status_code == 404  # expired
