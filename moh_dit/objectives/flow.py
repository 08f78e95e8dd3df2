"""Flow matching (SiT's stochastic interpolants with velocity prediction), in moh-dit's convention.

Flow time ``s`` runs from 0 (data) to 1 (noise), as in diffusers and REPA (SiT counts the other way):

    x_s = a(s) x + b(s) eps        linear: a = 1 - s, b = s        GVP: a = cos(pi s / 2), b = sin(pi s / 2)
    v   = dx_s / ds = a'(s) x + b'(s) eps                          (linear: v = eps - x)
    loss = mean over C, H, W of (v_hat - v)^2                      per sample, as SiT's and REPA's

Training draws ``s`` uniformly (SiT, REPA), logit-normally (SD3, LightningDiT) or as REPA's "lognormal" (the noise
level ``sigma = exp(N(mean, std))`` mapped to the path's time). The network outputs ``C`` channels: a learned
variance has no meaning here.

What the network sees as its time and what it outputs is the objective's ``convention``, recorded with the model:
``moh-dit`` (time ``1000 s``, output ``v``: diffusers' SD3 convention), ``repa`` (time ``s``, output ``v``) and
``sit`` (time ``1 - s``, output ``-v``). Checkpoints of SiT and REPA load with theirs (moh_dit.interop.sit); a
model keeps its convention for life (docs/objective.md has the table).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from moh_dit.errors import ConfigError
from moh_dit.objectives.base import Losses, Noised, NoiseLevel, Objective
from moh_dit.objectives.flow_schedulers import FlowHeunScheduler, FlowSDEScheduler, path_coefficients
from moh_dit.objectives.folded_guidance import FOLDED_KEYS, FoldedGuidance
from moh_dit.objectives.noise import PATHS, flow_sigma

__all__ = ["Flow", "CONVENTIONS", "TIME_SAMPLING", "shifted"]

# the network's time input for flow time s, and the sign of its output relative to v = dx/ds
CONVENTIONS = {
    "moh-dit": (lambda s: 1000.0 * s, 1.0),  # diffusers' SD3 convention: the timestep embedding sees 0 .. 1000
    "repa": (lambda s: s, 1.0),  # REPA's SiT: raw time, noise at 1
    "sit": (lambda s: 1.0 - s, -1.0),  # SiT: raw time with noise at 0, and the velocity toward the data
}
TIME_SAMPLING = ("uniform", "logit-normal", "lognormal")
# what the network outputs: the velocity (SiT's), or the clean image (JiT's x-prediction; the loss stays in velocity)
PREDICTIONS = ("velocity", "x")
# x-prediction's velocity divides by the noise coefficient b(s); JiT clamps it at 0.05 so that the last steps and the
# cleanest training times do not blow up
X_PREDICTION_MIN_NOISE = 0.05
# samplers that take x0 = x - s v, which holds on the linear path only (the registry's sampler_limits say where)
LINEAR_ONLY = ("dpm-solver", "unipc")


def shifted(s: torch.Tensor, shift: float) -> torch.Tensor:
    """The time shift of SD3 (and LightningDiT's ``timestep_shift`` 0.3 = SD3's 1 / 0.3): ``shift s / (1 + (shift -
    1) s)``; more of the grid's steps at high noise for ``shift`` > 1."""
    return shift * s / (1 + (shift - 1) * s)


