"""The playground page (GET /) in a real browser: Debian's Chromium driven by Playwright, against a real
`python -m diffgraph.server.cli --model digits --device cpu` process (one for the plain scenarios, one of its own
for each scenario that needs other flags).

The driving code (server process, browser launch, form filling, waiting for a result) lives in
tools/playground_screenshot.py, which writes docs/playground.png with it. Every wait is a Playwright wait with a
generous bound (the machine may be slow and loaded); nothing depends on a short wall-clock limit.

Needs `apt-get install -y chromium` (/usr/bin/chromium) and `pip install playwright` (no `playwright install`).
Without them the tests skip, except under CI=true, where they fail saying what to install.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import re
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from diffgraph.models.presets import shipped_preset_folder

_TOOL = Path(__file__).resolve().parents[1] / "tools" / "playground_screenshot.py"
_spec = importlib.util.spec_from_file_location("playground_screenshot", _TOOL)
pg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pg)

PROMPT = "a handwritten digit seven"
SEED = 1234
STEPS = 8
API_KEY = "playground-test-key"
GENERATIONS = "/v1/images/generations"


@pytest.fixture(scope="module")
def browser():
    missing = pg.missing_browser()
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the playground browser test cannot run in CI: {missing}", pytrace=False)
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pg.launch_chromium(pw)
        try:
            yield chromium
        finally:
            chromium.close()


def _server(*flags: str, until: str = "/ready", model: str = "digits"):
    server = pg.PlaygroundServer(*flags, model=model)
    try:
        server.wait_ready(path=until)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def server():
    """One plain server for the scenarios that need nothing else: each opens its page in a fresh browser context
    (empty localStorage), and none reads what another left on the server."""
    s = _server("--request-timeout", "600")
    yield s
    s.stop()


@pytest.fixture
def keyed_server():
    """Only listening, not yet ready: the page itself polls /info until the model is loaded."""
    s = _server("--request-timeout", "600", "--api-key", API_KEY, "--protect-metrics", until="/health")
    yield s
    s.stop()


@pytest.fixture
def model_dir(tmp_path):
    """A --model-dir: the shipped digits-xl twice (`xl/spare` is removed while the page lists it) and a file too
    short to be a checkpoint."""
    root = tmp_path / "models"
    source = shipped_preset_folder("digits-xl")
    if source is None:
        pytest.skip("this install does not carry the digits-xl preset")
    for name in ("digits-xl", "spare"):
        shutil.copytree(source, root / "xl" / name)
    (root / "broken.safetensors").write_bytes(b"0123456789")
    return root


@pytest.fixture
def multi_server(model_dir):
    s = _server("--request-timeout", "600", "--model-dir", str(model_dir))
    yield s
    s.stop()


class Traffic:
    """The page's generation requests (their JSON bodies and Authorization headers) and their statuses."""

    def __init__(self, page):
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.statuses: list[int] = []
        page.on("request", self._request)
        page.on("response", self._response)

    def _request(self, request) -> None:
        if request.url.endswith(GENERATIONS) and request.method == "POST":
            self.bodies.append(json.loads(request.post_data))
            self.auth.append(request.headers.get("authorization"))

    def _response(self, response) -> None:
        if response.url.endswith(GENERATIONS):
            self.statuses.append(response.status)


def _watch(page) -> tuple[Traffic, list[str], list[bytes]]:
    """The page's generation requests, its script errors and the edits forms it posts (their raw bodies)."""
    traffic, errors, forms = Traffic(page), [], []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.route("**/v1/images/edits", lambda route: (forms.append(route.request.post_data_buffer or b""),
                                                      route.continue_()))
    return traffic, errors, forms


def _image_sizes(card) -> list[tuple[int, int]]:
    sizes = []
    for src in card.locator("[data-testid=result-image]").evaluate_all("imgs => imgs.map(i => i.src)"):
        prefix = "data:image/png;base64,"
        assert src.startswith(prefix)
        sizes.append(Image.open(io.BytesIO(base64.b64decode(src[len(prefix):]))).size)
    return sizes


def _form(page) -> dict[str, str]:
    return {name: page.input_value(f"#{name}") for name in ("prompt", "seed", "steps", "size", "n", "sampler")}


