"""Drives the playground's batches page (/playground/batches.html) in a real Chromium and writes docs/batches.png:
a grid job (2 prompts x 2 guidance values x 4 seeds, 20 steps) on the `digits` model, run to its end, two picks
marked. Shares tools/playground_screenshot.py's server and browser launch.

    python tools/batches_screenshot.py [--out docs/batches.png]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

TOOL = Path(__file__).resolve().parent / "playground_screenshot.py"
spec = importlib.util.spec_from_file_location("playground_screenshot", TOOL)
pg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pg)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(pg.ROOT / "docs" / "batches.png"))
    a = p.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as state, sync_playwright() as pw:
        server = pg.PlaygroundServer("--request-timeout", "600", "--state-dir", state)
        try:
            server.wait_ready()
            browser = pg.launch_chromium(pw)
            page = browser.new_context(viewport={"width": 1280, "height": 1000}).new_page()
            page.set_default_timeout(pg.WAIT_MS)
            page.goto(server.url + "/playground/batches.html")
            page.wait_for_selector("body[data-ready=true]")
            page.fill("#prompts", "a handwritten digit seven\na handwritten digit three")
            page.fill("#seeds", "1, 2, 3, 4")
            page.select_option("#vary-field", "guidance_scale")
            page.fill("#vary-values", "3, 7")
            page.fill("#steps", "20")
            page.fill("#size", "64x64")
            page.fill("#job-name", "digits, guidance 3 vs 7")
            page.click("[data-testid=submit-job]")
            page.wait_for_selector("[data-testid=job-detail][data-status=completed]")
            page.wait_for_function("() => [...document.querySelectorAll('[data-testid=candidate] img')]"
                                   ".filter(i => i.complete && i.naturalWidth > 0).length === 16")
            for key in ("0-1", "2-3"):
                page.locator(f"[data-testid=candidate][data-key='{key}']").click()
                page.wait_for_selector("[data-testid=viewer]:not([hidden])")
                page.keyboard.press("p")
                page.keyboard.press("Escape")
            page.screenshot(path=a.out, full_page=True)
            browser.close()
        finally:
            server.stop()
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
