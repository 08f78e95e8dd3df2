"""What a training run reports: the loss window between two log records, ``metrics.jsonl``, experiment
trackers, and progress a user can follow in a terminal or in a scheduler's log file."""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from moh_dit.objectives.registry import LOSS_NAMES

if TYPE_CHECKING:
    from moh_dit.progress import Progress

logger = logging.getLogger("moh_dit.train")

# the scores of an evaluation record (moh_dit.training.quality) and their names in the log
EVAL_SCORE_NAMES = {
    "kid": "KID",
    "kid_std": "KID std",
    "fid": "FID",
    "sfid": "sFID",
    "inception_score": "IS",
    "precision": "precision",
    "recall": "recall",
}


def objective_loss(record: dict[str, Any]) -> tuple[str, float]:
    """``(key, value)`` of the objective's loss in a log record (``diffusion_loss``, ``flow_loss``, ...: each
    objective names its own; records of moh-dit 0.4 and earlier name every objective's ``diffusion_loss``)."""
    for key in LOSS_NAMES:
        if key in record:
            return key, record[key]
    raise KeyError(f"the record of step {record.get('step')} holds no objective loss ({', '.join(LOSS_NAMES)})")


class LossWindow:
    """Sums of the logged losses (``names``: the objective's loss and MoH's, and REPA's when it trains) since the
    last log record, per process, and the speed over the window.

    The sums are saved in every checkpoint, so that after a resume the first record averages the same steps
    as an uninterrupted run would (and not only the steps since the resume).
    """

    def __init__(
        self, device: torch.device, global_batch_size: int, names: tuple[str, ...] = ("diffusion_loss", "moh_loss")
    ) -> None:
        self.names = tuple(names)
        self.sums = torch.zeros(len(self.names) + 1, device=device)  # each loss, then the micro-steps
        self.batch = global_batch_size
        self.started, self.steps = time.time(), 0

    def add(self, *losses: torch.Tensor) -> None:
        """One micro-step's losses, in the order of ``names``."""
        ones = torch.ones((), device=self.sums.device)
        self.sums += torch.stack([*(loss.float() for loss in losses), ones])

    def record(
        self, accelerator, step: int, lr: float, samples_seen: int, head_masks=None, close: bool = True
    ) -> dict:
        """The log record of the window ending at ``step`` (losses averaged over processes, speed, per-layer
        head usage); ``close`` starts the next window."""
        means = self.means(accelerator)
        elapsed = max(time.time() - self.started, 1e-9)
        record = {
            "step": step,
            **means,
            "lr": lr,
            "steps_per_s": self.steps / elapsed,
            "images_per_s": self.steps * self.batch / elapsed,
            "samples_seen": samples_seen,
        }
        if head_masks is not None:
            record["head_usage"] = [m.float().mean(dim=(0, 1)).tolist() for m in head_masks]
        if close:
            self.reset()
        return record

    def means(self, accelerator) -> dict[str, float]:
        """Mean losses over the window and over all processes, by name."""
        total = accelerator.reduce(self.sums, reduction="sum") if accelerator.num_processes > 1 else self.sums
        count = total[-1].clamp_min(1)
        return {name: (total[i] / count).item() for i, name in enumerate(self.names)}

    def reset(self) -> None:
        self.sums.zero_()
        self.start_clock()

    def start_clock(self) -> None:
        """Measure speed from now on (after a resume, the sums carry over but the time does not)."""
        self.started, self.steps = time.time(), 0

    def state(self) -> torch.Tensor:
        return self.sums.detach().cpu().clone()

    def load(self, state: torch.Tensor | None) -> None:
        if state is not None:
            if state.shape != self.sums.shape:  # another set of losses: a window of another run's kind
                raise ValueError(
                    f"the saved loss window sums {len(state) - 1} losses, this run logs {list(self.names)}"
                )
            self.sums.copy_(state.to(self.sums.device))


def tracker_available(name: str) -> bool:
    """Whether the package behind one of accelerate's trackers is installed."""
    from accelerate import utils

    check = getattr(utils, f"is_{name}_available", None)
    return bool(check()) if check is not None else False


