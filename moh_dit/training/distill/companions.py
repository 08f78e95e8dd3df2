"""Networks trained beside the student (DMD2's fake score and its discriminator head): each with its own optimizer
and learning rate, saved in every checkpoint and restored on resume, never exported with the student.

An objective names the roles it trains beside its student (``trained_models``) and says which network each training
step updates (``updates(step)``); a role is one entry in :data:`COMPANIONS`. A companion runs its passes itself (not
through DDP: the objective calls it several times per step), and the trainer all-reduces its gradients over the
processes before its optimizer steps, as it does for an objective that runs the bare student
(moh_dit/training/gradients.py). docs/objective.md#dmd2.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moh_dit.errors import ConfigError
from moh_dit.model.block_tokens import tokens_after_blocks
from moh_dit.objectives import objective_of
from moh_dit.training.distill.teacher import guided_velocity

if TYPE_CHECKING:
    from moh_dit.training.config_sections import Config
    from moh_dit.training.frozen import FrozenModels

__all__ = ["Companion", "FakeScore", "COMPANIONS", "build_companions"]

logger = logging.getLogger("moh_dit.train")


class DiscriminatorHead(nn.Module):
    """DMD2's small classifier on a network's tokens (N, T, D): normed, a hidden layer, pooled over the tokens, one
    logit per image."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.SiLU())
        self.out = nn.Linear(width, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.net(tokens).mean(dim=1))  # (N, 1)


class FakeScore(nn.Module):
    """DMD2's fake score: a copy of the teacher (its architecture, weights and objective), trained on the generator's
    samples with that objective; with the GAN term a :class:`DiscriminatorHead` on the tokens of one of its blocks.

    Args:
        teacher: the teacher's network (copied).
        gan: whether the discriminator head is on.
        block: the block (from 1) the head reads; ``None``: the middle one.
    """

    def __init__(self, teacher: nn.Module, gan: bool, block: int | None = None) -> None:
        super().__init__()
        self.score = copy.deepcopy(teacher).train().requires_grad_(True)
        self.objective = objective_of(self.score)
        depth = len(self.score.blocks)
        self.block = depth // 2 if block is None else block
        if not 1 <= self.block <= depth:
            raise ConfigError(f"distill.gan_block must be a block from 1 to {depth}, got {block}")
        self.head = DiscriminatorHead(self.score.config.hidden_size) if gan else None

    def _labels(self, labels: torch.Tensor | None, drop: torch.Tensor | None) -> torch.Tensor | None:
        if labels is None or drop is None or self.score.null_class_id is None:
            return labels
        return torch.where(drop.bool(), torch.full_like(labels, self.score.null_class_id), labels)

    @staticmethod
    def _kept(labels: torch.Tensor | None) -> torch.Tensor | None:
        """No label dropped at random: every draw of a step comes from its generator (a resume redraws them)."""
        return None if labels is None else torch.zeros_like(labels)

    def _check_guidance(self, guidance) -> None:
        if guidance is not None and self.score.null_class_id is None:
            raise ConfigError(
                f"distill.fake_guidance: the fake score (a copy of the teacher) was trained without label dropout: it "
                f"has no unconditional prediction to guide with at scale {guidance.scale:g}"
            )

    def velocity(self, z, t, labels, drop, autocast, guidance=None) -> torch.Tensor:
        """Its velocity of the linear path at ``(z, t)``: unguided, or with ``guidance`` (a
        :class:`~moh_dit.training.distill.teacher.TeacherGuidance` without a guide) classifier-free guided over its
        flow times, as the teacher's is (:func:`~moh_dit.training.distill.teacher.guided_velocity`)."""
        if guidance is None:
            y = self._labels(labels, drop)
            with autocast():
                return self.objective.linear_velocity(self.score, z, t, y, self._kept(y)).float()
        self._check_guidance(guidance)

        def network(z, t, y):
            return self.objective.linear_velocity(self.score, z, t, y, self._kept(y))

        with autocast():
            return guided_velocity(network, z, t, labels, drop, self.score.null_class_id, guidance).float()

    @property
    def block_share(self) -> float:
        """The share of the network's depth a discriminator pass runs (its passes stop at the head's block)."""
        return self.block / len(self.score.blocks)

    def discriminate(self, z, t, labels, drop, autocast) -> torch.Tensor:
        """The head's logit (N, 1) on the tokens of block ``block`` at ``(z, t)`` of the linear path; the pass stops
        there (the later blocks cannot change the logit)."""
        y = self._labels(labels, drop)

        def run():
            with autocast():
                self.objective.linear_velocity(self.score, z, t, y, self._kept(y))

        (tokens,) = tokens_after_blocks(self.score, [self.block], run)
        return self.head(tokens.float())

    def train_on(self, x, labels, drop, generator, autocast, real=None, generated=None, guidance=None):
        """Its own objective's losses on the generator's samples ``x`` (drawn from ``generator``), its output (MoH's
        loss), and where real images are given (the GAN term on) the head's logits on them and on the generated ones,
        each ``(noised images, their times)`` as the objective noised them for the discriminator. With ``guidance``
        the loss is its classifier-free-guided prediction's where the samples' flow times are guided (SiD-LSG)."""
        own = self.objective.noised(x, generator, x.device)
        y = self._labels(labels, drop)
        with autocast():
            out = self._output(own, y, guidance)
        losses = self.objective.loss(out.sample.float(), own)
        logits = None
        if self.head is not None and real is not None:
            logits = tuple(self.discriminate(*images, labels, drop, autocast) for images in (real, generated))
        return losses, out, logits

    def _output(self, own, y: torch.Tensor | None, guidance) -> Any:
        """The network's output on the noised samples ``own``; with ``guidance``, where a sample's flow time is guided
        and its label kept, its prediction channels (the learned variance's stay the conditional's, as in sampling)
        guided by its unconditional half, run beside the conditional batch in one forward."""
        rows = None
        if guidance is not None and y is not None:
            self._check_guidance(guidance)
            times, null = self.objective.flow_times(own), self.score.null_class_id
            low, high = guidance.times
            rows = ((times >= low) & (times <= high) & (y != null)).nonzero().flatten()
        if rows is None or rows.numel() == 0:
            return self.score(own.x_t, own.time, y, force_drop_ids=self._kept(y))
        n, channels = own.x_t.shape[0], own.x_t.shape[1]
        both = torch.cat([y, torch.full_like(y[rows], self.score.null_class_id)])
        out = self.score(
            torch.cat([own.x_t, own.x_t[rows]]),
            torch.cat([own.time, own.time[rows]]),
            both,
            force_drop_ids=self._kept(both),
        )
        sample, uncond = out.sample[:n].clone(), out.sample[n:, :channels]
        sample[rows, :channels] = uncond + guidance.scale * (sample[rows, :channels] - uncond)
        out.sample = sample
        return out


