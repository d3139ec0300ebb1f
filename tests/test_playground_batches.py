"""The playground's batches page (/playground/batches.html, issue 35 point 5) in a real browser: Debian's Chromium
driven by Playwright against `diffgraph serve --model digits --state-dir DIR --api-key KEY` (the key given on the
playground page is used here too, the job images are fetched with it).

A grid job (2 prompts x 2 guidance values x 2 seeds, 2 steps at 64x64) is submitted through the page and watched to
its end; the gallery's viewer is driven with the keyboard, two candidates are picked, the picks survive a reload, and
both downloads are read back: the JSON, and the zip the page writes itself (Python's zipfile checks its CRCs).
A second, longer job is cancelled from the page while it runs, then deleted.
The server process and the browser launch are tools/playground_screenshot.py's, as in test_playground_browser.py.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import zipfile
from pathlib import Path

import httpx
import pytest
from PIL import Image

_TOOL = Path(__file__).resolve().parents[1] / "tools" / "playground_screenshot.py"
_spec = importlib.util.spec_from_file_location("playground_screenshot", _TOOL)
pg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pg)

KEY = "batches-test-key"
PROMPTS = ["a handwritten digit seven", "a handwritten digit three"]


@pytest.fixture(scope="module")
def browser():
    missing = pg.missing_browser()
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the batches browser test cannot run in CI: {missing}", pytrace=False)
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pg.launch_chromium(pw)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def server(tmp_path):
    s = pg.PlaygroundServer("--request-timeout", "600", "--state-dir", str(tmp_path / "state"), "--api-key", KEY)
    try:
        s.wait_ready()
    except BaseException:
        s.stop()
        raise
    yield s
    s.stop()


def _viewer_key(page) -> str:
    return page.get_attribute("[data-testid=viewer]", "data-key")


def test_submit_watch_pick_and_download(browser, server, tmp_path):
    context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
    context.set_default_timeout(pg.WAIT_MS)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    polls: list[str] = []
    page.on("request", lambda r: polls.append(r.url) if r.url.split("?")[0].rsplit("/", 2)[-2] == "jobs" else None)

    # the key given on the playground (sessionStorage, this tab) is the batches page's too: it does not ask again
    page.goto(server.url + "/")
    page.wait_for_selector("[data-testid=key-dialog][open]")
    page.fill("#api-key", KEY)
    page.click("#api-key-save")
    page.wait_for_selector("[data-testid=key-dialog]:not([open])", state="attached")
    page.locator("[data-testid=batches-link]").click()
    page.wait_for_url("**/playground/batches.html")
    page.wait_for_selector("body[data-ready=true]")
    assert not page.is_visible("[data-testid=key-dialog]")

    page.fill("#prompts", "\n".join(PROMPTS))
    page.fill("#seeds", "11, 12")
    page.select_option("#vary-field", "guidance_scale")
    page.fill("#vary-values", "3, 7")
    page.fill("#steps", "2")
    page.fill("#size", "64x64")
    page.fill("#job-name", "digits grid")
    page.click("[data-testid=submit-job]")
    page.wait_for_selector("[data-testid=job-detail][data-status=completed]")
    job = page.get_attribute("[data-testid=job-detail]", "data-job-id")
    assert page.inner_text("[data-testid=job-progress-text]") == "8 done · 0 failed · 0 pending of 8"
    assert page.locator("[data-testid=job-progress]").evaluate("p => [p.value, p.max]") == [8, 8]
    assert any(u.endswith(f"/v1/jobs/{job}") for u in polls)  # watched through GET /v1/jobs/ID
    page.wait_for_selector(f"[data-testid=job-item][data-job-id='{job}'][data-status=completed]")
    assert "digits grid" in page.inner_text(f"[data-testid=job-item][data-job-id='{job}']")

    # the gallery: 4 items (prompt-major, then the guidance values), 2 candidates each, every thumbnail loaded
    items = page.locator("[data-testid=gallery-item]")
    assert items.count() == 4
    assert "guidance_scale 7" in items.nth(1).inner_text() and PROMPTS[1] in items.nth(2).inner_text()
    page.wait_for_function("() => [...document.querySelectorAll('[data-testid=candidate] img')]"
                           ".filter(i => i.complete && i.naturalWidth === 64).length === 8")

    # the viewer: left/right between candidates (stopping at the ends), up/down between items, p and space pick
    page.locator("[data-testid=candidate][data-key='0-0']").click()
    page.wait_for_selector("[data-testid=viewer]:not([hidden])")
    page.wait_for_function("() => document.getElementById('viewer-image').naturalWidth === 64")
    page.keyboard.press("ArrowLeft")
    assert _viewer_key(page) == "0-0"
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    assert _viewer_key(page) == "0-1"
    page.keyboard.press("p")
    assert page.get_attribute("[data-testid=viewer]", "data-picked") == "true"
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowUp")
    assert _viewer_key(page) == "1-1"
    page.keyboard.press("ArrowLeft")
    page.keyboard.press(" ")
    page.keyboard.press(" ")  # twice: unpicked again
    page.keyboard.press("ArrowDown")
    page.keyboard.press(" ")
    assert _viewer_key(page) == "2-0" and "seed 11" in page.inner_text("[data-testid=viewer-caption]")
    page.keyboard.press("Escape")
    page.wait_for_selector("[data-testid=viewer]", state="hidden")
    assert page.get_attribute("[data-testid=picks-count]", "data-count") == "2"

    # the picks are kept per job: a reload shows them again
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    page.locator(f"[data-testid=job-item][data-job-id='{job}'] button").click()
    page.wait_for_selector("[data-testid=gallery-item]")
    assert page.locator("[data-testid=candidate].picked").evaluate_all("c => c.map(e => e.dataset.key)") == \
        ["0-1", "2-0"]

    with page.expect_download() as info:
        page.click("[data-testid=download-json]")
    picks = json.loads(Path(info.value.path()).read_text())
    assert picks["job"] == job and picks["name"] == "digits grid"
    assert [(p["item"], p["candidate"], p["seed"], p["prompt"], p["guidance_scale"]) for p in picks["picks"]] == \
        [(0, 1, 12, PROMPTS[0], 3), (2, 0, 11, PROMPTS[1], 3)]
    assert picks["picks"][0]["url"] == f"{server.url}/v1/jobs/{job}/images/0-1.png"

    with page.expect_download() as info:
        page.click("[data-testid=download-zip]")
    archive = zipfile.ZipFile(info.value.path())
    assert archive.namelist() == ["0-1.png", "2-0.png", "metadata.json"]
    assert archive.testzip() is None  # every CRC-32 right
    assert all(i.compress_type == zipfile.ZIP_STORED for i in archive.infolist())
    assert json.loads(archive.read("metadata.json")) == picks
    stored = httpx.get(picks["picks"][1]["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert archive.read("2-0.png") == stored.content
    assert Image.open(io.BytesIO(archive.read("0-1.png"))).size == (64, 64)

    # a longer job, cancelled while it runs; then deleted (after the confirm) and gone from the list
    page.fill("#prompts", PROMPTS[0])
    page.fill("#seeds", "1, 2, 3, 4, 5, 6, 7, 8")
    page.select_option("#vary-field", "")
    page.fill("#steps", "50")
    page.fill("#job-name", "to cancel")
    page.click("[data-testid=submit-job]")
    page.wait_for_selector("[data-testid=job-detail]:is([data-status=queued], [data-status=running])")
    other = page.get_attribute("[data-testid=job-detail]", "data-job-id")
    assert other != job
    page.click("[data-testid=cancel-job]")
    page.wait_for_selector(f"[data-testid=job-detail][data-job-id='{other}'][data-status=cancelled]")
    page.wait_for_selector(f"[data-testid=job-item][data-job-id='{other}'][data-status=cancelled]")
    page.once("dialog", lambda d: d.accept())
    page.click("[data-testid=delete-job]")
    page.wait_for_selector(f"[data-testid=job-item][data-job-id='{other}']", state="detached")
    assert page.locator("[data-testid=job-item]").count() == 1
    assert errors == []
    context.close()
