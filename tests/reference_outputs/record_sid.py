"""Record what mingyuanzhou/SiD's generator loss computes on fixed inputs, for the parity test of moh-dit's SiD loss
(tests/objectives/distill/test_sid.py). SiD's code is read from a checkout given on the command line and never copied
here; only its outputs are kept (``sid_official.safetensors``, settings in ``sid_official.json``).

    git clone https://github.com/mingyuanzhou/SiD /tmp/SiD          # (commit 01fbb13 was recorded)
    python tests/reference_outputs/record_sid.py --sid /tmp/SiD

What is recorded, from ``training/sid_loss.py``'s ``SID_EDMLoss.generator_loss`` at alpha 1.2 and 0.5: its
per-pixel loss and the gradient of its sum in the generated images, with two small differentiable scores defined
below (:func:`real_score`, :func:`fake_score`: stand-ins for the networks, so that the gradient through their inputs
is exercised), and the inputs the loss gave them (it draws its own noise levels and noise).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent


def real_score(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """A stand-in for the teacher's denoiser: smooth and nonlinear in its input."""
    return torch.tanh(0.8 * x) / (1 + sigma) + 0.1 * x.flip(-1)


def fake_score(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """A stand-in for the fake score's denoiser, near the real one."""
    return torch.tanh(0.6 * x + 0.05) / (1 + sigma) + 0.05 * x.roll(1, dims=-2)


def commit(repo: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sid", type=Path, required=True, help="a checkout of mingyuanzhou/SiD")
    p.add_argument("--out", type=Path, default=HERE)
    args = p.parse_args(argv)
    sys.path.insert(0, str(args.sid.resolve()))
    from training.sid_loss import SID_EDMLoss

    images = torch.randn(5, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    out = {"images": images}
    for alpha in (1.2, 0.5):
        seen: dict[str, torch.Tensor] = {}

        def real(x, sigma, labels, augment_labels=None):
            seen["x"], seen["sigma"] = x.detach().clone(), sigma.detach().clone()
            return real_score(x, sigma)

        def fake(x, sigma, labels, augment_labels=None):
            return fake_score(x, sigma)

        torch.manual_seed(1)
        leaf = images.clone().requires_grad_(True)
        loss = SID_EDMLoss().generator_loss(real, fake, leaf, alpha=alpha)
        loss.sum().backward()
        out |= {f"alpha{alpha}.x": seen["x"], f"alpha{alpha}.sigma": seen["sigma"].flatten()}
        out |= {f"alpha{alpha}.loss": loss.detach(), f"alpha{alpha}.grad": leaf.grad.detach().clone()}
    save_file({k: v.contiguous() for k, v in out.items()}, args.out / "sid_official.safetensors")
    settings = {"sid_commit": commit(args.sid), "torch": torch.__version__, "alphas": [1.2, 0.5]}
    (args.out / "sid_official.json").write_text(json.dumps(settings, indent=2) + "\n")
    print(f"recorded {len(out)} tensors in {args.out / 'sid_official.safetensors'}")


if __name__ == "__main__":
    main()
