"""Scoring a model: N samples with :func:`moh_dit.sampling.generation.generate_samples`, then
:func:`moh_dit.evaluation.scoring.score_sample_set`. ``moh-dit evaluate --model`` and the trainer's evaluations
during training (``log.eval_every``) both call :func:`sample_and_score`, so a score the trainer logs at step N
is the score the command gives for the checkpoint of step N with the same settings, to the last digit
(``tests/training/test_quality.py``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from moh_dit.evaluation.features import FeatureExtractor
from moh_dit.evaluation.scoring import ScoringOptions, score_sample_set
from moh_dit.sampling.generation import GenerationSettings, generate_samples, missing_indices
from moh_dit.sampling.pipeline import MoHDiTPipeline


def sample_and_score(
    pipe: MoHDiTPipeline,
    sample_dir: str | os.PathLike,
    settings: GenerationSettings,
    reference: str | os.PathLike,
    extractor: FeatureExtractor,
    options: ScoringOptions | None = None,
    accelerator=None,
    overwrite: bool = False,
) -> dict | None:
    """Generate ``settings.num_samples`` images of ``pipe`` into ``sample_dir`` (split over the processes of
    ``accelerator``; a folder with the same manifest is resumed, another is refused unless ``overwrite``) and
    score them against ``reference`` on the main process. Returns the scores there, ``None`` elsewhere; with
    ``generation``: how many images this call made and the seconds it took (scoring not counted). A guide the
    settings name is loaded by the pipeline, once."""
    folder = Path(sample_dir)
    missing = len(missing_indices(folder, settings.num_samples)) if folder.is_dir() else settings.num_samples
    start = time.time()
    npz = generate_samples(pipe, sample_dir, settings, accelerator, overwrite=overwrite)
    seconds = time.time() - start
    if npz is None:  # not the main process
        return None
    result = score_sample_set(npz, reference, extractor, options or ScoringOptions())
    result["generation"] = {"images": missing, "seconds": seconds}
    return result
