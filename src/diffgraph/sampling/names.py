"""The sampler and schedule names of the built-in families (SD1.x/2.x and SDXL walk the SD noise schedule with
these samplers): plain data, no numpy or torch, so that the command line can list them in `--help` and
`diffgraph models` without loading anything. `schedules.py` re-exports them. A family lists its own names
(`FamilyAdapter.samplers` / `schedules`, models/families/base.py): these are the SD-shaped families' lists.

Each sampler is its diffusers scheduler (the oracle, sampling/oracle.py); the schedules are diffusers' sigma
options (karras, exponential, beta) and ComfyUI's names for trailing timesteps (sgm_uniform, simple).
"""

SAMPLERS = ("euler", "euler_a", "dpmpp_2m", "ddim", "dpmpp_2m_sde", "dpmpp_3m_sde", "dpmpp_sde", "heun", "dpm2",
            "dpm2_a", "lms", "unipc", "unipc_3", "lcm", "tcd", "plms", "dpmpp_2s_a", "dpmpp_2m_sde_heun", "restart",
            "dpm_fast", "ddim_cfgpp")
SCHEDULES = ("default", "karras", "exponential", "beta", "sgm_uniform", "simple", "uniform", "polyexponential",
             "kl_optimal", "align_your_steps", "turbo", "ddim_uniform")
# the samplers no diffusers scheduler runs (k-diffusion's and AUTOMATIC1111's: sampling/kdiffusion.py, DDIM CFG++ in
# sampling/samplers.py) and the schedules no diffusers option lays (AUTOMATIC1111's, Forge's and ComfyUI's:
# sampling/sigma_tables.py)
KDIFFUSION_SAMPLERS = ("dpmpp_2s_a", "dpmpp_2m_sde_heun", "restart", "dpm_fast", "ddim_cfgpp")
# CFG++ samplers (Chung et al. 2024: their update steps along the unconditional branch's noise, so every row of theirs
# runs both branches where the request's interval guides) -> the factor on the request's guidance_scale that gives the
# guided output's weight (AUTOMATIC1111's 1 / 12.5: its CFG scale 12.5 is CFG++'s lambda 1)
CFGPP_SAMPLERS = {"ddim_cfgpp": 1 / 12.5}
TABLE_SCHEDULES = ("uniform", "polyexponential", "kl_optimal", "align_your_steps", "turbo", "ddim_uniform")
# a family's own list for a schedule name: the SDXL family walks "align_your_steps" on NVIDIA's SDXL list
SCHEDULE_VARIANTS = ("align_your_steps_sdxl",)
DEFAULT_SAMPLER = "euler"      # what a request that names no sampler gets on these families
DEFAULT_SCHEDULE = "default"
TIMESTEP_SPACINGS = ("leading", "linspace", "trailing")  # diffusers' timestep_spacing (a request may override it)
BUILTIN_FAMILIES = ("sd", "sdxl")  # the families (models/families/) that take exactly these names

# samplers that take only some schedules (the others take every one): DDIM steps between integer timesteps, LCM and
# TCD pick their own from the distillation's grid
SAMPLER_SCHEDULES = {
    "ddim": ("default", "karras", "sgm_uniform", "simple"),
    "ddim_cfgpp": ("default", "karras", "sgm_uniform", "simple"),
    "lcm": ("default",),
    "tcd": ("default",),
    "plms": ("default", "sgm_uniform", "simple"),  # PNDMScheduler takes no sigma options
    "dpm_fast": ("default",),  # it lays its own sigmas (AUTOMATIC1111's ignores the scheduler too)
}
# samplers whose rows keep history slots beyond D_prev (sampling/table.py): a family taking one of them allocates the
# slots (features/history.py)
HISTORY_SAMPLERS = ("dpmpp_3m_sde", "dpmpp_sde", "heun", "dpm2", "dpm2_a", "lms", "unipc", "unipc_3", "plms",
                    "dpmpp_2s_a", "restart", "dpm_fast")
