"""Attention-level benchmark: plain multi-head attention (SDPA) vs MoH dense, sparse and auto.

Widths of DiT-S/2, B/2 and XL/2 at 256 and 1024 tokens, activation rho = 1.0/0.9/0.75/0.5, plus the
routed layer layouts of the real MoH-DiT presets; forward only and forward + backward. All modes of a
shape are timed in one process, in interleaved rounds (median reported), with routers initialised like
real ones (xavier-uniform) and denormals flushed. Ratios are to multi-head attention measured in the same
run, next to the ideal FLOP ratio of exact skipping and the share of that ideal saving achieved.

    python benchmarks/attention.py                       # full grid
    python benchmarks/attention.py --calibrate           # also fit the auto cost model for this device
    python benchmarks/attention.py --quick               # a tiny grid (smoke test)

Writes runs/benchmarks/attention_<device>.{json,md,png} (--out benchmarks/results publishes).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

if not __package__:  # run as a file (python benchmarks/x.py): the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import DEFAULT_OUT, OUT_HELP
from moh_dit.model.attention import MoHAttention
from moh_dit.model.cost_model import CALIBRATION_DIR, FEATURE_NAMES, ideal_attention_ratio
from moh_dit.model.cost_model import features as perf_features
from moh_dit.model.execution import AutoProcessor, DenseProcessor, SparseProcessor, padded_active_fraction, padded_rows
from moh_dit.model.presets import PRESETS

WIDTHS = {"S": (384, 6, 64), "B": (768, 12, 64), "XL": (1152, 16, 72)}
MODES = ("mha", "dense", "sparse", "auto")


def layout_for(heads: int, rho: float) -> tuple[int, int]:
    """(shared, top_k) with about ``rho`` of ``heads`` active; a quarter of the heads shared."""
    active = max(1, int(round(rho * heads)))
    if active >= heads:
        return heads, 0
    shared = max(1, heads // 4)
    return shared, max(1, active - shared)


def preset_layouts() -> list[tuple[str, int, int, int, int, int]]:
    """Distinct routed layer layouts of the MoH-DiT presets: (name, width, heads, head_dim, shared, top_k)."""
    out = []
    for name, cfg in PRESETS.items():
        if not name.startswith("MoH-DiT") or "Ti" in name:
            continue
        seen = set()
        for h, s, k in zip(cfg["num_heads"], cfg["num_shared_heads"], cfg["top_k"]):
            if k and (h, s, k) not in seen:
                seen.add((h, s, k))
                out.append((f"{name} ({s}+{k}/{h - s} of {h})", cfg["hidden_size"], h, cfg["head_dim"], s, k))
    return out


def make_layers(dim, heads, head_dim, shared, top_k, device):
    torch.manual_seed(0)
    mha = MoHAttention(dim, heads, head_dim=head_dim, attention_type="mha").to(device)
    moh = MoHAttention(dim, heads, head_dim=head_dim, num_shared_heads=shared, top_k=top_k).to(device)
    for layer in (mha, moh):
        for m in layer.modules():
            if isinstance(m, torch.nn.Linear):
                torch.nn.init.xavier_uniform_(m.weight)  # as DiT initialises every linear, routers included
    moh.qkv.load_state_dict(mha.qkv.state_dict())
    moh.proj.load_state_dict(mha.proj.state_dict())
    return mha, moh


def timed(fn, device, repeats):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def bench_shape(
    dim, heads, head_dim, shared, top_k, tokens, batch, device, dtype, rounds, repeats, compile_, min_time=0.0
):
    mha, moh = make_layers(dim, heads, head_dim, shared, top_k, device)
    x = torch.randn(batch, tokens, dim, device=device)
    with torch.no_grad():
        mask = moh.compute_gates(x)[2]
    # what the sparse path really computes: every routed head padded to the busiest one
    padded = padded_active_fraction(moh, padded_rows(mask), tokens) if mask is not None else 1.0
    results = {"padded_rho": padded}
    auto = AutoProcessor()  # one per shape, as a model layer keeps one: its choice is made once
    processors = {"mha": DenseProcessor(), "dense": DenseProcessor(), "sparse": SparseProcessor(), "auto": auto}
    for backward in (False, True):

        def run(layer, mode):
            fn = torch.compile(layer) if compile_ else layer

            def step():
                layer.set_execution(processors[mode])  # the MoH modes share one layer
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    if backward:
                        xi = x.detach().requires_grad_(True)
                        out, _ = fn(xi)
                        out.float().square().mean().backward()
                    else:
                        with torch.no_grad():
                            fn(x)

            return step

        steps = {m: run(mha if m == "mha" else moh, m) for m in MODES}
        for step in steps.values():  # warm-up (and compilation)
            step()
            step()
        # enough calls per timing that one timing lasts at least min_time (short shapes are noisy otherwise)
        calls = max(repeats, math.ceil(min_time / max(timed(steps["mha"], device, 1), 1e-6)))
        times = {m: [] for m in MODES}
        for _ in range(rounds):
            for m, step in steps.items():
                times[m].append(timed(step, device, calls))
        med = {m: statistics.median(v) for m, v in times.items()}
        # round-to-round spread of the baseline: (max - min) / median, a yardstick for "within noise"
        spread = (max(times["mha"]) - min(times["mha"])) / med["mha"]
        rho = (shared + top_k) / heads
        ideal = ideal_attention_ratio(rho, tokens, dim)
        best = min(med["dense"], med["sparse"])
        saving = (1 - best / med["mha"]) / (1 - ideal) if ideal < 1 else float("nan")
        results["train" if backward else "infer"] = {
            "seconds": med,
            "ratio_to_mha": {m: med[m] / med["mha"] for m in MODES},
            "sparse_over_dense": med["sparse"] / med["dense"],
            "calls_per_timing": calls,
            "mha_spread": spread,
            "ideal_ratio": ideal,
            "ideal_saving_achieved": saving,
            "auto_choice": auto.choose(moh, x.detach().requires_grad_(backward))
            if backward
            else _choice_no_grad(auto, moh, x),
        }
    return results


def _choice_no_grad(auto, layer, x):
    with torch.no_grad():
        return auto.choose(layer, x)


def fit_calibration(rows, device_type):
    """Least-squares fit of sparse/dense on moh_dit.model.cost_model.features, per pass."""
    cal = {}
    for pass_ in ("infer", "train"):
        pts = [r for r in rows if r["rho"] < 1]
        if len(pts) < 2 * len(FEATURE_NAMES):
            continue
        # the padded activation is what the sparse path computes; auto re-checks with it at run time
        X = np.array(
            [
                perf_features(
                    r.get("padded_rho", r["rho"]), (r["heads"] - r["shared"]) / r["heads"], r["tokens"], r["dim"]
                )
                for r in pts
            ]
        )
        y = np.array([r[pass_]["sparse_over_dense"] for r in pts])
        coef, *_ = np.linalg.lstsq(X, y, rcond=None)
        resid = y - X @ coef
        cal[f"{device_type}/{pass_}"] = {
            "coef": [float(c) for c in coef],
            "features": list(FEATURE_NAMES),
            "points": len(pts),
            "rms_residual": float(np.sqrt(np.mean(resid**2))),
        }
    return cal


def plot(rows, path, title):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    grid = [r for r in rows if r["kind"] == "grid"]
    keys = sorted({(r["width"], r["tokens"]) for r in grid}, key=lambda k: (WIDTHS[k[0]][0], k[1]))
    fig, axes = plt.subplots(2, len(keys), figsize=(3.2 * len(keys), 6), squeeze=False, sharey=True)
    for col, (w, t) in enumerate(keys):
        sel = sorted((r for r in grid if (r["width"], r["tokens"]) == (w, t)), key=lambda r: r["rho"])
        for row, pass_ in enumerate(("infer", "train")):
            ax = axes[row][col]
            rho = [r["rho"] for r in sel]
            for m, style in (("dense", "s-"), ("sparse", "o-"), ("auto", "x--")):
                ax.plot(rho, [r[pass_]["ratio_to_mha"][m] for r in sel], style, label=f"MoH {m}")
            ax.plot(rho, [r[pass_]["ideal_ratio"] for r in sel], "k:", label="ideal")
            ax.axhline(1.0, color="grey", lw=0.5)
            ax.set_title(f"{w} width, {t} tokens, {'fwd' if pass_ == 'infer' else 'fwd+bwd'}", fontsize=8)
            ax.set_xlabel("active heads")
            if col == 0:
                ax.set_ylabel("time / multi-head attention")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--batch", type=int, default=0, help="default: 8 on CUDA, 1 on CPU")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=0, help="least calls per timing; default: 10 on CUDA, 1 on CPU")
    p.add_argument("--min-time", type=float, default=0.05, help="seconds one timing lasts at least (more calls)")
    p.add_argument("--widths", default="S,B,XL")
    p.add_argument("--tokens", default="256,1024")
    p.add_argument("--rhos", default="1.0,0.9,0.75,0.5")
    p.add_argument("--no-presets", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny shapes for a smoke test")
    p.add_argument("--calibrate", action="store_true", help="refit the auto cost model for this device")
    p.add_argument(
        "--calibration-file",
        default=None,
        help="where --calibrate writes (default: <out>/calibration_<device>[_tag].json); use it with "
        "$MOH_DIT_CALIBRATION, or --install it as the shipped calibration of this device type",
    )
    p.add_argument(
        "--install",
        action="store_true",
        help="with --calibrate: also write moh_dit/calibrations/<device type>.json (to commit)",
    )
    p.add_argument("--out", default=DEFAULT_OUT, help=OUT_HELP)
    p.add_argument("--tag", default="", help="suffix for the result file names")
    args = p.parse_args(argv)
    unknown = sorted(set(args.widths.split(",")) - set(WIDTHS))
    if unknown:
        p.error(f"unknown width(s) {', '.join(unknown)}; choose from {', '.join(WIDTHS)}")
    if args.min_time < 0 or args.rounds < 1:
        p.error("--min-time must be >= 0 and --rounds >= 1")
    torch.set_flush_denormal(True)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    batch = args.batch or (8 if device.type == "cuda" else 1)
    repeats = args.repeats or (10 if device.type == "cuda" else 1)
    shapes = []
    if args.quick:
        WIDTHS["tiny"] = (48, 6, 8)
        shapes = [("grid", "tiny", 48, 6, 8, *layout_for(6, rho), 16, rho) for rho in (1.0, 0.5)]
    else:
        for w in args.widths.split(","):
            dim, heads, hd = WIDTHS[w]
            for t in map(int, args.tokens.split(",")):
                for rho in map(float, args.rhos.split(",")):
                    shapes.append(("grid", w, dim, heads, hd, *layout_for(heads, rho), t, rho))
        if not args.no_presets:
            for name, dim, heads, hd, s, k in preset_layouts():
                for t in map(int, args.tokens.split(",")):
                    shapes.append(("preset", name, dim, heads, hd, s, k, t, (s + k) / heads))
    rows = []
    for kind, label, dim, heads, hd, s, k, t, _rho in shapes:
        res = bench_shape(
            dim, heads, hd, s, k, t, batch, device, dtype, args.rounds, repeats, args.compile, args.min_time
        )
        row = {
            "kind": kind,
            "width": label,
            "dim": dim,
            "heads": heads,
            "head_dim": hd,
            "shared": s,
            "top_k": k,
            "tokens": t,
            "rho": (s + k) / heads,
            **res,
        }
        rows.append(row)
        print(
            f"{label:>36} T={t:<5} rho={row['rho']:.2f}  fwd: dense {res['infer']['ratio_to_mha']['dense']:.3f} "
            f"sparse {res['infer']['ratio_to_mha']['sparse']:.3f} auto {res['infer']['ratio_to_mha']['auto']:.3f} "
            f"(ideal {res['infer']['ideal_ratio']:.3f})  fwd+bwd: dense {res['train']['ratio_to_mha']['dense']:.3f} "
            f"sparse {res['train']['ratio_to_mha']['sparse']:.3f} auto {res['train']['ratio_to_mha']['auto']:.3f}",
            flush=True,
        )
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    result = {
        "device": dev_name,
        "device_type": device.type,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "compile": args.compile,
        "batch": batch,
        "rounds": args.rounds,
        "repeats": repeats,
        "min_time": args.min_time,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{device.type}{('_' + args.tag) if args.tag else ''}"
    stem = f"attention_{tag}"
    if args.calibrate:
        new = fit_calibration(rows, device.type)
        targets = [Path(args.calibration_file or out / f"calibration_{tag}.json")]
        if args.install:
            targets.append(CALIBRATION_DIR / f"{device.type}.json")
        for cal_file in targets:
            cal_file.write_text(json.dumps(new, indent=2) + "\n")
            print(f"wrote calibration {cal_file}")
        result["calibration"] = new
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (out / f"{stem}.md").write_text(markdown(result))
    plot(rows, out / f"{stem}.png", f"MoH attention vs multi-head attention ({dev_name}, {args.dtype})")
    return result


def target_summary(result) -> list[str]:
    """The issue's targets, read off this run: auto vs dense MoH everywhere, and the XL-width 1024-token rows."""
    lines = ["## Targets", ""]
    for pass_, title in (("infer", "forward"), ("train", "forward + backward")):
        ratios = [(r[pass_]["seconds"]["auto"] / r[pass_]["seconds"]["dense"], r) for r in result["rows"]]
        worst, worst_row = max(ratios, key=lambda x: x[0])
        above = [r for q, r in ratios if q > 1 + max(r[pass_]["mha_spread"], 0.02)]
        lines.append(
            f"- auto / dense MoH, {title}: median {statistics.median(q for q, _ in ratios):.3f}, worst "
            f"{worst:.3f} ({worst_row['width']}, {worst_row['tokens']} tokens, rho {worst_row['rho']:.2f}, "
            f"auto chose {worst_row[pass_]['auto_choice']}); above 1 + that row's noise (or 2%): "
            f"{len(above)} of {len(ratios)}"
        )
    for r in result["rows"]:
        if r["dim"] == 1152 and r["tokens"] == 1024 and r["rho"] < 1:
            f, b = r["infer"], r["train"]
            lines.append(
                f"- {r['width']}, 1024 tokens, rho {r['rho']:.2f}: best MoH mode / MHA "
                f"{min(f['ratio_to_mha']['dense'], f['ratio_to_mha']['sparse']):.3f} forward, "
                f"{min(b['ratio_to_mha']['dense'], b['ratio_to_mha']['sparse']):.3f} forward + backward "
                f"(auto {f['ratio_to_mha']['auto']:.3f} / {b['ratio_to_mha']['auto']:.3f}; "
                f"ideal {f['ideal_ratio']:.3f})"
            )
    return lines + [""]


