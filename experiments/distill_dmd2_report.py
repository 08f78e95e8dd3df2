"""The report of the distillation study's DMD2 arms (experiments/distill_dmd2.py): the three-seed record against
the goal on 5000 samples with the teachers' own spread, the seed-0 measurements, and KID against what the whole
distillation cost, as a table and a plot (``distill_cost.png``).

What a run cost at a point of its curve: what its start cost (the student it started from, whole), its set of
trajectories (spent before its first step), and its own counted total (the networks' passes and the teacher's
evaluations) in proportion to the steps made, since a run spends alike at every step (DMD2 in whole cycles of its
updates). All of it over the teacher's training (8,300 steps x 16 images x 3 network evaluations).
"""

from __future__ import annotations

from pathlib import Path

from experiments.distill_dmd2 import (
    ANCHORS,
    ARMS,
    BUDGET,
    CHOSEN_SCALE,
    ECT_START_OF,
    ECT_STARTS,
    ECT_VARIETY_SCALE,
    FULL_VARIANTS,
    GAN_LATE,
    GAN_LOW,
    HELD_PAST_BUDGET,
    REAL_SCALES,
    RECIPE_SCALE,
    SID,
    VARIANTS,
    VARIETY_SCALES,
    budget_share,
    start_of,
    three_seed_arms,
)
from experiments.report import by_seed_table, fmt_values, paired, pyplot

__all__ = ["EARLIER_SAMPLES", "rows_at", "earlier_rows", "final_rows", "dmd2_lines", "plot_costs", "cost_curve"]

EARLIER_SAMPLES = 1000  # the arms' before the dmd2 study (their rows name no count); the dmd2 study's: the protocol's
TEACHER_STEPS = 25
FRACTIONS = (0.25, 0.5, 0.75, 1.0)  # the budgets the cost table reads each curve at
GOAL = {2: (1.25, 0.05), 1: (1.5, 0.1)}  # steps: (KID ratio to the teacher's, recall within)
NAMES = {"flow": "the flow twin", "ddpm": "the embedded default (DDPM)"}
BASELINE = ("dmd2t-",)  # the configs' recipe before the study (DMD2 from the full trajectory student), where scored
START_OF_EARLIER = {"cmt": "trajectory", "dmd2t": "trajectory"}  # the earlier arms' starts (by method)


def rows_at(result: dict, samples: int) -> list[dict]:
    """The score rows made with ``samples`` samples (a row without the count: the earlier protocol's 1000)."""
    return [r for r in result["scores"] if r.get("samples", EARLIER_SAMPLES) == samples]


def final_rows(result: dict) -> list[dict]:
    """The rows scored with the study's protocol (5000 samples at the cpu scale)."""
    return rows_at(result, result["protocol"]["samples"])


def earlier_rows(result: dict) -> list[dict]:
    """The rows of the earlier tables: those scored with 1000 samples before the protocol took 5000, or where there
    are none (a study run afresh, or at another scale) the protocol's."""
    return rows_at(result, EARLIER_SAMPLES) or final_rows(result)


def _by_seed(rows: list[dict], arm: str, steps: int, key: str = "kid") -> dict[int, float]:
    return {r["seed"]: r[key] for r in rows if (r["arm"], r["steps"]) == (arm, steps) and r.get(key) is not None}


# ----------------------------------------------------------------------------------------------------
# Costs
# ----------------------------------------------------------------------------------------------------
def _own(record: dict) -> tuple[float, float] | None:
    """A run's spending: (before its first step: its trajectories, during its steps: passes and teacher)."""
    if record.get("student_forwards") is None:
        return None
    return record.get("trajectory_evaluations", 0.0), record["student_forwards"] + record["teacher_evaluations"]


def _start(arm: str) -> str | None:
    found = start_of(arm)
    if found is None and arm.split("-")[0] in START_OF_EARLIER:
        method, _, rest = arm.partition("-")
        found = f"{START_OF_EARLIER[method]}-{rest.split('-')[0]}"
    return found


