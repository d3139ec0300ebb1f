import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def module_report(request):
    """Prints a test module's measured figures (its `REPORT` dict, filled by the tests that measure them) once the
    module's tests have run (`pytest -s` shows them); a fixture, so it asserts nothing and counts as no test."""
    yield
    report = getattr(request.module, "REPORT", None)
    if report:
        device = getattr(request.module, "DEVICE", None)
        print(f"\nREPORT of {request.module.__name__}" + (f" (device {device})" if device else ""))
        for k, v in report.items():
            print(f"  {k}: {v}")


@pytest.fixture(scope="session")
def tiny_engine():
    from diffgraph import Engine
    with Engine(model="random:tiny", device="cpu", dtype="fp32") as engine:
        yield engine


@pytest.fixture(scope="session")
def tiny_xl_engine():
    from diffgraph import Engine
    with Engine(model="random:tiny-xl", device="cpu", dtype="fp32") as engine:
        yield engine


@pytest.fixture(scope="module")
def digits_client():
    """A TestClient of the app on `digits` (CPU) in this process, with the default settings (--max-prompt-bytes
    4096); one per module that asks for it (tests/test_a1111.py, tests/test_server.py)."""
    from diffgraph import Engine
    from diffgraph.server import ServerConfig
    from server_util import served
    engine = Engine("digits", device="cpu")
    with served(engine, ServerConfig(model="digits", device="cpu")) as c:
        yield c


@pytest.fixture
def cut_while_loading(monkeypatch):
    """`cut_while_loading(*paths)`: the next time a streamed load (models/stream_load.py) has read a tensor of one of
    the files at `paths`, they are truncated (as `cp new old` or `rsync --inplace` starts rewriting them) while the
    rest is still to be read; once. Returns a list that holds the tensor's name once they are cut."""
    from diffgraph.models import stream_load

    def cut_while_loading(*paths):
        targets, cuts = {os.path.realpath(p) for p in paths}, []

        class CutWhileRead(stream_load.TensorFile):
            def read(self, keys=None, device=None, dtype=None):
                out = super().read(keys, device, dtype)
                if not cuts and os.path.realpath(self.path) in targets:
                    for path in paths:
                        with open(path, "r+b") as f:
                            f.truncate(0)
                    cuts.extend(out)
                return out
        monkeypatch.setattr(stream_load, "TensorFile", CutWhileRead)
        return cuts
    return cut_while_loading


@pytest.fixture
def no_huge_resizes(monkeypatch):
    """Fails any PIL resize to more than MAX_CONTROL_PIXELS (what an extreme aspect used to ask for: an 8x2M image
    for a 1024x1024 output is a 256Gpx intermediate) before it allocates."""
    from PIL import Image

    from diffgraph.request import MAX_CONTROL_PIXELS
    resize = Image.Image.resize

    def guarded(self, size, *args, **kwargs):
        assert size[0] * size[1] <= MAX_CONTROL_PIXELS, f"a {size[0]}x{size[1]} resize"
        return resize(self, size, *args, **kwargs)
    monkeypatch.setattr(Image.Image, "resize", guarded)


@pytest.fixture(scope="session")
def clients_url():
    """One server (random:tiny on the CPU, uvicorn in this process) for the unchanged clients' tests
    (tests/test_webuiapi_client.py, tests/test_openai_client.py): its URL. Its engine is its own (the app closes
    the engine it serves)."""
    from diffgraph import Engine
    from diffgraph.server import ServerConfig
    from server_util import listening
    with listening(ServerConfig(model="random:tiny", device="cpu"),
                   lambda: Engine(model="random:tiny", device="cpu", dtype="fp32")) as url:
        yield url
