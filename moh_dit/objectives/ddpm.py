"""DiT's diffusion training objective on top of diffusers' ``DDPMScheduler``, and DiT's samplers.

The noise schedule and the forward process come from diffusers. diffusers has no variational-bound
term for a learned variance, so it is written here (docs/objective.md): with ``learn_sigma`` the
model outputs ``2C`` channels, noise prediction ``eps`` and variance values ``v``, and

    log var  = f log(beta_t) + (1 - f) log(beta~_t),    f = (v + 1) / 2
    loss     = mean((eps - eps_hat)^2) + L_vb
    L_vb     = KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t)) in bits       (t > 0)
             = -log2 p(x_0 | x_1) under a discretised Gaussian decoder       (t = 0)

with the model mean computed from a *stop-gradient* copy of ``eps_hat``, so the VB term trains only the
variance. This equals the improved-DDPM hybrid loss with lambda = 0.001 (DiT uses it with no weight).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler, UniPCMultistepScheduler
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from moh_dit.errors import ConfigError
from moh_dit.objectives.base import Losses, Noised, NoiseLevel, Objective
from moh_dit.objectives.folded_guidance import FOLDED_KEYS, FoldedGuidance
from moh_dit.objectives.linear_path import (
    linear_path_input,
    sigma_of_timestep,
    timestep_of_sigma,
    velocity_of_ddpm_noise,
    velocity_of_noise,
)
from moh_dit.objectives.noise import DIT_SCHEDULE, ddpm_sigma

__all__ = [
    "DIT_SCHEDULE",
    "DDPM",
    "linear_path_input",
    "velocity_of_noise",
    "DiffusionObjective",
    "DiffusionLosses",
    "make_train_scheduler",
    "normal_kl",
    "discretized_gaussian_log_likelihood",
    "timestep_of_sigma",
    "sigma_of_timestep",
]


def make_train_scheduler(num_train_timesteps: int = 1000, learn_sigma: bool = True) -> DDPMScheduler:
    """DiT's schedule (:data:`DIT_SCHEDULE`) with noise prediction."""
    return DDPMScheduler(
        **dict(DIT_SCHEDULE, num_train_timesteps=num_train_timesteps),
        prediction_type="epsilon",
        variance_type="learned_range" if learn_sigma else "fixed_small",
        clip_sample=False,
    )


def _mean_flat(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.ndim)))


def normal_kl(mean1, logvar1, mean2, logvar2) -> torch.Tensor:
    """Elementwise KL(N(mean1, exp(logvar1)) || N(mean2, exp(logvar2))) in nats."""
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def _approx_standard_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    # The tanh approximation used by the reference implementations, kept so loss values match theirs.
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def discretized_gaussian_log_likelihood(x: torch.Tensor, mean: torch.Tensor, log_scale: torch.Tensor) -> torch.Tensor:
    """Log-likelihood (nats, elementwise) of data in [-1, 1] quantised to 256 bins under N(mean, exp(log_scale)^2).

    The outermost bins extend to -inf / +inf.
    """
    centered = x - mean
    inv_std = torch.exp(-log_scale)
    cdf_plus = _approx_standard_normal_cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_min = _approx_standard_normal_cdf(inv_std * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_delta))


DiffusionLosses = Losses  # the name of moh-dit 0.3


