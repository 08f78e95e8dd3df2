"""One log to follow on any number of processes: a warning about the run once, from the main process; a process's
own problem from that process, marked with its rank."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import logging
from moh_dit.logs import PER_RANK, setup_logging
setup_logging(with_time=False)
log = logging.getLogger("moh_dit.train")
log.info("training")
log.warning("resuming with changed settings: optim.lr")
log.warning("skipping unreadable image a.png", extra=PER_RANK)
log.error("failed")
"""


def _log_of(rank: int, world: int) -> list[str]:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return done.stderr.splitlines()


def test_the_main_process_logs_everything_once_and_the_others_only_their_own_problems():
    assert _log_of(0, 2) == [
        "[rank 0] INFO moh_dit.train: training",
        "[rank 0] WARNING moh_dit.train: resuming with changed settings: optim.lr",
        "[rank 0] WARNING moh_dit.train: skipping unreadable image a.png",
        "[rank 0] ERROR moh_dit.train: failed",
    ]
    assert _log_of(1, 2) == [
        "[rank 1] WARNING moh_dit.train: skipping unreadable image a.png",
        "[rank 1] ERROR moh_dit.train: failed",
    ]
    assert _log_of(0, 1)[1] == "WARNING moh_dit.train: resuming with changed settings: optim.lr"


def test_counts_read_as_sentences():
    from moh_dit.logs import plural
    from moh_dit.sampling.generation import describe_samples

    assert (plural(1, "step"), plural(25, "step"), plural(0, "step")) == ("1 step", "25 steps", "0 steps")
    one = {"identity": {"scheduler": {"name": "MeanFlowScheduler"}, "num_inference_steps": 1, "guidance_scale": 1.0}}
    assert "MeanFlowScheduler 1 step," in describe_samples(one | {"count": 8})
