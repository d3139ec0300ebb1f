"""Adapter names and device slots (diffgraph.lora.catalog, toward issue 12): the adapter folder's names, what is
refused (paths, '..', backslashes, NUL, links out of the folder, pickles), close-name hints; LRU slots that never
evict a pinned adapter, wait when all are pinned, and keep a replaced file's versions apart.

Adapter files that change under the server or are not what their names say: a file rewritten in place while
requests read it never crashes the server (each request ends with an image or a 400, and it serves after); a FIFO, a
device node, a socket, a dangling link and a 1 TB sparse file in --lora-dir are listed as unusable with the reason
and never block, in-process, over HTTP and with replicas in other processes; listings read headers only, once per
file version, on the adapter manager's own pool, and never evict the host copies requests use (also while 12
listings over 120 adapters run beside generations); integer, bool, fp8 and complex adapters and huge-but-finite ones
are a 400 naming the adapter. Failure bounds (BOUND_S) are bounds on a hang, never timing assumptions."""

from __future__ import annotations

import os
import socket
import stat
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from safetensors.torch import save_file

from diffgraph import Engine
from diffgraph.lora.catalog import AdapterDir, AdapterNameError, SlotCache, SlotsBusy
from diffgraph.request import ParamError
from diffgraph.server.process import ServerProcess
from lora_util import side_path_adapter
from server_util import served


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "styles").mkdir()
    for rel in ("ink.safetensors", "styles/watercolor.safetensors", "styles/old.ckpt", "notes.txt", "evil.bin"):
        (tmp_path / rel).write_bytes(b"x")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.safetensors"
    outside.write_bytes(b"x")
    os.symlink(outside, tmp_path / "escape.safetensors")
    return tmp_path


def test_names_listing_and_refusals(folder):
    d = AdapterDir(str(folder))
    listing = d.listing()
    assert list(listing.adapters) == ["ink", "styles/watercolor"]  # the link out of the folder is not an adapter
    assert listing.ignored == ["evil.bin", "styles/old.ckpt"]
    assert d.path("styles/watercolor") == str((folder / "styles" / "watercolor.safetensors").resolve())
    (folder / "later.safetensors").write_bytes(b"x")  # added while serving: found without a restart
    assert d.path("later").endswith("later.safetensors")
    for bad, needle in (("/etc/passwd", "not allowed"), ("../x", "not allowed"), ("styles/../ink", "not allowed"),
                        ("styles\\ink", "not allowed"), ("ink\x00", "not allowed"), ("", "non-empty"),
                        ("escape", "outside the adapter folder"), ("evil", "unknown"),
                        ("watercolour", "did you mean 'styles/watercolor'")):
        with pytest.raises(AdapterNameError, match=needle):
            d.path(bad)


def test_slots_lru_pins_waits_and_versions():
    cache = SlotCache(slots=2)
    a1, b1, c1 = ("a", (1, 1)), ("b", (1, 1)), ("c", (1, 1))
    sa, write = cache.acquire(a1)
    assert (sa, write) == (1, True)
    assert cache.acquire(a1) == (1, False)  # already there: no write, pinned twice
    sb, _ = cache.acquire(b1)
    with pytest.raises(SlotsBusy):  # both slots pinned: the request waits
        cache.acquire(c1)
    cache.release(sb)
    sc, write = cache.acquire(c1)  # b is unpinned and least recently used: evicted, a (pinned) never
    assert (sc, write) == (sb, True) and cache.slot_of(b1) is None and cache.slot_of(a1) == sa
    cache.release(sa)
    cache.release(sa)
    cache.release(sc)
    # a file replaced on disk while a request with the old version runs: the new version gets its own slot, the
    # old one stays for the rows in flight
    old, write = cache.acquire(a1)
    assert (old, write) == (sa, False)
    a2 = ("a", (2, 2))
    s2, write = cache.acquire(a2)
    assert write and s2 != old and cache.slot_of(a1) == old and cache.slot_of(a2) == s2
    cache.release(old)
    cache.release(s2)
    assert cache.drop("a") and cache.slot_of(a2) is None
    with pytest.raises(ValueError, match="not pinned"):
        cache.release(s2)


