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
