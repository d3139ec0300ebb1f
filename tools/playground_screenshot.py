"""Drives the playground page (GET /) in a real Chromium and writes docs/playground.png.

Starts `python -m diffgraph.server.cli --model digits --device cpu` on a free port, opens the page in Debian's
Chromium through Playwright, generates a few images and saves a desktop-size screenshot. The driving code here
(`PlaygroundServer`, `launch_chromium`, `open_playground`, `fill_form`, `generate`) is shared with
tests/test_playground_browser.py.

    apt-get install -y chromium          # /usr/bin/chromium; `playwright install` is not needed
    pip install playwright
    python tools/playground_screenshot.py [--out docs/playground.png] [--width 1280 --height 900]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # run from a checkout without installing it

from diffgraph.server.process import ServerProcess  # noqa: E402
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WAIT_MS = 120_000       # every browser wait: generous, the machine may be slow and loaded
READY_S = 600.0         # the server's model load on a loaded CPU


class PlaygroundServer(ServerProcess):
    """`diffgraph serve` in a child process on a free port (diffgraph.server.process), the digits model by default."""

    def __init__(self, *flags: str, model: str = "digits"):
        super().__init__(*flags, model=model)

    def wait_ready(self, timeout: float = READY_S, path: str = "/ready") -> None:
        super().wait_ready(timeout, path)


def missing_browser() -> str | None:
    """What is missing to drive the page (None when nothing is), with how to install it."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright for Python is not installed: run `pip install playwright` (not `playwright install`)"
    if not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} is missing: run `apt-get install -y chromium` (as root)"
    return None


def launch_chromium(playwright: Any) -> Any:
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


def open_playground(browser: Any, url: str, width: int = 1280, height: int = 900, ready_ms: float = WAIT_MS) -> Any:
    """A fresh context (empty localStorage) with the page loaded and, within `ready_ms`, its model ready."""
    context = browser.new_context(viewport={"width": width, "height": height})
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    page.goto(url + "/")
    wait_ready(page, ready_ms)
    return page


def wait_ready(page: Any, timeout_ms: float = WAIT_MS) -> None:
    """Waits until the page has seen /info say ready (it polls /info until then)."""
    page.wait_for_selector("body[data-ready=true]", timeout=timeout_ms)


def fill_form(page: Any, prompt: str | None = None, size: str | None = None, steps: int | None = None,
              seed: int | str | None = None, n: int | None = None, guidance: float | None = None,
              sampler: str | None = None, schedule: str | None = None, negative_prompt: str | None = None) -> None:
    """Sets the given fields; `size` not among the select's options goes into the custom WxH field."""
    if prompt is not None:
        page.fill("#prompt", prompt)
    if negative_prompt is not None:
        page.fill("#negative-prompt", negative_prompt)
    if size is not None:
        options = page.eval_on_selector_all("#size option", "os => os.map(o => o.value)")
        if size in options:
            page.select_option("#size", size)
        else:
            page.select_option("#size", "custom")
            page.fill("#size-custom", size)
    if steps is not None:
        page.fill("#steps", str(steps))
    if guidance is not None:
        page.fill("#guidance", str(guidance))
    if sampler is not None:
        page.select_option("#sampler", sampler)
    if schedule is not None:
        page.select_option("#schedule", schedule)
    if seed is not None:
        page.fill("#seed", str(seed))
    if n is not None:
        page.fill("#n", str(n))


def submit(page: Any) -> str:
    """Clicks Generate; returns the new request's local id (its card's data-local-id)."""
    before = page.evaluate("() => document.body.dataset.lastRequest || '0'")
    page.click("#generate")
    page.wait_for_function("(before) => (document.body.dataset.lastRequest || '0') !== before", arg=before,
                           timeout=WAIT_MS)
    return page.evaluate("() => document.body.dataset.lastRequest")


def card(page: Any, local_id: str) -> Any:
    return page.locator(f'[data-testid=result][data-local-id="{local_id}"]')


def wait_finished(page: Any, local_id: str) -> str:
    """Waits until the request's card is done or failed; returns its state."""
    page.wait_for_selector(f'[data-testid=result][data-local-id="{local_id}"]'
                           ':is([data-state=done], [data-state=failed], [data-state=cancelled])', timeout=WAIT_MS)
    return card(page, local_id).get_attribute("data-state")


def generate(page: Any, **settings: Any) -> str:
    """Fills the form, generates, waits for the result; returns the card's local id (raises if it failed)."""
    fill_form(page, **settings)
    local_id = submit(page)
    state = wait_finished(page, local_id)
    if state != "done":
        raise RuntimeError(f"the request ended {state}: {card(page, local_id).inner_text()}")
    return local_id


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "playground.png"))
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=900)
    args = p.parse_args()
    missing = missing_browser()
    if missing:
        sys.exit(missing)
    from playwright.sync_api import sync_playwright

    with PlaygroundServer() as server, sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            page = open_playground(browser, server.url, args.width, args.height)
            generate(page, prompt="a handwritten digit three", size="64x64", steps=20, seed=3, n=1)
            generate(page, prompt="a handwritten digit five", size="64x64", steps=20, seed=5, n=2)
            generate(page, prompt="a handwritten digit seven", seed="", n=4, steps=20, sampler="dpmpp_2m",
                     schedule="karras")
            # one request still running when the picture is taken: its live bar, and the status panel's rows
            fill_form(page, prompt="a handwritten digit zero", seed=10, n=1, steps=200, sampler="euler",
                      schedule="default")
            running = submit(page)
            page.wait_for_selector(f'[data-local-id="{running}"][data-state=running]')
            page.wait_for_function("(id) => document.querySelector(`[data-local-id='${id}']`).dataset.step >= 40 &&"
                                   " document.getElementById('status-live').textContent === '64x64: 1'", arg=running)
            page.evaluate("() => document.activeElement && document.activeElement.blur()")
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=args.out)
            print(f"wrote {args.out}")
        finally:
            browser.close()


if __name__ == "__main__":
    main()
