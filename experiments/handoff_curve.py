r"""The hand-off's whole curve: a generator trained for a lead (``distill.dmd_input: lead``) trained again, past its
recipe's length, with its two steps evaluated during training as the hand-off it is sampled with (the lead's first
step, then its second), beside the same arm's evaluations of its own two steps.

    python -m experiments.handoff_curve --arm-run <the study's run folder of a -lead arm> --times 3 \
        --name flow-seed0 --out experiments/results/handoff_curve

The arm's run folder (``experiments.distill --part train`` wrote it) holds the config it trained with; the new run
takes it with ``train.max_steps`` times ``--times``, into ``--runs/<name>``. At a constant rate and the same seed the
new run repeats the arm's to its length: the script checks that each shared evaluation's one-step scores are the
arm's to the last digit, so the curve past the length is the arm's run continued. The in-training evaluations are
500 class-balanced samples scored against the test images: they read the trend, the study's 5000-sample scores the
level. A finished run is reused; an interrupted one continues (``train.resume=latest``). Writes RESULTS.md,
results.json and handoff_curve.png under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from experiments.common import ROOT
from experiments.report import pyplot, save_results
from moh_dit.errors import ConfigError
from moh_dit.run_folder import RunLayout
from moh_dit.training.config import load_config
from moh_dit.training.quality import EVALUATION, read_records
from moh_dit.training.trainer import train

SHARED = ("kid", "recall")  # the one-step scores that must repeat to the digit where the two runs overlap


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm-run", required=True, help="the study's run folder of an arm trained for a lead")
    p.add_argument("--times", type=int, default=3, help="the new run's length, in the arm's lengths")
    p.add_argument("--name", required=True, help="the curve's name (its run folder and its record)")
    p.add_argument("--runs", default="runs/handoff_curve")
    p.add_argument("--out", default="experiments/results/handoff_curve")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    arm, run, out = Path(args.arm_run), Path(args.runs) / args.name, ROOT / args.out
    config = load_config(arm / "config.yaml")
    if config.distill.dmd_input != "lead" or not config.log.eval_every or 2 not in config.log.eval_also_steps:
        raise ConfigError(f"{arm} is not a run trained for a lead with two-step evaluations (distill.dmd_input: lead, "
                          "log.eval_also_steps with 2)")  # fmt: skip
    length = config.train.max_steps
    overrides = [f"train.output_dir={run}", f"train.max_steps={length * args.times}"]
    resume = ["train.resume=latest"] if RunLayout(run).latest_checkpoint() is not None else []
    summary = train(load_config(arm / "config.yaml", overrides + resume))
    if summary["stop_reason"] != "max_steps":
        raise SystemExit(f"{run} stopped at step {summary['step']}; rerun the same command to continue")
    led, alone = read_records(RunLayout(run).metrics, EVALUATION), read_records(RunLayout(arm).metrics, EVALUATION)
    check_same_run(led, alone)
    curve = {
        "arm_run": str(arm),
        "length": length,
        "times": args.times,
        "lead": led[-1].get("lead"),
        "handoff": [point(r) for r in led],
        "alone": [point(r) for r in alone],
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    result = load_curves(path) | {args.name: curve}
    draw(result, out / "handoff_curve.png")
    save_results(out, result, render(result))
    return result


def load_curves(path: Path) -> dict:
    """The curves recorded so far (one per ``--name``)."""
    return json.loads(path.read_text()) if path.is_file() else {}


def point(record: dict) -> dict:
    """The step, the one-step and the two-step scores of an evaluation record."""
    keys = ("kid", "recall", "kid@2", "recall@2")
    return {"step": record["step"], **{k: record[k] for k in keys if k in record}}


def check_same_run(longer: list[dict], arm: list[dict]) -> None:
    """The longer run is the arm's run continued: every evaluation both made has the same one-step scores."""
    mine = {r["step"]: r for r in longer}
    for r in arm:
        if r["step"] in mine and any(mine[r["step"]][k] != r[k] for k in SHARED):
            raise SystemExit(f"the new run differs from the arm's at step {r['step']}: not the same run continued "
                             "(another rate schedule, seed or code)")  # fmt: skip


