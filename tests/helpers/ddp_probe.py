"""Run a few training steps under torchrun and record, per rank, what the rank saw and what it holds.

python -m torch.distributed.run --standalone --nproc_per_node 2 tests/helpers/ddp_probe.py OUT_DIR key=value ...

Writes ``OUT_DIR/rank<r>.json`` (per micro-batch: hashes of each item and the local losses; fingerprints of the
weights and the EMA) and ``OUT_DIR/rank<r>.pt`` (the micro-batches of the first optimizer step and the gradients
that step applied).
"""

import hashlib
import json
import sys

import torch

from moh_dit.training.config import load_config
from moh_dit.training.trainer import Trainer


def item_hashes(x: torch.Tensor) -> list[str]:
    return [hashlib.sha1(item.numpy().tobytes()).hexdigest() for item in x]


class ProbeTrainer(Trainer):
    """A trainer that remembers the items of every micro-batch, its losses, the micro-batches of the first
    optimizer step and the gradients the optimizer applied then."""

    def __init__(self, config):
        super().__init__(config)
        self.seen, self.local_losses, self.first_batches, self.first_grads = [], [], [], None
        self.optimizer.optimizer.register_step_pre_hook(self._keep_first_grads)

    def _keep_first_grads(self, optimizer, args, kwargs):
        if self.first_grads is None:
            self.first_grads = {n: p.grad.clone() for n, p in self.unwrapped.named_parameters() if p.grad is not None}

    def _micro_step(self, x, y, micro, want_heads):
        self.seen.append(item_hashes(x))
        if self.first_grads is None:
            self.first_batches.append((x.clone(), y.clone()))
        result = super()._micro_step(x, y, micro, want_heads)
        self.local_losses.append([loss.item() for loss in result[1][:2]])  # the objective's and MoH's
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
    torch.save({"batches": trainer.first_batches, "grads": trainer.first_grads}, f"{out_dir}/rank{trainer.rank}.pt")


if __name__ == "__main__":
    from moh_dit.cli.common import close_process_group

    main()
    close_process_group()
