"""The models of a --model-dir folder (diffgraph.models.catalog, issue 29 point 3): names and nesting, the name rules,
links out of the folder left out, FIFOs never opened, pickles, LoRAs and truncated files listed with why they cannot
be served, diffusers folders, kinds / families / native sizes from headers, headers read once per file version,
the CLI listing (with hashes: test_file_hashes.py has their cache), and no torch in the importing process; odd
checkpoint headers are one-line errors and the listing survives them."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import save_file

from diffgraph.models import catalog
from diffgraph.models.catalog import (ModelDir, ModelNameError, ModelNotFound, ModelUnusable, native_size_of,
                                      pipeline_family, print_model_dir, supported_pipelines)
from diffgraph.models.checkpoint_configs import KINDS, folder_files
from diffgraph.models.checkpoint_kind import inspect_checkpoint
from diffgraph.models.presets import shipped_preset_folder

UNET = "model.diffusion_model.input_blocks.0.0.weight"
SD1_TEXT = "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight"
SDXL_TEXT = "conditioner.embedders.1.model.token_embedding.weight"
VAE = "first_stage_model.decoder.conv_in.weight"


def checkpoint(path, text_key=SD1_TEXT, channels=4):
    """A valid safetensors file with the keys and shapes checkpoint_kind.classify reads (it reads the first conv's
    input channels and the presence of the others): a few bytes, not gigabytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({UNET: torch.zeros(1, channels, 1, 1, dtype=torch.float16), text_key: torch.zeros(1, 1),
               VAE: torch.zeros(1, 1)}, str(path))
    return path


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "models"
    checkpoint(root / "sd15.safetensors")
    checkpoint(root / "sdxl" / "juggernaut.safetensors", SDXL_TEXT)
    checkpoint(root / "sdxl" / "deep" / "inpaint.safetensors", SDXL_TEXT, channels=9)
    shutil.copytree(shipped_preset_folder("digits"), root / "sub" / "digits")
    save_file({"lora_unet_x.lora_down.weight": torch.zeros(2, 2), "lora_unet_x.lora_up.weight": torch.zeros(2, 2)},
              str(root / "styles.safetensors"))
    (root / "old.ckpt").write_bytes(b"PK\x03\x04 not unpickled")
    (root / "notes.txt").write_text("not a model")
    outside = checkpoint(tmp_path / "outside.safetensors")
    os.symlink(outside, root / "escape.safetensors")
    os.symlink(root / "sd15.safetensors", root / "alias.safetensors")  # a link inside the folder is served
    return root


def test_listing_names_kinds_families_and_sizes(folder):
    entries = {e.name: e for e in ModelDir(str(folder)).listing()}
    # the link out of the folder is left out, notes.txt is no model, the digits folder's weights are not models
    assert list(entries) == ["alias", "old.ckpt", "sd15", "sdxl/deep/inpaint", "sdxl/juggernaut", "styles",
                             "sub/digits"]
    sd = entries["sd15"]
    assert (sd.form, sd.kind, sd.family, sd.native_size, sd.error) == ("file", "sd1", "sd", 512, None)
    assert sd.path == str((folder / "sd15.safetensors").resolve())
    assert sd.size_bytes == os.path.getsize(sd.path) and sd.stamp.size == sd.size_bytes
    assert sd.description == "SD1.x (512, epsilon)"
    assert entries["alias"].path == sd.path and entries["alias"].kind == "sd1"
    xl = entries["sdxl/juggernaut"]
    assert (xl.kind, xl.family, xl.native_size) == ("sdxl-base", "sdxl", 1024)
    assert (entries["sdxl/deep/inpaint"].kind, entries["sdxl/deep/inpaint"].family) == ("sdxl-inpaint", "sdxl")
    digits = entries["sub/digits"]
    assert (digits.form, digits.kind, digits.family, digits.native_size, digits.error) == \
        ("folder", "StableDiffusionPipeline", "sd", 64, None)
    assert digits.path == str(folder / "sub" / "digits")
    assert digits.stamp.size == os.path.getsize(folder / "sub" / "digits" / "model_index.json")
    assert digits.size_bytes == sum(os.path.getsize(os.path.join(d, f))
                                    for d, _, fs in os.walk(folder / "sub" / "digits") for f in fs)
    assert "looks like a LoRA adapter" in entries["styles"].error and entries["styles"].kind is None
    old = entries["old.ckpt"]
    assert "pickle checkpoint" in old.error and "diffgraph convert" in old.error
    assert old.size_bytes == len(b"PK\x03\x04 not unpickled")


