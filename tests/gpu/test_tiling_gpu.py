"""GPU tests (marker `gpu`, skipped without CUDA): AUTOMATIC1111's tiling in real CUDA graphs. A tiling request replays
its own step and VAE graphs (captured on first use, with the convolutions padding circularly) and its image equals
the eager engine's; plain requests around it replay the plain graphs and keep their images; tiling and plain rows
submitted together each equal alone."""

import os

import numpy as np
import pytest
import torch

from diffgraph import Engine, GraphConfig

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("DIFFGRAPH_TEST_DEVICE", "cuda")
PROMPT = "a seamless texture of mossy stones"


@pytest.fixture(scope="module")
def engines():
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((512, 512),))
    graph = Engine(model="random:sd15", device=DEVICE, dtype="fp16", mode="graph", graphs=cfg)
    eager = Engine(model=graph.model, device=DEVICE, dtype="fp16", mode="eager")
    yield graph, eager
    eager.close()
    graph.close()


def _levels(a, b) -> float:
    return float(np.abs(a.astype(np.float32) - b.astype(np.float32)).max() * 255)


def test_tiling_replays_its_own_graphs_and_equals_eager(engines):
    graph, eager = engines
    plain_before = graph.generate(PROMPT, num_inference_steps=6, seed=1).arrays
    tiled = graph.generate(PROMPT, num_inference_steps=6, seed=1, tiling=True).arrays
    plain_after = graph.generate(PROMPT, num_inference_steps=6, seed=1).arrays
    replays = {r["kind"]: r["replays"] for r in graph.graph_table() if r["replays"]}
    assert replays.get("step_tiling", 0) >= 6 and replays.get("vae_tiling", 0) >= 1, replays
    np.testing.assert_array_equal(plain_before, plain_after)  # no padding mode left in the plain graphs
    assert _levels(tiled, eager.generate(PROMPT, num_inference_steps=6, seed=1, tiling=True).arrays) <= 2.0
    assert _levels(tiled, plain_before) > 10
    convs = [m for m in graph.model.denoiser.modules() if isinstance(m, torch.nn.Conv2d)]
    assert {m.padding_mode for m in convs} == {"zeros"}


def test_tiling_and_plain_rows_together_each_equal_alone(engines):
    graph, _ = engines
    requests = [graph.make_request(PROMPT, num_inference_steps=6, seed=10 + i, tiling=i % 2 == 0) for i in range(4)]
    alone = [graph.run(r).arrays for r in requests]
    both = [f.result().arrays for f in [graph.submit(r) for r in requests]]
    for a, b in zip(alone, both):
        assert _levels(a, b) <= 2.0
