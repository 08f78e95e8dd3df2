"""What ``moh-dit ema`` does with a run's post-hoc EMA snapshots: rebuild the EMA of any width at any snapshot's
step as a pipeline or transformer folder that records how it was made, and sweep widths (and guidance scales) with
the scoring ``moh-dit evaluate --model`` uses, writing a table and a plot."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from moh_dit.run_folder import RunLayout
from moh_dit.sampling.loading import load_pipeline
from moh_dit.sampling.pipeline import MoHDiTPipeline
from moh_dit.sampling.posthoc import newest_checkpoint, rebuild_weights
from moh_dit.snapshots import read_snapshot_metadata, snapshots_up_to

__all__ = ["rebuild_pipeline", "export_posthoc", "sweep"]

logger = logging.getLogger(__name__)


def rebuild_pipeline(
    run: str | os.PathLike, sigma_rel: float, step: int | None = None, device: str = "cpu"
) -> MoHDiTPipeline:
    """The run's pipeline (its newest checkpoint's VAE and class names) with the transformer's weights rebuilt at
    ``sigma_rel`` from the snapshots up to ``step``; ``pipe.posthoc`` records the snapshots and coefficients."""
    latest = newest_checkpoint(run)
    pipe = load_pipeline(latest, device="cpu", log=False)  # its weights are replaced: the log says what by
    pipe.posthoc = rebuild_weights(pipe.transformer, run, sigma_rel, step, latest.name)
    pipe.provenance = dict(pipe.provenance, step=pipe.posthoc["step"], posthoc_ema=pipe.posthoc)
    return pipe.to(device)


def export_posthoc(
    run: str | os.PathLike,
    sigma_rel: float,
    out: str | os.PathLike,
    step: int | None = None,
    transformer_only: bool = False,
) -> Path:
    """Write the rebuilt EMA as a pipeline folder (or a bare transformer folder) whose manifest (or
    ``posthoc_ema.json``) says which snapshots and coefficients made it."""
    pipe = rebuild_pipeline(run, sigma_rel, step)
    out = Path(out)
    if transformer_only:
        from moh_dit.files import atomic_folder, atomic_write_json

        with atomic_folder(out, "the rebuilt transformer") as tmp:
            pipe.transformer.save_pretrained(tmp, safe_serialization=True)
            atomic_write_json(tmp / "posthoc_ema.json", dict(pipe.posthoc, run=str(Path(run).resolve())))
        return out
    source = {"run": str(Path(run).resolve()), "step": pipe.posthoc["step"], "weights": "posthoc-ema"}
    return pipe.save(out, dict(source, posthoc_ema=pipe.posthoc))


def sweep(
    run: str | os.PathLike,
    sigma_rels: list[float],
    guidance_scales: list[float],
    settings,
    reference: str | os.PathLike,
    extractor,
    out: str | os.PathLike,
    step: int | None = None,
    options=None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Score the rebuilt EMA at every width and guidance scale, and the run's own fixed-decay EMA beside them, with
    :func:`moh_dit.evaluation.model_scores.sample_and_score` (what ``moh-dit evaluate --model`` runs); write
    ``posthoc_sweep.{json,md,png}`` into ``out``. Sample folders are kept under ``out/samples`` and reused, and the
    rows of an earlier sweep in ``out`` of the same run, step, sample count, sampler and scoring are kept beside the
    new ones (a row scored again replaces its old one), so widths can be added to a sweep later."""
    from dataclasses import replace

    from moh_dit.evaluation.model_scores import sample_and_score
    from moh_dit.files import atomic_write_json, atomic_write_text

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    snapshots = snapshots_up_to(run, step)
    step = read_snapshot_metadata(snapshots[-1])["step"]
    checkpoint = RunLayout(run).checkpoint(step)
    rows = []

    def score(pipe, label: str, sigma_rel: float | None, error: float | None) -> None:
        for scale in guidance_scales:
            spec = settings.sampling.replace(guidance_scale=scale)
            folder = out / "samples" / f"{label}-cfg{scale:g}{spec.tag()}"
            result = sample_and_score(
                pipe,
                folder,
                replace(settings, sampling=spec),
                reference,
                extractor,
                options,
                overwrite=True,
            )
            metrics = result["metrics"]
            rows.append(
                {"weights": label, "sigma_rel": sigma_rel, "profile_error": error, "guidance": scale, **metrics}
            )
            logger.info(
                "%s, guidance %g: KID %.5f, FID %.3f", label, scale, metrics["kid"], metrics.get("fid", float("nan"))
            )

    for sigma_rel in sigma_rels:
        pipe = rebuild_pipeline(run, sigma_rel, step, device)
        score(pipe, f"posthoc-{sigma_rel:g}", sigma_rel, pipe.posthoc["profile_error"])
    if checkpoint.is_dir():  # the EMA of the run's fixed decay, at the same step
        score(load_pipeline(checkpoint, device=device), "fixed-ema", None, None)
    result = {
        "run": str(Path(run).resolve()),
        "step": step,
        "num_samples": settings.num_samples,
        "sampling": settings.sampling.record(),
        "extractor": getattr(extractor, "name", str(extractor)),
        "reference": str(reference),
        "rows": rows,
    }
    result["rows"] = _with_earlier_rows(out / "posthoc_sweep.json", result)
    atomic_write_json(out / "posthoc_sweep.json", result)
    atomic_write_text(out / "posthoc_sweep.md", _table(result))
    _plot(result, out / "posthoc_sweep.png")
    return result


