"""Qwen-Image-Edit (models/families/qwen_image_edit.py) against its oracle, diffusers' `QwenImageEditPlusPipeline`, on
the tiny random preset `random:qwen-image-edit-tiny`, the pipeline built from the engine's own modules.

Both sides read input images at shrunk resolutions (the pipeline's `CONDITION_IMAGE_SIZE` / `VAE_IMAGE_SIZE` module
constants and the family's, monkeypatched alike: 56 x 56 and 96 x 96 pixels of area), so a call takes a second or two.
The pipeline's text encoder is given `mm_token_type_ids` (the model's multimodal positions, which the family reads
and diffusers' pipeline leaves out under transformers 5). fp32 on the CPU: each image within one uint8 level of the
pipeline's with the same seed, with one and with two input images under true CFG (" " as the negative prompt); rows
with 1, 2 and no input images, prompts of different lengths and guidance on and off run together and each equals its
request alone; bad inputs are a one-line 400 naming `reference_images`. ComfyUI's split files written from the tiny
model (the encoder with its vision tower; the transformer also as a GGUF) give the engine's edit; a split file is
Edit's by its sidecar, its name or ComfyUI's 2511 marker.
"""

import functools

import numpy as np
import pytest
import torch

from diffgraph import Engine, GenerationRequest, ParamError
from diffgraph.models.families import qwen_image_edit
from diffgraph.models.families.qwen_image_edit import DROPPED, TEMPLATE, processor_settings, vision_image
from diffgraph.models.qwen_tokenizer import qwen_tokenizer

from loop_util import images_together, step_graphs
from playground_util import run as run_playground
from test_flux2_references import picture

CONDITION, VAE = 56 * 56, 96 * 96
IMAGES = [picture(72, 88, 1), picture(96, 64, 2)]
PROMPT = "make the fox blue and put it in the snow"


@pytest.fixture(scope="module")
def edit():
    """The tiny Edit engine and the pipeline on its modules, both reading images at the shrunk resolutions."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    from diffgraph.models.families.qwen_image import SCHEDULER

    with pytest.MonkeyPatch.context() as mp:
        for module in (plus, qwen_image_edit):
            mp.setattr(module, "CONDITION_IMAGE_SIZE", CONDITION)
            mp.setattr(module, "VAE_IMAGE_SIZE", VAE)
        with Engine(model="random:qwen-image-edit-tiny", device="cpu") as engine:
            model = engine.model
            with torch.no_grad():  # at its initial scale the prompt moves the tiny model's image by a level or two
                for p in model.denoiser.parameters():
                    if p.ndim == 2:
                        p.mul_(3.0)
            pipe = model.adapter.diffusers_pipeline(model, FlowMatchEulerDiscreteScheduler(**SCHEDULER))
            encoder, pad = pipe.text_encoder, pipe.processor.image_token_id
            plain = encoder.forward

            @functools.wraps(plain)
            def forward(*args, input_ids=None, **kwargs):  # the model's multimodal positions (diffusers' open fix)
                kwargs.setdefault("mm_token_type_ids", (input_ids == pad).int())  # (the engine gives its own)
                return plain(*args, input_ids=input_ids, **kwargs)
            mp.setattr(encoder, "forward", forward)
            yield engine, pipe


def oracle(pipe, prompt: str, images: list, size: tuple[int, int], steps: int, guidance: float, seed: int,
           negative: str | None = None) -> np.ndarray:
    from PIL import Image

    if guidance > 1 and negative is None:
        negative = " "
    image = pipe(image=[Image.fromarray(i) for i in images], prompt=prompt, negative_prompt=negative,
                 height=size[0], width=size[1], num_inference_steps=steps, true_cfg_scale=guidance,
                 generator=torch.Generator().manual_seed(seed), output_type="np").images[0]
    return (image * 255).round().astype(np.int16)


def request(images: list, prompt: str = PROMPT, size: tuple[int, int] = (64, 64), steps: int = 2,
            guidance: float = 4.0, seed: int = 3) -> dict:
    return dict(prompt=prompt, height=size[0], width=size[1], num_inference_steps=steps, guidance_scale=guidance,
                seed=seed, extras={"reference_images": images} if images else None)


@pytest.mark.parametrize("count,size", [(1, (64, 64)), (2, (64, 96))])
def test_edits_equal_the_pipeline_with_one_and_two_input_images(edit, count, size):
    """True CFG at 4 (" " as the negative prompt, read with the same images); the inputs show in the image. The inputs'
    grids (6 x 6; 6 x 6 and 8 x 4) reach further than the image's (4 x 4; 4 x 6): the text's positions start after
    theirs."""
    engine, pipe = edit
    got = images_together(engine, [request(IMAGES[:count], size=size)])[0]
    want = oracle(pipe, PROMPT, IMAGES[:count], size, 2, 4.0, 3)
    assert got.shape == (*size, 3) and np.abs(got - want).max() <= 1
    other = oracle(pipe, PROMPT, [picture(72, 88, 9)] + IMAGES[1:count], size, 2, 4.0, 3)
    assert np.abs(want - other).max() > 3
    assert engine.info.family == "qwen-image-edit" and engine.info.edit_images == "reference_images"
    assert (engine.info.default_steps, engine.info.default_guidance) == (40, 4.0)


def test_edit_2511_modulates_the_reference_tokens_at_timestep_0(edit, monkeypatch):
    """Edit-2511's transformer (`zero_cond_t`, the same weights' layout): with two input images the engine equals the
    pipeline, whose image differs from 2509's reading of the same weights."""
    engine, pipe = edit
    before = oracle(pipe, PROMPT, IMAGES, (64, 64), 2, 4.0, 6)
    net = engine.model.denoiser
    for module in (net, *net.transformer_blocks):
        monkeypatch.setattr(module, "zero_cond_t", True)
    got = images_together(engine, [request(IMAGES, seed=6)])[0]
    want = oracle(pipe, PROMPT, IMAGES, (64, 64), 2, 4.0, 6)
    assert np.abs(got - want).max() <= 1 and np.abs(want - before).max() > 3


