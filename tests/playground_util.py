"""The playground's scripts run without a browser: Node (the one Playwright ships, a test dependency) evaluates a
playground file beside stand-ins for the page's elements, and a test reads what its functions answer."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

PLAYGROUND = Path(__file__).resolve().parents[1] / "src" / "diffgraph" / "server" / "playground"

# a page of plain elements: every id answers one (hidden, textContent, value, files; `fire(id, event)` awaits its
# listeners), and a FileReader that reads every file as an empty PNG data URL
_PAGE = """
const vm = require("vm"), fs = require("fs");
const elements = {};
const element = () => ({ hidden: true, textContent: "", value: "", files: [], listeners: {},
  addEventListener(event, f) { (this.listeners[event] = this.listeners[event] || []).push(f); },
  replaceChildren() {}, closest: () => null, setAttribute() {}, removeAttribute() {} });
const $ = (id) => (elements[id] = elements[id] || element());
const fire = (id, event) => Promise.all(($(id).listeners[event] || []).map((f) => f()));
class FileReader { readAsDataURL() { this.result = "data:image/png;base64,"; setTimeout(() => this.onload()); } }
const window = {};
vm.runInNewContext(fs.readFileSync(process.argv[1], "utf8"), { window, document: { createElement: element },
  console, Promise, FileReader, setTimeout });
const input = JSON.parse(fs.readFileSync(0, "utf8"));
"""


def node() -> str:
    """Playwright's bundled Node."""
    import playwright

    return str(Path(playwright.__file__).parent / "driver" / "node")


def run(script: str, body: str, given: dict) -> object:
    """What `body` (JavaScript after the page above: `window`, `$`, `elements`, `input`) prints as JSON, with
    playground file `script` evaluated and `given` as `input`."""
    done = subprocess.run([node(), "-e", _PAGE + body, str(PLAYGROUND / script)], input=json.dumps(given),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
