"""Record artifacts made by moh-dit 0.4 (flow matching, before the block options existed), for the tests that hold
later versions to them (tests/test_compatibility.py): a tiny flow run (logit-normal times) stopped at step 2 with
its checkpoint, the losses of the same run trained to step 4 without a stop, its exported pipeline, the network's
outputs on fixed inputs, and samples drawn from that pipeline with three flow samplers.

Run it with moh-dit 0.4's own code first on the path (a checkout of commit 836400f):

    git worktree add /tmp/moh-dit-0.4 836400f
    PYTHONPATH=/tmp/moh-dit-0.4 python tests/reference_outputs/record_moh_dit_0_4.py --out tests/reference_outputs/moh_dit_0_4
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

# the inputs the network's outputs are recorded for: (x, t, y) from this seed, at the tiny run's 8 x 8 x 3
INPUT_SEED, BATCH = 11, 4


def fixed_inputs(config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(INPUT_SEED)
    x = torch.randn(BATCH, config.in_channels, config.sample_size, config.sample_size, generator=g)
    return x, 1000 * torch.rand(BATCH, generator=g), torch.arange(BATCH) % config.num_classes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/moh-dit-0.4-records"))
    args = p.parse_args(argv)
    import moh_dit
    from moh_dit.sampling.loading import load_pipeline
    from moh_dit.sampling.spec import SamplingSpec
    from moh_dit.training.config import load_config
    from moh_dit.training.trainer import train

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this repository's tests.helpers
    from tests.helpers.factories import make_image_folder, tiny_train_config

    shutil.rmtree(args.work, ignore_errors=True)
    make_image_folder(args.work / "images")
    common = ["train.checkpoint_every=2", "train.keep_last=3", "preview.per_class=1", "log.log_every=1"]
    common += ["objective.name=flow", "objective.time_sampling=logit-normal", "train.snr_gamma=null"]
    common += ["model.overrides.depth=2", "model.overrides.num_shared_heads=[2, 6]", "model.overrides.top_k=[2, 0]"]

    def run(folder: Path, *extra: str) -> None:
        train(load_config(tiny_train_config(folder, args.work / "images"), [*common, *extra]))

    run(args.work / "whole", "train.max_steps=4")
    run(args.work / "cut", "train.max_steps=2")
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    shutil.copytree(args.work / "cut", args.out / "cut-run", ignore=shutil.ignore_patterns("tensorboard"))
    shutil.copytree(args.work / "whole" / "pipeline", args.out / "pipeline")
    whole = [json.loads(line) for line in (args.work / "whole" / "metrics.jsonl").read_text().splitlines()]
    pipe = load_pipeline(args.out / "pipeline", device="cpu")
    x, t, y = fixed_inputs(pipe.transformer.config)
    with torch.no_grad():
        out = pipe.transformer(x, t, y).sample
    save_file({"x": x, "t": t, "y": y, "out": out.contiguous()}, args.out / "forward.safetensors")
    settings = {
        "euler": SamplingSpec("euler", 6, 2.0),
        "heun": SamplingSpec("heun", 4, 3.0, guidance_noise=(0.2, 5.0), time_shift=3.0),
        "dpm-solver": SamplingSpec("dpm-solver", 5, 3.0, guidance_interval=(100, 600), grid_averaging=100),
    }
    samples = {name: pipe.sample_grid([0, 1], 2, 7, spec)[0] for name, spec in settings.items()}
    np.savez(args.out / "samples.npz", **samples)
    loss_key = next(k for k in ("flow_loss", "diffusion_loss") if k in whole[0])  # 0.4 named every loss diffusion_loss
    (args.out / "records.json").write_text(
        json.dumps(
            {
                "made_by": moh_dit.__version__,
                "overrides": common,
                "whole_run_losses": [(r["step"], r[loss_key], r["moh_loss"]) for r in whole],
                "sampling": {name: spec.record() for name, spec in settings.items()},
            },
            indent=2,
        )
    )
    print(f"recorded moh-dit {moh_dit.__version__} artifacts in {args.out}")


if __name__ == "__main__":
    main()