def flat_config(config: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config as ``section.key`` scalars (lists as text), the form trackers store hyperparameters in."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out |= flat_config(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else json.dumps(value)
    return out


def start_trackers(accelerator, names: list[str], project: str, state_file: Path, config: dict, step: int) -> dict:
    """Start accelerate's trackers with the resolved config. A resumed run continues the same tracker run:
    the wandb run id is kept in ``state_file`` (the run folder's ``trackers.json``) and reused with
    ``resume="allow"``; TensorBoard keeps its folder and drops events after the checkpoint's step
    (``purge_step``), as ``metrics.jsonl`` drops its records. Returns the tracker state."""
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    init_kwargs: dict[str, dict] = {}
    if "wandb" in names:
        run_id = state.get("wandb", {}).get("id") or uuid.uuid4().hex[:12]  # letters and digits, as wandb's own
        state["wandb"] = {"id": run_id, "project": project}
        init_kwargs["wandb"] = {
            "id": run_id,
            "resume": "allow",
            "dir": str(state_file.parent),
            "name": state_file.parent.name,
        }
    if "tensorboard" in names and step > 0:
        init_kwargs["tensorboard"] = {"purge_step": step + 1}
    accelerator.init_trackers(project, config=flat_config(config), init_kwargs=init_kwargs)
    if accelerator.is_main_process and state:
        state_file.write_text(json.dumps(state, indent=2))
    return state


class MetricsLog:
    """``metrics.jsonl`` (one JSON record per log step) plus accelerate's trackers, written by the main
    process; a resumed run first drops the records of steps after its checkpoint."""

    def __init__(self, path: Path, accelerator, use_trackers: bool) -> None:
        self.path = path
        self.accelerator = accelerator
        self.use_trackers = use_trackers
        self.logged_images: dict[str, int] = {}

    def log_image(self, tag: str, image_file: Path, step: int) -> None:
        """An image file for every tracker that takes images (TensorBoard, wandb, ...); once per tag and step
        (a final preview grid repeats the last periodic one)."""
        if not self.use_trackers or not self.accelerator.is_main_process or self.logged_images.get(tag) == step:
            return
        self.logged_images[tag] = step
        from PIL import Image

        image = np.asarray(Image.open(image_file).convert("RGB"))
        for tracker in self.accelerator.trackers:
            try:
                if tracker.name == "tensorboard":
                    tracker.log_images({tag: image[None]}, step=step, dataformats="NHWC")
                else:
                    tracker.log_images({tag: [image]}, step=step)
            except (NotImplementedError, AttributeError, TypeError) as err:
                logger.debug("tracker %s takes no images (%s)", tracker.name, err)

    def truncate_after(self, step: int) -> None:
        if not self.accelerator.is_main_process or not self.path.exists():
            return
        kept = [
            ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= step
        ]
        self.path.write_text("".join(ln + "\n" for ln in kept))

    def write_evaluation(self, record: dict[str, Any]) -> None:
        """Append an evaluation record (main process), send its scores to the trackers as ``eval/*``, log them."""
        if not self.accelerator.is_main_process:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        scores = {k: v for k, v in record.items() if k.split("@")[0] in EVAL_SCORE_NAMES}  # kid, kid@2 (2 steps)
        if self.use_trackers:
            self.accelerator.log({f"eval/{k}": v for k, v in scores.items()}, step=record["step"])

        def name(key: str) -> str:
            score, _, steps = key.partition("@")
            return EVAL_SCORE_NAMES[score] + (f" ({steps} steps)" if steps else "")

        shown = " | ".join(
            f"{name(k)} {v:.{5 if k.startswith('kid') else 4}g}" for k, v in scores.items() if "kid_std" not in k
        )
        logger.info(
            "step %d | evaluation of %d samples: %s (%.0f s)",
            record["step"],
            record["num_samples"],
            shown,
            record["seconds"],
        )

    def write(self, record: dict[str, Any], progress: Progress | None = None) -> None:
        """Append ``record`` (main process), send it to the trackers, log it, and show it on ``progress``."""
        if progress is not None:
            progress.update(
                0,
                loss=f"{objective_loss(record)[1]:.4f}",
                moh=f"{record['moh_loss']:.3f}",
                img_s=f"{record['images_per_s']:.0f}",
            )
        if not self.accelerator.is_main_process:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.use_trackers:
            scalars = {f"train/{k}": v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            for layer, usage in enumerate(record.get("head_usage", [])):
                mean = sum(usage) / len(usage)
                scalars[f"heads/layer{layer:02d}_active_fraction"] = mean
                scalars[f"heads/layer{layer:02d}_max_over_mean_load"] = max(usage) / mean if mean > 0 else 0.0
            self.accelerator.log(scalars, step=record["step"])
        hardware = ""
        if "grad_norm" in record:
            mfu = f", MFU {100 * record['mfu']:.1f}%" if "mfu" in record else ""
            hardware = (
                f" | grad norm {record['grad_norm']:.3g} | {record['tflops']:.3g} TFLOP/s{mfu}"
                f" | peak memory {record['peak_memory_gb']:.2f} GB"
            )
        repa = f" | repa loss {record['repa_loss']:.4f}" if "repa_loss" in record else ""
        name, loss = objective_loss(record)
        logger.info(
            "step %d | %s %.4f | moh loss %.4f%s | %.2f steps/s | %.1f images/s | lr %.2e%s",
            record["step"],
            name.replace("_", " "),
            loss,
            record["moh_loss"],
            repa,
            record["steps_per_s"],
            record["images_per_s"],
            record["lr"],
            hardware,
        )
