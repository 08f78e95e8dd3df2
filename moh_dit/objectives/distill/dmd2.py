r"""Distribution matching distillation, DMD2 (Yin et al. 2024, arXiv:2405.14867; NVlabs/FastGen's
``methods/distribution_matching/dmd2.py``): a one-step generator trained to match the teacher's *distribution*,
not its trajectories (``distill.method: dmd2``; docs/objective.md#dmd2).

Three networks: the generator (the student, from the teacher's weights: ``x = z_t - t u(z_t, t, 0)``, the data it
predicts from ``z_t`` at a grid time ``t``, 1 for one step), the real score (the frozen teacher, its guidance folded
in) and the fake score (a copy of the teacher trained, with the teacher's own objective, on the generator's samples:
moh_dit/training/distill/companions.py). Each training step updates one of the two trained networks; of every
``fake_updates + 1`` steps the first updates the generator, the others the fake score (two time-scales):

    generator   x_t = (1 - t) x + t eps at a flow time t drawn per sample (no gradient through t or eps);
                loss = VSD(x; x0_real(x_t, t), x0_fake(x_t, t))  [moh_dit/objectives/distill/dmd_losses.py]
                       + gan_weight * softplus(-D(features of the fake score at x_t))
                       + regression * d(x(a teacher trajectory's noise, or its state at x's start), its end)
                                                                                     (DMD's regression, optional)
    fake score  the teacher's objective on the generator's samples (no gradient to the generator)
                + the discriminator head's softplus(D(fake)) + softplus(-D(real data noised)) (with the GAN term)

``x0_real`` is the teacher's clean prediction from its velocity, ``x0 = x_t - t v``, guided at the real score's own
scale (``distill.real_guidance``; DMD2's ImageNet-64 recipe and SiDA use none: guidance there seeks modes), or for the
samples a multi-step generator makes from its grids' later start times at a scale of their own
(``distill.real_guidance_later``: the first step lays out the image, the later ones its detail); ``x0_fake`` the fake
score's. The GAN term (``distill.gan_weight``) reads the fake score's tokens at one block (the passes stop
there) and trains on real images of the run's training split; it can start late (``distill.gan_start``: SiDA's order,
the fake score alone first), and alone (``distill.vsd_weight: 0``: a GAN fine-tune of the teacher's weights, GDD's).

Multi-step generators (``distill.dmd_steps``) train at every start time of their grids, their input there the data
noised to it (FastGen's) or the generator's own sample from the grid's step before (backward simulation, along the
coarsest grid that holds the start time: ``distill.dmd_input: generator`` renoises with the start's own noise,
``generator_fresh`` with noise of its own at every renoising, as DMD2's code and the sampler do); they sample by
predicting the data at each grid time and noising it afresh to the next
(:class:`~moh_dit.objectives.flow_schedulers.MeanFlowScheduler` with ``renoise``). The two-step grid is
``[1, distill.dmd_midpoint, 0]``: every grid is shifted so (SD3's time shift), in training and, recorded with the
model, in sampling.

Each training step updates one network; the logs count the updates of each (``generator_updates``,
``fake_score_updates``) and every pass of the networks trained (:meth:`DMD2Distill.step_forwards`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from moh_dit.argtypes import is_number, is_whole
from moh_dit.errors import ConfigError
from moh_dit.objectives.base import Losses, Noised
from moh_dit.objectives.distill import distances, divergences
from moh_dit.objectives.distill.dmd_costs import DMDCosts
from moh_dit.objectives.distill.dmd_losses import gan_discriminator_loss, gan_generator_loss, vsd_loss
from moh_dit.objectives.distill.fake_guidance import FakeGuidance
from moh_dit.objectives.distill.generator import GridGenerator
from moh_dit.objectives.distill.grids import MIDPOINT
from moh_dit.objectives.distill.meanflow import MeanFlowDistill
from moh_dit.objectives.distill.methods import DMD_IDENTITY
from moh_dit.objectives.distill.real_score import RealScore
from moh_dit.objectives.distill.regression import TrajectoryRegression
from moh_dit.objectives.distill.times import loss_time_ranges, vsd_times
from moh_dit.objectives.linear_path import clean_prediction

__all__ = ["DMD2Distill"]


class DMD2Distill(GridGenerator, TrajectoryRegression, RealScore, FakeGuidance, DMDCosts, MeanFlowDistill):
    """DMD2 (see the module docstring).

    Args:
        fake_updates: fake-score updates per generator update (FastGen's ``student_update_freq`` less one: 4).
        fake_lr: the fake score's (and discriminator's) learning rate; ``None``: the run's ``optim.lr``.
        gan_weight: the GAN term's weight in the generator's loss (FastGen's 1e-3; 0: no discriminator).
        gan_block: the fake score's block (from 1) whose tokens the discriminator head reads; ``None``: the middle.
        regression: the weight of DMD's regression on the teacher's trajectories (0: none).
        regression_distance, regression_feature_time: its distance ``d`` (moh_dit/objectives/distill/distances.py).
        regression_from: where its generator sample starts: the trajectory's ``noise`` (DMD's), or its state at each
            sample's ``start`` time (moh_dit/objectives/distill/regression.py).
        dmd_steps: the step counts of the grids the generator trains at (``[1]``: one step); ``None``: ``[1]``, as a
            generator rebuilt from its record for sampling has them (it records its grids' middle, not its counts).
        dmd_input: a multi-step generator's input at a grid time: ``data`` noised, its own ``generator`` sample
            (``generator_fresh``: renoised with noise of its own at every step, DMD2's), or the state a frozen
            ``lead`` model's first steps reach there (a hand-off's lead, trained for).
        lead_model: that lead model (a run, checkpoint, pipeline or transformer folder; only with ``dmd_input:
            lead``; loaded as the run's frozen ``lead``, moh_dit/training/distill/lead.py).
        dmd_time: ``[first, last]`` flow times the VSD loss noises the generator's samples at (uniform).
        dmd_time_sampling: how those times are drawn: ``uniform`` in flow time, or ``karras`` (uniform over the index of
            EDM's Karras sigmas between the range's ends, FastGen's and SiD's draw;
            :func:`~moh_dit.objectives.distill.times.vsd_times`).
        real_guidance: the guidance scale of the real score (1: none); ``None``: the teacher's (``distill.guidance_scale``
            or what it records). Recorded with the model: it is part of what the generator learns.
        real_guidance_later: the real score's scale for the samples made from the grids' later start times (the
            two-step grid's middle), ``real_guidance`` staying the first step's; ``None``: ``real_guidance`` for all.
            Recorded with the model.
        dmd_first_share: the share of the generator's samples that start at its grids' first time (pure noise), the
            rest alike over the later start times; ``None``: every start time alike (half each for ``[1, 2]``).
        real_guidance_end, real_guidance_ramp: the scale ``real_guidance`` moves to, linearly over the first
            ``real_guidance_ramp`` training steps, then held (both or neither; ``None``: it stays). Recorded.
        fake_guidance, fake_guidance_eval: the fake score's own guidance scales, trained at and read at (SiD-LSG;
            ``None``: 1, and the first). Recorded (:class:`~moh_dit.objectives.distill.fake_guidance.FakeGuidance`).
        vsd_weight: the VSD loss's weight (0: the GAN term alone, a GAN fine-tune of the teacher's weights).
        gan_start: the training step from which the GAN term and its discriminator train (0: from the start).
        dmd_midpoint: the two-step grid's middle flow time (every grid shifted alike; recorded with the model).
        gan_time: ``[first, last]`` flow times the discriminator and the generator's GAN term noise their images at
            (uniform, drawn apart from the VSD loss's); ``None``: the VSD loss's own times and noised samples.
        vsd_divergence: the divergence VSD follows: ``reverse_kl`` (VSD's own), or ``js``/``forward_kl``, its gap
            weighted by the discriminator's density ratio (moh_dit/objectives/distill/divergences.py).
        trajectories, trajectory_*: the regression's trajectories (as the trajectory method's).
    """

    method = "dmd2"
    title = "A DMD2 generator"
    trained_models = ("fake_score",)  # trained beside the student (moh_dit.training.distill.companions)
    draws_config_times = False  # its start times are its grids', the VSD loss's its own (objective.time_* unread)
    # what the logs call each network's updates: the student is DMD2's generator
    update_names = {"student": "generator_updates", "fake_score": "fake_score_updates"}
    # the generator's distribution-matching loss, by its logged name, and the passes of each score per image on a
    # generator step (1: a forward; a loss that differentiates through the scores adds their backward, two more)
    distribution_term = "vsd_loss"
    score_passes = 1.0

    def __init__(
        self,
        fake_updates: int = 4,
        fake_lr: float | None = None,
        gan_weight: float = 0.0,
        gan_block: int | None = None,
        regression: float = 0.0,
        regression_distance: str = distances.DEFAULT,
        regression_feature_time: float | None = None,
        regression_from: str = "noise",
        dmd_steps: tuple[int, ...] | list[int] | None = None,
        dmd_input: str = "data",
        dmd_time: tuple[float, float] | list[float] = (0.02, 0.98),
        dmd_time_sampling: str = "uniform",
        real_guidance: float | None = None,
        vsd_weight: float = 1.0,
        gan_start: int = 0,
        dmd_midpoint: float = MIDPOINT,
        gan_time: tuple[float, float] | list[float] | None = None,
        real_guidance_later: float | None = None,
        dmd_first_share: float | None = None,
        real_guidance_end: float | None = None,
        real_guidance_ramp: int | None = None,
        fake_guidance: float | None = None,
        fake_guidance_eval: float | None = None,
        lead_model: str | None = None,
        vsd_divergence: str = divergences.DEFAULT,
        trajectories: str | None = None,
        trajectory_count: int = 2048,
        trajectory_sampler: str | None = None,
        trajectory_steps: int | None = None,
        trajectory_shard_size: int = 256,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        if not is_whole(fake_updates) or fake_updates < 1:
            raise ConfigError(f"distill.fake_updates must be a count >= 1 (FastGen's 4), got {fake_updates!r}")
        for key, value in (("gan_weight", gan_weight), ("regression", regression), ("vsd_weight", vsd_weight)):
            if not is_number(value) or not 0 <= value < float("inf"):
                raise ConfigError(f"distill.{key} must be a weight >= 0, got {value!r}")
        if not vsd_weight and not gan_weight:
            raise ConfigError(
                "distill.vsd_weight=0 leaves the generator nothing to learn: a GAN fine-tune needs distill.gan_weight > 0"
            )
        self.set_real_scales(real_guidance, real_guidance_later, real_guidance_end, real_guidance_ramp)
        self.set_fake_scales(fake_guidance, fake_guidance_eval)
        if not is_whole(gan_start) or gan_start < 0:
            raise ConfigError(f"distill.gan_start must be a training step >= 0, got {gan_start!r}")
        if not is_number(dmd_midpoint) or not 0 < dmd_midpoint < 1:
            raise ConfigError(
                f"distill.dmd_midpoint must be a flow time between 0 and 1 (the two-step grid's middle, 0.5), got "
                f"{dmd_midpoint!r}"
            )
        if fake_lr is not None and not (is_number(fake_lr) and fake_lr > 0):
            raise ConfigError(f"distill.fake_lr must be a learning rate > 0 or null, got {fake_lr!r}")
        steps = tuple(dmd_steps) if dmd_steps is not None else (1,)
        if not steps or not all(is_whole(n) and n >= 1 for n in steps):
            raise ConfigError(f"distill.dmd_steps must be step counts >= 1, e.g. [1], got {list(steps)!r}")
        self.dmd_time, self.gan_time = loss_time_ranges(dmd_time, gan_time, dmd_time_sampling)
        self.fake_updates, self.fake_lr, self.gan_block = fake_updates, fake_lr, gan_block
        self.gan_weight = float(gan_weight)
        self.dmd_steps, self.dmd_input, self.dmd_time_sampling = steps, dmd_input, dmd_time_sampling
        self.vsd_weight, self.gan_start, self.dmd_midpoint = float(vsd_weight), gan_start, float(dmd_midpoint)
        self.place_grids(steps, dmd_input, self.dmd_midpoint, dmd_first_share)
        self.set_regression(regression, regression_distance, regression_feature_time, regression_from)
        self.lead_model, self.divergence = lead_model, divergences.vsd_divergence(vsd_divergence, gan_weight, gan_time)
        later = {"real_guidance_later": real_guidance_later, "dmd_first_share": dmd_first_share}
        self.check_later_steps(later, lead_model, dmd_steps is not None)

    @classmethod
    def frozen_models_for(cls, options: Mapping[str, Any]) -> tuple[str, ...]:
        """The teacher, its trajectories when the regression term is on, and the lead model that starts the later grid
        steps' inputs (``dmd_input: lead``)."""
        lead = ("lead",) if options.get("dmd_input") == "lead" else ()
        return cls.frozen_models + (("trajectories",) if options.get("regression") else ()) + lead

    # what the generator is (recorded), beside its teacher's record: the keys a resume may not change (the table's)
    RECORDED = DMD_IDENTITY

    def record(self) -> dict[str, Any]:
        """The distillation's record, with the real score's guidance where it is its own (the later steps' where
        theirs is) and the two-step grid's middle where it is not 0.5 (a generator of moh-dit 0.6 and earlier records
        none of them)."""
        extra = {"real_guidance": self.real_guidance} if self.real_guidance is not None else {}
        if self.real_guidance_later is not None:
            extra["real_guidance_later"] = self.real_guidance_later
        if self.real_guidance_end is not None:
            extra |= {"real_guidance_end": self.real_guidance_end, "real_guidance_ramp": self.real_guidance_ramp}
        if self.dmd_midpoint != MIDPOINT:
            extra["dmd_midpoint"] = self.dmd_midpoint
        return super().record() | extra | self.fake_record()

    @classmethod
    def from_record(cls, record: dict[str, Any] | None, learn_sigma: bool = False, **training: Any) -> DMD2Distill:
        """As the distillation's, with what only a generator records; a record and the training options that disagree
        on it are another generator: a :class:`ConfigError` naming the key and both values."""
        record = dict(record or {})
        for key in cls.RECORDED:
            if key in record:
                recorded = record.pop(key)
                given = training.get(key, recorded)
                if given != recorded:
                    raise ConfigError(
                        f"distill.{key}={given}: this generator was trained with {recorded} (recorded with its weights)"
                    )
                training[key] = recorded
        return super().from_record(record, learn_sigma, **training)

    # ------------------------------------------------------------------------------------------------
    # What it is
    # ------------------------------------------------------------------------------------------------
    def describe(self) -> str:
        return super().describe() + self.describe_real()

    def describe_loss(self) -> str:
        parts = []
        if self.vsd_weight:
            weight = "" if self.vsd_weight == 1 else f"{self.vsd_weight:g} x "
            law = " (Karras sigmas)" if self.dmd_time_sampling == "karras" else ""
            divergence = f", weighted as {self.divergence.describe()}" if self.divergence.needs_ratio else ""
            parts.append(f"{weight}{self.describe_distribution()} at flow times {self.dmd_time}{law}{divergence}")
        if self.gan_weight:
            start = f" from step {self.gan_start}" if self.gan_start else ""
            times = f" at flow times {self.gan_time}" if self.gan_time else ""
            parts.append(
                f"a GAN term of weight {self.gan_weight:g} on the fake score's features, real data{times}{start}"
            )
        if self.regression:
            parts.append(self.describe_regression())
        steps = "/".join(map(str, self.dmd_steps))
        grid = f" (two-step middle {self.dmd_midpoint:g})" if self.dmd_midpoint != MIDPOINT else ""
        if self.first_share is not None and len(self.start_times) > 1:
            grid += (
                f", {self.first_share:g} of the samples from pure noise" if self.first_share else ", none from noise"
            )
        return (
            f"{' + '.join(parts)}; {self.fake_updates} fake-score updates per generator update; {steps}-step "
            f"grids{grid}{self.describe_input()}{self.describe_fake()}"
        )

    def describe_distribution(self) -> str:
        """The generator's distribution-matching loss, in words."""
        return "VSD of the teacher's and a fake score's clean predictions"

    @property
    def logged_terms(self) -> tuple[str, ...]:
        """The generator's distribution-matching loss (VSD) and the fake score's loss (each averaged over all steps,
        the others' zero), the GAN terms and the regression where they are on."""
        gan = ("gan_generator", "gan_discriminator") if self.gan_weight else ()
        return (self.distribution_term, "fake_score_loss", *gan, *(("regression",) if self.regression else ()))

    # ------------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------------
    def noised(self, x0: torch.Tensor, generator: torch.Generator, device: torch.device) -> Noised:
        """The step's draws, on the CPU from ``generator``: the generator's start time (a grid time) and noise, the VSD
        loss's time and noise, the real images' for the discriminator, and a seed for the fake score's own draws."""
        n = x0.shape[0]
        start = self.draw_starts(n, generator)
        low, high = self.dmd_time
        gan_low, gan_high = self.gan_time or self.dmd_time  # the discriminator's times: the same draws, rescaled
        terms = {
            "start": start,
            "start_noise": torch.randn(x0.shape, generator=generator),
            "t": vsd_times(torch.rand(n, generator=generator), low, high, self.dmd_time_sampling),
            "noise": torch.randn(x0.shape, generator=generator),
            "real_t": gan_low + (gan_high - gan_low) * torch.rand(n, generator=generator),
            "real_noise": torch.randn(x0.shape, generator=generator),
            "pick": torch.rand(n, generator=generator),
            "fake_seed": torch.randint(2**62, (1,), generator=generator),
        }
        if self.gan_time:  # the generated images' own times (drawn last: a run without the key draws as before)
            terms["gan_t"] = gan_low + (gan_high - gan_low) * torch.rand(n, generator=generator)
        terms |= self.path_draws(x0.shape, generator)  # last as well: DMD2's own noises along its backward simulation
        terms = {k: v.to(device) for k, v in terms.items()} | {"real": x0}
        return Noised(x0, self.network_time(terms["start"], torch.zeros_like(terms["start"])), terms)

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
            return self._generator_losses(net, noised, labels, drop, want_heads, autocast, frozen, companions, step)
        fake = companions["fake_score"]
        return self._fake_score_losses(net, noised, labels, drop, autocast, fake, step, frozen)

    def _noised_sample(
        self, x: torch.Tensor, noised: Noised, time: str = "t", noise: str = "noise"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` on the linear path at the step's draws named ``time`` and ``noise``, and those times."""
        t, noise = noised.terms[time], noised.terms[noise]
        shape = (-1, *([1] * (x.ndim - 1)))
        return (1 - t).reshape(shape) * x + t.reshape(shape) * noise, t

    def _generator_losses(self, model, noised, labels, drop, want_heads, autocast, frozen, companions, step):
        fake = companions["fake_score"]
        lead = frozen.get("lead")
        x, out = self.generate(model, noised, labels, drop, autocast, lead, return_head_masks=want_heads)
        x_t, t = self._noised_sample(x, noised)
        zero = torch.zeros(x.shape[0], device=x.device)
        vsd, loss, logits = zero, zero, None
        gan_on = self.gan_on(step)
        if gan_on and self.divergence.needs_ratio:  # gradient to x through the frozen score; its value the ratio
            logits = fake.discriminate(*self.gan_input(x, noised), labels, drop, autocast)
        if self.vsd_weight:
            teacher = frozen["teacher"]
            start = noised.terms["start"]
            vsd = self.distribution_loss(x, x_t, t, labels, drop, autocast, teacher, fake, start, step or 0)
            loss = self.vsd_weight * (vsd if logits is None else vsd * self.divergence.weights(logits).to(vsd.dtype))
        extras = {self.distribution_term: vsd.detach(), "fake_score_loss": zero}
        if self.gan_weight:
            gan = zero
            if gan_on:
                if logits is None:
                    logits = fake.discriminate(*self.gan_input(x, noised), labels, drop, autocast)
                gan = gan_generator_loss(logits)
                loss = loss + self.gan_weight * gan
            extras |= {"gan_generator": gan.detach(), "gan_discriminator": zero}
        if self.regression:
            regressed = self.regression_loss(model, noised, autocast, frozen)
            extras["regression"] = regressed.detach()
            loss = loss + self.regression * regressed
        return Losses(loss=loss, mse=vsd.detach(), logged=vsd.detach(), extras=extras), out

    def distribution_loss(self, x, x_t, t, labels, drop, autocast, teacher, fake, start, step=0) -> torch.Tensor:
        """Per sample, the loss that pulls the generator's samples ``x`` (made from grid times ``start``, noised to
        ``x_t`` at flow times ``t``) towards the teacher's distribution at training ``step``: VSD of the real score's
        (:meth:`real_velocity`) and the fake score's clean predictions ``x0 = x_t - t v``, neither differentiated."""
        with torch.no_grad():
            real = self.real_velocity(teacher, x_t, t, labels, drop, autocast, start, step=step)
            real_x0 = clean_prediction(x_t, t, real)
            fake_x0 = clean_prediction(x_t, t, self.fake_velocity(fake, teacher, x_t, t, labels, drop, autocast))
        return vsd_loss(x, real_x0, fake_x0)

    def gan_input(self, x: torch.Tensor, noised: Noised) -> tuple[torch.Tensor, torch.Tensor]:
        """The generated images ``x`` as the discriminator reads them, and their times: the VSD loss's noised sample,
        or with ``gan_time`` the same noise at the step's own draw of that range."""
        return self._noised_sample(x, noised, "gan_t" if "gan_t" in noised.terms else "t")

    def _fake_score_losses(self, model, noised, labels, drop, autocast, fake, step, frozen):
        teacher = frozen["teacher"]
        with torch.no_grad():
            x, _ = self.generate(model, noised, labels, drop, autocast, frozen.get("lead"))
        generator = torch.Generator().manual_seed(int(noised.terms["fake_seed"]))
        gan = self.gan_on(step)
        real = self._noised_sample(noised.terms["real"], noised, "real_t", "real_noise") if gan else None
        generated = self.gan_input(x.detach(), noised) if gan else None
        losses, out, logits = self.train_fake(fake, teacher, x, labels, drop, generator, autocast, real, generated)
        zero = torch.zeros_like(losses.loss)
        extras = {self.distribution_term: zero, "fake_score_loss": losses.loss.detach()}
        loss = losses.loss
        if self.gan_weight:
            disc = zero
            if gan:
                real_logits, fake_logits = logits
                disc = gan_discriminator_loss(real_logits, fake_logits)
                loss = loss + disc
            extras |= {"gan_generator": zero, "gan_discriminator": disc.detach()}
        if self.regression:
            extras["regression"] = zero
        return Losses(loss=loss, mse=losses.mse.detach(), logged=losses.loss.detach(), extras=extras), out
