"""What the experiments share: the Fashion-MNIST reference set, the classifier features they score with, and
sampling + scoring a model (KID and FID with bootstrap intervals, precision, recall, time per image)."""

from __future__ import annotations

import functools
import json
import logging
import statistics
from pathlib import Path

import numpy as np
import torch

from experiments import fmnist_classifier
from moh_dit.data.fashion_mnist import FASHION_MNIST_CLASSES, FashionMNIST
from moh_dit.errors import ArtifactError
from moh_dit.evaluation.features import load_images, resolve_extractor
from moh_dit.evaluation.metrics import kernel_inception_distance, patch_seam_ratio
from moh_dit.evaluation.model_scores import sample_and_score as package_sample_and_score
from moh_dit.evaluation.reference import NAMED_REFERENCES
from moh_dit.evaluation.scoring import ScoringOptions
from moh_dit.evaluation.statistics import reference_statistics
from moh_dit.files import atomic_path
from moh_dit.sampling.generation import GenerationSettings
from moh_dit.sampling.grids import sample_grid
from moh_dit.sampling.loading import load_pipeline
from moh_dit.sampling.sample_sets import read_npz_manifest
from moh_dit.sampling.spec import SamplingSpec

ROOT = Path(__file__).resolve().parents[1]
# the package's named reference fashion-mnist-test: the test images, gray repeated to RGB (uint8 NHWC)
fashion_test_images = NAMED_REFERENCES["fashion-mnist-test"]


# where the studies keep the Fashion-MNIST test reference they score against (23 MB, ignored by git): one copy for
# every study and every --out, never beside a folder the user named
REFERENCE_DIR = ROOT / "experiments" / "results"


def fashion_reference(out: Path, count: int = 10000) -> Path:
    """The first ``count`` Fashion-MNIST test images as an ADM-style uint8 npz (gray repeated to RGB). An
    existing file is checked against the test set (a second, cheap to read) before it is reused."""
    path = Path(out) / f"reference_fmnist_test_{count}.npz"
    images = fashion_test_images()[:count]
    if path.exists():
        check_fashion_reference(path, count, images)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # never a half-written reference; the temporary name is the process's own, as two studies started at once
    # write the same reference
    with atomic_path(path, ".npz") as tmp:
        np.savez(tmp, arr_0=images)
    return path


def check_fashion_reference(path: Path, count: int, images: np.ndarray | None = None) -> None:
    """Raise unless ``path`` holds exactly the first ``count`` Fashion-MNIST test images, in order (as
    :func:`fashion_reference` writes them; ``images``: those images, when the caller has them)."""
    if images is None:
        images = fashion_test_images()[:count]
    with np.load(path) as stored:
        if not ("arr_0" in stored.files and np.array_equal(stored["arr_0"], images)):
            raise ArtifactError(f"{path} does not hold the first {count} Fashion-MNIST test images: delete it")


# the whole Fashion-MNIST test set: what every study scores against unless told otherwise
REFERENCE_COUNT = 10000


def smoke_run(steps: int = 4) -> list[str]:
    """The training overrides of a study's ``tiny`` scale (its smoke run in tests/test_experiments.py): the narrowest
    model the presets' heads allow, ``steps`` steps on 4 images per class, a checkpoint every 2 steps."""
    return [
        "model.overrides.hidden_size=32",
        "model.overrides.head_dim=8",
        f"train.max_steps={steps}",
        "train.checkpoint_every=2",
        "data.subset_per_class=4",
        "log.log_every=1",
        "optim.warmup_steps=1",
        "preview.per_class=1",
    ]


def add_scoring_arguments(parser, out: str) -> None:
    """The options every sample-and-score study shares: sample count, sampler, bootstrap, reference size,
    output folder."""
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--scheduler", default="dpm-solver")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--bootstrap", type=int, default=20)
    add_reference_argument(parser)
    parser.add_argument("--out", default=out)


def add_reference_argument(parser) -> None:
    """``--reference-count``: how many Fashion-MNIST test images the scores are against (smoke runs use few)."""
    parser.add_argument(
        "--reference-count",
        type=int,
        default=REFERENCE_COUNT,
        help=f"score against the first N Fashion-MNIST test images (default {REFERENCE_COUNT}, the whole test set)",
    )


def reference_protocol(args) -> dict:
    """The reference's part of a study's protocol: nothing for the whole test set (so that tables scored
    before the option existed are kept), the count otherwise (never mixed into a table of another count)."""
    count = args.reference_count
    return {} if count == REFERENCE_COUNT else {"reference_count": count}