def test_generate_errors_reuse_and_history(browser, server, tmp_path):
    page = pg.open_playground(browser, server.url)
    traffic = Traffic(page)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))

    # the size select starts with the graphed resolutions from /info (none on this eager CPU server), then the
    # native size and other common sizes, then custom
    info = page.evaluate("() => fetch('/info').then(r => r.json())")
    options = page.eval_on_selector_all("#size option", "os => os.map(o => o.value)")
    assert info["graphed_resolutions"] == [] and options[0] == "64x64"
    assert options[-1] == "custom" and len(options) > 2
    assert page.input_value("#guidance") == str(info["default_guidance"])
    assert page.get_attribute("#n", "max") == str(info["max_images"])
    assert page.eval_on_selector_all("#sampler option", "os => os.map(o => o.value)") == info["samplers"]
    # one model (no --model-dir): GET /v1/models is read, and the picker stays out of the way
    page.wait_for_selector("#model[data-models='1']", state="attached")
    assert not page.is_visible("[data-testid=model-field]")

    # every image element the results get, in order: the live previews must come (and change) before the image
    page.evaluate("""() => { window.seenImages = [];
      new MutationObserver((records) => { for (const r of records) {
        const nodes = r.type === "attributes" ? [r.target] : [...r.addedNodes].filter((n) => n.nodeType === 1);
        for (const n of nodes) for (const img of (n.matches("img") ? [n] : [...n.querySelectorAll("img")]))
          window.seenImages.push([img.dataset.testid, img.src.slice(-24)]); } })
        .observe(document.getElementById("results"), { subtree: true, childList: true, attributes: true,
                                                       attributeFilter: ["src"] }); }""")

    # two requests at once: a fixed seed, and two images with the seed left to the server
    pg.fill_form(page, prompt=PROMPT, size="64x64", steps=STEPS, seed=SEED, n=1)
    first = pg.submit(page)
    pg.fill_form(page, prompt="a handwritten digit three", seed="", n=2)
    second = pg.submit(page)
    assert pg.wait_finished(page, first) == "done"
    assert pg.wait_finished(page, second) == "done"

    # at 1280x900 the Generate button is on screen, also with the page scrolled to its end, and the newest result
    # is in view whole once its images are in
    height = page.viewport_size["height"]

    def whole(locator) -> bool:
        box = locator.bounding_box()
        return box is not None and box["y"] >= 0 and box["y"] + box["height"] <= height
    page.wait_for_function("() => [...document.querySelectorAll('[data-testid=result-image]')].every(i => i.complete)")
    assert whole(pg.card(page, second)), pg.card(page, second).bounding_box()
    assert whole(page.locator("#generate"))
    page.mouse.wheel(0, 5000)
    page.wait_for_function("() => window.scrollY > 0 || document.body.scrollHeight <= window.innerHeight")
    assert whole(page.locator("#generate"))

    assert traffic.bodies[0] == {"prompt": PROMPT, "size": "64x64", "n": 1, "num_inference_steps": STEPS,
                                 "sampler": "euler", "schedule": "default", "output_format": "png",
                                 "response_format": "b64_json", "stream": True,
                                 "preview": {"every": 1, "format": "jpeg"},  # about every tenth of the steps
                                 "guidance_scale": info["default_guidance"], "seed": SEED}
    assert "seed" not in traffic.bodies[1] and traffic.bodies[1]["n"] == 2

    card = pg.card(page, first)
    # the bar moved with the SSE progress events, one per step, up to the total
    assert card.get_attribute("data-progress-events") == str(STEPS)
    assert card.locator("[data-testid=progress]").evaluate("p => [p.value, p.max]") == [STEPS, STEPS]
    assert card.locator("[data-testid=progress-text]").inner_text().startswith(f"{STEPS} / {STEPS} steps")
    assert card.locator("[data-testid=result-seed]").inner_text() == f"seed {SEED}"
    assert re.search(r"total \d", card.locator("[data-testid=result-timings]").inner_text())
    assert _image_sizes(card) == [(64, 64)]
    assert card.get_attribute("data-previews") == str(STEPS) and card.locator("[data-testid=preview-image]").count() == 0
    seen = [(kind, src) for kind, src in page.evaluate("() => window.seenImages") if kind != "download"]
    kinds = [k for k, _ in seen]
    assert "preview-image" in kinds and "result-image" in kinds, seen
    before = [src for k, src in seen[:kinds.index("result-image")] if k == "preview-image"]
    assert len(set(before)) >= 2, seen  # the preview updated (new pixels) before the first image arrived
    download = card.locator("[data-testid=download]")
    assert download.get_attribute("href").startswith("data:image/png;base64,")
    assert re.fullmatch(rf"diffgraph-a-handwritten-digit-seven-{SEED}\.png", download.get_attribute("download"))

    other = pg.card(page, second)
    assert other.get_attribute("data-progress-events") == str(STEPS)
    server_seed = other.get_attribute("data-seed")
    assert re.fullmatch(r"\d+", server_seed)
    assert other.locator("[data-testid=result-seed]").inner_text() == f"seed {server_seed}"
    assert _image_sizes(other) == [(64, 64), (64, 64)]

    # the status panel polls /status: ready, with the steps just run counted
    page.wait_for_function("() => Number(document.getElementById('status-steps').textContent) >= 8 && "
                           "document.getElementById('status-inflight').textContent === '0'")
    assert page.inner_text("#status-ready") == "yes"
    assert page.inner_text("#status-queue") == "0"
    assert page.inner_text("#status-buckets") == "none (eager mode)"  # a CPU server runs eager

    # a size the server refuses: its 400 message is shown at the size field, and no card is left
    cards = page.locator("[data-testid=result]").count()
    pg.fill_form(page, size="100x100")
    page.click("#generate")
    page.wait_for_selector("#error-size:not(:empty)")
    assert page.inner_text("#error-size") == "width 100 is not a multiple of 8; use 96 or 104"
    assert page.get_attribute("#size-custom", "aria-invalid") == "true"
    assert page.inner_text("#error-general") == ""
    assert traffic.statuses[-1] == 400
    page.wait_for_function(f"() => document.querySelectorAll('[data-testid=result]').length === {cards}")

    # a range the server checks: its message goes to the steps field
    pg.fill_form(page, size="64x64", steps=0)
    page.click("#generate")
    page.wait_for_selector("#error-steps:not(:empty)")
    assert "num_inference_steps" in page.inner_text("#error-steps")

    # "use these settings again" puts the first request back in the form, the seed the server used included
    pg.fill_form(page, prompt="something else", seed="", steps=20, n=3)
    card.locator("[data-testid=reuse]").click()
    assert _form(page) == {"prompt": PROMPT, "seed": str(SEED), "steps": str(STEPS), "size": "64x64", "n": "1",
                           "sampler": "euler"}
    assert page.inner_text("#error-steps") == ""
    other.locator("[data-testid=reuse]").click()
    assert page.input_value("#seed") == server_seed and page.input_value("#n") == "2"
    page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)

    # the history survives a reload, with settings, seed and a thumbnail (the two requests ran at once, so
    # either may have finished first: the order is not checked here, the key test checks newest-first)
    page.reload()
    pg.wait_ready(page)
    items = page.locator("[data-testid=history-item]")
    assert sorted(items.evaluate_all("li => li.map(i => i.dataset.seed)")) == sorted([server_seed, str(SEED)])
    item = page.locator(f"[data-testid=history-item][data-seed='{SEED}']")
    assert PROMPT in item.inner_text() and f"seed {SEED}" in item.inner_text()
    assert item.locator("img").get_attribute("src").startswith("data:image/")
    assert page.locator("[data-testid=result]").count() == 0
    pg.fill_form(page, prompt="", seed="", steps=20)
    item.locator("[data-testid=history-reuse]").click()
    assert _form(page)["prompt"] == PROMPT and _form(page)["seed"] == str(SEED)
    assert _form(page)["steps"] == str(STEPS)
    assert errors == []


