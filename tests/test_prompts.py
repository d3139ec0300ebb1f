"""Prompts as people write them (issue 30), through the engine: clip skip and textual-inversion embeddings against
diffusers' pipelines, AUTOMATIC1111's emphasis and chunks against a reference computed here from its rules, rows of
1, 2 and 3 chunks (with embeddings, clip skip and LoRA tags) together equal to each alone, and bad prompts refused
before the engine loop sees them.

The parser and the chunker are tested against an independent reference in tests/test_prompt_a1111.py; here the
chunks they give are encoded and compared with what AUTOMATIC1111 computes from them: each 77-token window encoded
alone, each token's hidden state times its weight, the window's mean restored ("original"), windows concatenated.
"""

from __future__ import annotations

import copy
import os
import time

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from diffgraph import Engine
from diffgraph.request import ParamError
from diffgraph.text.prepared import TokenCache, empty_prompt, prepare

PROMPT = "a photo of a red fox in the snow"
LONG = ", ".join(["a detailed painting of a small red house in the dark forest at night"] * 5)  # 99 tokens
HALF = ", ".join(["a detailed painting of a small red house in the dark forest at night"] * 3)


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_engine, tiny_xl_engine):
    """Embedding folders for SD (768-wide: the tiny encoder's width) and SDXL (clip_l / clip_g pairs)."""
    base = tmp_path_factory.mktemp("embeddings")
    torch.manual_seed(0)
    out = {}
    for family, engine in (("sd", tiny_engine), ("sdxl", tiny_xl_engine)):
        folder = base / family
        folder.mkdir()
        dims = engine.model.adapter.embedding_dims(engine.model)
        for name, count in (("fox", 1), ("snowy", 3)):
            tensors = ({"emb_params": torch.randn(count, dims["default"])} if family == "sd" else
                       {"clip_l": torch.randn(count, dims["clip_l"]), "clip_g": torch.randn(count, dims["clip_g"])})
            save_file(tensors, str(folder / f"{name}.safetensors"))
        out[family] = str(folder)
    return out


def _shift(engine):
    """Moves the encoders' hidden states' mean away from 0, as a trained CLIP's is: a random one's final layer norm
    centres them, and AUTOMATIC1111's "original" emphasis divides by that mean (noise over noise)."""
    with torch.no_grad():
        for encoder in engine.model.text_encoders:  # by parameter name: LoRA side paths may wrap the layers
            for name, p in encoder.named_parameters():
                if name.endswith("bias") and ("final_layer_norm" in name or ".fc2." in name) and "lora" not in name:
                    p.add_(0.5)
    return engine


@pytest.fixture(scope="module")
def sd(folders):
    with Engine(model="random:tiny", device="cpu", dtype="fp32", embeddings_dir=folders["sd"]) as engine:
        yield _shift(engine)


@pytest.fixture(scope="module")
def sd_loras(folders, tiny_engine, tmp_path_factory):
    """random:tiny with the SD embeddings and one LoRA adapter, `ink` (for `<lora:ink:0.8>` tags)."""
    from lora_util import _write_diffusers

    loras = tmp_path_factory.mktemp("loras")
    _write_diffusers(tiny_engine, str(loras / "ink.safetensors"), rank=4, seed=3)
    with Engine(model="random:tiny", device="cpu", dtype="fp32", embeddings_dir=folders["sd"],
                lora_dir=str(loras)) as engine:
        yield _shift(engine)


@pytest.fixture(scope="module")
def sdxl(folders):
    with Engine(model="random:tiny-xl", device="cpu", dtype="fp32", embeddings_dir=folders["sdxl"]) as engine:
        yield _shift(engine)


def _pipe(engine):
    """diffusers' pipeline over copies of the engine's text modules (textual inversion resizes their embeddings)."""
    pipe = engine.diffusers_pipeline("euler", "default")
    for name in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"):
        module = getattr(pipe, name, None)
        if module is not None:
            module = copy.deepcopy(module)
            if name.startswith("text_encoder") and not hasattr(module, "text_model"):
                # transformers 5 dropped CLIPTextModel's `text_model` level, which diffusers' clip_skip reads
                object.__setattr__(module, "text_model", module)
            setattr(pipe, name, module)
    return pipe


