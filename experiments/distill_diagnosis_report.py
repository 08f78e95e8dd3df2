"""The distillation diagnosis's measures of a set of images (``experiments/distill_diagnosis.py`` takes them) and its
report: RESULTS.md."""

from __future__ import annotations

import statistics

import torch

__all__ = ["report", "across_seeds", "INTERVALS", "spread", "roughness", "pool_features", "feature_spread", "rms"]

INTERVALS = {"1 -> 0": (1.0, 0.0), "1 -> 0.5": (1.0, 0.5), "0.5 -> 0": (0.5, 0.0)}  # the sampler's own intervals


def _jumps(record: dict) -> str:
    """How the record's generators jumped to the middle: each one's own sampler step (a record written before it said
    so: the flow map's jump, which is how those were made)."""
    renoises = record.get("renoises")
    if renoises is None:
        return "each generator's first jump along its flow map (1 to the middle)"
    kinds = [f"the {name}'s {'renoised (the data predicted, noised afresh)' if r else 'along its flow map'}"
             for name, r in renoises.items()]  # fmt: skip
    return "each generator's first jump as its own sampler takes it: " + ", ".join(kinds)


def across_seeds(variety: dict[str, dict], baseline: str = "student, 2 steps") -> list[str]:
    """The variety records of one arm at several seeds (run names ``ARM-seedN``) side by side: each composition that
    every seed has, its KID and recall per seed, and its paired difference from ``baseline`` (the student alone)
    averaged over the seeds, with the seeds on which it is ahead."""
    import re

    arms: dict[str, dict[str, dict]] = {}
    for name, record in variety.items():
        named = re.fullmatch(r"(.*)-seed(\d+)", name)
        arm, seed = named.groups() if named else (name, "-1")
        arms.setdefault(arm, {})[seed] = record["rows"]
    lines = []
    for arm, seeds in arms.items():
        if len(seeds) < 2:
            continue
        order = sorted(seeds, key=int)
        shared = [t for t in seeds[order[0]] if all(t in rows for rows in seeds.values())]
        lines += [f"## The compositions across seeds ({arm})", "", f"Seeds {', '.join(order)}, one run each; 'vs the "
                  f"student': the composition's value minus that of '{baseline}' on the same seed (KID: below 0 is "
                  "better; recall: above 0), averaged over the seeds; 'ahead': the seeds on which the composition is "
                  "better.", "",
                  "| composition | KID x 1000 per seed | mean | vs the student | ahead | recall per seed | mean | vs the student | ahead |",
                  "|---" * 9 + "|"]  # fmt: skip
        for title in shared:
            kid = [seeds[s][title]["kid"] for s in order]
            recall = [seeds[s][title]["recall"] for s in order]
            base = [seeds[s].get(baseline) for s in order]
            if all(base) and title != baseline:
                dk = [k - b["kid"] for k, b in zip(kid, base)]
                dr = [r - b["recall"] for r, b in zip(recall, base)]
                paired = (f"{statistics.mean(dk):+.2f} | {sum(d < 0 for d in dk)} of {len(dk)}",
                          f"{statistics.mean(dr):+.3f} | {sum(d > 0 for d in dr)} of {len(dr)}")  # fmt: skip
            else:
                paired = ("- | -", "- | -")
            lines.append(f"| {title} | {' / '.join(f'{k:.2f}' for k in kid)} | {statistics.mean(kid):.2f} | {paired[0]} "
                         f"| {' / '.join(f'{r:.3f}' for r in recall)} | {statistics.mean(recall):.3f} | {paired[1]} |")  # fmt: skip
        lines.append("")
    return lines


