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


@pytest.fixture
def cut_on_load(monkeypatch):
    """`cut_on_load(cls, *paths)`: from then on `cls.from_pretrained` first truncates the files at `paths` (as
    `cp new old` or `rsync --inplace` starts rewriting them) and then reads. A loader that hands it the user's
    files reads them cut (or, mapped, dies of SIGBUS later); one that hands it private copies made before is
    untouched."""
    def cut_on_load(cls, *paths):
        read = cls.from_pretrained

        def cut_then_read(*args, **kwargs):
            for path in paths:
                with open(path, "r+b") as f:
                    f.truncate(0)
            return read(*args, **kwargs)
        monkeypatch.setattr(cls, "from_pretrained", cut_then_read)
    return cut_on_load


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
