"""``train.py`` with faults injected, for multi-process tests of the spike guard.

``MOH_DIT_TEST_FAULTS`` (JSON) says what goes wrong and what to keep:

- ``rank``, ``scale``: on that rank only, the loss of step ``s`` (0-based: the step being made) is multiplied by
  ``scale[s]`` (a number, or ``"nan"``);
- ``die_at``: rank 0 kills itself (SIGKILL, as a crash) when it starts step ``die_at``;
- after every rollback and at the end, each rank writes its model weights to ``<out>/rollback-<step>-rank<r>``
  and ``<out>/final-rank<r>`` (safetensors), so a test can check that every rank holds the same weights.

    torchrun --standalone --nproc_per_node 2 tests/helpers/faulty_train.py section.key=value ...
"""

import json
import math
import os
import signal
import sys
from pathlib import Path

from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from moh_dit.cli.train import main  # noqa: E402
from moh_dit.training.trainer import Trainer  # noqa: E402

FAULTS = json.loads(os.environ.get("MOH_DIT_TEST_FAULTS", "{}"))


def save_weights(trainer: Trainer, name: str) -> None:
    state = {k: v.detach().cpu().contiguous() for k, v in trainer.unwrapped.state_dict().items()}
    save_file(state, str(trainer.layout.root / f"{name}-rank{trainer.rank}.safetensors"))


micro_step, roll_back, run = Trainer._micro_step, Trainer.roll_back, Trainer.run


def faulty_micro_step(self, x, y, micro, want_heads):
    if self.rank == 0 and self.step == FAULTS.get("die_at") and micro == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    loss, losses, heads = micro_step(self, x, y, micro, want_heads)
    scale = FAULTS.get("scale", {}).get(str(self.step)) if self.rank == FAULTS.get("rank") else None
    if scale is not None:
        loss = loss * (math.nan if scale == "nan" else scale)
    return loss, losses, heads


def recorded_roll_back(self, why):
    roll_back(self, why)
    save_weights(self, f"rollback-{self.step + 1}")


def recorded_run(self):
    summary = run(self)
    save_weights(self, "final")
    return summary


Trainer._micro_step, Trainer.roll_back, Trainer.run = faulty_micro_step, recorded_roll_back, recorded_run

if __name__ == "__main__":
    from moh_dit.cli.common import close_process_group

    main(sys.argv[1:])
    close_process_group()
