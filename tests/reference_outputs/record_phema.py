"""Record what the official post-hoc EMA routines of NVlabs/edm2 (``training/phema.py``) compute, for
tests/training/test_posthoc_ema.py. Only the outputs are kept (``phema_official.json``, ``phema_official.safetensors``).

    git clone https://github.com/NVlabs/edm2 /tmp/edm2          # (commit 4bf8162 was recorded)
    python tests/reference_outputs/record_phema.py --edm2 /tmp/edm2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--edm2", type=Path, required=True, help="a checkout of NVlabs/edm2")
    p.add_argument("--out", type=Path, default=HERE)
    args = p.parse_args(argv)
    spec = importlib.util.spec_from_file_location("phema", args.edm2 / "training" / "phema.py")
    phema = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(phema)

    sigmas = [0.015, 0.025, 0.05, 0.075, 0.1, 0.13, 0.2, 0.28]
    record = {
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=args.edm2, capture_output=True, text=True
        ).stdout.strip(),
        "sigma_rel": sigmas,
        "gamma": [float(phema.std_to_exp(s)) for s in sigmas],
        "sigma_of_gamma": [float(phema.exp_to_std(g)) for g in (0.5, 2.0, 6.9372, 16.97, 60.0)],
        "beta": [[0.1, 2048, 256, float(phema.power_function_beta(0.1, 2048, 256))]],
        "correlation": [
            [a_t, a_s, b_t, b_s, float(phema.power_function_correlation(a_t, a_s, b_t, b_s))]
            for a_t, a_s, b_t, b_s in (
                (8, 0.05, 64, 0.10),
                (64, 0.05, 8, 0.10),
                (30, 0.2, 30, 0.015),
                (5, 0.1, 5, 0.1),
            )
        ],
    }
    cases = {
        "regular": (np.repeat(np.arange(1, 9) * 8.0, 2), np.tile([0.05, 0.10], 8), 64.0, [0.075, 0.15]),
        "irregular": (
            np.array([3.0, 3.0, 10.0, 10.0, 17.0, 17.0, 40.0, 40.0]),
            np.tile([0.05, 0.10], 4),
            [40.0, 25.0],
            [0.03, 0.12],
        ),
    }
    record["coefficients"] = {}
    for name, (in_t, in_s, out_t, out_s) in cases.items():
        x = phema.solve_posthoc_coefficients(in_t, in_s, out_t, out_s)
        record["coefficients"][name] = {
            "in_t": np.broadcast_to(in_t, np.shape(in_s)).tolist(),
            "in_sigma": list(in_s),
            "out_t": out_t,
            "out_sigma": out_s,
            "x": x.tolist(),
        }

    # the recursion: a tiny net whose weights move by seeded steps, updated with the image count after each step
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    ema = phema.PowerFunctionEMA(net, stds=[0.05, 0.10])
    start = {k: v.clone() for k, v in net.state_dict().items()}
    g, batch, tensors = torch.Generator().manual_seed(1), 4, {}
    with torch.no_grad():
        for step in range(1, 21):
            for p_net in net.parameters():
                p_net.add_(torch.randn(p_net.shape, generator=g) * 0.1)
            ema.update(cur_nimg=step * batch, batch_size=batch)
    for std, copy in zip(ema.stds, ema.emas):
        tensors.update({f"ema{std:.2f}.{k}": v.clone() for k, v in copy.state_dict().items()})
    tensors.update({f"start.{k}": v for k, v in start.items()})
    record["recursion"] = {"steps": 20, "batch": batch, "step_std": 0.1, "generator_seed": 1}
    save_file(tensors, args.out / "phema_official.safetensors")
    (args.out / "phema_official.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"recorded {args.out / 'phema_official.json'}")


if __name__ == "__main__":
    main()
