"""The distillation diagnosis's ``variety`` part (experiments/distill_diagnosis.py): where a two-step student loses the
teacher's variety. A two-step generator jumps from noise to the grid's middle (``distill.dmd_midpoint``) and from
there to an image; either jump may be the one that drops modes. Each jump is swapped, alone, for the teacher's own
guided ODE over the same half of the flow times (Euler steps of its guided velocity, as the trajectories are
recorded), and for the jump of the student the run started from (``distill.student_from``). A generator's jump is the
step its own sampler takes: a DMD2 or SiD generator predicts the data and noises it afresh to the middle (its
renoising sampler), an ECT or trajectory student jumps along its flow map: if the student's first
jump followed by the teacher's second half keeps the teacher's recall, the first jump keeps the variety and the second
drops it; and so on. A stochastic hand-off's middle is one more: the start's jump past the middle, noised forward
afresh up to it (:func:`restart_jump`). Every composition starts from the same noise and class-balanced labels, and
is scored as the study scores a student: KID, precision and recall on the project's classifier features against the
test images, and each class's recall against that class's test images (does the gap sit in a few classes or in
all?)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch

from experiments.arms import run_config
from experiments.distill_diagnosis_report import pool_features
from experiments.distill_diagnosis_runs import run_parts, student_at, the_objective

__all__ = [
    "HALF_STEPS",
    "COMPOSITIONS",
    "GENERATORS_ONLY",
    "part_variety",
    "flow_map_jump",
    "sampler_jump",
    "restart_jump",
    "renoises",
    "teacher_half",
    "latest_step",
    "variety_scores",
]

HALF_STEPS = 12  # the teacher's Euler steps over each half of the flow times (24 in all, about its sampler's 25)
# what each composition runs from the noise to the middle and from the middle to the image (None: a one-step jump
# straight to the image, no second half): the teacher's ODE at its own guidance ("teacher") or at the real score's
# (``distill.real_guidance``: "real"), or a generator's jump
COMPOSITIONS = {
    "teacher, Euler both halves": ("teacher", "teacher"),
    "teacher at the real score's scale": ("real", "real"),  # the distribution the generator is pulled towards
    "student, 2 steps": ("student", "student"),
    "student's first jump, then the teacher": ("student", "teacher"),
    "the teacher, then the student's second jump": ("teacher", "student"),
    "start, 2 steps": ("start", "start"),
    "start's first jump, then the student's second": ("start", "student"),
    # the hand-off's middle finished by the teacher: whether the start's jump or the student's second loses its recall
    "start's first jump, then the teacher": ("start", "teacher"),
    "student's first jump, then the start's second": ("student", "start"),
    "student, 1 step": ("student", None),
    "start, 1 step": ("start", None),
    # a stochastic hand-off: the start's jump past the middle (to the data, or to half the middle), noised forward
    # afresh up to the middle (a restart), then the student's second: does fresh noise at the middle keep more variety
    # than the start's deterministic jump? (``start@f``: the start's jump to ``f`` times the middle, then renoised)
    "start's jump to the data, renoised to the middle, then the student's second": ("start@0", "student"),
    "start's jump to half the middle, renoised to the middle, then the student's second": ("start@0.5", "student"),
}
# the compositions of the two generators alone: no teacher ODE, so a minute instead of half an hour on a CPU core
GENERATORS_ONLY = [title for title, halves in COMPOSITIONS.items() if not {"teacher", "real"} & set(halves)]
BATCH = 500


@torch.no_grad()
def flow_map_jump(objective, model, x: torch.Tensor, t: float, r: float, y: torch.Tensor) -> torch.Tensor:
    """A flow-map generator's jump from flow time ``t`` to ``r``: ``x - (t - r) u(x, t, r)``."""
    ones = torch.ones(len(x))
    return x - (t - r) * objective.average_velocity(model, x, t * ones, r * ones, y).sample