def _reference(pipe, prompt, **kw):
    return pipe(prompt, num_inference_steps=3, generator=torch.Generator().manual_seed(kw.pop("seed")),
                output_type="np", **kw).images


@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_clip_skip_equals_diffusers(request, family):
    engine = request.getfixturevalue(family)
    ours = engine.generate(PROMPT, negative_prompt="blurry", num_inference_steps=3, seed=2, guidance_scale=5.0,
                           clip_skip=1)
    plain = engine.generate(PROMPT, negative_prompt="blurry", num_inference_steps=3, seed=2, guidance_scale=5.0)
    ref = _reference(_pipe(engine), PROMPT, negative_prompt="blurry", guidance_scale=5.0, clip_skip=1, seed=2)
    np.testing.assert_allclose(ours.arrays, ref, atol=1e-4, rtol=0)
    assert np.abs(ours.arrays - plain.arrays).max() > 1e-3  # the skip changed the image


@pytest.mark.parametrize("family", ["sd", "sdxl"])
@pytest.mark.parametrize("name,count", [("fox", 1), ("snowy", 3)])
def test_embeddings_equal_diffusers_load_textual_inversion(request, folders, family, name, count):
    engine = request.getfixturevalue(family)
    ours = engine.generate(f"a photo of {name} in the snow", negative_prompt="blurry", num_inference_steps=3,
                           seed=3, guidance_scale=5.0, prompt_syntax="a1111")
    pipe = _pipe(engine)
    path = os.path.join(folders[family], f"{name}.safetensors")
    token = f"<{name}>"
    if family == "sd":
        pipe.load_textual_inversion(path, token=token)
    else:
        from safetensors.torch import load_file
        state = load_file(path)
        pipe.load_textual_inversion(state["clip_l"], token=token, text_encoder=pipe.text_encoder,
                                    tokenizer=pipe.tokenizer)
        pipe.load_textual_inversion(state["clip_g"], token=token, text_encoder=pipe.text_encoder_2,
                                    tokenizer=pipe.tokenizer_2)
    ref = _reference(pipe, f"a photo of {token} in the snow", negative_prompt="blurry", guidance_scale=5.0, seed=3)
    np.testing.assert_allclose(ours.arrays, ref, atol=1e-4, rtol=0)
    without = engine.generate("a photo of in the snow", negative_prompt="blurry", num_inference_steps=3, seed=3,
                              guidance_scale=5.0, prompt_syntax="a1111")
    assert np.abs(ours.arrays - without.arrays).max() > 1e-3


def _encode_windows(engine, windows, clip_skip=None):
    """Reference: each 77-token window through the text encoder(s) alone, as the family conditions."""
    m = engine.model
    return m.adapter.encode_ids(m, [torch.tensor([w]) for w in windows], *([clip_skip] if clip_skip else []))


def _emphasis(z, weights, widths):
    """AUTOMATIC1111's "original" emphasis on one window, per encoder slice."""
    out, start = [], 0
    w = torch.tensor(weights).view(1, -1, 1)
    for width in widths:
        part = z[..., start:start + width]
        weighted = part * w
        out.append(weighted * (part.mean() / weighted.mean()))
        start += width
    return torch.cat(out, dim=-1)


@pytest.fixture(scope="module", params=["sd", "sdxl"])
def shifted(request):
    return request.getfixturevalue(request.param)