def test_rows_of_1_2_and_no_inputs_together_each_equal_their_request_alone(edit):
    """Rows with one and two inputs (36 and 68 reference tokens: one bucket of 256), prompts of 2 and 40 words, true
    CFG and a guidance-1 row of 3 steps on the Lightning schedule, and a row without inputs (its own group) share the
    burst; each equals its request alone. The
    shared picture's reference tokens are encoded once (cached by content)."""
    engine, _ = edit
    long = ", ".join(["a lighthouse on a cliff at dusk with gulls"] * 5)
    requests = [dict(request(IMAGES[:1], prompt="blue fox", guidance=1.0, seed=11, steps=3), schedule="lightning"),
                request(IMAGES, prompt=long, size=(96, 64), seed=12),
                request(IMAGES[:1], prompt=PROMPT, size=(64, 96), seed=13),
                request([], prompt=PROMPT, seed=14)]
    runner = engine.runner
    made = [GenerationRequest.create(model=engine.info, **r) for r in requests]
    keys = []
    for m in made:
        prepared = runner.capabilities.prepare(dict(m.extras or {}), "m")
        from diffgraph.text.prepared import prepare
        keys.append(runner.group_key(m.key, prepare(runner.text_setup, m, inputs=runner.prompt_inputs(prepared)),
                                     prepared))
    assert keys == [((128, 256), 256)] * 3 + [((128, 0), 256)]
    together = images_together(engine, requests)
    for r, image in zip(requests, together):
        alone = images_together(engine, [r])[0]
        assert np.abs(image - alone).max() <= 1, r["prompt"][:20]


def test_a_request_without_inputs_is_text_to_image_in_the_edit_template(edit):
    """No input image: QwenImagePipeline's reading with the Edit template (and its 64 dropped tokens) in place of its
    own, as the Edit pipeline's encode reads a prompt without pictures."""
    from diffusers import QwenImagePipeline

    engine, pipe = edit
    text = QwenImagePipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=pipe.text_encoder,
                             tokenizer=pipe.tokenizer, transformer=pipe.transformer)
    text.prompt_template_encode, text.prompt_template_encode_start_idx = TEMPLATE[0] + "{}" + TEMPLATE[1], DROPPED
    got = images_together(engine, [request([], seed=5)])[0]
    want = text(prompt=PROMPT, negative_prompt=" ", height=64, width=64, num_inference_steps=2, true_cfg_scale=4.0,
                generator=torch.Generator().manual_seed(5), output_type="np").images[0]
    assert np.abs(got - (want * 255).round().astype(np.int16)).max() <= 1


