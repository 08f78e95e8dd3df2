"""The guide model of autoguidance: loading the weights a spec names, checking they can guide the main model, and
attaching them to its pipeline.

Autoguidance (Karras et al. 2024, arXiv:2406.02507) guides a model with a weaker version of itself: an earlier
checkpoint of its run, or a smaller model trained on the same data, each conditional. The guide must predict the same
thing in the same space: the same objective and convention, latent space, image size, channels and classes; anything
else stops before an image is drawn. A spec names the guide by path (``SamplingSpec.guide``), with a run's step
(``guide_step``) and an EMA width rebuilt from its post-hoc snapshots (``guide_sigma_rel``).

The post-hoc rebuild belongs to training (``moh_dit.training.posthoc_export``); the callers that may need it (the
command line, the trainer) hand it in as ``rebuild``, so that sampling stays below training.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moh_dit.errors import ConfigError
from moh_dit.manifests import fingerprint_module
from moh_dit.model.network import MoHDiT
from moh_dit.run_folder import RunLayout
from moh_dit.sampling.checks import attached_guide_entry
from moh_dit.sampling.pipeline import MoHDiTPipeline
from moh_dit.sampling.spec import SamplingSpec

__all__ = ["Guide", "attach_guide", "guide_identity", "check_guide"]

# rebuild(run, sigma_rel, step) -> the transformer with the EMA of that width at that step
Rebuild = Callable[[str, float, int | None], MoHDiT]


@dataclass
class Guide:
    """An attached guide: its weights and what they are (the spec's record, where they came from, their
    fingerprint)."""

    model: MoHDiT
    record: dict[str, Any]
    source: str
    fingerprint: str

    def identity(self) -> dict[str, Any]:
        """What a sample set's identity keeps of its guide: the weights (by fingerprint) and how they were chosen."""
        return {
            "transformer_sha256": self.fingerprint,
            "step": self.record["step"],
            "sigma_rel": self.record["sigma_rel"],
        }


def check_guide(main: MoHDiT, guide: MoHDiT, main_space: dict | None, guide_space: dict | None, where: str) -> None:
    """One :class:`ConfigError` naming every difference that keeps ``guide`` from guiding ``main``: objective (and
    its path and convention), image size, channels, classes, latent space."""
    wrong = []
    mine, theirs = main.config.get("objective") or {"name": "ddpm"}, guide.config.get("objective") or {"name": "ddpm"}
    if mine != theirs:
        wrong.append(f"objective {theirs} (the main model: {mine})")
    for key in ("sample_size", "in_channels", "num_classes"):
        if main.config[key] != guide.config[key]:
            wrong.append(f"{key} {guide.config[key]} (the main model: {main.config[key]})")
    if (main_space or {}) != (guide_space or {}):
        wrong.append(f"latent space {guide_space} (the main model: {main_space})")
    if wrong:
        raise ConfigError(f"the guide {where} cannot guide this model: {'; '.join(wrong)}")


def attach_guide(pipe: MoHDiTPipeline, spec: SamplingSpec, rebuild: Rebuild | None = None) -> None:
    """Load the guide ``spec`` names (or none), check it against the pipeline's model and attach it (``pipe.guide``);
    a guide already attached for the same record is kept. ``rebuild`` makes an EMA of ``guide_sigma_rel`` from a
    run's snapshots (``moh_dit.training.posthoc_export.rebuild_transformer``)."""
    record = spec.guide_record()
    if record is None:
        pipe.guide = None
        return
    attached = getattr(pipe, "guide", None)
    if attached is not None and attached.record == record:
        return
    from moh_dit.sampling.loading import load_pipeline, resolve_model_source

    if record["sigma_rel"] is not None:
        if rebuild is None:
            raise ConfigError("guide_sigma_rel rebuilds an EMA from a run's snapshots: this caller cannot")
        model, source = rebuild(record["model"], record["sigma_rel"], record["step"]), str(record["model"])
        space = load_pipeline(record["model"], device="cpu", log=False).space.space  # the run's latent space
    else:
        path = resolve_model_source(_checkpoint_at(record["model"], record["step"])).path
        loaded = load_pipeline(path, device="cpu", log=False)
        model, source, space = loaded.transformer, str(path), loaded.space.space
    check_guide(pipe.transformer, model, pipe.space.space, space, source)
    model = model.to(device=pipe.transformer.device, dtype=pipe.transformer.dtype).eval()
    pipe.guide = Guide(model, record, source, fingerprint_module(model))


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


def guide_identity(pipe: MoHDiTPipeline, spec: SamplingSpec) -> dict[str, Any] | None:
    """The guide's part of a sample set's identity (``None`` without one); the guide ``spec`` names must be
    attached (:func:`attach_guide`)."""
    entry = attached_guide_entry(pipe, spec)
    return None if entry is None else entry.identity()
