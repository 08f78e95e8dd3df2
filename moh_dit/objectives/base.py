"""The interface every objective implements: how a training example is noised and scored, what the network
outputs, and how its predictions are sampled (which diffusers schedulers, on which grid, at which noise levels).

The trainer, the pipeline, generation, evaluation and the command line ask the objective; none of them branches on
its name. An objective is recorded with the model (``MoHDiT.config.objective``), so a checkpoint, a pipeline or a
bare transformer folder says how it is sampled.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from moh_dit.errors import ConfigError
from moh_dit.model.token_routing import rows_of_route
from moh_dit.objectives.folded_guidance import FoldedGuidance
from moh_dit.objectives.registry import check_sampler, entry, offered_samplers, resolve_protocol

__all__ = ["Objective", "Noised", "Losses", "NoiseLevel"]


@dataclass
class Noised:
    """One noised micro-batch: the network's input ``x_t`` and its time input ``time`` (a tuple for a network of two
    time inputs: MeanFlow's); ``terms`` hold what the loss needs (the clean input, the noise, the draw of time), by
    the objective's own names."""

    x_t: torch.Tensor
    time: torch.Tensor | tuple[torch.Tensor, ...]
    terms: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Losses:
    """Per-sample loss terms, each of shape (N,): ``loss`` is what is minimised; ``mse`` the objective's squared
    error (noise or velocity); ``vb`` DDPM's variational-bound term where the model learns its variance; ``cos`` the
    velocity-direction term (LightningDiT's) where a flow model trains with it. ``logged`` is what the logs and the
    spike guard follow, where it is not ``loss`` (MeanFlow's adaptively weighted loss stays near 1 whatever the
    error: its logs follow the unweighted error). ``extras`` are more terms the logs follow (the objective's
    ``logged_terms``: a distillation's derivative, its anchor)."""

    loss: torch.Tensor
    mse: torch.Tensor
    vb: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    logged: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # per sample, by Objective.logged_terms' names

    @property
    def followed(self) -> torch.Tensor:
        """What the logs and the spike guard follow (per sample)."""
        return self.loss if self.logged is None else self.logged


@dataclass(frozen=True)
class NoiseLevel:
    """Where a sampler is: ``sigma``, the noise level (noise std over signal std, the same for every objective),
    and ``timestep``, the DDPM training timestep where the sampler walks DiT's schedule (``None`` elsewhere)."""

    sigma: float
    timestep: int | None = None


