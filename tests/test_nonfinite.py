"""A row whose numbers overflow (NaN or infinity reaching the pixels) fails its own request with a clear error
instead of returning a black image (NaN cast to uint8); the other rows of the same batch are unchanged (issue 36)."""

import numpy as np
import pytest
import torch

from diffgraph import Engine, EngineStepError


def test_a_non_finite_row_fails_alone_and_its_batch_companions_are_unchanged():
    with Engine(model="random:tiny", device="cpu", dtype="fp32") as e:
        marker = float(e.runner.encode_texts(["poison"])["embeds"][0, 1, 0])

        def poison(module, args, kwargs, out):  # NaN for the denoiser rows of the prompt "poison"
            rows = kwargs["encoder_hidden_states"][:, 1, 0] == marker
            out[0][rows] = float("nan")
            return out

        clean = e.make_request("a red fox", num_inference_steps=3, seed=1)
        alone = e.run(clean).arrays
        handle = e.model.denoiser.register_forward_hook(poison, with_kwargs=True)
        try:
            futures = []  # both queued at one step boundary: one batch
            requests = (e.make_request("poison", num_inference_steps=3, seed=2), clean)
            e.core.call_between_steps(lambda: futures.extend(e.submit(r) for r in requests)).result()
            bad, good = futures
            with pytest.raises(EngineStepError, match="non-finite pixels"):
                bad.result()
            np.testing.assert_allclose(good.result().arrays, alone, atol=1e-5, rtol=0)
        finally:
            handle.remove()
        assert np.isfinite(e.generate("a blue car", num_inference_steps=2, seed=3).arrays).all()  # still serving
