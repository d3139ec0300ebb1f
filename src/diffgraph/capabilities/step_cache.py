"""`step_cache`'s declaration: its request parameter and its setting (the capability: models/families/unet_cache.py
for the SD families' UNets, token_cache.py for Z-Image)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..capability_settings import Declaration, RequestFlag


@dataclass(frozen=True)
class StepCacheSettings:
    step_cache: str = dataclasses.field(default="off", metadata={
        "metavar": "off|auto|JSON", "help": "the step cache of a request that names none (SD families' UNets; "
                "Z-Image): off, auto, or a JSON object such as '{\"method\": \"deepcache\", \"interval\": 3}'"})


DECLARATION = Declaration("step_cache", StepCacheSettings, flags=(RequestFlag(
    "step_cache", metavar="off|auto|JSON", json=True,
    help="per-row step caching (SD families' UNets: DeepCache; Z-Image: TaylorSeer): off, auto, or a JSON "
         "object such as '{\"method\": \"deepcache\", \"interval\": 3, \"branch\": 0, \"schedule\": "
         "\"uniform\"}' or '{\"method\": \"taylorseer\", \"interval\": 2, \"order\": 1}' "
         "(default: the server's or off)"),))