def test_emphasis_and_chunks_equal_the_reference(shifted):
    engine = shifted
    runner = engine.runner
    text = f"(red cat:1.4), [snow], {LONG} BREAK ((night sky))"  # no embedding names
    req = engine.make_request(text, negative_prompt="blurry", prompt_syntax="a1111", num_inference_steps=2)
    pos, neg = prepare(runner.text_setup, req)
    assert pos.chunks == 3 and neg.chunks == 1
    cond = runner.embed([("+", pos, ())])[("+", pos, ())]
    widths = engine.model.adapter.encoder_widths(engine.model)
    expected = []
    for c in range(3):
        windows = [pos.ids[t][c] for t in range(len(pos.ids))]
        z = _encode_windows(engine, windows)
        expected.append(_emphasis(z["embeds"], pos.weights[c], widths))
        if c == 0 and "pooled" in z:
            torch.testing.assert_close(cond["pooled"], z["pooled"])  # the first window's pooled output
    torch.testing.assert_close(cond["embeds"], torch.cat(expected, dim=1), atol=1e-5, rtol=1e-5)
    weights = set(w for window in pos.weights for w in window)
    assert {1.0, 1.4, 1 / 1.1, 1.1 * 1.1}.issubset({round(w, 6) for w in weights} | weights)


def test_no_norm_emphasis_skips_the_rescale(shifted):
    req = shifted.make_request("(red cat:1.5) in the snow", prompt_syntax="a1111", emphasis="no_norm",
                               num_inference_steps=2)
    pos, _ = prepare(shifted.runner.text_setup, req)
    cond = shifted.runner.embed([("+", pos, ())])[("+", pos, ())]
    z = _encode_windows(shifted, [pos.ids[t][0] for t in range(len(pos.ids))])["embeds"]
    torch.testing.assert_close(cond["embeds"], z * torch.tensor(pos.weights[0]).view(1, -1, 1))


def test_original_emphasis_on_a_centred_window_keeps_the_weights_alone():
    """A window whose states a bias-free final layer norm centred (mean 0 up to rounding) keeps z * w, finite; a
    window with a mean has it restored as AUTOMATIC1111 does."""
    from diffgraph.text.emphasis import emphasize

    z = torch.randn(2, 77, 8, generator=torch.Generator().manual_seed(0))
    z[0] = z[0] - z[0].mean(dim=-1, keepdim=True)  # each token centred, as a LayerNorm without bias leaves it
    z[1] = z[1] + 0.5
    w = torch.ones(2, 77)
    w[:, 3:6] = 1.21
    out = emphasize(z, w, [8], "original")
    assert bool(out.isfinite().all())
    torch.testing.assert_close(out[0], z[0] * w[0].unsqueeze(-1))
    weighted = z[1] * w[1].unsqueeze(-1)
    torch.testing.assert_close(out[1], weighted * (z[1].mean() / weighted.mean()))


def test_padding_the_shorter_prompt_with_empty_chunks(sd):
    """AUTOMATIC1111's "pad conds": a 2-chunk prompt's 1-chunk negative prompt gets the empty prompt's window."""
    req = sd.make_request(LONG, negative_prompt="blurry", prompt_syntax="a1111", num_inference_steps=2)
    pos, neg = prepare(sd.runner.text_setup, req)
    empty = empty_prompt(sd.runner.text_setup, pos)
    enc = sd.runner.embed([("+", pos, ()), ("-", neg, ()), ("+", empty, ())])
    cond, uncond, chunks = sd.runner.row_conditioning(enc[("+", pos, ())], enc[("-", neg, ())],
                                                      enc[("+", empty, ())])
    assert chunks == 2
    ref_empty = _encode_windows(sd, [tuple(_empty_ids(sd))])["embeds"]
    torch.testing.assert_close(uncond["embeds"][:, 77:154], ref_empty)
    assert uncond["embeds"].shape[1] == 154  # the buffers zero their third window (masked in the step)


def _empty_ids(engine):
    tok = engine.model.tokenizers[0]
    return [tok.bos_token_id] + [tok.eos_token_id] * 76


