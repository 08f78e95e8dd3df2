"""The report of the recipes study (``experiments/recipes.py``): RESULTS.md and its plots, from results.json."""

from __future__ import annotations

import statistics
from pathlib import Path

from experiments.common import describe_reference
from experiments.report import by_seed_table, curve_points, curve_table, plot_by_seed, plot_curves, pyplot

__all__ = ["COMPARISONS", "TITLES", "NFE_BUDGETS", "report", "plot", "compare_table", "posthoc_table", "runs_table"]

NFE_BUDGETS = (25, 50)
# each comparison: its arms, the first the baseline the others are paired against
COMPARISONS = {"objective": ("moh-ddpm", "moh-flow", "dit-flow"), "repa": ("moh-flow", "moh-flow-repa")}
TITLES = {"objective": "DDPM against flow matching", "repa": "REPA"}
ARM_ORDER = list(dict.fromkeys(arm for arms in COMPARISONS.values() for arm in arms))


def by_seed(records: list[dict], arm: str, budget: int) -> dict[int, float]:
    return {r["seed"]: r["kid"] for r in records if r["arm"] == arm and r["budget"] == budget}


def compare_table(records: list[dict], arms: list[str], budgets, base: str) -> list[str]:
    """Each arm's KID per seed at each NFE budget (its best sampler there), the mean and the difference from
    ``base`` paired by seed."""
    rows = []
    for budget in budgets:
        for arm in arms:
            kid = by_seed(records, arm, budget)
            if kid:
                r = next(r for r in records if r["arm"] == arm and r["budget"] == budget)
                sampler = f"{r['scheduler']} {r['steps']}, guidance {r['guidance']:g}"
                rows.append(
                    ((arm, str(r["nfe"]), sampler), kid, by_seed(records, base, budget) if arm != base else None)
                )
    return by_seed_table(("arm", "NFE", "sampler"), rows, base)


def posthoc_by_seed(posthoc: dict) -> dict[tuple[str, float], dict[int, dict]]:
    """The sweeps' rows keyed by (weights, guidance), then seed."""
    rows: dict[tuple[str, float], dict[int, dict]] = {}
    for seed, swept in posthoc.items():
        for r in swept["rows"]:
            rows.setdefault((r["weights"], r["guidance"]), {})[int(seed)] = r
    return rows


def posthoc_table(posthoc: dict, baseline: str = "fixed-ema") -> list[str]:
    """KID per seed, mean [95% t] and the difference from the fixed EMA paired by seed, per weights and guidance."""
    rows = posthoc_by_seed(posthoc)
    table = []
    for (weights, guidance), by in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0] == baseline, kv[0][0])):
        base = {s: r["kid"] for s, r in rows.get((baseline, guidance), {}).items()}
        kid = {s: r["kid"] for s, r in by.items()}
        table.append(((weights, f"{guidance:g}"), kid, base if weights != baseline else None))
    return by_seed_table(("weights", "guidance"), table, baseline)


def runs_table(training: dict, arms: list[str], pairs: list[tuple[str, str]]) -> list[str]:
    """The unguided KID during training per step: each arm's mean over seeds, and each pair's paired difference."""
    return curve_table(training.values(), arms, pairs)