def describe_reference(protocol: dict) -> str:
    """What a study's ``protocol`` scored against, for reports: ``10,000 Fashion-MNIST test images`` (the
    whole test set) or ``first 500 Fashion-MNIST test images``."""
    count = protocol.get("reference_count", REFERENCE_COUNT)
    return (
        f"{count:,} Fashion-MNIST test images"
        if count == REFERENCE_COUNT
        else f"first {count:,} Fashion-MNIST test images"
    )


def start_scoring(args) -> tuple[Path, Path, object]:
    """Logging, the output folder, the Fashion-MNIST test reference beside it and the classifier features."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return out, fashion_reference(REFERENCE_DIR, args.reference_count), classifier_features()


def scoring_context(args, sc: dict, **extra) -> dict:
    """What a study's scoring parts take: :func:`start_scoring`'s folder, reference and features, torch's seed fixed,
    the scale's sample count and bootstrap, ``--rescore``, and the study's ``extra`` entries."""
    out, reference, extractor = start_scoring(args)
    torch.manual_seed(0)
    return dict(out=out, reference=reference, extractor=extractor, samples=sc["samples"], bootstrap=sc["bootstrap"],
                rescore=args.rescore, **extra)  # fmt: skip


def kept_rows(out: Path, protocol: dict) -> dict:
    """The rows of ``out/results.json`` that a study run now may keep beside its own: all of them when they
    were scored with the same ``protocol``, none otherwise (the old file is moved aside to
    ``results.previous.json``, never mixed into a table of another protocol)."""
    path = out / "results.json"
    if not path.exists():
        return {}
    previous = json.loads(path.read_text())
    if previous.get("protocol") != json.loads(json.dumps(protocol)):
        aside = out / "results.previous.json"
        logging.warning(
            "%s was scored with another protocol (%s, now %s); moved to %s, starting a new table",
            path,
            previous.get("protocol"),
            protocol,
            aside,
        )
        path.replace(aside)
        return {}
    return dict(previous.get("rows") or {})


def classifier_features():
    """The project's Fashion-MNIST classifier as a feature extractor (registered with torch-fidelity)."""
    return resolve_extractor(fmnist_classifier.register(), None, "cpu")


