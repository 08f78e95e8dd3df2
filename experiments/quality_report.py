"""The MoH-DiT against DiT study's arms (``experiments/quality.py`` trains and scores them) and its report:
RESULTS.md and its plots."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from experiments.common import ROOT
from experiments.report import fmt, mean_ci, pyplot, seedwise

__all__ = ["make_plots", "report", "paired", "conclusion", "ARMS", "MODELS", "RECIPE", "SCRATCH", "TIMESTEPS", "slug"]

# every run's recipe: the embedded default's when the study began (b32), frozen byte for byte (its content is
# part of the records' identity, so a later default cannot mix into them)
RECIPE = ROOT / "experiments" / "configs" / "fashion_mnist_moh_v2.yaml"
MODELS = ("DiT-Ti/4", "MoH-DiT-Ti/4-90", "MoH-DiT-Ti/4-75", "MoH-DiT-Ti/4-50")
CONVERSIONS = {  # the head tables of the MoH-DiT-Ti/4 presets: shared heads and top-k per layer
    "MoH-75": ([2, 2, 2, 2, 3, 6], [2, 2, 2, 2, 2, 0]),
    "MoH-50": (2, 1),
}
SCRATCH = {"MoH-75": "MoH-DiT-Ti/4-75", "MoH-50": "MoH-DiT-Ti/4-50"}  # each conversion's architecture in the study
ARMS = ("DiT", *CONVERSIONS)  # DiT: the study's DiT trained on with the fine-tuning settings
TIMESTEPS = [999, 800, 600, 400, 200, 50]  # where the head usage is read


def slug(name: str) -> str:
    return name.replace("/", "_")


def per_model(records: list[dict], model: str, setting: str, key: str) -> list[float]:
    return [r[setting][key] for r in sorted(records, key=lambda r: r["seed"]) if r["model"] == model]


def paired(records: list[dict], model: str, base: str, setting: str, key: str) -> dict | None:
    """The difference to ``base`` paired by seed, with a 95% t-interval."""
    a, b = per_model(records, model, setting, key), per_model(records, base, setting, key)
    if len(a) != len(b) or len(a) < 2:
        return None
    return mean_ci([x - y for x, y in zip(a, b)])


def make_plots(result: dict, out: Path) -> dict:
    plt = pyplot()
    if plt is None:
        return {}
    plots = {}
    study = result.get("study")
    if study:
        fig, ax = plt.subplots(figsize=(6, 4))
        for model in result["models"]:
            runs = [r["loss_curve"] for r in study["records"] if r["model"] == model]
            if not runs:
                continue
            steps = [s for s, _ in runs[0]]
            losses = np.array([[v for _, v in r[: len(steps)]] for r in runs if len(r) >= len(steps)])
            ax.plot(steps, losses.mean(0), label=model)
            ax.fill_between(steps, losses.min(0), losses.max(0), alpha=0.2)
        ax.set(
            xlabel="step",
            ylabel="diffusion loss (MSE + VB)",
            yscale="log",
            title="Training loss (band: min..max over seeds)",
        )
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "loss_curves.png", dpi=110)
        plt.close(fig)
        plots["loss"] = "loss_curves.png"
        for model, u in study["head_usage"].items():
            if u is None:
                continue
            u = np.array(u, dtype=float)
            fig, axes = plt.subplots(1, u.shape[0], figsize=(2.2 * u.shape[0], 2.8), sharey=True)
            for layer, ax in enumerate(np.atleast_1d(axes)):
                im = ax.imshow(u[layer], vmin=0, vmax=1, cmap="viridis", aspect="auto")
                ax.set_xticks(range(len(TIMESTEPS)), [str(t) for t in TIMESTEPS], rotation=90, fontsize=6)
                ax.set_title(f"layer {layer}", fontsize=8)
                ax.set_xlabel("timestep", fontsize=7)
            np.atleast_1d(axes)[0].set_ylabel("head")
            fig.colorbar(im, ax=list(np.atleast_1d(axes)), shrink=0.8, label="share of tokens")
            fig.suptitle(f"{model}: head usage vs timestep (noise decreases to the right)", fontsize=9)
            name = f"head_usage_{slug(model)}.png"
            fig.savefig(out / name, dpi=110)
            plt.close(fig)
            plots[model] = name
    cont = result.get("continue")
    if cont:
        fig, ax = plt.subplots(figsize=(6, 4))
        for arm in dict.fromkeys(r["arm"] for r in cont["records"]):
            points, means, lows, highs = [], [], [], []
            for point in cont["points"]:
                values = [r["kid"] for r in cont["records"] if r["arm"] == arm and r["step"] == point]
                if values:  # a stage may have stopped before this point
                    points.append(point)
                    means.append(statistics.mean(values))
                    lows.append(min(values))
                    highs.append(max(values))
            line = ax.plot(points, means, marker="o", label=arm if arm != "DiT" else "DiT (trained on)")[0]
            ax.fill_between(points, lows, highs, alpha=0.2)
            scratch = SCRATCH.get(arm)
            values = (
                per_model(study["records"], scratch, f"cfg{result['guidance']:g}", "kid") if study and scratch else []
            )
            if values:
                # the same architecture trained from scratch in the study, for as many steps as the DiT before conversion
                kid = statistics.mean(values)
                ax.axhline(kid, color=line.get_color(), linestyle="--", linewidth=1, label=f"{scratch} from scratch")
        ax.set(
            xlabel="fine-tuning steps",
            ylabel="KID (classifier features)",
            title="Continue-tuning: KID against steps (band: min..max over seeds)",
        )
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "continue_tuning_kid.png", dpi=110)
        plt.close(fig)
        plots["continue"] = "continue_tuning_kid.png"
    return plots


def report(result: dict, plots: dict) -> str:
    sc, g = result["settings"], f"cfg{result['guidance']:g}"
    scheduler, steps = sc["sampler"]
    lines = [
        "# MoH-DiT against DiT on Fashion-MNIST (evidence v2)",
        "",
        f"Scale `{result['scale']}`: every model trained with the v2 embedded default's recipe "
        f"(`{RECIPE.relative_to(ROOT)}`: pixel space 28 x 28, same steps, schedule, EMA and data), planned for "
        f"seeds {list(sc['seeds'])}; {sc['samples']} class-balanced samples per model and setting ({scheduler}, {steps} "
        f"steps; no guidance and guidance {result['guidance']:g}) scored against {sc['reference']} Fashion-MNIST test "
        "images with the project's classifier features (`experiments/fmnist_classifier.py`). Across seeds: mean "
        "[95% t-interval]. KID is the number to compare at this sample count (unbiased); FID is shown for "
        f"completeness. Reproduce: `python -m experiments.quality --scale {result['scale']}`.",
        "",
        *status(result),
        *[f"Note: {note}" for note in result.get("notes", [])],
        *([""] if result.get("notes") else []),
    ]
    study = result.get("study")
    if study:
        recs = study["records"]
        lines += [
            "## MoH-DiT against DiT",
            "",
            f"| model | seeds | KID (no guidance) | KID (guidance {result['guidance']:g}) "
            f"| FID (guidance {result['guidance']:g}) | precision | recall | final loss | train img/s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for m in [m for m in result["models"] if any(r["model"] == m for r in recs)]:
            loss = mean_ci([r["final_diffusion_loss"] for r in recs if r["model"] == m])
            speed = mean_ci([r["train_images_per_s"] for r in recs if r["model"] == m])
            seeds = ", ".join(str(r["seed"]) for r in recs if r["model"] == m)
            lines.append(
                f"| {m} | {seeds} | {fmt(mean_ci(per_model(recs, m, 'cfg1', 'kid')), 4)} | {fmt(mean_ci(per_model(recs, m, g, 'kid')), 4)} "
                f"| {fmt(mean_ci(per_model(recs, m, g, 'fid')), 1)} | {fmt(mean_ci(per_model(recs, m, g, 'precision')), 3)} "
                f"| {fmt(mean_ci(per_model(recs, m, g, 'recall')), 3)} | {loss['mean']:.4f} | {speed['mean']:.0f} |"
            )
        lines += [
            "",
            "Per run (90% bootstrap intervals over the samples):",
            "",
            "| model | seed | KID (guided) | FID (guided) |",
            "|---|---|---|---|",
        ]
        for r in recs:
            k, f = r[g], r[g]
            lines.append(
                f"| {r['model']} | {r['seed']} | {k['kid']:.4f} [{k['kid_interval'][0]:.4f}, {k['kid_interval'][1]:.4f}] "
                f"| {f['fid']:.1f} [{f['fid_interval'][0]:.1f}, {f['fid_interval'][1]:.1f}] |"
            )
        lines += [""]
        if "loss" in plots:
            lines += [f"![loss curves]({plots['loss']})", ""]
        for m in result["models"]:
            if m in plots:
                lines += [f"![{m} head usage]({plots[m]})", ""]
    cont = result.get("continue")
    if cont:
        lines += [
            "## Continue-tuning a trained DiT into MoH-DiT",
            "",
            f"Each seed's DiT-Ti/4 from the study, converted with `dit_to_moh` at 75% and 50% active heads, "
            f"scored at 0 steps and then fine-tuned {cont['steps']} steps (`{' '.join(cont['finetune'])}`); "
            "against it the DiT trained the same steps with the same settings. KID, guidance "
            f"{result['guidance']:g}, mean [95% t-interval] over seeds:",
            "",
            "| model | " + " | ".join(f"step {p}" for p in cont["points"]) + " |",
            "|---|" + "---|" * len(cont["points"]),
        ]
        for arm in dict.fromkeys(r["arm"] for r in cont["records"]):
            cells = []
            for point in cont["points"]:
                runs = [r for r in cont["records"] if r["arm"] == arm and r["step"] == point]
                if not runs:
                    cells.append("not run yet")
                elif len(runs) == 1:  # one seed: the run's own 90% bootstrap interval over its samples
                    lo, hi = runs[0]["kid_interval"]
                    cells.append(f"{runs[0]['kid']:.4f} [{lo:.4f}, {hi:.4f}]* (seed {runs[0]['seed']})")
                else:
                    seeds = ", ".join(str(r["seed"]) for r in runs)
                    cells.append(f"{fmt(mean_ci([r['kid'] for r in runs]), 4)} (seeds {seeds})")
            lines.append(f"| {arm if arm != 'DiT' else 'DiT (trained on)'} | " + " | ".join(cells) + " |")
        if any(
            len([r for r in cont["records"] if (r["arm"], r["step"]) == (a, p)]) == 1
            for a in ARMS
            for p in cont["points"]
        ):
            lines += [
                "",
                "\\* one seed so far: the 90% bootstrap interval of that run over its samples, not over seeds.",
            ]
        if "continue" in plots:
            lines += ["", f"![continue-tuning]({plots['continue']})"]
        lines += [""]
    lines += ["## Conclusion", "", conclusion(result), ""]
    return "\n".join(lines)


def missing_runs(result: dict) -> tuple[list[tuple[str, int]], list[tuple[int, str, int]]]:
    """The planned study runs ``(model, seed)`` and continue-tuning points ``(seed, arm, step)`` that no
    stage has scored yet."""
    seeds = result["settings"]["seeds"]
    study = {(r["model"], r["seed"]) for r in (result.get("study") or {}).get("records", [])}
    steps = result["settings"]["finetune_steps"]
    cont = {(r["seed"], r["arm"], r["step"]) for r in (result.get("continue") or {}).get("records", [])}
    return (
        [(m, s) for s in seeds for m in MODELS if (m, s) not in study],
        [(s, a, p) for s in seeds for a in ARMS for p in (0, steps // 2, steps) if (s, a, p) not in cont],
    )


def status(result: dict) -> list[str]:
    """A paragraph that says whether every planned run is in, and if not which are missing and how to add them."""
    study, cont = missing_runs(result)
    if not study and not cont:
        return ["Status: complete (every planned model, seed and fine-tuning point is scored).", ""]
    lines = ["**Status: partial.** Missing so far:"]
    scale = f" --scale {result['scale']}" if result["scale"] != "default" else ""
    for seed in dict.fromkeys(s for _, s in study):
        models = [m for m, s in study if s == seed]
        lines.append(
            f"- study, seed {seed}: {', '.join(models)} "
            f"(`python -m experiments.quality{scale} --part study --seeds {seed}`)"
        )
    for seed in dict.fromkeys(s for s, _, _ in cont):
        points = [f"{a} step {p}" for s, a, p in cont if s == seed]
        lines.append(
            f"- continue-tuning, seed {seed}: {', '.join(points)} "
            f"(`python -m experiments.quality{scale} --part continue --seeds {seed}`)"
        )
    lines += ["", "Intervals over seeds appear once a model has two seeds; single values are one seed.", ""]
    return lines


def conclusion(result: dict) -> str:
    """The reading of the numbers, from paired differences: a difference counts when its 95% interval
    excludes zero."""
    parts, g = [], f"cfg{result['guidance']:g}"
    study = result.get("study")
    if study:
        base = result["models"][0]
        for m in result["models"][1:]:
            bits = []
            for label, key, setting in (
                ("guided KID", "kid", g),
                ("unguided KID", "kid", "cfg1"),
                ("precision", "precision", g),
                ("recall", "recall", g),
            ):
                d = paired(study["records"], m, base, setting, key)
                if d is None or d["ci"] is None:
                    continue
                lo, hi = d["ci"]
                verdict = "no difference resolved" if lo <= 0 <= hi else ("lower" if hi < 0 else "higher")
                per_seed = f"; {seedwise(d['values'])}" if key == "kid" else ""
                bits.append(f"{label} {verdict} ({d['mean']:+.4f}, 95% CI [{lo:+.4f}, {hi:+.4f}]{per_seed})")
            if not any(r["model"] == m for r in study["records"]):
                continue
            if bits:
                parts.append(f"- {m} against {base}, paired by seed: " + "; ".join(bits) + ".")
            else:
                ours, theirs = per_model(study["records"], m, g, "kid"), per_model(study["records"], base, g, "kid")
                against = f"{statistics.mean(theirs):.4f}" if theirs else "not run yet"
                parts.append(
                    f"- {m} against {base}: guided KID {statistics.mean(ours):.4f} against {against} "
                    f"({len(ours)} and {len(theirs)} seed(s) so far; a paired interval needs two of each)."
                )
    cont = result.get("continue")
    if cont:
        end = cont["points"][-1]
        kid = {(r["arm"], r["seed"], r["step"]): r["kid"] for r in cont["records"]}
        for arm in [a for a in dict.fromkeys(r["arm"] for r in cont["records"]) if a != "DiT"]:
            seeds = sorted(s for a, s, p in kid if a == arm and p == end and ("DiT", s, end) in kid)
            if not seeds:
                continue
            at0 = [kid[arm, s, 0] for s in seeds if (arm, s, 0) in kid] or [float("nan")]
            tuned, dit = [kid[arm, s, end] for s in seeds], [kid["DiT", s, end] for s in seeds]
            diff = mean_ci([a - b for a, b in zip(tuned, dit)])
            ci = diff["ci"]
            verdict = (
                "no difference resolved"
                if ci and ci[0] <= 0 <= ci[1]
                else "lower (better)"
                if ci and ci[1] < 0
                else "higher (worse)"
                if ci
                else "one seed only"
            )
            parts.append(
                f"- Continue-tuning to {arm}: KID {statistics.mean(at0):.4f} right after conversion, "
                f"{statistics.mean(tuned):.4f} after {end} steps, against {statistics.mean(dit):.4f} for the DiT "
                f"trained as long: {verdict} ({diff['mean']:+.4f}"
                + (f", 95% CI [{ci[0]:+.4f}, {ci[1]:+.4f}]; {seedwise(diff['values'])})" if ci else ")")
                + scratch_clause(result, arm)
                + "."
            )
    return "\n".join(parts) if parts else "No results yet."


def scratch_clause(result: dict, arm: str) -> str:
    """How the converted-and-tuned model compares with its architecture trained from scratch in the study."""
    study, name = result.get("study") or {}, SCRATCH.get(arm)
    values = per_model(study.get("records", []), name, f"cfg{result['guidance']:g}", "kid") if name else []
    if not values:
        return ""
    return f"; {name} trained from scratch for the DiT's steps reaches {statistics.mean(values):.4f} ({len(values)} seed(s))"