def reading(curve: dict) -> str:
    """Where the hand-off's two-step KID is best, how it stands at the recipe's length, and how it moved over the
    last quarter before it: still falling there, or flat or turning up."""
    points, length = curve["handoff"], curve["length"]
    before = [p for p in points if p["step"] <= length]
    at, best = before[-1], min(points, key=lambda p: p["kid@2"])
    quarter = [p for p in before if p["step"] >= 0.75 * length]
    change = at["kid@2"] - quarter[0]["kid@2"]
    moved = (
        "still falling" if change < -0.05 * at["kid@2"] else ("turning up" if change > 0.05 * at["kid@2"] else "flat")
    )
    past = [p for p in points if p["step"] > length]
    after = f"; its end ({past[-1]['step']:,}) {past[-1]['kid@2']:.3g}" if past else ""
    return (
        f"at its last evaluation within the recipe's length (step {at['step']:,} of {length:,}) the hand-off's KID is "
        f"{at['kid@2']:.3g} (recall {at['recall@2']:.3f}), "
        f"{moved} over the last quarter ({change:+.3g}); best {best['kid@2']:.3g} at step {best['step']:,}{after}"
    )


def draw(result: dict, path: Path) -> None:
    """Each curve against its steps in recipe lengths (1: where the recipe stops), so that runs of other batches and
    lengths line up."""
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    panels = (("kid@2", "KID at two steps"), ("recall@2", "recall at two steps"), ("kid", "KID at one step"))
    for ax, (key, label) in zip(axes, panels):
        for name, curve in result.items():
            at = lambda points: zip(*[(p["step"] / curve["length"], p[key]) for p in points])  # noqa: E731
            line = ax.plot(*at(curve["handoff"]), marker="o", ms=2, label=f"{name}: {'hand-off' if '@2' in key else 'alone'}")  # fmt: skip
            if "@2" in key:
                ax.plot(*at(curve["alone"]), ls="--", color=line[0].get_color(), label=f"{name}: alone")
        ax.axvline(1.0, color="grey", ls=":", lw=1)
        ax.set_xlabel("steps, in the recipe's lengths")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(result: dict) -> str:
    lines = [
        "# The hand-off's whole curve",
        "",
        "`python -m experiments.handoff_curve`: an arm trained for a lead (`distill.dmd_input: lead`) trained again "
        "past its length, its two steps evaluated during training as the hand-off (solid) beside the arm's own run "
        "evaluated at its two steps alone (dashed), against the steps in the recipe's lengths (1, dotted: where the recipe stops). 500 class-balanced samples per "
        "point against the test images (the trend; the study's 5000-sample scores give the level). Up to the "
        "length the new run is the arm's run (its one-step scores equal to the digit).",
        "",
        "![the hand-off's curve](handoff_curve.png)",
        "",
    ]
    for name, curve in result.items():
        alone = {p["step"]: p for p in curve["alone"]}
        lines += [
            f"## {name}",
            "",
            f"`{curve['arm_run']}`, {curve['times']} times its length; lead: `{(curve['lead'] or {}).get('model')}`. "
            f"Reading: {reading(curve)}.",
            "",
            "| step | KID, 1 step | hand-off KID | hand-off recall | alone KID | alone recall |",
            "|---|---|---|---|---|---|",
        ]
        for p in curve["handoff"]:
            a = alone.get(p["step"], {})
            own = f"{a['kid@2']:.3g} | {a['recall@2']:.3f}" if a else "- | -"
            lines.append(f"| {p['step']:,} | {p['kid']:.3g} | {p['kid@2']:.3g} | {p['recall@2']:.3f} | {own} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