# -- adapter files that change under the server or are not what their names say --------------------------------
PROMPT = "a handwritten digit seven"
BOUND_S = 300
ADAPTERS = [f"a{i}" for i in range(6)]  # more than the engine's 4 slots (and host copies)
# name -> what its unusable entry says
SPECIAL = {"fifo": "FIFO", "device": "character device", "sock": "socket", "dangling": "dangling link",
           "huge": "above the limit"}


def _special_files(lora_folder: str) -> set[str]:
    """The entries of SPECIAL that this machine lets us make (a device node needs CAP_MKNOD, a socket a short
    path)."""
    made = set()
    os.mkfifo(os.path.join(lora_folder, "fifo.safetensors"))
    made.add("fifo")
    try:
        os.mknod(os.path.join(lora_folder, "device.safetensors"), stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null
        made.add("device")
    except (PermissionError, OSError):
        pass
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(os.path.join(lora_folder, "sock.safetensors"))
        made.add("sock")
    except OSError:  # (a path longer than a socket address allows)
        pass
    os.symlink("gone.safetensors", os.path.join(lora_folder, "dangling.safetensors"))
    made.add("dangling")
    with open(os.path.join(lora_folder, "huge.safetensors"), "wb") as f:
        f.truncate(1 << 40)  # 1 TB, sparse
    made.add("huge")
    return made


def _unblock(lora_folder: str) -> None:
    """Frees a reader stuck opening the FIFO (the bug this file guards against), so that teardown ends."""
    try:
        os.close(os.open(os.path.join(lora_folder, "fifo.safetensors"), os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


@pytest.fixture(scope="module")
def lora_folder(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hostile"))
    special = _special_files(root)
    yield root, special
    _unblock(root)


@pytest.fixture(scope="module")
def engine(lora_folder):
    root, _ = lora_folder
    with Engine("digits", device="cpu", lora_dir=root, max_loras=4, max_lora_rank=8) as e:
        for i, name in enumerate(ADAPTERS + ["hot"]):
            save_file(side_path_adapter(e, i, rank=4), os.path.join(root, f"{name}.safetensors"))
        yield e


def _in_thread(fn, *args):
    """fn(*args) on a thread, bounded: a call that blocks (a FIFO opened for reading) fails the test."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except Exception as e:  # raised again on the test's thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(BOUND_S)
    assert not t.is_alive(), f"{fn} blocked"
    if "error" in out:
        raise out["error"]
    return out["value"]


def _check_unusable(listing: dict, special: set[str]) -> None:
    unusable = {u["name"]: u["error"] for u in listing["unusable"]}
    for name in special:
        assert SPECIAL[name] in unusable.get(name, ""), (name, unusable.get(name))
    assert not special & {a["name"] for a in listing["data"]}
    assert set(ADAPTERS) <= {a["name"] for a in listing["data"]}


def test_special_files_are_unusable_and_never_block(engine, lora_folder):
    root, special = lora_folder
    _check_unusable(_in_thread(engine.loras), special)
    for name in special:
        with pytest.raises(ParamError, match=SPECIAL[name]) as info:
            _in_thread(lambda: engine.generate(PROMPT, num_inference_steps=1, loras=[(name, 1.0)]))
        assert info.value.param == "loras" and "did you mean" not in str(info.value)
    assert engine.generate(PROMPT, num_inference_steps=1, loras=[("a0", 1.0)]).arrays.std() > 0


class _Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kw):
        self.calls += 1
        return self.fn(*args, **kw)


def test_listings_read_each_file_version_once_and_keep_the_host_copies(engine, lora_folder, monkeypatch):
    import diffgraph.lora.files as files

    root, _ = lora_folder
    path = os.path.join(root, "a0.safetensors")
    original = open(path, "rb").read()
    st = os.stat(path)

    def garble():  # same size, inode and mtime: the same file version, whose bytes are no adapter any more
        with open(path, "r+b") as f:
            f.write(b"\xff" * len(original))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    try:
        first = engine.generate(PROMPT, num_inference_steps=1, seed=3, loras=[("a0", 1.0)]).arrays
        engine.loras()
        headers, bodies = _Counting(files.read_header), _Counting(files.TensorFile)
        monkeypatch.setattr(files, "read_header", headers)
        monkeypatch.setattr(files, "TensorFile", bodies)
        garble()
        listing = engine.loras()  # more adapters than host copies: a listing that read them would evict a0's
        assert (headers.calls, bodies.calls) == (0, 0)
        assert "a0" in {a["name"] for a in listing["data"]}
        again = engine.generate(PROMPT, num_inference_steps=1, seed=3, loras=[("a0", 1.0)]).arrays
        assert (again == first).all() and bodies.calls == 0  # the host copy a request made is still there
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new version: read (its header only)
        listing = engine.loras()
        assert (headers.calls, bodies.calls) == (1, 0)
        assert "not a readable safetensors file" in {u["name"]: u["error"] for u in listing["unusable"]}["a0"]
    finally:
        with open(path, "wb") as f:
            f.write(original)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.float8_e4m3fn, torch.complex64])
def test_adapters_that_are_not_floating_point_are_refused(engine, lora_folder, dtype):
    root, _ = lora_folder
    name = f"typed-{str(dtype).removeprefix('torch.')}"
    state = side_path_adapter(engine, 50, rank=4)
    key = next(iter(state))
    state[key] = state[key].to(dtype) if dtype != torch.bool else state[key] > 0
    save_file(state, os.path.join(root, f"{name}.safetensors"))
    try:
        with pytest.raises(ParamError, match=f"adapter '{name}': tensor '{key}'") as info:
            engine.generate(PROMPT, num_inference_steps=1, loras=[(name, 1.0)])
        assert "bf16, fp16 or fp32" in str(info.value)
        assert name in {u["name"] for u in engine.loras()["unusable"]}
    finally:
        os.remove(os.path.join(root, f"{name}.safetensors"))


def test_a_huge_but_finite_adapter_is_refused_by_name(engine, lora_folder):
    root, _ = lora_folder
    save_file(side_path_adapter(engine, 60, rank=4, scale=0.05 * 1e18), os.path.join(root, "loud.safetensors"))
    try:
        with pytest.raises(ParamError, match=r"adapter 'loud': unet\.\S+ changes its layer by up to") as info:
            engine.generate(PROMPT, num_inference_steps=1, loras=[("loud", 1.0)])
        assert info.value.param == "loras" and "above the limit" in str(info.value)
    finally:
        os.remove(os.path.join(root, "loud.safetensors"))


@pytest.fixture(scope="module")
def server(engine, lora_folder):
    root, _ = lora_folder
    s = ServerProcess("--lora-dir", root, "--max-loras", "4", "--max-lora-rank", "8", model="digits")
    try:
        s.wait_ready(BOUND_S)
        yield s
    finally:
        _unblock(root)
        s.stop(timeout=60)


def _post(server, name: str, seed: int = 0) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/images/generations", timeout=BOUND_S,
                      json={"prompt": PROMPT, "num_inference_steps": 1, "seed": seed, "loras": [{"name": name}]})


def test_a_file_rewritten_in_place_never_crashes_the_server(server, engine, lora_folder):
    root, special = lora_folder
    path = os.path.join(root, "hot.safetensors")
    versions = [open(path, "rb").read()]
    save_file(side_path_adapter(engine, 70, rank=4), path + ".b")
    versions.append(open(path + ".b", "rb").read())
    os.remove(path + ".b")

    def rewrite():  # as `cp new.safetensors hot.safetensors` does: truncate, then write in chunks
        for i in range(200):
            data = versions[i % 2]
            with open(path, "wb") as f:
                for at in range(0, len(data), 1 << 16):
                    f.write(data[at:at + (1 << 16)])
                    f.flush()

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda i: _post(server, "hot", seed=i), range(60)))
    finally:
        writer.join(BOUND_S)
    assert server.proc.poll() is None, server.output()[-3000:]
    for r in answers:
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            error = r.json()["error"]
            assert error["param"] == "loras" and "adapter 'hot'" in error["message"], error
    assert httpx.get(f"{server.url}/ready", timeout=BOUND_S).status_code == 200
    assert _post(server, "hot").status_code == 200  # the file as last written: served
    # the same server lists the special files as unusable (never blocking), answers /health, refuses a huge adapter
    listing = httpx.get(f"{server.url}/v1/loras", timeout=BOUND_S)
    assert listing.status_code == 200
    _check_unusable(listing.json(), special)
    assert httpx.get(f"{server.url}/health", timeout=BOUND_S).status_code == 200
    save_file(side_path_adapter(engine, 61, rank=4, scale=0.05 * 1e18), os.path.join(root, "loud2.safetensors"))
    try:
        r = _post(server, "loud2")
        assert r.status_code == 400 and "adapter 'loud2'" in r.json()["error"]["message"], r.text
    finally:
        os.remove(os.path.join(root, "loud2.safetensors"))


def test_replicas_list_special_files_as_unusable(engine, lora_folder):
    """With --devices cpu,cpu the HTTP process lists the folder itself (from the files' headers)."""
    root, special = lora_folder
    with ServerProcess("--devices", "cpu,cpu", "--lora-dir", root, "--max-loras", "4", "--max-lora-rank", "8",
                       model="digits") as s:
        r = httpx.get(f"{s.url}/v1/loras", timeout=BOUND_S)
        assert r.status_code == 200
        _check_unusable(r.json(), special)
        assert httpx.get(f"{s.url}/health", timeout=BOUND_S).status_code == 200
        bad = _post(s, "fifo")
        assert bad.status_code == 400 and "FIFO" in bad.json()["error"]["message"], bad.text


def test_an_added_file_is_read_into_memory_too(engine, lora_folder):
    """Engine.add_lora with a path reads the file as the lora dir's files are (checked, a private copy)."""
    root, _ = lora_folder
    path = os.path.join(root, "a1.safetensors")
    engine.add_lora("added/a1", path)
    try:
        ours = engine.generate(PROMPT, num_inference_steps=1, seed=5, loras=[("added/a1", 1.0)]).arrays
        same = engine.generate(PROMPT, num_inference_steps=1, seed=5, loras=[("a1", 1.0)]).arrays
        assert (ours == same).all()
        with pytest.raises(ParamError, match="FIFO"):
            engine.add_lora("added/fifo", os.path.join(root, "fifo.safetensors"))
    finally:
        engine.remove_lora("added/a1")


# -- listings while generations run: each 1-step generation starts together with 12 listings over 120 adapters,
# against the in-process app, on a cold cache (every file a new version) and warm. What is asserted is what bounds the
# listings' cost: no listing reads an adapter's weights; the headers are read once per file version however many
# listings ask (120 per cold sample, none warm); they are read on the manager's pool, never on the threads that serve
# or encode. The latency ratio against idle is printed, not asserted (STYLE.md: speed is measured by benchmarks).
MODEL = "digits"
LISTED_ADAPTERS = 120
LISTERS = 12
SAMPLES = 5
BODY = {"prompt": "a handwritten digit seven", "num_inference_steps": 1, "seed": 3}


class _Reads:
    """A file-reading function that records its calls' paths and threads."""

    def __init__(self, fn):
        self.fn, self.paths, self.threads, self.lock = fn, [], [], threading.Lock()

    def __call__(self, path, *args, **kw):
        with self.lock:
            self.paths.append(path)
            self.threads.append(threading.current_thread().name)
        return self.fn(path, *args, **kw)

    def count(self, root: str) -> int:
        with self.lock:
            return sum(p.startswith(root + os.sep) for p in self.paths)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from diffgraph.server import ServerConfig

    root = str(tmp_path_factory.mktemp("listings"))
    engine = Engine(MODEL, device="cpu", lora_dir=root, max_loras=4, max_lora_rank=16)  # the built-in lcm adapter is rank 16
    for i in range(LISTED_ADAPTERS):
        save_file(side_path_adapter(engine, i, layers=8), os.path.join(root, f"a{i:03d}.safetensors"))
    with served(engine, ServerConfig(model=MODEL, device="cpu", lora_dir=root)) as c:
        yield c, root


def _generation_s(client) -> float:
    t0 = time.perf_counter()
    r = client.post("/v1/images/generations", json=BODY)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t0


def _listing_ok(client) -> None:
    r = client.get("/v1/loras")
    assert r.status_code == 200, r.text
    listing = r.json()
    names = {a["name"] for a in listing["data"]}
    assert {f"a{i:03d}" for i in range(LISTED_ADAPTERS)} <= names and not listing["unusable"], listing["unusable"]


def _with_listings(client, new_versions: str | None = None) -> list[float]:
    """SAMPLES latencies of a generation started with LISTERS listings at once; with `new_versions` (the adapter
    folder), every file there gets a new version (mtime) before each sample, so that each sample's listings start
    on a cold cache."""
    out = []
    for sample in range(SAMPLES):
        if new_versions:
            for name in os.listdir(new_versions):
                path = os.path.join(new_versions, name)
                st = os.stat(path)
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        start, errors = threading.Barrier(LISTERS + 1), []

        def lister():
            try:
                start.wait(BOUND_S)
                _listing_ok(client)
            except BaseException as e:  # raised again on the test's thread
                errors.append(e)

        threads = [threading.Thread(target=lister, daemon=True) for _ in range(LISTERS)]
        for t in threads:
            t.start()
        start.wait(BOUND_S)
        out.append(_generation_s(client))
        for t in threads:
            t.join(BOUND_S)
        assert not any(t.is_alive() for t in threads), "a listing hung"
        if errors:
            raise errors[0]
    return out


def test_listings_during_generations_read_headers_once_and_no_weights(client, monkeypatch):
    import diffgraph.lora.files as files

    c, root = client
    _generation_s(c)  # warm-up (first-call costs)
    _listing_ok(c)
    idle = statistics.median(_generation_s(c) for _ in range(SAMPLES))
    headers, bodies = _Reads(files.read_header), _Reads(files.TensorFile)
    monkeypatch.setattr(files, "read_header", headers)
    monkeypatch.setattr(files, "TensorFile", bodies)

    cold = statistics.median(_with_listings(c, new_versions=root))
    # 12 listings: one read per version
    assert (headers.count(root), len(bodies.paths)) == (LISTED_ADAPTERS * SAMPLES, 0)
    warm = statistics.median(_with_listings(c))
    assert (headers.count(root), len(bodies.paths)) == (LISTED_ADAPTERS * SAMPLES, 0)
    # the headers are read on the adapter manager's own pool, never on the threads that serve requests or encode
    # their images (the 46 s: listings queued behind, and ahead of, every response's encoding)
    assert {name.rsplit("-", 1)[0] for name in headers.threads} == {"diffgraph-lora-files"}, set(headers.threads)
    print(f"\n1-step generation, median of {SAMPLES}: idle {idle * 1e3:.0f} ms; started with {LISTERS} listings "
          f"over {ADAPTERS} adapters: cold cache {cold * 1e3:.0f} ms ({cold / idle:.2f}x), warm {warm * 1e3:.0f} ms "
          f"({warm / idle:.2f}x)")