def test_mixed_chunk_counts_embeddings_clip_skip_submitted_together_equal_each_alone(sd_loras):
    sd = sd_loras
    requests = [
        dict(prompt=PROMPT),                                                     # plain, 1 window
        dict(prompt=f"(fox:1.3) {LONG}", prompt_syntax="a1111"),                 # 2 windows
        dict(prompt=f"{LONG} BREAK {HALF}", prompt_syntax="a1111", negative_prompt="snowy, blurry"),  # 3 + TI
        dict(prompt="a photo of snowy fox", prompt_syntax="a1111", clip_skip=1),  # embeddings, clip skip
        dict(prompt=PROMPT, guidance_scale=1.0),                                 # one branch
        dict(prompt=f"<lora:ink:0.8> (cat:1.2), {HALF}", prompt_syntax="a1111"),  # a LoRA tag, 1 window
    ]
    made = [sd.make_request(r.pop("prompt"), num_inference_steps=3, seed=10 + i, **r)
            for i, r in enumerate(requests)]
    assert made[-1].loras == (("ink", 0.8),)
    alone = [sd.run(r).arrays for r in made]
    futures = [sd.submit(r) for r in made]
    together = [f.result().arrays for f in futures]
    for a, t in zip(alone, together):
        np.testing.assert_allclose(t, a, atol=2e-5, rtol=0)
    assert len({round(float(a.mean()), 5) for a in alone}) == len(alone)


@pytest.mark.parametrize("prompt,field,words", [
    ("a photo of embedding:snowi", "prompt", "'snowy'"),
    ("a " * 240, "prompt", "at most 3"),
    ("a fox <lora:ink:abc>", "prompt", "lora"),
    ("a [fox:cat:0.5] AND a dog", "prompt", "'AND'"),
])
def test_bad_prompts_are_refused_naming_the_prompt(sd, prompt, field, words):
    before = sd.core.stats["steps"]
    with pytest.raises(ParamError) as err:
        sd.submit(sd.make_request(prompt, prompt_syntax="a1111", num_inference_steps=2))
    assert err.value.param == field and words in str(err.value) and "\n" not in str(err.value)
    assert sd.core.stats["steps"] == before


def test_a_pickle_embedding_is_never_read(tmp_path):
    folder = tmp_path / "emb"
    folder.mkdir()
    (folder / "bad.pt").write_bytes(b"\x80\x04not a pickle we would read")
    with Engine(model="random:tiny", device="cpu", dtype="fp32", embeddings_dir=str(folder)) as engine:
        with pytest.raises(ParamError) as err:
            engine.submit(engine.make_request("a embedding:bad fox", prompt_syntax="a1111", num_inference_steps=2))
    assert err.value.param == "prompt" and "'bad'" in str(err.value) and "pickle" in str(err.value)


def test_lora_tags_join_the_request_loras():
    from diffgraph.request import GenerationRequest
    r = GenerationRequest.create("a fox <lora:styles/ink:0.7>, snow", prompt_syntax="a1111", width=64, height=64,
                                 guidance_scale=5.0)
    assert r.loras == (("styles/ink", 0.7),)
    plain = GenerationRequest.create("a fox <lora:styles/ink:0.7>", width=64, height=64, guidance_scale=5.0)
    assert plain.loras == ()  # plain syntax reads the tag as text, as diffusers does


def test_http_a1111_prompts_embeddings_listing_and_errors(folders):
    """Over HTTP: `prompt_syntax` and `clip_skip` per request, the server's defaults, GET /v1/embeddings, and the
    prompt errors as 400s naming the field (a close embedding name suggested)."""
    from fastapi.testclient import TestClient

    from diffgraph.server.app import create_app
    from diffgraph.api.config import ServerConfig

    config = ServerConfig(model="random:tiny", device="cpu", embeddings_dir=folders["sd"], prompt_syntax="a1111",
                          clip_skip=1)
    with TestClient(create_app(config)) as client:
        for _ in range(6000):  # the engine is built on a background thread (a failure bound, not a timing)
            if client.get("/ready").status_code == 200:
                break
            time.sleep(0.05)
        listing = client.get("/v1/embeddings").json()
        assert [(e["name"], e["vectors"]) for e in listing["embeddings"]] == [("fox", 1), ("snowy", 3)]
        body = {"prompt": "a photo of (fox:1.2) in the snow", "num_inference_steps": 2, "seed": 1, "size": "64x64"}
        ok = client.post("/v1/images/generations", json=body)
        assert ok.status_code == 200, ok.text
        plain = client.post("/v1/images/generations", json={**body, "prompt_syntax": "plain", "clip_skip": 0})
        assert plain.status_code == 200 and plain.json()["data"][0]["b64_json"] != ok.json()["data"][0]["b64_json"]
        for prompt, words in (("a embedding:snowi cat", "did you mean 'snowy'"), ("a AND b", "AND"),
                              ("a <lora:x:abc>", "lora")):
            bad = client.post("/v1/images/generations", json={**body, "prompt": prompt})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt", bad.text
            assert words in bad.json()["error"]["message"]
        bad = client.post("/v1/images/generations", json={**body, "clip_skip": 40})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "clip_skip"


