"""Autoguidance's guide model: loading the weights a spec names and checking they can guide the main model.

Autoguidance (Karras et al. 2024, arXiv:2406.02507) guides a model with a weaker version of itself: an earlier
checkpoint of its run, or a smaller model trained on the same data, each conditional. The guide must predict the same
thing in the same space: the same objective and convention, latent space, image size, channels and classes; anything
else stops before an image is drawn. A spec names the guide (:class:`~moh_dit.sampling.spec_parts.GuideSpec`: a path,
a run's step, an EMA width rebuilt from the run's post-hoc snapshots); the pipeline loads it on first use
(``MoHDiTPipeline.guide_for``) and hands it to the sampling loop, or takes one as the ``guide`` argument of its call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moh_dit.errors import ConfigError
from moh_dit.manifests import fingerprint_module
from moh_dit.model.network import MoHDiT
from moh_dit.objectives import objective_name
from moh_dit.run_folder import RunLayout
from moh_dit.sampling.posthoc import rebuild_transformer
from moh_dit.sampling.sources import load_transformer, source_vae_record
from moh_dit.sampling.spec_parts import GuideSpec
from moh_dit.vae import latent_space_differences, space_of

__all__ = ["Guide", "load_guide", "check_guide", "image_differences"]


@dataclass
class Guide:
    """A guide model and what it is: the spec that names it, where its weights came from, their fingerprint."""

    model: MoHDiT
    spec: GuideSpec
    source: str
    fingerprint: str

    @classmethod
    def of(cls, model: MoHDiT, spec: GuideSpec, source: str = "in memory") -> Guide:
        """A guide from a model already loaded (a benchmark's untrained model, a test's), in eval mode."""
        return cls(model.eval(), spec, source, fingerprint_module(model))

    def identity(self) -> dict[str, Any]:
        """What a sample set's identity keeps of its guide: the weights (by fingerprint) and how they were chosen."""
        return {"transformer_sha256": self.fingerprint, "step": self.spec.step, "sigma_rel": self.spec.sigma_rel}


def _objective(model: MoHDiT) -> dict[str, Any]:
    """What the model's outputs mean, resolved (a record that leaves a default out equals one that writes it): the
    objective's completed record without the guidance folded into training, which changes the predictions' strength,
    not what they are."""
    from moh_dit.objectives import objective_of
    from moh_dit.objectives.folded_guidance import FOLDED_KEYS

    record = objective_of(model).record() or {}
    return {
        k: v
        for k, v in dict(record, name=objective_name(model.config.get("objective"))).items()
        if k not in FOLDED_KEYS
    }


def check_guide(main: MoHDiT, guide: MoHDiT, main_space: dict | None, guide_space: dict | None, where: str) -> None:
    """One :class:`ConfigError` naming every difference that keeps ``guide`` from guiding ``main``: objective (and its
    path and convention), image size, channels, classes, latent space (``None``: pixels)."""
    wrong = []
    mine, theirs = _objective(main), _objective(guide)
    if mine != theirs:
        wrong.append(f"objective {theirs} (the main model: {mine})")
    wrong += image_differences(main, guide, main_space, guide_space)
    if wrong:
        raise ConfigError(f"the guide {where} cannot guide this model: {'; '.join(wrong)}")


def image_differences(main: MoHDiT, other: MoHDiT, main_space: dict | None, other_space: dict | None) -> list[str]:
    """What keeps ``other`` from drawing the same images as ``main``, in words: image size, channels, classes, latent
    space (``None``: pixels). Empty when nothing does."""
    wrong = []
    for key in ("sample_size", "in_channels", "num_classes"):
        if main.config[key] != other.config[key]:
            wrong.append(f"{key} {other.config[key]} (the main model: {main.config[key]})")
    same = main_space is None and other_space is None
    if main_space is not None and other_space is not None:
        same = not latent_space_differences(other_space, main_space)
    if not same:
        shown = [None if s is None else space_of(s) for s in (other_space, main_space)]
        wrong.append(f"latent space {shown[0]} (the main model: {shown[1]})")
    return wrong


def load_guide(spec: GuideSpec, main: MoHDiT, main_space: dict | None) -> Guide:
    """The guide ``spec`` names, checked against the ``main`` model (of latent space ``main_space``), on its device and
    in its dtype. An EMA width rebuilds the guide from its run's post-hoc snapshots; the guide's autoencoder is read
    from its record, never loaded."""
    if spec.sigma_rel is not None:
        model, source, _ = rebuild_transformer(spec.model, spec.sigma_rel, spec.step)
        where = str(spec.model)
    else:
        model, source = load_transformer(_checkpoint_at(spec.model, spec.step))
        where = str(source.path)
    check_guide(main, model, main_space, source_vae_record(source), where)
    # torch's own cast: diffusers' ModelMixin.to warns that "modules should be kept in float32: []" on every dtype
    # given, also when (as here) there are none
    model = torch.nn.Module.to(model, device=main.device, dtype=main.dtype).eval()
    return Guide(model, spec, where, fingerprint_module(model))


def _checkpoint_at(model: str, step: int | None) -> str:
    """The folder of the guide's weights: ``model`` itself, or its run's checkpoint at ``step``."""
    if step is None:
        return model
    layout = RunLayout(model)
    path = layout.checkpoint(step)
    if not (path / "trainer_state.json").is_file():
        steps = [s for s, _ in layout.list_checkpoints()]
        raise ConfigError(f"the guide {model} has no checkpoint at step {step} (it has {steps or 'none'})")
    return str(path)