class DDPM(Objective):
    """DiT's objective: noising and the hybrid loss for a given ``DDPMScheduler``, and DiT's samplers.

    Args:
        scheduler: the training scheduler (its betas define everything); DiT's by default.
        learn_sigma: the model predicts the variance (``2C`` output channels) and the VB term is added.
        snr_gamma: None for DiT's loss. A number gamma weights each sample's noise MSE by
            ``min(SNR_t, gamma) / SNR_t`` (Min-SNR-gamma, Hang et al., ICCV 2023, for noise prediction): the
            many nearly clean timesteps, whose targets conflict least with the others, stop dominating the
            gradient, which speeds up convergence; the VB term is left as it is.
        guidance_scale, guidance_mix, guidance_times, guidance_warmup, guidance_source: guidance folded into the noise
            target (Model Guidance; :class:`~moh_dit.objectives.folded_guidance.FoldedGuidance`: omega, kappa, the
            flow times of the noise levels it applies at, the steps before it starts, whose predictions); the VB term
            keeps the true posterior. Off by default.
    """

    name = "ddpm"
    target_term = "noise"

    def __init__(
        self,
        scheduler: DDPMScheduler | None = None,
        learn_sigma: bool = True,
        snr_gamma: float | None = None,
        guidance_scale: float | None = None,
        guidance_mix: float | None = None,
        guidance_times: list[float] | None = None,
        guidance_warmup: int | None = None,
        guidance_source: str | None = None,
    ) -> None:
        self.folded = FoldedGuidance.create(
            guidance_scale, guidance_mix, guidance_times, guidance_warmup, guidance_source
        )
        self.scheduler = scheduler if scheduler is not None else make_train_scheduler(learn_sigma=learn_sigma)
        self.learn_sigma = learn_sigma
        if snr_gamma is not None and not snr_gamma > 0:
            raise ValueError(f"snr_gamma must be a positive number or None, got {snr_gamma}")
        self.snr_gamma = snr_gamma
        self.num_timesteps = self.scheduler.config.num_train_timesteps
        # Coefficients in float64, like the reference, gathered per timestep and cast to the data dtype.
        # diffusers keeps betas in float32; rebuild a linear schedule in float64 so the coefficients match
        # the reference to the last digit.
        sc = self.scheduler.config
        if sc.beta_schedule == "linear" and sc.trained_betas is None:
            betas = torch.linspace(sc.beta_start, sc.beta_end, sc.num_train_timesteps, dtype=torch.float64)
        else:
            betas = self.scheduler.betas.to(torch.float64)
        alphas = 1.0 - betas
        alphas_cumprod = torch.cumprod(alphas, dim=0)
        alphas_cumprod_prev = torch.cat([torch.ones(1, dtype=torch.float64), alphas_cumprod[:-1]])
        posterior_variance = betas * (1.0 - alphas_cumprod_prev) / (1.0 - alphas_cumprod)
        self.betas = betas
        self.alphas_cumprod = alphas_cumprod
        self.posterior_variance = posterior_variance
        # beta~_0 is 0: clip the log at t = 0 to beta~_1, as the reference does
        self.posterior_log_variance_clipped = torch.log(torch.cat([posterior_variance[1:2], posterior_variance[1:]]))
        self.posterior_mean_coef1 = betas * torch.sqrt(alphas_cumprod_prev) / (1.0 - alphas_cumprod)
        self.posterior_mean_coef2 = (1.0 - alphas_cumprod_prev) * torch.sqrt(alphas) / (1.0 - alphas_cumprod)
        self.sqrt_recip_alphas_cumprod = torch.sqrt(1.0 / alphas_cumprod)
        self.sqrt_recipm1_alphas_cumprod = torch.sqrt(1.0 / alphas_cumprod - 1.0)
        # diffusers' compute_snr takes the scheduler's float32 table; these float64 ones give the same SNR
        # to float32 precision without a device round trip per step
        snr = alphas_cumprod / (1.0 - alphas_cumprod)
        self.mse_weights = torch.clamp(snr, max=snr_gamma) / snr if snr_gamma is not None else None

    @staticmethod
    def _gather(table: torch.Tensor, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        out = table.to(t.device)[t].to(like.dtype)
        return out.reshape(-1, *([1] * (like.ndim - 1)))

    # ------------------------------------------------------------------------------------------------
    # Forward process
    # ------------------------------------------------------------------------------------------------
    def add_noise(self, x_start: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """q(x_t | x_0): ``sqrt(a_t) x_0 + sqrt(1 - a_t) noise`` (diffusers' scheduler does it)."""
        return self.scheduler.add_noise(x_start, noise, t)

    def q_posterior(self, x_start, x_t, t):
        """Mean and clipped log-variance of q(x_{t-1} | x_t, x_0)."""
        mean = (
            self._gather(self.posterior_mean_coef1, t, x_t) * x_start
            + self._gather(self.posterior_mean_coef2, t, x_t) * x_t
        )
        return mean, self._gather(self.posterior_log_variance_clipped, t, x_t)

    def model_log_variance(self, var_values: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Interpolate between log(beta~_t) and log(beta_t) with ``f = (v + 1) / 2``."""
        min_log = self._gather(self.posterior_log_variance_clipped, t, var_values)
        max_log = self._gather(torch.log(self.betas), t, var_values)
        frac = (var_values + 1) / 2
        return frac * max_log + (1 - frac) * min_log

    def predict_start_from_noise(self, x_t, t, eps):
        return (
            self._gather(self.sqrt_recip_alphas_cumprod, t, x_t) * x_t
            - self._gather(self.sqrt_recipm1_alphas_cumprod, t, x_t) * eps
        )

    # ------------------------------------------------------------------------------------------------
    # Loss
    # ------------------------------------------------------------------------------------------------
    def vb_terms_bpd(self, eps, var_values, x_start, x_t, t) -> torch.Tensor:
        """VB term in bits per dimension for each sample (N,): KL for t > 0, decoder NLL at t = 0."""
        true_mean, true_log_var = self.q_posterior(x_start, x_t, t)
        pred_x0 = self.predict_start_from_noise(x_t, t, eps)
        model_mean, _ = self.q_posterior(pred_x0, x_t, t)
        model_log_var = self.model_log_variance(var_values, t)
        kl = _mean_flat(normal_kl(true_mean, true_log_var, model_mean, model_log_var)) / math.log(2.0)
        nll = -_mean_flat(discretized_gaussian_log_likelihood(x_start, model_mean, 0.5 * model_log_var)) / math.log(
            2.0
        )
        return torch.where(t == 0, nll, kl)

    def losses(
        self,
        model_output: torch.Tensor,
        x_start: torch.Tensor,
        x_t: torch.Tensor,
        t: torch.Tensor,
        noise: torch.Tensor,
    ) -> Losses:
        """Per-sample loss terms for a model output on ``x_t = add_noise(x_start, noise, t)``."""
        c = x_start.shape[1]
        if self.learn_sigma:
            if model_output.shape[1] != 2 * c:
                raise ValueError(f"learn_sigma expects {2 * c} output channels, got {model_output.shape[1]}")
            eps, var_values = model_output[:, :c], model_output[:, c:]
            mse = _mean_flat((noise - eps) ** 2)
            vb = self.vb_terms_bpd(eps.detach(), var_values, x_start, x_t, t)  # the mean gets no VB gradient
            return Losses(loss=self._weighted(mse, t) + vb, mse=mse, vb=vb)
        if model_output.shape[1] != c:
            raise ValueError(f"expected {c} output channels, got {model_output.shape[1]}")
        mse = _mean_flat((noise - model_output) ** 2)
        return Losses(loss=self._weighted(mse, t), mse=mse)

    def _weighted(self, mse: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The noise MSE (N,) with the Min-SNR weight of each sample's timestep (as it is without one)."""
        return mse if self.mse_weights is None else mse * self._gather(self.mse_weights, t, mse)

    # ------------------------------------------------------------------------------------------------
    # The objective's interface (moh_dit.objectives.base)
    # ------------------------------------------------------------------------------------------------
    def record(self) -> dict[str, Any] | None:
        # DiT's objective is what a model without a record means (moh-dit 0.3 and earlier); folded guidance is recorded
        return {"name": self.name, **self.folded.record()} if self.folded.active else None

    @classmethod
    def from_record(
        cls, record: dict[str, Any] | None, learn_sigma: bool = True, snr_gamma: float | None = None, **guidance: Any
    ) -> DDPM:
        record = record or {}
        unknown = sorted(set(record) - {"name", *FOLDED_KEYS})
        if unknown:
            raise ConfigError(f"the ddpm objective record has unknown keys {unknown}")
        return cls(learn_sigma=learn_sigma, snr_gamma=snr_gamma, **{k: record[k] for k in FOLDED_KEYS if k in record},
                   **guidance)  # fmt: skip

    def describe(self) -> str:
        return super().describe() + (f"; {self.folded.describe()}" if self.folded.active else "")

    def flow_times(self, noised: Noised) -> torch.Tensor:
        sigma = sigma_of_timestep(noised.terms["t"].double())
        return (sigma / (1 + sigma)).float()  # the linear path's time of that noise level

    def target_prediction(self, output: torch.Tensor, noised: Noised, index: torch.Tensor) -> torch.Tensor:
        return output[:, : noised.x_t.shape[1]]  # the noise prediction (the learned variance is not guided)

    def out_channels(self, in_channels: int) -> int:
        return 2 * in_channels if self.learn_sigma else in_channels

    def describe_loss(self) -> str:
        what = "DiT's hybrid loss (noise MSE + variational bound)" if self.learn_sigma else "noise MSE"
        return what + (f", Min-SNR-{self.snr_gamma:g} weighted" if self.snr_gamma is not None else "")

    def noised(self, x0: torch.Tensor, generator: torch.Generator, device: torch.device) -> Noised:
        """A uniform timestep and Gaussian noise per sample, drawn in that order (the draws of moh-dit 0.3)."""
        t = torch.randint(0, self.num_timesteps, (x0.shape[0],), generator=generator).to(device)
        noise = torch.randn(x0.shape, generator=generator).to(device)
        return Noised(self.add_noise(x0, noise, t), t, {"x0": x0, "noise": noise, "t": t})

    def random_model_times(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(0, self.num_timesteps, (n,), generator=generator)

    def loss(self, output: torch.Tensor, noised: Noised) -> Losses:
        terms = noised.terms
        return self.losses(output, terms["x0"], noised.x_t, terms["t"], terms["noise"])

    # ------------------------------------------------------------------------------------------------
    # Teaching
    # ------------------------------------------------------------------------------------------------
    @property
    def time_convention(self) -> str:
        return "ddpm"  # a student sees the DiT timestep of its noise level, as the teacher did

    def linear_velocity(self, net, z, t, labels, drop=None) -> torch.Tensor:
        """At flow time ``t`` the linear path's noise level is ``sigma = t / (1 - t)``; the DDPM model sees the same
        signal-to-noise ratio at the (fractional) timestep ``tau`` of that level, on the input ``sqrt(abar_tau) z / (1 -
        t)``, and predicts the noise ``eps_hat``; the velocity ``eps - x`` with ``x = (z - t eps) / (1 - t)`` is then
        ``(eps_hat - z) / (1 - t)`` (docs/objective.md#distillation). Beyond DiT's schedule (noise levels below
        timestep 0's or above 999's) the model sees the nearest timestep; above 999's the velocity comes from its
        clean estimate there (:func:`velocity_of_ddpm_noise`: finite at ``t = 1``)."""
        model_in, tau = linear_path_input(z, t)
        eps = net(model_in, tau.to(z.dtype), labels, force_drop_ids=drop).sample
        return velocity_of_ddpm_noise(eps[:, : z.shape[1]], z, t).float()

    def make_scheduler(self, name: str) -> SchedulerMixin:
        """Sampling schedulers for DiT's training schedule.

        ``ddpm`` is DiT's protocol: ancestral sampling with the learned variance on linspace-respaced steps. The
        others use only the noise prediction: ``ddim`` (eta 0), ``dpm-solver`` (DPM-Solver++ 2M),
        ``dpm-solver-sde`` (its stochastic SDE variant) and ``unipc`` (UniPC, bh2).
        """
        self.check_sampler(name)
        if name == "ddpm":
            return DDPMScheduler(
                **DIT_SCHEDULE,
                variance_type="learned_range" if self.learn_sigma else "fixed_small",
                clip_sample=False,
                timestep_spacing="linspace",
                prediction_type="epsilon",
            )
        if name == "ddim":
            return DDIMScheduler(
                **DIT_SCHEDULE,
                clip_sample=False,
                set_alpha_to_one=False,
                prediction_type="epsilon",
                timestep_spacing="linspace",
            )
        # the second-order multistep solvers share everything but the algorithm
        multistep = dict(
            **DIT_SCHEDULE,
            solver_order=2,
            prediction_type="epsilon",
            timestep_spacing="linspace",
            lower_order_final=True,
        )
        if name == "dpm-solver":
            return DPMSolverMultistepScheduler(**multistep, algorithm_type="dpmsolver++")
        if name == "dpm-solver-sde":
            return DPMSolverMultistepScheduler(**multistep, algorithm_type="sde-dpmsolver++")
        return UniPCMultistepScheduler(**multistep)

    def scheduler_name(self, scheduler: SchedulerMixin) -> str | None:
        if isinstance(scheduler, DPMSolverMultistepScheduler):
            if scheduler.config.get("use_flow_sigmas"):
                return None
            algorithm = scheduler.config.algorithm_type
            return {"dpmsolver++": "dpm-solver", "sde-dpmsolver++": "dpm-solver-sde"}.get(algorithm)
        if isinstance(scheduler, UniPCMultistepScheduler):
            return None if scheduler.config.get("use_flow_sigmas") else "unipc"
        return {DDPMScheduler: "ddpm", DDIMScheduler: "ddim"}.get(type(scheduler))

    def set_timesteps(
        self, scheduler: SchedulerMixin, steps: int, time_shift: float, device: torch.device | str | None
    ) -> None:
        if time_shift != 1.0:
            raise ConfigError(
                f"time_shift={time_shift:g} shifts the grid of flow samplers; DiT's samplers space their steps on its "
                "schedule: leave time_shift at 1 for a DDPM model"
            )
        scheduler.set_timesteps(steps, device=device)

    def step_time(self, scheduler: SchedulerMixin, index: int, t: torch.Tensor) -> tuple[torch.Tensor, NoiseLevel]:
        return t, NoiseLevel(ddpm_sigma(int(t)), int(t))  # the network sees the training timestep itself

    def scheduler_input(
        self, output: torch.Tensor, scheduler: SchedulerMixin, in_channels: int, latents: torch.Tensor, index: int
    ) -> torch.Tensor:
        # DiT's DDPM takes the learned variance too; the fast solvers take the noise prediction only
        learned = isinstance(scheduler, DDPMScheduler) and scheduler.config.variance_type in (
            "learned",
            "learned_range",
        )
        return output if learned else output[:, :in_channels]


DiffusionObjective = DDPM  # the name of moh-dit 0.3