def renoises(objective) -> bool:
    """Whether the model's own sampler (``objective.make_scheduler``) renoises between steps (a DMD2 or SiD
    generator's) instead of jumping along its flow map."""
    return bool(objective.make_scheduler("meanflow").config.get("renoise", False))


@torch.no_grad()
def sampler_jump(
    objective, model, x: torch.Tensor, t: float, r: float, y: torch.Tensor, renoise: bool, noise: torch.Tensor | None
) -> torch.Tensor:
    """The step from ``t`` to ``r`` that the model's own sampler takes: with a renoising one (``renoise``,
    :func:`renoises`) the data predicted from ``t``, noised afresh to ``r`` by ``noise``, ``(1 - r) x_0 + r noise``
    (a restart from the data, :func:`restart_jump`); otherwise the flow map's jump (:func:`flow_map_jump`)."""
    if r > 0 and renoise:
        return restart_jump(objective, model, x, t, 0.0, r, y, noise)
    return flow_map_jump(objective, model, x, t, r, y)


@torch.no_grad()
def restart_jump(
    objective, model, x: torch.Tensor, t: float, low: float, r: float, y: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    """A flow map's jump from ``t`` down to ``low``, then noised forward afresh up to ``r`` (``low <= t``, ``low <= r``)
    along the flow path ``x_s = (1 - s) x_0 + s eps``: ``x_r = a x_low + sqrt(r^2 - a^2 low^2) noise`` with
    ``a = (1 - r) / (1 - low)``, the one Gaussian step that takes the path's marginal at ``low`` to its marginal at
    ``r`` (Restart sampling's forward step, Xu et al. 2023, arXiv:2306.14878). ``low = 0``: the data predicted, noised
    to ``r``."""
    a = (1 - r) / (1 - low)
    return a * flow_map_jump(objective, model, x, t, low, y) + (r**2 - a**2 * low**2) ** 0.5 * noise


@torch.no_grad()
def teacher_half(velocity, x: torch.Tensor, t: float, r: float, y: torch.Tensor, steps: int = HALF_STEPS):
    """The teacher's guided ODE from ``t`` to ``r`` by ``steps`` Euler steps (its recorded trajectories' sampler).
    Written out here: diffusers' flow schedulers (``run_teacher_sampler``) always end their grid at 0, and the first
    half must stop at the middle."""
    times = torch.linspace(t, r, steps + 1).tolist()
    for now, then in zip(times[:-1], times[1:]):
        x = x + (then - now) * velocity(x, torch.full((len(x),), now), y)
    return x


def latest_step(run: Path) -> int | None:
    """The step of ``run``'s latest checkpoint (whose EMA weights the part reads), ``None`` without one."""
    from moh_dit.run_folder import RunLayout, checkpoint_step

    latest = RunLayout(run).latest_checkpoint() if run.is_dir() else None
    return None if latest is None else checkpoint_step(latest)


def variety_scores(features: np.ndarray, labels: np.ndarray, reference: np.ndarray, reference_labels: np.ndarray):
    """KID, precision, recall of ``features`` against ``reference``, and each class's recall against that
    class's reference features (k = 3 within the class, as the whole set's)."""
    from moh_dit.evaluation.metrics import kernel_inception_distance, precision_recall

    kid = kernel_inception_distance(reference, features)[0]  # the value the study records (its tables: KID x 1000)
    precision, recall = precision_recall(reference, features)
    classes = sorted(set(labels.tolist()))
    class_recall = [precision_recall(reference[reference_labels == c], features[labels == c])[1] for c in classes]
    return {"kid": kid, "precision": precision, "recall": recall, "class_recall": class_recall}


def part_variety(result: dict, run: Path, samples: int = 5000, generators_only: bool = False) -> None:
    """Every composition of :data:`COMPOSITIONS` for ``run`` (a two-step generator with a start), ``samples`` each,
    recorded under the run's name (the diagnoses of several runs share one results file); ``generators_only``: those
    of :data:`GENERATORS_ONLY` (the teacher's rows stay out of the record)."""
    from experiments.common import REFERENCE_COUNT, ROOT, classifier_features, fashion_reference
    from moh_dit.data.fashion_mnist import FashionMNIST
    from moh_dit.evaluation.statistics import reference_statistics
    from moh_dit.progress import progress
    from moh_dit.training.distill import teacher_velocity

    config, data, teacher = run_parts(run)
    start_run = config.distill.student_from
    if not start_run:
        raise SystemExit(f"{run} started from the teacher (no distill.student_from): the variety part compares a "
                         "student with the start it was trained from")  # fmt: skip
    start_run = Path(start_run)
    steps = {"student": latest_step(run), "start": latest_step(start_run)}
    if steps["start"] is None:
        raise SystemExit(f"{run} started from {start_run}, which holds no checkpoint here (moved or deleted): the "
                         "variety part needs the start's weights")  # fmt: skip
    student = student_at(run, None, ema=True)
    start = student_at(start_run, None, ema=True)
    models = {"student": (the_objective(config, student), student),
              "start": (the_objective(run_config(start_run), start), start)}  # fmt: skip
    renoising = {name: renoises(objective) for name, (objective, _) in models.items()}  # asked once per model
    real_scale = config.distill.real_guidance
    velocities = {"teacher": teacher_velocity(teacher, "no", torch.device("cpu")),
                  "real": lambda z, t, y: teacher.velocity(z, t, y, None, contextlib.nullcontext, real_scale)}  # fmt: skip
    middle = float(config.distill.dmd_midpoint)
    classes = data.num_classes
    y_all = torch.arange(classes).repeat_interleave(-(-samples // classes))[:samples]
    z_all = torch.randn(samples, *data.dataset[0][0].shape, generator=torch.Generator().manual_seed(1))
    renoise_all = torch.randn(z_all.shape, generator=torch.Generator().manual_seed(2))  # a renoising first jump's

    def move(name: str, x: torch.Tensor, t: float, r: float, y: torch.Tensor, i: int) -> torch.Tensor:
        """From ``t`` to ``r`` by the teacher's ODE or by a generator's own sampler step (batch ``i``'s noise)."""
        if name in velocities:
            return teacher_half(velocities[name], x, t, r, y)
        name, _, share = name.partition("@")
        objective, model = models[name]
        if share:  # a restart: the jump past ``r``, then noised forward afresh up to it
            return restart_jump(objective, model, x, t, float(share) * r, r, y, renoise_all[i : i + len(x)])
        return sampler_jump(objective, model, x, t, r, y, renoising[name], renoise_all[i : i + len(x)])

    reference_path = fashion_reference(ROOT / "experiments" / "results", REFERENCE_COUNT)
    extractor = classifier_features()
    reference = np.asarray(reference_statistics(reference_path, extractor)["pool"])
    reference_labels = np.asarray(FashionMNIST(split="test").labels[: len(reference)])
    halves: dict[tuple[str, int], torch.Tensor] = {}  # the middles, computed once per first jump
    rows = {}
    titles = GENERATORS_ONLY if generators_only else list(COMPOSITIONS)
    for title in titles:
        a, b = COMPOSITIONS[title]
        images = []
        for i in progress(range(0, samples, BATCH), desc=title, unit="batch"):
            z, y = z_all[i : i + BATCH], y_all[i : i + BATCH]
            if b is None:
                images.append(move(a, z, 1.0, 0.0, y, i))
                continue
            if (a, i) not in halves:
                halves[(a, i)] = move(a, z, 1.0, middle, y, i)
            images.append(move(b, halves[(a, i)], middle, 0.0, y, i))
        features = pool_features(torch.cat(images), extractor, desc=title).numpy()
        rows[title] = variety_scores(features, y_all.numpy(), reference, reference_labels)
    result.setdefault("variety", {})[run.name] = {
        "run": str(run), "start": str(start_run), "steps": steps, "samples": samples, "middle": middle,
        "teacher_steps": 2 * HALF_STEPS, "real_guidance": real_scale, "rows": rows,
        "renoises": renoising,
    }  # fmt: skip