def test_a_replaced_embedding_takes_effect_for_the_next_request(tmp_path):
    """Replaced by a rename (the folder changes) or rewritten in place with another vector count (it does not): the
    next prompt reads the new file; the cache keys on the file version, so the old conditioning is never reused."""
    folder = tmp_path / "emb"
    folder.mkdir()
    path = folder / "fox.safetensors"
    torch.manual_seed(1)
    save_file({"emb_params": torch.randn(1, 32)}, str(path))
    with Engine(model="random:tiny", device="cpu", dtype="fp32", embeddings_dir=str(folder)) as engine:
        runner = engine.runner

        def cond():
            pos, _ = prepare(runner.text_setup, engine.make_request("a photo of fox", prompt_syntax="a1111"))
            return pos, runner.embed([("+", pos, ())])[("+", pos, ())]["embeds"]

        first, a = cond()
        save_file({"emb_params": torch.randn(1, 32)}, str(folder / "new.tmp"))
        os.replace(folder / "new.tmp", path)
        second, b = cond()
        assert first.splices[0][1] != second.splices[0][1] and float((a - b).abs().max()) > 1e-3
        times = os.stat(folder)
        save_file({"emb_params": torch.randn(2, 32)}, str(path))  # in place, the folder's time put back
        os.utime(folder, ns=(times.st_atime_ns, times.st_mtime_ns))
        third, _ = cond()
        assert third.splices[0][4] == 2


def test_kept_token_ids_equal_the_tokenizers(sd, caplog):
    """Prompts prepared again come from the token cache and equal a fresh tokenisation (plain, long plain, a1111
    with weights, BREAK and a repeated piece); a truncated plain prompt still warns each time."""
    import dataclasses

    setup = sd.runner.text_setup
    fresh = dataclasses.replace(setup, tokens=TokenCache(0))
    requests = [sd.make_request("a photo of a red fox", num_inference_steps=2),
                sd.make_request(" ".join(["fox"] * 90), num_inference_steps=2),
                sd.make_request("(red fox:1.2), forest BREAK red fox, (forest:0.8)", negative_prompt="blurry",
                                prompt_syntax="a1111", num_inference_steps=2)]
    for r in requests:
        first, again = prepare(setup, r), prepare(setup, r)
        assert first == again == prepare(fresh, r), r.prompt
    assert caplog.text.count("prompt truncated") == 3  # twice from `setup` (once from its cache), once from `fresh`
    assert (("plain", 0), "a photo of a red fox") in setup.tokens._ids


def test_the_token_cache_tokenises_only_what_it_lacks():
    calls = []

    def tokenize(texts):
        calls.append(list(texts))
        return [[len(t)] * len(t) for t in texts]

    cache = TokenCache(size=2)
    assert cache.get("k", ["a", "bb"], tokenize) == [(1,), (2, 2)] and calls == [["a", "bb"]]
    assert cache.get("k", ["bb", "a"], tokenize) == [(2, 2), (1,)] and len(calls) == 1  # both kept
    assert cache.get("k", ["ccc", "a"], tokenize) == [(3, 3, 3), (1,)] and calls[-1] == ["ccc"]
    assert cache.get("k", ["bb"], tokenize) == [(2, 2)] and calls[-1] == ["bb"]  # the least recent went
    assert cache.get("other", ["a"], tokenize) == [(1,)] and calls[-1] == ["a"]  # each kind of call on its own
    few = TokenCache(size=100, max_ids=5)  # at most 5 ids kept, whatever the texts
    assert few.get("k", ["aaa", "bb", "aaa"], tokenize) == [(3, 3, 3), (2, 2), (3, 3, 3)]
    assert few._held == 5 and list(few._ids) == [("k", "aaa"), ("k", "bb")]
    few.get("k", ["cccc"], tokenize)  # 9 ids: the oldest go until 5 or fewer are left
    assert list(few._ids) == [("k", "cccc")] and few._held == 4
    few.get("k", ["dddddd"], tokenize)  # longer than the whole bound: not kept, and nothing is evicted for it
    assert list(few._ids) == [("k", "cccc")] and few._held == 4