def whole_cost(training: dict, arm: str, seed: int) -> float | None:
    """The network evaluations of ``arm``'s whole distillation at ``seed`` (with the students it started from)."""
    record = training.get(f"{arm}-seed{seed}", {})
    own = _own(record)
    if own is None:
        return None
    start = _start(arm)
    before = whole_cost(training, start, seed) if start else 0.0
    return None if before is None else before + sum(own)


def cost_curve(training: dict, arm: str, seed: int, key: str = "kid") -> list[tuple[float, float]]:
    """``(cost over the teacher's training, KID)`` at each evaluation of ``arm``'s run at ``seed`` (``key``:
    ``kid@2`` for two steps)."""
    record = training.get(f"{arm}-seed{seed}", {})
    own, start = _own(record), _start(arm)
    before = whole_cost(training, start, seed) if start else 0.0
    if own is None or before is None or not record.get("steps"):
        return []
    upfront, during = own
    return [((before + upfront + during * p["step"] / record["steps"]) / BUDGET, p[key])
            for p in record.get("curve", []) if p.get(key) is not None]  # fmt: skip


def _at_budget(curve: list[tuple[float, float]], fraction: float) -> float | None:
    """The curve's last KID within ``fraction`` of the budget (a run that had not evaluated yet there: None)."""
    within = [kid for cost, kid in curve if cost <= fraction + 1e-9]
    return within[-1] if within else None


def _curved_arms(result: dict, kind: str) -> list[str]:
    arms = {r["arm"] for r in result["training"].values() if r.get("curve") and r.get("arm", "").count("-")}
    return sorted(a for a in arms if a.split("-")[1] == kind and (a.split("-")[0] != "meanflow" or a.count("-") == 1))


# ----------------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------------
def _steps(n: int) -> str:
    return f"{n} step" + ("s" if n != 1 else "")