def report(result: dict) -> str:
    protocol = result["protocol"]
    lines = [
        "# Newer recipes on the embedded default: flow matching, REPA, post-hoc EMA",
        "",
        f"Written by `python -m experiments.recipes` (scale {protocol['scale']}). {protocol['samples']} class-balanced "
        f"samples per score against the {describe_reference(protocol)} with the project's classifier features; "
        "KID x 1000 (lower is better) with each run's 90% bootstrap interval in results.json; across seeds, means "
        "with 95% t-intervals and differences paired by seed. NFE: network evaluations per image, counted.",
        "",
        "## Training",
        "",
        "| run | images/s (median) | final loss | final REPA loss | KID during training (step: KID) |",
        "|---|---|---|---|---|",
    ]
    for name, t in result["training"].items():
        curve = ", ".join(f"{p['step']}: {p['kid']:.1f}" for p in t["curve"] if p.get("kid") is not None)
        repa = f"{t['final_repa_loss']:.3f}" if t.get("final_repa_loss") is not None else "-"
        loss = f"{t['final_loss']:.4f}" if t.get("final_loss") is not None else "-"
        lines.append(f"| {name} | {t['median_images_per_s']:.0f} | {loss} | {repa} | {curve} |")
    if result["training"]:
        lines += ["", "Unguided KID x 1000 during training, mean over seeds [95% t] (n seeds):", ""]
        pairs = [(arm, arms[0]) for arms in COMPARISONS.values() for arm in arms[1:]]
        lines += runs_table(result["training"], ARM_ORDER, pairs)
    for objective, rows in result["samplers"].items():
        lines += [
            "",
            f"## Samplers of {objective} (seed 0)",
            "",
            "| sampler | steps | NFE | guidance | KID [90%] | FID | precision | recall | s / image |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(rows, key=lambda r: (r["guidance"] != 4.0, r["nfe"], r["scheduler"], r["guidance"])):
            lo, hi = r["kid_interval"]
            lines.append(
                f"| {r['scheduler']} | {r['steps']} | {r['nfe']} | {r['guidance']:g} | {r['kid']:.2f} [{lo:.2f}, {hi:.2f}] | "
                f"{r['fid']:.1f} | {r['precision']:.3f} | {r['recall']:.3f} | {r['seconds_per_image']:.3f} |"
            )
        picks = result["choice"].get(objective, {})
        lines += [
            "",
            "Chosen: "
            + "; ".join(
                f"NFE {b}: {p['scheduler']} {p['steps']} steps, guidance {p['guidance']:g}" for b, p in picks.items()
            ),
        ]
    for name, arms in COMPARISONS.items():
        if result[name]:
            lines += ["", f"## {TITLES[name]}", ""]
            lines += compare_table(result[name], arms, NFE_BUDGETS, arms[0])
    if result["posthoc"]:
        lines += ["", "## Post-hoc EMA across seeds (moh-ddpm)", ""]
        lines += posthoc_table(result["posthoc"])
    for seed, swept in result["posthoc"].items():
        lines += ["", f"## Post-hoc EMA (moh-ddpm, seed {seed}, step {swept['step']})", ""]
        lines += ["| weights | guidance | KID | FID |", "|---|---|---|---|"]
        for r in swept["rows"]:
            lines.append(f"| {r['weights']} | {r['guidance']:g} | {r['kid']:.2f} | {r['fid']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> None:
    """KID against NFE per sampler (seed 0), each seed's KID per arm and NFE, KID during training per arm (mean over
    seeds, min-max band) and the post-hoc EMA sweeps."""
    plt = pyplot()
    if plt is None:
        return
    if result["samplers"]:
        fig, axes = plt.subplots(1, len(result["samplers"]), figsize=(5 * len(result["samplers"]), 3.6), squeeze=False)
        for ax, (objective, rows) in zip(axes[0], result["samplers"].items()):
            for scheduler in dict.fromkeys(r["scheduler"] for r in rows):
                points = sorted(
                    (r["nfe"], r["kid"]) for r in rows if r["scheduler"] == scheduler and r["guidance"] == 4.0
                )
                ax.plot(*zip(*points), marker="o", label=scheduler)
            ax.set(title=f"{objective} (seed 0, guidance 4)", xlabel="NFE", ylabel="KID x 1000")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "kid_vs_nfe.png", dpi=110)
        plt.close(fig)
    comparisons = [(name, arms) for name, arms in COMPARISONS.items() if result[name]]
    if comparisons:
        fig, axes = plt.subplots(1, len(comparisons), figsize=(5 * len(comparisons), 3.6), squeeze=False)
        for ax, (name, arms) in zip(axes[0], comparisons):
            values = {arm: [by_seed(result[name], arm, b) for b in NFE_BUDGETS] for arm in arms}
            plot_by_seed(ax, [f"NFE {b}" for b in NFE_BUDGETS], values, "KID x 1000 (each arm's best sampler)")
            ax.set_title(TITLES[name])
        fig.tight_layout()
        fig.savefig(out / "kid_by_seed.png", dpi=110)
        plt.close(fig)
    curves = curve_points(result["training"].values())
    if curves:
        fig, ax = plt.subplots(figsize=(6, 4))
        plot_curves(ax, curves, "KID x 1000 (500 unguided samples)")
        ax.set(yscale="log", title="During training")
        fig.tight_layout()
        fig.savefig(out / "kid_during_training.png", dpi=110)
        plt.close(fig)
    if result["posthoc"]:
        plot_posthoc(posthoc_by_seed(result["posthoc"]), out / "posthoc_by_seed.png", plt)


def plot_posthoc(rows: dict[tuple[str, float], dict[int, dict]], path: Path, plt) -> None:
    """KID against sigma_rel per guidance: each seed a dot, the mean a line; the fixed EMA's mean a dashed line."""
    guidances = sorted({g for _, g in rows})
    fig, axes = plt.subplots(1, len(guidances), figsize=(5 * len(guidances), 3.6), squeeze=False)
    for ax, guidance in zip(axes[0], guidances):
        swept = sorted(
            (next(iter(by.values()))["sigma_rel"], by)
            for (weights, g), by in rows.items()
            if g == guidance and weights != "fixed-ema"
        )
        for sigma_rel, by in swept:
            ax.plot([sigma_rel] * len(by), [r["kid"] for r in by.values()], "o", color="C0", alpha=0.4)
        ax.plot(
            [x for x, _ in swept],
            [statistics.mean(r["kid"] for r in by.values()) for _, by in swept],
            "-",
            color="C0",
            label="post-hoc EMA (mean over seeds)",
        )
        fixed = rows.get(("fixed-ema", guidance))
        if fixed:
            ax.axhline(
                statistics.mean(r["kid"] for r in fixed.values()), color="C1", ls="--", label="fixed EMA (mean)"
            )
        ax.set(title=f"guidance {guidance:g}", xlabel="sigma_rel", ylabel="KID x 1000")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
