r"""The distances DMD's regression holds a generator's one-step sample ``x`` of a teacher trajectory's noise to the
trajectory's end by (``distill.regression_distance``; docs/objective.md#dmd2). One class each, one entry each in
:data:`DISTANCES`:

    mse               mean over pixels (x - end)^2. DMD's regression in this form blurs: a one-step generator cannot
                      reach every end, and the squared error's best answer is their mean.
    teacher_features  LPIPS's form (Zhang et al. 2018, arXiv:1801.03924) in the frozen teacher's own tokens: each
                      block's tokens (N, T, D) unit-normalised over the channels, the squared difference summed over the
                      channels and averaged over the tokens, the blocks averaged, every channel weighted alike (LPIPS's
                      untrained baseline). Both images are put on the linear path at flow time
                      ``regression_feature_time`` towards the trajectory's own noise, and the teacher reads them with
                      the trajectory's label. DMD (Yin et al. 2023, arXiv:2311.18828) regresses with LPIPS; Kang et
                      al. 2024 (arXiv:2405.05967) with a distance in a latent network's features (E-LatentLPIPS). Here
                      the teacher supplies the features, so nothing is trained or loaded beside it, and the distance
                      never reads the evaluation's feature network (Inception, or the study's classifier).

Each returns one value per sample and says how many passes of the frozen teacher it makes per image
(``teacher_passes``, a backward counted two), which the run's cost counts.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F

from moh_dit.argtypes import is_number
from moh_dit.errors import ConfigError
from moh_dit.model.block_tokens import tokens_after_blocks

__all__ = ["RegressionDistance", "SquaredError", "TeacherFeatures", "DISTANCES", "regression_distance"]


class RegressionDistance:
    """A distance of DMD's regression: ``distance(x, end, noise, labels, teacher, autocast)`` per sample (N,)."""

    name = ""
    teacher_passes = 0.0  # passes of the frozen teacher per image (a backward counted two)

    def __call__(
        self,
        x: torch.Tensor,
        end: torch.Tensor,
        noise: torch.Tensor,
        labels: torch.Tensor | None,
        teacher: Any,
        autocast: Callable[[], AbstractContextManager],
    ) -> torch.Tensor:
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


class SquaredError(RegressionDistance):
    """The mean squared error over pixels (DMD's regression with an L2 distance)."""

    name = "mse"

    def __call__(self, x, end, noise, labels, teacher, autocast) -> torch.Tensor:
        return ((x - end) ** 2).flatten(1).mean(dim=1)


class TeacherFeatures(RegressionDistance):
    """LPIPS's form in the frozen teacher's tokens after every block (see the module docstring).

    Args:
        time: the flow time both images are noised to (towards the trajectory's noise) before the teacher reads them;
            0: the images themselves.
    """

    name = "teacher_features"
    # the end's pass without a gradient (one forward), the sample's with its backward to x (three)
    teacher_passes = 4.0

    def __init__(self, time: float = 0.0) -> None:
        if not is_number(time) or not 0 <= time < 1:
            raise ConfigError(f"distill.regression_feature_time must be a flow time in [0, 1), got {time!r}")
        self.time = float(time)

    def _tokens(self, images, noise, labels, teacher, autocast) -> list[torch.Tensor]:
        network = teacher.model
        t = torch.full((images.shape[0],), self.time, device=images.device)
        z = (1 - self.time) * images + self.time * noise

        def run():
            with autocast():
                teacher.objective.linear_velocity(network, z, t, labels)

        blocks = range(1, len(network.blocks) + 1)
        return [F.normalize(tokens.float(), dim=-1) for tokens in tokens_after_blocks(network, blocks, run)]

    def __call__(self, x, end, noise, labels, teacher, autocast) -> torch.Tensor:
        # The end's tokens are recomputed, not cached per trajectory: a cache holds every block's tokens of every
        # trajectory (the study's 6 x 49 x 192 floats, 0.23 MB each, 0.9 GB for 4096; DiT-XL/2's 28 x 256 x 1152, 33 MB
        # each), against one forward without gradient per image, which the run's cost counts
        with torch.no_grad():
            wanted = self._tokens(end, noise, labels, teacher, autocast)
        got = self._tokens(x, noise, labels, teacher, autocast)  # the gradient to x through the frozen teacher
        per_block = [((a - b) ** 2).sum(dim=-1).mean(dim=1) for a, b in zip(got, wanted)]  # (N,) each
        return torch.stack(per_block).mean(dim=0)

    def describe(self) -> str:
        at = "" if self.time == 0 else f" at flow time {self.time:g}"
        return f"the teacher's block features{at} (LPIPS's form)"


DEFAULT = "mse"
# name -> the distance's class, and the keys it reads (beside distill.regression_distance) with the argument each sets
DISTANCES: dict[str, tuple[type[RegressionDistance], dict[str, str]]] = {
    "mse": (SquaredError, {}),
    "teacher_features": (TeacherFeatures, {"regression_feature_time": "time"}),
}


def regression_distance(
    name: str = DEFAULT, regression_feature_time: float | None = None, on: bool = True
) -> RegressionDistance:
    """The distance ``name`` with its settings (``None``: unset); ``on``: whether the regression is (its weight above
    0). An unknown name, a setting the distance does not read, a wrong value, or a distance chosen for a regression
    that is off is a :class:`ConfigError` naming the key."""
    if name not in DISTANCES:
        raise ConfigError(f"unknown distill.regression_distance {name!r}; choose one of {', '.join(DISTANCES)}")
    if not on and (name != DEFAULT or regression_feature_time is not None):
        raise ConfigError(
            "distill.regression_distance and its settings need DMD's regression on (distill.regression > 0)"
        )
    cls, reads = DISTANCES[name]
    given = {
        key: value for key, value in {"regression_feature_time": regression_feature_time}.items() if value is not None
    }
    for key in given.keys() - reads.keys():
        readers = ", ".join(n for n, (_, read) in DISTANCES.items() if key in read)
        raise ConfigError(f"distill.{key} is read by distill.regression_distance={readers} only, not {name!r}")
    return cls(**{reads[key]: value for key, value in given.items()})