@dataclass
class Companion:
    """A network trained beside the student: its module, its optimizer and its learning rate (a factor of the run's
    schedule)."""

    role: str
    module: nn.Module
    optimizer: torch.optim.Optimizer
    lr_scale: float

    def set_trainable(self, trainable: bool) -> None:
        self.module.train(trainable).requires_grad_(trainable)


@dataclass(frozen=True)
class CompanionEntry:
    """One role: ``build(config, frozen, device)`` makes its module and learning rate."""

    build: Callable[[Config, FrozenModels, torch.device], tuple[nn.Module, float]]
    what: str


def _build_fake_score(config: Config, frozen: FrozenModels, device: torch.device) -> tuple[nn.Module, float]:
    section = config.distill
    fake = FakeScore(frozen["teacher"].model, section.gan_weight > 0, section.gan_block).to(device)
    lr = section.fake_lr if section.fake_lr is not None else config.optim.lr
    return fake, lr / config.optim.lr


COMPANIONS: dict[str, CompanionEntry] = {
    "fake_score": CompanionEntry(_build_fake_score, "DMD2's fake score (a copy of the teacher) and its discriminator"),
}


def build_companions(
    config: Config, objective: Any, frozen: FrozenModels, device: torch.device
) -> dict[str, Companion]:
    """The networks ``objective`` trains beside its student, each with an AdamW of the run's settings."""
    built = {}
    for role in getattr(objective, "trained_models", ()):
        if role not in COMPANIONS:
            raise ConfigError(
                f"the {objective.name} objective trains {role!r} beside its student: no entry in COMPANIONS"
            )
        module, scale = COMPANIONS[role].build(config, frozen, device)
        optim = config.optim
        optimizer = torch.optim.AdamW(
            module.parameters(), lr=optim.lr * scale, betas=tuple(optim.betas), eps=optim.eps,
            weight_decay=optim.weight_decay,
        )  # fmt: skip
        built[role] = Companion(role, module, optimizer, scale)
        count = sum(p.numel() for p in module.parameters())
        logger.info(
            "trained beside the student: %s (%s parameters, lr x%g)", COMPANIONS[role].what, f"{count:,}", scale
        )
    return built
