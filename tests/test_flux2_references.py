"""FLUX.2 klein's reference images (models/families/flux2_refs.py) against diffusers' `Flux2KleinPipeline(image=[...])`
on test_flux2.py's tiny distilled folder: fp32 on the CPU, each image within one uint8 level of the pipeline's with the
same seed and references; rows with 0, 1 and 2 references submitted together each equal their request alone; bad
references are a one-line ParamError naming `reference_images`. Image-to-image below strength 1 (the engine, the
AUTOMATIC1111 and edits routes) against `Flux2KleinInpaintPipeline` at a full mask.
"""

import numpy as np
import pytest
import torch

from diffgraph import GenerationRequest, ParamError

from loop_util import images_together, step_graphs
from test_flux2 import folders, klein  # noqa: F401 (fixtures)

PROMPT = "the same fox, now in the snow"


def picture(h: int, w: int, seed: int) -> np.ndarray:
    """A smooth random RGB picture (a VAE's latents of noise tell little), uint8 [h, w, 3]."""
    g = torch.Generator().manual_seed(seed)
    small = torch.rand((1, 3, h // 8 + 1, w // 8 + 1), generator=g)
    return (torch.nn.functional.interpolate(small, size=(h, w), mode="bilinear")[0].permute(1, 2, 0).numpy()
            * 255).round().astype(np.uint8)


# a 72x88 picture is cropped to 64x80 (multiples of 16): 20 reference tokens; 96x64: 24
REFS = {0: [], 1: [picture(72, 88, 1)], 2: [picture(72, 88, 1), picture(96, 64, 2)]}


def oracle(pipe, refs: list, size: tuple[int, int], steps: int, seed: int) -> np.ndarray:
    from PIL import Image

    image = pipe(prompt=PROMPT, image=[Image.fromarray(r) for r in refs] or None, height=size[0], width=size[1],
                 num_inference_steps=steps, generator=torch.Generator().manual_seed(seed), output_type="np").images[0]
    return (image * 255).round().astype(np.int16)


def request(refs: list, size: tuple[int, int], seed: int) -> dict:
    return dict(prompt=PROMPT, height=size[0], width=size[1], num_inference_steps=2, seed=seed,
                extras={"reference_images": refs} if refs else None)


# 256x256 with one reference: the group key (256 reference tokens, 256 image tokens) equals the size in numbers
@pytest.mark.parametrize("count,size", [(0, (128, 128)), (1, (128, 128)), (2, (96, 160)), (1, (256, 256))])
def test_references_equal_the_pipeline(folders, klein, count, size):
    pipe = folders["FLUX.2-klein-4B"][1]
    got = images_together(klein, [request(REFS[count], size, 3)])[0]
    want = oracle(pipe, REFS[count], size, 2, 3)
    assert np.abs(got - want).max() <= 1
    if count:  # the references show
        assert np.abs(want - oracle(pipe, [], size, 2, 3)).max() > 3


def test_rows_with_0_1_2_references_together_each_equal_the_pipeline_alone(folders, klein, monkeypatch):
    """Rows with 1 and 2 references (20 and 44 tokens: one bucket of 256) share a step, the row without any runs in
    its own group in the same burst; each equals diffusers' image of its request alone. The picture both send is
    encoded once (the content-hash cache)."""
    from diffgraph.models.families import flux2_refs

    original, encoded = flux2_refs.encode, []

    def counting(model, pixels):
        encoded.append(tuple(pixels.shape))
        return original(model, pixels)
    monkeypatch.setattr(flux2_refs, "encode", counting)
    pipe = folders["FLUX.2-klein-4B"][1]
    shared = picture(72, 88, 5)
    refs = {0: [], 1: [shared], 2: [shared, picture(96, 64, 6)]}
    sizes = {0: (128, 128), 1: (96, 160), 2: (160, 96)}
    requests = [request(refs[count], sizes[count], 10 + count) for count in (0, 1, 2)]
    made = [GenerationRequest.create(model=klein.info, **r) for r in requests]
    keys = [klein.runner.group_key(r.key, (), klein.runner.capabilities.prepare(dict(r.extras), "m")) for r in made]
    assert keys == [(0, 256), (256, 256), (256, 256)]
    got = images_together(klein, requests)
    assert sorted(encoded) == [(1, 3, 64, 80), (1, 3, 96, 64)]
    for count, image in zip((0, 1, 2), got):
        want = oracle(pipe, refs[count], sizes[count], 2, 10 + count)
        assert np.abs(image - want).max() <= 1, count


@pytest.mark.parametrize("tokens,slot", [((), 0), ((20,), 256), ((20, 24), 256), ((300, 300), 768),
                                         ((1000, 200), 1536), ((4096,) * 3, 12288), ((4096,) * 4, 16384),
                                         ((4096, 4096, 4096, 100), 16384)])
def test_reference_slots_are_a_ladder_of_buckets_at_most_one_and_a_half_times_the_tokens(tokens, slot):
    """A row's reference tokens round up to 1, 2, 3, 4, 6, 8, 12, 16, ... buckets of 256: four 1024 x 1024
    references fill 16384 tokens exactly, and a graphed size has at most a dozen reference slots up to there."""
    from diffgraph.models.families.references import reference, reference_bucket

    refs = tuple(reference(torch.zeros((1, 3, 16, 16 * t))) for t in tokens)
    assert reference_bucket(refs, 256) == slot


@pytest.mark.parametrize("slots", [(), (256,)])
def test_graph_mode_replays_reference_rows_in_their_slot_beside_plain_rows_each_equal_to_eager_alone(folders, klein,
                                                                                                     slots):
    """Graph mode (the emulated backend) at 128x128: rows with 1 and 2 references (20 and 44 tokens: reference slot
    256) of other sizes of the same image bucket replay the step graphs of that slot in one replay (bucket 2),
    captured on first use, or at start-up where the graph config lists the slot (`reference_slots`); the plain row
    replays its prewarmed graph in the same steps; nothing runs eagerly, and each image equals the engine's eager
    image of its request alone."""
    from diffgraph import Engine, GraphConfig

    refs = {0: [], 1: [picture(72, 88, 7)], 2: [picture(72, 88, 7), picture(96, 64, 8)]}
    sizes = {0: (128, 128), 1: (96, 160), 2: (160, 96)}
    requests = [request(refs[count], sizes[count], 20 + count) for count in (0, 1, 2)]
    cfg = GraphConfig(batch_buckets=(1, 2), resolutions=((128, 128),), backend="emulated", warmup_iters=1,
                      capture_vae=False, reference_slots=slots)
    with Engine(model=folders["FLUX.2-klein-4B"][0], device="cpu", mode="graph", graphs=cfg) as g:
        graphed = images_together(g, requests)
        steps = step_graphs(g)
    assert steps["eager"] == {}
    plain, refs_slot = steps[((0, 256), 1)], steps[((256, 256), 2)]
    assert plain["status"] == refs_slot["status"] == "captured"
    assert plain["replays"] == refs_slot["replays"] == 2 and plain["on_demand"] == 0
    assert refs_slot["on_demand"] == (0 if slots else 1)
    assert plain["eager_fallbacks"] == refs_slot["eager_fallbacks"] == 0
    for r, image in zip(requests, graphed):
        assert np.abs(images_together(klein, [r])[0] - image).max() <= 1


def test_a_reference_slot_off_the_ladder_or_on_a_family_without_references_is_refused_naming_the_setting():
    from diffgraph import Engine, GraphConfig
    from diffgraph.models.families.flux2 import Flux2KleinFamily

    family = Flux2KleinFamily()
    assert family.reference_group((0, 1024), 1536) == (1536, 1024)
    with pytest.raises(ValueError, match=r"reference_slots 1280 is not a reference slot .* use 1536"):
        family.reference_group((0, 1024), 1280)
    cfg = GraphConfig(resolutions=((64, 64),), batch_buckets=(1,), backend="emulated", reference_slots="256")
    with pytest.raises(ValueError, match="reads no reference images; leave reference_slots out"):
        Engine(model="random:tiny", device="cpu", dtype="fp32", mode="graph", graphs=cfg)
    with pytest.raises(ValueError, match="positive token counts"):
        GraphConfig(reference_slots="256,x")


@pytest.mark.parametrize("refs,words", [([picture(64, 64, 0)] * 5, "at most 4"),
                                        (["not an image"], "reference_images[0] must be a PIL image"),
                                        ([np.zeros((64, 64), np.uint8)], "reference_images[0] must be RGB"),
                                        (picture(64, 64, 0), "must be a list"),
                                        ([picture(32, 64, 0)], "reference_images[0]: Image too small"),
                                        ([np.zeros((4097, 4096, 3), np.uint8)], "at most 16 megapixels")])
def test_bad_references_are_a_param_error_naming_the_field(klein, refs, words):
    with pytest.raises(ParamError) as e:
        klein.submit(GenerationRequest.create(model=klein.info, prompt="x", height=128, width=128,
                                              extras={"reference_images": refs}))
    assert e.value.param == "reference_images" and words in str(e.value) and "\n" not in str(e.value)


def test_http_routes_take_references_as_base64_and_as_edit_image_parts(folders):
    """/v1/images/generations takes `reference_images` as base64 strings, /v1/images/edits every image[] part as a
    reference on this family; both equal the pipeline with those references; bad ones are a 400 naming the field."""
    import base64
    import io

    from PIL import Image

    from diffgraph import Engine
    from diffgraph.server import ServerConfig
    from server_util import b64png, served

    path, pipe = folders["FLUX.2-klein-4B"]
    want = oracle(pipe, REFS[2], (128, 128), 2, 4)

    def png(refs):
        out = []
        for r in refs:
            buf = io.BytesIO()
            Image.fromarray(r).save(buf, "PNG")
            out.append(buf.getvalue())
        return out

    def image(answer) -> np.ndarray:
        assert answer.status_code == 200, answer.text
        return np.array(Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"])))).astype(
            np.int16)

    body = {"prompt": PROMPT, "size": "128x128", "seed": 4, "num_inference_steps": 2}
    with served(Engine(model=path, device="cpu"), ServerConfig(model=path, device="cpu")) as client:
        assert "reference_images" in client.get("/v1/models").json()["data"][0]["capabilities"]
        refs = [b64png(Image.fromarray(r)) for r in REFS[2]]
        got = image(client.post("/v1/images/generations", json={**body, "reference_images": refs}))
        assert np.abs(got - want).max() <= 1
        form = {k: str(v) for k, v in body.items()}
        files = [("image[]", (f"{i}.png", data, "image/png")) for i, data in enumerate(png(REFS[2]))]
        got = image(client.post("/v1/images/edits", data=form, files=files))
        assert np.abs(got - want).max() <= 1
        for bad, field in (({"reference_images": "abc"}, "reference_images"),
                           ({"reference_images": refs * 3}, "reference_images")):
            answer = client.post("/v1/images/generations", json={**body, **bad})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text
        answer = client.post("/v1/images/edits", data={**form, "strength": "1"}, files=files)
        assert np.abs(image(answer) - want).max() <= 1  # strength 1: from noise, as without one
        # AUTOMATIC1111's img2img: every init image a reference; at denoising_strength 1 none is a start
        a1111 = {"prompt": PROMPT, "init_images": refs, "width": 128, "height": 128, "seed": 4, "steps": 2,
                 "denoising_strength": 1.0}
        answer = client.post("/sdapi/v1/img2img", json=a1111)
        assert answer.status_code == 200, answer.text
        got = np.array(Image.open(io.BytesIO(base64.b64decode(answer.json()["images"][0])))).astype(np.int16)
        assert np.abs(got - want).max() <= 1 and not any("strength" in w for w in answer.json()["warnings"])
        answer = client.post("/sdapi/v1/img2img", json={**a1111, "mask": refs[0]})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "mask", answer.text


def test_a_job_item_s_reference_images_are_its_request_s_and_bad_ones_are_refused_at_submit(folders, tmp_path):
    """A batch job's item carries `reference_images` (base64) as an images body does: its candidate's image equals
    the pipeline's with those references; a bad reference or too many is a 400 naming the item's field when the job
    is submitted, and nothing is stored."""
    from PIL import Image

    from diffgraph import Engine
    from diffgraph.server import ServerConfig
    from server_util import b64png, job_first_image, served

    path, pipe = folders["FLUX.2-klein-4B"]
    want = oracle(pipe, REFS[2], (128, 128), 2, 4)
    refs = [b64png(Image.fromarray(r)) for r in REFS[2]]
    item = {"prompt": PROMPT, "size": "128x128", "seeds": [4], "num_inference_steps": 2, "reference_images": refs}
    config = ServerConfig(model=path, device="cpu", state_dir=str(tmp_path / "state"))
    with served(Engine(model=path, device="cpu"), config) as client:
        for bad, words in (("abc", "must be a list of base64 images"), (refs * 3, "6 reference images; send at most 4")):
            r = client.post("/v1/jobs", json={"items": [{**item, "reference_images": bad}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "items[0].reference_images", r.text
            assert words in r.json()["error"]["message"], r.text
        assert client.get("/v1/jobs").json()["data"] == []
        r = client.post("/v1/jobs", json={"items": [item]})
        assert r.status_code == 200, r.text
        job = r.json()["id"]
        assert np.abs(job_first_image(client, job) - want).max() <= 1


def inpaint_oracle(pipe, start: np.ndarray, strength: float, steps: int, seed: int,
                   reference: np.ndarray | None = None) -> np.ndarray:
    """diffusers' `Flux2KleinInpaintPipeline` at a full (all-white) mask: image-to-image from `start` (also its first
    reference), `reference` a second one."""
    from diffusers import Flux2KleinInpaintPipeline
    from PIL import Image

    inpaint = Flux2KleinInpaintPipeline(**pipe.components, is_distilled=pipe.config.is_distilled)
    mask = Image.new("L", (start.shape[1], start.shape[0]), 255)
    image = inpaint(prompt=PROMPT, image=Image.fromarray(start), mask_image=mask, strength=strength,
                    image_reference=None if reference is None else Image.fromarray(reference),
                    num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
                    output_type="np").images[0]
    return (image * 255).round().astype(np.int16)


def test_image_to_image_rows_at_two_strengths_and_plain_rows_together_each_equal_the_pipeline(folders, klein):
    """An image with `strength` below 1 starts from its posterior's mode noised to the step the strength selects (the
    flow rule: 4 steps at 0.5 run the last 2, at 0.75 the last 3), reading the image as its reference too: each
    equals diffusers' klein inpaint pipeline at a full mask. Rows at strengths 0.5 and 0.75 and a reference row from
    noise share a step (one group), a plain row runs beside them; each equals its request alone. A mask is refused:
    the family does not inpaint."""
    pipe = folders["FLUX.2-klein-4B"][1]
    starts = {0.5: picture(128, 128, 7), 0.75: picture(96, 160, 8)}
    requests = [dict(prompt=PROMPT, image=start, strength=strength, num_inference_steps=4, seed=20 + i,
                     extras={"reference_images": [start]}) for i, (strength, start) in enumerate(starts.items())]
    requests += [request([starts[0.5]], (128, 128), 22), request([], (96, 160), 23)]
    for r in requests[2:]:
        r["num_inference_steps"] = 4
    made = [GenerationRequest.create(model=klein.info, **r) for r in requests]
    assert [r.denoising_steps for r in made] == [2, 3, 4, 4] and klein.info.edit_steps_rule == "flow"
    keys = [klein.runner.group_key(r.key, (), klein.runner.capabilities.prepare(dict(r.extras or {}), "m"))
            for r in made]
    assert keys == [(256, 256)] * 3 + [(0, 256)]
    got = images_together(klein, requests)
    for i, (strength, start) in enumerate(starts.items()):
        want = inpaint_oracle(pipe, start, strength, 4, 20 + i)
        assert got[i].shape == start.shape and np.abs(got[i] - want).max() <= 1, strength
        assert np.abs(want - oracle(pipe, [start], start.shape[:2], 4, 20 + i)).max() > 3  # the start shows
    assert np.abs(got[2] - oracle(pipe, [starts[0.5]], (128, 128), 4, 22)).max() <= 1
    assert np.abs(got[3] - oracle(pipe, [], (96, 160), 4, 23)).max() <= 1
    with pytest.raises(ParamError) as e:
        klein.submit(GenerationRequest.create(model=klein.info, **requests[0],
                                              mask_image=np.zeros((128, 128), np.uint8)))
    assert e.value.param == "mask" and "\n" not in str(e.value)


def test_http_routes_start_from_the_first_image_below_strength_1(folders):
    """AUTOMATIC1111's img2img with `denoising_strength` 0.5 and /v1/images/edits with `strength` 0.5 start from the
    first image noised to that strength, every image still a reference: each equals the klein inpaint pipeline at a
    full mask with the first image as its start and the second as its extra reference; a strength out of range is a
    400 naming the route's field, a mask stays a 400 naming `mask`."""
    import base64
    import io

    from PIL import Image

    from diffgraph import Engine
    from diffgraph.server import ServerConfig
    from server_util import b64png, served

    path, pipe = folders["FLUX.2-klein-4B"]
    start, second = picture(128, 128, 9), REFS[1][0]
    want = inpaint_oracle(pipe, start, 0.5, 4, 6, reference=second)
    assert np.abs(want - oracle(pipe, [start, second], (128, 128), 4, 6)).max() > 3  # the start shows

    def png(r: np.ndarray) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(r).save(buf, "PNG")
        return buf.getvalue()

    def decoded(text: str) -> np.ndarray:
        return np.array(Image.open(io.BytesIO(base64.b64decode(text)))).astype(np.int16)

    a1111 = {"prompt": PROMPT, "init_images": [b64png(Image.fromarray(r)) for r in (start, second)], "width": 128,
             "height": 128, "seed": 6, "steps": 4, "denoising_strength": 0.5}
    form = {"prompt": PROMPT, "size": "128x128", "seed": "6", "num_inference_steps": "4", "strength": "0.5"}
    files = [("image[]", (f"{i}.png", png(r), "image/png")) for i, r in enumerate((start, second))]
    with served(Engine(model=path, device="cpu"), ServerConfig(model=path, device="cpu")) as client:
        answer = client.post("/sdapi/v1/img2img", json=a1111)
        assert answer.status_code == 200, answer.text
        assert np.abs(decoded(answer.json()["images"][0]) - want).max() <= 1
        assert not any("strength" in w for w in answer.json()["warnings"])
        answer = client.post("/v1/images/edits", data=form, files=files)
        assert answer.status_code == 200, answer.text
        assert np.abs(decoded(answer.json()["data"][0]["b64_json"]) - want).max() <= 1
        for route, body, field in (("/sdapi/v1/img2img", {**a1111, "denoising_strength": 0}, "denoising_strength"),
                                   ("/sdapi/v1/img2img", {**a1111, "mask": a1111["init_images"][0]}, "mask")):
            answer = client.post(route, json=body)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text
            assert "\n" not in answer.json()["error"]["message"]
        for bad, field in (({"strength": "1.5"}, "strength"), ({}, "mask")):
            extra = [("mask", ("m.png", png(np.full((128, 128, 3), 255, np.uint8)), "image/png"))] if not bad else []
            answer = client.post("/v1/images/edits", data={**form, **bad}, files=files + extra)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text
