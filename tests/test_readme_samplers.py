"""The README's sampler table is generated from the code (sampling/names.py): this test fails when they drift, and
`python tests/test_readme_samplers.py` rewrites it."""

from __future__ import annotations

import pathlib
import re
import sys

from diffgraph.sampling.names import SAMPLER_DESCRIPTIONS, SAMPLERS, markdown_table

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(<!-- samplers:begin[^>]*-->\n)(.*?)(<!-- samplers:end -->)", re.S)


def generated(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + markdown_table() + "\n" + m.group(3), text)


def test_the_readme_lists_every_sampler_as_the_code_does():
    text = README.read_text(encoding="utf-8")
    assert BLOCK.search(text), "README.md lacks the samplers:begin / samplers:end markers"
    assert text == generated(text), "README.md's sampler table is stale: run python tests/test_readme_samplers.py"
    assert set(SAMPLER_DESCRIPTIONS) == set(SAMPLERS)
    for name in SAMPLERS:
        assert f"| `{name}` |" in text


if __name__ == "__main__":
    README.write_text(generated(README.read_text(encoding="utf-8")), encoding="utf-8")
    sys.exit(0)
