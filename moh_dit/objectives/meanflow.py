r"""MeanFlow (Geng, Deng, Bai, Kolter, He 2025, arXiv:2505.13447): the network learns the *average* velocity over an
interval of flow time, so that one evaluation crosses the whole interval, noise to data in one step.

On the linear path of flow matching (moh-dit's time: ``t = 1`` is noise, ``t = 0`` data)

    z_t = (1 - t) x + t eps,       v = eps - x                  (the instantaneous velocity, as flow matching's)
    u(z_t, r, t) = 1 / (t - r) * integral_r^t v(z_s, s) ds       (the average velocity over [r, t], r <= t)

and differentiating ``(t - r) u = integral`` in ``t`` gives the identity the loss is built on,

    u(z_t, r, t) = v(z_t, t) - (t - r) d/dt u(z_t, r, t),     d/dt u = v . grad_z u + partial_t u

The total derivative is one Jacobian-vector product of the network with the tangent ``(v, 1, 0)`` in ``(z, t, r)``
(``torch.func.jvp``), and the loss regresses the network on the target with the gradient stopped:

    u_tgt = sg(v - clip(t - r, 0, 1) * du/dt),     L = sum over pixels (u_theta - u_tgt)^2,     loss = L / sg(L + c)^p

(the adaptive weight; the paper's ImageNet values p = 1, c = 0.01). ``(t, r)`` are two logit-normal draws (mean -0.4,
std 1), ordered so that ``t >= r``, and a share of the batch (75%) takes ``r = t``: there the target is ``v``, plain
flow matching. The network sees ``t`` and the interval ``t - r`` as raw numbers in [0, 1], each through its own
timestep embedding (``MoHDiT(time_inputs=2)``), as the authors' DiT.

Classifier-free guidance is folded into training: inside the guided times the target velocity is

    v_g = omega v + (1 - omega - kappa) v_uncond + kappa v_cond        (kappa = 0: v_uncond + omega (v - v_uncond))

with ``v_cond``, ``v_uncond`` the network's own instantaneous velocity ``u(z_t, t, t)`` with and without the label
(no gradient), and ``v_g`` replaces ``v`` in the target *and* as the JVP's tangent; samples whose label is dropped keep
``v``. The effective scale is ``omega / (1 - kappa)``; the model then samples without guidance. The guidance is
recorded with the model (``guidance_scale`` = omega, ``guidance_mix`` = kappa, ``guidance_times``), so that sampling
knows.

Sampling: ``z_r = z_t - (t - r) u(z_t, r, t)`` over a grid from 1 to 0 (:class:`MeanFlowScheduler`): one step is one
evaluation.

Faithfulness: the loss matches the authors' PyTorch code (Gsunshine/py-meanflow) on fixed draws, and their JAX code's
guidance and time draws are followed term by term (``tests/objectives/test_meanflow.py``). Two traps of PyTorch: the
JVP cannot run through the fused attention kernels (it runs on the math backend here), and it cannot run through
``DistributedDataParallel`` (it runs on the bare module, and :attr:`runs_bare_module` tells the trainer to average
the gradients itself).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from moh_dit.argtypes import is_number
from moh_dit.errors import ConfigError
from moh_dit.model.token_routing import rows_of_route
from moh_dit.objectives.base import Losses, Noised, NoiseLevel, Objective
from moh_dit.objectives.flow_schedulers import MeanFlowScheduler
from moh_dit.objectives.folded_guidance import FOLDED_KEYS, FoldedGuidance
from moh_dit.objectives.noise import flow_sigma

__all__ = ["MeanFlow", "TIME_SAMPLING"]

TIME_SAMPLING = ("logit-normal", "uniform")


def _weight(value: Any, what: str, low: float = 0.0, high: float = math.inf) -> float:
    if not is_number(value) or not low <= value <= high:
        raise ConfigError(f"{what} must be a number in [{low}, {high}], got {value!r}")
    return float(value)


class MeanFlow(Objective):
    """MeanFlow: average-velocity prediction on the linear path, sampled in one or a few steps (see the module
    docstring).

    Args:
        guidance_scale: omega of the guidance folded into training (1 with ``guidance_mix`` 0: none).
        guidance_mix: kappa, the share of the network's own conditional velocity in the guided target (0 <= kappa < 1).
        guidance_times: ``[first, last]`` flow times where training guides (the authors' ``t_start``, ``t_end``).
        time_sampling: how ``t`` and ``r`` are drawn: ``logit-normal`` (``sigmoid(N(time_mean, time_std))``, the
            paper's) or ``uniform``.
        time_mean, time_std: the normal of logit-normal draws (the paper's ImageNet -0.4, 1.0).
        equal_times: the share of each micro-batch with ``r = t`` (the paper's 0.75; its first samples, as the
            authors' code).
        adaptive_power, adaptive_eps: ``p`` and ``c`` of the adaptive weight ``1 / (L + c)^p`` (the paper's 1, 0.01;
            0 and any ``c``: the plain squared error).
        jvp_autocast: run the JVP in the run's mixed precision (default: in float32, as the authors' PyTorch code;
            the guidance passes always take the run's precision).
        guidance_warmup, guidance_source: the steps before the folded guidance starts, and whose predictions it uses
            (the network's or its EMA's; :class:`~moh_dit.objectives.folded_guidance.FoldedGuidance`).
    """

    name = "meanflow"
    runs_bare_module = True  # torch.func.jvp runs on the bare module

    def __init__(
        self,
        guidance_scale: float = 1.0,
        guidance_mix: float = 0.0,
        guidance_times: tuple[float, float] | list[float] = (0.0, 1.0),
        time_sampling: str = "logit-normal",
        time_mean: float = -0.4,
        time_std: float = 1.0,
        equal_times: float = 0.75,
        adaptive_power: float = 1.0,
        adaptive_eps: float = 0.01,
        jvp_autocast: bool = False,
        guidance_warmup: int | None = None,
        guidance_source: str | None = None,
    ) -> None:
        self.folded = FoldedGuidance.create(
            guidance_scale, guidance_mix, guidance_times, guidance_warmup, guidance_source
        )
        if time_sampling not in TIME_SAMPLING:
            raise ConfigError(
                f"MeanFlow draws its times {' or '.join(TIME_SAMPLING)} (objective.time_sampling), got {time_sampling!r}"
            )
        if not (math.isfinite(time_mean) and math.isfinite(time_std) and time_std > 0):
            raise ConfigError(f"objective.time_mean must be finite and time_std > 0, got {time_mean}, {time_std}")
        self.time_sampling, self.time_mean, self.time_std = time_sampling, float(time_mean), float(time_std)
        self.equal_times = _weight(equal_times, "objective.equal_times (the share with r = t)", 0.0, 1.0)
        self.adaptive_power = _weight(adaptive_power, "objective.adaptive_power")
        self.adaptive_eps = _weight(adaptive_eps, "objective.adaptive_eps")
        if self.adaptive_power > 0 and self.adaptive_eps == 0:
            raise ConfigError("objective.adaptive_eps must be > 0 with adaptive_power > 0 (it keeps 1 / L finite)")
        if not isinstance(jvp_autocast, bool):
            raise ConfigError(f"objective.jvp_autocast must be true or false, got {jvp_autocast!r}")
        self.jvp_autocast = jvp_autocast

    # ------------------------------------------------------------------------------------------------
    # What it is
    # ------------------------------------------------------------------------------------------------
    @property
    def guided(self) -> bool:
        """Whether training guides the target (omega != 1 or kappa > 0)."""
        return self.folded.active

    @property
    def omega(self) -> float:
        return self.folded.omega

    @property
    def kappa(self) -> float:
        return self.folded.kappa

    @property
    def guidance_times(self) -> tuple[float, float]:
        return self.folded.times

    def record(self) -> dict[str, Any]:
        return {"name": self.name, **self.folded.record()}

    @classmethod
    def from_record(cls, record: dict[str, Any] | None, learn_sigma: bool = False, **training: Any) -> MeanFlow:
        if learn_sigma:
            raise ConfigError("a MeanFlow model predicts an average velocity of C channels: learn_sigma must be false")
        record = record or {}
        unknown = sorted(set(record) - {"name", *FOLDED_KEYS})
        if unknown:
            raise ConfigError(f"the meanflow objective record has unknown keys {unknown}")
        given = {k: record[k] for k in FOLDED_KEYS if k in record}
        return cls(**given, **training)

    def out_channels(self, in_channels: int) -> int:
        return in_channels

    def model_config(self) -> dict[str, Any]:
        return {"objective": self.record(), "learn_sigma": False, "time_inputs": 2}

    def describe(self) -> str:
        guidance = (
            f"guided in training (omega {self.omega:g}, kappa {self.kappa:g}: scale {self.omega / (1 - self.kappa):g} "
            f"at t in [{self.guidance_times[0]:g}, {self.guidance_times[1]:g}])"
            if self.guided
            else "unguided in training"
        )
        return f"MeanFlow: average velocity over [r, t] on the linear path, {guidance}"

    def describe_loss(self) -> str:
        weight = (
            f"adaptively weighted (p {self.adaptive_power:g}, c {self.adaptive_eps:g})"
            if self.adaptive_power
            else "unweighted"
        )
        return (
            f"{weight} squared error of the average velocity against its JVP target; r = t for "
            f"{self.equal_times:.0%} of each batch, times drawn {self.time_sampling}"
        )

    # ------------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------------
    def _one_time(self, n: int, generator: torch.Generator) -> torch.Tensor:
        if self.time_sampling == "uniform":
            return torch.rand(n, generator=generator)
        return torch.sigmoid(self.time_mean + self.time_std * torch.randn(n, generator=generator))

    def draw_times(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``(t, r)`` for ``n`` samples, on the CPU from ``generator``: two draws ordered so that ``t >= r``, then
        ``r = t`` for the first ``floor(n * equal_times)`` samples (the authors' JAX code)."""
        a, b = self._one_time(n, generator), self._one_time(n, generator)
        t, r = torch.maximum(a, b), torch.minimum(a, b)
        equal = torch.arange(n) < int(n * self.equal_times)
        return t, torch.where(equal, t, r)

    def noised(self, x0: torch.Tensor, generator: torch.Generator, device: torch.device) -> Noised:
        t, r = self.draw_times(x0.shape[0], generator)
        noise = torch.randn(x0.shape, generator=generator)
        return self.interpolate(x0, t.to(device), r.to(device), noise.to(device))

    def interpolate(self, x0: torch.Tensor, t: torch.Tensor, r: torch.Tensor, noise: torch.Tensor) -> Noised:
        """``z_t`` between the clean ``x0`` and ``noise`` at times ``t`` (N,), the network's time inputs (see
        :meth:`network_time`) and the instantaneous velocity ``eps - x``."""
        tt = t.reshape(-1, *([1] * (x0.ndim - 1)))
        terms = {"velocity": noise - x0, "t": t, "r": r}
        return Noised((1 - tt) * x0 + tt * noise, self.network_time(t, r), terms)

    def network_time(self, t: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The network's two time inputs for the interval from ``t`` back to ``r``: the time and the interval ``t - r``
        as raw numbers (the authors' DiT)."""
        return t, t - r

    def random_model_times(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return self.network_time(*self.draw_times(n, generator))

    @property
    def time_convention(self) -> str:
        return "repa"  # raw flow time, the velocity as output (REPA's flow convention)

    def linear_velocity(self, net, z, t, labels, drop=None) -> torch.Tensor:
        """The instantaneous velocity ``u(z, t, t)``: the average over an empty interval."""
        return self.average_velocity(net, z, t, t, labels, drop).sample.float()

    def average_velocity(self, net, z, t, r, labels, drop=None, **kwargs: Any):
        """The network's output at ``(z, t, r)`` (a :class:`~moh_dit.model.network.MoHDiTOutput`) with ``sample`` the
        average velocity ``u``: here the output itself; a distilled student's may be a parameterization of it."""
        return net(z, self.network_time(t, r), labels, force_drop_ids=drop, **kwargs)

    def loss(self, output: torch.Tensor, noised: Noised) -> Losses:
        """The adaptively weighted loss of the average velocity ``output`` against ``noised.terms["target"]`` (set
        by :meth:`forward_losses`: the JVP's target needs the network). ``mse``, the squared error per pixel, is
        what the logs follow."""
        target = noised.terms["target"]
        if output.shape != target.shape:
            raise ValueError(f"a MeanFlow model outputs {target.shape[1]} channels, got {output.shape[1]}")
        error = ((output - target) ** 2).flatten(1)
        total = error.sum(dim=1)  # the authors' L: a sum over pixels
        weighted = total / (total.detach() + self.adaptive_eps) ** self.adaptive_power
        mse = error.mean(dim=1)
        return Losses(loss=weighted, mse=mse, logged=mse)

    def guided_velocity(
        self,
        net: torch.nn.Module,
        noised: Noised,
        labels: torch.Tensor | None,
        drop: torch.Tensor | None,
        autocast: Callable[[], AbstractContextManager],
        step: int | None = None,
        ema: torch.nn.Module | None = None,
    ) -> torch.Tensor:
        """The target velocity ``v_g`` (no gradient): ``v`` where training does not guide (outside the guided times,
        dropped labels, an unconditional model, the warm-up), else the authors' mix of ``v`` and the network's own (or
        its EMA's) conditional and unconditional instantaneous velocities ``u(z_t, t, t)``, in one batched forward over
        the guided samples only (:class:`~moh_dit.objectives.folded_guidance.FoldedGuidance`)."""
        v, t = noised.terms["velocity"], noised.terms["t"]
        if labels is None or not self.guided:
            return v
        source = ema if self.folded.source == "ema" and ema is not None else net

        def predict(index: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with autocast(), rows_of_route(source, index):  # a routed run (TREAD) routes these rows as their batch
                time = self.network_time(t[index], t[index])  # u(z, t, t): the instantaneous velocity
                return source(noised.x_t[index], time, y, force_drop_ids=torch.zeros_like(y)).sample

        return self.folded.fold(v, self.folded.rows(t, drop, step), labels, source.null_class_id, predict)

    def forward_losses(
        self,
        model: torch.nn.Module,
        noised: Noised,
        labels: torch.Tensor | None,
        drop: torch.Tensor | None,
        want_heads: bool,
        autocast: Callable[[], AbstractContextManager],
        frozen: Mapping[str, Any] | None = None,
        step: int | None = None,
        ema: torch.nn.Module | None = None,
    ) -> tuple[Losses, Any]:
        """The guided target velocity, then ``u`` and ``du/dt`` in one ``torch.func.jvp`` (tangent ``(v_g, 1, 0)`` in
        ``(z, t, r)``) on the bare module, on the math attention backend; the target, and the loss of ``u``. The MoH
        and REPA terms come from the JVP's primal pass (counted once); head masks, when wanted, from one more
        forward without gradient."""
        from accelerate.utils import extract_model_from_parallel

        net = extract_model_from_parallel(model, keep_torch_compile=False)
        t, r = noised.terms["t"], noised.terms["r"]
        v_g = self.target_velocity(net, noised, labels, drop, autocast, frozen, step, ema)
        out, dudt = self.velocity_and_derivative(net, noised, v_g, labels, drop, autocast)
        span = (t - r).clamp(0, 1).reshape(-1, *([1] * (dudt.ndim - 1)))
        noised.terms["target"] = (v_g - span * dudt).detach()
        if want_heads:
            out.head_masks = self.head_masks(net, noised, labels, drop, autocast)
        return self.loss(out.sample, noised), out

    @torch.no_grad()
    def head_masks(self, net, noised: Noised, labels, drop, autocast) -> Any:
        """Each layer's head masks at ``noised`` (one more forward, without gradient: the JVP returns none)."""
        with autocast():
            t, r = noised.terms["t"], noised.terms["r"]
            return self.average_velocity(net, noised.x_t, t, r, labels, drop, return_head_masks=True).head_masks

    def target_velocity(
        self,
        net: torch.nn.Module,
        noised: Noised,
        labels: torch.Tensor | None,
        drop: torch.Tensor | None,
        autocast: Callable[[], AbstractContextManager],
        frozen: Mapping[str, Any] | None = None,
        step: int | None = None,
        ema: torch.nn.Module | None = None,
    ) -> torch.Tensor:
        """The instantaneous velocity the target is built from, and the JVP's tangent: the data's, guided by the
        network's own predictions (:meth:`guided_velocity`; ``step``, ``ema``: its warm-up and source)."""
        return self.guided_velocity(net, noised, labels, drop, autocast, step, ema)

    def velocity_and_derivative(
        self,
        net: torch.nn.Module,
        noised: Noised,
        velocity: torch.Tensor,
        labels: torch.Tensor | None,
        drop: torch.Tensor | None,
        autocast: Callable[[], AbstractContextManager],
    ) -> tuple[Any, torch.Tensor]:
        """The network's output at ``(z_t, t, r)`` (a :class:`~moh_dit.model.network.MoHDiTOutput`, with gradient) and
        ``du/dt`` along ``velocity``, in one ``torch.func.jvp`` (tangent ``(velocity, 1, 0)`` in ``(z, t, r)``) on the
        math attention backend, in float32 unless ``jvp_autocast``. The MoH and REPA terms come from the primal pass
        (counted once)."""
        from moh_dit.model.network import MoHDiTOutput

        t, r = noised.terms["t"], noised.terms["r"]
        aligned = net.projectors is not None and net.training

        def average_velocity(z: torch.Tensor, t: torch.Tensor, r: torch.Tensor):
            out = self.average_velocity(net, z, t, r, labels, drop)
            return (out.sample, out.aux_loss, *(out.aligned if aligned else ()))

        precision = autocast() if self.jvp_autocast else torch.autocast(noised.x_t.device.type, enabled=False)
        with sdpa_kernel(SDPBackend.MATH), precision:  # forward-mode AD has no fused attention kernel
            primal, tangent = torch.func.jvp(
                average_velocity, (noised.x_t, t, r), (velocity, torch.ones_like(t), torch.zeros_like(r))
            )
        u, dudt = primal[0].to(noised.x_t.dtype), tangent[0].to(noised.x_t.dtype)  # float32 from mixed precision
        return MoHDiTOutput(sample=u, aux_loss=primal[1], aligned=tuple(primal[2:]) or None), dudt

    def training_forwards(self) -> float:
        """A forward with its JVP (about two forwards: the tangent pass costs what the primal does), the backward of
        the primal (two), and the guidance passes on the guided samples (two with kappa, one without, none
        unguided; counted for every sample, an upper bound outside the guided times)."""
        return 4.0 + self.folded.forwards

    # ------------------------------------------------------------------------------------------------
    # Sampling
    # ------------------------------------------------------------------------------------------------
    def make_scheduler(self, name: str) -> MeanFlowScheduler:
        """``meanflow``: one average-velocity step per interval of the grid."""
        self.check_sampler(name)
        return MeanFlowScheduler(num_train_timesteps=1000)

    def scheduler_name(self, scheduler: Any) -> str | None:
        return "meanflow" if isinstance(scheduler, MeanFlowScheduler) else None

    def set_timesteps(
        self, scheduler: MeanFlowScheduler, steps: int, time_shift: float, device: torch.device | str | None
    ) -> None:
        """The grid ``1, 1 - 1/steps, ..., 1/steps`` (then 0), shifted by ``time_shift`` as the flow samplers' (a
        shift > 1 puts the intermediate times nearer the noise)."""
        from moh_dit.objectives.flow import shifted

        grid = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)[:-1]
        scheduler.set_timesteps(device=device, sigmas=shifted(grid, time_shift).to(torch.float32).tolist())

    def step_time(
        self, scheduler: MeanFlowScheduler, index: int, t: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], NoiseLevel]:
        now, to = scheduler.sigmas[index].float().to(t.device), scheduler.sigmas[index + 1].float().to(t.device)
        return self.network_time(now, to), NoiseLevel(flow_sigma(float(now)))

    def scheduler_input(
        self, output: torch.Tensor, scheduler: Any, in_channels: int, latents: torch.Tensor, index: int
    ) -> torch.Tensor:
        return output[:, :in_channels]