def spread(images: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean over classes of each class's pixel std over its samples, averaged over pixels."""
    return statistics.mean(float(images[labels == c].std(dim=0).mean()) for c in labels.unique().tolist())


def roughness(images: torch.Tensor) -> float:
    """The mean absolute difference of neighbouring pixels (total variation per pixel): the grain a sampler leaves."""
    down = (images[..., 1:, :] - images[..., :-1, :]).abs().mean()
    across = (images[..., :, 1:] - images[..., :, :-1]).abs().mean()
    return float((down + across) / 2)


def pool_features(images: torch.Tensor, extractor, desc: str = "features") -> torch.Tensor:
    """The classifier's pool features (what KID, precision and recall compare) of images in [-1, 1], (N, 1, H, W),
    quantised to uint8 and repeated to RGB as a saved sample set is."""
    from moh_dit.evaluation.features import extract_features

    pixels = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).repeat(1, 3, 1, 1)
    return torch.as_tensor(extract_features(extractor, pixels.permute(0, 2, 3, 1).numpy(), desc=desc)["pool"])


def feature_spread(images: torch.Tensor, labels: torch.Tensor, extractor) -> float:
    """Mean over classes of the samples' mean distance to their class centroid in the classifier's features (what
    precision and recall compare), relative to the mean distance between class centroids."""
    import numpy as np

    feats = pool_features(images, extractor)
    centroids = torch.stack([feats[labels == c].mean(0) for c in labels.unique()])
    inner = statistics.mean(
        float((feats[labels == c] - centroids[i]).norm(dim=1).mean()) for i, c in enumerate(labels.unique())
    )
    between = float(torch.pdist(centroids).mean())
    return inner / between if np.isfinite(between) and between > 0 else float("nan")


def rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b) ** 2).mean().sqrt())


