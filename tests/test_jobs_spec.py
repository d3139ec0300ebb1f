"""Job files (jobs/spec.py): JSON, JSONL and the grid form parse into items with one seed per candidate; every bad
file is refused before anything runs, with the line or item and the field named; 1,000,001 items are refused at
once, counted before they are read. In process, no model: items are checked against a digits-shaped ModelInfo
with the images route's own validation (api/protocol.py: generation_request)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from diffgraph.jobs.spec import MAX_CANDIDATES, SpecError, SpecLimits, parse_job
from diffgraph.request import ModelInfo
from diffgraph.api.config import ServerConfig
from diffgraph.api.protocol import generation_request

INFO = ModelInfo(name="digits", family="sd", native_size=64, default_guidance=7.5, max_rows=32, mode="eager",
                 device="cpu")
CONFIG = ServerConfig(model="digits")
LIMITS = SpecLimits(max_items=100_000)


def check(params, extras=None):
    return generation_request(INFO, CONFIG, params, extras=extras)


def jsonl(*items) -> bytes:
    return "\n".join(i if isinstance(i, str) else json.dumps(i) for i in items).encode()


def refused(data: bytes, form: str = "auto", limits: SpecLimits = LIMITS) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_job(data, form, limits, check)
    assert "\n" not in info.value.message  # one line
    return info.value


# -- the forms --------------------------------------------------------------------------------------------------
def test_jsonl_items_with_seeds_given_counted_or_drawn():
    spec = parse_job(jsonl({"prompt": "a", "seeds": [3, 9]}, "", {"prompt": "b", "seed": 10, "n": 3},
                           "   ", {"prompt": "c", "n": 2, "size": "64x64", "negative_prompt": None}),
                     "jsonl", LIMITS, check)
    assert [i.seeds for i in spec.items[:2]] == [(3, 9), (10, 11, 12)]
    assert [i.drawn for i in spec.items] == [False, False, True]
    drawn = spec.items[2].seeds
    assert len(drawn) == 2 and all(0 <= s < 2**31 for s in drawn)
    assert spec.items[2].body == {"prompt": "c", "size": "64x64"}  # nulls dropped, n and seeds apart
    assert spec.candidates == 7 and spec.name is None


def test_json_body_with_name_webhook_and_loras_as_pairs():
    body = {"items": [{"prompt": "a", "loras": [["ink", 0.5], {"name": "wash", "scale": 1}]}], "name": "shots",
            "webhook": "http://127.0.0.1:9/done"}
    spec = parse_job(json.dumps(body).encode(), "json", LIMITS, check)
    assert spec.name == "shots" and spec.webhook == "http://127.0.0.1:9/done"
    assert spec.items[0].body["loras"] == [{"name": "ink", "scale": 0.5}, {"name": "wash", "scale": 1}]
    # auto: an object with items is JSON; objects one a line are JSONL (the same item twice)
    assert len(parse_job(json.dumps(body).encode(), "auto", LIMITS, check).items) == 1
    assert len(parse_job(jsonl({"prompt": "a"}, {"prompt": "a"}), "auto", LIMITS, check).items) == 2


def test_the_grid_expands_prompts_by_varied_fields_with_the_same_seeds():
    grid = {"grid": {"prompts": ["a fox", "an owl"], "seeds": [1, 2, 3],
                     "vary": {"guidance_scale": [5, 7], "loras": [[["ink", 0.5]], [["ink", 1.0]]]},
                     "base": {"num_inference_steps": 4}}}
    items = parse_job(json.dumps(grid).encode(), "json", LIMITS, check).items
    assert len(items) == 2 * 2 * 2
    assert [(i.body["prompt"], i.body["guidance_scale"], i.body["loras"][0]["scale"]) for i in items] == [
        (p, g, s) for p in ("a fox", "an owl") for g in (5, 7) for s in (0.5, 1.0)]
    assert all(i.seeds == (1, 2, 3) and i.body["num_inference_steps"] == 4 for i in items)
    # vary.seed is the seeds; without seeds, n are drawn once for the whole grid (its cells compare)
    items = parse_job(json.dumps({"grid": {"prompts": ["a"], "vary": {"seed": [4, 5], "sampler": ["euler", "ddim"]}}})
                      .encode(), "json", LIMITS, check).items
    assert [i.seeds for i in items] == [(4, 5), (4, 5)] and [i.body["sampler"] for i in items] == ["euler", "ddim"]
    items = parse_job(json.dumps({"grid": {"prompts": ["a", "b"], "n": 3}}).encode(), "json", LIMITS, check).items
    assert items[0].seeds == items[1].seeds and len(items[0].seeds) == 3 and items[0].drawn


def test_an_item_carries_the_model_s_capability_parameters_to_its_check_and_keeps_them():
    """A capability's parameters (the model's `extension_params`) sit beside the images fields, as in an images
    body: stored in the item's body, handed to the check as the request's extras, variable in a grid."""
    info = dataclasses.replace(INFO, extension_params=("step_cache",))
    seen = []

    def check_extras(params, extras):
        seen.append(extras)
        return generation_request(info, CONFIG, params, extras=extras)
    cache = {"method": "deepcache", "interval": 2}
    spec = parse_job(jsonl({"prompt": "a", "seed": 3, "step_cache": cache}, {"prompt": "b", "seed": 4}), "jsonl",
                     LIMITS, check_extras, extras=info.extension_params)
    assert spec.items[0].body == {"prompt": "a", "step_cache": cache} and spec.items[1].body == {"prompt": "b"}
    assert seen == [{"step_cache": cache}, {}]
    grid = {"grid": {"prompts": ["a"], "seeds": [1], "vary": {"step_cache": ["off", cache]}}}
    items = parse_job(json.dumps(grid).encode(), "json", LIMITS, check_extras, extras=("step_cache",)).items
    assert [i.body["step_cache"] for i in items] == ["off", cache]
    # an unknown field is still refused, naming the model's parameters among those an item takes
    with pytest.raises(SpecError) as e:
        parse_job(jsonl({"prompt": "a", "step_cahce": cache}), "jsonl", LIMITS, check_extras, extras=("step_cache",))
    assert e.value.message.startswith("line 1: unknown field 'step_cahce'; an item takes prompt, ")
    assert e.value.message.endswith(", n, seed, seeds, step_cache") and e.value.param == "line 1.step_cahce"
    # on a model without it (no extension_params) it is an unknown field, as in an images body
    assert refused(jsonl({"prompt": "a", "step_cache": cache})).param == "line 1.step_cache"


# -- refusals, each naming where and what ---------------------------------------------------------------------
@pytest.mark.parametrize("data, needle, param", [
    (jsonl({"prompt": "a"}, '{"prompt": "b",}'), "line 2 is not valid JSON", "line 2"),
    (jsonl({"prompt": "a"}, {"prompt": "b"}, {"prompt": "c", "promt": "x"}), "line 3: unknown field 'promt'",
     "line 3.promt"),
    (jsonl({"prompt": "a", "size": "65x64"}), "line 1: width 65 is not a multiple of 8", "line 1.size"),
    (jsonl({"prompt": "a"}, {"prompt": "b", "num_inference_steps": 5000}), "line 2: num_inference_steps 5000 is "
     "out of range", "line 2.num_inference_steps"),
    (jsonl({"prompt": "a", "sampler": "euler_b"}), "line 1: sampler 'euler_b' is unknown", "line 1.sampler"),
    (jsonl({"prompt": "a", "guidance_scale": "7"}), "line 1: guidance_scale: must be a number",
     "line 1.guidance_scale"),
    (jsonl({"prompt": "a", "n": MAX_CANDIDATES + 1}), f"line 1: n {MAX_CANDIDATES + 1} is out of range", "line 1.n"),
    (jsonl({"prompt": "a", "n": 3, "seeds": [1, 2]}), "line 1: n is 3 but seeds lists 2", "line 1.n"),
    (jsonl({"prompt": "a", "seeds": [1, -2]}), "line 1: seed -2 in seeds is not an integer", "line 1.seeds"),
    (jsonl({"prompt": "a", "seed": 1, "seeds": [1]}), "give seeds (one per candidate) or seed", "line 1.seeds"),
    (jsonl({"prompt": "a", "stream": True}), "line 1: stream has no meaning in a job", "line 1.stream"),
    (jsonl({"prompt": "a", "output_format": "jpeg"}), "a job stores PNG images", "line 1.output_format"),
    (jsonl({"prompt": "a", "model": "sdxl"}), "line 1: model 'sdxl' is not served here", "line 1.model"),
    (jsonl({"prompt": "a", "prompt_syntax": "a1111", "negative_prompt": "x" * 5000}), "negative_prompt has 5000 "
     "bytes", "line 1.negative_prompt"),
    (jsonl([1, 2]), "line 1: an item is a JSON object", "line 1"),
    (jsonl({"items": []}), "line 1 holds a whole job", "line 1"),
    (b"", "the job has no items", "items"),
    (b"\xff\xfe\x00", "not UTF-8", None),
    (b'{"prompt": ' + b"[" * 100_000 + b"}", "line 1 is not valid JSON (nested too deeply)", "line 1"),
])
def test_a_bad_jsonl_file_is_refused_naming_its_line_and_field(data, needle, param):
    e = refused(data, "jsonl")
    assert needle in e.message and e.param == param, (e.message, e.param)


@pytest.mark.parametrize("body, needle, param", [
    ('{"items": [{"prompt": "a"}, {"prompt": "b", "size": "big"}]}', "items[1]: size 'big' must look like",
     "items[1].size"),
    ('{"items": [{"prompt": "a"}], "nmae": "x"}', "unknown job field 'nmae'", "nmae"),
    ('{"items": {"prompt": "a"}}', "items must be a list", "items"),
    ('{"name": "x"}', "give items (a list) or grid", "items"),
    ('{"items": [{"prompt": "a"}] "name": "x"}', "Expecting ',' delimiter: line 1 column 29", None),
    ('{"items": [{"prompt": "a"}]', "not valid JSON", None),
    ('[{"prompt": "a"}]', "a JSON job is an object", None),
    ('{"items": [{"prompt": "a"}], "name": 5}', "name must be a string", "name"),
    ('{"grid": {"prompts": ["a"], "vary": {"prompt": ["b"]}}}', "grid.vary.prompt cannot be varied",
     "grid.vary.prompt"),
    ('{"grid": {"prompts": ["a"], "vary": {"eta": [0.1], "sampler": ["ddim"], "schedule": ["karras"]}}}',
     "grid.vary has 3 fields; a grid varies at most 2", "grid.vary"),
    ('{"grid": {"prompts": [], "seeds": [1]}}', "grid.prompts must be a non-empty list", "grid.prompts"),
    ('{"grid": {"prompts": ["a"], "vary": {"size": ["64x64", "64x63"]}}}',
     "grid item 1 (prompts[0], vary.size[1]): height 63 is not a multiple of 8",
     "grid item 1 (prompts[0], vary.size[1]).size"),
    ('{"items": [{"prompt": "a", "seed": ' + "1" * 5000 + '}]}', "not valid JSON (Exceeds the limit (4300 digits)",
     None),
    ('[' * 100_000, "a JSON job is an object", None),
    ('{"grid": {"prompts": ["a"], "seeds": [1], "vary": {"seed": [2]}}}', "give one", "grid.vary.seed"),
    ('{"grid": {"prompts": ["a"], "steps": 3}}', "unknown field grid.steps", "grid.steps"),
])
def test_a_bad_json_job_is_refused_naming_its_item_and_field(body, needle, param):
    e = refused(body.encode(), "json")
    assert needle in e.message and e.param == param, (e.message, e.param)


def test_a_million_and_one_items_are_refused_at_once_in_every_form(monkeypatch):
    """Counted before the items are read: no line of the JSONL form is parsed and no item of any form is checked
    (the JSON form stops reading past the limit; the grid is counted from its axes)."""
    line = b'{"prompt": "a handwritten digit three"}'
    limits = SpecLimits(max_items=1_000_000)
    calls = {"loads": 0, "check": 0}
    loads = json.loads

    def counted_loads(*args, **kwargs):
        calls["loads"] += 1
        return loads(*args, **kwargs)

    def counted_check(params, extras):
        calls["check"] += 1
        return check(params, extras)

    monkeypatch.setattr(json, "loads", counted_loads)
    for data, form in ((b"\n".join([line] * 1_000_001), "jsonl"),
                       (b'{"items": [' + b",".join([line] * 1_000_001) + b"]}", "json")):
        with pytest.raises(SpecError) as info:
            parse_job(data, form, limits, counted_check)
        assert info.value.message == ("the job has more than 1000000 items; this server takes at most 1000000 a job "
                                      "(--max-batch-items): split it into several jobs") and info.value.param == "items"
    grid = {"grid": {"prompts": ["a"] * 1001, "vary": {"guidance_scale": list(range(1000))}}}
    with pytest.raises(SpecError, match="the job has 1001000 items"):
        parse_job(json.dumps(grid).encode(), "json", limits, counted_check)
    assert calls == {"loads": 0, "check": 0}


def test_a_grid_over_the_candidate_limit_is_refused_from_its_sizes_before_any_item_is_made():
    """316 prompts x 316 guidance values x 64 seeds: a 5 KB body of 6.4 million candidates (1.4 GB of SQLite) was
    expanded, checked and stored."""
    calls = []

    def counted_check(params, extras):
        calls.append(params)
        return check(params, extras)
    grid = {"grid": {"prompts": [f"p{i}" for i in range(316)], "seeds": list(range(64)),
                     "vary": {"guidance_scale": [1 + i / 100 for i in range(316)]}}}
    body = json.dumps(grid).encode()
    with pytest.raises(SpecError) as info:
        parse_job(body, "json", LIMITS, counted_check)
    assert info.value.message == ("the grid is 316 prompts x 316 guidance_scale values x 64 seeds = 6390784 candidate "
                                  "images; this server takes at most 100000 a job (--max-job-candidates): vary fewer "
                                  "values or split it into several jobs")
    assert info.value.param == "grid" and calls == []
    items = jsonl(*[{"prompt": "a", "n": 40}] * 3)
    e = refused(items, "jsonl", SpecLimits(max_items=10, max_candidates=100))
    assert e.message.startswith("the job has more than 100 candidate images (at line 3); this server takes at most "
                                "100 a job (--max-job-candidates)") and e.param == "items"
    assert parse_job(items, "jsonl", SpecLimits(max_items=10, max_candidates=120), check).candidates == 120


def test_the_default_limit_and_an_item_over_it():
    e = refused(b"\n".join([b'{"prompt": "a"}'] * 100_001), "jsonl")
    assert e.message.startswith("the job has more than 100000 items; this server takes at most 100000 a job")
    assert len(parse_job(b"\n".join([b'{"prompt": "a"}'] * 3), "jsonl", SpecLimits(max_items=3), check).items) == 3
    refused(b"\n".join([b'{"prompt": "a"}'] * 4), "jsonl", SpecLimits(max_items=3))


# -- the settings and the webhook checks the job routes use ------------------------------------------------------
def test_job_settings_parse_and_refuse_with_their_flag_named(tmp_path):
    from diffgraph.api.config import load_config

    config = load_config(None, {"model": "digits", "state_dir": str(tmp_path / "state"), "job_retention": "12h",
                                "max_batch_items": "500", "batch_inflight": 8, "webhook_secret": "s",
                                "max_job_candidates": "6000", "max_key_jobs": 3, "max_key_bytes": 2**30,
                                "webhook_allow": "127.0.0.1, Hooks.Example.com:8080"})
    assert (config.job_retention, config.max_batch_items, config.batch_inflight) == (43200.0, 500, 8)
    assert (config.max_job_candidates, config.max_key_jobs, config.max_key_bytes) == (6000, 3, 2**30)
    default = ServerConfig(model="digits")  # a studio's episode: 4,000 shots x 15 candidates, several at once
    assert (default.max_job_candidates, default.max_key_jobs, default.max_key_bytes) == (100_000, 16, 256 * 2**30)
    assert config.webhook_allow == ("127.0.0.1", "hooks.example.com:8080") and "'s'" not in repr(config)
    assert load_config(None, {"model": "digits", "job_retention": "90m"}).job_retention == 5400.0
    for values, needle in (({"job_retention": "12x"}, "job-retention must be a duration"),
                           ({"job_retention": 0}, "job-retention 0 s is out of range"),
                           ({"max_batch_items": 0}, "max-batch-items 0 is out of range"),
                           ({"batch_inflight": 0}, "batch-inflight 0 is out of range"),
                           ({"max_job_candidates": 0}, "max-job-candidates 0 is out of range"),
                           ({"max_key_jobs": 0}, "max-key-jobs 0 is out of range"),
                           ({"max_key_bytes": 1000}, "max-key-bytes 1000 must be >= 1048576"),
                           ({"webhook_allow": "127.0.0.1"}, "webhook-allow needs a signing secret"),
                           ({"webhook_allow": "a b", "webhook_secret": "s"}, "'a b' is not a host name"),
                           ({"state_dir": "/proc/diffgraph-state"}, "state-dir '/proc/diffgraph-state' is not a "
                                                                    "writable folder")):
        with pytest.raises(ValueError, match=needle):
            load_config(None, {"model": "digits", **values})


def test_webhooks_go_only_to_allowed_hosts_and_are_signed():
    import hashlib
    import hmac

    from diffgraph.jobs.webhook import WebhookRefused, check_webhook, sign, webhook_secret

    allow = ("127.0.0.1", "hooks.example.com:8443")
    assert check_webhook("http://127.0.0.1:9000/done", allow) == "http://127.0.0.1:9000/done"
    assert check_webhook("https://HOOKS.example.com:8443/x", allow)
    for url, needle in (("https://hooks.example.com/x", "webhook host 'hooks.example.com' is not allowed"),
                        ("http://10.0.0.1/x", "not allowed; this server calls only 127.0.0.1, hooks.example.com:8443"),
                        ("ftp://127.0.0.1/x", "must be an http or https URL"),
                        ("http://user:pw@127.0.0.1/x", "may not carry credentials"),
                        ("http://127.0.0.1:99999/x", "is not a URL")):
        with pytest.raises(WebhookRefused, match=re.escape(needle)):
            check_webhook(url, allow)
    with pytest.raises(WebhookRefused, match="start it with --webhook-allow HOST"):
        check_webhook("http://127.0.0.1/x", ())
    body = b'{"id":"job_1"}'
    assert sign(b"k", body) == "sha256=" + hmac.new(b"k", body, hashlib.sha256).hexdigest()
    derived = webhook_secret(None, ("b", "a"))
    assert derived == hashlib.sha256(b"diffgraph webhooks\na\nb").hexdigest().encode()
    assert webhook_secret("given", ("a",)) == b"given" and webhook_secret(None, ()) is None


# -- references: what the items name, looked up before anything is stored -----------------------------------------
def test_an_item_naming_a_reference_the_server_cannot_serve_refuses_the_whole_job(tmp_path):
    """A job naming an unknown LoRA, ControlNet, IP-Adapter or embedding was accepted and failed item by item in the
    engine; now the route's check (server/jobs_routes.py: References.checker) refuses it whole, naming the item and
    the reference."""
    from diffgraph.errors import ParamError
    from diffgraph.jobs.references import References
    from diffgraph.api.protocol import error_from_param_error

    loras, embeddings = tmp_path / "loras", tmp_path / "embeddings"
    (loras / "styles").mkdir(parents=True)
    embeddings.mkdir()
    (loras / "styles" / "ink.safetensors").write_bytes(b"adapter")   # a stat finds it; its weights are the engine's
    (embeddings / "calm.safetensors").write_bytes(b"embedding")
    config = ServerConfig(model="digits", lora_dir=str(loras), embeddings_dir=str(embeddings))

    def checked(body: dict):
        named = References(config).checker()

        def check_named(params, extras):
            request = generation_request(INFO, config, params, extras=extras)
            try:
                named(request)
            except ParamError as e:
                raise error_from_param_error(e) from None
        return parse_job(json.dumps(body).encode(), "json", LIMITS, check_named)

    good = {"prompt": "a digit <lora:styles/ink:0.5> embedding:calm", "prompt_syntax": "a1111"}
    png = tiny_png()
    assert len(checked({"items": [good, good]}).items) == 2
    grid = {"grid": {"prompts": ["a digit"], "vary": {"loras": [[["styles/ink", 1]], [["styles/inc", 1]]]}}}
    cases = [
        (grid, "grid item 1 (prompts[0], vary.loras[1]): adapter 'styles/inc' is unknown; did you mean "
         "'styles/ink'?",
         "grid item 1 (prompts[0], vary.loras[1]).loras"),
        ({"items": [good, {"prompt": "a digit", "loras": [["../etc/passwd", 1]]}]}, "items[1]: adapter name "
         "'../etc/passwd' is not allowed", "items[1].loras"),
        ({"items": [good, {"prompt": "a digit <lora:nope:1>", "prompt_syntax": "a1111"}]},
         "items[1]: adapter 'nope' is unknown", "items[1].loras"),
        ({"items": [{"prompt": "a digit", "controls": [{"model": "nope", "image": png}]}]},
         "items[0]: ControlNet 'nope' is unknown", "items[0].controls"),
        ({"items": [{"prompt": "a digit", "image_prompts": {"model": "face", "images": [png]}}]},
         "items[0]: IP-Adapter 'face': this server serves no IP-Adapters", "items[0].image_prompts"),
        ({"items": [good, {"prompt": "a digit embedding:stormy", "prompt_syntax": "a1111"}]},
         "items[1]: prompt: unknown embedding 'stormy'", "items[1].prompt"),
        ({"items": [{"prompt": "a digit", "model": "sdxl"}]}, "items[0]: model 'sdxl' is not served here",
         "items[0].model"),
    ]
    for body, needle, param in cases:
        with pytest.raises(SpecError) as info:
            checked(body)
        assert info.value.message.startswith(needle) and info.value.param == param, (info.value.message, param)
    off = References(ServerConfig(model="random:tiny")).checker()
    with pytest.raises(ParamError, match="adapter 'styles/ink': this server has no adapter slots"):
        off(generation_request(INFO, config, parse_params({"prompt": "a", "loras": [{"name": "styles/ink", "scale": 1}]})))


def tiny_png() -> str:
    import base64
    import io

    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), "white").save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def parse_params(body: dict):
    from diffgraph.api.protocol import ImageGenerationRequest
    return ImageGenerationRequest.model_validate(body)