# what each sampler is, for --help, /info and the README (one line each)
SAMPLER_DESCRIPTIONS = {
    "euler": "Euler (k-diffusion; EulerDiscreteScheduler)",
    "euler_a": "Euler ancestral (EulerAncestralDiscreteScheduler)",
    "dpmpp_2m": "DPM-Solver++(2M) (DPMSolverMultistepScheduler)",
    "ddim": "DDIM (DDIMScheduler), eta 0 unless the request's eta sets it",
    "dpmpp_2m_sde": "DPM-Solver++(2M) SDE, midpoint (DPMSolverMultistepScheduler, sde-dpmsolver++)",
    "dpmpp_3m_sde": "DPM-Solver++(3M) SDE (DPMSolverMultistepScheduler, sde-dpmsolver++, order 3)",
    "dpmpp_sde": "DPM-Solver++ SDE, two evaluations a step, Brownian-tree noise per request (DPMSolverSDEScheduler)",
    "heun": "Heun, two evaluations a step (HeunDiscreteScheduler)",
    "dpm2": "DPM2, two evaluations a step (KDPM2DiscreteScheduler)",
    "dpm2_a": "DPM2 ancestral, two evaluations a step (KDPM2AncestralDiscreteScheduler)",
    "lms": "linear multistep, order 4 (LMSDiscreteScheduler)",
    "unipc": "UniPC bh2, order 2 (UniPCMultistepScheduler)",
    "unipc_3": "UniPC bh2, order 3 (UniPCMultistepScheduler, solver_order 3)",
    "lcm": "latent consistency, for LCM models and LCM-LoRA (LCMScheduler)",
    "tcd": "trajectory consistency, gamma 0.3 (TCDScheduler)",
    "plms": "pseudo linear multistep, two evaluations at its first step (PNDMScheduler, skip_prk_steps)",
    "dpmpp_2s_a": "DPM-Solver++(2S) ancestral, two evaluations a step, eta 1 unless the request's eta sets it "
                  "(k-diffusion's sample_dpmpp_2s_ancestral)",
    "dpmpp_2m_sde_heun": "DPM-Solver++(2M) SDE, heun solver (k-diffusion's sample_dpmpp_2m_sde, solver_type heun)",
    "restart": "Restart: Heun steps with restart segments from 20 steps on (AUTOMATIC1111's restart_sampler)",
    "dpm_fast": "DPM-Solver fast, orders 3, 2, 1 over its own sigmas, ends at sigma_min; eta 1 unless the request's "
                "eta sets it (k-diffusion's sample_dpm_fast)",
    "ddim_cfgpp": "DDIM CFG++: DDIM's steps along the unconditional branch's noise, the guided output's weight "
                  "guidance_scale / 12.5, both branches at every guided step; eta as `ddim`'s (AUTOMATIC1111's "
                  "ddim_cfgpp)",
}


def markdown_table() -> str:
    """The README's table of samplers and their schedules (tests/test_readme_samplers.py keeps it current)."""
    lines = ["| sampler | what it is | schedules |", "|---|---|---|"]
    for name in SAMPLERS:
        lines.append(f"| `{name}` | {SAMPLER_DESCRIPTIONS[name]} | {', '.join(SAMPLER_SCHEDULES.get(name, SCHEDULES))} |")
    schedules = ("Schedules: `default` (the model's own timestep spacing), `karras`, `exponential` and `beta` (alpha "
                 "= beta = 0.6) respace the sigmas as diffusers' use_karras_sigmas / use_exponential_sigmas / "
                 "use_beta_sigmas; `sgm_uniform` and `simple` are the default schedule on trailing timesteps "
                 "(diffusers' mapping of ComfyUI's names). `uniform`, `polyexponential`, `kl_optimal`, "
                 "`align_your_steps` (NVIDIA's SD1.5 list, SDXL's on the SDXL family), `turbo` and `ddim_uniform` "
                 "are AUTOMATIC1111's and Forge's schedulers of those names (sampling/sigma_tables.py), over the "
                 "model's whole sigma range. The default sampler is "
                 f"`{DEFAULT_SAMPLER}`, the default schedule `{DEFAULT_SCHEDULE}`. A request's `eta` (0-1) is `tcd`'s "
                 "gamma and `ddim`'s and `ddim_cfgpp`'s eta (fresh noise each step, as DDIMScheduler's eta and "
                 "AUTOMATIC1111's Eta DDIM), "
                 "and the noise amount of `euler_a`, `dpmpp_2s_a` and `dpm_fast`; other samplers refuse it.")
    return "\n".join(lines) + "\n\n" + schedules
