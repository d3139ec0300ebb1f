"""A run-time capability with host files (tests/test_capabilities.py's `Bias`) on CUDA graphs: each bias file placed
in the one device slot in place between steps reaches the captured step (the final latents are the plain request's
plus the file's shift), the slot rewritten for each request in turn."""

import os

import pytest

from diffgraph import Engine, GraphConfig
from diffgraph.features.capability import Capabilities

from test_capabilities import Bias, check_files_reach_graphed_steps, make_bias_folder

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("DIFFGRAPH_TEST_DEVICE", "cuda")


def test_a_capabilitys_files_reach_captured_graphs(tmp_path):
    graphs = GraphConfig(resolutions=((64, 64),), batch_buckets=(1, 2), prewarm=False)
    with Engine(model="random:tiny", device=DEVICE, dtype="fp32", mode="graph", graphs=graphs,
                capabilities=Capabilities((Bias(),)),
                capability_settings={"bias": {"folder": str(make_bias_folder(tmp_path)), "slots": 1}}) as e:
        check_files_reach_graphed_steps(e)
        assert any(row for row in e.runner.graph_table())  # the steps replayed captured graphs
