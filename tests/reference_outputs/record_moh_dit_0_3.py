"""Record artifacts made by moh-dit 0.3 (before objectives existed), for the tests that hold later versions to them
(tests/test_compatibility.py): a tiny run stopped at step 2 with its checkpoint, the losses and final EMA of the
same run trained to step 4 without a stop, its exported pipeline, and samples drawn from that pipeline.

Run it with moh-dit 0.3's own code first on the path (a checkout of tag v0.3 / commit 6009ad1):

    git worktree add /tmp/moh-dit-0.3 6009ad1
    PYTHONPATH=/tmp/moh-dit-0.3 python tests/reference_outputs/record_moh_dit_0_3.py --out tests/reference_outputs/moh_dit_0_3
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/moh-dit-0.3-records"))
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
    samples = {}
    pipe = load_pipeline(args.out / "pipeline", device="cpu")
    settings = {
        "ddpm": SamplingSpec("ddpm", 10, 2.0),
        "dpm-solver": SamplingSpec("dpm-solver", 5, 3.0, guidance_interval=(100, 600), grid_averaging=100),
    }
    for name, spec in settings.items():
        images, _ = pipe.sample_grid([0, 1], 2, 7, spec)
        samples[name] = images
    np.savez(args.out / "samples.npz", **samples)
    (args.out / "records.json").write_text(
        json.dumps(
            {
                "made_by": moh_dit.__version__,
                "overrides": common,
                "whole_run_losses": [(r["step"], r["diffusion_loss"], r["moh_loss"]) for r in whole],
                "sampling": {name: spec.record() for name, spec in settings.items()},
            },
            indent=2,
        )
    )
    print(f"recorded moh-dit {moh_dit.__version__} artifacts in {args.out}")


if __name__ == "__main__":
    main()