def markdown(result) -> str:
    lines = [
        f"# Attention benchmark ({result['device']}, torch {result['torch']}, {result['dtype']}"
        f"{', torch.compile' if result['compile'] else ''})",
        "",
        f"Batch {result['batch']}, median of {result['rounds']} interleaved rounds, each timing at least "
        f"{result.get('min_time', 0):g} s of repeated calls. Times are ratios to plain "
        "multi-head attention (SDPA) of the same width measured in the same run. *ideal* is the FLOP ratio of "
        "exact head skipping, (1 + rho + rho r) / (2 + r) with r = tokens / width; *padded* is the share of "
        "(token, head) pairs the sparse path computes once every routed head is padded to the busiest one (routers "
        "initialised like real ones, random inputs); *saving achieved* is "
        "(1 - best MoH mode / MHA) / (1 - ideal); *noise* is the round-to-round spread of the baseline, "
        "(max - min) / median.",
        "",
        *target_summary(result),
    ]
    for pass_, title in (("infer", "Forward"), ("train", "Forward + backward")):
        lines += [
            f"## {title}",
            "",
            "| layer | tokens | active (padded) | MoH dense | MoH sparse | auto (choice) | ideal | saving achieved | noise |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in result["rows"]:
            x = r[pass_]
            q = x["ratio_to_mha"]
            lines.append(
                f"| {r['width']} | {r['tokens']} | {r['rho']:.2f} ({r['padded_rho']:.2f}) | {q['dense']:.3f} | {q['sparse']:.3f} | "
                f"{q['auto']:.3f} ({x['auto_choice']}) | {x['ideal_ratio']:.3f} | "
                f"{x['ideal_saving_achieved']:.2f} | {100 * x['mha_spread']:.0f}% |"
            )
        lines.append("")
    if "calibration" in result:
        lines += ["## Calibration written", "", "```", json.dumps(result["calibration"], indent=2), "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    from moh_dit.cli.common import run_cli

    run_cli(main)  # bad input: one line, as the commands say it