def test_unservable_entries_say_why(folder):
    good = (folder / "sd15.safetensors").read_bytes()
    (folder / "cut.safetensors").write_bytes(good[:-3])
    os.symlink(folder / "gone.safetensors", folder / "dangling.safetensors")
    (folder / "sd3").mkdir()
    (folder / "sd3" / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    (folder / "broken").mkdir()
    (folder / "broken" / "model_index.json").write_text("{not json")
    checkpoint(folder / "twin.safetensors")
    shutil.copytree(shipped_preset_folder("digits"), folder / "twin")
    listing = ModelDir(str(folder)).listing()
    twins = [e for e in listing if e.name == "twin"]
    assert [e.form for e in twins] == ["file", "folder"]
    assert {e.error for e in twins} == {"'twin' names both a .safetensors file and a diffusers folder; rename one"}
    with pytest.raises(ModelUnusable, match="rename one"):
        ModelDir(str(folder)).resolve("twin")
    entries = {e.name: e for e in listing}
    assert "truncated" in entries["cut"].error
    assert "dangling link" in entries["dangling"].error and entries["dangling"].stamp is None
    sd3 = entries["sd3"]
    assert (sd3.kind, sd3.family, sd3.native_size) == ("StableDiffusion3Pipeline", None, None)
    assert "supported: StableDiffusionXLPipeline" in sd3.error
    assert entries["broken"].error.startswith("broken/model_index.json is not valid JSON (")


def test_a_deeply_nested_json_file_costs_its_own_entry_only(folder):
    (folder / "deep").mkdir()
    (folder / "deep" / "model_index.json").write_text("[" * 200_000 + "]" * 200_000)  # was a RecursionError
    shutil.copytree(shipped_preset_folder("digits"), folder / "configs")
    (folder / "configs" / "unet" / "config.json").write_text('{"a": ' * 200_000 + "1" + "}" * 200_000)
    (folder / "nested.safetensors").write_bytes(_header_file(b'{"t": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"))
    d = ModelDir(str(folder))
    entries = {e.name: e for e in d.listing()}
    assert entries["deep"].error == ("deep/model_index.json nests JSON deeper than 64 levels (the limit for this "
                                     "file; a damaged or hostile one): copy or download it again")
    assert "nests JSON deeper than 3 levels" in entries["nested"].error
    assert entries["configs"].error == ("configs/unet/config.json nests JSON deeper than 64 levels (the limit for "
                                        "this file; a damaged or hostile one): copy or download it again")
    assert entries["sd15"].error is None and d.resolve("sd15").kind == "sd1"
    with pytest.raises(ModelUnusable, match="deeper than 64 levels"):
        d.resolve("deep")



@pytest.mark.parametrize("file", ["tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"])
def test_a_folder_whose_tokenizer_json_nests_too_deep_costs_its_own_entry_and_is_parsed_once_a_version(
        folder, monkeypatch, file):
    """transformers parses a tokenizer's JSON without a depth limit (200,000 brackets: a RecursionError when the
    model loaded); the listing names the file on that entry, serves the others, and parses each JSON file once per
    version."""
    from diffgraph import safe_files

    shutil.copytree(shipped_preset_folder("digits"), folder / "deep")
    (folder / "deep" / file).write_text("[" * 200_000 + "]" * 200_000)
    d = ModelDir(str(folder))
    entries = {e.name: e for e in d.listing()}
    assert entries["deep"].error == (f"deep/{file} nests JSON deeper than 64 levels (the limit for this file; a "
                                     "damaged or hostile one): copy or download it again")
    assert (entries["deep"].kind, entries["deep"].family) == ("StableDiffusionPipeline", None)
    assert entries["sub/digits"].error is None and entries["sd15"].error is None
    with pytest.raises(ModelUnusable, match=f"deep/{file} nests JSON deeper than 64 levels"):
        d.resolve("deep")
    assert d.resolve("sub/digits").family == "sd"
    parsed = []
    read_json = safe_files.read_json
    monkeypatch.setattr(safe_files, "read_json", lambda path, n: (parsed.append(path), read_json(path, n))[1])
    assert {e.name: e.error for e in d.listing()} == {e.name: e.error for e in entries.values()}
    assert parsed == []  # nothing changed: nothing parsed again
    (folder / "deep" / file).write_text("{}")
    assert {e.name: e for e in d.listing()}["deep"].error is None
    assert parsed[0] == str(folder / "deep" / file)  # the file that changed; those walked before it were kept
    assert not any(p.endswith("model_index.json") or "/text_encoder/" in p or "/sub/" in p for p in parsed), parsed
    parsed.clear()
    d.listing()
    assert parsed == []

def _header_file(header: bytes) -> bytes:
    return len(header).to_bytes(8, "little") + header


def test_an_entry_whose_reader_fails_unforeseen_is_listed_as_unusable(folder, monkeypatch):
    real = catalog.inspect_checkpoint

    def failing(path, *a):
        if path.endswith("juggernaut.safetensors"):
            raise RuntimeError("a reader's own bug")
        return real(path, *a)
    monkeypatch.setattr(catalog, "inspect_checkpoint", failing)
    entries = {e.name: e for e in ModelDir(str(folder)).listing()}  # was the RuntimeError, for the whole listing
    assert entries["sdxl/juggernaut"].error == ("sdxl/juggernaut.safetensors cannot be read (RuntimeError): check or "
                                                "replace it; the server's log has the details")
    assert entries["sd15"].error is None and entries["sub/digits"].family == "sd"


def test_a_fifo_is_listed_with_an_error_and_never_opened(folder):
    fifo = folder / "pipe.safetensors"
    os.mkfifo(fifo)
    got = []
    t = threading.Thread(target=lambda: got.append(ModelDir(str(folder)).listing()), daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # it opened the FIFO: release it (a writer unblocks the reader) and fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("the listing opened a FIFO")
    entry = {e.name: e for e in got[0]}["pipe"]
    assert entry.error == "pipe.safetensors is a FIFO (named pipe), not a regular file; only regular files are read"
    with pytest.raises(ModelUnusable, match="FIFO"):
        ModelDir(str(folder)).resolve("pipe")


def test_resolve_names(folder):
    d = ModelDir(str(folder))
    assert d.resolve("sdxl/juggernaut").kind == "sdxl-base"
    assert d.resolve("sdxl/juggernaut.safetensors").name == "sdxl/juggernaut"
    assert d.resolve("sub/digits").form == "folder"
    checkpoint(folder / "later.safetensors")  # added while serving: found without a restart
    assert d.resolve("later").kind == "sd1"
    for bad in ("/etc/passwd", str(folder / "sd15"), "../models/sd15", "sdxl/../sd15", "sdxl\\juggernaut",
                "sd15\x00", "./sd15", "sdxl//juggernaut", "sdxl/"):
        with pytest.raises(ModelNameError, match="is not allowed") as e:
            d.resolve(bad)
        assert type(e.value) is ModelNameError
    with pytest.raises(ModelNameError, match="non-empty string"):
        d.resolve("")
    with pytest.raises(ModelNotFound, match="resolves outside the model folder"):
        d.resolve("escape")
    with pytest.raises(ModelNotFound, match="did you mean 'sdxl/juggernaut'"):
        d.resolve("sdxl/jugernaut")
    with pytest.raises(ModelNotFound, match="known: alias, later, old.ckpt, sd15"):
        d.resolve("qqqqqqqqqqqqqqqq")
    with pytest.raises(ModelNotFound):  # a diffusers folder's weights are not models of their own
        d.resolve("sub/digits/unet/diffusion_pytorch_model")
    with pytest.raises(ModelUnusable, match="looks like a LoRA adapter"):
        d.resolve("styles")
    with pytest.raises(ModelUnusable, match="pickle checkpoint"):
        d.resolve("old.ckpt")


def test_the_folder_itself(tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        ModelDir(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="is itself a diffusers model"):
        ModelDir(shipped_preset_folder("digits"))
    out = io.StringIO()
    assert print_model_dir(str(tmp_path), out) == 0
    assert out.getvalue().startswith("no models in")


def test_headers_are_read_once_per_file_version(folder, monkeypatch):
    calls = []
    real = catalog.inspect_checkpoint
    monkeypatch.setattr(catalog, "inspect_checkpoint", lambda path, *a: calls.append(path) or real(path, *a))
    d = ModelDir(str(folder))
    d.listing()
    first = len(calls)
    assert first == 5  # the .safetensors files inside (the alias has a name of its own; the pickle is never read)
    d.listing()
    assert len(calls) == first
    path = folder / "sd15.safetensors"
    checkpoint(path, SDXL_TEXT)  # rewritten: a new version, inspected again
    assert {e.name: e for e in d.listing()}["sd15"].kind == "sdxl-base"
    assert calls[first:] == [str(path.resolve())] * 2  # itself and the alias that links to it


def test_native_sizes_of_every_kind(tmp_path):
    sizes = {kind: native_size_of(folder_files(kind)["unet/config.json"], folder_files(kind)["vae/config.json"])
             for kind in KINDS}
    assert sizes == {"sd1": 512, "sd1-inpaint": 512, "sd2-base": 512, "sd2-v": 768, "sd2-inpaint": 512,
                     "sdxl-base": 1024, "sdxl-inpaint": 1024}
    checkpoint(tmp_path / "sd21-768.safetensors", "cond_stage_model.model.token_embedding.weight")
    (entry,) = ModelDir(str(tmp_path)).listing()
    assert (entry.name, entry.kind, entry.family, entry.native_size) == ("sd21-768", "sd2-v", "sd", 768)
    assert native_size_of({"sample_size": 96}, None) == 768  # no VAE config: diffusers' default factor 8
    assert native_size_of({"sample_size": [64, 96]}, None) is None and native_size_of(None, None) is None


def test_weights_bytes_count_floats_at_the_load_size_and_the_rest_as_stored(tmp_path):
    """An fp32 tensor counts 2 bytes an element at a 16-bit load and 4 at fp32; fp8 and integer tensors as stored;
    a GGUF file its size, a pickle as fp32; a split model its three files; a folder only the weights its loader
    reads (the plain files, not the fp16 variant beside them, nor the safety checker)."""
    from diffgraph.models.catalog import ModelEntry, weights_bytes
    from diffgraph.models.split_files import SPLIT_KINDS, SplitFiles

    save_file({"w": torch.zeros(10, 10), "f8": torch.zeros(7, dtype=torch.float8_e4m3fn),
               "ids": torch.zeros(3, dtype=torch.int64)}, str(tmp_path / "dit.safetensors"))
    save_file({"h": torch.zeros(8, dtype=torch.float16)}, str(tmp_path / "te.safetensors"))
    (tmp_path / "vae.gguf").write_bytes(b"g" * 40)
    (tmp_path / "old.ckpt").write_bytes(b"p" * 400)

    def file(name: str) -> ModelEntry:
        return ModelEntry(name, str(tmp_path / name), "file", 0, None)
    assert weights_bytes(file("dit.safetensors"), 2) == 100 * 2 + 7 + 24
    assert weights_bytes(file("dit.safetensors"), 4) == 100 * 4 + 7 + 24
    assert weights_bytes(file("old.ckpt"), 2) == 200 and weights_bytes(file("vae.gguf"), 2) == 40
    assert weights_bytes(file("missing.safetensors"), 2) == 0
    split = SplitFiles(SPLIT_KINDS[0], str(tmp_path / "dit.safetensors"), str(tmp_path / "te.safetensors"),
                       str(tmp_path / "vae.gguf"), ())
    assert weights_bytes(ModelEntry("s", split.diffusion_model, "file", 0, None, split=split), 2) == 231 + 16 + 40
    folder = tmp_path / "pipe"
    for sub in ("unet", "safety_checker"):
        (folder / sub).mkdir(parents=True)
        save_file({"w": torch.zeros(5)}, str(folder / sub / "diffusion_pytorch_model.safetensors"))
    save_file({"w": torch.zeros(5, dtype=torch.float16)}, str(folder / "unet" / "diffusion_pytorch_model.fp16.safetensors"))
    assert weights_bytes(ModelEntry("pipe", str(folder), "folder", 0, None), 2) == 10


def test_family_table_matches_the_adapters():
    from diffgraph.models.families import default_registry
    registry = default_registry()
    assert sorted(supported_pipelines()) == sorted(registry.pipeline_classes())
    for cls in registry.pipeline_classes():
        assert pipeline_family(cls) == registry.for_pipeline(cls).name
    assert pipeline_family("StableDiffusion3Pipeline") is None and pipeline_family(None) is None


def test_print_model_dir(folder, tmp_path):
    out = io.StringIO()
    assert print_model_dir(str(folder), out) == 0
    lines = {line.split()[0]: line for line in out.getvalue().splitlines()}
    assert list(lines) == ["alias", "old.ckpt", "sd15", "sdxl/deep/inpaint", "sdxl/juggernaut", "styles",
                           "sub/digits"]
    assert lines["sdxl/juggernaut"].split()[1:5] == ["file", "sdxl-base", "SDXL", "base"]
    assert "  sdxl   1024px " in lines["sdxl/juggernaut"] and "error" not in lines["sdxl/juggernaut"]
    assert lines["sub/digits"].split()[1:5] == ["folder", "StableDiffusionPipeline", "sd", "64px"]
    assert lines["sub/digits"].split()[5:7] == ["0.01", "GB"]
    assert "error: model" in lines["styles"] and "looks like a LoRA" in lines["styles"]
    assert "not-a-hash" not in out.getvalue() and not (tmp_path / "cache").exists()
    out = io.StringIO()
    print_model_dir(str(folder), out, hashes=True, cache_root=str(tmp_path / "cache"))
    lines = {line.split()[0]: line for line in out.getvalue().splitlines()}
    digest = hashlib.sha256((folder / "sd15.safetensors").read_bytes()).hexdigest()[:10]
    assert lines["sd15"].split()[-1] == digest and lines["sub/digits"].split()[-1] == "-"
    assert lines["styles"].split("GB")[1].split()[0] == "-"  # unservable entries are not hashed


def test_importing_the_catalog_loads_no_torch():
    code = "import sys, diffgraph.models.catalog; print(sorted(m for m in ('torch', 'diffusers', 'transformers', " \
           "'safetensors') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_sidecar_names_the_config_folder_or_preset_and_a_bad_one_costs_its_own_entry(folder):
    shutil.copytree(shipped_preset_folder("digits-xl"), folder / "configs" / "xl")
    (folder / "sd15.diffgraph.toml").write_text('config = "configs/xl"\n')  # relative to the sidecar
    checkpoint(folder / "as-preset.safetensors")
    (folder / "as-preset.diffgraph.toml").write_text('preset = "sd1-inpaint"\n')
    (folder / "split.safetensors").write_bytes((folder / "sd15.safetensors").read_bytes())
    (folder / "te.safetensors").write_bytes(b"")
    (folder / "split.diffgraph.toml").write_text('text_encoder = "te.safetensors"\nvae = "te.safetensors"\n')
    bad = {"unknown": ('config = "configs/xl"\ncolour = "red"\n', "unknown key 'colour'; allowed: config, preset"),
           "missing": ('config = "nowhere"\n', "config 'nowhere' is not a diffusers folder"),
           "wrong-type": ("config = 3\n", "config must be a non-empty string"),
           "not-toml": ("config = \n", "is not TOML"),
           "both": ('config = "configs/xl"\npreset = "sd1"\n', "gives both config and preset; keep one"),
           "bad-preset": ('preset = "sd9"\n', "preset 'sd9' is unknown; one of sd1"),
           "no-vae-file": ('vae = "vae.safetensors"\n', "vae 'vae.safetensors' is not a file")}
    for name, (text, _) in bad.items():
        checkpoint(folder / f"{name}.safetensors")
        (folder / f"{name}.diffgraph.toml").write_text(text)
    models = ModelDir(str(folder))
    entries = {e.name: e for e in models.listing()}
    assert (entries["sd15"].family, entries["sd15"].native_size, entries["sd15"].error) == ("sdxl", 64, None)
    assert (entries["as-preset"].kind, entries["as-preset"].error) == ("sd1-inpaint", None)
    assert entries["split"].error is None
    for name, (_, words) in bad.items():
        error = entries[name].error
        assert error and words in error and "\n" not in error, (name, error)
        with pytest.raises(ModelUnusable, match="sidecar"):
            models.resolve(name)
    assert models.resolve("sdxl/juggernaut").error is None  # the other models keep serving
    (folder / "sd15.diffgraph.toml").write_text('colour = "red"\n')  # a sidecar edited: listed again
    assert "unknown key" in {e.name: e for e in models.listing()}["sd15"].error
    (folder / "sd15.diffgraph.toml").unlink()
    assert {e.name: e for e in models.listing()}["sd15"].family == "sd"
    assert not [e for e in models.listing() if e.name.endswith(".diffgraph")]  # sidecars are not models


def _f16_header_file(path, tensors, metadata=None):
    header, offset = {}, 0
    for key, shape in tensors.items():
        n = 2 * int(torch.tensor(shape).prod())
        header[key] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + bytes(offset))


FIRST = {"model.diffusion_model.input_blocks.0.0.weight": (4, 4, 3, 3)}
SD2_TEXT = {"cond_stage_model.model.token_embedding.weight": (4, 4)}


@pytest.mark.parametrize("name, tensors, metadata, needle", [
    ("ctx", {**FIRST, "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": (768,)},
     None, "without its text encoders"),
    ("pred", {**FIRST, **SD2_TEXT}, {"modelspec.prediction_type": 5}, "__metadata__ is not a map of strings"),
    ("res", {**FIRST, **SD2_TEXT}, {"modelspec.resolution": [768, 768]}, "__metadata__ is not a map of strings"),
])
def test_odd_checkpoint_headers_are_one_line_errors_and_the_listing_survives(tmp_path, name, tensors, metadata,
                                                                             needle):
    path = str(tmp_path / f"{name}.safetensors")
    _f16_header_file(path, tensors, metadata)
    with pytest.raises(ValueError, match=needle):  # was IndexError / AttributeError
        inspect_checkpoint(path)
    _f16_header_file(str(tmp_path / "other.safetensors"), {**FIRST, **SD2_TEXT}, {"modelspec.resolution": "512"})
    entries = {e.name: e for e in ModelDir(str(tmp_path)).listing()}
    assert needle in entries[name].error and entries["other"].kind == "sd2-base" and entries["other"].error is None
