"""Record what the authors' PyTorch MeanFlow code computes on tiny seeded inputs, for the parity tests of moh-dit's
MeanFlow objective (tests/objectives/test_meanflow.py). Their code is read from a checkout given on the command line
and never copied into this repository; only its outputs are kept (``meanflow_official.safetensors``, and the
settings in ``meanflow_official.json``).

    git clone https://github.com/Gsunshine/py-meanflow /tmp/py-meanflow     # (commit 1f6d72d was recorded)
    python tests/reference_outputs/record_meanflow.py --meanflow /tmp/py-meanflow

Their ``MeanFlow.forward_with_loss`` (draws of (t, r) and noise, the JVP with tangent (v, 1, 0), the target, the
adaptive weight) runs on a tiny moh-dit network: a MoH-DiT with routed heads and every block option, whose zero-
initialised weights are drawn at random so that every path carries signal, called as their U-Net is, ``net(z, (t,
t - r), aug_cond)``. Their time sampler draws from torch's global generator, seeded here; the draws it made and the
noise are recorded beside the loss and one layer's gradient, for each adaptive weight setting (the paper's ImageNet
p = 1, c = 0.01, their CIFAR-10 p = 0.75, c = 1e-3, and p = 0: the plain squared error).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file
from torch.nn.attention import SDPBackend, sdpa_kernel

from moh_dit.model.network import MoHDiT

HERE = Path(__file__).resolve().parent
# a tiny MoH-DiT: routed heads in both layers, LightningDiT's block options, two time inputs
TINY = dict(
    sample_size=8,
    patch_size=2,
    in_channels=2,
    hidden_size=32,
    depth=2,
    num_heads=4,
    num_shared_heads=1,
    top_k=2,
    num_classes=3,
    learn_sigma=False,
    time_inputs=2,
    block={"norm": "rmsnorm", "mlp": "swiglu", "qk_norm": "rmsnorm", "rope": True},
)
LABELS = torch.tensor([0, 1, 2, 0, 1, 2])
SETTINGS = {"imagenet": (1.0, 0.01), "cifar": (0.75, 1e-3), "plain": (0.0, 0.01)}


def commit(repo: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def tiny_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = MoHDiT(**TINY)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adaLN" in name or "final_layer" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return {k: v.clone() for k, v in model.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meanflow", type=Path, required=True, help="a checkout of Gsunshine/py-meanflow")
    parser.add_argument("--commit", default=None, help="the checkout's commit, where it is not a git work tree")
    args = parser.parse_args()
    sys.path.insert(0, str(args.meanflow / "meanflow"))
    import models.meanflow as official  # their MeanFlow (models/meanflow.py) and time sampler

    weights = tiny_weights()

    class Network(torch.nn.Module):
        """The tiny MoH-DiT called as their U-Net: ``net(z, (t, h), aug_cond)``, for fixed labels."""

        def __init__(self) -> None:
            super().__init__()
            self.inner = MoHDiT(**TINY)
            self.inner.load_state_dict(weights)

        def forward(self, z, times, aug_cond=None):
            return self.inner(z, times, LABELS, force_drop_ids=torch.zeros_like(LABELS)).sample

    out = {f"model.{k}": v for k, v in weights.items()}
    draws = {}
    sample_two_timesteps, randn_like = official.sample_two_timesteps, torch.randn_like

    def recorded_times(*a, **k):
        draws["t"], draws["r"] = (v.clone() for v in sample_two_timesteps(*a, **k))
        return draws["t"], draws["r"]

    def recorded_noise(x, *a, **k):
        draws["noise"] = randn_like(x, *a, **k)
        return draws["noise"].clone()

    official.sample_two_timesteps, torch.randn_like = recorded_times, recorded_noise
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 2, 8, 8, generator=g)
    out["x"], out["labels"] = x, LABELS
    try:
        for tag, (power, eps) in SETTINGS.items():
            config = SimpleNamespace(
                ema_decay=0.9999,
                ema_decays=[],
                norm_p=power,
                norm_eps=eps,
                tr_sampler="v0",
                P_mean_t=-0.4,
                P_std_t=1.0,
                P_mean_r=-0.4,
                P_std_r=1.0,
                ratio=0.5,  # P(r != t): half of the six samples on average
            )
            torch.manual_seed(3)
            meanflow = official.MeanFlow(Network, config, {}).train()
            with sdpa_kernel(SDPBackend.MATH):  # their U-Net's attention is plain math; forward AD needs it
                loss = meanflow.forward_with_loss(x, aug_cond=None)
            loss.backward()
            grad = meanflow.net.inner.final_layer.linear.weight.grad
            out[f"{tag}.loss"], out[f"{tag}.final_grad"] = loss.detach(), grad.clone()
            out.update({f"{tag}.{k}": v for k, v in draws.items()})
    finally:
        official.sample_two_timesteps, torch.randn_like = sample_two_timesteps, randn_like
    save_file({k: v.contiguous() for k, v in out.items()}, HERE / "meanflow_official.safetensors")
    settings = {
        "commit": args.commit or commit(args.meanflow),
        "tiny": TINY,
        "adaptive": SETTINGS,
        "torch": torch.__version__,
    }
    (HERE / "meanflow_official.json").write_text(json.dumps(settings, indent=2) + "\n")
    print({k: float(v) for k, v in out.items() if k.endswith(".loss")})


if __name__ == "__main__":
    main()
