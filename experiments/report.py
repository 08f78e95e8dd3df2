"""What every study's report shares: means over seeds with 95% t-intervals, differences paired by seed and their
verdict, markdown tables of arms by seed, KID curves during training, the plots of every seed, one writer per study
folder, and the atomic write of ``results.json`` with its ``RESULTS.md``.

A study keeps its records as plain dicts; these helpers take them keyed by arm and seed, so that each study's own
report says only what is particular to it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from experiments.common import add_reference_argument, reference_protocol, t_interval
from moh_dit.data.fashion_mnist import FASHION_MNIST_CLASSES
from moh_dit.files import atomic_write_text, json_text

__all__ = [
    "mean_ci",
    "fmt",
    "fmt_values",
    "paired",
    "verdict",
    "seedwise",
    "by_seed_table",
    "curve_points",
    "curve_table",
    "pyplot",
    "plot_by_seed",
    "plot_curves",
    "hold_lock",
    "save_results",
    "study_arguments",
    "open_study",
]

BySeed = dict[int, float]


# ----------------------------------------------------------------------------------------------------
# Numbers over seeds
# ----------------------------------------------------------------------------------------------------
def mean_ci(values: Iterable[float]) -> dict[str, Any]:
    """``{"mean", "ci", "values"}``: the mean over seeds and its 95% t-interval (``None`` for one seed)."""
    values = list(values)
    return {"mean": statistics.mean(values), "ci": t_interval(values), "values": values}


def fmt(stat: dict[str, Any], digits: int = 2) -> str:
    """``mean [low, high]`` (the mean alone for one seed)."""
    if stat["ci"] is None:
        return f"{stat['mean']:.{digits}f}"
    return f"{stat['mean']:.{digits}f} [{stat['ci'][0]:.{digits}f}, {stat['ci'][1]:.{digits}f}]"


def fmt_values(values: Iterable[float], digits: int = 2) -> str:
    """:func:`fmt` of the values' :func:`mean_ci`, or ``-`` for none."""
    values = list(values)
    return fmt(mean_ci(values), digits) if values else "-"


def paired(values: BySeed, base: BySeed) -> list[float]:
    """The differences ``values - base`` of the seeds both have, in seed order."""
    return [values[s] - base[s] for s in sorted(values) if s in base]


def verdict(ci: tuple[float, float] | None, lower: str = "lower", higher: str = "higher") -> str:
    """What a paired 95% interval says: a difference counts when the interval excludes zero."""
    if ci is None:
        return "one seed only"
    if ci[0] <= 0 <= ci[1]:
        return "no difference resolved"
    return lower if ci[1] < 0 else higher


def paired_reading(what: str, values: BySeed, base: BySeed) -> str | None:
    """``- WHAT: +d [low, high], verdict.`` for the paired difference ``values - base`` (lower is better), or
    ``None`` below two seeds."""
    diff = paired(values, base)
    if len(diff) < 2:
        return None
    stat = mean_ci(diff)
    ci = stat["ci"]
    return f"- {what}: {stat['mean']:+.2f} [{ci[0]:+.2f}, {ci[1]:+.2f}], {verdict(ci, 'better', 'worse')}."


def paired_readings(comparisons) -> list[str]:
    """One :func:`paired_reading` line per ``(what, values, base)`` that has two seeds or more; a line saying so when
    none has."""
    lines = [line for what, values, base in comparisons if (line := paired_reading(what, values, base))]
    return lines or ["No paired results yet."]


def seedwise(values: list[float]) -> str:
    """Each seed's difference, and whether they agree in sign (a hint that two seeds cannot resolve)."""
    signs = {v > 0 for v in values}
    agree = "same sign in every seed" if len(signs) == 1 else "signs differ between seeds"
    return f"per seed {', '.join(f'{v:+.2f}' for v in values)}: {agree}"


# ----------------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------------
def by_seed_table(
    labels: tuple[str, ...], rows: list[tuple[tuple[str, ...], BySeed, BySeed | None]], base_name: str, digits: int = 2
) -> list[str]:
    """A markdown table with one line per ``(label cells, values by seed, the baseline's values or None)``: the
    labels, each seed's value, the mean [95% t] and the difference from the baseline paired by seed (empty for the
    baseline itself)."""
    seeds = sorted({s for _, values, _ in rows for s in values})
    lines = [
        f"| {' | '.join(labels)} | "
        + " | ".join(f"seed {s}" for s in seeds)
        + f" | mean [95% t] | vs {base_name}, paired |",
        "|" + "---|" * len(labels) + "---|" * len(seeds) + "---|---|",
    ]
    for cells, values, base in rows:
        diff = paired(values, base) if base is not None else []
        shown = " | ".join(f"{values[s]:.{digits}f}" if s in values else "-" for s in seeds)
        lines.append(
            f"| {' | '.join(cells)} | {shown} | {fmt_values(values.values(), digits)} | "
            f"{fmt_values(diff, digits) if diff else ''} |"
        )
    return lines