class Flow(Objective):
    """Flow matching with velocity prediction (see the module docstring).

    Args:
        path: ``linear`` (SiT's Linear) or ``gvp`` (SiT's GVP, the cosine path).
        convention: the network's time and output (``moh-dit``, ``repa``, ``sit``).
        time_sampling: how training draws ``s``: ``uniform``, ``logit-normal`` (``sigmoid(N(time_mean,
            time_std))``) or ``lognormal`` (REPA's: ``sigma = exp(N(time_mean, time_std))``, then the path's time
            of that noise level; the same law as logit-normal on the linear path).
        time_mean, time_std: the normal's parameters for the last two.
        cosine_loss: the weight of LightningDiT's velocity-direction loss, ``1 - cos(v_hat, v)`` over the channels at
            every position, averaged over the positions, added to the MSE (its recipe: 1; 0: none).
        prediction: ``velocity`` (the network outputs ``v``, in its convention's sign) or ``x`` (JiT: it outputs the
            clean image ``x_hat``; the loss and the samplers take the velocity it implies, :meth:`velocity_of`).
        guidance_scale, guidance_mix, guidance_times, guidance_warmup, guidance_source: guidance folded into the
            velocity target (Model Guidance; :class:`~moh_dit.objectives.folded_guidance.FoldedGuidance`). Off by
            default.
    """

    name = "flow"
    target_term = "velocity"

    def __init__(
        self,
        path: str = "linear",
        convention: str = "moh-dit",
        time_sampling: str = "uniform",
        time_mean: float = 0.0,
        time_std: float = 1.0,
        cosine_loss: float = 0.0,
        prediction: str = "velocity",
        guidance_scale: float | None = None,
        guidance_mix: float | None = None,
        guidance_times: list[float] | None = None,
        guidance_warmup: int | None = None,
        guidance_source: str | None = None,
    ) -> None:
        self.folded = FoldedGuidance.create(
            guidance_scale, guidance_mix, guidance_times, guidance_warmup, guidance_source
        )
        if path not in PATHS:
            raise ConfigError(f"objective.path must be one of {', '.join(PATHS)}, got {path!r}")
        if convention not in CONVENTIONS:
            raise ConfigError(f"the flow convention must be one of {', '.join(CONVENTIONS)}, got {convention!r}")
        if time_sampling not in TIME_SAMPLING:
            raise ConfigError(
                f"objective.time_sampling must be one of {', '.join(TIME_SAMPLING)}, got {time_sampling!r}"
            )
        if not (math.isfinite(time_mean) and math.isfinite(time_std) and time_std > 0):
            raise ConfigError(f"objective.time_mean must be finite and time_std > 0, got {time_mean}, {time_std}")
        self.path, self.convention = path, convention
        if isinstance(cosine_loss, bool) or not (math.isfinite(cosine_loss) and cosine_loss >= 0):
            raise ConfigError(
                f"objective.cosine_loss must be a finite weight >= 0 (LightningDiT's 1), got {cosine_loss}"
            )
        if prediction not in PREDICTIONS:
            raise ConfigError(f"objective.prediction must be one of {', '.join(PREDICTIONS)}, got {prediction!r}")
        self.time_sampling, self.time_mean, self.time_std = time_sampling, time_mean, time_std
        self.cosine_loss = float(cosine_loss)
        self.prediction = prediction
        self._time, self.sign = CONVENTIONS[convention]

    def record(self) -> dict[str, Any]:
        record = {"name": self.name, "path": self.path, "convention": self.convention}
        record |= {"prediction": self.prediction} if self.prediction != "velocity" else {}
        return record | (self.folded.record() if self.folded.active else {})

    @classmethod
    def from_record(cls, record: dict[str, Any] | None, learn_sigma: bool = False, **training: Any) -> Flow:
        if learn_sigma:
            raise ConfigError(
                "a flow model predicts a velocity of C channels: learn_sigma must be false (a learned variance has "
                "no meaning for flow matching)"
            )
        record = record or {}
        unknown = sorted(set(record) - {"name", "path", "convention", "prediction", *FOLDED_KEYS})
        if unknown:
            raise ConfigError(f"the flow objective record has unknown keys {unknown}")
        path, convention = record.get("path", "linear"), record.get("convention", "moh-dit")
        folded = {k: record[k] for k in FOLDED_KEYS if k in record}
        return cls(path, convention, prediction=record.get("prediction", "velocity"), **folded, **training)

    def out_channels(self, in_channels: int) -> int:
        return in_channels

    def model_config(self) -> dict[str, Any]:
        return {"objective": self.record(), "learn_sigma": False}

    def describe(self) -> str:
        what = "velocity prediction" if self.prediction == "velocity" else "x-prediction (loss on the velocity)"
        folded = f"; {self.folded.describe()}" if self.folded.active else ""
        return f"flow matching, {self.path} path, {what} ({self.convention} convention){folded}"

    def describe_loss(self) -> str:
        direction = f" + {self.cosine_loss:g} x velocity direction (1 - cosine)" if self.cosine_loss else ""
        return f"velocity MSE{direction} on the {self.path} path, times drawn {self.time_sampling}"

    # ------------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------------
    def draw_time(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` training times ``s`` in [0, 1), drawn on the CPU from ``generator``."""
        if self.time_sampling == "uniform":
            return torch.rand(n, generator=generator)
        normal = self.time_mean + self.time_std * torch.randn(n, generator=generator)
        if self.time_sampling == "logit-normal" or self.path == "linear":
            return torch.sigmoid(normal)  # sigma / (1 + sigma) with sigma = exp(normal)
        return 2 / math.pi * torch.atan(torch.exp(normal))

    def noised(self, x0: torch.Tensor, generator: torch.Generator, device: torch.device) -> Noised:
        """A time per sample (:meth:`draw_time`), then Gaussian noise, from ``generator``."""
        s = self.draw_time(x0.shape[0], generator).to(device)
        return self.interpolate(x0, s, torch.randn(x0.shape, generator=generator).to(device))

    def interpolate(self, x0: torch.Tensor, s: torch.Tensor, noise: torch.Tensor) -> Noised:
        """``x_s`` between the clean ``x0`` and ``noise`` at times ``s`` (N,), its velocity (the target), and the
        network's time input."""
        a, b, da, db = (c.reshape(-1, *([1] * (x0.ndim - 1))) for c in path_coefficients(s, self.path))
        return Noised(a * x0 + b * noise, self.model_time(s), {"velocity": da * x0 + db * noise, "s": s})

    def random_model_times(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return self.model_time(torch.rand(n, generator=generator))

    def model_time(self, s: torch.Tensor) -> torch.Tensor:
        """The network's time input at flow time ``s`` (the convention's)."""
        return self._time(s)

    def velocity_of(self, output: torch.Tensor, x_s: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """The velocity ``dx_s/ds`` the network's ``output`` at ``(x_s, s)`` stands for: the output in the convention's
        sign, or, with x-prediction, ``a' x_hat + b' eps_hat`` where ``eps_hat = (x_s - a x_hat) / b`` (the path solved
        for the noise), i.e. ``(b' x_s - (a b' - a' b) x_hat) / b``, whose divisor is held at
        :data:`X_PREDICTION_MIN_NOISE` or more as JiT holds it (linear path: ``(x_s - x_hat) / max(s, 0.05)``)."""
        if self.prediction == "velocity":
            return self.sign * output
        s = torch.as_tensor(s, device=output.device).to(torch.float32).reshape(-1)
        a, b, da, db = (c.reshape(-1, *([1] * (output.ndim - 1))) for c in path_coefficients(s, self.path))
        v = (db * x_s.float() - (a * db - da * b) * output.float()) / b.clamp_min(X_PREDICTION_MIN_NOISE)
        return v.to(output.dtype)

    def flow_times(self, noised: Noised) -> torch.Tensor:
        return noised.terms["s"]

    def target_prediction(self, output: torch.Tensor, noised: Noised, index: torch.Tensor) -> torch.Tensor:
        return self.velocity_of(output, noised.x_t[index], noised.terms["s"][index])

    def loss(self, output: torch.Tensor, noised: Noised) -> Losses:
        target = noised.terms["velocity"]
        if output.shape != target.shape:
            raise ValueError(f"a flow model outputs {target.shape[1]} channels, got {output.shape[1]}")
        prediction = self.velocity_of(output, noised.x_t, noised.terms["s"])
        mse = ((prediction - target) ** 2).mean(dim=tuple(range(1, output.ndim)))
        if not self.cosine_loss:
            return Losses(loss=mse, mse=mse)
        # LightningDiT's direction term: the cosine over the channels at each position, then the mean over positions
        cos = (1 - F.cosine_similarity(prediction, target, dim=1)).mean(dim=tuple(range(1, output.ndim - 1)))
        return Losses(loss=mse + self.cosine_loss * cos, mse=mse, cos=cos)

    # ------------------------------------------------------------------------------------------------
    # Teaching
    # ------------------------------------------------------------------------------------------------
    @property
    def time_convention(self) -> str:
        return self.convention  # a student keeps the teacher's time input and output sign

    def linear_velocity(self, net, z, t, labels, drop=None) -> torch.Tensor:
        """On the linear path the model's own velocity. On the GVP path the model sees the same signal-to-noise ratio
        at its time ``s`` of the level ``t / (1 - t)`` on the input ``a(s) z / (1 - t)``; its velocity there gives the
        clean image and the noise (the path's two equations solved), whose difference is the linear path's
        velocity."""
        if self.path == "linear":
            return self.velocity_of(net(z, self.model_time(t), labels, force_drop_ids=drop).sample, z, t).float()
        t64 = t.to(torch.float64)
        s = 2 / math.pi * torch.atan(t64 / (1 - t64))
        a, b, da, db = (c.reshape(-1, *([1] * (z.ndim - 1))) for c in path_coefficients(s, self.path))
        zs = z.double() * a / (1 - t64).reshape(a.shape)
        out = net(zs.to(z.dtype), self.model_time(s).to(z.dtype), labels, force_drop_ids=drop).sample
        v = self.velocity_of(out, zs.to(z.dtype), s).double()
        det = a * db - da * b
        x, eps = (db * zs - b * v) / det, (a * v - da * zs) / det
        return (eps - x).float()

    # ------------------------------------------------------------------------------------------------
    # Sampling
    # ------------------------------------------------------------------------------------------------

    def make_scheduler(self, name: str) -> SchedulerMixin:
        """``euler`` (diffusers' flow-matching Euler), ``heun`` (its Heun, on moh-dit's grids), ``dpm-solver`` and
        ``unipc`` (diffusers' multistep solvers in flow mode, 2nd order), ``sde`` (SiT's Euler-Maruyama)."""
        self.check_sampler(name)
        if name == "euler":
            return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
        if name == "heun":
            return FlowHeunScheduler(num_train_timesteps=1000, shift=1.0)
        if name == "sde":
            return FlowSDEScheduler(num_train_timesteps=1000, path=self.path)
        multistep = dict(
            use_flow_sigmas=True,
            prediction_type="flow_prediction",
            flow_shift=1.0,
            final_sigmas_type="zero",
            solver_order=2,
            lower_order_final=True,
        )
        if name == "dpm-solver":
            return DPMSolverMultistepScheduler(**multistep, algorithm_type="dpmsolver++")
        return UniPCMultistepScheduler(**multistep)

    def scheduler_name(self, scheduler: SchedulerMixin) -> str | None:
        if isinstance(scheduler, DPMSolverMultistepScheduler) and scheduler.config.get("use_flow_sigmas"):
            return "dpm-solver" if scheduler.config.algorithm_type == "dpmsolver++" else None
        if isinstance(scheduler, UniPCMultistepScheduler) and scheduler.config.get("use_flow_sigmas"):
            return "unipc"
        kinds = {FlowMatchEulerDiscreteScheduler: "euler", FlowHeunScheduler: "heun", FlowSDEScheduler: "sde"}
        return kinds.get(type(scheduler))

    def set_timesteps(
        self, scheduler: SchedulerMixin, steps: int, time_shift: float, device: torch.device | str | None
    ) -> None:
        """Euler and Heun get the grid ``1, ..., 1/steps`` (then 0), SDE ``1 .. last_step_size`` (then 0), each time
        shifted by ``time_shift``, as explicit sigmas (which also keeps diffusers from shifting twice, diffusers
        #13243). DPM-Solver++ and UniPC keep diffusers' flow grid (from 0.999) with ``flow_shift = time_shift``."""
        name = self.scheduler_name(scheduler)
        if name in LINEAR_ONLY:
            if scheduler.config.flow_shift != time_shift:
                scheduler.register_to_config(flow_shift=float(time_shift))
            scheduler.set_timesteps(steps, device=device)
            return
        if name == "sde":
            grid = torch.linspace(1.0, scheduler.config.last_step_size, steps, dtype=torch.float64)
        else:
            grid = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)[:-1]
        sigmas = shifted(grid, time_shift).to(torch.float32)
        scheduler.set_timesteps(device=device, sigmas=sigmas.tolist())

    def step_time(self, scheduler: SchedulerMixin, index: int, t: torch.Tensor) -> tuple[torch.Tensor, NoiseLevel]:
        # the scheduler's own sigma of this call (diffusers' multistep solvers round their timesteps to integers)
        s = scheduler.sigmas[index].to(torch.float32)
        return self.model_time(s).to(t.device), NoiseLevel(flow_sigma(float(s), self.path))

    def scheduler_input(
        self, output: torch.Tensor, scheduler: SchedulerMixin, in_channels: int, latents: torch.Tensor, index: int
    ) -> torch.Tensor:
        return self.velocity_of(output[:, :in_channels], latents, scheduler.sigmas[index].to(latents.device))
