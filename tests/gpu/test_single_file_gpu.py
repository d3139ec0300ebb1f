"""GPU tests of single-file checkpoints (issue 29): the full-size SD1.5 architecture written as one original-layout
fp16 file loads with its kind detected (no --model-config: the config folder diffgraph writes, with CLIP's real
tokenizer) onto the GPU with the folder's exact weights, and, read with the folder's config (its preset tokenizer),
gives the folder's image in graph mode. Each component is read straight to the GPU: the weights equal diffusers'
`from_single_file`'s moved there, and the host's peak memory grows by far less than the file."""

import dataclasses
import os
import sys

import numpy as np
import pytest
import torch

from diffgraph import Engine, GraphConfig
from diffgraph.config import LoadOptions
from diffgraph.models.loader import load_model
from diffgraph.models.presets import RANDOM_PRESETS, SD_SCHEDULER_CONFIG

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


def _from_single_file(path: str, folder: str, dtype: torch.dtype):
    """diffusers' own pipeline `from_single_file` (on the CPU, mapping the file): the oracle of the streamed load."""
    import json

    import diffusers

    name = json.load(open(os.path.join(folder, "model_index.json")))["_class_name"]
    extra = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False} \
        if name == "StableDiffusionPipeline" else {}
    return getattr(diffusers, name).from_single_file(path, config=folder, local_files_only=True, torch_dtype=dtype,
                                                     **extra)


def _tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


@pytest.mark.parametrize("kind,dtype", [("sd1", "fp16"), ("sd1", "fp32"), ("sd2", "fp16"), ("sdxl", "fp16"),
                                        ("sdxl", "fp32")])
def test_a_single_file_read_to_the_gpu_equals_from_single_file_moved_there(tmp_path, monkeypatch, kind, dtype):
    """Each component read straight to the GPU and made there (CLIP-L, OpenCLIP and SDXL's two encoders among
    them) holds diffusers' `from_single_file` weights, moved to the GPU, in value, dtype and device."""
    monkeypatch.setenv("DIFFGRAPH_CACHE", str(tmp_path / "cache"))
    folder = O.variant_folder(str(tmp_path), kind)
    path = str(tmp_path / f"{kind}.safetensors")
    O.write_single_file(folder, path, O.VARIANTS[kind][1], dtype=torch.float16)
    m = load_model(path, DEVICE, dtype, options=LoadOptions(model_config=folder))
    pipe = _from_single_file(path, folder, {"fp32": torch.float32, "fp16": torch.float16}[dtype]).to(DEVICE)
    theirs = (pipe.unet, pipe.vae, pipe.text_encoder, *([pipe.text_encoder_2] if kind == "sdxl" else []))
    for a, b in zip((m.denoiser, m.vae, *m.text_encoders), theirs, strict=True):
        x, y = _tensors(a), _tensors(b)
        assert x.keys() == y.keys() and x
        assert all(x[k].device == y[k].device and x[k].device.type == "cuda" for k in y)
        assert all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in y)


# SD1.5's architecture with its UNet's channels narrowed (full VAE and CLIP-L): a single file of about 1.2 GB in fp16
NARROW_SD15 = dataclasses.replace(RANDOM_PRESETS["random:sd15"], name="sd15-narrow",
                                  unet={**RANDOM_PRESETS["random:sd15"].unet,
                                        "block_out_channels": (224, 448, 896, 896)})

# Run in a fresh process: a tiny single file loaded first (imports, CUDA context, kernels), then the peak resident
# set (VmHWM) and the peak GPU memory of loading the big one, each beyond its value before
MEASURE = r"""
import json, sys
import torch
from diffgraph.config import LoadOptions
from diffgraph.models.loader import load_model
path, folder, tiny, tiny_folder, device = sys.argv[1:]
def hwm():  # this process's peak resident set in bytes (ru_maxrss would start at the forking parent's)
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
load_model(tiny, device, "fp16", options=LoadOptions(model_config=tiny_folder))
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
gpu_before = torch.cuda.memory_allocated()
host_before = hwm()
m = load_model(path, device, "fp16", options=LoadOptions(model_config=folder))
torch.cuda.synchronize()
host = hwm() - host_before
sizes = [sum(t.numel() * t.element_size() for t in (*p.parameters(), *p.buffers()))
         for p in (m.denoiser, m.vae, *m.text_encoders)]
print(json.dumps({"host_growth": host, "gpu_peak": torch.cuda.max_memory_allocated() - gpu_before,
                  "model": sum(sizes), "largest_component": max(sizes)}))
"""


def test_a_single_file_loads_to_the_gpu_with_the_host_holding_one_chunk_buffer(tmp_path, monkeypatch):
    """A ~1.2 GB fp16 single file loaded to the GPU: the host's peak resident set grows by far less than the file
    (every chunk passes through one host buffer of at most 64 MiB), the GPU's peak allocation is at most the model
    plus one component, and the weights equal diffusers' `from_single_file`'s."""
    import json
    import subprocess

    from diffgraph.models.tokenizer import preset_tokenizer

    monkeypatch.setenv("DIFFGRAPH_CACHE", str(tmp_path / "cache"))
    unet, vae, encoders = O.build_modules(NARROW_SD15, DEVICE)
    folder, path = str(tmp_path / "sd15-narrow"), str(tmp_path / "sd15-narrow.safetensors")
    O.pipeline_of(unet.half(), vae.half(), [e.half() for e in encoders],
                  [preset_tokenizer(p) for p in NARROW_SD15.tokenizer_pads], dict(SD_SCHEDULER_CONFIG),
                  force_zeros=False).save_pretrained(folder, safe_serialization=True)
    del unet, vae, encoders
    O.write_single_file(folder, path, "sd1", dtype=torch.float16)
    size = os.path.getsize(path)
    assert 1 << 30 < size < 2 << 30
    tiny_folder = O.variant_folder(str(tmp_path), "sd1")
    tiny = str(tmp_path / "tiny.safetensors")
    O.write_single_file(tiny_folder, tiny, "sd1", dtype=torch.float16)
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", MEASURE, path, folder, tiny, tiny_folder, DEVICE], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"file {size} bytes: {figures}")
    assert figures["host_growth"] < size / 4, figures
    assert figures["gpu_peak"] <= figures["model"] + figures["largest_component"] + (64 << 20), figures
    m = load_model(path, DEVICE, "fp16", options=LoadOptions(model_config=folder))
    pipe = _from_single_file(path, folder, torch.float16).to(DEVICE)
    for a, b in zip((m.denoiser, m.vae, *m.text_encoders), (pipe.unet, pipe.vae, pipe.text_encoder), strict=True):
        x, y = _tensors(a), _tensors(b)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in y)
