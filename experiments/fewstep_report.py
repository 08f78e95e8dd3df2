"""The few-step study's settings (``experiments/fewstep.py`` trains and scores them) and its report: RESULTS.md and its
plots."""

from __future__ import annotations

from pathlib import Path

from experiments.common import describe_reference
from experiments.report import (
    by_seed_table,
    curve_points,
    fmt_values,
    note_lines,
    paired_readings,
    plot_by_seed,
    plot_curves,
    pyplot,
)

__all__ = ["MEANFLOW_STEPS", "FLOW_SAMPLER", "FLOW_STEPS", "CACHES", "best", "by_seed", "report", "reading", "plot"]

MEANFLOW_STEPS = (1, 2, 4)
FLOW_SAMPLER, FLOW_STEPS = "euler", (25, 50)  # the recipes study's flow sampler
CACHES = ("none", "first-block", "magcache", "taylorseer")


def _shown(scale: float | None) -> str:
    return "not swept yet" if scale is None else f"{scale:g}"


def best(result: dict, kind: str) -> float | None:
    rows = [r for r in result["sweep"] if r["kind"] == kind]
    return min(rows, key=lambda r: r["kid"])["scale"] if rows else None


def by_seed(result: dict, kind: str, steps: int, key: str = "kid") -> dict[int, float]:
    return {r["seed"]: r[key] for r in result["scores"] if (r["kind"], r["steps"]) == (kind, steps)}


def time_ratios(times: dict[int, float], base: dict[int, float]) -> list[float]:
    """Each seed's sampling time over the baseline's at the same seed (both timed on one machine), in seed order."""
    return [times[s] / base[s] for s in sorted(times) if base.get(s)]