def test_the_vision_tower_runs_once_per_images_and_prompt(edit, monkeypatch):
    """The encoder's output is kept by the prompt cache under the prompt and the images' content: a request sent
    again (another seed) runs no vision tower; other images with the same prompt do."""
    engine, _ = edit
    visual = engine.model.text_encoders[0].visual
    calls, forward = [], visual.forward
    monkeypatch.setattr(visual, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    prompt = "turn the fox into a cat"
    images_together(engine, [request(IMAGES[:1], prompt=prompt, seed=1)])
    first = len(calls)
    images_together(engine, [request(IMAGES[:1], prompt=prompt, seed=2)])
    assert first >= 1 and len(calls) == first  # the prompt and " " with the image (a batch); then none
    images_together(engine, [request(IMAGES[1:], prompt=prompt, seed=2)])
    assert len(calls) > first


def test_graph_mode_replays_edit_rows_of_1_and_2_inputs_in_one_graph_beside_a_text_row(edit):
    """In graph mode (the CPU's emulated graphs, nothing prewarmed) a true-CFG row with one input and a guidance-1 row
    with two inputs of another size (36 and 68 reference tokens: reference slot 256) replay one step graph of that
    slot (bucket 4: three denoiser rows), captured on first use; the text-to-image row replays its own group's in the
    same steps; nothing runs eagerly, each graph is verified against eager at capture, and every image equals the
    eager engine's of its request alone."""
    from diffgraph import GraphConfig

    engine, _ = edit
    requests = [request(IMAGES[:1], seed=21), request(IMAGES, size=(64, 96), guidance=1.0, seed=22),
                request([], seed=23)]
    want = [images_together(engine, [r])[0] for r in requests]
    cfg = GraphConfig(batch_buckets=(1, 2, 4), resolutions=((64, 64),), prewarm=False, verify=True,
                      backend="emulated", capture_text_encoder=False)
    with Engine(model="random:qwen-image-edit-tiny", device="cpu", mode="graph", graphs=cfg) as graphed:
        with torch.no_grad():
            for mine, theirs in zip(graphed.model.denoiser.parameters(), engine.model.denoiser.parameters()):
                mine.copy_(theirs)
        got = images_together(graphed, requests)
        steps = step_graphs(graphed)
    assert steps.pop("eager") == {}
    assert sorted(steps) == [(((128, 0), 256), 2), (((128, 256), 256), 4)], steps
    for row in steps.values():
        assert (row["status"], row["replays"], row["on_demand"], row["eager_fallbacks"]) == ("captured", 2, 1, 0)
        assert row["verify_max_abs"] is not None and row["verify_max_abs"] < 1e-4, row
    for a, b in zip(got, want):
        assert np.abs(a - b).max() <= 1


def test_a_saved_pipeline_folder_loads_as_the_family_and_a_foreign_processor_is_refused(edit, tmp_path):
    """The pipeline's save_pretrained folder (QwenImageEditPlusPipeline) serves the same images; a processor whose
    settings differ from the shipped ones is refused at load naming the setting."""
    import json

    engine, pipe = edit
    path = tmp_path / "Qwen-Image-Edit"
    pipe.save_pretrained(str(path))
    with Engine(model=str(path), device="cpu") as loaded:
        assert loaded.info.family == "qwen-image-edit" and loaded.info.default_steps == 40
        r = request(IMAGES[:1], seed=8)
        assert np.abs(images_together(loaded, [r])[0] - images_together(engine, [r])[0]).max() <= 1
    config = path / "processor" / "processor_config.json"
    saved = json.loads(config.read_text())
    saved["image_processor"]["patch_size"] = 16
    config.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="patch_size is 16"):
        Engine(model=str(path), device="cpu")


