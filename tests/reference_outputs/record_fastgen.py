"""Record what NVlabs/FastGen's MeanFlow distillation computes on tiny fixed inputs, for the parity tests of moh-dit's
distill objective (tests/objectives/distill/test_meanflow.py). FastGen's code is read from a checkout given on the command line
and never copied here; only its outputs are kept (``fastgen_official.safetensors``, settings in
``fastgen_official.json``).

    git clone https://github.com/NVlabs/FastGen /tmp/FastGen        # (commit 34f30e8 was recorded)
    pip install --target /tmp/fgdeps attrs ftfy einops imageio omegaconf loguru   # what its utilities import
    python tests/reference_outputs/record_fastgen.py --fastgen /tmp/FastGen --deps /tmp/fgdeps

FastGen's ``MeanFlowModel`` methods are called unbound on a stand-in ``self`` holding its config values, its
rectified-flow noise schedule (``RFNoiseSchedule``: t in [0, 0.999]) and the networks: the small smooth networks of
``tests/helpers/toy_velocity.py`` (a teacher's velocity, a student's average velocity), whose weights are seeded.
What is recorded:
- ``_get_velocity`` with ``use_cd`` and teacher CFG (scale 3 on flow times 0.3-0.8): the teacher's guided velocity;
- ``_estimate_jvp_finite_difference`` (eps 1e-4) at six (t, r): central, forward (t - eps reaches r; r = t), backward
  (t + eps passes 0.999) and neither;
- ``_mf_pred_to_loss`` (``l2``, ``poly_1.0``, c = 0.01): the per-sample loss, its weight and tangent;
- ``_mf_pred_to_loss`` in the settings of :data:`LOSS_CASES` (``opt_grad`` with and without its spatial invariance,
  the tangent warm-up part-way, other norm constants and powers): loss, weight, tangent and the gradient of the summed
  loss in the student's output.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# name -> FastGen's loss settings and the training iteration (the warm-up's clock)
LOSS_CASES = {
    "opt_grad": dict(loss_type="opt_grad", norm_method="poly_1.0", norm_const=0.1, spatial=False, warmup=0, it=0),
    "opt_grad_spatial": dict(loss_type="opt_grad", norm_method="poly_1.0", norm_const=10.0, spatial=True, warmup=0, it=0),
    "opt_grad_warmup": dict(loss_type="opt_grad", norm_method="poly_1.0", norm_const=10.0, spatial=True, warmup=2000, it=500),
    "opt_grad_poly": dict(loss_type="opt_grad", norm_method="poly_0.75", norm_const=1e-3, spatial=False, warmup=0, it=0),
    "l2_warmup": dict(loss_type="l2", norm_method="poly_1.0", norm_const=0.01, spatial=False, warmup=100, it=30),
}  # fmt: skip


def commit(repo: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def fastgen(root: Path, deps: Path | None):
    """FastGen's ``MeanFlowModel`` and ``RFNoiseSchedule``, without importing every method it ships (its package
    ``__init__`` imports them all): the ``fastgen.methods`` package is stood in for by an empty one."""
    sys.path.insert(0, str(root))
    if deps is not None:
        sys.path.append(str(deps))
    package = types.ModuleType("fastgen.methods")
    package.__path__ = [str(root / "fastgen" / "methods")]
    package.CMModel = object
    sys.modules["fastgen.methods"] = package
    from fastgen.methods.consistency_model.mean_flow import MeanFlowModel
    from fastgen.networks.noise_schedule import RFNoiseSchedule

    return MeanFlowModel, RFNoiseSchedule


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fastgen", type=Path, required=True, help="a checkout of NVlabs/FastGen")
    p.add_argument("--deps", type=Path, default=None, help="a folder of the packages its utilities import")
    p.add_argument("--out", type=Path, default=HERE)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.helpers.toy_velocity import CLASSES, ToyAverageVelocity, ToyTeacher

    MeanFlowModel, RFNoiseSchedule = fastgen(args.fastgen.resolve(), args.deps)
    settings = dict(
        guidance_scale=3.0, guidance_t_start=0.3, guidance_t_end=0.8, eps=1e-4, norm_const=0.01, norm_method="poly_1.0",
        fastgen_commit=commit(args.fastgen), torch=torch.__version__,
    )  # fmt: skip
    student, teacher = ToyAverageVelocity(seed=0), ToyTeacher(seed=1)
    g = torch.Generator().manual_seed(0)
    x, noise = torch.randn(6, 2, 4, 4, generator=g), torch.randn(6, 2, 4, 4, generator=g)
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    # central, forward (t - eps reaches r), backward (t + eps passes 0.999), r = t (forward), neither, central
    t = torch.tensor([0.5, 0.6, 0.99895, 0.7, 0.99895, 0.35])
    r = torch.tensor([0.2, 0.59995, 0.3, 0.7, 0.99893, 0.0])
    schedule = RFNoiseSchedule()
    me = SimpleNamespace(
        config=SimpleNamespace(
            guidance_scale=settings["guidance_scale"],
            guidance_t_start=settings["guidance_t_start"],
            guidance_t_end=settings["guidance_t_end"],
            loss_config=SimpleNamespace(jvp_finite_diff_eps=settings["eps"]),
        ),
        loss_config=SimpleNamespace(
            use_cd=True,
            norm_method=settings["norm_method"],
            norm_const=settings["norm_const"],
            tangent_warmup_steps=0,
            loss_type="l2",
        ),  # fmt: skip
        net=SimpleNamespace(noise_scheduler=schedule),
        teacher=lambda x_t, t, condition=None, fwd_pred_type=None: teacher(x_t, t, condition),
        device=torch.device("cpu"),
    )
    me._compute_weight = lambda tensor: MeanFlowModel._compute_weight(me, tensor)
    out = {"x": x, "noise": noise, "labels": labels, "t": t, "r": r}
    out |= {f"student.{k}": v.detach().clone() for k, v in student.state_dict().items()}
    out |= {f"teacher.{k}": v.detach().clone() for k, v in teacher.state_dict().items()}
    with torch.no_grad():
        x_t = schedule.forward_process(x, noise, t)
        _, velocity = MeanFlowModel._get_velocity(
            me, x, noise, t, condition=labels, neg_condition=torch.full_like(labels, CLASSES)
        )

    def net_wrapper(z, t, r):
        return student(z, (t, t - r), labels).sample

    with torch.no_grad():
        fd = MeanFlowModel._estimate_jvp_finite_difference(me, net_wrapper, x_t, t, r, velocity)
    u = student(x_t, (t, t - r), labels).sample
    loss, tangent, weight, _ = MeanFlowModel._mf_pred_to_loss(
        me, u_theta=u, u_theta_jvp=fd.float(), x_t=x_t, dxt_dt=velocity, t=t, r=r, iteration=0
    )
    out |= {"x_t": x_t, "velocity": velocity, "fd": fd, "u": u.detach(), "loss": loss.detach()}
    out |= {"weight": weight.detach(), "tangent": tangent.detach()}
    for case, given in LOSS_CASES.items():
        me.loss_config = SimpleNamespace(
            use_cd=True, norm_method=given["norm_method"], norm_const=given["norm_const"],
            tangent_warmup_steps=given["warmup"], loss_type=given["loss_type"],
            tangent_spatial_invariance=given["spatial"],
        )  # fmt: skip
        u_case = u.detach().clone().requires_grad_(True)
        loss, tangent, weight, warm = MeanFlowModel._mf_pred_to_loss(
            me, u_theta=u_case, u_theta_jvp=fd.float(), x_t=x_t, dxt_dt=velocity, t=t, r=r, iteration=given["it"]
        )
        loss.sum().backward()
        out |= {f"{case}.loss": loss.detach(), f"{case}.tangent": tangent.detach(), f"{case}.weight": weight.detach()}
        out |= {f"{case}.grad": u_case.grad.detach().clone(), f"{case}.warm": torch.tensor(float(warm))}
    settings["loss_cases"] = LOSS_CASES
    save_file({k: v.contiguous() for k, v in out.items()}, args.out / "fastgen_official.safetensors")
    (args.out / "fastgen_official.json").write_text(json.dumps(settings, indent=2) + "\n")
    print(f"recorded {len(out)} tensors in {args.out / 'fastgen_official.safetensors'}")


if __name__ == "__main__":
    main()
