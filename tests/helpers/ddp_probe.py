"""Run a few training steps under torchrun and record, per rank, what the rank saw and what it holds.

python -m torch.distributed.run --standalone --nproc_per_node 2 tests/helpers/ddp_probe.py OUT_DIR key=value ...
"""

import hashlib
import json
import sys

import torch

from moh_dit.config import load_config
from moh_dit.training import Trainer


class ProbeTrainer(Trainer):
    def __init__(self, config):
        super().__init__(config)
        self.seen, self.local_losses = [], []

    def _micro_step(self, x, y, micro, want_heads):
        self.seen.append(hashlib.sha1(x.numpy().tobytes()).hexdigest())
        result = super()._micro_step(x, y, micro, want_heads)
        self.local_losses.append([result[1].item(), result[2].item()])
        return result


def main() -> None:
    out_dir, overrides = sys.argv[1], sys.argv[2:]
    trainer = ProbeTrainer(load_config(None, overrides))
    trainer.run()
    weights = torch.cat([p.detach().double().flatten() for p in trainer.unwrapped.parameters()])
    record = {
        "rank": trainer.rank,
        "world": trainer.world,
        "seen": trainer.seen,
        "local_losses": trainer.local_losses,
        "weights_sha": hashlib.sha1(weights.numpy().tobytes()).hexdigest(),
        "ema_sha": hashlib.sha1(
            torch.cat([p.double().flatten() for p in trainer.ema.shadow_params]).numpy().tobytes()
        ).hexdigest(),
    }
    with open(f"{out_dir}/rank{trainer.rank}.json", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
