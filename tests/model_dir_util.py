"""Files for the `--model-dir` tests (tests/test_model_dir.py, test_split_files.py)."""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file


def _checkpoint(path, fill: float) -> None:
    """A few-byte safetensors file the catalog reads as an SD1 checkpoint (test_model_catalog.py's keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(path) + ".tmp"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(1, 4, 1, 1, dtype=torch.float16),
               "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight": torch.zeros(1, 1),
               "first_stage_model.decoder.conv_in.weight": torch.full((1, 1), fill)}, tmp)
    os.replace(tmp, path)  # as a copy tool finishes: a new file under the old name