def test_the_api_docs_render_offline(browser, server):
    """/docs renders Swagger UI with every request outside the server refused (no CDN): the operations are listed."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(pg.WAIT_MS)
    outside: list[str] = []

    def route(r):
        if r.request.url.startswith(server.url):
            r.continue_()
        else:
            outside.append(r.request.url)
            r.abort()
    context.route("**/*", route)
    page = context.new_page()
    page.goto(server.url + "/docs")
    page.wait_for_selector(".swagger-ui .info .title")
    page.wait_for_selector(".opblock-summary-path[data-path='/v1/images/generations']")
    assert page.locator(".opblock").count() >= 5 and outside == []
    context.close()


def _old_entry(i: int) -> dict:
    settings = {"prompt": f"old request {i}", "negative_prompt": "", "size": "64x64", "steps": "8", "guidance": "7.5",
                "sampler": "euler", "schedule": "default", "seed": "", "n": "1"}
    return {"id": f"old-{i}", "time": 1_700_000_000_000 + i, "settings": settings, "seed": str(i),
            "timings": {"total_ms": 1.0}, "thumb": None}


FILL_STORAGE = """() => {
  const chunk = "x".repeat(1 << 18);
  let i = 0, full = false;
  for (let size = chunk.length; size >= 16; size = Math.floor(size / 2)) {
    try { for (;;) localStorage.setItem(`junk-${i++}`, chunk.slice(0, size)); } catch (e) { full = true; }
  }
  return full;
}"""


def test_asks_for_the_api_key_then_generates(browser, keyed_server, tmp_path):
    page = pg.open_playground(browser, keyed_server.url, ready_ms=pg.READY_S * 1000)
    traffic = Traffic(page)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))

    # /info says auth_required: the page asks for the key at once, and refuses a wrong one
    dialog = page.locator("[data-testid=key-dialog]")
    dialog.wait_for(state="visible")
    page.fill("#api-key", "not-the-key")
    page.click("#api-key-save")
    page.wait_for_selector("#key-error:has-text('did not accept')")
    assert dialog.is_visible()
    page.fill("#api-key", API_KEY)
    page.click("#api-key-save")
    dialog.wait_for(state="hidden")
    assert page.evaluate("() => sessionStorage.getItem('diffgraph.apiKey')") == API_KEY
    # /status is protected too (--protect-metrics): the panel reads it with the key
    page.wait_for_function("() => document.getElementById('status-ready').textContent === 'yes'")

    # a full history (50 entries) from an earlier visit; the key is asked for once per tab, not per load
    page.evaluate("(h) => localStorage.setItem('diffgraph.history.v1', JSON.stringify(h))",
                  [_old_entry(i) for i in range(50, 0, -1)])
    page.reload()
    pg.wait_ready(page)
    assert page.locator("[data-testid=history-item]").count() == 50
    assert not dialog.is_visible()

    local_id = pg.generate(page, prompt=PROMPT, size="64x64", steps=4, seed=7)
    assert traffic.auth == [f"Bearer {API_KEY}"]
    assert pg.card(page, local_id).locator("[data-testid=result-seed]").inner_text() == "seed 7"
    assert _image_sizes(pg.card(page, local_id)) == [(64, 64)]
    stored = page.evaluate("() => JSON.parse(localStorage.getItem('diffgraph.history.v1'))")
    assert [h["seed"] for h in stored] == ["7"] + [str(i) for i in range(50, 1, -1)]  # capped at 50, newest first

    # a key the server refuses (401) asks again, then the same request goes through with the new key; meanwhile
    # localStorage is full, which the history survives quietly (kept in the page, saved as far as it fits)
    assert page.evaluate(FILL_STORAGE)
    page.evaluate("() => sessionStorage.setItem('diffgraph.apiKey', 'stale-key')")
    pg.fill_form(page, seed=8)
    retried = pg.submit(page)
    dialog.wait_for(state="visible")
    assert "401" in page.inner_text("#key-reason")
    page.fill("#api-key", API_KEY)
    page.click("#api-key-save")
    assert pg.wait_finished(page, retried) == "done"
    assert traffic.statuses[-2:] == [401, 200]
    assert traffic.auth[-2:] == ["Bearer stale-key", f"Bearer {API_KEY}"]
    assert pg.card(page, retried).locator("[data-testid=result-seed]").inner_text() == "seed 8"
    page.wait_for_selector("[data-testid=history-item][data-seed='8']")
    assert page.locator("[data-testid=history-item]").count() == 50
    stored = page.evaluate("() => JSON.parse(localStorage.getItem('diffgraph.history.v1'))")
    assert stored[0]["seed"] == "8" and len(stored) < 50  # the newest entries that fit
    assert errors == []
    page.screenshot(path=str(tmp_path / "playground-key.png"), full_page=True)


def test_image_upload_and_mask_brush_send_edits(browser, server, tmp_path):
    """An uploaded image with strokes of the mask brush is an inpainting request to /v1/images/edits (image and
    a white-on-black mask of the image's size); without strokes, image-to-image; a bad strength is shown at its
    field; the results have the image's size."""
    page = pg.open_playground(browser, server.url)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    sent: list[dict] = []

    def on_route(route) -> None:  # the multipart body as sent (request events omit file parts)
        body = route.request.post_data_buffer or b""
        sent.append({"has_mask": b'name="mask"' in body, "has_image": b'name="image"' in body, "body": body})
        route.continue_()
    page.route("**/v1/images/edits", on_route)

    source = tmp_path / "three.png"
    arr = np.zeros((72, 64, 3), np.uint8)  # 64x72: a non-square size the result must keep
    arr[16:56, 20:44] = 255
    Image.fromarray(arr).save(source)
    page.set_input_files("#image", str(source))
    page.wait_for_selector("[data-testid=edit-area]:not([hidden])", timeout=pg.WAIT_MS)
    assert page.evaluate("() => document.body.dataset.editImage") == "64x72"
    assert page.input_value("#size") == "auto"

    # paint a stroke across the middle of the image
    box = page.locator("[data-testid=mask-canvas]").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.2, box["y"] + box["height"] * 0.5)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.8, box["y"] + box["height"] * 0.5, steps=8)
    page.mouse.up()
    assert page.evaluate("() => document.body.dataset.maskPainted") == "true"

    pg.fill_form(page, prompt="a handwritten digit eight", steps=STEPS, seed=SEED, n=1)
    local = pg.submit(page)
    assert pg.wait_finished(page, local) == "done"
    assert sent and sent[-1]["has_image"] and sent[-1]["has_mask"]
    assert _image_sizes(pg.card(page, local)) == [(64, 72)]
    mask_png = sent[-1]["body"].split(b'name="mask"', 1)[1].split(b"\r\n\r\n", 1)[1]
    mask = np.asarray(Image.open(io.BytesIO(mask_png)).convert("L"))
    assert mask.shape == (72, 64) and mask[36, 32] == 255 and mask[2, 2] == 0  # painted middle, untouched corner

    # a strength the server refuses: its message at the strength field
    page.fill("#strength", "2")
    refused = pg.submit(page)
    page.wait_for_function("() => document.getElementById('error-strength').textContent.length > 0",
                           timeout=pg.WAIT_MS)
    assert "strength 2" in page.text_content("#error-strength")
    del refused

    # no strokes: image-to-image at strength 0.5
    page.click("[data-testid=mask-clear]")
    page.fill("#strength", "0.5")
    local = pg.submit(page)
    assert pg.wait_finished(page, local) == "done"
    assert sent[-1]["has_image"] and not sent[-1]["has_mask"]
    assert b"0.5" in sent[-1]["body"].split(b'name="strength"', 1)[1][:40]
    steps_seen = pg.card(page, local).get_attribute("data-total")
    assert steps_seen == str(STEPS // 2)  # strength 0.5 runs half the steps

    # removing the image goes back to text-to-image
    page.click("[data-testid=image-remove]")
    assert page.input_value("#size") != "auto"
    assert not errors, errors


def test_adapter_picker_sends_the_chosen_lora(browser, server):
    """The shipped digits model's built-in `pencil` adapter is in the picker (from GET /v1/loras); choosing it with
    a scale sends `loras` in the request and the card's summary names it; a scale that is not a number is shown at
    the picker; with no adapter chosen, no `loras` field is sent."""
    page = pg.open_playground(browser, server.url)
    traffic = Traffic(page)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.wait_for_selector("[data-testid=adapters]:not([hidden])", timeout=pg.WAIT_MS)
    assert page.eval_on_selector_all("#lora option", "os => os.map(o => o.value)") == ["", "lcm", "pencil"]

    page.select_option("#lora", "pencil")
    page.fill("#lora-scale", "strong")
    page.click("#generate")
    page.wait_for_selector("#error-lora:not(:empty)")
    assert "scale" in page.inner_text("#error-lora")

    page.fill("#lora-scale", "0.8")
    pg.fill_form(page, prompt=PROMPT, size="64x64", steps=STEPS, seed=SEED, n=1)
    local = pg.submit(page)
    assert pg.wait_finished(page, local) == "done"
    assert traffic.bodies[-1]["loras"] == [{"name": "pencil", "scale": 0.8}]
    assert "pencil ×0.8" in pg.card(page, local).inner_text()

    page.select_option("#lora", "")
    plain = pg.submit(page)
    assert pg.wait_finished(page, plain) == "done"
    assert "loras" not in traffic.bodies[-1]
    assert errors == []


def test_prompt_syntax_picker_sends_a1111_prompts(browser, server):
    """Choosing AUTOMATIC1111's syntax sends `prompt_syntax` with the prompt as written (weights, BREAK and a
    `<lora:...>` tag for the built-in adapter); the server's default sends no field; a prompt with AND (composable
    diffusion, not served) comes back as an error at the prompt field."""
    page = pg.open_playground(browser, server.url)
    traffic = Traffic(page)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.select_option("#prompt-syntax", "a1111")
    pg.fill_form(page, prompt="(a handwritten digit seven:1.3) BREAK thick strokes <lora:pencil:0.5>", size="64x64",
                 steps=STEPS, seed=SEED, n=1)
    local = pg.submit(page)
    assert pg.wait_finished(page, local) == "done"
    assert traffic.bodies[-1]["prompt_syntax"] == "a1111"

    pg.fill_form(page, prompt="a seven AND an eight digit")
    page.click("#generate")
    page.wait_for_selector("#error-prompt:not(:empty)", timeout=pg.WAIT_MS)
    assert "AND" in page.inner_text("#error-prompt")

    page.select_option("#prompt-syntax", "")
    pg.fill_form(page, prompt=PROMPT)
    plain = pg.submit(page)
    assert pg.wait_finished(page, plain) == "done"
    assert "prompt_syntax" not in traffic.bodies[-1]
    assert errors == []


def test_a_signed_image_url_loads_in_an_img_tag_without_a_key(browser, keyed_server):
    """response_format "url" with --api-key: a browser's <img src> sends no Bearer header, so the URL's signature
    is what lets it load; the same URL with its signature altered does not."""
    keyed_server.wait_ready()
    r = httpx.post(keyed_server.url + "/v1/images/generations", timeout=600,
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"prompt": "a red fox", "response_format": "url", "num_inference_steps": 2})
    assert r.status_code == 200, r.text
    url = r.json()["data"][0]["url"]
    page = browser.new_page()
    try:
        page.goto(keyed_server.url + "/health")  # a page of the server's origin (no key in it)
        sizes = page.evaluate("""async ([good, bad]) => {
            const load = (src) => new Promise((resolve) => {
                const img = new Image();
                img.onload = () => resolve([img.naturalWidth, img.naturalHeight]);
                img.onerror = () => resolve(null);
                img.src = src;
            });
            return [await load(good), await load(bad)];
        }""", [url, url.replace("sig=", "sig=f")])
    finally:
        page.close()
    assert sizes == [[64, 64], None]


