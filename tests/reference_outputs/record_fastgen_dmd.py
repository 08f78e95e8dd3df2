"""Record what NVlabs/FastGen's DMD2 loss functions compute on fixed inputs, for the parity tests of moh-dit's DMD2
(tests/objectives/distill/test_dmd2.py). FastGen's code is read from a checkout given on the command line and never copied
here; only its outputs are kept (``fastgen_dmd.safetensors``, settings in ``fastgen_dmd.json``).

    git clone https://github.com/NVlabs/FastGen /tmp/FastGen        # (commit 34f30e8 was recorded)
    pip install --target /tmp/fgdeps attrs ftfy einops imageio omegaconf loguru   # what its utilities import
    python tests/reference_outputs/record_fastgen_dmd.py --fastgen /tmp/FastGen --deps /tmp/fgdeps

What is recorded, from ``fastgen/methods/common_loss.py``:
- ``variational_score_distillation_loss`` (without and with ``additional_scale``): the loss and its gradient in the
  generated data;
- ``gan_loss_generator`` and ``gan_loss_discriminator``: the losses and their gradients in the logits;
- ``denoising_score_matching_loss`` with the ``flow``, ``eps`` and ``x0`` predictions: the losses and their gradients
  in the prediction.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent


def commit(repo: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def common_loss(root: Path, deps: Path | None):
    """FastGen's ``fastgen.methods.common_loss`` without its package ``__init__`` (which imports every method)."""
    sys.path.insert(0, str(root))
    if deps is not None:
        sys.path.append(str(deps))
    package = types.ModuleType("fastgen.methods")
    package.__path__ = [str(root / "fastgen" / "methods")]
    sys.modules["fastgen.methods"] = package
    import fastgen.methods.common_loss as losses

    return losses


def grad_of(fn, *inputs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    value = fn(*leaves)
    value.backward()
    return value.detach(), [x.grad.detach().clone() for x in leaves]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fastgen", type=Path, required=True, help="a checkout of NVlabs/FastGen")
    p.add_argument("--deps", type=Path, default=None, help="a folder of the packages its utilities import")
    p.add_argument("--out", type=Path, default=HERE)
    args = p.parse_args(argv)
    losses = common_loss(args.fastgen.resolve(), args.deps)
    g = torch.Generator().manual_seed(0)
    gen, teacher_x0, fake_x0 = (torch.randn(5, 2, 4, 4, generator=g) for _ in range(3))
    scale = torch.tensor([0.5, 1.0, 2.0, 1.5, 0.25])
    real_logits, fake_logits = torch.randn(5, 1, generator=g), torch.randn(5, 1, generator=g)
    x0, eps, pred = (torch.randn(5, 2, 4, 4, generator=g) for _ in range(3))
    out = {"gen": gen, "teacher_x0": teacher_x0, "fake_x0": fake_x0, "scale": scale, "real_logits": real_logits,
           "fake_logits": fake_logits, "x0": x0, "eps": eps, "pred": pred}  # fmt: skip
    vsd, (vsd_grad,) = grad_of(lambda x: losses.variational_score_distillation_loss(x, teacher_x0, fake_x0), gen)
    vsd_s, (vsd_s_grad,) = grad_of(
        lambda x: losses.variational_score_distillation_loss(x, teacher_x0, fake_x0, additional_scale=scale), gen
    )
    gen_gan, (gen_gan_grad,) = grad_of(losses.gan_loss_generator, fake_logits)
    disc, (disc_real_grad, disc_fake_grad) = grad_of(losses.gan_loss_discriminator, real_logits, fake_logits)
    out |= {"vsd": vsd, "vsd.grad": vsd_grad, "vsd_scaled": vsd_s, "vsd_scaled.grad": vsd_s_grad}
    out |= {"gan_gen": gen_gan, "gan_gen.grad": gen_gan_grad, "gan_disc": disc}
    out |= {"gan_disc.grad_real": disc_real_grad, "gan_disc.grad_fake": disc_fake_grad}
    for kind in ("flow", "eps", "x0"):
        value, (grad,) = grad_of(lambda y, k=kind: losses.denoising_score_matching_loss(k, y, x0=x0, eps=eps), pred)
        out |= {f"dsm_{kind}": value, f"dsm_{kind}.grad": grad}
    save_file({k: v.contiguous() for k, v in out.items()}, args.out / "fastgen_dmd.safetensors")
    settings = {"fastgen_commit": commit(args.fastgen), "torch": torch.__version__}
    (args.out / "fastgen_dmd.json").write_text(json.dumps(settings, indent=2) + "\n")
    print(f"recorded {len(out)} tensors in {args.out / 'fastgen_dmd.safetensors'}")


if __name__ == "__main__":
    main()
