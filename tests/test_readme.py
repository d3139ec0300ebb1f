"""The README leads with what a user does (install, generate, serve, the clients, batch jobs) before GPU internals,
development and benchmarks; its user install comes first, and its development section's test install and test
command are the ones CI runs (.ci/run), so a new developer's two commands work."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sections() -> list[str]:
    return re.findall(r"^## (.+)$", (ROOT / "README.md").read_text(), re.M)


def _first_block(section: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", body, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_readme_commands_are_what_ci_runs():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert _first_block("Install") == ["pip install -e ."]  # a user's install first, not the test tools
    install, test = _first_block("Development / tests")
    assert f"python -m {install}" in ci, f"{install!r} is not what .ci/run installs"
    assert test in ci and ci[-1] == test, f"{test!r} is not .ci/run's test command"
    assert "bash .ci/run" in (ROOT / "README.md").read_text()


def test_readme_leads_with_what_a_user_does_then_gpu_internals_and_benchmarks():
    sections = _sections()
    user = ["Install", "Generate an image", "Serve over HTTP", "AUTOMATIC1111 clients",
            "Batch production: jobs of thousands of images"]
    below = ["Speed on a GPU: the tiers", "Development / tests", "Benchmarks and GPU tests", "Architecture"]
    assert sections[0] == "Install" and set(user + below) <= set(sections), sections
    assert max(map(sections.index, user)) < min(map(sections.index, below)), sections
    intro = (ROOT / "README.md").read_text().split("\n## ", 1)[0]
    assert "CUDA-graph" not in intro and "pip install" not in intro  # the introduction says what it does, no internals
