"""GPU tests of single-file checkpoints (issue 29): the full-size SD1.5 architecture written as one original-layout
fp16 file loads with its kind detected (no --model-config: the config folder diffgraph writes, with CLIP's real
tokenizer) onto the GPU with the folder's exact weights, and, read with the folder's config (its preset tokenizer),
gives the folder's image in graph mode."""

import os
import sys

import numpy as np
import pytest
import torch

from diffgraph import Engine, GraphConfig
from diffgraph.config import LoadOptions
from diffgraph.models.loader import load_model

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import original_layout as O  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("DIFFGRAPH_TEST_DEVICE", "cuda")


def test_a_full_size_sd15_single_file_gives_the_folders_image(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFGRAPH_CACHE", str(tmp_path / "cache"))
    folder = O.write_folder(load_model("random:sd15", DEVICE, "fp16"), str(tmp_path / "sd15"))
    path = str(tmp_path / "sd15.safetensors")
    O.write_single_file(folder, path, "sd1", dtype=torch.float16)
    detected, ref = load_model(path, DEVICE, "fp16"), load_model(folder, DEVICE, "fp16")
    assert detected.tokenizers[0]("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    for a, b in ((detected.unet, ref.unet), (detected.vae, ref.vae), (detected.text_encoders[0], ref.text_encoders[0])):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sb)
    del detected, ref
    images = []
    for source, load in ((path, LoadOptions(model_config=folder)), (folder, None)):
        with Engine(source, device=DEVICE, graphs=GraphConfig(batch_buckets=(1, 2), prewarm=False),
                    load=load) as engine:
            assert engine.model.family == "sd" and engine.model.native_size == 512
            assert next(engine.model.denoiser.parameters()).dtype == torch.float16
            images.append(np.asarray(engine.generate("a photo of a cat", seed=5, num_inference_steps=4)[0]))
    assert np.array_equal(images[0], images[1])
