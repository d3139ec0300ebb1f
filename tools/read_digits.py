"""Reads digits images saved by a GPU test (tests/gpu/test_compile_gpu.py, DIFFGRAPH_TEST_OUT) with the digits
recognition oracle of tests/test_digits.py (scikit-learn), on a machine that has scikit-learn:

    python tools/read_digits.py digits_compile_tier.npz     -> the fraction read as the asked digit (target >= 0.9)
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def main(path: str) -> int:
    from test_digits import features, oracle_and_heldout

    saved = np.load(path)
    clf, _ = oracle_and_heldout()
    pred = clf.predict(features(saved["images"]))
    rate = float((pred == saved["asked"]).mean())
    wrong = {int(a): int(p) for a, p in zip(saved["asked"], pred) if a != p}
    print(f"{path}: {rate:.0%} of {len(pred)} read as the asked digit; misread (asked: read) {wrong}")
    return 0 if rate >= 0.9 else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
