"""The distillation diagnosis's ``discriminator`` part (experiments/distill_diagnosis.py): can a DMD2 run's
discriminator tell the training split's real images from its generator's, and where? Its logged loss, averaged over
the VSD loss's times, can sit at chance while the head separates well at low noise; this part scores the head of the
run's last checkpoint at fixed noise times (the area under the ROC curve of its logits: 0.5 is chance), then trains
it on that task alone from the checkpoint, at the run's own rate and above, to say whether it could learn faster
than the run let it. It reads the training split only, as the run's discriminator does (never the test split the
study scores against)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from experiments.arms import run_config

__all__ = ["PROBE_TIMES", "PROBES", "part_discriminator", "roc_area"]

PROBE_TIMES = (0.1, 0.3, 0.5, 0.7, 0.9)  # flow times (the noise's share) at which the head is scored
# what trains alone from the checkpoint, at what rate relative to the run's discriminator's (1: the run's own)
PROBES = (("head", 1.0), ("head", 10.0), ("fake score and head", 1.0))


def roc_area(real: torch.Tensor, fake: torch.Tensor) -> float:
    """The area under the ROC curve of logits that should rank ``real`` above ``fake`` (Mann-Whitney, ties half)."""
    above = (real[:, None] > fake[None, :]).float().mean()
    ties = (real[:, None] == fake[None, :]).float().mean()
    return float(above + 0.5 * ties)


def part_discriminator(result: dict, run: Path, count: int = 500, steps: int = 400, seed: int = 0) -> None:
    """The head of ``run``'s last checkpoint scored on ``count`` real and ``count`` generated images (one step of the
    run's exported generator, class-balanced: its EMA weights, where the run's discriminator saw the raw generator's
    samples at both of its steps) noised at each of :data:`PROBE_TIMES`, then trained alone for ``steps`` steps at
    the run's batch and times (``distill.gan_time``, else the VSD loss's; each of :data:`PROBES`, from the checkpoint,
    on other images than those scored) and scored again; the mean loss of each probe's first and last fifth beside
    chance (2 ln 2)."""
    from safetensors.torch import load_file

    from moh_dit.data.training_data import load_data_space
    from moh_dit.objectives.distill import gan_discriminator_loss
    from moh_dit.run_folder import RunLayout, checkpoint_step
    from moh_dit.sampling.loading import load_pipeline
    from moh_dit.training.distill import FakeScore, Teacher

    config = run_config(run)
    section = config.distill
    if config.objective.name != "distill" or section.method != "dmd2" or not section.gan_weight:
        raise SystemExit(f"{run} trained no discriminator (a dmd2 run with distill.gan_weight > 0): nothing to probe")
    latest = RunLayout(run).latest_checkpoint()
    state = None if latest is None else Path(latest) / "companions" / "fake_score.safetensors"
    if state is None or not state.is_file():
        raise SystemExit(f"{run} has no checkpoint with its fake score ({state}): nothing to probe")
    data = load_data_space(config.data)
    teacher = Teacher.load(section, data, torch.device("cpu"), None)

    def checkpointed() -> FakeScore:
        fake = FakeScore(teacher.model, True, section.gan_block)
        fake.load_state_dict(load_file(str(state)))
        return fake

    g = torch.Generator().manual_seed(seed)
    n = 2 * count + steps * config.train.global_batch_size  # scored, then trained on, never both
    picked = torch.randperm(len(data.dataset), generator=g)[: min(n, len(data.dataset))]
    real = torch.stack([torch.as_tensor(data.dataset[int(i)][0]) for i in picked]).float()
    real_y = torch.tensor([int(data.dataset[int(i)][1]) for i in picked])
    pipe = load_pipeline(run / "pipeline", device="cpu", scheduler="meanflow", log=False)  # as the study samples it
    gen_y = torch.arange(len(picked)) % data.num_classes
    with torch.no_grad():
        gen = pipe(class_labels=gen_y.tolist(), num_inference_steps=1, guidance_scale=1.0, output_type="pt",
                   generator=torch.Generator().manual_seed(seed + 1), progress=False).images.float()  # fmt: skip
    plain = contextlib.nullcontext

    def noised(x: torch.Tensor, t: torch.Tensor, gen_: torch.Generator) -> torch.Tensor:
        shape = (-1, *([1] * (x.ndim - 1)))
        return (1 - t).reshape(shape) * x + t.reshape(shape) * torch.randn(x.shape, generator=gen_)

    def scored(fake: FakeScore) -> dict[str, float]:
        fake.eval()
        draws, areas = torch.Generator().manual_seed(seed + 2), {}
        with torch.no_grad():
            for time in PROBE_TIMES:
                t = torch.full((count,), time)
                logits = [fake.discriminate(noised(x[:count], t, draws), t, y[:count], None, plain).squeeze(1)
                          for x, y in ((real, real_y), (gen, gen_y))]  # fmt: skip
                areas[f"{time:g}"] = roc_area(*logits)
        return areas

    low, high = (float(v) for v in section.gan_time or section.dmd_time)  # the times the run's discriminator read
    batch, rate = config.train.global_batch_size, section.fake_lr or config.optim.lr
    probes = {"checkpoint": {"area": scored(checkpointed())}}
    for trained, factor in PROBES:
        fake = checkpointed().train()
        fake.score.requires_grad_(trained != "head")  # a head alone: no gradient through the backbone's weights
        params = fake.head.parameters() if trained == "head" else fake.parameters()
        optimizer = torch.optim.AdamW(params, lr=rate * factor, betas=tuple(config.optim.betas), weight_decay=0.0)
        draws, losses = torch.Generator().manual_seed(seed + 3), []
        for _ in range(steps):
            pick = 2 * count + torch.randint(len(picked) - 2 * count, (batch,), generator=draws)
            t_real, t_gen = (low + (high - low) * torch.rand(batch, generator=draws) for _ in range(2))
            loss = gan_discriminator_loss(
                fake.discriminate(noised(real[pick], t_real, draws), t_real, real_y[pick], None, plain),
                fake.discriminate(noised(gen[pick], t_gen, draws), t_gen, gen_y[pick], None, plain),
            ).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        fifth = max(1, steps // 5)
        probes[f"{trained}, {factor:g}x the rate"] = {
            "area": scored(fake),
            "loss": {"first fifth": sum(losses[:fifth]) / fifth, "last fifth": sum(losses[-fifth:]) / fifth},
        }
    result["discriminator"] = {"run": str(run), "step": checkpoint_step(Path(latest)), "count": count,
                               "steps": steps, "rate": rate, "probes": probes}  # fmt: skip
