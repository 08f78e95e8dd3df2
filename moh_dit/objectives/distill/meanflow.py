r"""MeanFlow distilled from a trained model: the average velocity over an interval learned from a *teacher*'s
velocity instead of the data's, so that a model the user trained samples in one or two steps.

The loss is MeanFlow's (:mod:`moh_dit.objectives.meanflow`) with the instantaneous velocity ``v`` of its target and
tangent taken from the teacher, guided as the teacher would be sampled (NVlabs/FastGen's MeanFlow with ``use_cd``):

    v_g = v_T(z_t, t, c) + (w - 1) (v_T(z_t, t, c) - v_T(z_t, t, null))     inside the guided times, else v_T(z_t, t, c)
    u_tgt = sg(v_g - (t - r) du/dt),     du/dt = v_g . grad_z u + partial_t u,     L = sum (u - u_tgt)^2 / sg(L + c)^p

(``v_T``: the teacher's velocity of the linear path at the same signal-to-noise ratio, whatever its objective:
``Objective.linear_velocity``; autoguidance replaces ``v_T(., null)`` by a guide model's conditional velocity). The
guidance is folded into the student, which samples without guidance; samples whose label training drops learn the
teacher's unconditional velocity, so CFG on top stays possible.

``du/dt`` is a Jacobian-vector product (``torch.func.jvp``, as MeanFlow) or a finite difference in float64 along the
teacher's velocity, ``(u(z + eps v_g, t + eps, r) - u(z - eps v_g, t - eps, r)) / 2 eps``, one-sided where ``t - eps``
would reach ``r`` or the lower end, or ``t + eps`` the upper (FastGen's ``use_jvp_finite_diff``); MoH's routing is
held at the primal input's choice for the shifted evaluations (:mod:`moh_dit.model.routing`), so that a flip of a
token's top-k does not enter the difference.

The student's network sees its times as the teacher's did (:data:`TIME_CONVENTIONS`): a flow teacher's convention (a
student that starts from all of a flow teacher's weights reproduces it), a DDPM teacher's timestep of the same noise
level. Its second time input is the interval ``t - r`` through a second timestep embedding (MeanFlow's), or, with
``end_time_blocks`` (Decoupled MeanFlow, Lee et al. 2025, arXiv:2510.24474), the end time ``r`` through the same
embedding, conditioning the last blocks and the final layer: no new parameters.

The teacher (its weights' fingerprint, its objective) and its guidance are recorded with the student, so a student
says what it was distilled from (``describe``, model cards).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from moh_dit.argtypes import is_number, is_whole
from moh_dit.errors import ConfigError
from moh_dit.model.token_routing import rows_of_route
from moh_dit.objectives.base import Losses, Noised
from moh_dit.objectives.distill.derivative import X1000, FiniteDifference, default_fd_eps, finite_difference_times
from moh_dit.objectives.distill.heads import HEADS
from moh_dit.objectives.distill.losses import TangentLoss
from moh_dit.objectives.distill.methods import DEFAULT_METHOD, method_entry
from moh_dit.objectives.distill.times import IntervalCoverage, TimeDistribution
from moh_dit.objectives.linear_path import timestep_of_flow_time
from moh_dit.objectives.meanflow import MeanFlow

__all__ = ["MeanFlowDistill", "TIME_CONVENTIONS", "DERIVATIVES", "finite_difference_times"]


def _ddpm_time(t: torch.Tensor) -> torch.Tensor:
    return timestep_of_flow_time(t).to(t.dtype)


# name -> (the network's start time input, the scale of that input per unit of time, output sign): a student keeps its
# teacher's time convention (moh_dit.objectives.flow.CONVENTIONS; DDPM: the DiT timestep of the same noise level). The
# interval t - r goes into MeanFlow's second embedding raw, in [0, 1], whatever the convention (as MeanFlow's own
# network): scaled by 1000 its sinusoid let the student's derivative in t grow until the distillation diverged
# (docs/objective.md#the-student-and-its-time)
TIME_CONVENTIONS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], float, float]] = {
    "moh-dit": (lambda t: X1000 * t, X1000, 1.0),
    "repa": (lambda t: t, 1.0, 1.0),
    "sit": (lambda t: 1.0 - t, 1.0, -1.0),
    "ddpm": (_ddpm_time, X1000, 1.0),
}
DERIVATIVES = ("jvp", "finite-difference")


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


class MeanFlowDistill(FiniteDifference, MeanFlow):
    """MeanFlow learned from a teacher's (guided) velocity (see the module docstring).

    Args:
        time: the student network's time convention (:data:`TIME_CONVENTIONS`), its teacher's.
        end_time_blocks: Decoupled MeanFlow's split: the last this-many blocks see the end time (0: the interval
            through a second embedding, MeanFlow's).
        teacher: what the student was distilled from (recorded: source, weights' fingerprint, objective).
        guidance: the teacher's guidance folded into the target (recorded: scale, flow times, guide).
        derivative: ``jvp`` or ``finite-difference``; ``fd_eps``: the finite difference's step in time (None:
            :func:`default_fd_eps` of the time convention).
        head: what the network outputs (:data:`HEADS`): the average velocity, or a DDPM teacher's noise;
            ``noise_until``: the latter's last flow time of DDIM's exact parameterization.
        time_sampling, time_mean, time_std, equal_times, adaptive_power, adaptive_eps, jvp_autocast: MeanFlow's
            (:class:`~moh_dit.objectives.meanflow.MeanFlow`).
        method: the distillation method (:data:`moh_dit.objectives.distill.methods.METHODS`; recorded).
        r_time_sampling, r_time_mean, r_time_std, grid_share, grid_steps: the interval coverage
            (:class:`~moh_dit.objectives.distill.times.IntervalCoverage`).
        loss, spatial_invariance, tangent_clamp, tangent_warmup: the loss and its stabilisers
            (:class:`~moh_dit.objectives.distill.losses.TangentLoss`); ``anchor``: the weight of the flow-matching
            anchor on the interval samples.
    """

    name = "distill"
    frozen_models = ("teacher",)  # the teacher beside the student (moh_dit.training.distill.teacher)
    method = DEFAULT_METHOD
    title = "MeanFlow"  # what the student is, in its description

    def __init__(
        self,
        time: str = "moh-dit",
        end_time_blocks: int = 0,
        teacher: dict | None = None,
        guidance: dict | None = None,
        derivative: str = "jvp",
        fd_eps: float | None = None,
        head: str = "velocity",
        noise_until: float = 0.5,
        time_sampling: str = "logit-normal",
        time_mean: float = -0.4,
        time_std: float = 1.0,
        equal_times: float = 0.75,
        adaptive_power: float = 1.0,
        adaptive_eps: float = 0.01,
        jvp_autocast: bool = False,
        method: str | None = None,
        r_time_sampling: str | None = None,
        r_time_mean: float | None = None,
        r_time_std: float | None = None,
        grid_share: float = 0.0,
        grid_steps: tuple[int, ...] | list[int] = (1, 2),
        loss: str = "l2",
        spatial_invariance: bool = False,
        tangent_clamp: float | None = None,
        tangent_warmup: int = 0,
        anchor: float = 0.0,
    ) -> None:
        if method is not None and method != self.method:
            method_entry(method)  # an unknown one names the known
            raise ConfigError(
                f"distill.method={method}: this is a {self.method} student (its weights record it); a {method} student "
                f"is another model: train one with distill.method={method}"
            )
        super().__init__(
            time_sampling=time_sampling,
            time_mean=time_mean,
            time_std=time_std,
            equal_times=equal_times,
            adaptive_power=adaptive_power,
            adaptive_eps=adaptive_eps,
            jvp_autocast=jvp_autocast,
        )
        if time not in TIME_CONVENTIONS:
            raise ConfigError(
                f"a distilled model's time convention must be one of {', '.join(TIME_CONVENTIONS)}, got {time!r}"
            )
        if not is_whole(end_time_blocks) or end_time_blocks < 0:
            raise ConfigError(f"distill.end_time_blocks must be a number of blocks >= 0, got {end_time_blocks!r}")
        if derivative not in DERIVATIVES:
            raise ConfigError(f"distill.derivative must be {' or '.join(DERIVATIVES)}, got {derivative!r}")
        if fd_eps is None and time in TIME_CONVENTIONS:
            fd_eps = default_fd_eps(TIME_CONVENTIONS[time][1])
        if not is_number(fd_eps) or not (0 < fd_eps < 0.5):
            raise ConfigError(
                f"distill.fd_eps must be a step in time between 0 and 0.5 (FastGen's 1e-4), got {fd_eps!r}"
            )
        if head not in HEADS:
            raise ConfigError(f"distill.head must be teacher or one of {', '.join(HEADS)}, got {head!r}")
        if HEADS[head].conventions and time not in HEADS[head].conventions:
            raise ConfigError(
                f"distill.head={head} is the parameterization of a {' or '.join(HEADS[head].conventions)} teacher; "
                f"this student's times are {time!r}: distill.head=velocity"
            )
        if not is_number(noise_until) or not 0 < noise_until < 1:
            raise ConfigError(f"distill.noise_until must be a flow time between 0 and 1 (0.5), got {noise_until!r}")
        options = {"noise_until": float(noise_until)}
        self.head = HEADS[head](**{key: options[key] for key in HEADS[head].options})
        self.time, self.end_time_blocks = time, end_time_blocks
        self.teacher, self.teacher_guidance = dict(teacher or {}), dict(guidance or {})
        self.derivative, self.fd_eps = derivative, float(fd_eps)
        self._start_time, _, self.sign = TIME_CONVENTIONS[time]
        own_t = TimeDistribution(self.time_sampling, self.time_mean, self.time_std)
        r_given = r_time_sampling is not None or r_time_mean is not None or r_time_std is not None
        own_r = (
            TimeDistribution(r_time_sampling or "logit-normal", _or(r_time_mean, -0.4), _or(r_time_std, 1.0))
            if r_given
            else None
        )
        self.coverage = IntervalCoverage(own_t, own_r, self.equal_times, grid_share, tuple(grid_steps))
        self.tangent_loss = TangentLoss(
            loss, self.adaptive_power, self.adaptive_eps, spatial_invariance, tangent_clamp, tangent_warmup
        )
        if not is_number(anchor) or not 0 <= anchor < float("inf"):
            raise ConfigError(f"distill.anchor must be a weight >= 0 (0: no anchor), got {anchor!r}")
        self.anchor = float(anchor)

    # ------------------------------------------------------------------------------------------------
    # What it is
    # ------------------------------------------------------------------------------------------------
    def record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "method": self.method,
            "time": self.time,
            "end_time_blocks": self.end_time_blocks,
            "teacher": self.teacher,
            "guidance": self.teacher_guidance,
        } | self.head.record()

    @classmethod
    def from_record(cls, record: dict[str, Any] | None, learn_sigma: bool = False, **training: Any) -> MeanFlowDistill:
        if learn_sigma:
            raise ConfigError(
                "a distilled MeanFlow model predicts an average velocity of C channels: learn_sigma is false"
            )
        record = dict(record or {})
        keys = ("time", "end_time_blocks", "teacher", "guidance", "head", "noise_until", "method")
        unknown = sorted(set(record) - {"name", *keys})
        if unknown:
            raise ConfigError(f"the distill objective record has unknown keys {unknown}")
        given = {k: record[k] for k in keys if k in record}
        return cls(**given, **training)

    def model_config(self) -> dict[str, Any]:
        return {
            "objective": self.record(),
            "learn_sigma": False,
            "time_inputs": 2,
            "end_time_blocks": self.end_time_blocks,
        }

    @property
    def guided(self) -> bool:
        return False  # no guidance by the network's own predictions: the teacher's is folded in

    def describe(self) -> str:
        source = self.teacher.get("source", "the teacher")  # a student of moh-dit 0.5 recorded the path it was given
        weights = self.teacher.get("sha256")
        scale = self.teacher_guidance.get("scale", 1.0)
        folded = (
            f", its guidance {scale:g} folded in"
            + (
                f" (autoguidance by {self.teacher_guidance['guide']['model']})"
                if self.teacher_guidance.get("guide")
                else ""
            )
            if scale != 1.0
            else ""
        )
        split = f", the last {self.end_time_blocks} blocks on the end time" if self.end_time_blocks else ""
        return f"{self.title} distilled from {source}" + (f" ({weights[:12]})" if weights else "") + folded + split

    def describe_loss(self) -> str:
        how = "a JVP" if self.derivative == "jvp" else f"finite differences (step {self.fd_eps:g}, float64)"
        anchor = f"; a flow-matching anchor of weight {self.anchor:g}" if self.anchor else ""
        return (
            f"{self.tangent_loss.describe()} against the teacher's velocity, du/dt by {how}{anchor}; times: "
            f"{self.coverage.describe()}"
        )

    @property
    def logged_terms(self) -> tuple[str, ...]:
        """The derivative's term ``(t - r) du/dt`` (its root mean square) and the anchor's loss."""
        return ("derivative_rms", *(("anchor_loss",) if self.anchor else ()))

    @property
    def time_convention(self) -> str:
        return self.time

    def network_time(self, t: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The start time in the teacher's convention, and the end time in it (Decoupled MeanFlow's split) or the
        interval ``t - r``, raw (MeanFlow's second embedding)."""
        if self.end_time_blocks:
            return self._start_time(t), self._start_time(r)
        return self._start_time(t), t - r

    def average_velocity(self, net, z, t, r, labels, drop=None, **kwargs: Any):
        """The network's output at ``(z, t, r)`` with ``sample`` the average velocity its head stands for, in the
        flow's sign (:data:`HEADS`)."""
        out = net(self.head.network_input(z, t), self.network_time(t, r), labels, force_drop_ids=drop, **kwargs)
        out.sample = self.head.velocity(out.sample, z, t, self.sign)
        return out

    def network_input(self, scheduler: Any, latents: torch.Tensor, index: int, t: torch.Tensor) -> torch.Tensor:
        return self.head.network_input(latents, self._grid_time(scheduler, index, latents))

    def scheduler_input(
        self, output: torch.Tensor, scheduler: Any, in_channels: int, latents: torch.Tensor, index: int
    ) -> torch.Tensor:
        now = self._grid_time(scheduler, index, latents)
        return self.head.velocity(output[:, :in_channels], latents, now, self.sign).to(latents.dtype)

    @staticmethod
    def _grid_time(scheduler: Any, index: int, latents: torch.Tensor) -> torch.Tensor:
        return scheduler.sigmas[index].to(latents.device, torch.float32).expand(latents.shape[0])

    def training_forwards(self) -> float:
        """The student's passes and the teacher's, counted at the student's size (the logs' FLOPs and MFU)."""
        return self.student_forwards() + self.teacher_forwards()

    def step_forwards(self, step: int, companions: Mapping[str, Any] | None = None) -> float:
        """The student's passes (:meth:`student_forwards`); the teacher's are counted as they happen."""
        return self.student_forwards()

    def student_forwards(self) -> float:
        """The student's passes per image, in forwards: its forward and backward (three), the derivative's (a JVP:
        about one more; finite differences: two, on the interval samples only) and the anchor's forward and backward
        on the interval samples."""
        intervals = 1 - self.equal_times
        derivative = 1.0 if self.derivative == "jvp" else 2.0 * intervals
        return 3.0 + derivative + (3.0 * intervals if self.anchor else 0.0)

    def teacher_forwards(self) -> float:
        """The teacher's forwards per image: two where it is guided, one elsewhere (counted as guided everywhere; the
        logs' ``teacher_evaluations`` count them exactly)."""
        return 2.0 if self.teacher_guidance.get("scale", 1.0) != 1.0 else 1.0

    def teacher_forwards_at(self, step: int) -> float:
        """The teacher's forwards per image at training ``step``: the same at every step (DMD2's differ)."""
        return self.teacher_forwards()

    # ------------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------------
    def draw_times(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``(t, r)`` by the interval coverage (:class:`~moh_dit.objectives.distill.times.IntervalCoverage`)."""
        return self.coverage.draw(n, generator)

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
        """The teacher's guided velocity, the student's ``u`` and ``du/dt`` (a JVP or finite differences, on the bare
        module), then the loss with its stabilisers (:class:`~moh_dit.objectives.distill.losses.TangentLoss` at
        training ``step``: the warm-up) and the anchor. The logs follow the unweighted error against the unclamped
        target."""
        from accelerate.utils import extract_model_from_parallel

        net = extract_model_from_parallel(model, keep_torch_compile=False)
        t, r = noised.terms["t"], noised.terms["r"]
        v_g = self.target_velocity(net, noised, labels, drop, autocast, frozen, step, ema)
        out, dudt = self.velocity_and_derivative(net, noised, v_g, labels, drop, autocast)
        span = (t - r).clamp(0, 1).reshape(-1, *([1] * (dudt.ndim - 1)))
        derivative = (span * dudt).detach()
        loss, _, _ = self.tangent_loss(out.sample, v_g, derivative, step)
        target = (v_g - self.tangent_loss.warm(step) * derivative).detach()
        noised.terms["target"] = target
        mse = ((out.sample.detach() - target).float() ** 2).flatten(1).mean(dim=1)
        extras = {"derivative_rms": derivative.float().flatten(1).pow(2).mean(dim=1).sqrt()}
        if self.anchor:
            anchored = self.anchor_loss(net, noised, v_g, labels, drop, autocast)
            loss, extras["anchor_loss"] = loss + self.anchor * anchored, anchored.detach()
        if want_heads:
            out.head_masks = self.head_masks(net, noised, labels, drop, autocast)
        return Losses(loss=loss, mse=mse, logged=mse, extras=extras), out

    def anchor_loss(self, net, noised: Noised, velocity: torch.Tensor, labels, drop, autocast) -> torch.Tensor:
        """Per sample, the flow-matching anchor of the interval samples (0 elsewhere: ``r = t`` is flow matching
        already): the student's instantaneous velocity ``u(z_t, t, t)`` (one more forward, with gradient) against the
        teacher's, by the same loss without derivative (DMF's and FACM's flow-matching term beside the interval's)."""
        t, r = noised.terms["t"], noised.terms["r"]
        rows = (t > r).nonzero().flatten()
        loss = torch.zeros(t.shape[0], device=t.device, dtype=torch.float32)
        if rows.numel() == 0:
            return loss
        y = labels[rows] if labels is not None else None
        dropped = drop[rows] if drop is not None else None
        precision = autocast() if self.jvp_autocast else torch.autocast(t.device.type, enabled=False)
        with precision, rows_of_route(net, rows):
            u = self.average_velocity(net, noised.x_t[rows], t[rows], t[rows], y, dropped).sample.float()
        anchored, _, _ = self.tangent_loss(u, velocity[rows], torch.zeros_like(u))
        return loss.index_put((rows,), anchored.float())

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
        """The teacher's guided velocity at ``(z_t, t)`` (its unconditional one where the label is dropped)."""
        if not frozen or "teacher" not in frozen:
            raise ConfigError("the distill objective learns from a teacher: name one (distill.teacher)")
        return frozen["teacher"].velocity(noised.x_t, noised.terms["t"], labels, drop, autocast)

    def velocity_and_derivative(self, net, noised, velocity, labels, drop, autocast):
        """A JVP (MeanFlow's), or finite differences (:meth:`finite_difference`)."""
        if self.derivative == "jvp":  # the tangent of z is the velocity itself
            return super().velocity_and_derivative(net, noised, velocity, labels, drop, autocast)
        return self.finite_difference(net, noised, velocity, labels, drop, autocast)
