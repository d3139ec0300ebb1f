"""The README's Install and Test commands are the ones CI runs (.ci/run), so a new user's two commands work."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _first_block(section: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", body, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_readme_commands_are_what_ci_runs():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    install, = _first_block("Install")
    test, = _first_block("Test")
    assert f"python -m {install}" in ci, f"{install!r} is not what .ci/run installs"
    assert test in ci and ci[-1] == test, f"{test!r} is not .ci/run's test command"
    assert "bash .ci/run" in (ROOT / "README.md").read_text()
