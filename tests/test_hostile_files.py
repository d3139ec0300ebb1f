"""Adapter files that change under the server or are not what their names say (issue 36, point 1 and adapter part
of point 3): a file rewritten in place while requests read it never crashes the server (each request ends with an
image or a 400, and it serves after); a FIFO, a device node, a socket, a dangling link and a 1 TB sparse file in
--lora-dir are listed as unusable with the reason and never block, in-process, over HTTP and with replicas in
other processes; listings read headers only, once per file version, and never evict the host copies requests
use; integer, bool, fp8 and complex adapters and huge-but-finite ones are a 400 naming the adapter.

Failure bounds (BOUND_S) are bounds on a hang, never timing assumptions."""

from __future__ import annotations

import os
import socket
import stat
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from safetensors.torch import save_file

from diffgraph import Engine
from diffgraph.request import ParamError
from diffgraph.server.process import ServerProcess

PROMPT = "a handwritten digit seven"
BOUND_S = 300
ADAPTERS = [f"a{i}" for i in range(6)]  # more than the engine's 4 slots (and host copies)
# name -> what its unusable entry says
SPECIAL = {"fifo": "FIFO", "device": "character device", "sock": "socket", "dangling": "dangling link",
           "huge": "above the limit"}


def _state(engine: Engine, seed: int, scale: float = 0.05, dtype: torch.dtype = torch.float32) -> dict:
    """A rank-4 diffusers/PEFT-layout adapter on every UNet side path of `engine`."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for path, slot in engine.runner.loras.banks["unet"].layers.items():
        a = torch.randn(4, slot.a.shape[2], generator=g) * scale
        b = torch.randn(slot.b.shape[2], 4, generator=g) * scale
        out[f"unet.{path}.lora_A.weight"], out[f"unet.{path}.lora_B.weight"] = a.to(dtype), b.to(dtype)
    return out


def _special_files(folder: str) -> set[str]:
    """The entries of SPECIAL that this machine lets us make (a device node needs CAP_MKNOD, a socket a short
    path)."""
    made = set()
    os.mkfifo(os.path.join(folder, "fifo.safetensors"))
    made.add("fifo")
    try:
        os.mknod(os.path.join(folder, "device.safetensors"), stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null
        made.add("device")
    except (PermissionError, OSError):
        pass
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(os.path.join(folder, "sock.safetensors"))
        made.add("sock")
    except OSError:  # (a path longer than a socket address allows)
        pass
    os.symlink("gone.safetensors", os.path.join(folder, "dangling.safetensors"))
    made.add("dangling")
    with open(os.path.join(folder, "huge.safetensors"), "wb") as f:
        f.truncate(1 << 40)  # 1 TB, sparse
    made.add("huge")
    return made


def _unblock(folder: str) -> None:
    """Frees a reader stuck opening the FIFO (the bug this file guards against), so that teardown ends."""
    try:
        os.close(os.open(os.path.join(folder, "fifo.safetensors"), os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hostile"))
    special = _special_files(root)
    yield root, special
    _unblock(root)


@pytest.fixture(scope="module")
def engine(folder):
    root, _ = folder
    with Engine("digits", device="cpu", lora_dir=root, max_loras=4, max_lora_rank=8) as e:
        for i, name in enumerate(ADAPTERS + ["hot"]):
            save_file(_state(e, seed=i), os.path.join(root, f"{name}.safetensors"))
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


def test_special_files_are_unusable_and_never_block(engine, folder):
    root, special = folder
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


def test_listings_read_each_file_version_once_and_keep_the_host_copies(engine, folder, monkeypatch):
    import diffgraph.lora.files as files

    root, _ = folder
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
def test_adapters_that_are_not_floating_point_are_refused(engine, folder, dtype):
    root, _ = folder
    name = f"typed-{str(dtype).removeprefix('torch.')}"
    state = _state(engine, seed=50)
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


def test_a_huge_but_finite_adapter_is_refused_by_name(engine, folder):
    root, _ = folder
    save_file(_state(engine, seed=60, scale=0.05 * 1e18), os.path.join(root, "loud.safetensors"))
    try:
        with pytest.raises(ParamError, match=r"adapter 'loud': unet\.\S+ changes its layer by up to") as info:
            engine.generate(PROMPT, num_inference_steps=1, loras=[("loud", 1.0)])
        assert info.value.param == "loras" and "above the limit" in str(info.value)
    finally:
        os.remove(os.path.join(root, "loud.safetensors"))


def test_a_file_that_grows_while_read_is_refused():
    """safe_tensors: a file appended to while it is read raises FileChanged (or reads as not safetensors)."""
    import tempfile

    from diffgraph.safe_files import FileChanged, NotSafetensors
    from diffgraph.safe_tensors import read_safetensors

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "grow.safetensors")
        save_file({"x": torch.zeros(1 << 18)}, path)
        stop = threading.Event()

        def grow():
            with open(path, "ab") as f:
                while not stop.is_set():
                    f.write(b"\0" * 4096)
                    f.flush()

        size = os.path.getsize(path)
        t = threading.Thread(target=grow, daemon=True)
        t.start()
        try:
            for _ in range(BOUND_S * 100):  # until it has begun to grow
                if os.path.getsize(path) > size:
                    break
                threading.Event().wait(0.01)
            for _ in range(5):
                with pytest.raises((FileChanged, NotSafetensors)):
                    read_safetensors(path, 1 << 30)
        finally:
            stop.set()
            t.join(BOUND_S)


@pytest.mark.parametrize("header, words", [
    (b'{"x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "its header nests JSON deeper than 3 levels"),
    (b'{"x": {"dtype": "F32", "shape": [[[1]]], "data_offsets": [0, 4]}}', "its header nests JSON deeper than 3"),
    (b'{"x": {"dtype": "F32", "shape": [' + b"1, " * 16 + b'1], "data_offsets": [0, 4]}}', "at most 16 dimensions"),
    (b'{"' + b"x" * 5000 + b'": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', "at most 4096 characters"),
    (b'{"x": {"dtype": "' + b"F" * 5000 + b'", "shape": [1], "data_offsets": [0, 4]}}', "at most 4096 characters"),
    (b"{" + b", ".join(b'"t%d": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}' % i for i in range(9)) + b"}",
     "lists 9 tensors, above the limit of 8"),
], ids=["200000-brackets", "nested-shape", "17-dims", "long-name", "long-dtype", "9-tensors"])
def test_safetensors_headers_are_bounded_before_they_are_used(tmp_path, monkeypatch, header, words):
    """safe_files: a header's nesting, tensor count, dimensions and names are bounded; each is a NotSafetensors
    naming the bound (a header of 200,000 brackets was a RecursionError out of every listing that read it)."""
    from diffgraph import safe_files

    monkeypatch.setattr(safe_files, "MAX_TENSORS", 8)
    path = tmp_path / "x.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    with pytest.raises(safe_files.NotSafetensors, match=words):
        safe_files.read_header(str(path), 1 << 30)


def test_json_from_a_folder_is_parsed_with_a_depth_limit(tmp_path):
    from diffgraph.safe_files import NotJson, parse_json, read_json

    assert parse_json(b'{"a": [1, {"b": 2}]}', max_depth=3) == {"a": [1, {"b": 2}]}
    for text, words in (("[" * 200_000 + "]" * 200_000, "deeper than 64 levels"),
                        ("[" * 65 + "]" * 65, "deeper than 64"), ("{not json", "is not valid JSON")):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(NotJson, match=words):
            read_json(str(tmp_path / "config.json"), 1 << 30)
    assert parse_json("[" * 64 + "]" * 64)  # the limit itself is allowed


def test_the_file_pool_bounds_each_read_in_time():
    from diffgraph.safe_files import FileReader, ReadTimeout

    release = threading.Event()
    reader = FileReader(workers=1, timeout=0.05)
    try:
        with pytest.raises(ReadTimeout, match="stalled"):  # a read stuck on a dead disk
            reader.call(release.wait, BOUND_S, what="reading x")
        with pytest.raises(ReadTimeout):  # queued behind it on the bounded pool: also bounded
            reader.call(lambda: 1)
    finally:
        release.set()
    assert FileReader(workers=1, timeout=BOUND_S).call(lambda: 7) == 7


@pytest.fixture(scope="module")
def server(engine, folder):
    root, _ = folder
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


def test_a_file_rewritten_in_place_never_crashes_the_server(server, engine, folder):
    root, special = folder
    path = os.path.join(root, "hot.safetensors")
    versions = [open(path, "rb").read()]
    save_file(_state(engine, seed=70), path + ".b")
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
    save_file(_state(engine, seed=61, scale=0.05 * 1e18), os.path.join(root, "loud2.safetensors"))
    try:
        r = _post(server, "loud2")
        assert r.status_code == 400 and "adapter 'loud2'" in r.json()["error"]["message"], r.text
    finally:
        os.remove(os.path.join(root, "loud2.safetensors"))


def test_replicas_list_special_files_as_unusable(engine, folder):
    """With --devices cpu,cpu the HTTP process lists the folder itself (from the files' headers)."""
    root, special = folder
    with ServerProcess("--devices", "cpu,cpu", "--lora-dir", root, "--max-loras", "4", "--max-lora-rank", "8",
                       model="digits") as s:
        r = httpx.get(f"{s.url}/v1/loras", timeout=BOUND_S)
        assert r.status_code == 200
        _check_unusable(r.json(), special)
        assert httpx.get(f"{s.url}/health", timeout=BOUND_S).status_code == 200
        bad = _post(s, "fifo")
        assert bad.status_code == 400 and "FIFO" in bad.json()["error"]["message"], bad.text


def test_an_added_file_is_read_into_memory_too(engine, folder):
    """Engine.add_lora with a path reads the file as the lora dir's files are (checked, a private copy)."""
    root, _ = folder
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