def report(result: dict) -> str:
    lines = ["# Distillation: the diagnosis", "", "`python -m experiments.distill_diagnosis` (see its docstring).", ""]
    if "times" in result:
        lines += ["## The drawn intervals", "", "![times](times.png)", ""]
        keys = [*INTERVALS, *(f"{k} of intervals" for k in INTERVALS)]
        lines += ["| recipe | draws | r < t | " + " | ".join(keys) + " |", "|---" * (3 + len(keys)) + "|"]
        for name, row in result["times"].items():
            closed = row.get("closed form 1 -> 0 of intervals")
            cells = [f"{row[k]:.3%}" for k in keys]
            if closed is not None:
                cells[3] += f" (closed form {closed:.3%})"
            lines.append(f"| {name} | {row['recipe']} | {row['interval_share']:.0%} | " + " | ".join(cells) + " |")
        lines.append("")
    if "fit" in result:
        f = result["fit"]
        lines += ["## A trajectory student against its targets", "", f"Run: `{f['run']}` ({f['trajectories']} "
                  "trajectories); RMS per pixel to the teacher's trajectory end, same noise:", "",
                  "| weights, noise | 1 step | 2 steps |", "|---|---|---|"]  # fmt: skip
        lines += [f"| {k} | {v['1 step']:.4f} | {v['2 steps']:.4f} |" for k, v in f["rows"].items()]
        lines.append("")
    for step, c in result.get("collapse", {}).items():
        lines += [f"## The collapse at one step (step {step})", "", f"Run: `{c['run']}`", "",
                  "| samples | per-class pixel spread | per-class feature spread / between classes | roughness |",
                  "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {k} | {v:.4f} | {c['feature spread'][k]:.3f} | {c['roughness'][k]:.4f} |"
                  for k, v in c["spread"].items()]  # fmt: skip
        lines += ["", "| distance (RMS per pixel, same noise) | |", "|---|---|"]
        lines += [f"| {k} | {v:.4f} |" for k, v in c["distance"].items()]
        lines.append("")
    for part, title in (("derivative", "The derivative along the run"), ("updates", "Where each update comes from")):
        if part in result:
            rows = result[part]["rows"]
            keys = [k for k in rows[0] if k != "step"]
            lines += [f"## {title}", "", f"Run: `{result[part]['run']}`", ""]
            lines += ["| step | " + " | ".join(keys) + " |", "|---" * (1 + len(keys)) + "|"]
            lines += [f"| {r['step']} | " + " | ".join(f"{r[k]:.4g}" for k in keys) + " |" for r in rows]
            lines.append("")
    if "weights" in result:
        w = result["weights"]
        lines += ["## The EMA against the raw weights", "", f"Run: `{w['run']}`, step {w['step']}, {w['samples']} samples", "",
                  "| weights | steps | KID x 1000 [90%] | recall |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['weights']} | {r['steps']} | {r['kid']:.2f} [{r['kid_interval'][0]:.2f}, {r['kid_interval'][1]:.2f}] "
                  f"| {r['recall']:.3f} |" for r in w["rows"]]  # fmt: skip
        lines.append("")
    if "discriminator" in result:
        d = result["discriminator"]
        times = list(d["probes"]["checkpoint"]["area"])
        lines += ["## The discriminator", "", f"Run: `{d['run']}`, step {d['step']}: ROC area of the head's logits, "
                  f"{d['count']} training images against {d['count']} one-step samples at each noise time (0.5: "
                  f"chance); each probe trains alone from the checkpoint for {d['steps']} steps (the run's rate "
                  f"{d['rate']:g}); loss: its mean over the first and last fifth (chance 1.386)", "",
                  "| head | " + " | ".join(f"t = {t}" for t in times) + " | loss |", "|---" * (2 + len(times)) + "|"]  # fmt: skip
        for name, probe in d["probes"].items():
            loss = probe.get("loss")
            said = f"{loss['first fifth']:.3f} to {loss['last fifth']:.3f}" if loss else ""
            lines.append(f"| {name} | " + " | ".join(f"{probe['area'][t]:.3f}" for t in times) + f" | {said} |")
        lines.append("")
    for name, c in result.get("consistency", {}).items():
        keys = list(next(iter(c["rows"].values())))
        lines += [f"## Where ECT's target points ({name})", "", f"Run: `{c['run']}` ({'its step ' + str(c['ect_dt']) if c['ect_dt'] else 'not ECT'}); RMS per "
                  f"pixel, {c['samples']} noises, the teacher's end: its guided 25 Euler steps", "",
                  "| student | " + " | ".join(keys) + " |", "|---" * (1 + len(keys)) + "|"]  # fmt: skip
        lines += [f"| {who} | " + " | ".join(f"{row[k]:.4f}" for k in keys) + " |" for who, row in c["rows"].items()]
        lines.append("")
    for name, v in result.get("variety", {}).items():
        classes = len(next(iter(v["rows"].values()))["class_recall"])
        lines += [f"## Where the two-step student's variety goes ({name})", "", f"Run: `{v['run']}`, started from `{v['start']}` (their checkpoints at steps "
                  f"{v['steps']['student']} and {v['steps']['start']}); {v['samples']} class-balanced samples from the same noise; the middle at {v['middle']:g}; the "
                  f"teacher: {v['teacher_steps']} guided Euler steps in all (the real score's scale: "
                  f"{v.get('real_guidance') or 'its own'}); {_jumps(v)}; each class's recall against its own test images, the classes in "
                  "Fashion-MNIST's order (0 T-shirt/top, 1 trouser, 2 pullover, 3 dress, 4 coat, 5 sandal, 6 shirt, "
                  "7 sneaker, 8 bag, 9 ankle boot)", "",
                  "| composition | KID x 1000 | precision | recall | " + " | ".join(f"recall {c}" for c in range(classes))
                  + " |", "|---" * (4 + classes) + "|"]  # fmt: skip
        lines += [f"| {row} | {r['kid']:.2f} | {r['precision']:.3f} | {r['recall']:.3f} | "
                  + " | ".join(f"{c:.2f}" for c in r["class_recall"]) + " |" for row, r in v["rows"].items()]  # fmt: skip
        lines.append("")
    lines += across_seeds(result.get("variety", {}))
    if "ema" in result:
        e = result["ema"]
        if "teacher_share" in e:  # a record written before the EMA's own updates were counted (one per step)
            shares = ", ".join(f"step {s}: {v:.3g}" for s, v in e["teacher_share"].items())
            lines += ["## The EMA", "", f"Decay {e['decay']}: the teacher's share of the EMA weights at {shares}.", ""]
        else:
            shares = ", ".join(f"update {s}: {v:.3g}" for s, v in e["start_share"].items())
            lines += ["## The EMA", "", f"Decay {e['decay']}, {e['updates']} EMA updates in {e['steps']} steps: the "
                      f"start's share of the EMA weights at {shares}.", ""]  # fmt: skip
    return "\n".join(lines) + "\n"
