"""Host memory of prepared adapters is bounded by --lora-host-bytes, not by the queue (issue 28 point 3): queued
requests hold adapter names and file versions only; a host copy dropped from the bounded cache is read again at
admission, off the engine loop, and the images are those of an unbounded engine. The issue measured RSS 706 -> 1478
MB for 100 queued requests over 100 tiny adapters, kept at the high-water mark."""

import os

import numpy as np
import pytest
from safetensors.torch import save_file

from diffgraph import Engine
from loop_util import held_loop
from lora_util import side_path_adapter

MODEL = "random:tiny"
ADAPTERS, REQUESTS = 200, 256


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("adapters"))
    with Engine(MODEL, device="cpu", max_loras=4, max_lora_rank=4) as e:
        for i in range(ADAPTERS):
            save_file(side_path_adapter(e, i, scale=0.3, layers=6), os.path.join(root, f"a{i:03d}.safetensors"))
    return root


def test_queued_requests_hold_no_prepared_weights_and_the_cache_stays_under_its_bound(folder):
    with Engine(MODEL, device="cpu", lora_dir=folder, max_loras=4, max_lora_rank=4, max_queue=REQUESTS) as probe:
        one = probe.runner.loras  # one adapter's prepared bytes
        one.resolve((("a000", 1.0),))
        each = one.host_bytes()
    bound = 3 * each  # room for three adapters' host copies
    with Engine(MODEL, device="cpu", lora_dir=folder, max_loras=4, max_lora_rank=4, max_queue=REQUESTS,
                lora_host_bytes=bound) as e:
        manager = e.runner.loras
        requests = [e.make_request("a cat", num_inference_steps=1, seed=i, loras=[(f"a{i % ADAPTERS:03d}", 1.0)])
                    for i in range(REQUESTS)]
        with held_loop(e):
            futures = [e.submit(r) for r in requests]  # every adapter read and checked at submit...
            peak = manager.host_bytes()
            queued = [s for g in e.core.scheduler.groups.values() for s in g.waiting]
        assert len(queued) == REQUESTS and each > 0
        assert peak <= bound, (peak, bound)  # ...but only the bounded cache keeps them
        assert all(not hasattr(a, "prepared") and a.key[0] == r.loras[0][0] for s, r in zip(queued, requests)
                   for a in s.prepared[manager.files.held_key])
        results = [f.result() for f in futures]  # admission reads the dropped copies again
        assert manager.host_bytes() <= bound
    with Engine(MODEL, device="cpu", lora_dir=folder, max_loras=4, max_lora_rank=4) as unbounded:
        for i in (0, 7, 199, 255):
            np.testing.assert_allclose(results[i].arrays, unbounded.run(requests[i]).arrays, atol=1e-4, rtol=0)


def test_an_adapter_rewritten_while_its_request_waits_fails_that_request_with_a_clear_error(folder, tmp_path):
    import shutil
    root = str(tmp_path)
    for i in range(3):
        shutil.copy(os.path.join(folder, f"a{i:03d}.safetensors"), root)
    with Engine(MODEL, device="cpu", lora_dir=root, max_loras=4, max_lora_rank=4, lora_host_bytes=0) as e:
        with held_loop(e):
            doomed = e.submit(e.make_request("a cat", num_inference_steps=1, seed=1, loras=[("a000", 1.0)]))
            fine = e.submit(e.make_request("a cat", num_inference_steps=1, seed=2, loras=[("a001", 1.0)]))
            os.remove(os.path.join(root, "a000.safetensors"))  # its version is gone before admission reads it again
        assert fine.result().arrays.shape[0] == 1
        with pytest.raises(ValueError, match="could not be read again at admission.*send the request again"):
            doomed.result()