class Objective(ABC):
    """A training objective and its samplers (see the module docstring). Subclasses set :attr:`name` (their key in
    :data:`moh_dit.objectives.registry.OBJECTIVES`)."""

    name: ClassVar[str]
    # True where the objective runs the bare network, not the trainer's wrapped one (functorch's transforms cannot
    # run through DistributedDataParallel or a compiled module): the trainer then averages the gradients over
    # processes itself, and train.compile does not apply
    runs_bare_module: ClassVar[bool] = False
    # the frozen models beside the student this objective needs, by role (moh_dit.training.frozen.FROZEN_MODELS: a
    # distillation's teacher): training loads and places them and hands them to forward_losses
    frozen_models: ClassVar[tuple[str, ...]] = ()
    # the networks this objective trains beside the student, by role (moh_dit.training.distill.companions.COMPANIONS: DMD2's
    # fake score), each with its own optimizer; ``updates(step)`` says which one a training step updates
    trained_models: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def frozen_models_for(cls, options: Mapping[str, Any]) -> tuple[str, ...]:
        """The frozen roles a run of these options (its config's ``distill`` section) needs: :attr:`frozen_models`."""
        return cls.frozen_models

    def updates(self, step: int) -> str:
        """Which network training ``step`` updates: ``student``, or a role of :attr:`trained_models`."""
        return "student"

    @property
    def logged_terms(self) -> tuple[str, ...]:
        """The names of the terms beside the loss that the logs and ``metrics.jsonl`` follow (``Losses.extras``)."""
        return ()

    # ------------------------------------------------------------------------------------------------
    # What it is, and how a model records it
    # ------------------------------------------------------------------------------------------------
    @abstractmethod
    def record(self) -> dict[str, Any] | None:
        """What the model's config stores (``None`` for DiT's DDPM, so that models of moh-dit 0.3 compare equal)."""

    @classmethod
    @abstractmethod
    def from_record(cls, record: dict[str, Any] | None, **training: Any) -> Objective:
        """The objective of a model's record, with training options where it is trained."""

    @abstractmethod
    def out_channels(self, in_channels: int) -> int:
        """The network's output channels for ``in_channels`` input channels."""

    def model_config(self) -> dict[str, Any]:
        """What the objective sets in a new model's config (its record; a head without a learned variance)."""
        record = self.record()
        return {} if record is None else {"objective": record}

    def describe(self) -> str:
        """What the objective is, in words (model cards, errors)."""
        return entry(self.name).summary

    @property
    def loss_name(self) -> str:
        """The key of the training loss in logs and ``metrics.jsonl`` (``diffusion_loss``, ``flow_loss``, ...)."""
        return entry(self.name).loss_name

    @abstractmethod
    def describe_loss(self) -> str:
        """The training loss in words (model cards)."""

    # ------------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------------
    @abstractmethod
    def noised(self, x0: torch.Tensor, generator: torch.Generator, device: torch.device) -> Noised:
        """Draw the noise and time of a clean micro-batch ``x0`` (from ``generator``, on the CPU, so that a draw is
        the same on any device) and noise it."""

    @abstractmethod
    def random_model_times(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` time inputs of the network, uniform over the noise levels training covers (calibration batches)."""

    @abstractmethod
    def loss(self, output: torch.Tensor, noised: Noised) -> Losses:
        """Per-sample losses of the network's ``output`` (float32) for ``noised``."""

    # ------------------------------------------------------------------------------------------------
    # Teaching: what a distillation's student learns from a model of this objective
    # ------------------------------------------------------------------------------------------------
    @property
    def time_convention(self) -> str | None:
        """How a student distilled from a model of this objective feeds its times to the network, so that it starts
        from the teacher's weights with the teacher's time embedding (a key of
        ``moh_dit.objectives.distill.TIME_CONVENTIONS``); ``None``: a model of this objective cannot teach."""
        return None

    def linear_velocity(
        self, net: torch.nn.Module, z: torch.Tensor, t: torch.Tensor, labels: torch.Tensor | None, drop=None
    ) -> torch.Tensor:
        """The velocity ``eps - x`` of the linear path ``z = (1 - t) x + t eps`` at flow times ``t`` (N,) as a model of
        this objective predicts it (its prediction at the same signal-to-noise ratio, converted), from one forward of
        ``net``; float32. What a distillation's student learns from."""
        raise ConfigError(f"a model of the {self.name} objective cannot teach: it has no velocity of the linear path")

    def training_forwards(self) -> float:
        """The FLOPs of one image's training step in forward passes (logs' TFLOP/s and MFU): 3, a forward and a
        backward, and the passes of guidance folded into the target."""
        return 3.0 + self.folded.forwards

    def step_forwards(self, step: int, companions: Mapping[str, Any] | None = None) -> float:
        """The passes of the networks a run trains (the student and ``companions``) at training ``step``, per image,
        in forwards at the student's size (a backward counts two): what the logs' ``network_evaluations`` add up.
        A frozen model's (a teacher's) are counted as they happen, apart."""
        return self.training_forwards()

    # what the logs call the updates of each network trained (role -> key: DMD2's generator_updates); empty where
    # every step updates the student alone (its updates are the steps)
    update_names: ClassVar[dict[str, str]] = {}

    # guidance folded into the training target (moh_dit.objectives.folded_guidance); inactive unless the objective
    # was made with it. DDPM and flow fold it here (their target term and prediction below); MeanFlow folds it into its
    # instantaneous velocity itself
    folded: FoldedGuidance = FoldedGuidance()
    target_term: str | None = None  # the key of ``Noised.terms`` that the network's output is regressed on

    def flow_times(self, noised: Noised) -> torch.Tensor:
        """Each sample's flow time of its noise level (where folded guidance applies: ``guidance_times``)."""
        raise NotImplementedError(f"the {self.name} objective does not fold guidance into its target")

    def target_prediction(self, output: torch.Tensor, noised: Noised, index: torch.Tensor) -> torch.Tensor:
        """The network's ``output`` for the samples ``index`` of ``noised``, as a prediction of the target term."""
        raise NotImplementedError(f"the {self.name} objective does not fold guidance into its target")

    def fold_guidance(
        self,
        net: torch.nn.Module,
        noised: Noised,
        labels: torch.Tensor | None,
        drop: torch.Tensor | None,
        autocast: Callable[[], AbstractContextManager],
        step: int | None = None,
    ) -> None:
        """Replace the target term of ``noised`` by its guided version (:class:`FoldedGuidance`), with ``net``'s
        predictions (the bare network or its EMA copy, without gradient)."""
        if labels is None or not self.folded.active:
            return
        rows = self.folded.rows(self.flow_times(noised), drop, step)

        def predict(index: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with autocast(), rows_of_route(net, index):  # a routed run (TREAD) routes these rows as their batch
                out = net(noised.x_t[index], noised.time[index], y, force_drop_ids=torch.zeros_like(y)).sample
            return self.target_prediction(out.float(), noised, index)

        term = self.target_term
        noised.terms[term] = self.folded.fold(noised.terms[term], rows, labels, net.null_class_id, predict)

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
        """The network's pass over ``noised`` and its per-sample losses: ``(losses, output)``, the output a
        :class:`~moh_dit.model.network.MoHDiTOutput` (its MoH loss, head masks and REPA tokens are the trainer's).
        ``model`` is the trainer's (wrapped for DDP or compiled); ``drop`` marks the labels replaced by the null
        class; ``autocast`` opens the run's mixed precision; ``frozen`` holds the run's models beside the student by
        role (those :attr:`frozen_models` names among them); ``step`` is the training step and ``ema`` the EMA
        weights as a network (folded guidance's warm-up and source). One forward here (after folded guidance's
        predictions, when it applies); MeanFlow's JVP overrides it."""
        if self.folded.active:
            from accelerate.utils import extract_model_from_parallel

            source = ema if self.folded.source == "ema" else extract_model_from_parallel(model)
            self.fold_guidance(source, noised, labels, drop, autocast, step)
        with autocast():
            out = model(noised.x_t, noised.time, labels, force_drop_ids=drop, return_head_masks=want_heads)
        return self.loss(out.sample.float(), noised), out

    # ------------------------------------------------------------------------------------------------
    # Sampling
    # ------------------------------------------------------------------------------------------------
    @property
    def samplers(self) -> tuple[str, ...]:
        """The scheduler names that sample this model (the objective's, narrowed by its record: the path, ...)."""
        return offered_samplers(self.name, self.record())

    def check_sampler(self, name: str) -> None:
        """A name of another objective's sampler, or of one this model's record rules out, is a ConfigError that
        says which samplers apply."""
        check_sampler(name, self.name, self.record())

    def protocol(self, name: str, given: bool = True) -> tuple[str, int]:
        """``(scheduler, steps)`` of protocol ``name`` for this model (``paper``: the objective's published one); a
        protocol the user did not choose (``given=False``) falls back to a sampler this model offers."""
        return resolve_protocol(name, self.name, self.record(), given)

    @abstractmethod
    def make_scheduler(self, name: str) -> SchedulerMixin:
        """The diffusers scheduler of sampler ``name``."""

    @abstractmethod
    def scheduler_name(self, scheduler: SchedulerMixin) -> str | None:
        """The name of a scheduler :meth:`make_scheduler` could have made (``None`` for another kind)."""

    @abstractmethod
    def set_timesteps(
        self, scheduler: SchedulerMixin, steps: int, time_shift: float, device: torch.device | str | None
    ) -> None:
        """Put ``scheduler`` on the grid of ``steps`` steps (shifted by ``time_shift`` where the objective allows)."""

    @abstractmethod
    def step_time(self, scheduler: SchedulerMixin, index: int, t: torch.Tensor) -> tuple[torch.Tensor, NoiseLevel]:
        """At the ``index``-th call of the sampling loop (scheduler timestep ``t``): the network's time input, and the
        noise level (for guidance intervals and grid averaging)."""

    def network_input(
        self, scheduler: SchedulerMixin, latents: torch.Tensor, index: int, t: torch.Tensor
    ) -> torch.Tensor:
        """The network's input at the ``index``-th call (timestep ``t``): what the scheduler makes of ``latents``."""
        return scheduler.scale_model_input(latents, t) if hasattr(scheduler, "scale_model_input") else latents

    @abstractmethod
    def scheduler_input(
        self, output: torch.Tensor, scheduler: SchedulerMixin, in_channels: int, latents: torch.Tensor, index: int
    ) -> torch.Tensor:
        """What ``scheduler.step`` takes from the (guided) network ``output`` at the ``index``-th call, at the sampler's
        ``latents`` (before :meth:`network_input`)."""