def _with_earlier_rows(path: Path, result: dict) -> list[dict]:
    """``result``'s rows and those of the sweep at ``path`` that were made alike and not scored again, ordered by
    width (the fixed EMA last), then guidance."""
    rows = result["rows"]
    if path.is_file():
        try:
            earlier = json.loads(path.read_text())
            alike = isinstance(earlier, dict) and all(earlier.get(k) == result[k] for k in result if k != "rows")
        except (OSError, ValueError):  # unreadable: not a sweep to add to
            alike = False
        if alike:
            scored = {(r["weights"], r["guidance"]) for r in rows}
            kept = [r for r in earlier["rows"] if (r["weights"], r["guidance"]) not in scored]
            rows = kept + rows
            if kept:
                logger.info("kept %d rows of the earlier sweep in %s", len(kept), path.parent)
        else:
            logger.warning("%s is unreadable or from another sweep (run, step, samples or scoring): replaced", path)
    return sorted(rows, key=lambda r: (r["sigma_rel"] is None, r["sigma_rel"] or 0.0, r["guidance"]))


def _table(result: dict) -> str:
    lines = [
        f"# Post-hoc EMA sweep of {result['run']} at step {result['step']}",
        "",
        f"{result['num_samples']} samples per row, {result['extractor']} features against {result['reference']}.",
        "",
        "Profile error: how far the snapshots' combination is from the wanted EMA profile (relative L2; 0 at a",
        "tracked width).",
        "",
        "| weights | sigma_rel | profile error | guidance | KID | FID | precision | recall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        sigma = f"{r['sigma_rel']:g}" if r["sigma_rel"] is not None else "-"
        error = f"{r['profile_error']:.3f}" if r.get("profile_error") is not None else "-"
        lines.append(
            f"| {r['weights']} | {sigma} | {error} | {r['guidance']:g} | {r['kid']:.5f} | "
            f"{r.get('fid', float('nan')):.3f} | "
            f"{r.get('precision', float('nan')):.3f} | {r.get('recall', float('nan')):.3f} |"
        )
    return "\n".join(lines) + "\n"


def _plot(result: dict, path: Path) -> bool:
    """KID against sigma_rel, one line per guidance scale, the fixed-decay EMA as a dashed line of its colour."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for scale in dict.fromkeys(r["guidance"] for r in result["rows"]):
        mine = sorted((r["sigma_rel"], r["kid"]) for r in result["rows"] if r["guidance"] == scale and r["sigma_rel"])
        line = ax.plot([s for s, _ in mine], [k for _, k in mine], marker="o", label=f"post-hoc, guidance {scale:g}")[
            0
        ]
        fixed = [r["kid"] for r in result["rows"] if r["guidance"] == scale and r["sigma_rel"] is None]
        if fixed:
            ax.axhline(fixed[0], color=line.get_color(), linestyle="--", label=f"fixed EMA, guidance {scale:g}")
    ax.set(xlabel="sigma_rel of the rebuilt EMA", ylabel="KID", title=f"Post-hoc EMA at step {result['step']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
