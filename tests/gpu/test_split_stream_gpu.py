"""GPU test (marker `gpu`): split DiT files streamed to CUDA (models/split_stream.py). A Z-Image transformer file of
~400 MiB (bf16, ComfyUI's layout; written by tools/bench_split_load.py in a subprocess, so this process never held
its weights) loads with the device's peak allocation at most what the load leaves allocated plus its largest
tensor (plus 4 MiB), what it leaves being the module's bytes and the caching allocator's tails (under 1 MiB a
tensor over 1 MiB), the host's peak RSS growing by one tensor plus the reader's chunk (plus a margin), well under the file, and equals the
module loaded on the host; a tiny Z-Image's three split files load_split to CUDA and equal the same files loaded on
the host."""

import os
import resource
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the tiny modules

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("DIFFGRAPH_TEST_DEVICE", "cuda")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 1 << 20


def _same(got: torch.nn.Module, want: torch.nn.Module) -> None:
    mine, theirs = got.state_dict(), want.state_dict()
    assert sorted(mine) == sorted(theirs)
    for name, value in theirs.items():
        assert mine[name].device.type == "cuda" and mine[name].dtype == value.dtype, name
        assert torch.equal(mine[name].cpu(), value), name


def test_streamed_to_the_gpu_holds_the_module_plus_one_tensor(tmp_path, monkeypatch):
    from diffusers import ZImageTransformer2DModel  # noqa: F401 (imported before the baseline)

    from diffgraph.models import split_stream
    from diffgraph.safe_tensors import TensorFile

    path = str(tmp_path / "z_image_bench_bf16.safetensors")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_split_load.py"), "--file", path, "--gb", "0.4",
                    "--dim", "1024", "--write-only"], check=True,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(
                       filter(None, [os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH")]))})
    with TensorFile(path) as f:
        largest = max(t.end - t.begin for t in f.header.tensors.values())
    size = os.path.getsize(path)
    device = torch.device(DEVICE)
    torch.zeros(1, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    built = {}
    check_places = split_stream._check_places

    def at_build(*args):  # the module built (meta parameters, its buffers on the device): the reads start after
        torch.cuda.synchronize(device)
        built.update(peak=torch.cuda.max_memory_allocated(device) - start, held=torch.cuda.memory_allocated(device) - start)
        torch.cuda.reset_peak_memory_stats(device)
        return check_places(*args)

    monkeypatch.setattr(split_stream, "_check_places", at_build)
    model, _ = split_stream.load_transformer(path, torch.bfloat16, device)
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - start
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss
    peak = torch.cuda.max_memory_allocated(device) - start
    module = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(f"file {size / MIB:.0f} MiB, module {module / MIB:.1f} MiB, largest {largest / MIB:.1f} MiB, device peak "
          f"while read {peak / MIB:.1f} MiB, while built {built['peak'] / MIB:.1f} MiB (held after it "
          f"{built['held'] / MIB:.1f} MiB), held after the load {held / MIB:.1f} MiB, host maxrss growth {grown / MIB:.1f} MiB")
    assert module > 0.9 * size
    assert built["peak"] <= 16 * MIB, built  # the build's buffers and their temporaries, no parameter
    # What the load leaves allocated is the module, each tensor over 1 MiB in a block of at most 1 MiB more: the
    # caching allocator hands a freed block (a fused qkv read, its parts copied out) to a smaller tensor whole when
    # the rest would be under 1 MiB (kSmallSize), and counts the block.
    large = sum(1 for t in model.state_dict().values() if t.numel() * t.element_size() > MIB)
    assert module <= held <= module + large * MIB, (held, module, large)
    assert peak <= held + built["held"] + largest + 4 * MIB, (peak, held, built, largest)
    assert grown <= largest + 64 * MIB + 128 * MIB < size, grown  # one tensor, the reader's chunk, CUDA's kernels
    _same(model, split_stream.load_transformer(path, torch.bfloat16, "cpu")[0])


def test_tiny_split_files_load_to_the_gpu_equal_to_the_host(tmp_path):
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file

    from diffgraph.models.families import default_registry
    from diffgraph.models.families.zimage import FLUX_VAE
    from diffgraph.models.original_layout import vae_original
    from diffgraph.models.split_files import SPLIT_KINDS, SplitFiles
    from test_zimage_files import tiny_qwen3, tiny_transformer, to_original

    paths = [str(tmp_path / n) for n in ("z_image_turbo.safetensors", "qwen_3.safetensors", "ae.safetensors")]
    save_file(to_original(tiny_transformer().state_dict()), paths[0])
    save_file({f"model.{k}": v.contiguous() for k, v in tiny_qwen3().state_dict().items()}, paths[1])
    vae = AutoencoderKL(**{**FLUX_VAE, "block_out_channels": (32, 32, 32, 32), "layers_per_block": 1})
    save_file({k: v.contiguous() for k, v in vae_original(vae.state_dict(), 4).items()}, paths[2])
    files = SplitFiles(next(k for k in SPLIT_KINDS if k.family == "zimage"), *paths, ())
    family = default_registry().by_name("zimage")
    got = family.load_split(files, torch.device(DEVICE), torch.bfloat16, paths[0])
    want = family.load_split(files, torch.device("cpu"), torch.bfloat16, paths[0])
    for a, b in ((got.denoiser, want.denoiser), (got.text_encoders[0], want.text_encoders[0]), (got.vae, want.vae)):
        _same(a, b)