def test_vision_preprocessing_equals_transformers_pil_processor():
    """The family's own preprocessing (no torchvision) gives Qwen2VLImageProcessorPil's pixel values and grid."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    settings = processor_settings()
    processor = Qwen2VLImageProcessorPil(**settings)
    for h, w in ((64, 64), (384, 416), (97, 203)):
        image = Image.fromarray(picture(h, w, h))
        want = processor(images=[image], return_tensors="np")
        got = vision_image(image, settings)
        assert got.grid == tuple(want["image_grid_thw"][0])
        assert np.abs(got.pixels - want["pixel_values"]).max() < 1e-5


def test_the_template_drops_the_system_prompt():
    """The pipeline's prompt_template_encode_start_idx (64) is its system message and the user turn's opening."""
    tokenizer = qwen_tokenizer("qwen2.5")
    assert len(tokenizer(TEMPLATE[0]).input_ids) == DROPPED


@pytest.mark.parametrize("images,words", [([picture(64, 64, 0)] * 4, "4 input images; send at most 3"),
                                          (["not an image"], "reference_images[0] must be a PIL image"),
                                          ([np.zeros((8, 4000, 3), np.uint8)], "too thin")])
def test_bad_inputs_are_a_param_error_naming_the_field(edit, images, words):
    engine, _ = edit
    with pytest.raises(ParamError) as e:
        engine.submit(GenerationRequest.create(model=engine.info, prompt="x", height=64, width=64,
                                               extras={"reference_images": images}))
    assert e.value.param == "reference_images" and words in str(e.value) and "\n" not in str(e.value)


def test_an_output_without_a_size_takes_the_last_input_s_aspect_ratio(edit):
    """As the pipeline: the last input's aspect ratio at 1024 x 1024 pixels of area, sides multiples of 32 (within
    2048: a panorama's output scaled to fit); a size given, or no input, as before."""
    from PIL import Image

    engine, _ = edit

    def size(**kw):
        made = GenerationRequest.create(model=engine.info, prompt="x", **kw)
        return made.width, made.height
    assert size(extras={"reference_images": [picture(64, 64, 0), np.zeros((200, 300, 3), np.uint8)]}) == (1248, 832)
    assert size(extras={"reference_images": [Image.new("RGB", (100, 600))]}) == (320, 2048)  # 416 x 2496, scaled
    assert size(extras={"reference_images": [picture(64, 64, 0)]}, width=64, height=96) == (64, 96)
    assert size() == (128, 128)  # the tiny preset's native size


def test_the_images_placeholders_count_against_the_prompt_s_1024_tokens(edit):
    """A prompt that fits alone but not beside its input images' placeholders is refused naming the count and the
    limit."""
    engine, _ = edit
    prompt = "fox " * 1000
    engine.submit(GenerationRequest.create(model=engine.info, prompt=prompt, height=64, width=64,
                                           num_inference_steps=1, guidance_scale=1.0)).result(timeout=600)
    with pytest.raises(ParamError) as e:
        engine.submit(GenerationRequest.create(model=engine.info, prompt=prompt, height=64, width=64,
                                               extras={"reference_images": [*IMAGES, IMAGES[0]]}))
    assert e.value.param == "prompt" and "with the model's template and its 3 input images" in str(e.value)
    assert "at most 1024" in str(e.value) and "\n" not in str(e.value)


# -- split files ------------------------------------------------------------------------------------------------

