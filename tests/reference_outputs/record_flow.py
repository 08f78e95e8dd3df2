"""Record what the official SiT and REPA code computes on tiny seeded inputs, for the parity tests of moh-dit's
flow objective (tests/objectives/test_flow_parity.py). The official code is read from checkouts given on the
command line and never copied into this repository; only its outputs are kept (``flow_official.safetensors``, and
the settings in ``flow_official.json``).

    git clone https://github.com/willisma/SiT /tmp/SiT          # (commit 947f95b was recorded)
    git clone https://github.com/sihyun-yu/REPA /tmp/REPA       # (commit 67f7145 was recorded)
    pip install timm torchdiffeq                                # what the official code imports
    python tests/reference_outputs/record_flow.py --sit /tmp/SiT --repa /tmp/REPA

What is recorded:
- SiT ``ICPlan`` / ``GVPCPlan``: ``plan(t, x0, x1)`` and ``get_score_from_velocity`` / ``get_noise_from_velocity``;
- a tiny random official ``SiT`` (learn_sigma=True, 2C head) and REPA ``SiT`` (C head, a projector): their weights,
  a forward pass each, SiT's ``forward_with_cfg`` (3 channels guided);
- SiT's ``Transport.training_losses`` with fixed draws (``Transport.sample`` replaced by one returning them);
- SiT's ``Sampler.sample_ode(euler)`` and ``Sampler.sample_sde(diffusion_form="sigma", last_step="Mean")`` with the
  CPU generator seeded (the noise it draws is replayed by seeding moh-dit's generator alike);
- REPA's ``SILoss`` denoising loss with its draws, and its ``euler_sampler`` (guided on t <= 0.7; with Heun guided at
  every step) and ``euler_maruyama_sampler`` (guided on t <= 0.7; its float64 noise recorded for replay).
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
TINY = dict(input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=4, num_classes=3)


def commit(repo: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def with_signal(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every zero-initialised weight (adaLN, output layer) drawn from N(0, 0.05), so that every path carries signal."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adaLN" in name or "final_layer" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def record_sit(root: Path, out: dict, settings: dict) -> None:
    sys.path.insert(0, str(root))
    from models import SiT  # the official SiT (timm blocks)
    from transport import Sampler, create_transport, path

    g = torch.Generator().manual_seed(0)
    x0, x1 = torch.randn(5, 4, 8, 8, generator=g), torch.randn(5, 4, 8, 8, generator=g)  # noise, data
    t = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0])
    for name, plan in (("linear", path.ICPlan()), ("gvp", path.GVPCPlan())):
        _, xt, ut = plan.plan(t, x0, x1)
        out[f"sit.{name}.xt"], out[f"sit.{name}.ut"] = xt, ut
        inner = torch.tensor([0.1, 0.3, 0.5, 0.7, 0.9])  # away from t = 0, where GVP's ratio is infinite
        v = torch.randn(5, 4, 8, 8, generator=g)
        out[f"sit.{name}.velocity"] = v
        out[f"sit.{name}.score"] = plan.get_score_from_velocity(v, xt, inner)
        out[f"sit.{name}.noise"] = plan.get_noise_from_velocity(v, xt, inner)
    out["sit.paths.x0"], out["sit.paths.x1"], out["sit.paths.t"] = x0, x1, t
    out["sit.linear.score_at_noise"] = path.ICPlan().get_score_from_velocity(x1, x0, torch.zeros(5))

    torch.manual_seed(0)
    model = with_signal(SiT(**TINY, learn_sigma=True), seed=1)
    out.update({f"sit.model.{k}": v.clone() for k, v in model.state_dict().items()})
    x, y = torch.randn(6, 4, 8, 8, generator=g), torch.tensor([0, 1, 2, 0, 1, 3])  # 3: the null class
    tt = torch.rand(6, generator=g)
    with torch.no_grad():
        out["sit.forward.x"], out["sit.forward.t"], out["sit.forward.y"] = x, tt, y
        out["sit.forward.out"] = model(x, tt, y)
        half = torch.cat([x[:3], x[:3]])
        out["sit.cfg.out"] = model.forward_with_cfg(
            half, tt[[0, 1, 2, 0, 1, 2]], torch.tensor([0, 1, 2, 3, 3, 3]), 2.5
        )

    transport = create_transport("Linear", "velocity")
    draws = (torch.rand(6, generator=g), torch.randn(6, 4, 8, 8, generator=g))
    transport.sample = lambda x1: (draws[0], draws[1], x1)
    data = torch.randn(6, 4, 8, 8, generator=g)
    with torch.no_grad():
        terms = transport.training_losses(model, data, dict(y=torch.tensor([0, 1, 2, 0, 1, 2])))
    out["sit.loss.t"], out["sit.loss.noise"], out["sit.loss.data"] = draws[0], draws[1], data
    out["sit.loss.values"] = terms["loss"]

    sampler, noise, labels = Sampler(transport), torch.randn(3, 4, 8, 8, generator=g), torch.tensor([0, 1, 2])
    steps = settings["ode_steps"]
    with torch.no_grad():
        out["sit.ode.noise"] = noise
        ode = sampler.sample_ode(sampling_method="euler", num_steps=steps + 1)
        out["sit.ode.x"] = ode(noise, model.forward, y=labels)[-1]
        sde = sampler.sample_sde(diffusion_form="sigma", last_step="Mean", last_step_size=0.04, num_steps=steps)
        torch.manual_seed(settings["sde_seed"])  # SiT's Euler-Maruyama draws from the CPU generator
        out["sit.sde.x"] = sde(noise, model.forward, y=labels)[-1]
    settings["sit_commit"] = commit(root)
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m in ("models", "transport") or m.startswith("transport.")]:
        del sys.modules[name]


def record_repa(root: Path, out: dict, settings: dict) -> None:
    sys.path.insert(0, str(root))
    import samplers
    from loss import SILoss
    from models.sit import SiT

    g = torch.Generator().manual_seed(10)
    torch.manual_seed(0)
    config = dict(TINY, num_classes=1000)  # the official samplers hard-code 1000 as the null class
    model = SiT(  # two encoders' projectors on block 1 of 2: the tap's index and the loss's averaging show
        **config,
        decoder_hidden_size=32,
        encoder_depth=1,
        z_dims=[16, 8],
        projector_dim=24,
        qk_norm=False,
        fused_attn=False,
    )
    model = with_signal(model, seed=2)
    out.update({f"repa.model.{k}": v.clone() for k, v in model.state_dict().items()})
    x, tt, y = torch.randn(6, 4, 8, 8, generator=g), torch.rand(6, generator=g), torch.tensor([0, 1, 2, 0, 1, 3])
    with torch.no_grad():
        velocity, zs = model(x, tt, y)
    out["repa.forward.x"], out["repa.forward.t"], out["repa.forward.y"] = x, tt, y
    out["repa.forward.out"], out["repa.forward.z0"], out["repa.forward.z1"] = velocity, zs[0], zs[1]

    data = torch.randn(6, 4, 8, 8, generator=g)
    targets = [torch.randn(6, 16, 16, generator=g), torch.randn(6, 16, 8, generator=g)]  # 16 tokens, two encoders
    out["repa.loss.targets0"], out["repa.loss.targets1"] = targets
    for weighting in ("uniform", "lognormal"):
        loss = SILoss(prediction="v", path_type="linear", weighting=weighting)
        torch.manual_seed(settings["loss_seed"])
        state = torch.get_rng_state()
        with torch.no_grad():
            denoising, projection = loss(model, data, dict(y=y), zs=targets)
        out[f"repa.loss.{weighting}.proj"] = torch.as_tensor(projection).reshape(1)
        torch.set_rng_state(state)  # replay SILoss's draws: time first, then the noise
        if weighting == "uniform":
            time_input = torch.rand((6, 1, 1, 1))
        else:
            time_input = torch.randn((6, 1, 1, 1)).exp()
            time_input = time_input / (1 + time_input)
        out[f"repa.loss.{weighting}.t"] = time_input.flatten()
        out[f"repa.loss.{weighting}.noise"] = torch.randn_like(data)
        out[f"repa.loss.{weighting}.values"] = denoising
    out["repa.loss.data"] = data

    noise, labels, steps = torch.randn(3, 4, 8, 8, generator=g), torch.tensor([0, 1, 2]), settings["ode_steps"]
    out["repa.samplers.noise"] = noise
    guided = dict(cfg_scale=2.0, guidance_low=0.0, guidance_high=0.7)  # the official samplers' null class is 1000
    with torch.no_grad():
        out["repa.euler.x"] = samplers.euler_sampler(model, noise, labels, num_steps=steps, **guided)
        everywhere = dict(
            guided, guidance_high=1.0
        )  # a Heun step's guidance is decided by its start (docs/objective.md)
        out["repa.heun.x"] = samplers.euler_sampler(model, noise, labels, num_steps=steps, heun=True, **everywhere)
        torch.manual_seed(settings["sde_seed"])  # its Euler-Maruyama draws from the CPU generator (randn_like)
        out["repa.sde.x"] = samplers.euler_maruyama_sampler(model, noise, labels, num_steps=steps, **guided)
        torch.manual_seed(settings["sde_seed"])  # the same draws again: float64 noise, one per stochastic step
        out["repa.sde.noise"] = torch.stack([torch.randn_like(noise.double()) for _ in range(steps - 1)])
    settings["repa_commit"] = commit(root)
    sys.path.remove(str(root))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sit", type=Path, required=True, help="a checkout of willisma/SiT")
    p.add_argument("--repa", type=Path, required=True, help="a checkout of sihyun-yu/REPA")
    p.add_argument("--out", type=Path, default=HERE)
    args = p.parse_args(argv)
    out: dict[str, torch.Tensor] = {}
    settings = {"tiny_model": TINY, "ode_steps": 6, "sde_seed": 7, "loss_seed": 3, "torch": torch.__version__}
    record_sit(args.sit.resolve(), out, settings)
    record_repa(args.repa.resolve(), out, settings)
    save_file({k: v.contiguous() for k, v in out.items()}, args.out / "flow_official.safetensors")
    (args.out / "flow_official.json").write_text(json.dumps(settings, indent=2) + "\n")
    print(f"recorded {len(out)} tensors in {args.out / 'flow_official.safetensors'}")


if __name__ == "__main__":
    main()