def report(result: dict) -> str:
    protocol = result["protocol"]
    lines = [
        "# Few-step sampling: MeanFlow against flow matching, and sampling caches",
        "",
        f"Written by `python -m experiments.fewstep` (scale {protocol['scale']}). The embedded default's data and "
        "budget (MoH-DiT-Ti/4-75 at width 128, batch 16 x 8300 steps, its optimizer and EMA). KID x 1000 on the "
        f"project's classifier features against the {describe_reference(protocol)}; {protocol['samples']} "
        "class-balanced samples per setting; across seeds, means with 95% t-intervals and differences paired by seed. "
        "NFE: network evaluations per image (a CFG step evaluates two predictions, batched in one forward).",
    ]
    curves = [*result["training"].values(), *result.get("flow_curves", [])]
    if curves:
        lines += [
            "",
            "## During training",
            "",
            "500 unguided samples of the EMA weights at each evaluation: MeanFlow in one step, the flow twin with "
            "DPM-Solver++ 25 steps (the backbone study's flow arm); mean over seeds [95% t] (n):",
            "",
            "| step | meanflow, 1 step | flow, 25 steps |",
            "|---|---|---|",
        ]
        points = curve_points(curves)
        for step in sorted({s for arm in points.values() for s in arm}):
            cells = [points.get(a, {}).get(step, {}) for a in ("meanflow", "flow")]
            lines.append(f"| {step} | " + " | ".join(f"{fmt_values(c.values())} (n={len(c)})" for c in cells) + " |")
    if result["sweep"]:
        lines += [
            "",
            "## Guidance (seed 0)",
            "",
            "| model | steps | scale | KID [90%] | FID |",
            "|---|---|---|---|---|",
        ]
        for r in sorted(result["sweep"], key=lambda r: (r["kind"], r["scale"])):
            lo, hi = r["kid_interval"]
            lines.append(
                f"| {r['kind']} | {r['steps']} | {r['scale']:g} | {r['kid']:.2f} [{lo:.2f}, {hi:.2f}] | {r['fid']:.1f} |"
            )
        lines += [
            "",
            "MeanFlow's scale is CFG on top of the guidance folded into its training (omega 1, kappa 0.5; at scale 1 "
            "a step is one evaluation, above it two); each model's rows below take its best scale here (MeanFlow "
            f"{_shown(best(result, 'meanflow'))}, the flow twin {_shown(best(result, 'flow'))} in its recorded "
            "interval).",
        ]
    if result["scores"]:
        lines += ["", "## MeanFlow at 1, 2 and 4 steps against flow at 25 and 50", ""]
        base = by_seed(result, "flow", FLOW_STEPS[0])
        rows = [(("meanflow", str(s)), by_seed(result, "meanflow", s), base) for s in MEANFLOW_STEPS]
        rows += [
            (("flow", str(s)), by_seed(result, "flow", s), base if s != FLOW_STEPS[0] else None) for s in FLOW_STEPS
        ]
        lines += by_seed_table(("model", "steps"), [r for r in rows if r[1]], f"flow at {FLOW_STEPS[0]} steps")
        lines += [
            "",
            f"| model | steps | NFE | FID | precision | recall | s / image | time / flow's at {FLOW_STEPS[0]} steps |",
            "|---|---|---|---|---|---|---|---|",
        ]
        base_time = by_seed(result, "flow", FLOW_STEPS[0], "seconds_per_image")
        for kind, steps in [*(("meanflow", s) for s in MEANFLOW_STEPS), *(("flow", s) for s in FLOW_STEPS)]:
            if by_seed(result, kind, steps):
                nfe = by_seed(result, kind, steps, "nfe")
                cells = [f"{max(nfe.values()):g}"]
                cells += [
                    fmt_values(by_seed(result, kind, steps, k).values(), d)
                    for k, d in (("fid", 1), ("precision", 3), ("recall", 3), ("seconds_per_image", 4))
                ]
                cells.append(fmt_values(time_ratios(by_seed(result, kind, steps, "seconds_per_image"), base_time), 3))
                lines.append(f"| {kind} | {steps} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "The time ratio is taken within each seed (its two models sampled on one machine) and then averaged: the "
            "seconds themselves mix machines when seeds ran on different ones.",
        ]
    if result["caches"]:
        lines += [
            "",
            "## Sampling caches (seed 0, sampled as each model records)",
            "",
            "Seconds per image as the sample sets were generated, one after the other in one process (the speed-up "
            "measured in interleaved rounds is benchmarks/results/caches_cpu_*.md); the KID difference from the "
            "uncached sampler on the same noise and labels, with the cached set's 90% interval.",
            "",
            "| model | steps | cache | KID [90%] | KID - uncached | FID | s / image | speed-up |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(result["caches"], key=lambda r: (r["kind"], r["steps"], CACHES.index(r["cache"]))):
            plain = next(
                (
                    p
                    for p in result["caches"]
                    if (p["kind"], p["steps"], p["cache"]) == (r["kind"], r["steps"], "none")
                ),
                None,
            )
            lo, hi = r["kid_interval"]
            diff = f"{r['kid'] - plain['kid']:+.2f}" if plain else "-"
            speed = (
                f"{plain['seconds_per_image'] / r['seconds_per_image']:.2f}x"
                if plain and r["seconds_per_image"]
                else "-"
            )
            lines.append(
                f"| {r['kind']} | {r['steps']} | {r['cache']} | {r['kid']:.2f} [{lo:.2f}, {hi:.2f}] | {diff} | "
                f"{r['fid']:.1f} | {r['seconds_per_image']:.4f} | {speed} |"
            )
    lines += note_lines(result)
    lines += ["", "## Reading", "", *reading(result), ""]
    return "\n".join(lines)


def reading(result: dict) -> list[str]:
    base = by_seed(result, "flow", FLOW_STEPS[0])
    return paired_readings(
        (
            f"{kind} at {steps} step{'s' if steps > 1 else ''} against flow at {FLOW_STEPS[0]}, KID",
            by_seed(result, kind, steps),
            base,
        )
        for kind, steps in [*(("meanflow", s) for s in MEANFLOW_STEPS), ("flow", FLOW_STEPS[1])]
    )


def plot(result: dict, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    curves = [*result["training"].values(), *result.get("flow_curves", [])]
    if curves:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        plot_curves(ax, curve_points(curves), "unguided KID x 1000 (500 samples)")
        ax.set(yscale="log", title="meanflow: 1 step; flow: DPM-Solver++ 25 steps")
        fig.tight_layout()
        fig.savefig(out / "kid_during_training.png", dpi=110)
        plt.close(fig)
    if result["scores"]:
        groups = [f"meanflow {s}" for s in MEANFLOW_STEPS] + [f"flow {s}" for s in FLOW_STEPS]
        values = [by_seed(result, "meanflow", s) for s in MEANFLOW_STEPS] + [
            by_seed(result, "flow", s) for s in FLOW_STEPS
        ]
        fig, ax = plt.subplots(figsize=(7.5, 3.8))
        plot_by_seed(ax, groups, {"KID": values}, "KID x 1000")
        ax.set_title("Each setting at every seed (steps = network evaluations, MeanFlow unguided)")
        fig.tight_layout()
        fig.savefig(out / "kid_by_steps.png", dpi=110)
        plt.close(fig)