def _model_options(page) -> list[dict]:
    return page.eval_on_selector_all("#model option", "os => os.map(o => ({value: o.value, text: o.textContent, "
                                     "disabled: o.disabled, title: o.title}))")


def test_model_picker_chooses_sends_and_restores_the_model(browser, multi_server, model_dir):
    """With --model-dir the picker lists GET /v1/models: the default (loaded) first, the folder's models (loaded on
    first use), the unreadable file disabled with its reason; the chosen model is sent as `model` (the default as no
    field), its first request says it is loading, the list then shows it loaded; a history entry restores its
    model; a model gone from the folder is refused at the picker, and a history entry naming it falls back to the
    default with a note."""
    page = pg.open_playground(browser, multi_server.url)
    traffic = Traffic(page)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    picker = page.locator("[data-testid=model-picker]")
    page.wait_for_selector("[data-testid=model-field]:not([hidden])")
    options = _model_options(page)
    assert [o["value"] for o in options] == ["digits", "xl/digits-xl", "xl/spare", "broken"]
    assert options[0]["text"] == "digits · sd 64×64 · default · loaded" and not options[0]["disabled"]
    assert options[1]["text"] == "xl/digits-xl · sdxl 64×64 · loads on first use" and not options[1]["disabled"]
    assert options[3]["disabled"] and "not a readable safetensors file" in options[3]["title"]
    assert picker.input_value() == "digits"
    assert page.inner_text("[data-testid=model-hint]").startswith("Loaded")

    # the default: no `model` field
    default_id = pg.generate(page, prompt=PROMPT, size="64x64", steps=STEPS, seed=SEED, n=1)
    assert "model" not in traffic.bodies[-1]

    # another model: sent by name; while its request is held back the card says the model is loading
    held: list = []
    page.route("**" + GENERATIONS, lambda route: held.append(route))
    picker.select_option("xl/digits-xl")
    assert "Not loaded" in page.inner_text("[data-testid=model-hint]")
    local = pg.submit(page)
    text = pg.card(page, local).locator("[data-testid=progress-text]")
    assert text.inner_text() == "loading xl/digits-xl (its first use: this can take a while)…"
    while not held:
        page.wait_for_timeout(20)
    held[0].continue_()
    page.unroute("**" + GENERATIONS)
    assert pg.wait_finished(page, local) == "done"
    assert traffic.bodies[-1]["model"] == "xl/digits-xl"
    assert _image_sizes(pg.card(page, local)) == [(64, 64)]
    assert pg.card(page, local).get_attribute("data-progress-events") == str(STEPS)
    page.wait_for_function("() => document.querySelector('#model option[value=\"xl/digits-xl\"]')"
                           ".textContent.endsWith('· loaded')")  # the list is read again after a request
    stored = page.evaluate("() => JSON.parse(localStorage.getItem('diffgraph.history.v1'))")
    assert [h["settings"]["model"] for h in stored] == ["xl/digits-xl", "digits"]
    assert page.locator("[data-testid=history-item]").first.inner_text().count("xl/digits-xl") == 1

    # reusing an entry restores its model (the card's and the history's button alike)
    pg.card(page, default_id).locator("[data-testid=reuse]").click()
    assert picker.input_value() == "digits"
    page.locator("[data-testid=history-reuse]").first.click()
    assert picker.input_value() == "xl/digits-xl"

    # a model removed from the folder after it was listed: the server's 404 is shown at the picker, the list then
    # drops it; a history entry naming it chooses the default and says why
    shutil.rmtree(model_dir / "xl" / "spare")
    picker.select_option("xl/spare")
    page.click("#generate")
    page.wait_for_selector("#error-model:not(:empty)")
    assert "spare" in page.inner_text("#error-model") and traffic.statuses[-1] == 404
    assert page.get_attribute("#model", "aria-invalid") == "true"
    page.wait_for_function("() => !document.querySelector('#model option[value=\"xl/spare\"]')")
    assert picker.input_value() == "digits"
    entry = {**_old_entry(1), "settings": {**_old_entry(1)["settings"], "model": "xl/spare"}}
    page.evaluate("(h) => localStorage.setItem('diffgraph.history.v1', JSON.stringify(h))", [entry])
    page.reload()
    pg.wait_ready(page)
    page.locator("[data-testid=history-reuse]").first.click()  # maybe before the listing is read: it waits for it
    page.wait_for_selector("[data-testid=model-field]:not([hidden])")
    page.wait_for_function("() => document.getElementById('model-hint').textContent.includes('not served now')")
    assert picker.input_value() == "digits"
    assert page.input_value("#prompt") == "old request 1"
    assert errors == []



