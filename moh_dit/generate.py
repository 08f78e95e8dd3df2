"""The import path of moh-dit 0.2 for loading and N-sample generation, kept for one release (CHANGELOG.md):
use ``moh_dit.load_pipeline`` / ``moh_dit.sampling.loading`` and ``moh_dit.sampling.generation``."""

from moh_dit.sampling.generation import GenerationSettings, generate_samples, sample_to_folder
from moh_dit.sampling.loading import load_pipeline
from moh_dit.sampling.sources import load_transformer, resolve_model_source

__all__ = [
    "GenerationSettings",
    "generate_samples",
    "load_pipeline",
    "load_transformer",
    "resolve_model_source",
    "sample_to_folder",
]
