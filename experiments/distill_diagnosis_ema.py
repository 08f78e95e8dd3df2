"""The distillation diagnosis's EMA parts (experiments/distill_diagnosis.py): ``ema``, the share of the start the EMA
still holds (over the EMA's own updates: a DMD2 generator's steps with its updates only), and ``weights``, a run's EMA
and its raw weights at the same step, each scored as the distillation study scores a student. Over a short stage the
EMA holds much of the start: is it a lag that hides a better generator, or an anchor that holds the start's variety?"""

from __future__ import annotations

from pathlib import Path

import torch

from experiments.arms import STUDY_SCALES, run_config

__all__ = ["WEIGHTS_STEPS", "part_ema", "ema_updates", "part_weights", "raw_pipeline", "pipeline_step"]


def part_ema(result: dict, run: Path) -> None:
    """The EMA's weight on the weights the run started from (the teacher's, or ``distill.student_from``'s) after each
    quarter of its updates: its own update rule applied to one number that starts at 1 and is 0 ever after. The
    updates are the EMA's own count (a DMD2 generator's EMA steps with the generator's updates only, one step in
    ``fake_updates + 1``), read from the run's last checkpoint."""
    from moh_dit.training.setup import make_ema

    config = run_config(run)
    updates = ema_updates(run, config)
    param = torch.nn.Parameter(torch.ones(1))
    ema = make_ema(torch.nn.ParameterList([param]), config.ema)
    shares = {}
    with torch.no_grad():
        param.zero_()
        for update in range(1, updates + 1):
            ema.step([param])
            if update in (updates // 4, updates // 2, updates):
                shares[update] = float(ema.shadow_params[0])
    result["ema"] = {"run": str(run), "decay": config.ema.decay, "steps": config.train.max_steps,
                     "updates": updates, "start_share": shares}  # fmt: skip


def ema_updates(run: Path, config) -> int:
    """How many times ``run``'s EMA stepped: its last checkpoint's record, else one per ``ema.update_every`` steps."""
    import json

    from moh_dit.run_folder import RunLayout

    latest = RunLayout(run).latest_checkpoint()  # a checkpoint counts only with its trainer_state.json
    recorded = None if latest is None else json.loads((Path(latest) / "trainer_state.json").read_text())
    if recorded is not None and recorded.get("ema_optimization_step") is not None:
        return int(recorded["ema_optimization_step"])
    return config.train.max_steps // config.ema.update_every


WEIGHTS_STEPS = (1, 2)  # the step counts the weights part scores at (the dmd2 study's)


def part_weights(result: dict, run: Path, out: Path, samples: int = 5000) -> None:
    """The run's EMA and raw weights at its last checkpoint, scored alike (:func:`experiments.arms.score_model`, the
    study's scorer; the samples and a raw-weights pipeline are kept under ``out`` and reused)."""
    from argparse import Namespace

    from experiments.arms import score_model
    from experiments.common import REFERENCE_COUNT, scoring_context

    raw = raw_pipeline(run, out / "raw-pipeline")
    args = Namespace(out=str(out), reference_count=REFERENCE_COUNT, rescore=False)
    # the distillation study's scoring: its reference, features and bootstrap
    ctx = scoring_context(args, {"samples": samples, "bootstrap": STUDY_SCALES["cpu"]["bootstrap"]})
    rows = []
    for weights, model in (("ema", run / "pipeline"), ("raw", raw)):
        for steps in WEIGHTS_STEPS:
            name = run.name if weights == "ema" else f"{run.name}-raw"  # the study's own sample folders for the EMA
            scores = score_model(model, name, "meanflow", steps, 1.0, ctx)
            rows.append(
                {"weights": weights, "steps": steps} | {k: scores[k] for k in ("kid", "kid_interval", "recall")}
            )
    result["weights"] = {"run": str(run), "step": pipeline_step(run), "samples": samples, "rows": rows}


def raw_pipeline(run: Path, folder: Path) -> Path:
    """A pipeline folder of ``run``'s raw weights at its last checkpoint, beside its exported (EMA) pipeline of the
    same step: that pipeline's scheduler, classes and recorded sampling, the manifest naming the weights ``model``.
    A run whose exported pipeline is of another step is refused in one line."""
    from moh_dit.run_folder import RunLayout, checkpoint_step
    from moh_dit.sampling.loading import load_pipeline
    from moh_dit.sampling.pipeline import MoHDiTPipeline
    from moh_dit.sampling.sources import checkpoint_model

    latest = RunLayout(run).latest_checkpoint()
    step, exported = (None if latest is None else checkpoint_step(Path(latest))), pipeline_step(run)
    if step is None or step != exported:
        raise SystemExit(f"{run}: its pipeline (step {exported}) and its last checkpoint (step {step}) differ; "
                         "the weights part compares the two at one step")  # fmt: skip
    if (folder / "manifest.json").is_file():  # reused only where it is this run's raw weights at this step
        source = (MoHDiTPipeline.manifest_of(folder) or {}).get("source") or {}
        made = (source.get("run"), source.get("step"), source.get("weights"))
        if made != (str(run.resolve()), step, "model"):
            raise SystemExit(f"{folder} holds {made[2]} weights of {made[0]} at step {made[1]}, not {run}'s raw "
                             f"weights at step {step}: pass another --out")  # fmt: skip
        return folder
    pipe = load_pipeline(run / "pipeline", device="cpu", log=False)
    model, _ = checkpoint_model(Path(latest), prefer_ema=False)
    pipe.transformer.load_state_dict(model.state_dict())
    pipe.save(folder, {"run": str(run.resolve()), "step": step, "weights": "model"}, sampling=pipe.preview_sampling)
    return folder


def pipeline_step(run: Path) -> int | None:
    from moh_dit.sampling.pipeline import MoHDiTPipeline

    manifest = MoHDiTPipeline.manifest_of(run / "pipeline") if (run / "pipeline").is_dir() else None
    return ((manifest or {}).get("source") or {}).get("step")
