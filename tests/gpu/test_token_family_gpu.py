"""GPU test (marker `gpu`): the test-only DiT family (tests/test_token_family.py) in graph mode on CUDA. Rows of three
sizes of one token bucket share the step graphs captured for the bucket's group key (0, 64), and each image equals
the eager engine's within one uint8 level."""

import json
import os

import numpy as np
import pytest

from diffgraph import Engine, GenerationRequest, GraphConfig
from diffgraph.models.families import default_registry

from test_token_family import MODEL_SEED, REQUESTS, SIZES, TinyDiTFamily

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("DIFFGRAPH_TEST_DEVICE", "cuda")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tinydit")
    (path / "model_index.json").write_text(json.dumps({"_class_name": "TinyDiTPipeline", "seed": MODEL_SEED}))
    return str(path)


def _run(engine):
    futures = []
    requests = [GenerationRequest.create(prompt=r["prompt"], negative_prompt=r["negative_prompt"] or None,
                                         height=r["size"][0], width=r["size"][1], num_inference_steps=r["steps"],
                                         guidance_scale=r["guidance"], seed=r["seed"], model=engine.info)
                for r in REQUESTS]
    engine.core.call_between_steps(lambda: futures.extend(engine.submit(r) for r in requests)).result()
    return [f.result(timeout=600).arrays[0] for f in futures]


def test_sizes_of_one_bucket_replay_one_group_s_graphs(folder):
    families = default_registry()
    families.register(TinyDiTFamily())
    cfg = GraphConfig(batch_buckets=(1, 2, 4, 8), resolutions=tuple(SIZES), prewarm=False, verify=True)
    with Engine(model=folder, families=families, device=DEVICE, dtype="fp32") as eager:
        want = _run(eager)
    with Engine(model=folder, families=families, device=DEVICE, dtype="fp32", mode="graph", graphs=cfg) as graphed:
        assert graphed.runner.graphed_resolutions() == ((0, 64),)
        got = _run(graphed)
        steps = [row for row in graphed.runner.graph_table() if row["kind"] == "step" and row["replays"]]
    assert steps and all((row["height"], row["width"]) == (0, 64) for row in steps), steps
    for a, b in zip(got, want):
        assert np.abs((a * 255).round() - (b * 255).round()).max() <= 1