def _final_lines(result: dict, kind: str) -> list[str]:
    rows, training = final_rows(result), result["training"]
    teacher = _by_seed(rows, kind, TEACHER_STEPS)
    recipes = three_seed_arms((kind,)) | {f"{prefix}{kind}" for prefix in BASELINE}  # beside the configs' earlier one
    arms = [a for a in sorted(recipes) if _by_seed(rows, a, 1)]
    if not teacher and not arms:
        return []
    table = [((a, str(s)), _by_seed(rows, a, s), teacher) for a in arms for s in (1, 2, 4)]
    table.append(((f"teacher ({kind})", str(TEACHER_STEPS)), teacher, None))
    samples = result["protocol"]["samples"]
    scored = sorted({s for _, values, _ in table for s in values})
    seeds = (
        "three seeds"
        if len(scored) >= 3
        else f"seed{'s' * (len(scored) > 1)} {' and '.join(map(str, scored))} of three"
    )
    lines = ["", f"### {NAMES[kind]}: {samples} samples, {seeds}", "", "KID x 1000:", ""]
    lines += by_seed_table(("model", "steps"), [r for r in table if r[1]], f"the teacher at {TEACHER_STEPS}")
    lines += ["", "| model | steps | KID / teacher's | recall | recall - teacher's | generator updates | cost / "
              "teacher's training |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    seeds = sorted(teacher)
    for arm in arms:
        updates = [training.get(f"{arm}-seed{s}", {}).get("generator_updates") for s in seeds]
        spent = [c / BUDGET for s in seeds if (c := whole_cost(training, arm, s)) is not None]
        for steps in (1, 2):
            mine, recall = _by_seed(rows, arm, steps), _by_seed(rows, arm, steps, "recall")
            ratios = [mine[s] / teacher[s] for s in seeds if s in mine]
            gaps = paired(recall, _by_seed(rows, kind, TEACHER_STEPS, "recall"))
            shown = " / ".join("-" if u is None else f"{u:,}" for u in updates)
            lines.append(f"| {arm} | {steps} | {fmt_values(ratios)} | {fmt_values(recall.values(), 3)} | "
                         f"{fmt_values(gaps, 3)} | {shown} | {fmt_values(spent)} |")  # fmt: skip
    return [*lines, "", *_goal_lines(result, kind, arms)]


def _goal_lines(result: dict, kind: str, arms: list[str]) -> list[str]:
    """The goal read off the record: per step count the best student (lowest mean KID ratio over the seeds), how
    many seeds meet it, and the teachers' own spread beside it."""
    rows, training = final_rows(result), result["training"]
    teacher = _by_seed(rows, kind, TEACHER_STEPS)
    if not teacher:
        return []
    low, high = min(teacher.values()), max(teacher.values())
    if len(teacher) < 2:
        lines = [f"The teacher's own KID: {low:.2f} (one seed: its spread between seeds is not measured yet).", ""]
    else:
        lines = [f"The teacher's own KID over its seeds: {' / '.join(f'{v:.2f}' for v in teacher.values())} (the "
                 f"highest {high / low:.2f}x the lowest: the goal's margins sit inside the teachers' spread between "
                 "seeds, which is why students are paired with their own seed's teacher).", ""]  # fmt: skip
    recall_t = _by_seed(rows, kind, TEACHER_STEPS, "recall")
    for steps, (limit, gap) in sorted(GOAL.items(), reverse=True):
        scored = {a: [(_by_seed(rows, a, steps)[s] / teacher[s], _by_seed(rows, a, steps, "recall")[s] - recall_t[s])
                      for s in sorted(teacher) if s in _by_seed(rows, a, steps)] for a in arms}  # fmt: skip
        scored = {a: v for a, v in scored.items() if v}
        if not scored:
            continue
        most = max(len(v) for v in scored.values())  # means over the same seeds: an arm with fewer is not compared
        best = min((a for a in scored if len(scored[a]) == most), key=lambda a: sum(r for r, _ in scored[a]) / most)
        pairs = scored[best]
        met = sum(r <= limit and g >= -gap for r, g in pairs)
        spent = [c / BUDGET for s in sorted(teacher) if (c := whole_cost(training, best, s)) is not None]
        lines.append(f"- **{_steps(steps)}**: the best, {best}, is at {fmt_values([r for r, _ in pairs])} x the "
                     f"teacher's KID, recall {fmt_values([g for _, g in pairs], 3)} from the teacher's (goal <= "
                     f"{limit:g}x, within {gap:g}); met at {met} of {len(pairs)} seeds; cost "
                     f"{fmt_values(spent)} x the teacher's training (goal <= 1).")  # fmt: skip
    return lines


def _handoff_lines(result: dict, kind: str) -> list[str]:
    """Each two-step generator of this teacher scored with its start's first jump (``result["handoff"]``, the study's
    samples): KID per seed beside the generator alone, paired by seed; recall likewise; each against the goal."""
    samples = result["protocol"]["samples"]
    led = [r for r in result.get("handoff", []) if r["samples"] == samples and r["arm"].split("-")[1] == kind]
    if not led:
        return []
    rows = final_rows(result)
    teacher, recall_t = _by_seed(rows, kind, TEACHER_STEPS), _by_seed(rows, kind, TEACHER_STEPS, "recall")
    limit, gap = GOAL[2]
    lines = ["", f"#### {NAMES[kind]}: the start's first jump, then the generator's second (a hand-off)", "",
             "The same two network evaluations and no more training (`--lead-model`, docs/sampling.md#hand-off); "
             "scored as the students are, each paired with the generator's own two steps at its seed.", ""]  # fmt: skip
    for arm in sorted({r["arm"] for r in led}):
        start = next(r["lead"] for r in led if r["arm"] == arm)
        mine = {r["seed"]: r for r in led if r["arm"] == arm}
        kid, recall = {s: r["kid"] for s, r in mine.items()}, {s: r["recall"] for s, r in mine.items()}
        alone, alone_recall = _by_seed(rows, arm, 2), _by_seed(rows, arm, 2, "recall")
        for what, values, base, digits in (("KID x 1000", kid, alone, 2), ("recall", recall, alone_recall, 3)):
            lines += [f"{arm}, two steps, {what}:", ""]
            lines += by_seed_table(("sampler",), [(("alone",), base, None), ((f"{start}'s first jump, then its second",),
                                                                             values, base)], "alone", digits)  # fmt: skip
            lines.append("")
        pairs = [(kid[s] / teacher[s], recall[s] - recall_t[s]) for s in sorted(kid) if s in teacher and s in recall_t]
        if pairs:
            met = sum(r <= limit and g >= -gap for r, g in pairs)
            lines += [f"- With the hand-off: {fmt_values([r for r, _ in pairs])} x the teacher's KID, recall "
                      f"{fmt_values([g for _, g in pairs], 3)} from the teacher's (goal <= {limit:g}x, within {gap:g}); "
                      f"met at {met} of {len(pairs)} seeds.", ""]  # fmt: skip
    return lines + _trained_for_lead_lines(rows, led)


def _trained_for_lead_lines(rows: list[dict], led: list[dict]) -> list[str]:
    """Each generator trained for the hand-off (``-lead[-...]``: its two-step middle on its start's first jump) beside
    the arm it varies, each alone and in the hand-off, paired by seed against that arm in the hand-off."""
    lines = []
    for arm in sorted({r["arm"] for r in led if "-lead" in r["arm"]}):
        base = arm[: arm.index("-lead")]
        handed = {a: {r["seed"]: r for r in led if r["arm"] == a} for a in (base, arm)}
        if not handed[base]:
            continue
        lines += [f"Trained for the hand-off (`{arm}`) against `{base}`:", ""]
        for what, key, digits in (("KID x 1000", "kid", 2), ("recall", "recall", 3)):
            ref = {s: r[key] for s, r in handed[base].items()}
            table = [(("the arm", "alone"), _by_seed(rows, base, 2, key), ref), (("the arm", "hand-off"), ref, None),
                     (("trained for it", "alone"), _by_seed(rows, arm, 2, key), ref),
                     (("trained for it", "hand-off"), {s: r[key] for s, r in handed[arm].items()}, ref)]  # fmt: skip
            lines += [f"two steps, {what}:", "", *by_seed_table(("generator", "sampler"), table, "the arm's hand-off", digits), ""]  # fmt: skip
    return lines


def _one_seed_lines(result: dict, kind: str, seed: int) -> list[str]:
    """Every DMD2 arm of this teacher scored at ``seed`` where that seed holds a setting measured at it alone (not a
    three-seed arm's or the baseline's), the three-seed arms and the baseline beside it where scored: its settings'
    reading at 1 and 2 steps, with recall, against the same seed's teacher."""
    rows, training = final_rows(result), result["training"]
    arms = sorted(a for a in {r["arm"] for r in rows} if a.startswith((*ARMS, *BASELINE))
                  and a.split("-")[1] == kind and _by_seed(rows, a, 1).get(seed) is not None)  # fmt: skip
    paired_arms = three_seed_arms((kind,)) | {f"{prefix}{kind}" for prefix in BASELINE}
    if not set(arms) - paired_arms:
        return []
    teacher = _by_seed(rows, kind, TEACHER_STEPS).get(seed)
    against = "" if teacher is None else f"; the teacher at {TEACHER_STEPS} steps: {teacher:.2f}"
    lines = ["", f"### {NAMES[kind]}: each setting at seed {seed} ({result['protocol']['samples']} samples{against})",
             "", "| arm | 1 step KID | 2 steps KID | 1 step recall | 2 steps recall | generator updates | cost | KID at 1 "
             "step during training (500 samples) |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm in arms:
        cells = [f"{_by_seed(rows, arm, s, k).get(seed, float('nan')):.{d}f}" for k, d in (("kid", 2), ("recall", 3))
                 for s in (1, 2)]  # fmt: skip
        record = training.get(f"{arm}-seed{seed}", {})
        spent = whole_cost(training, arm, seed)
        curve = " / ".join(f"{p['kid']:.1f}" for p in record.get("curve", []) if "kid" in p)
        lines.append(f"| {arm} | {' | '.join(cells)} | {record.get('generator_updates', '-')} | "
                     f"{'-' if spent is None else f'{spent / BUDGET:.2f}'} | {curve} |")  # fmt: skip
    return lines


def _one_seed_tables(result: dict, kind: str) -> list[str]:
    """:func:`_one_seed_lines` at every seed scored (seed 0 holds the sweep; a later seed a setting measured where its
    start was trained, e.g. a run past the budget)."""
    seeds = sorted({r["seed"] for r in final_rows(result)})
    return [line for seed in seeds for line in _one_seed_lines(result, kind, seed)]


def _cost_lines(result: dict, kind: str) -> list[str]:
    """Each method's KID (mean over its seeds) at a quarter, half, three quarters and the whole of the budget."""
    training = result["training"]
    arms = _curved_arms(result, kind)
    if not arms:
        return []
    lines = ["", f"### {NAMES[kind]}: KID against what the distillation cost", "",
             "During training (500 samples, mean over the seeds run), at the last evaluation within each share of the "
             "teacher's training cost; `-`: not evaluated yet there (the start alone cost more).", "",
             "| arm | steps | " + " | ".join(f"<= {f:g}x" for f in FRACTIONS) + " |",
             "|---|---|" + "---|" * len(FRACTIONS)]  # fmt: skip
    for arm in arms:
        seeds = sorted(r["seed"] for r in training.values() if r.get("arm") == arm)
        for steps, key in ((1, "kid"), (2, "kid@2")):
            cells = []
            for fraction in FRACTIONS:
                found = [
                    v for s in seeds if (v := _at_budget(cost_curve(training, arm, s, key), fraction)) is not None
                ]
                cells.append(fmt_values(found) if found else "-")
            lines.append(f"| {arm} | {steps} | " + " | ".join(cells) + " |")
    return lines


def _ect_variant(tail: str, change: dict) -> str:
    """One of ECT's variants as the report names it: its settings, its share of what the cheaper start leaves where it
    is not half, and its start where it is not the cheaper one."""
    share = budget_share(f"ectfew{tail}-")
    settings = ", ".join(f"{key} {value:g}" for key, value in change.items())
    origin = f" from `{ECT_START_OF[tail]}-*`" if tail in ECT_START_OF else ""
    return (
        f"`ectfew{tail}-*`: {settings}"
        + (f", {share:g} of what the cheaper start leaves" if share != 0.5 else "")
        + origin
    )


def dmd2_lines(result: dict) -> list[str]:
    """The DMD2 study's sections of RESULTS.md (nothing before its first record)."""
    if not any(r.get("arm", "").startswith(ARMS) for r in result["training"].values()):
        return []
    scales = "; ".join(f"{k}: {', '.join(f'{s:g}' for s in REAL_SCALES[k])} (the short start's variants at "
                       f"{CHOSEN_SCALE[k]:g}, the three-seed recipe at {RECIPE_SCALE[k]:g})"
                       for k in CHOSEN_SCALE)  # fmt: skip
    ect_variants = ", ".join(_ect_variant(tail, change) for tail, change in ECT_STARTS.items() if tail)
    lines = ["", "## DMD2 as its references train it, within the teacher's cost", "",
             "experiments/distill_dmd2.py's arms: a short trajectory stage (`short-*`), then DMD2 from it (`dmd2s-*`: "
             "the GAN term on real data, backward simulation, the real score at guidance g), the same from the full "
             "trajectory student (`dmd2f-*`), DMD2 from the teacher "
             "(`dmd2g-*`), a GAN fine-tune (`ganonly-*`). Each stage as long as the teacher's training leaves in "
             f"network evaluations. The real score's scales measured: {scales}. Variants of the recipe at seed 0: "
             f"{', '.join(VARIANTS)}; from the full start: {', '.join(FULL_VARIANTS)} (`x4`: four times the steps the budget "
             f"leaves, a measurement past it), and the real score below the sampler's scale from it without the GAN term "
             f"(the real score's sweep: {', '.join(f'`dmd2f-{k}-g{v:g}-nogan`' for k, vs in VARIETY_SCALES.items() for v in vs)}); "
             "the variety lever: trajectory starts recorded at lower guidance (`low-*`, `mid-*`) and the recipe from them "
             "(`dmd2l-*`, `dmd2mid-*`); the cheaper start: the full stage's steps on a quarter of its recorded set "
             f"(`few-*`) and the recipe from it (`dmd2few-*`), the same on every interval (`fewuni-*`: distill.grid_share 0), the two together (`fewlow-*`, `fewmid-*`; `dmd2fewl-*`, "
             f"`dmd2fewmid-*`); the EMA's hold on the start ({', '.join(f'`-{k}`: ema.decay {v:g}' for k, v in ANCHORS.items())} "
             f"against the recipe's 0.995, stepped once per generator update; past the budget with the recipe's share "
             f"held: {', '.join(f'`{p}-*-{k}-x4`' for p, held in HELD_PAST_BUDGET.items() for k in held)}); DMD's regression on the start's own set (`-reg*`: squared error; `-feat*`: the teacher's block features); ECT from the cheaper start (`ectfew-*`) and DMD2 from it (`dmd2ecf-*`; `dmd2ecf-*-g{ECT_VARIETY_SCALE:g}-nogan`: its real score at a lower scale), ECT's variants ({ect_variants}) and DMD2 from each (`dmd2ecf{{{','.join(t for t in ECT_STARTS if t)}}}-*`); SiD's score-identity loss in place of VSD from ECT's start at the step 0.05 (`sidecfdt-*`, alpha {SID['sid_alpha']:g}, at the EMA of each DMD2 arm it mirrors; `-f1`: SiD's one fake-score update per generator update; `-lr3e-4`: three times the rate, `-lr3e-4-alpha{{0.5,1}}`: with SiD's alpha at 0.5 or 1; `sidecfdt-*-ganlate`: with the GAN term switched on late, SiDA's pairing); the GAN term switched on late (`-ganlate`: "
             f"weight {GAN_LATE['gan_weight']:g} from step {GAN_LATE['gan_start']}) with the real score unguided, as "
             "the references pair them (`-g1-ganlate`, and `-x4` past the budget), and at the recipe's scale; the same "
             f"with its discriminator at low noise (`-ganlow`: distill.gan_time {GAN_LOW['gan_time']}). "
             f"Scored with {result['protocol']['samples']} class-balanced samples, teachers included; cost: "
             "the whole distillation over the teacher's training."]  # fmt: skip
    for kind in NAMES:
        lines += _final_lines(result, kind) + _handoff_lines(result, kind)
        lines += _one_seed_tables(result, kind) + _cost_lines(result, kind)
    return lines


def plot_costs(result: dict, out: Path) -> None:
    """distill_cost.png: KID (500 samples during training, mean over seeds) against the whole distillation's cost
    over the teacher's training, one line per arm, at one step and at two, for each teacher."""
    plt = pyplot()
    training = result["training"]
    if plt is None or not any(_curved_arms(result, k) for k in NAMES):
        return
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    for row, kind in enumerate(NAMES):
        for col, (steps, key) in enumerate(((1, "kid"), (2, "kid@2"))):
            ax = axes[row][col]
            for arm in _curved_arms(result, kind):
                seeds = sorted(r["seed"] for r in training.values() if r.get("arm") == arm)
                curves = [c for s in seeds if (c := cost_curve(training, arm, s, key))]
                if not curves:
                    continue
                n = min(len(c) for c in curves)
                xs = [sum(c[i][0] for c in curves) / len(curves) for i in range(n)]
                ys = [sum(c[i][1] for c in curves) / len(curves) for i in range(n)]
                ax.plot(xs, ys, marker="o", markersize=3, label=f"{arm} (n={len(curves)})")
            ax.axvline(1.0, color="gray", linestyle=":")
            ax.set_yscale("log")
            ax.set_xlabel("cost / the teacher's training (network evaluations)")
            ax.set_ylabel(f"KID x 1000, {_steps(steps)} (500 samples)")
            ax.set_title(f"{NAMES[kind]}, {_steps(steps)}")
            ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "distill_cost.png", dpi=110)
    plt.close(fig)