def curve_points(runs: Iterable[dict], key: str = "kid") -> dict[str, dict[int, BySeed]]:
    """The evaluations during training of each run (``{"arm", "seed", "curve": [{"step", key}, ...]}``) by arm,
    then step, then seed."""
    points: dict[str, dict[int, BySeed]] = {}
    for run in runs:
        for point in run["curve"]:
            if point.get(key) is not None:
                points.setdefault(run["arm"], {}).setdefault(point["step"], {})[run["seed"]] = point[key]
    return points


def curve_table(runs: Iterable[dict], arms: list[str], pairs: list[tuple[str, str]], key: str = "kid") -> list[str]:
    """Per step and arm, the mean over seeds [95% t] of ``key`` during training, and each ``(arm, baseline)``
    pair's difference paired by seed."""
    points = curve_points(runs, key)
    arms = [a for a in arms if a in points]
    pairs = [(a, b) for a, b in pairs if a in points and b in points]
    steps = sorted({step for a in arms for step in points[a]})
    header = arms + [f"{a} - {b}, paired" for a, b in pairs]
    lines = ["| step | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for step in steps:
        at = {a: points[a].get(step, {}) for a in arms}
        cells = [f"{fmt_values(at[a].values())} (n={len(at[a])})" for a in arms]
        cells += [fmt_values(paired(at[a], at[b])) for a, b in pairs]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return lines


# ----------------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------------
def pyplot():
    """matplotlib's pyplot on the file-only backend, or ``None`` where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_by_seed(ax, groups: list[str], arms: dict[str, list[BySeed]], ylabel: str) -> None:
    """For each group (an NFE budget, a setting) and arm: every seed a dot, the mean with its 95% t-interval.
    ``arms[arm][i]`` holds the arm's values by seed in group ``i``."""
    for offset, (arm, per_group) in enumerate(arms.items()):
        for i, values in enumerate(per_group):
            values = list(values.values())
            if not values:
                continue
            x = i + 0.25 * (offset - (len(arms) - 1) / 2)
            ax.plot([x] * len(values), values, "o", color=f"C{offset}", alpha=0.5)
            interval, mean = t_interval(values), statistics.mean(values)
            err = [[mean - interval[0]], [interval[1] - mean]] if interval else None
            label = arm if i == 0 else None
            ax.errorbar([x], [mean], yerr=err, fmt="_", markersize=14, capsize=4, color=f"C{offset}", label=label)
    ax.set_xticks(range(len(groups)), groups)
    ax.set(xlabel="each seed a dot; the mean with its 95% t-interval", ylabel=ylabel)
    ax.legend(fontsize=7)


def plot_curves(ax, points: dict[str, dict[int, BySeed]], ylabel: str) -> None:
    """One line per arm: the mean over seeds at each step, and a band from the lowest to the highest seed."""
    for arm, by_step in points.items():
        steps = sorted(by_step)
        values = [list(by_step[s].values()) for s in steps]
        ax.plot(steps, [statistics.mean(v) for v in values], marker="o", label=arm)
        ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], alpha=0.2)
    ax.set(xlabel="training step", ylabel=ylabel)
    ax.legend(fontsize=7)


# ----------------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------------
def hold_lock(out: Path, study: str):
    """One writer per study folder: each part keeps ``results.json`` in memory and rewrites it, so a second process
    on the same folder would lose the first one's records. Runs in parallel take separate folders (whose ``runs``
    may be links to one folder of runs: finished runs are reused). Returns the open lock (keep it)."""
    try:
        import fcntl
    except ImportError:  # not on Windows: one process per folder is then up to the user
        return None
    handle = open(out / f".{study}.lock", "w")  # noqa: SIM115 (open for the process's life)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(
            f"another experiments.{study} process is writing {out}: wait for it, or use another --out"
        ) from None
    return handle


def save_results(out: Path, result: dict, report: str) -> None:
    """``results.json`` and ``RESULTS.md``, each written atomically, and only when its content changed (a
    ``--report-only`` on unchanged records leaves a checkout clean)."""
    for path, text in ((out / "results.json", json_text(result)), (out / "RESULTS.md", report)):
        if not (path.is_file() and path.read_text() == text):
            atomic_write_text(path, text)