def test_split_files_with_the_vision_tower_give_the_folder_s_edit(edit, tmp_path):
    """The tiny Edit model written as ComfyUI's three files (the transformer under `model.diffusion_model.`, the
    Qwen2.5-VL file with its `visual.*` tower, the VAE) and named as ComfyUI names Edit-2509's: read as
    Edit by its name, loaded by the family (configs from the shapes, the encoder with its tower), its edit of an input
    image under true CFG within one level of the engine's, and of its transformer's as QuantStack's F16 GGUF (Edit by
    its name too). ComfyUI's Edit-2511 file (its `__index_timestep_zero__`
    marker, a kind of its own) loads with `zero_cond_t`; an encoder file without the tower is refused in one line
    naming the file and what to use, before any weight is read."""
    import gguf
    from safetensors.torch import load_file, save_file

    from diffgraph.models.families import QwenImageEditFamily
    from diffgraph.models.split_files import SPLIT_KINDS, SplitFiles, preset_of
    from test_qwen_image import split_files
    from test_zimage_files import write_gguf

    engine, _ = edit
    model = engine.model
    paths, _ = split_files(tmp_path, "qwen_image_edit_2509_tiny.safetensors", model.denoiser.state_dict(),
                           model.text_encoders[0].state_dict(), model.vae.state_dict())
    kinds = {k.name: k for k in SPLIT_KINDS}
    files = SplitFiles(kinds["qwen-image"], *paths, (), preset_of(kinds["qwen-image"], paths[0], None))
    assert (files.preset, files.family) == ("qwen-image-edit-2509", "qwen-image-edit")
    loaded = QwenImageEditFamily().load_split(files, torch.device("cpu"), torch.float32, paths[0])
    assert not loaded.denoiser.zero_cond_t and type(loaded.text_encoders[0]).__name__ == "Qwen2_5_VLModel"
    r = request(IMAGES[:1], seed=7)
    with Engine(model=loaded) as split:
        assert split.info.family == "qwen-image-edit" and split.info.default_steps == 40
        got = images_together(split, [r])[0]
    assert np.abs(got - images_together(engine, [r])[0]).max() <= 1

    gguf_path = str(tmp_path / "diffusion_models" / "Qwen-Image-Edit-2509-F16.gguf")  # QuantStack's name
    write_gguf(gguf_path, {k: v.contiguous() for k, v in model.denoiser.state_dict().items()},
               gguf.GGMLQuantizationType.F16)
    files = SplitFiles(kinds["qwen-image"], gguf_path, *paths[1:], (), preset_of(kinds["qwen-image"], gguf_path, None))
    with Engine(model=QwenImageEditFamily().load_split(files, torch.device("cpu"), torch.float32, gguf_path)) as split:
        assert np.abs(images_together(split, [r])[0] - got).max() <= 1  # (the F16 transformer's)

    transformer = load_file(paths[0])
    save_file({**transformer, "model.diffusion_model.__index_timestep_zero__": torch.empty(0)}, paths[0])
    files = SplitFiles(kinds["qwen-image-edit-2511"], *paths, ())
    assert QwenImageEditFamily().load_split(files, torch.device("cpu"), torch.float32, paths[0]).denoiser.zero_cond_t

    text_only = str(tmp_path / "qwen_2.5_vl_text_only.safetensors")
    save_file({"model.embed_tokens.weight": torch.zeros(8, 4), "model.layers.0.self_attn.q_proj.bias": torch.zeros(4)},
              text_only)  # (refused from its header: no visual.* tensors)
    files = SplitFiles(kinds["qwen-image"], paths[0], text_only, paths[2], (), "qwen-image-edit-2509")
    with pytest.raises(ValueError, match="qwen_2.5_vl_text_only.safetensors holds .* without its vision tower .*; "
                                         "use a text encoder file with it") as e:
        QwenImageEditFamily().load_split(files, torch.device("cpu"), torch.float32, paths[0])
    assert "\n" not in str(e.value)


def test_an_fp8_scaled_encoder_file_with_its_vision_tower_loads_as_its_dequantised_weights(edit, tmp_path):
    """ComfyUI's `qwen_2.5_vl_7b_fp8_scaled` form of the Edit text encoder: every 2-D weight, the vision tower's too, in
    e4m3 with its `scale_weight` and the `scaled_fp8` marker. Streamed by the family's split loader with the tower, the
    encoder equals the one loaded from a file of the dequantised weights, and its tower's weights are the quantised
    ones (not the originals)."""
    from safetensors.torch import load_file, save_file
    from test_qwen_image import split_files
    from test_zimage_files import E4M3, _quantised

    from diffgraph.models import split_stream

    model = edit[0].model
    paths, _ = split_files(tmp_path, "qwen_image_edit_2509_tiny.safetensors", model.denoiser.state_dict(),
                           model.text_encoders[0].state_dict(), model.vae.state_dict())
    original = load_file(paths[1])
    fp8, dequantised = _quantised(original, False)
    assert any(k.startswith("visual.") for k in fp8) and any(k.startswith("model.") for k in fp8)
    scaled = {**original, "scaled_fp8": torch.empty(0, dtype=E4M3)}
    for key, (q, scale) in fp8.items():
        scaled[key], scaled[key.removesuffix(".weight") + ".scale_weight"] = q, scale
    files = {"fp8": str(tmp_path / "qwen_2.5_vl_7b_fp8_scaled.safetensors"),
             "dequantised": str(tmp_path / "qwen_2.5_vl_dequantised.safetensors")}
    save_file(scaled, files["fp8"])
    save_file({k: v.contiguous() for k, v in dequantised.items()}, files["dequantised"])
    encoders = {what: split_stream.load_qwen_image(paths[0], path, torch.float32, "cpu", vision=True)[1].state_dict()
                for what, path in {**files, "original": paths[1]}.items()}
    assert set(encoders["fp8"]) == set(encoders["dequantised"]) and any("visual." in k for k in encoders["fp8"])
    assert all(torch.equal(v, encoders["dequantised"][k]) for k, v in encoders["fp8"].items())
    tower = [k for k in encoders["fp8"] if "visual.blocks." in k and k.endswith("proj.weight")]
    assert tower and not any(torch.equal(encoders["fp8"][k], encoders["original"][k]) for k in tower)