# what overlaps or leaves its box at the page's width: visible elements past the viewport's right edge, fieldsets whose
# content is wider than they are, and form controls (inputs, selects, buttons, text areas) whose boxes intersect (a
# sticky bar's controls aside: content scrolls under it)
_LAYOUT_JS = """() => {
  const width = document.documentElement.clientWidth, out = [];
  const name = e => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '') + (e.name ? '[' + e.name + ']' : '');
  const shown = [...document.querySelectorAll('body *')].filter(e => e.getClientRects().length &&
      getComputedStyle(e).visibility !== 'hidden');
  for (const e of shown) {
    const r = e.getBoundingClientRect();
    if (r.width > 0 && r.right > width + 0.5) out.push(name(e) + ' ends at ' + r.right + ' past ' + width);
    if (e.tagName === 'FIELDSET' && e.scrollWidth > e.clientWidth + 1)
      out.push(name(e) + ' holds ' + e.scrollWidth + ' px in ' + e.clientWidth);
  }
  // a bar kept in view over scrolling content (position sticky or fixed, opaque) covers what scrolls under it by design
  const floating = e => { for (; e; e = e.parentElement) { const p = getComputedStyle(e).position;
      if (p === 'sticky' || p === 'fixed') return true; } return false; };
  const controls = shown.filter(e => ['INPUT', 'SELECT', 'BUTTON', 'TEXTAREA'].includes(e.tagName) &&
      e.type !== 'hidden' && e.type !== 'file' && !floating(e));
  for (let i = 0; i < controls.length; i++) for (let j = i + 1; j < controls.length; j++) {
    const a = controls[i].getBoundingClientRect(), b = controls[j].getBoundingClientRect();
    const x = Math.min(a.right, b.right) - Math.max(a.left, b.left), y = Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top);
    if (x > 1 && y > 1) out.push(name(controls[i]) + ' overlaps ' + name(controls[j]));
  }
  return out;
}"""


