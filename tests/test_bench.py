"""The benchmarks' CPU-side arithmetic: seeded traces and the saturation work measure."""

import pytest

from diffgraph.bench.throughput import make_trace, work_fraction


def test_trace_is_seeded_and_follows_the_mix():
    a = make_trace(5.0, 20.0, 0, steps=(20, 50), sizes=((512, 512), (768, 512)), samplers=("euler",))
    b = make_trace(5.0, 20.0, 0, steps=(20, 50), sizes=((512, 512), (768, 512)), samplers=("euler",))
    assert a == b and a != make_trace(5.0, 20.0, 1)
    assert 60 < len(a) < 140  # Poisson, 5/s over 20 s
    assert all(0 < x.at <= 20 for x in a) and [x.at for x in a] == sorted(x.at for x in a)
    assert {x.steps for x in a} == {20, 50} and {x.size for x in a} == {(512, 512), (768, 512)}


def test_work_fraction_weighs_rows_by_their_full_bucket_cost():
    cost = {(512, 512): 93.0 / 16, (768, 512): 147.0 / 16}
    steps = [(0.5, (512, 512), 16), (1.0, (512, 512), 8), (1.5, (768, 512), 16), (3.0, (512, 512), 16)]
    # in [0, 2]: 16 + 8 rows at 512 and 16 at 768; the step at t=3 is outside
    assert work_fraction(steps, cost, 0.0, 2.0) == pytest.approx((24 * 93 / 16 + 147) / 2000)
    # back-to-back full steps fill the window exactly
    full = [(0.093 * i, (512, 512), 16) for i in range(1, 101)]
    assert work_fraction(full, cost, 0.0, 9.3) == pytest.approx(1.0)