@pytest.mark.parametrize("name,side,marker,family,preset,zero", [
    ("qwen_image_fp8_e4m3fn.safetensors", None, False, "qwen-image", None, False),
    ("qwen_image_edit_2509_fp8_e4m3fn.safetensors", None, False, "qwen-image-edit", "qwen-image-edit-2509", False),
    ("Qwen-Image-Edit-2511-Lightning-8steps.safetensors", None, False, "qwen-image-edit", "qwen-image-edit-2511",
     True),
    ("qwen_image_edit_fp8_e4m3fn.safetensors", None, False, "qwen-image-edit", "qwen-image-edit", False),
    ("my_finetune.safetensors", "qwen-image-edit-2511", False, "qwen-image-edit", "qwen-image-edit-2511", True),
    ("qwen_image_edit_2509.safetensors", "qwen-image", False, "qwen-image", "qwen-image", False),
    ("qwen_image_edit_2511_bf16.safetensors", None, True, "qwen-image-edit", None, True)])
def test_a_split_qwen_image_file_is_edit_by_its_sidecar_its_name_or_comfyui_s_2511_marker(tmp_path, name, side,
                                                                                          marker, family, preset,
                                                                                          zero):
    """The family of a Qwen-Image-layout file (the weights are the same): its sidecar's preset, else the words of its
    name ("edit", then "2509" / "2511"), else text-to-image; ComfyUI's 2511 marker makes it the Edit-2511 kind. The
    marker, a 2511 preset or a 2511 name turn Edit-2511's `zero_cond_t` on."""
    from safetensors.torch import save_file

    from diffgraph.models.families.qwen_image_edit import EDIT_2511, is_2511
    from diffgraph.models.sidecar import read_sidecar, sidecar_path
    from diffgraph.models.split_files import SplitFiles, header_shapes, preset_of, split_kind

    path = str(tmp_path / name)
    tensors = {"model.diffusion_model.img_in.weight": torch.zeros(1, 64),
               "model.diffusion_model.txt_in.weight": torch.zeros(1, 3584),
               "model.diffusion_model.txt_norm.weight": torch.zeros(1),
               "model.diffusion_model.transformer_blocks.0.img_mod.1.weight": torch.zeros(1, 1)}
    if marker:
        tensors["model.diffusion_model.__index_timestep_zero__"] = torch.empty(0)
    save_file(tensors, path)
    if side:
        with open(sidecar_path(path), "w") as f:
            f.write(f'preset = "{side}"\n')
    kind = split_kind(name, header_shapes(path))
    assert (kind.name == EDIT_2511) == marker
    files = SplitFiles(kind, path, "te", "vae", (), preset_of(kind, path, read_sidecar(path)))
    assert (files.family, files.preset, is_2511(files)) == (family, preset, zero)
    with open(sidecar_path(path), "w") as f:
        f.write('preset = "z-image"\n')
    with pytest.raises(ValueError, match="preset 'z-image' is not a Qwen-Image.* preset; one of") as e:
        preset_of(kind, path, read_sidecar(path))
    assert "\n" not in str(e.value)