# ----------------------------------------------------------------------------------------------------
# A study's command line
# ----------------------------------------------------------------------------------------------------
def study_arguments(doc: str, parts: list[str], scales: dict, scale: str, out: str) -> argparse.ArgumentParser:
    """The options every study shares: ``--part`` (one of ``parts`` or ``all``), ``--scale``, ``--seeds``,
    ``--report-only``, ``--out`` and the reference's size. A study adds its own to the parser returned."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=[*parts, "all"], default="all")
    p.add_argument("--scale", choices=list(scales), default=scale)
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: the scale's")
    p.add_argument("--report-only", action="store_true", help="RESULTS.md and the plots from results.json")
    p.add_argument("--out", default=out)
    add_reference_argument(p)
    return p


def is_recorded(rows: list[dict], match: tuple[str, ...], identity: dict) -> bool:
    """Whether ``rows`` (a study's records) hold a row equal to ``identity`` on every key of ``match``: the studies
    keep such a point rather than redo it (the records outlive the sample sets and runs, which may be gone)."""
    return any(all(r.get(k) == identity.get(k) for k in match) for r in rows)


def with_row(rows: list[dict], match: tuple[str, ...], row: dict) -> list[dict]:
    """``rows`` with ``row`` in place of any row of its identity (equal on every key of ``match``)."""
    return [r for r in rows if not is_recorded([r], match, row)] + [row]


def note_lines(result: dict) -> list[str]:
    """The records' ``notes`` (what the rows alone do not say: which machine or which training made them), each as
    its own paragraph of a report."""
    return [f"\nNote: {note}" for note in result.get("notes", [])]


def open_study(args: argparse.Namespace, scale: dict, study: str, sections: dict) -> tuple[dict, tuple[int, ...], Any]:
    """The records of ``args.out/results.json`` so far, the seeds of this run and the folder's lock (``None`` with
    ``--report-only``, which writes nothing but the report). Records written under another protocol (scale, sample
    count, reference) are refused rather than mixed into one table; ``sections`` (name: empty value) are added where
    a file written before them lacks them."""
    out = Path(args.out)
    lock = None
    if not args.report_only:
        out.mkdir(parents=True, exist_ok=True)
        lock = hold_lock(out, study)  # before reading: the records read are then the latest
    path = out / "results.json"
    protocol = {"scale": args.scale, "samples": scale["samples"]} | reference_protocol(args)
    result = {"protocol": protocol} | sections | (json.loads(path.read_text()) if path.exists() else {})
    if result["protocol"] != protocol:
        theirs = result["protocol"].get("scale")
        fix = (
            f"pass --scale {theirs} to continue them"
            if theirs != args.scale
            else "pass the options they were written with"
        )
        raise SystemExit(f"{path} was written with {result['protocol']}, not {protocol}: {fix} (or use another --out)")
    seeds = tuple(args.seeds) if args.seeds is not None else tuple(scale["seeds"])
    return result, seeds, lock


RECOGNISED_NOTE = (
    "It saturates on sandals: moh-dit 0.1's broken sandals are recognised about as often as the best recipe's, "
    "so per-class KID is the measure there."
)


def class_tables(
    rows: dict, real_recognised: list | None, what: str = "recipe", note: str = RECOGNISED_NOTE
) -> list[str]:
    """Per class: KID against the test images of that class, and how many samples the classifier recognises
    as the class they were asked for. The hard classes (sandals, sneakers, bags, ankle boots) are where
    recipes differ most; the grid shows eight samples of each, these count all of them."""
    if not all(r.get("class_kid") and r.get("recognised") for r in rows.values()):
        return []  # rows scored before these columns existed: rerun the script to fill them
    header = [
        f"| {what} | " + " | ".join(n.split("/")[0] for n in FASHION_MNIST_CLASSES) + " |",
        "|---|" + "---|" * len(FASHION_MNIST_CLASSES),
    ]

    def line(name: str, values: list, digits: int) -> str:
        return f"| {name} | " + " | ".join("-" if v is None else f"{v:.{digits}f}" for v in values) + " |"

    lines = ["Per-class KID: each class's samples against the 1,000 test images of that class.", "", *header]
    lines += [line(n, r["class_kid"], 1) for n, r in rows.items()]
    lines += [
        "",
        "Recognised: the share of each class's samples that the classifier labels as that class, and the same on "
        f"the real test images (the classifier's own errors). {note}",
        "",
        *header,
    ]
    lines += [line(n, r["recognised"], 2) for n, r in rows.items()]
    if real_recognised:
        lines.append(line("real test images", real_recognised, 2))
    seams = {n: r for n, r in rows.items() if r.get("class_seam_excess")}
    if seams:  # rows scored before the seam measure existed have none; rerunning the script adds them
        lines += [
            "",
            "Patch seams: how much sharper the lines of the model's patch grid are in the samples than in the test "
            "images of the same class (`moh_dit.evaluation.metrics.patch_seam_ratio` of the samples over that of the real "
            "images; 1 = like real images). The faint 4x4 texture of large bright areas shows up here. Any offset: "
            "the largest excess of all samples over every position of the grid (seams moved off the model's own "
            "grid, as grid averaging could, show there).",
            "",
            header[0][:-1] + "| all | any offset |",
            header[1] + "---|---|",
            *[
                line(n, [*r["class_seam_excess"], r["seam_excess"], r.get("seam_excess_any_offset")], 2)
                for n, r in seams.items()
            ],
        ]
    return lines
