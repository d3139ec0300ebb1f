"""The sampler and schedule names of the built-in families (SD1.x/2.x and SDXL walk the SD noise schedule with
these samplers): plain data, no numpy or torch, so that the command line can list them in `--help` and
`diffgraph models` without loading anything. `schedules.py` re-exports them. A family lists its own names
(`FamilyAdapter.samplers` / `schedules`, models/families/base.py): these are the SD-shaped families' lists.
"""

SAMPLERS = ("euler", "euler_a", "dpmpp_2m", "ddim")
SCHEDULES = ("default", "karras")
DEFAULT_SAMPLER = "euler"      # what a request that names no sampler gets on these families
DEFAULT_SCHEDULE = "default"
BUILTIN_FAMILIES = ("sd", "sdxl")  # the families (models/families/) that take exactly these names