def _layout_problems(page, width: int) -> list[str]:
    page.set_viewport_size({"width": width, "height": 900})
    return page.evaluate(_LAYOUT_JS)


def test_control_upload_shows_the_map_and_sends_the_control(browser, server, tmp_path):
    """The digits model's built-in `outline` ControlNet is in the control picker (GET /v1/controlnets); an uploaded
    digit with preprocess canny shows its edge map (POST /v1/controlnets/preview, at the chosen size) before
    generating; Generate sends the control with its image, modes and window, and the card names it; an edit with the
    control sends the map as the form's file part control_image_0."""
    page = pg.open_playground(browser, server.url)
    traffic, errors, forms = _watch(page)
    page.wait_for_selector("[data-testid=controls]:not([hidden])", timeout=pg.WAIT_MS)
    assert page.eval_on_selector_all("#control-model option", "os => os.map(o => o.value)") == ["", "outline"]

    digit = np.zeros((64, 64, 3), np.uint8)
    digit[12:52, 24:40] = 255  # a filled bar: canny draws its outline
    Image.fromarray(digit).save(tmp_path / "bar.png")
    pg.fill_form(page, prompt=PROMPT, size="64x64", steps=STEPS, seed=SEED, n=1)
    page.select_option("#control-model", "outline")
    page.select_option("#control-preprocess", "canny")
    page.set_input_files("#control-image", str(tmp_path / "bar.png"))
    page.wait_for_selector("[data-testid=control-map]:not([hidden])", timeout=pg.WAIT_MS)
    src = page.get_attribute("#control-map", "src")
    shown = np.asarray(Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("L"))
    # the bar's edge, not its inside
    assert shown.shape == (64, 64) and shown[30, 22:26].max() == 255 and shown[30, 28:36].max() == 0, shown[30]
    for width in (1024, 1280):  # every fieldset shown (the control's too): nothing overlaps or overflows
        assert _layout_problems(page, width) == [], width
    page.set_viewport_size({"width": 1280, "height": 900})
    page.select_option("#control-mode", "control")
    page.fill("#control-end", "0.8")
    local = pg.submit(page)
    assert pg.wait_finished(page, local) == "done"
    sent = traffic.bodies[-1]["controls"]
    assert len(sent) == 1 and sent[0]["model"] == "outline" and sent[0]["preprocess"] == "canny"
    assert sent[0]["control_mode"] == "control" and sent[0]["end"] == 0.8
    assert sent[0]["image"].startswith("data:image/png;base64,")
    assert "control outline" in pg.card(page, local).inner_text()

    page.set_input_files("#image", str(tmp_path / "bar.png"))  # an edit with the control: multipart
    page.wait_for_selector("[data-testid=edit-area]:not([hidden])", timeout=pg.WAIT_MS)
    local = pg.submit(page)
    assert pg.wait_finished(page, local) == "done"
    assert forms and b'name="control_image_0"' in forms[-1] and b'"model": "outline"' not in forms[-1]
    assert b'"model":"outline"' in forms[-1]
    assert not errors, errors


