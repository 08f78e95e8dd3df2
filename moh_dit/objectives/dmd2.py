r"""Distribution matching distillation, DMD2 (Yin et al. 2024, arXiv:2405.14867; NVlabs/FastGen's
``methods/distribution_matching/dmd2.py``): a one-step generator trained to match the teacher's *distribution*,
not its trajectories (``distill.method: dmd2``; docs/objective.md#dmd2).

Three networks: the generator (the student, from the teacher's weights: ``x = z_t - t u(z_t, t, 0)``, the data it
predicts from ``z_t`` at a grid time ``t``, 1 for one step), the real score (the frozen teacher, its guidance folded
in) and the fake score (a copy of the teacher trained, with the teacher's own objective, on the generator's samples:
moh_dit/training/companions.py). Each training step updates one of the two trained networks; of every
``fake_updates + 1`` steps the first updates the generator, the others the fake score (two time-scales):

    generator   x_t = (1 - t) x + t eps at a flow time t drawn per sample (no gradient through t or eps);
                loss = VSD(x; x0_real(x_t, t), x0_fake(x_t, t))  [moh_dit/objectives/dmd_losses.py]
                       + gan_weight * softplus(-D(features of the fake score at x_t))
                       + regression * |x(noise of a teacher trajectory) - its end|^2     (DMD's regression, optional)
    fake score  the teacher's objective on the generator's samples (no gradient to the generator)
                + the discriminator head's softplus(D(fake)) + softplus(-D(real data noised)) (with the GAN term)

``x0_real`` is the teacher's clean prediction from its guided velocity, ``x0 = x_t - t v``; ``x0_fake`` the fake
score's. Multi-step generators (``distill.dmd_steps``) train at every start time of their grids, their input there
the data noised to it (FastGen's) or the generator's own sample from the step before (``distill.dmd_input:
generator``, DMD2's backward simulation); they sample by predicting the data at each grid time and noising it
afresh to the next (:class:`~moh_dit.objectives.flow_schedulers.MeanFlowScheduler` with ``renoise``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from moh_dit.errors import ConfigError
from moh_dit.objectives.base import Losses, Noised, NoiseLevel
from moh_dit.objectives.distill import MeanFlowDistill
from moh_dit.objectives.distill_times import sampler_intervals
from moh_dit.objectives.dmd_losses import gan_discriminator_loss, gan_generator_loss, vsd_loss
from moh_dit.objectives.flow_schedulers import MeanFlowScheduler
from moh_dit.objectives.noise import flow_sigma

__all__ = ["DMD2Distill", "DMD_INPUTS"]

DMD_INPUTS = ("data", "generator")  # a multi-step generator's input at a grid time


class DMD2Distill(MeanFlowDistill):
    """DMD2 (see the module docstring).

    Args:
        fake_updates: fake-score updates per generator update (FastGen's ``student_update_freq`` less one: 4).
        fake_lr: the fake score's (and discriminator's) learning rate; ``None``: the run's ``optim.lr``.
        gan_weight: the GAN term's weight in the generator's loss (FastGen's 1e-3; 0: no discriminator).
        gan_block: the fake score's block (from 1) whose tokens the discriminator head reads; ``None``: the middle.
        regression: the weight of DMD's regression on the teacher's trajectories (0: none).
        dmd_steps: the step counts of the grids the generator trains at (``[1]``: one step).
        dmd_input: a multi-step generator's input at a grid time: ``data`` noised, or its own ``generator`` sample.
        dmd_time: ``[first, last]`` flow times the VSD loss noises the generator's samples at (uniform).
        trajectories, trajectory_*: the regression's trajectories (as the trajectory method's).
    """

    method = "dmd2"
    title = "A DMD2 generator"
    trained_models = ("fake_score",)  # trained beside the student (moh_dit.training.companions)

    def __init__(
        self,
        fake_updates: int = 4,
        fake_lr: float | None = None,
        gan_weight: float = 0.0,
        gan_block: int | None = None,
        regression: float = 0.0,
        dmd_steps: tuple[int, ...] | list[int] = (1,),
        dmd_input: str = "data",
        dmd_time: tuple[float, float] | list[float] = (0.02, 0.98),
        trajectories: str | None = None,
        trajectory_count: int = 2048,
        trajectory_sampler: str | None = None,
        trajectory_steps: int | None = None,
        trajectory_shard_size: int = 256,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        if isinstance(fake_updates, bool) or not isinstance(fake_updates, int) or fake_updates < 1:
            raise ConfigError(f"distill.fake_updates must be a count >= 1 (FastGen's 4), got {fake_updates!r}")
        for key, value in (("gan_weight", gan_weight), ("regression", regression)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ConfigError(f"distill.{key} must be a weight >= 0, got {value!r}")
        if fake_lr is not None and not (isinstance(fake_lr, (int, float)) and fake_lr > 0):
            raise ConfigError(f"distill.fake_lr must be a learning rate > 0 or null, got {fake_lr!r}")
        steps = tuple(dmd_steps)
        if not steps or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in steps):
            raise ConfigError(f"distill.dmd_steps must be step counts >= 1, e.g. [1], got {list(steps)!r}")
        if dmd_input not in DMD_INPUTS:
            raise ConfigError(f"distill.dmd_input must be {' or '.join(DMD_INPUTS)}, got {dmd_input!r}")
        low, high = (float(v) for v in dmd_time)
        if not 0 < low < high <= 1:
            raise ConfigError(f"distill.dmd_time must be [first, last] flow times in (0, 1], got {list(dmd_time)!r}")
        self.fake_updates, self.fake_lr, self.gan_block = fake_updates, fake_lr, gan_block
        self.gan_weight, self.regression = float(gan_weight), float(regression)
        self.dmd_steps, self.dmd_input, self.dmd_time = steps, dmd_input, (low, high)
        # every start time of the grids the generator samples with (1 first)
        self.start_times = sorted({start for start, _ in sampler_intervals(steps)}, reverse=True)

    @classmethod
    def frozen_models_for(cls, options: Mapping[str, Any]) -> tuple[str, ...]:
        """The teacher, and its trajectories when the regression term is on."""
        return cls.frozen_models + (("trajectories",) if options.get("regression") else ())

    # ------------------------------------------------------------------------------------------------
    # What it is
    # ------------------------------------------------------------------------------------------------
    def describe_loss(self) -> str:
        parts = [f"VSD of the teacher's and a fake score's clean predictions at flow times {self.dmd_time}"]
        if self.gan_weight:
            parts.append(f"a GAN term of weight {self.gan_weight:g} on the fake score's features")
        if self.regression:
            parts.append(f"DMD's regression on the teacher's trajectories, weight {self.regression:g}")
        steps = "/".join(map(str, self.dmd_steps))
        return f"{' + '.join(parts)}; {self.fake_updates} fake-score updates per generator update; {steps}-step grids"

    @property
    def logged_terms(self) -> tuple[str, ...]:
        """The generator's VSD loss and the fake score's loss (each averaged over all steps, the others' zero), the GAN
        terms and the regression where they are on."""
        gan = ("gan_generator", "gan_discriminator") if self.gan_weight else ()
        return ("vsd_loss", "fake_score_loss", *gan, *(("regression",) if self.regression else ()))

    def updates(self, step: int) -> str:
        """Which network training ``step`` updates: the student first, then the fake score ``fake_updates`` times."""
        return "student" if step % (self.fake_updates + 1) == 0 else "fake_score"

    def student_forwards(self) -> float:
        """Per image, averaged over the steps: the generator's forward (and backward on its steps), the fake score's
        forward (its backward on its steps) and, with the GAN term, the features of the real images."""
        share = 1 / (self.fake_updates + 1)
        gan = (1.0 - share) * 3.0 if self.gan_weight else 0.0
        return 1.0 + 2.0 * share + 1.0 + 2.0 * (1 - share) + gan

    def teacher_forwards(self) -> float:
        """The teacher's (guided) forwards on the generator's steps."""
        return super().teacher_forwards() / (self.fake_updates + 1)

    # ------------------------------------------------------------------------------------------------
    # Sampling: the data predicted at each grid time, noised afresh to the next
    # ------------------------------------------------------------------------------------------------
    def make_scheduler(self, name: str) -> MeanFlowScheduler:
        self.check_sampler(name)
        return MeanFlowScheduler(num_train_timesteps=1000, renoise=True)

    def step_time(self, scheduler: MeanFlowScheduler, index: int, t: torch.Tensor):
        now = scheduler.sigmas[index].float().to(t.device)
        return self.network_time(now, torch.zeros_like(now)), NoiseLevel(flow_sigma(float(now)))

    # ------------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------------
    def noised(self, x0: torch.Tensor, generator: torch.Generator, device: torch.device) -> Noised:
        """The step's draws, on the CPU from ``generator``: the generator's start time (a grid time) and noise, the VSD
        loss's time and noise, the real images' for the discriminator, and a seed for the fake score's own draws."""
        n = x0.shape[0]
        starts = torch.tensor(self.start_times)
        start = starts[torch.randint(len(starts), (n,), generator=generator)]
        low, high = self.dmd_time
        terms = {
            "start": start,
            "start_noise": torch.randn(x0.shape, generator=generator),
            "t": low + (high - low) * torch.rand(n, generator=generator),
            "noise": torch.randn(x0.shape, generator=generator),
            "real_t": low + (high - low) * torch.rand(n, generator=generator),
            "real_noise": torch.randn(x0.shape, generator=generator),
            "pick": torch.rand(n, generator=generator),
            "fake_seed": torch.randint(2**62, (1,), generator=generator),
        }
        terms = {k: v.to(device) for k, v in terms.items()} | {"real": x0}
        return Noised(x0, self.network_time(terms["start"], torch.zeros_like(terms["start"])), terms)

    def generate(self, net, noised: Noised, labels: torch.Tensor | None, drop, autocast, **kwargs: Any):
        """The generator's samples ``x`` from its inputs at the drawn start times (pure noise at 1), and its output
        (MoH's loss, head masks). A start time below 1 sees the data noised to it, or the generator's own sample from
        the grid time before (without gradient), noised to it."""
        terms = noised.terms
        start, noise = terms["start"], terms["start_noise"]
        source = terms["real"]
        if self.dmd_input == "generator" and bool((start < 1).any()):
            source = self.backward_simulation(net, noise, start, labels, drop, autocast)
        shape = (-1, *([1] * (noise.ndim - 1)))
        z = (1 - start).reshape(shape) * source + start.reshape(shape) * noise
        with autocast():
            out = self.average_velocity(net, z, start, torch.zeros_like(start), labels, drop, **kwargs)
        return z - start.reshape(shape) * out.sample.float(), out

    @torch.no_grad()
    def backward_simulation(self, net, noise, start, labels, drop, autocast) -> torch.Tensor:
        """For each sample, the generator's own prediction of the data at the grid time before its start (from pure
        noise down the grid, renoising with ``noise`` on the way)."""
        shape = (-1, *([1] * (noise.ndim - 1)))
        z, x = noise, torch.zeros_like(noise)
        for previous in self.start_times:  # 1, then lower: a sample stops where the next time is its start
            now = torch.full_like(start, previous)
            with autocast():
                u = self.average_velocity(net, z, now, torch.zeros_like(now), labels, drop).sample.float()
                x_now = z - previous * u
            x = torch.where((start < previous).reshape(shape), x_now, x)
            z = (1 - start).reshape(shape) * x_now + start.reshape(shape) * noise
        return x

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
        companions: Mapping[str, Any] | None = None,
    ) -> tuple[Losses, Any]:
        """The generator's losses on its steps, the fake score's on the others (:meth:`updates`); the output returned
        is the trained network's (its MoH loss is the step's)."""
        from accelerate.utils import extract_model_from_parallel

        if not frozen or "teacher" not in frozen or not companions or "fake_score" not in companions:
            raise ConfigError("DMD2 learns from a teacher beside a fake score (distill.teacher, distill.method=dmd2)")
        net = extract_model_from_parallel(model, keep_torch_compile=False)  # several passes: the trainer averages
        if self.updates(step or 0) == "student":
            return self._generator_losses(net, noised, labels, drop, want_heads, autocast, frozen, companions)
        return self._fake_score_losses(net, noised, labels, drop, autocast, companions["fake_score"])

    def _noised_sample(self, x: torch.Tensor, noised: Noised, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        t, noise = noised.terms[f"{prefix}t"], noised.terms[f"{prefix}noise"]
        shape = (-1, *([1] * (x.ndim - 1)))
        return (1 - t).reshape(shape) * x + t.reshape(shape) * noise, t

    def _generator_losses(self, model, noised, labels, drop, want_heads, autocast, frozen, companions):
        fake = companions["fake_score"]
        x, out = self.generate(model, noised, labels, drop, autocast, return_head_masks=want_heads)
        x_t, t = self._noised_sample(x, noised)
        shape = (-1, *([1] * (x.ndim - 1)))
        with torch.no_grad():
            real_x0 = x_t - t.reshape(shape) * frozen["teacher"].velocity(x_t, t, labels, drop, autocast).float()
            fake_x0 = x_t - t.reshape(shape) * fake.velocity(x_t, t, labels, drop, autocast).float()
        vsd = vsd_loss(x, real_x0, fake_x0)
        loss, zero = vsd, torch.zeros_like(vsd)
        extras = {"vsd_loss": vsd.detach(), "fake_score_loss": zero}
        if self.gan_weight:
            logits = fake.discriminate(x_t, t, labels, drop, autocast)  # gradient to x through the frozen score
            extras |= {"gan_generator": gan_generator_loss(logits).detach(), "gan_discriminator": zero}
            loss = loss + self.gan_weight * gan_generator_loss(logits)
        if self.regression:
            regressed = self._regression(model, noised, autocast, frozen["trajectories"])
            extras["regression"] = regressed.detach()
            loss = loss + self.regression * regressed
        return Losses(loss=loss, mse=vsd.detach(), logged=vsd.detach(), extras=extras), out

    def _regression(self, model, noised: Noised, autocast, trajectories) -> torch.Tensor:
        """DMD's regression: the one-step sample of a teacher trajectory's noise against the trajectory's end."""
        n = noised.terms["pick"].shape[0]
        last = torch.full((n,), len(trajectories.grid) - 1, device=noised.x_t.device)
        first = torch.zeros_like(last)
        noise, end, y = trajectories.pairs(noised.terms, first, last, noised.x_t.device)
        one = torch.ones(n, device=noise.device)
        with autocast():
            u = self.average_velocity(model, noise, one, torch.zeros_like(one), y, torch.zeros_like(y)).sample.float()
        return ((noise - u - end) ** 2).flatten(1).mean(dim=1)

    def _fake_score_losses(self, model, noised, labels, drop, autocast, fake):
        with torch.no_grad():
            x, _ = self.generate(model, noised, labels, drop, autocast)
        generator = torch.Generator().manual_seed(int(noised.terms["fake_seed"]))
        real = None
        if self.gan_weight:
            real, _ = self._noised_sample(noised.terms["real"], noised, "real_")
        losses, out, logits = fake.train_on(x.detach(), labels, drop, generator, autocast, real, noised)
        zero = torch.zeros_like(losses.loss)
        extras = {"vsd_loss": zero, "fake_score_loss": losses.loss.detach()}
        loss = losses.loss
        if self.gan_weight:
            real_logits, fake_logits = logits
            disc = gan_discriminator_loss(real_logits, fake_logits)
            extras |= {"gan_generator": zero, "gan_discriminator": disc.detach()}
            loss = loss + disc
        if self.regression:
            extras["regression"] = zero
        return Losses(loss=loss, mse=losses.mse.detach(), logged=losses.loss.detach(), extras=extras), out