# -- the routes (closes the engine: last) ------------------------------------------------------------------

def test_http_edits_take_two_image_parts_and_refuse_four_or_a_non_image(edit, tmp_path):
    """/v1/images/edits reads every image part as an input image, AUTOMATIC1111's img2img every init image, a job
    item its `reference_images`: two equal the engine's request with them; four parts (or items), or a JSON input
    that is not an image, are a one-line 400 naming the field (the element, on the JSON route), and the playground
    refuses a fourth before sending, in the same words."""
    import base64
    import io

    from PIL import Image

    from diffgraph.server import ServerConfig
    from server_util import b64png, job_first_image, served

    engine, _ = edit
    want = images_together(engine, [request(IMAGES, steps=2, seed=4)])[0]

    def png(r: np.ndarray) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(r).save(buf, "PNG")
        return buf.getvalue()

    form = {"prompt": PROMPT, "size": "64x64", "seed": "4", "num_inference_steps": "2", "guidance_scale": "4"}
    files = [("image[]", (f"{i}.png", png(r), "image/png")) for i, r in enumerate(IMAGES)]
    name = "random:qwen-image-edit-tiny"
    config = ServerConfig(model=name, device="cpu", state_dir=str(tmp_path / "state"))
    with served(engine, config) as client:  # (closes the engine: the last test)
        answer = client.post("/v1/images/edits", data=form, files=files)
        assert answer.status_code == 200, answer.text
        got = np.array(Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"])))).astype(
            np.int16)
        assert np.abs(got - want).max() <= 1
        a1111 = {"prompt": PROMPT, "init_images": [b64png(Image.fromarray(r)) for r in IMAGES], "width": 64,
                 "height": 64, "seed": 4, "steps": 2, "cfg_scale": 4, "denoising_strength": 1.0}
        answer = client.post("/sdapi/v1/img2img", json=a1111)  # AUTOMATIC1111's init images are the inputs too
        assert answer.status_code == 200, answer.text
        got = np.array(Image.open(io.BytesIO(base64.b64decode(answer.json()["images"][0])))).astype(np.int16)
        assert np.abs(got - want).max() <= 1
        answer = client.post("/v1/images/edits", data=form, files=files * 2)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "reference_images", answer.text
        assert answer.json()["error"]["message"] == "4 input images; send at most 3"
        info = client.get("/info").json()  # the playground refuses the 4th before sending, in the same words
        assert info["image_limits"] == {"reference_images": {"max": 3, "items": "input images"}}
        assert playground_refusals(info, files=3) == [[["reference_images", answer.json()["error"]["message"]]], []]
        assert playground_refusals(info, files=2) == [[], []]
        item = {"prompt": PROMPT, "size": "64x64", "seeds": [4], "num_inference_steps": 2, "guidance_scale": 4,
                "reference_images": [b64png(Image.fromarray(r)) for r in IMAGES]}
        r = client.post("/v1/jobs", json={"items": [{**item, "reference_images": item["reference_images"] * 2}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "items[0].reference_images", r.text
        assert r.json()["error"]["message"] == "items[0]: 4 input images; send at most 3"
        job = client.post("/v1/jobs", json={"items": [item]}).json()["id"]
        assert np.abs(job_first_image(client, job) - want).max() <= 1
        text = base64.b64encode(b"not an image").decode()
        body = {"prompt": PROMPT, "size": "64x64", "reference_images": [b64png(Image.fromarray(IMAGES[0])), text]}
        answer = client.post("/v1/images/generations", json=body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "reference_images[1]", answer.text
        assert "\n" not in answer.json()["error"]["message"]


def playground_refusals(info: dict, files: int) -> list:
    """The playground's refusals of `files` reference images under /info's `info`, with an image to edit (counted
    among them) and without."""
    return run_playground("controls.js", """(async () => {
      const refs = window.DiffgraphControls.createReferences({ $ });
      refs.show(input.info);
      $("ref-images-input").files = Array.from({ length: input.files }, () => ({}));
      await fire("ref-images-input", "change");
      console.log(JSON.stringify([refs.localErrors(true), refs.localErrors(false)]));
    })();""", {"info": info, "files": files})