def sample_and_score(
    model: Path,
    folder: Path,
    settings: GenerationSettings,
    scheduler: str,
    reference: Path,
    extractor,
    bootstrap: int = 20,
    pipe=None,
) -> dict:
    """Generate ``settings.num_samples`` images of ``model`` into ``folder`` (resumable; reused when done)
    with ``scheduler``, and score them: KID, FID (90% bootstrap intervals), precision, recall, and the
    sampling time per image (measured when the images are generated; kept beside them), and the patch-seam
    excess overall and per class (:func:`seam_excess`). ``pipe``: the model already loaded (a rebuilt post-hoc
    EMA); a guide the settings name is attached (a post-hoc EMA of it rebuilt from its run's snapshots)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    timing = folder.with_name(folder.name + ".timing.json")
    pipe = pipe if pipe is not None else load_pipeline(model, device=device, scheduler=scheduler)
    if scheduler is not None:
        pipe.with_scheduler(scheduler)
    # the package's scoring (moh-dit evaluate --model's): also for a finished folder, whose manifest must name this
    # model and these settings (a retrained model or another sampler is refused, never scored as this one)
    options = ScoringOptions(batch_size=500, bootstrap=bootstrap, return_features=True)
    scored = package_sample_and_score(pipe, folder, settings, reference, extractor, options)
    made, npz = scored["generation"], Path(scored["samples"]["path"])
    if made["images"] and (made["images"] == settings.num_samples or not timing.exists()):
        timing.write_text(json.dumps({"seconds_per_image": made["seconds"] / made["images"]}))
    made_by = read_npz_manifest(npz)["identity"]
    images = load_images(npz)  # (N, H, W, 3) uint8, validated: for the seam scores
    with np.load(npz) as stored:
        labels = stored["arr_1"]
    seconds = json.loads(timing.read_text())["seconds_per_image"] if timing.exists() else None
    return dict(
        scored["metrics"],
        **per_class_scores(scored["features"], labels, reference, extractor),
        **seam_excess(images, labels, pipe.patch_pixels),
        seconds_per_image=seconds,
        num_samples=settings.num_samples,
        transformer_sha256=made_by["transformer_sha256"],  # which weights were scored, wherever the folder moves
    )


def per_class_scores(features: dict, labels: np.ndarray, reference: Path, extractor) -> dict:
    """Per class: ``class_kid``, KID of the class's samples against the reference's images of that class
    (None for fewer than 2 samples), and ``recognised``, the share of the class's samples the classifier
    labels as that class. ``features`` are the samples' features by the classifier ``extractor`` (the dict
    :func:`evaluate` returns with ``return_features``, so one pass serves every score), ``labels`` their
    classes. ``reference`` is :func:`fashion_reference`'s file: the first test images in order, so the
    test labels say which of its cached features belong to which class."""
    if "logits" not in features or len(features["pool"]) != len(labels):
        raise ValueError(f"per_class_scores needs the classifier's pool features and logits of {len(labels)} samples")
    ref = reference_statistics(reference, extractor)["pool"]  # (R, D), the reference's first R images
    check_fashion_reference(reference, len(ref))  # else the test labels would name the wrong images' classes
    ref_labels = FashionMNIST(split="test").labels[: len(ref)]
    pool = features["pool"]  # (N, D)
    kid = [
        kernel_inception_distance(ref[ref_labels == c], pool[labels == c])[0] if (labels == c).sum() >= 2 else None
        for c in range(len(FASHION_MNIST_CLASSES))
    ]
    recognised = fmnist_classifier.recognition_rates(features["logits"].argmax(1), labels)
    return {"class_kid": kid, "recognised": recognised}


def seam_excess(images: np.ndarray, labels: np.ndarray, patch: int) -> dict:
    """The patch-seam ratio (:func:`moh_dit.evaluation.metrics.patch_seam_ratio`) of the samples divided by that of the
    Fashion-MNIST test images, over all samples (``seam_excess``, against all test images) and per class
    (``class_seam_excess``, against the test images of that class; None for a class without samples).
    1 means no sharper patch-grid lines than real images; the 4x4 texture of an undertrained grid is well
    above it. ``seam_excess_any_offset`` is the largest overall excess over every offset of the grid
    (``patch_seam_ratio(..., offset)``): grid averaging moves each copy's grid, and a seam moved off the
    model's own grid would still show there. ``patch``: the model's patch in pixels."""
    real_by_class, real_by_offset = real_seam_ratios(patch)
    excess = [
        patch_seam_ratio(images[labels == c], patch) / real_by_class[c] if (labels == c).any() else None
        for c in range(len(FASHION_MNIST_CLASSES))
    ]
    overall = [patch_seam_ratio(images, patch, offset) / real_by_offset[offset] for offset in range(patch)]
    return {"seam_excess": overall[0], "class_seam_excess": excess, "seam_excess_any_offset": max(overall)}


@functools.cache  # the test set does not change while a study runs; every sample set of a study divides by these
def real_seam_ratios(patch: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The patch-seam ratios of the Fashion-MNIST test images: per class on the grid's own lines, and over all
    classes at each offset of the grid."""
    test = FashionMNIST(split="test")
    images, labels = np.asarray(test.images), np.asarray(test.labels)
    by_class = tuple(patch_seam_ratio(images[labels == c], patch) for c in range(len(FASHION_MNIST_CLASSES)))
    return by_class, tuple(patch_seam_ratio(images, patch, offset) for offset in range(patch))


def real_recognition(count: int = REFERENCE_COUNT) -> list[float | None]:
    """The share of each class's real test images (of the first ``count``, those a study scores against) the
    classifier recognises: the most a generator can be expected to reach per class, given the classifier's
    own errors."""
    test = FashionMNIST(split="test")
    return fmnist_classifier.recognition_rates(
        fmnist_classifier.predict(fmnist_classifier.load_classifier(), test.images[:count]), test.labels[:count]
    )


def render_grid(
    model: Path,
    path: Path,
    scheduler: str,
    steps: int,
    guidance: float,
    per_class: int = 8,
    guidance_interval: tuple[int, int] | None = None,
    grid_averaging: int | None = None,
) -> Path:
    """A labelled grid of ``per_class`` images of every class (seed 0), as ``sample.py`` draws it."""
    from moh_dit.images import make_grid

    pipe = load_pipeline(model, device="cuda" if torch.cuda.is_available() else "cpu", scheduler=scheduler)
    classes = list(range(pipe.transformer.config.num_classes))
    spec = SamplingSpec.create(scheduler, steps, guidance, guidance_interval, grid_averaging=grid_averaging)
    images, names = sample_grid(pipe, classes, per_class, 0, spec)
    make_grid(images, ncols=per_class, row_labels=names).save(path)
    return path


def t_interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """Mean +- Student-t half-width over seeds (None for one value)."""
    if len(values) < 2:
        return None
    from scipy import stats

    half = stats.t.ppf(0.5 + level / 2, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
    mean = statistics.mean(values)
    return mean - half, mean + half
