"""The choices the command lines offer and their defaults, in one place (and light: no torch import, so
``--help`` answers at once). The code that acts on a choice (``make_scheduler``, ``load_pipeline``)
validates against the same names."""

from __future__ import annotations

__all__ = ["SCHEDULERS", "DTYPES", "LABEL_MODES", "GRID_GUIDANCE", "EVAL_GUIDANCE", "EVAL_STEPS"]

# Sampling schedulers for DiT's training schedule (moh_dit.pipeline.make_scheduler): DiT's DDPM with the
# learned variance, and fast solvers that use the noise prediction only.
SCHEDULERS = ("ddpm", "ddim", "dpm-solver", "dpm-solver-sde", "unipc")

# Transformer dtypes for sampling (the VAE stays in fp32).
DTYPES = ("fp32", "bf16", "fp16")

# How N-sample generation labels image i: uniformly at random from (seed, i), as the papers' 50K
# evaluations do, or class-balanced (i mod K), which lowers the variance of small-sample metrics.
LABEL_MODES = ("uniform", "balanced")

# Guidance defaults differ on purpose. Grids are for looking at: DiT's visual samples use scale 4.0, which
# trades diversity for clearly recognisable classes. Evaluations reproduce the papers' FID protocol, which
# uses 1.5 (DiT); the MoH paper reports 1.25 as well. Pass --cfg-scale to choose otherwise.
GRID_GUIDANCE = 4.0
EVAL_GUIDANCE = 1.5

# DiT's evaluation protocol: 250 DDPM steps.
EVAL_STEPS = 250