def test_prompts_prepared_on_many_threads_get_their_own_tokens(sd):
    """transformers' fast tokenizers keep their padding setting on the object: plain (padded) and a1111 (unpadded)
    prompts tokenised at once on several threads must not get each other's lengths."""
    import threading

    import dataclasses

    setup = dataclasses.replace(sd.runner.text_setup, tokens=TokenCache(0))  # no kept ids: every call tokenises
    plain = sd.make_request("a photo of a red fox", num_inference_steps=2)
    weighted = sd.make_request("a photo of a (red fox:1.2)", prompt_syntax="a1111", num_inference_steps=2)
    want = {id(r): [p.ids for p in prepare(setup, r)] for r in (plain, weighted)}
    bad = []

    def work(i):
        for k in range(60):
            r = (plain, weighted)[(i + k) % 2]
            if [p.ids for p in prepare(setup, r)] != want[id(r)]:
                bad.append(r.prompt_syntax)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []


def test_embedding_folder_oddities(tmp_path, tiny_xl_engine):
    """A name that tokenises to nothing is left out, another model's embedding leaves its word as text (as
    AUTOMATIC1111 skips it), and one in a sub-folder is found by its file name too."""
    folder = tmp_path / "emb"
    (folder / "neg").mkdir(parents=True)
    save_file({"emb_params": torch.randn(1, 32)}, str(folder / " .safetensors"))
    save_file({"clip_l": torch.randn(1, 32), "clip_g": torch.randn(1, 64)}, str(folder / "cat.safetensors"))
    save_file({"emb_params": torch.randn(2, 32)}, str(folder / "neg" / "smudge.safetensors"))
    with Engine(model="random:tiny", device="cpu", dtype="fp32", embeddings_dir=str(folder)) as engine:
        pos, neg = prepare(engine.runner.text_setup, engine.make_request(
            "a photo of a cat", negative_prompt="smudge, blurry", prompt_syntax="a1111"))
        assert pos.splices == ()  # the SDXL-shaped "cat" is not this model's: the word stays text
        assert [(s[0], s[4]) for s in neg.splices] == [("neg/smudge", 2)]


def test_sdxl_a1111_empty_negative_prompt_is_zeros(sdxl):
    """AUTOMATIC1111 zeroes SDXL's conditioning of an empty negative prompt (force_zero_negative_prompt)."""
    req = sdxl.make_request("a photo of a cat", prompt_syntax="a1111", num_inference_steps=2)
    pos, neg = prepare(sdxl.runner.text_setup, req)
    assert neg.text is None
    cond = sdxl.runner.embed([("-", neg, ())])[("-", neg, ())]
    assert float(cond["embeds"].abs().max()) == 0.0 and float(cond["pooled"].abs().max()) == 0.0


def test_lora_tag_errors_name_the_prompt_and_the_chunk_limit_is_checked():
    from diffgraph.request import GenerationRequest

    with pytest.raises(ParamError) as err:
        GenerationRequest.create("a fox <lora:ink:20>", prompt_syntax="a1111", width=64, height=64,
                                 guidance_scale=5.0)
    assert err.value.param == "prompt" and "20" in str(err.value)
    with pytest.raises(ValueError, match="max_prompt_chunks 5"):
        Engine(model="random:tiny", device="cpu", max_prompt_chunks=5)