def test_image_prompt_upload_sends_the_image_prompt(browser, tmp_path):
    """With --ip-adapter-dir the image-prompt picker lists the adapters (GET /v1/ip-adapters); two uploaded images and
    a scale are sent as `image_prompts` (the images as data URLs), the card names it, and the result is done."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from test_ip_adapter import make_ip_adapter

    from diffgraph import Engine
    with Engine(model="digits", device="cpu") as digits:
        make_ip_adapter(digits.model.denoiser, tmp_path, "faces", seed=4)
    s = _server("--request-timeout", "600", "--ip-adapter-dir", str(tmp_path))
    try:
        page = pg.open_playground(browser, s.url)
        traffic = Traffic(page)
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.wait_for_selector("[data-testid=image-prompt]:not([hidden])", timeout=pg.WAIT_MS)
        assert page.eval_on_selector_all("#ip-model option", "os => os.map(o => o.value)") == ["", "faces"]
        assert page.is_hidden("[data-testid=references]")  # digits takes no reference images
        for i in range(2):
            Image.fromarray(np.full((40, 40, 3), 60 * (i + 1), np.uint8)).save(tmp_path / f"p{i}.png")
        pg.fill_form(page, prompt=PROMPT, size="64x64", steps=STEPS, seed=SEED, n=1)
        page.select_option("#ip-model", "faces")
        page.set_input_files("#ip-images-input", [str(tmp_path / "p0.png"), str(tmp_path / "p1.png")])
        page.wait_for_selector("#ip-images:not([hidden]) img", timeout=pg.WAIT_MS)
        page.fill("#ip-scale", "0.5")
        local = pg.submit(page)
        assert pg.wait_finished(page, local) == "done"
        sent = traffic.bodies[-1]["image_prompts"]
        assert sent["model"] == "faces" and sent["scale"] == 0.5 and len(sent["images"]) == 2
        assert all(i.startswith("data:image/png;base64,") for i in sent["images"])
        assert "image prompt faces" in pg.card(page, local).inner_text()
        assert not errors, errors
    finally:
        s.stop()


def test_reference_images_upload_sends_them_and_an_edit_sends_them_after_the_image(browser, tmp_path):
    """On a model that takes `reference_images` (the tiny random FLUX.2 klein) the reference fieldset shows; two
    uploaded images go as `reference_images` (data URLs) on the JSON route and the card names them; with an image to
    edit and strength 0.5 the edits form carries the image then the references as image[] parts; both are done."""
    s = _server("--request-timeout", "600", model="random:flux2-klein-tiny")
    try:
        page = pg.open_playground(browser, s.url)
        traffic, errors, forms = _watch(page)
        page.wait_for_selector("[data-testid=references]:not([hidden])", timeout=pg.WAIT_MS)
        for i, (h, w) in enumerate(((64, 64), (80, 64))):
            Image.fromarray(np.full((h, w, 3), 60 * (i + 1), np.uint8)).save(tmp_path / f"r{i}.png")
        pg.fill_form(page, prompt="the same fox", size="64x64", steps=2, seed=SEED, n=1)
        page.set_input_files("#ref-images-input", [str(tmp_path / "r0.png"), str(tmp_path / "r1.png")])
        page.wait_for_selector("#ref-images:not([hidden]) img", timeout=pg.WAIT_MS)
        assert page.locator("#ref-images img").count() == 2
        for width in (1024, 1280):  # the reference fieldset shown: nothing overlaps or overflows
            assert _layout_problems(page, width) == [], width
        page.set_viewport_size({"width": 1280, "height": 900})
        local = pg.submit(page)
        assert pg.wait_finished(page, local) == "done"
        sent = traffic.bodies[-1]["reference_images"]
        assert len(sent) == 2 and all(r.startswith("data:image/png;base64,") for r in sent)
        assert "2 reference images" in pg.card(page, local).inner_text()

        page.set_input_files("#image", str(tmp_path / "r0.png"))  # an edit: the image, then the references
        page.wait_for_selector("[data-testid=edit-area]:not([hidden])", timeout=pg.WAIT_MS)
        page.fill("#strength", "0.5")
        local = pg.submit(page)
        assert pg.wait_finished(page, local) == "done", pg.card(page, local).inner_text()
        form = forms[-1]
        assert form.count(b'name="image[]"') == 3 and b'name="image"' not in form
        assert form.index(b'filename="r0.png"') < form.index(b'filename="r1.png"')
        assert re.search(rb'name="strength"\r\n\r\n0\.5\r\n', form)
        assert not errors, errors
    finally:
        s.stop()
